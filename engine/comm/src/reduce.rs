//! Element-wise reductions in rank order, the arithmetic every backend must reproduce.
//!
//! `out[i] = ((x_0[i] + x_1[i]) + x_2[i]) + ...` in the accumulation dtype (f32 for f32, bf16 and
//! f16; f64 for f64), then for `Avg` one division by the number of contributions, then one
//! rounding to the element dtype. Every input is streamed once and the output written once, in
//! one fused pass: each step folds the next 32 elements of every input in registers and writes
//! the 32 results, so all input streams advance together; the loops are monomorphised per
//! dtype and operation so they vectorise (and compiled twice on x86-64, for the baseline and
//! for AVX2, chosen at run time).

use crate::buf::{Buf, BufMut, Element};
use crate::error::{CommError, OpKind};
use crate::topology::{Group, ReduceOp};
use half::{bf16, f16};
use std::ops::{Add, Div};

/// A length unit for tests of the reduction kernels, in elements: 4096 (16 KiB of f32), a
/// multiple of the fused kernel's 32-element chunk, so `3 * BLOCK + 5` elements run many whole
/// chunks and a tail (the conformance suite's large size).
pub const BLOCK: usize = 4096;

/// An accumulation type: f32 or f64.
pub(crate) trait Acc:
    Copy + Default + Add<Output = Self> + Div<Output = Self> + PartialOrd
{
    fn from_count(n: usize) -> Self;
    fn is_nan(self) -> bool;
}
impl Acc for f32 {
    fn from_count(n: usize) -> Self {
        n as f32
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
}
impl Acc for f64 {
    fn from_count(n: usize) -> Self {
        n as f64
    }
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
}

/// An element type with its accumulation type.
pub(crate) trait Reducible: Element {
    type A: Acc;
    fn to_acc(self) -> Self::A;
    fn from_acc(a: Self::A) -> Self;
}
impl Reducible for f32 {
    type A = f32;
    #[inline(always)]
    fn to_acc(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_acc(a: f32) -> f32 {
        a
    }
}
impl Reducible for f64 {
    type A = f64;
    #[inline(always)]
    fn to_acc(self) -> f64 {
        self
    }
    #[inline(always)]
    fn from_acc(a: f64) -> f64 {
        a
    }
}
impl Reducible for bf16 {
    type A = f32;
    #[inline(always)]
    fn to_acc(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn from_acc(a: f32) -> bf16 {
        bf16::from_f32(a)
    }
}
impl Reducible for f16 {
    type A = f32;
    #[inline(always)]
    fn to_acc(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn from_acc(a: f32) -> f16 {
        f16::from_f32(a)
    }
}

/// How one contribution folds into the accumulator: `Sum`/`Avg` add, `Max` keeps the larger
/// value or a NaN. Zero-sized so every loop below is monomorphised and vectorised per operation.
trait Fold<A: Acc> {
    fn fold(a: A, x: A) -> A;
}
struct AddFold;
impl<A: Acc> Fold<A> for AddFold {
    #[inline(always)]
    fn fold(a: A, x: A) -> A {
        a + x
    }
}
struct MaxFold;
impl<A: Acc> Fold<A> for MaxFold {
    #[inline(always)]
    fn fold(a: A, x: A) -> A {
        if x > a || x.is_nan() {
            x
        } else {
            a
        }
    }
}

/// Reduces `inputs.len()` runs of `n` elements into `out`, in input order.
///
/// # Safety
/// Every `inputs[j]` must be valid for reads of `n` elements and `out` valid for writes of `n`
/// elements for the duration of the call; nobody else may write those ranges meanwhile. `out`
/// may be equal to one of the inputs (each chunk is read from every input before it is
/// written); any other overlap is not allowed.
/// With `stream`, `out` is written with non-temporal stores (for outputs that will not stay
/// in cache; ignored when `out` aliases an input).
pub(crate) unsafe fn reduce_raw<T: Reducible>(
    inputs: &[*const T],
    out: *mut T,
    n: usize,
    op: ReduceOp,
    stream: bool,
) {
    debug_assert!(!inputs.is_empty());
    match op {
        ReduceOp::Sum => reduce_fold::<T, AddFold, false>(inputs, out, n, stream),
        ReduceOp::Avg => reduce_fold::<T, AddFold, true>(inputs, out, n, stream),
        ReduceOp::Max => reduce_fold::<T, MaxFold, false>(inputs, out, n, stream),
    }
}

/// True when the `n`-element runs at `a` and `b` share an element.
fn overlaps<T>(a: *const T, b: *const T, n: usize) -> bool {
    let bytes = n * std::mem::size_of::<T>();
    let (a, b) = (a as usize, b as usize);
    bytes > 0 && a < b + bytes && b < a + bytes
}

/// Elements per step of the fused kernel: every input's next `CHUNK` elements fold in registers
/// (32 x f32 = four 256-bit vectors, two cache lines) before the `CHUNK` results are written.
const CHUNK: usize = 32;

/// The rank-order reduction `out = fin(fold(...fold(fold(x_0, x_1), x_2)..., x_{k-1}))` for
/// one operation, where `fin` divides by `k` once when `AVG` and rounds to `T` once.
///
/// One fused pass: for each run of [`CHUNK`] elements, all `k` inputs are read and folded in
/// registers in rank order and the results written, so the `k` input streams and the output
/// stream advance together and the memory system always has reads in flight (a memory-bound
/// kernel is as fast as the misses it keeps outstanding). Each input is read once and `out`
/// written once. With `stream` (and `out` not aliasing an input, and aligned to its element
/// size) `out` is written with non-temporal stores from its first 64-byte line on (ordinary
/// stores for the elements before it and the tail), followed by one `sfence`. When `out`
/// aliases an input (the thread backend's in-place all-reduce), every chunk is read from all
/// inputs before it is written. On x86-64 with AVX2 (detected at run time) the same code is
/// compiled for 256-bit vectors. The operations on one element are exactly the sequential
/// definition, so every path gives the same bits.
///
/// # Safety
/// As [`reduce_raw`].
#[inline(always)]
unsafe fn reduce_fold<T: Reducible, F: Fold<T::A>, const AVG: bool>(
    inputs: &[*const T],
    out: *mut T,
    n: usize,
    stream: bool,
) {
    let aliased = inputs.iter().any(|&p| overlaps(p, out, n));
    debug_assert!(
        inputs
            .iter()
            .all(|&p| std::ptr::eq(p, out) || !overlaps(p, out, n)),
        "`out` may only alias an input exactly"
    );
    let stream = stream && !aliased && (out as usize).is_multiple_of(std::mem::align_of::<T>());
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        return reduce_fused_avx2::<T, F, AVG>(inputs, out, n, stream);
    }
    reduce_fused::<T, F, AVG, false>(inputs, out, n, stream)
}

/// [`reduce_fused`] compiled for AVX2.
///
/// # Safety
/// As [`reduce_raw`]; the CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn reduce_fused_avx2<T: Reducible, F: Fold<T::A>, const AVG: bool>(
    inputs: &[*const T],
    out: *mut T,
    n: usize,
    stream: bool,
) {
    reduce_fused::<T, F, AVG, true>(inputs, out, n, stream)
}

/// The body of [`reduce_fold`]; `AVX2`: compiled inside an AVX2 function (256-bit streaming
/// stores).
///
/// # Safety
/// As [`reduce_raw`]; `out` does not alias an input when `stream`.
#[inline(always)]
unsafe fn reduce_fused<T: Reducible, F: Fold<T::A>, const AVG: bool, const AVX2: bool>(
    inputs: &[*const T],
    out: *mut T,
    n: usize,
    stream: bool,
) {
    let k = inputs.len();
    let count = T::A::from_count(k);
    let fin = |a: T::A| {
        if AVG {
            T::from_acc(a / count)
        } else {
            T::from_acc(a)
        }
    };
    // One element in rank order (heads and tails).
    let one = |i: usize| {
        let mut a = (*inputs[0].add(i)).to_acc();
        for &p in &inputs[1..] {
            a = F::fold(a, (*p.add(i)).to_acc());
        }
        *out.add(i) = fin(a);
    };
    let size = std::mem::size_of::<T>();
    // Streaming starts at the first 64-byte line of `out` (non-temporal stores need aligned
    // destinations); the elements before it are written normally.
    let head = if stream {
        (out.align_offset(64)).min(n)
    } else {
        0
    };
    for i in 0..head {
        one(i);
    }
    let mut i = head;
    let mut acc = [T::A::default(); CHUNK];
    let mut staged = [T::from_acc(T::A::default()); CHUNK];
    while i + CHUNK <= n {
        // Every input's chunk is read (into `acc`) before `out`'s chunk is written, so an
        // `out` equal to an input is fine; no reference into the buffers outlives its loop.
        let x0 = inputs[0].add(i);
        if k == 1 {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = (*x0.add(j)).to_acc();
            }
        } else {
            let x1 = inputs[1].add(i);
            for (j, a) in acc.iter_mut().enumerate() {
                *a = F::fold((*x0.add(j)).to_acc(), (*x1.add(j)).to_acc());
            }
            for &p in &inputs[2..] {
                let x = p.add(i);
                for (j, a) in acc.iter_mut().enumerate() {
                    *a = F::fold(*a, (*x.add(j)).to_acc());
                }
            }
        }
        if stream {
            for (o, &a) in staged.iter_mut().zip(&acc) {
                *o = fin(a);
            }
            crate::thread::stream::store_lines::<AVX2>(
                staged.as_ptr() as *const u8,
                out.add(i) as *mut u8,
                CHUNK * size,
            );
        } else {
            for (j, &a) in acc.iter().enumerate() {
                *out.add(j + i) = fin(a);
            }
        }
        i += CHUNK;
    }
    for i in i..n {
        one(i);
    }
    if stream {
        crate::thread::stream::fence();
    }
}

/// The reference reduction: `out = op(inputs[0], inputs[1], ...)` element-wise in input (rank)
/// order, accumulating 16-bit dtypes in f32, `Avg` dividing once by `inputs.len()`.
///
/// Every input and `out` must have the same dtype and length. Backends that receive the
/// contributions of a group (MPI, a TCP transport) call this to reproduce the thread backend
/// bit for bit.
///
/// Errors: [`CommError::DTypeMismatch`] or [`CommError::SizeMismatch`] (reported for rank 0 of
/// the world group, op `all_reduce`) naming the offending input; an empty `inputs` is a size
/// error too.
pub fn reduce_in_rank_order(
    inputs: &[Buf<'_>],
    op: ReduceOp,
    out: BufMut<'_>,
) -> Result<(), CommError> {
    let n = out.len();
    let size_err = |expected, got| CommError::SizeMismatch {
        rank: 0,
        op: OpKind::AllReduce,
        group: Group::World,
        group_size: inputs.len(),
        what: "input",
        expected,
        got,
    };
    if inputs.is_empty() {
        return Err(size_err(1, 0));
    }
    for b in inputs {
        if b.dtype() != out.dtype() {
            return Err(CommError::DTypeMismatch {
                rank: 0,
                op: OpKind::AllReduce,
                send: b.dtype(),
                recv: out.dtype(),
            });
        }
        if b.len() != n {
            return Err(size_err(n, b.len()));
        }
    }
    let ptrs: Vec<*const u8> = inputs.iter().map(|b| b.as_ptr()).collect();
    let mut out = out;
    let o = out.as_mut_ptr();
    // SAFETY: every pointer covers `n` elements of the checked dtype; `out` is exclusively
    // borrowed and cannot alias a shared input.
    unsafe { reduce_dyn(out.dtype(), &ptrs, o, n, op) };
    Ok(())
}

/// Dtype-dispatching wrapper over [`reduce_raw`] on byte pointers (ordinary stores).
///
/// # Safety
/// As [`reduce_raw`], with the pointers addressing elements of `dtype`.
pub(crate) unsafe fn reduce_dyn(
    dtype: fsdp_types::DType,
    inputs: &[*const u8],
    out: *mut u8,
    n: usize,
    op: ReduceOp,
) {
    reduce_dyn_streaming(dtype, inputs, out, n, op, false)
}

/// [`reduce_dyn`] that writes `out` with non-temporal stores when `stream` (see
/// [`reduce_raw`]).
///
/// # Safety
/// As [`reduce_raw`], with the pointers addressing elements of `dtype`.
pub(crate) unsafe fn reduce_dyn_streaming(
    dtype: fsdp_types::DType,
    inputs: &[*const u8],
    out: *mut u8,
    n: usize,
    op: ReduceOp,
    stream: bool,
) {
    use fsdp_types::DType;
    macro_rules! go {
        ($t:ty) => {{
            let ins: Vec<*const $t> = inputs.iter().map(|&p| p as *const $t).collect();
            reduce_raw::<$t>(&ins, out as *mut $t, n, op, stream)
        }};
    }
    match dtype {
        DType::F32 => go!(f32),
        DType::BF16 => go!(bf16),
        DType::F16 => go!(f16),
        DType::F64 => go!(f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_is_sequential_in_rank_order() {
        // 1e8 + 1 - 1e8 in f32: ((1e8 + 1) + -1e8) = 0 exactly, while 1 + (1e8 - 1e8) = 1.
        let a = vec![1.0e8f32; 5000];
        let b = vec![1.0f32; 5000];
        let c = vec![-1.0e8f32; 5000];
        let mut out = vec![7.0f32; 5000];
        reduce_in_rank_order(
            &[(&a).into(), (&b).into(), (&c).into()],
            ReduceOp::Sum,
            (&mut out).into(),
        )
        .unwrap();
        assert!(out.iter().all(|&x| x == 0.0));
        reduce_in_rank_order(
            &[(&b).into(), (&a).into(), (&c).into()],
            ReduceOp::Sum,
            (&mut out).into(),
        )
        .unwrap();
        assert!(out.iter().all(|&x| x == 0.0 || x == 1.0));
        assert_eq!(out[4999], (1.0f32 + 1.0e8) - 1.0e8);
    }

    /// The plain, aliased and streaming paths of the kernel give the same bits as a scalar
    /// rank-order loop, for 1..=5 inputs, every operation, f32 and bf16, lengths around
    /// [`BLOCK`].
    #[test]
    fn every_kernel_path_equals_the_scalar_rank_order_loop() {
        let v = |j: usize, i: usize| {
            let h = (j as u32 + 1).wrapping_mul(2_654_435_761) ^ (i as u32).wrapping_mul(40_503);
            ((h % 2001) as f32 - 1000.0) * [1e-3f32, 1.0, 1e5][(h >> 12) as usize % 3]
        };
        for k in 1..=5usize {
            for n in [0usize, 1, 7, BLOCK - 1, BLOCK, 2 * BLOCK + 3] {
                let ins: Vec<Vec<f32>> =
                    (0..k).map(|j| (0..n).map(|i| v(j, i)).collect()).collect();
                let ins16: Vec<Vec<bf16>> = ins
                    .iter()
                    .map(|x| x.iter().map(|&y| bf16::from_f32(y)).collect())
                    .collect();
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                    let want: Vec<f32> = (0..n)
                        .map(|i| {
                            let mut a = ins[0][i];
                            for x in &ins[1..] {
                                a = match op {
                                    ReduceOp::Max => {
                                        if x[i] > a || x[i].is_nan() {
                                            x[i]
                                        } else {
                                            a
                                        }
                                    }
                                    _ => a + x[i],
                                };
                            }
                            if op == ReduceOp::Avg {
                                a / k as f32
                            } else {
                                a
                            }
                        })
                        .collect();
                    let want16: Vec<bf16> = (0..n)
                        .map(|i| {
                            let mut a = ins16[0][i].to_f32();
                            for x in &ins16[1..] {
                                let y = x[i].to_f32();
                                a = match op {
                                    ReduceOp::Max => {
                                        if y > a || y.is_nan() {
                                            y
                                        } else {
                                            a
                                        }
                                    }
                                    _ => a + y,
                                };
                            }
                            bf16::from_f32(if op == ReduceOp::Avg { a / k as f32 } else { a })
                        })
                        .collect();
                    for stream in [false, true] {
                        let ptrs: Vec<*const f32> = ins.iter().map(|x| x.as_ptr()).collect();
                        let mut out = vec![f32::NAN; n];
                        unsafe { reduce_raw(&ptrs, out.as_mut_ptr(), n, op, stream) };
                        assert_eq!(
                            out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                            "f32 k={k} n={n} {op:?} stream={stream}"
                        );
                        let p16: Vec<*const bf16> = ins16.iter().map(|x| x.as_ptr()).collect();
                        let mut out16 = vec![bf16::NAN; n];
                        unsafe { reduce_raw(&p16, out16.as_mut_ptr(), n, op, stream) };
                        assert_eq!(out16, want16, "bf16 k={k} n={n} {op:?} stream={stream}");
                        // Output aliasing the last input (the in-place all-reduce's own chunk).
                        let mut alias = ins.clone();
                        let mut ptrs: Vec<*const f32> = alias.iter().map(|x| x.as_ptr()).collect();
                        let o = alias[k - 1].as_mut_ptr();
                        ptrs[k - 1] = o;
                        unsafe { reduce_raw(&ptrs, o, n, op, stream) };
                        assert_eq!(
                            alias[k - 1].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                            "aliased f32 k={k} n={n} {op:?} stream={stream}"
                        );
                    }
                }
            }
        }
    }

    /// Streaming output at every start within a 64-byte line (so every head length, down to
    /// none), with lengths that end mid-chunk, for every dtype (chunks of 64, 128 and 256
    /// bytes), through the run-time dispatch and the baseline build: the same bits as the
    /// scalar rank-order sum, and nothing outside `out` written.
    #[test]
    fn streaming_heads_and_tails_are_exact_for_every_dtype() {
        fn check<T: Reducible + PartialEq + std::fmt::Debug>(make: impl Fn(f32) -> T, name: &str) {
            let v = |j: usize, i: usize| ((j * 7919 + i * 104_729) % 1999) as f32 * 0.37 - 300.0;
            let n_max = 3 * CHUNK + 40 + 64;
            for k in [1usize, 2, 3, 4] {
                let ins: Vec<Vec<T>> = (0..k)
                    .map(|j| (0..n_max).map(|i| make(v(j, i))).collect())
                    .collect();
                for off in 0..(64 / std::mem::size_of::<T>() + 1) {
                    for n in [CHUNK - 1, CHUNK, 2 * CHUNK + 5, 3 * CHUNK + 40] {
                        let want: Vec<T> = (0..n)
                            .map(|i| {
                                let mut a = ins[0][i].to_acc();
                                for x in &ins[1..] {
                                    a = a + x[i].to_acc();
                                }
                                T::from_acc(a)
                            })
                            .collect();
                        let guard = make(12345.0);
                        let ptrs: Vec<*const T> = ins.iter().map(|x| x.as_ptr()).collect();
                        // The dispatching entry (AVX2 where present) and the baseline build
                        // (SSE2 streaming stores on x86-64).
                        for path in ["dispatch", "baseline"] {
                            let mut buf = vec![guard; off + n + 3];
                            let o = unsafe { buf.as_mut_ptr().add(off) };
                            match path {
                                "dispatch" => unsafe {
                                    reduce_raw(&ptrs, o, n, ReduceOp::Sum, true)
                                },
                                _ => unsafe {
                                    reduce_fused::<T, AddFold, false, false>(&ptrs, o, n, true)
                                },
                            }
                            let at = format!("{name} {path} k={k} off={off} n={n}");
                            assert_eq!(&buf[off..off + n], &want[..], "{at}");
                            assert!(buf[..off].iter().all(|x| *x == guard), "{at}");
                            assert!(buf[off + n..].iter().all(|x| *x == guard), "{at}");
                        }
                    }
                }
            }
        }
        check::<f32>(|x| x, "f32");
        check::<f64>(|x| x as f64 * 1.000_000_1, "f64");
        check::<bf16>(bf16::from_f32, "bf16");
        check::<f16>(|x| f16::from_f32(x * 0.01), "f16");
    }

    #[test]
    fn bf16_accumulates_in_f32_and_rounds_once() {
        // 1 + 64 x 2^-9 = 1.125 exactly; a bf16 accumulator would stay at 1.0 (2^-9 is below
        // half an ulp of 1.0 in bf16).
        let one = vec![bf16::ONE; 3];
        let small = vec![bf16::from_f32(0.001953125); 3];
        let mut inputs: Vec<Buf<'_>> = vec![(&one).into()];
        for _ in 0..64 {
            inputs.push((&small).into());
        }
        let mut out = vec![bf16::ZERO; 3];
        reduce_in_rank_order(&inputs, ReduceOp::Sum, (&mut out).into()).unwrap();
        assert_eq!(out[0].to_f32(), 1.125);
    }

    #[test]
    fn avg_divides_by_contributions_and_max_keeps_nan() {
        let a = vec![1.0f64, f64::NAN, -3.0];
        let b = vec![2.0f64, 0.0, -1.0];
        let mut out = vec![0.0f64; 3];
        reduce_in_rank_order(
            &[(&a).into(), (&b).into()],
            ReduceOp::Avg,
            (&mut out).into(),
        )
        .unwrap();
        assert_eq!(out[0], 1.5);
        assert_eq!(out[2], -2.0);
        reduce_in_rank_order(
            &[(&b).into(), (&a).into()],
            ReduceOp::Max,
            (&mut out).into(),
        )
        .unwrap();
        assert_eq!(out[0], 2.0);
        assert!(out[1].is_nan());
        assert_eq!(out[2], -1.0);
        let short = vec![0.0f64; 2];
        let e = reduce_in_rank_order(
            &[(&a).into(), (&short).into()],
            ReduceOp::Sum,
            (&mut out).into(),
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                CommError::SizeMismatch {
                    expected: 3,
                    got: 2,
                    ..
                }
            ),
            "{e}"
        );
    }
}

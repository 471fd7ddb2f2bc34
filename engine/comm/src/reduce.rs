//! Element-wise reductions in rank order, the arithmetic every backend must reproduce.
//!
//! `out[i] = ((x_0[i] + x_1[i]) + x_2[i]) + ...` in the accumulation dtype (f32 for f32, bf16 and
//! f16; f64 for f64), then for `Avg` one division by the number of contributions, then one
//! rounding to the element dtype. Work is done in blocks of [`BLOCK`] elements held in a stack
//! accumulator so every input is streamed once and the inner loops vectorise.

use crate::buf::{Buf, BufMut, Element};
use crate::error::{CommError, OpKind};
use crate::topology::{Group, ReduceOp};
use half::{bf16, f16};
use std::ops::{Add, Div};

/// Elements per accumulation block (16 KiB of f32 accumulator).
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

/// Reduces `inputs.len()` runs of `n` elements into `out`, in input order.
///
/// # Safety
/// Every `inputs[j]` must be valid for reads of `n` elements and `out` valid for writes of `n`
/// elements for the duration of the call; nobody else may write those ranges meanwhile. `out`
/// may be equal to one of the inputs (each block is read completely before it is written).
pub(crate) unsafe fn reduce_raw<T: Reducible>(
    inputs: &[*const T],
    out: *mut T,
    n: usize,
    op: ReduceOp,
) {
    debug_assert!(!inputs.is_empty());
    let mut acc = [T::A::default(); BLOCK];
    let count = T::A::from_count(inputs.len());
    let mut start = 0;
    while start < n {
        let len = BLOCK.min(n - start);
        let a = &mut acc[..len];
        {
            let s0 = std::slice::from_raw_parts(inputs[0].add(start), len);
            for (ai, &x) in a.iter_mut().zip(s0) {
                *ai = x.to_acc();
            }
        }
        for &p in &inputs[1..] {
            let s = std::slice::from_raw_parts(p.add(start), len);
            match op {
                ReduceOp::Sum | ReduceOp::Avg => {
                    for (ai, &x) in a.iter_mut().zip(s) {
                        *ai = *ai + x.to_acc();
                    }
                }
                ReduceOp::Max => {
                    for (ai, &x) in a.iter_mut().zip(s) {
                        let x = x.to_acc();
                        if x > *ai || x.is_nan() {
                            *ai = x;
                        }
                    }
                }
            }
        }
        if op == ReduceOp::Avg {
            for ai in a.iter_mut() {
                *ai = *ai / count;
            }
        }
        let o = out.add(start);
        for (i, &ai) in a.iter().enumerate() {
            o.add(i).write(T::from_acc(ai));
        }
        start += len;
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

/// Dtype-dispatching wrapper over [`reduce_raw`] on byte pointers.
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
    use fsdp_types::DType;
    macro_rules! go {
        ($t:ty) => {{
            let ins: Vec<*const $t> = inputs.iter().map(|&p| p as *const $t).collect();
            reduce_raw::<$t>(&ins, out as *mut $t, n, op)
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

//! Fused CPU custom ops for the GPT hot path, each with a hand-written backward pass that
//! candle's autograd calls: LayerNorm, causal self-attention ([`causal_attention`]: qkv rows
//! to the attention output through strided GEMMs, its own module), causal softmax, bias +
//! GELU, summed cross-entropy, token + position embedding, bias add (with its column-sum
//! backward) and the backward seed; and for the Llama family (their own modules) RMSNorm
//! ([`rms_norm`]), the rotary embedding packed for the attention ([`rope_qkv`]) and the SwiGLU
//! gate ([`swiglu`]).
//!
//! Composed from candle primitives, each of these is 5-10 full passes over memory and as many
//! temporaries in the autograd graph; fused, it is one pass forward and one backward. Inputs
//! are made contiguous first (a no-op when they already are).
//!
//! # Speed and determinism
//!
//! - **Vectorised kernels.** Each row kernel is plain branch-free element loops (polynomial
//!   `exp` through the exponent bits, [`exp_f32`], and [`exp_f64`] for the cross-entropy's
//!   f64 log-sum-exp; GELU through a sigmoid, see [`bias_gelu`]) that the compiler vectorises, compiled three times: for AVX-512 (16 f32 lanes), AVX2
//!   (8 lanes) and the baseline (SSE2), the widest the CPU has chosen at run time. Only IEEE-754
//!   add, subtract, multiply, divide, square root, min/max, compares and bit operations are
//!   used, never a fused multiply-add or an approximate reciprocal, and every reduction has a
//!   fixed lane structure (8 accumulators), so the three builds give the same
//!   bits (tested) and the results do not depend on the CPU.
//! - **Rows in parallel, bits independent of the thread count.** When the current rayon pool
//!   (the rank's pool: `cores / W` threads, the one candle's matmul uses) has more than one
//!   thread, rows are computed in parallel tasks. A row's output depends only on that row, so
//!   any partition gives the same bits. Column sums (bias and LayerNorm weight gradients) use
//!   a partition fixed by the row count alone: blocks of [`SUM_BLOCK_ROWS`] rows, each summed
//!   in row order, then the block sums added in block order, with one thread or many.
//!   Row-independent values that are summed (cross-entropy's per-row losses) are added in row
//!   order after the parallel part. So an op gives the same bits for the same input whatever
//!   the thread count, world size or batch split. The embedding backward (a scatter-add in
//!   token order into `[V + P, D]`) stays sequential.
//! - **No zero-fill.** Outputs that every row writes in full are allocated without
//!   initialisation: each row is computed into a reused (cache-resident) row buffer and then
//!   stored into its place in the output's spare capacity, and the length is set after every
//!   row has been stored.
//!
//! # Dtypes: f32, f64, and bf16 / f16 storage with f32 math
//!
//! Each op takes CPU tensors of ONE float dtype (token ids and targets are u32):
//! - f32 and f64 are computed in their own precision.
//! - bf16 and f16 (a unit computing in `param_dtype`, mixed precision as in Micikevicius et al.
//!   2018, "Mixed Precision Training", §3) are 16-bit STORAGE only: each input row is widened
//!   exactly to f32, computed by the f32 kernel (same f32 operations in the same order, so the
//!   same f32 bits as the f32 op on the widened inputs), and each output element is narrowed
//!   back to the input dtype with round-to-nearest-even (`half`'s `from_f32`, what candle's
//!   `to_dtype` does), the way GPU bf16 kernels keep f32 registers and 16-bit memory.
//!   Reductions (LayerNorm statistics and its `dw`/`db`, softmax sums, bias and embedding
//!   gradients, cross-entropy) accumulate in f32 (cross-entropy's loss in f64), never in 16 bits.
//!   Rows are widened one at a time into a reused scratch buffer (no full-tensor f32 copy),
//!   except the embedding gradient, which is accumulated in an f32 `[V + P, D]` buffer.
//!   So a 16-bit op's output is `round16(f32 op(widen(inputs)))` exactly: each element is
//!   within one rounding (relative `2^-8` for bf16, `2^-11` for f16, or half an f16 subnormal
//!   step, `2^-25`, below f16's normal range) of the f32 op on the same values.
//!   The backward passes that read a 16-bit forward result are the causal softmax's (it saves
//!   `y`, already rounded) and the causal attention's (it saves the probabilities `P`, rounded
//!   to the storage dtype; its forward used them unrounded), so their gradients carry that
//!   rounding through their dot products too. The attention widens each (sequence, head)
//!   pair's `[T, hd]` q/k/v (and in backward `dY` and `[T, T]` `P`) into per-task f32
//!   scratch rather than row by row, since its GEMMs read whole matrices.
//! - [`cross_entropy_sum`] returns an F32 scalar for bf16/f16 logits (f32 for f32, f64 for f64;
//!   see [`compute_dtype`]): the loss is never rounded to 16 bits. Its backward takes the f32
//!   upstream gradient unrounded and returns the logits gradient in the logits dtype.
//! - [`backward_seed`] works for all four dtypes.
//! - Mixed float dtypes in one op (e.g. f32 activations with a bf16 weight) are an error naming
//!   both dtypes, never a silent cast. Any other dtype is an error.
//!
//! Matrix products are not here: candle's CPU matmul serves bf16 (widened to f32, multiplied,
//! narrowed) and f16 (gemm's f16 kernel). Parameter gradients from candle autograd come out in
//! the parameters' dtype.
//!
//! These ops have no GPU kernels: on a CUDA device the model uses their candle-primitive
//! counterparts in [`super::composite`] (same contract; [`super::OpsPath`]). The f32/f64 ops
//! are tested against those compositions (engine/tests/model_gpt.rs, model_device.rs); the
//! 16-bit ops against the f32 ops (engine/tests/model_half.rs) and against the 16-bit
//! compositions (model_device.rs); the f32 kernels against f64 and across thread counts
//! (engine/tests/model_ops_accuracy.rs).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;
use std::borrow::Cow;
use std::mem::MaybeUninit;

/// The dtype the fused ops compute in for storage dtype `dtype`: F32 for BF16, F16 and F32;
/// F64 for F64 (any other dtype is returned unchanged; the ops refuse it). It is also the dtype
/// of the scalar [`cross_entropy_sum`] returns, and the dtype of its upstream gradient.
pub fn compute_dtype(dtype: DType) -> DType {
    match dtype {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    }
}

/// The float element types the fused kernels compute in (f32, f64).
trait Flt: Copy + Send + Sync + 'static + std::fmt::Debug {
    /// `|z|` beyond which GELU and its derivative are their limits in this precision (see
    /// [`gelu_fwd_impl`]): 10 for f32 (`|gelu(-10)| = 1.4e-37`), 20 for f64.
    const GELU_ZMAX: f64;
    fn of(v: f64) -> Self;
    fn f(self) -> f64;
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    fn wrap(v: Vec<Self>) -> CpuStorage;
    fn zero() -> Self;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    /// `e^x`: for f32 [`exp_f32`] (pure arithmetic, vectorisable); for f64 the std `exp`.
    fn exp_fast(self) -> Self;
    fn max(self, o: Self) -> Self;
    fn min(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
    /// `self < o` (false when either is NaN).
    fn lt(self, o: Self) -> bool;
    /// `self` limited to `[lo, hi]`; NaN stays NaN.
    fn clamp(self, lo: Self, hi: Self) -> Self;
}

macro_rules! impl_flt {
    ($t:ty, $var:ident, $exp:path, $zmax:expr) => {
        impl Flt for $t {
            const GELU_ZMAX: f64 = $zmax;
            #[inline(always)]
            fn of(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn f(self) -> f64 {
                self as f64
            }
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$var(v) => Some(v),
                    _ => None,
                }
            }
            fn wrap(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$var(v)
            }
            #[inline(always)]
            fn zero() -> Self {
                0.0
            }
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self + o
            }
            #[inline(always)]
            fn sub(self, o: Self) -> Self {
                self - o
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self * o
            }
            #[inline(always)]
            fn exp_fast(self) -> Self {
                $exp(self)
            }
            #[inline(always)]
            fn max(self, o: Self) -> Self {
                <$t>::max(self, o)
            }
            #[inline(always)]
            fn min(self, o: Self) -> Self {
                <$t>::min(self, o)
            }
            #[inline(always)]
            fn div(self, o: Self) -> Self {
                self / o
            }
            #[inline(always)]
            fn lt(self, o: Self) -> bool {
                self < o
            }
            #[inline(always)]
            fn clamp(self, lo: Self, hi: Self) -> Self {
                <$t>::clamp(self, lo, hi)
            }
        }
    };
}
impl_flt!(f32, F32, exp_f32, 10.0);
impl_flt!(f64, F64, f64::exp, 20.0);

/// The STORAGE element types the fused ops accept: f32 and f64 (computed as themselves,
/// `Acc = Self`, no copies) and bf16 and f16 (`Acc = f32`: rows widened into scratch
/// buffers, outputs narrowed with round-to-nearest-even).
trait Elem: Copy + Send + Sync + 'static {
    /// The type the kernels compute in.
    type Acc: Flt;
    /// The candle dtype of this storage type.
    const DTYPE: DType;
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    fn wrap(v: Vec<Self>) -> CpuStorage;
    /// `src` in compute precision: `src` itself, or widened into `buf` (reused scratch).
    fn acc<'a>(src: &'a [Self], buf: &'a mut Vec<Self::Acc>) -> &'a [Self::Acc];
    /// A whole (small: a weight or bias vector) slice in compute precision.
    fn acc_all(src: &[Self]) -> Cow<'_, [Self::Acc]>;
    /// Writes EVERY element of `dst` from `src` (moved, or narrowed through `tmp`). Panics when
    /// the lengths differ, so a stored row is always fully initialised.
    fn store(src: &[Self::Acc], dst: &mut [MaybeUninit<Self>], tmp: &mut Vec<Self>);
    /// A compute-precision vector as storage: moved, or narrowed.
    fn from_acc(v: Vec<Self::Acc>) -> Vec<Self>;
    /// Appends `src` (compute precision) to `v`, narrowed for 16-bit storage.
    fn extend_from_acc(v: &mut Vec<Self>, src: &[Self::Acc]);
    /// The `rows x cols` matrix whose row `r` is `src[r * stride..r * stride + cols]`, in
    /// compute precision, as a pointer and a row stride (elements) for a GEMM: `src` itself
    /// (stride `stride`), or widened row by row into `buf` (stride `cols`). Panics when `src`
    /// is shorter than the matrix; the pointer is valid while `src` and `buf` are.
    fn mat(
        src: &[Self],
        rows: usize,
        cols: usize,
        stride: usize,
        buf: &mut Vec<Self::Acc>,
    ) -> (*const Self::Acc, usize);
}

macro_rules! impl_elem_full {
    ($t:ty, $var:ident, $dt:ident) => {
        impl Elem for $t {
            type Acc = $t;
            const DTYPE: DType = DType::$dt;
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                <$t as Flt>::slice(s)
            }
            fn wrap(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$var(v)
            }
            #[inline(always)]
            fn acc<'a>(src: &'a [Self], _buf: &'a mut Vec<Self>) -> &'a [Self] {
                src
            }
            fn acc_all(src: &[Self]) -> Cow<'_, [Self]> {
                Cow::Borrowed(src)
            }
            #[inline]
            fn store(src: &[Self], dst: &mut [MaybeUninit<Self>], _tmp: &mut Vec<Self>) {
                assert_eq!(src.len(), dst.len(), "store: row lengths differ");
                for (d, &s) in dst.iter_mut().zip(src) {
                    d.write(s);
                }
            }
            fn from_acc(v: Vec<Self>) -> Vec<Self> {
                v
            }
            fn extend_from_acc(v: &mut Vec<Self>, src: &[Self]) {
                v.extend_from_slice(src);
            }
            fn mat(
                src: &[Self],
                rows: usize,
                cols: usize,
                stride: usize,
                _buf: &mut Vec<Self>,
            ) -> (*const Self, usize) {
                assert!(
                    rows == 0 || src.len() >= (rows - 1) * stride + cols,
                    "mat: source too short"
                );
                (src.as_ptr(), stride)
            }
        }
    };
}
impl_elem_full!(f32, F32, F32);
impl_elem_full!(f64, F64, F64);

macro_rules! impl_elem_half {
    ($t:ty, $var:ident, $dt:ident) => {
        impl Elem for $t {
            type Acc = f32;
            const DTYPE: DType = DType::$dt;
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$var(v) => Some(v),
                    _ => None,
                }
            }
            fn wrap(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$var(v)
            }
            #[inline]
            fn acc<'a>(src: &'a [Self], buf: &'a mut Vec<f32>) -> &'a [f32] {
                buf.clear();
                buf.resize(src.len(), 0.0);
                src.convert_to_f32_slice(buf);
                buf
            }
            fn acc_all(src: &[Self]) -> Cow<'_, [f32]> {
                Cow::Owned(src.to_f32_vec())
            }
            #[inline]
            fn store(src: &[f32], dst: &mut [MaybeUninit<Self>], tmp: &mut Vec<Self>) {
                assert_eq!(src.len(), dst.len(), "store: row lengths differ");
                tmp.clear();
                tmp.resize(src.len(), <$t>::ZERO);
                tmp.convert_from_f32_slice(src);
                for (d, &s) in dst.iter_mut().zip(tmp.iter()) {
                    d.write(s);
                }
            }
            fn from_acc(v: Vec<f32>) -> Vec<Self> {
                let mut out = vec![<$t>::ZERO; v.len()];
                out.convert_from_f32_slice(&v);
                out
            }
            fn extend_from_acc(v: &mut Vec<Self>, src: &[f32]) {
                v.extend_from_slice(&Self::from_acc(src.to_vec()));
            }
            fn mat(
                src: &[Self],
                rows: usize,
                cols: usize,
                stride: usize,
                buf: &mut Vec<f32>,
            ) -> (*const f32, usize) {
                buf.clear();
                buf.resize(rows * cols, 0.0);
                for (r, dst) in buf.chunks_exact_mut(cols.max(1)).enumerate().take(rows) {
                    src[r * stride..r * stride + cols].convert_to_f32_slice(dst);
                }
                (buf.as_ptr(), cols)
            }
        }
    };
}
impl_elem_half!(bf16, BF16, BF16);
impl_elem_half!(f16, F16, F16);

/// `e^x` in f32 from IEEE-754 operations only (so the compiler vectorises it and it is the same
/// on every platform): `x = n ln 2 + r` with `n = round(x / ln 2)` (the 1.5 * 2^23 trick),
/// `|r| <= ln 2 / 2` (Cody-Waite split of ln 2), `e^r` by Cephes `expf`'s degree-7 minimax
/// polynomial (Moshier 1992), times `2^n` built in the exponent bits. Inputs are clamped to
/// `[-87, 88]`: results below `e^-87 = 1.6e-38` are returned as that (absolute error below
/// `1.7e-38`), `+inf` and overflow give `e^88 = 1.65e38`; NaN stays NaN. Relative error
/// within `[-87, 88]`: below `2^-22` (2 ulp; tested against f64 in model_gpt.rs and
/// model_ops_accuracy.rs).
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    // `clamp` keeps NaN as NaN.
    let x = x.clamp(-87.0, 88.0);
    // 1.5 * 2^23: v's low mantissa bits hold n = round(x / ln 2) exactly (v is in
    // [2^23, 2^24)).
    const MAGIC: f32 = 12_582_912.0;
    let v = x * std::f32::consts::LOG2_E + MAGIC;
    let n = v - MAGIC;
    let ni = (v.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let p = 1.987_569_1e-4_f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let y = p * (r * r) + r + 1.0;
    let scale = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    y * scale
}

/// `e^x` in f64 from IEEE-754 operations only (vectorisable, the same on every platform):
/// `x = n ln 2 + r`, `n = round(x / ln 2)` (the 1.5 * 2^52 trick), `|r| <= ln 2 / 2` (Cody-Waite
/// split of ln 2, fdlibm's constants), `e^r` by its Taylor polynomial to degree 13
/// (truncation below `5e-18` relative), times `2^n` built in the exponent bits. Inputs are
/// clamped to `[-708, 709]`: results below `e^-708 = 3.3e-308` are returned as that, `+inf`
/// and overflow give `e^709 = 8.2e307`; NaN stays NaN. Relative error within the range: a
/// few ulp of f64 (below `2^-50`; tested against `f64::exp` in model_ops_accuracy.rs). Used
/// by the cross-entropy, whose log-sum-exp is accumulated in f64.
#[inline(always)]
pub fn exp_f64(x: f64) -> f64 {
    let x = x.clamp(-708.0, 709.0);
    const MAGIC: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52
    let v = x * std::f64::consts::LOG2_E + MAGIC;
    let n = v - MAGIC;
    let ni = (v.to_bits() as i64).wrapping_sub(MAGIC.to_bits() as i64);
    // fdlibm's ln 2 split: LN2_HI ends in 21 zero bits, so `n * LN2_HI` is exact (`|n| <= 1075`).
    const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
    const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
    let r = x - n * LN2_HI - n * LN2_LO;
    // 1/k! for k = 13 down to 2.
    let mut p = 1.0 / 6_227_020_800.0;
    for c in [
        1.0 / 479_001_600.0,
        1.0 / 39_916_800.0,
        1.0 / 3_628_800.0,
        1.0 / 362_880.0,
        1.0 / 40_320.0,
        1.0 / 5_040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
    ] {
        p = p * r + c;
    }
    let y = p * (r * r) + r + 1.0;
    let scale = f64::from_bits((ni.wrapping_add(1023) as u64) << 52);
    y * scale
}

/// Sum of `xs` with 8 independent accumulators (vectorisable, fixed order: deterministic, and
/// the same bits for every vector width).
#[inline(always)]
fn lane_sum<T: Flt>(xs: &[T]) -> T {
    let mut acc = [T::zero(); 8];
    let chunks = xs.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] = acc[l].add(c[l]);
        }
    }
    let mut t = T::zero();
    for &v in tail {
        t = t.add(v);
    }
    let a = acc[0].add(acc[4]).add(acc[1].add(acc[5]));
    let b = acc[2].add(acc[6]).add(acc[3].add(acc[7]));
    a.add(b).add(t)
}

/// `sum_j a_j b_j` with 8 independent accumulators (see [`lane_sum`]).
#[inline(always)]
fn lane_dot<T: Flt>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::zero(); 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] = acc[l].add(x[l].mul(y[l]));
        }
    }
    let mut t = T::zero();
    for (x, y) in ta.iter().zip(tb) {
        t = t.add(x.mul(*y));
    }
    let s = acc[0].add(acc[4]).add(acc[1].add(acc[5]));
    let u = acc[2].add(acc[6]).add(acc[3].add(acc[7]));
    s.add(u).add(t)
}

/// The largest (`MAX`) or smallest element of `xs` ignoring NaNs (`-inf` / `+inf` for an
/// empty or all-NaN slice), with 8 independent accumulators (vectorisable; `max` and `min` are
/// exact, so the order does not matter).
#[inline(always)]
fn lane_extreme<T: Flt, const MAX: bool>(xs: &[T]) -> T {
    let pick = |a: T, b: T| if MAX { a.max(b) } else { a.min(b) };
    let init = if MAX {
        f64::NEG_INFINITY
    } else {
        f64::INFINITY
    };
    let mut acc = [T::of(init); 8];
    let chunks = xs.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] = pick(acc[l], c[l]);
        }
    }
    let mut m = acc[0];
    for &v in acc[1..].iter().chain(tail) {
        m = pick(m, v);
    }
    m
}

// ---------------------------------------------------------------------------------------------
// Kernels compiled per instruction set, chosen at run time.

/// Defines `fn $name<T: Flt>(args)` that runs `$imp::<T>(args)` (an `#[inline(always)]`
/// kernel) compiled for AVX-512 or AVX2 when the CPU has it, else for the baseline target, and
/// a module `$name` holding the per-ISA builds (`v4`, `v3`; tests compare their bits).
/// Only IEEE operations appear in the kernels and Rust never contracts `a * b + c` into a fused
/// multiply-add, so every build returns the same bits.
macro_rules! simd_kernel {
    ($(#[$attr:meta])* fn $name:ident = $imp:ident ( $($arg:ident : $ty:ty),* $(,)? ) $(-> $ret:ty)?) => {
        #[allow(dead_code, clippy::too_many_arguments)]
        mod $name {
            use super::*;
            /// The kernel built for AVX-512 (F, VL, DQ, BW). Safety: the CPU must have them.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx512bw")]
            pub(super) unsafe fn v4<T: Flt>($($arg: $ty),*) $(-> $ret)? {
                $imp::<T>($($arg),*)
            }
            /// The kernel built for AVX2. Safety: the CPU must have AVX2.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            pub(super) unsafe fn v3<T: Flt>($($arg: $ty),*) $(-> $ret)? {
                $imp::<T>($($arg),*)
            }
        }
        $(#[$attr])*
        #[inline]
        #[allow(clippy::too_many_arguments)]
        fn $name<T: Flt>($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512dq")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                {
                    // SAFETY: the CPU has the features `v4` is built for (checked above).
                    return unsafe { $name::v4::<T>($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2 (checked above).
                    return unsafe { $name::v3::<T>($($arg),*) };
                }
            }
            $imp::<T>($($arg),*)
        }
    };
}

simd_kernel!(
    /// `acc[j] += row[j]`.
    fn add_into = add_into_impl(acc: &mut [T], row: &[T])
);
#[inline(always)]
fn add_into_impl<T: Flt>(acc: &mut [T], row: &[T]) {
    for (a, &v) in acc.iter_mut().zip(row) {
        *a = a.add(v);
    }
}

simd_kernel!(
    /// `y[j] = x[j] + b[j]`.
    fn bias_add_row = bias_add_row_impl(x: &[T], b: &[T], y: &mut [T])
);
#[inline(always)]
fn bias_add_row_impl<T: Flt>(x: &[T], b: &[T], y: &mut [T]) {
    for ((o, &xv), &bv) in y.iter_mut().zip(x).zip(b) {
        *o = xv.add(bv);
    }
}

// ---------------------------------------------------------------------------------------------
// Row-parallel drivers.

/// About this many elements per parallel task of a row-wise op (rows are never split).
const ROW_TASK_ELEMS: usize = 1 << 14;

/// Rows per block of a column sum: the sum of a column is the sum, in block order, of the
/// block sums, each accumulated in row order. Fixed (never derived from the thread count), so
/// the bits of a column sum depend only on the input.
pub const SUM_BLOCK_ROWS: usize = 32;

/// Whether `rows` rows, `per` per task, are worth running in parallel tasks: the current rayon
/// pool has more than one thread and there are at least two tasks.
fn parallel(rows: usize, per: usize) -> bool {
    rows > per && rayon::current_num_threads() > 1
}

/// Scratch buffers in compute precision, reused from row to row by one task.
struct Bufs<A> {
    a: Vec<A>,
    b: Vec<A>,
    c: Vec<A>,
    d: Vec<A>,
}

/// Everything one task reuses: input scratch, the row being computed, the narrowing buffer.
struct RowState<E: Elem> {
    bufs: Bufs<E::Acc>,
    out: Vec<E::Acc>,
    tmp: Vec<E>,
}

impl<E: Elem> RowState<E> {
    fn new() -> Self {
        RowState {
            bufs: Bufs {
                a: Vec::new(),
                b: Vec::new(),
                c: Vec::new(),
                d: Vec::new(),
            },
            out: Vec::new(),
            tmp: Vec::new(),
        }
    }
}

/// A `rows x w` output (plus `extra` elements of spare capacity for the caller), row `r`
/// computed by `f(r, scratch, out)` into a reused row buffer `out` of `w` elements (its
/// contents on entry are unspecified: `f` must set every element it means to keep, the rest
/// are stored as found) and stored (narrowed for 16-bit storage) into its place. The output is
/// never zero-filled. Rows run in parallel tasks in the current rayon pool when it has more
/// than one thread; a row's bits do not depend on the partition.
fn map_rows<E, F>(rows: usize, w: usize, extra: usize, f: F) -> Vec<E>
where
    E: Elem,
    F: Fn(usize, &mut Bufs<E::Acc>, &mut [E::Acc]) + Sync,
{
    let len = rows * w;
    let mut v: Vec<E> = Vec::with_capacity(len + extra);
    if len == 0 {
        return v;
    }
    let run = |first: usize, dst: &mut [MaybeUninit<E>], st: &mut RowState<E>| {
        st.out.resize(w, <E::Acc as Flt>::zero());
        for (k, d) in dst.chunks_exact_mut(w).enumerate() {
            f(first + k, &mut st.bufs, &mut st.out);
            E::store(&st.out, d, &mut st.tmp);
        }
    };
    let dst = &mut v.spare_capacity_mut()[..len];
    let per = (ROW_TASK_ELEMS / w).max(1);
    if parallel(rows, per) {
        dst.par_chunks_mut(per * w)
            .enumerate()
            .for_each_init(RowState::new, |st, (i, d)| run(i * per, d, st));
    } else {
        run(0, dst, &mut RowState::new());
    }
    // SAFETY: `dst` is the first `len` elements of the spare capacity; its chunks (each a
    // whole number of rows, as `len = rows * w`) cover it, and `E::store` wrote every element
    // of every row (it panics unless the row buffer has exactly `w` elements, and a panic
    // propagates out of rayon before this line). So `v[..len]` is initialised.
    unsafe { v.set_len(len) };
    v
}

/// Like [`map_rows`], and `f(r, scratch, out, sums)` also adds row `r`'s contributions to `k`
/// column sums (`sums`: `k * w` elements, zero at the start of each block). Returns the output
/// and the `k * w` column sums: blocks of [`SUM_BLOCK_ROWS`] rows, block sums added in block
/// order (the same bits with one thread or many).
fn map_rows_sums<E, F>(rows: usize, w: usize, k: usize, extra: usize, f: F) -> (Vec<E>, Vec<E::Acc>)
where
    E: Elem,
    F: Fn(usize, &mut Bufs<E::Acc>, &mut [E::Acc], &mut [E::Acc]) + Sync,
{
    let zero = <E::Acc as Flt>::zero();
    let len = rows * w;
    let mut v: Vec<E> = Vec::with_capacity(len + extra);
    let mut sums = vec![zero; k * w];
    if len == 0 {
        return (v, sums);
    }
    let block =
        |b: usize, dst: &mut [MaybeUninit<E>], st: &mut RowState<E>, part: &mut [E::Acc]| {
            part.fill(zero);
            st.out.resize(w, zero);
            for (i, d) in dst.chunks_exact_mut(w).enumerate() {
                f(b * SUM_BLOCK_ROWS + i, &mut st.bufs, &mut st.out, part);
                E::store(&st.out, d, &mut st.tmp);
            }
        };
    let dst = &mut v.spare_capacity_mut()[..len];
    if parallel(rows, SUM_BLOCK_ROWS) {
        let parts: Vec<Vec<E::Acc>> = dst
            .par_chunks_mut(SUM_BLOCK_ROWS * w)
            .enumerate()
            .map_init(RowState::new, |st, (b, d)| {
                let mut part = vec![zero; k * w];
                block(b, d, st, &mut part);
                part
            })
            .collect();
        for p in &parts {
            add_into(&mut sums, p);
        }
    } else {
        let (mut st, mut part) = (RowState::new(), vec![zero; k * w]);
        for (b, d) in dst.chunks_mut(SUM_BLOCK_ROWS * w).enumerate() {
            block(b, d, &mut st, &mut part);
            add_into(&mut sums, &part);
        }
    }
    // SAFETY: as in `map_rows`: the chunks cover `dst`, a whole number of rows each, and
    // `E::store` wrote every element of every row.
    unsafe { v.set_len(len) };
    (v, sums)
}

/// `k * w` column sums over `rows` rows, `f(r, scratch, sums)` adding row `r`'s
/// contributions; blocks of [`SUM_BLOCK_ROWS`] rows as in [`map_rows_sums`], no row output.
fn block_sums<A, F>(rows: usize, w: usize, k: usize, f: F) -> Vec<A>
where
    A: Flt,
    F: Fn(usize, &mut Bufs<A>, &mut [A]) + Sync,
{
    let zero = A::zero();
    let mut sums = vec![zero; k * w];
    let nblocks = rows.div_ceil(SUM_BLOCK_ROWS);
    let block = |b: usize, bufs: &mut Bufs<A>, part: &mut [A]| {
        part.fill(zero);
        for r in b * SUM_BLOCK_ROWS..((b + 1) * SUM_BLOCK_ROWS).min(rows) {
            f(r, bufs, part);
        }
    };
    let new_bufs = || Bufs {
        a: Vec::new(),
        b: Vec::new(),
        c: Vec::new(),
        d: Vec::new(),
    };
    if parallel(rows, SUM_BLOCK_ROWS) {
        let parts: Vec<Vec<A>> = (0..nblocks)
            .into_par_iter()
            .map_init(new_bufs, |bufs, b| {
                let mut part = vec![zero; k * w];
                block(b, bufs, &mut part);
                part
            })
            .collect();
        for p in &parts {
            add_into(&mut sums, p);
        }
    } else {
        let (mut bufs, mut part) = (new_bufs(), vec![zero; k * w]);
        for b in 0..nblocks {
            block(b, &mut bufs, &mut part);
            add_into(&mut sums, &part);
        }
    }
    sums
}

/// The contiguous element slice of `s` under layout `l`, of storage type `E` (the dtype of the
/// op's first float input): another dtype is a mixed-dtype error naming both.
fn view<'a, E: Elem>(op: &str, s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [E]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: input is not contiguous")))?;
    let v = E::slice(s).ok_or_else(|| {
        candle_core::Error::Msg(format!(
            "{op}: mixed dtypes: an input is {:?} but the first input is {:?} (all float inputs \
             of an op must have one dtype; cast explicitly)",
            s.dtype(),
            E::DTYPE
        ))
    })?;
    Ok(&v[a..b])
}

/// The contiguous slice of `s` in compute type `T` (the f32 upstream gradient of a 16-bit
/// cross-entropy).
fn acc_view<'a, T: Flt>(op: &str, s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [T]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: input is not contiguous")))?;
    let v = T::slice(s).ok_or_else(|| {
        candle_core::Error::Msg(format!(
            "{op}: upstream gradient is {:?}, expected the compute dtype",
            s.dtype()
        ))
    })?;
    Ok(&v[a..b])
}

fn u32_view<'a>(op: &str, s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [u32]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: targets not contiguous")))?;
    match s {
        CpuStorage::U32(v) => Ok(&v[a..b]),
        _ => candle_core::bail!("{op}: targets must be u32, got {:?}", s.dtype()),
    }
}

/// Dispatches a generic body over f32 / f64 / bf16 / f16 storage (the first float input's).
macro_rules! dispatch {
    ($op:expr, $s:expr, $body:ident ( $($arg:expr),* )) => {
        match $s {
            CpuStorage::F32(_) => $body::<f32>($($arg),*),
            CpuStorage::F64(_) => $body::<f64>($($arg),*),
            CpuStorage::BF16(_) => $body::<bf16>($($arg),*),
            CpuStorage::F16(_) => $body::<f16>($($arg),*),
            other => candle_core::bail!(
                "{}: dtype {:?} is not supported (f32, f64, bf16, f16)",
                $op,
                other.dtype()
            ),
        }
    };
}

/// Checks that the named float tensors of op `op` share one dtype: a clear error naming each
/// dtype otherwise (no silent cast).
pub(crate) fn same_dtype(op: &str, ts: &[(&str, &Tensor)]) -> candle_core::Result<()> {
    let first = ts[0].1.dtype();
    if ts.iter().any(|(_, t)| t.dtype() != first) {
        let list: Vec<String> = ts
            .iter()
            .map(|(n, t)| format!("{n} {:?}", t.dtype()))
            .collect();
        candle_core::bail!(
            "{op}: mixed dtypes ({}); all float inputs of an op must have one dtype (cast \
             explicitly)",
            list.join(", ")
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// LayerNorm (Ba, Kiros & Hinton 2016): y = (x - mean) * rstd * w + b over the last dim.

struct LayerNorm {
    eps: f64,
}

/// Per-row mean and `1 / sqrt(var + eps)` (biased variance, two passes), with `scratch` (`D`
/// elements) receiving `x - mean`.
#[inline(always)]
fn row_stats<T: Flt>(row: &[T], eps: f64, scratch: &mut [T]) -> (T, T) {
    let d = row.len() as f64;
    let mean = T::of(lane_sum(row).f() / d);
    for (c, &x) in scratch.iter_mut().zip(row) {
        *c = x.sub(mean);
    }
    let var = lane_dot(scratch, scratch).f() / d;
    (mean, T::of(1.0 / (var + eps).sqrt()))
}

simd_kernel!(
    /// One LayerNorm row: `y = (x - mean) rstd w + b`; `xc` (`D` elements) is scratch.
    fn ln_fwd_row = ln_fwd_row_impl(x: &[T], w: &[T], b: &[T], eps: f64, xc: &mut [T], y: &mut [T])
);
#[inline(always)]
fn ln_fwd_row_impl<T: Flt>(x: &[T], w: &[T], b: &[T], eps: f64, xc: &mut [T], y: &mut [T]) {
    let (_, rstd) = row_stats(x, eps, xc);
    for (((o, &c), &wv), &bv) in y.iter_mut().zip(xc.iter()).zip(w).zip(b) {
        *o = c.mul(rstd).mul(wv).add(bv);
    }
}

fn ln_fwd<E: Elem>(
    eps: f64,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let x = view::<E>("layer_norm", s1, l1)?;
    let w = E::acc_all(view::<E>("layer_norm", s2, l2)?);
    let b = E::acc_all(view::<E>("layer_norm", s3, l3)?);
    let d = w.len();
    let n = x.len().checked_div(d).unwrap_or(0);
    let y = map_rows::<E, _>(n, d, 0, |r, s, out| {
        let row = E::acc(&x[r * d..(r + 1) * d], &mut s.a);
        s.c.resize(d, <E::Acc as Flt>::zero());
        ln_fwd_row(row, &w, &b, eps, &mut s.c, out);
    });
    Ok((E::wrap(y), l1.shape().clone()))
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "fused-layer-norm"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s1, ln_fwd(self.eps, s1, l1, s2, l2, s3, l3))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let n = x.elem_count() / w.elem_count();
        let packed = x.apply_op3_no_bwd(w, &grad.contiguous()?, &LayerNormBwd { eps: self.eps })?;
        let dx = packed.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = packed.get(n)?;
        let db = packed.get(n + 1)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// Backward of LayerNorm: inputs `(x [N, D], w [D], g [N, D])`, output packed `[N + 2, D]` =
/// rows `dx`, then `dw = sum_n g * xhat`, then `db = sum_n g` (both accumulated in the compute
/// dtype in blocks of [`SUM_BLOCK_ROWS`] rows, see the module docs).
/// `dx = rstd * (g w - mean(g w) - xhat * mean(g w xhat))`.
struct LayerNormBwd {
    eps: f64,
}

simd_kernel!(
    /// One LayerNorm backward row: `dx` from `x`, `g`; adds `g * xhat` to `dw` and `g` to `db`.
    /// `xhat`, `gw` (`D` elements) are scratch.
    fn ln_bwd_row = ln_bwd_row_impl(
        x: &[T],
        g: &[T],
        w: &[T],
        eps: f64,
        xhat: &mut [T],
        gw: &mut [T],
        dx: &mut [T],
        dwb: &mut [T],
    )
);
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn ln_bwd_row_impl<T: Flt>(
    x: &[T],
    g: &[T],
    w: &[T],
    eps: f64,
    xhat: &mut [T],
    gw: &mut [T],
    dx: &mut [T],
    dwb: &mut [T],
) {
    let d = x.len();
    let (_, rstd) = row_stats(x, eps, xhat);
    let (dw, db) = dwb.split_at_mut(d);
    for j in 0..d {
        xhat[j] = xhat[j].mul(rstd);
        gw[j] = g[j].mul(w[j]);
        dw[j] = dw[j].add(g[j].mul(xhat[j]));
        db[j] = db[j].add(g[j]);
    }
    let m_gw = T::of(lane_sum(gw).f() / d as f64);
    let m_gwx = T::of(lane_dot(gw, xhat).f() / d as f64);
    for ((o, &a), &h) in dx.iter_mut().zip(gw.iter()).zip(xhat.iter()) {
        *o = rstd.mul(a.sub(m_gw).sub(h.mul(m_gwx)));
    }
}

fn ln_bwd<E: Elem>(
    eps: f64,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let x = view::<E>("layer_norm_bwd", s1, l1)?;
    let w = E::acc_all(view::<E>("layer_norm_bwd", s2, l2)?);
    let g = view::<E>("layer_norm_bwd", s3, l3)?;
    let d = w.len();
    let n = x.len().checked_div(d).unwrap_or(0);
    let zero = <E::Acc as Flt>::zero();
    let (mut out, dwb) = map_rows_sums::<E, _>(n, d, 2, 2 * d, |r, s, dxr, part| {
        let xr = E::acc(&x[r * d..(r + 1) * d], &mut s.a);
        let gr = E::acc(&g[r * d..(r + 1) * d], &mut s.b);
        s.c.resize(d, zero);
        s.d.resize(d, zero);
        ln_bwd_row(xr, gr, &w, eps, &mut s.c, &mut s.d, dxr, part);
    });
    E::extend_from_acc(&mut out, &dwb);
    Ok((E::wrap(out), Shape::from((n + 2, d))))
}

impl CustomOp3 for LayerNormBwd {
    fn name(&self) -> &'static str {
        "fused-layer-norm-bwd"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s1, ln_bwd(self.eps, s1, l1, s2, l2, s3, l3))
    }
}

/// Fused LayerNorm over the last dim: `x` `[N, D]`, `w` `[D]`, optional `b` `[D]` (zeros when
/// absent) -> `[N, D]`, dtype of `x` (f32, f64, or bf16/f16 computed in f32, see the module
/// docs). Gradients flow to `x`, `w` and `b` (`dw`, `db` summed over rows in blocks of
/// [`SUM_BLOCK_ROWS`]). Errors: mixed or unsupported dtypes, shapes that do not match.
pub fn layer_norm(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f64,
) -> candle_core::Result<Tensor> {
    let d = w.elem_count();
    if x.dim(candle_core::D::Minus1)? != d {
        candle_core::bail!("layer_norm: x {:?} vs weight [{d}]", x.dims());
    }
    let zeros;
    let b = match b {
        Some(b) => b,
        None => {
            zeros = w.zeros_like()?;
            &zeros
        }
    };
    same_dtype("layer_norm", &[("x", x), ("weight", w), ("bias", b)])?;
    x.contiguous()?
        .apply_op3(&w.contiguous()?, &b.contiguous()?, LayerNorm { eps })
}

// ---------------------------------------------------------------------------------------------
// Causal softmax: y[i, j] = softmax_j(scale * s[i, j]) over j <= i, 0 for j > i, rows i taken
// modulo T in a [..., T, T] tensor (Vaswani et al. 2017, §3.2.1, with the decoder mask).

struct CausalSoftmax {
    scale: f64,
}

simd_kernel!(
    /// The softmax of `sc * x` over one row's unmasked part `x` into `y` (same length).
    fn softmax_row = softmax_row_impl(x: &[T], sc: T, y: &mut [T])
);
/// `y_j = e^(a_j) / sum_k e^(a_k)`, `a_j = (x_j - m) sc <= 0` with `m` the element of `x`
/// that maximises `sc x` (`max x` for `sc >= 0`, `min x` for `sc < 0`): the subtraction comes
/// first, so `a_j` carries a rounding relative to itself (not to `sc x_j`) and the largest
/// outputs are accurate to a few ulp. The sum by [`lane_sum`], one f64 reciprocal.
#[inline(always)]
fn softmax_row_impl<T: Flt>(x: &[T], sc: T, y: &mut [T]) {
    let m = if sc.lt(T::zero()) {
        lane_extreme::<T, false>(x)
    } else {
        lane_extreme::<T, true>(x)
    };
    for (o, &v) in y.iter_mut().zip(x) {
        *o = v.sub(m).mul(sc).exp_fast();
    }
    let inv = T::of(1.0 / lane_sum(y).f());
    for v in y.iter_mut() {
        *v = v.mul(inv);
    }
}

fn csm_fwd<E: Elem>(
    scale: f64,
    s: &CpuStorage,
    l: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let x = view::<E>("causal_softmax", s, l)?;
    let t = *l.dims().last().unwrap_or(&1);
    let sc = <E::Acc as Flt>::of(scale);
    let rows = x.len().checked_div(t).unwrap_or(0);
    let y = map_rows::<E, _>(rows, t, 0, |r, s, out| {
        let i = r % t;
        let valid = E::acc(&x[r * t..r * t + i + 1], &mut s.a);
        let (head, masked) = out.split_at_mut(i + 1);
        softmax_row(valid, sc, head);
        masked.fill(<E::Acc as Flt>::zero());
    });
    Ok((E::wrap(y), l.shape().clone()))
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "fused-causal-softmax"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s, csm_fwd(self.scale, s, l))
    }
    fn bwd(
        &self,
        _arg: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let dx =
            res.apply_op2_no_bwd(&grad.contiguous()?, &CausalSoftmaxBwd { scale: self.scale })?;
        Ok(Some(dx))
    }
}

/// Backward of the causal softmax: inputs `(y, g)`, output `scale * y * (g - sum_j g_j y_j)`.
/// `y` is the saved forward output (for bf16/f16 already rounded to 16 bits).
struct CausalSoftmaxBwd {
    scale: f64,
}

simd_kernel!(
    /// One row's unmasked part: `dx_j = sc y_j (g_j - sum_k g_k y_k)`.
    fn softmax_bwd_row = softmax_bwd_row_impl(y: &[T], g: &[T], sc: T, dx: &mut [T])
);
#[inline(always)]
fn softmax_bwd_row_impl<T: Flt>(y: &[T], g: &[T], sc: T, dx: &mut [T]) {
    let dot = lane_dot(g, y);
    for ((o, &yv), &gv) in dx.iter_mut().zip(y).zip(g) {
        *o = sc.mul(yv).mul(gv.sub(dot));
    }
}

fn csm_bwd<E: Elem>(
    scale: f64,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let y = view::<E>("causal_softmax_bwd", s1, l1)?;
    let g = view::<E>("causal_softmax_bwd", s2, l2)?;
    let t = *l1.dims().last().unwrap_or(&1);
    let sc = <E::Acc as Flt>::of(scale);
    let rows = y.len().checked_div(t).unwrap_or(0);
    let dx = map_rows::<E, _>(rows, t, 0, |r, s, out| {
        let i = r % t;
        let yr = E::acc(&y[r * t..r * t + i + 1], &mut s.a);
        let gr = E::acc(&g[r * t..r * t + i + 1], &mut s.b);
        let (head, masked) = out.split_at_mut(i + 1);
        softmax_bwd_row(yr, gr, sc, head);
        masked.fill(<E::Acc as Flt>::zero());
    });
    Ok((E::wrap(dx), l1.shape().clone()))
}

impl CustomOp2 for CausalSoftmaxBwd {
    fn name(&self) -> &'static str {
        "fused-causal-softmax-bwd"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s1, csm_bwd(self.scale, s1, l1, s2, l2))
    }
}

/// Fused scaled causal softmax over the last dim of attention scores `s` `[..., T, T]`:
/// `softmax(scale * s + mask)` with `mask[i][j] = -inf` for `j > i` (masked entries are exactly
/// 0), dtype of `s` (f32, f64, or bf16/f16 computed in f32). Gradient flows to `s`.
///
/// Computed as `e^(a_j) / sum_k e^(a_k)` with `a_j = scale (s_j - m) <= 0`, `m` the score
/// maximising `scale s` (the subtraction first, so `a_j` is rounded relative to itself),
/// [`exp_f32`] in f32, the row sum by 8 fixed lanes, one f64 reciprocal.
/// f32 accuracy against the f64 softmax of the same f32 scores (engine/tests/
/// model_ops_accuracy.rs, rows of 67 and 256, `|scale s|` up to 200): every output `y_j`
/// within `(6 + n/8 + 3 |a_j|) 2^-24 y64_j + 2e-38`, `n` the row's unmasked length (a few
/// ulp for the outputs that carry the weight; measured at most 0.82 of the bound, 64 ulp
/// relative at `a_j = -77`); entries with `a_j < -87` come out as `1.6e-38 / sum` instead of
/// underflowing. A NaN score in the unmasked part makes the row NaN; so does `+inf`
/// (`inf - inf`); a `-inf` score gives `1.6e-38 / sum`. Masked entries are exactly `+0`.
/// Errors: unsupported dtype, last two dims not equal.
pub fn causal_softmax(s: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    let dims = s.dims();
    if dims.len() < 2 || dims[dims.len() - 1] != dims[dims.len() - 2] {
        candle_core::bail!("causal_softmax: scores must be [..., T, T], got {dims:?}");
    }
    s.contiguous()?.apply_op1(CausalSoftmax { scale })
}

// ---------------------------------------------------------------------------------------------
// Bias + GELU, tanh approximation (Hendrycks & Gimpel 2016, as GPT-2):
// gelu(z) = 0.5 z (1 + tanh(c (z + 0.044715 z^3))), c = sqrt(2 / pi),
// computed as z * sigmoid(2u) = z / (1 + e^(-2u)), u = c z (1 + 0.044715 z^2): the same
// function (0.5 (1 + tanh u) = 1 / (1 + e^(-2u))), one exp and one division, and without the
// cancellation of 1 + tanh u for negative z.

const GELU_C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
const GELU_A: f64 = 0.044_715;

struct BiasGelu;

/// `e^(-2u)` for (clamped) `z`, `u = c z (1 + a z^2)`.
#[inline(always)]
fn gelu_exp<T: Flt>(zc: T) -> T {
    let z2 = zc.mul(zc);
    T::of(-2.0 * GELU_C)
        .mul(zc)
        .mul(T::of(1.0).add(T::of(GELU_A).mul(z2)))
        .exp_fast()
}

simd_kernel!(
    /// `y[j] = gelu(x[j] + b[j])`.
    fn gelu_fwd_row = gelu_fwd_impl(x: &[T], b: &[T], y: &mut [T])
);
/// GELU forward: `z / (1 + e^(-2u(zc)))` with `zc = clamp(z, -Z, Z)`, `Z` =
/// [`Flt::GELU_ZMAX`]; `-0` for `z < -Z` (where `|gelu| < 1.4e-37` in f32). For `z > Z` the
/// denominator is exactly 1, so `gelu(z) = z`.
#[inline(always)]
fn gelu_fwd_impl<T: Flt>(x: &[T], b: &[T], y: &mut [T]) {
    let zmax = T::of(T::GELU_ZMAX);
    let nzmax = T::of(-T::GELU_ZMAX);
    let (one, nzero) = (T::of(1.0), T::of(-0.0));
    for ((o, &xv), &bv) in y.iter_mut().zip(x).zip(b) {
        let z = xv.add(bv);
        let e = gelu_exp(z.clamp(nzmax, zmax));
        let v = z.div(one.add(e));
        *o = if z.lt(nzmax) { nzero } else { v };
    }
}

fn bg_fwd<E: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let x = view::<E>("bias_gelu", s1, l1)?;
    let b = E::acc_all(view::<E>("bias_gelu", s2, l2)?);
    let f = b.len();
    let n = x.len().checked_div(f).unwrap_or(0);
    let y = map_rows::<E, _>(n, f, 0, |r, s, out| {
        let row = E::acc(&x[r * f..(r + 1) * f], &mut s.a);
        gelu_fwd_row(row, &b, out);
    });
    Ok((E::wrap(y), l1.shape().clone()))
}

impl CustomOp2 for BiasGelu {
    fn name(&self) -> &'static str {
        "fused-bias-gelu"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s1, bg_fwd(s1, l1, s2, l2))
    }
    fn bwd(
        &self,
        x: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let f = b.elem_count();
        let n = x.elem_count() / f;
        let packed = x.apply_op3_no_bwd(b, &grad.contiguous()?, &BiasGeluBwd)?;
        let dz = packed.narrow(0, 0, n)?.reshape(x.shape())?;
        let db = packed.get(n)?;
        Ok((Some(dz), Some(db)))
    }
}

/// Backward of bias + GELU: inputs `(x [N, F], b [F], g [N, F])`, output packed `[N + 1, F]`:
/// rows `dz = g * gelu'(x + b)`, then `db = sum_n dz` (in the compute dtype, from the
/// unrounded `dz`, in blocks of [`SUM_BLOCK_ROWS`] rows), with `s = 1 / (1 + e^(-2u))`:
/// `gelu'(z) = 0.5 (1 + tanh u) + 0.5 z (1 - tanh^2 u) u'(z) = s + s (1 - s) 2 c z (1 + 3 a z^2)`.
struct BiasGeluBwd;

simd_kernel!(
    /// `dz[j] = g[j] gelu'(x[j] + b[j])`, and `db[j] += dz[j]`.
    fn gelu_bwd_row = gelu_bwd_impl(x: &[T], b: &[T], g: &[T], dz: &mut [T], db: &mut [T])
);
/// GELU derivative on `zc = clamp(z, -Z, Z)`: `s + s q w` with `s = 1 / (1 + e)`,
/// `q = e s = 1 - s`, `w = 2 c zc (1 + 3 a zc^2)`, `e = e^(-2u(zc))`; 0 for `z < -Z` (where
/// `|gelu'| < 4e-36` in f32); exactly 1 for `z > Z` in f32 and f64.
#[inline(always)]
fn gelu_bwd_impl<T: Flt>(x: &[T], b: &[T], g: &[T], dz: &mut [T], db: &mut [T]) {
    let zmax = T::of(T::GELU_ZMAX);
    let nzmax = T::of(-T::GELU_ZMAX);
    let (one, zero) = (T::of(1.0), T::zero());
    let (c2, a3) = (T::of(2.0 * GELU_C), T::of(3.0 * GELU_A));
    for ((((o, acc), &xv), &bv), &gv) in dz.iter_mut().zip(db.iter_mut()).zip(x).zip(b).zip(g) {
        let z = xv.add(bv);
        let zc = z.clamp(nzmax, zmax);
        let e = gelu_exp(zc);
        let s = one.div(one.add(e));
        let q = e.mul(s);
        let w = c2.mul(zc).mul(one.add(a3.mul(zc.mul(zc))));
        let d = s.add(s.mul(q).mul(w));
        let d = if z.lt(nzmax) { zero } else { d };
        let v = gv.mul(d);
        *o = v;
        *acc = acc.add(v);
    }
}

fn bg_bwd<E: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let x = view::<E>("bias_gelu_bwd", s1, l1)?;
    let b = E::acc_all(view::<E>("bias_gelu_bwd", s2, l2)?);
    let g = view::<E>("bias_gelu_bwd", s3, l3)?;
    let f = b.len();
    let n = x.len().checked_div(f).unwrap_or(0);
    let (mut out, db) = map_rows_sums::<E, _>(n, f, 1, f, |r, s, dzr, part| {
        let xr = E::acc(&x[r * f..(r + 1) * f], &mut s.a);
        let gr = E::acc(&g[r * f..(r + 1) * f], &mut s.b);
        gelu_bwd_row(xr, &b, gr, dzr, part);
    });
    E::extend_from_acc(&mut out, &db);
    Ok((E::wrap(out), Shape::from((n + 1, f))))
}

impl CustomOp3 for BiasGeluBwd {
    fn name(&self) -> &'static str {
        "fused-bias-gelu-bwd"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s1, bg_bwd(s1, l1, s2, l2, s3, l3))
    }
}

/// Fused `gelu(x + b)` (tanh approximation): `x` `[N, F]`, optional bias `b` `[F]` (zeros when
/// absent) -> `[N, F]`, dtype of `x` (f32, f64, or bf16/f16 computed in f32: `x + b` is NOT
/// rounded to 16 bits before the GELU). Gradients flow to `x` and `b` (`db` summed over rows
/// in blocks of [`SUM_BLOCK_ROWS`]).
///
/// Computed as `z / (1 + e^(-2u))`, `u = c z (1 + a z^2)` (the tanh form rewritten through
/// `0.5 (1 + tanh u) = sigmoid(2u)`: one exp, one division, no cancellation of `1 + tanh u`
/// for negative `z`), with [`exp_f32`] in f32; the derivative is
/// `s + s (1 - s) 2 c z (1 + 3 a z^2)`, `s = sigmoid(2u)`. f32 accuracy against the f64
/// evaluation at the same f32 `z = x + b` (engine/tests/model_ops_accuracy.rs, 250k points
/// dense over `[-12, 12]` and log-uniform up to `|z| = 1e30`, the f32 extremes):
/// `|y - y64| <= 8 (1 + |u|) 2^-24 |y64| + 2e-37` (measured at most 0.72 of it; for
/// `z >= 0` at most 4 ulp, measured 1.9): the relative error grows with `|u|` only for
/// negative `z`, where `y` decays like `z e^(2u)`, as any f32 evaluation of `u` gives.
/// Derivative: `|d - d64| <= 2^-21` absolute (measured `3.4 * 2^-24`); the input gradient
/// `g d` adds one rounding. For `z < -10` the output is `-0` and the derivative 0 (true
/// magnitudes below `1.4e-37` and `4e-36`); for `z > 10`, `y = z` and `d = 1` exactly.
/// `+inf` gives `+inf` (derivative 1), `-inf` gives `-0` (derivative 0), NaN gives NaN.
/// Errors: mixed or unsupported dtypes, shapes.
pub fn bias_gelu(x: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let f = x.dim(candle_core::D::Minus1)?;
    let zeros;
    let b = match b {
        Some(b) => b,
        None => {
            zeros = Tensor::zeros(f, x.dtype(), x.device())?;
            &zeros
        }
    };
    if b.elem_count() != f {
        candle_core::bail!("bias_gelu: x {:?} vs bias {:?}", x.dims(), b.dims());
    }
    same_dtype("bias_gelu", &[("x", x), ("bias", b)])?;
    x.contiguous()?.apply_op2(&b.contiguous()?, BiasGelu)
}

// ---------------------------------------------------------------------------------------------
// Summed cross-entropy: loss = sum_n (logsumexp(z_n) - z_n[t_n]); dz = g (softmax(z) - onehot).

struct CrossEntropySum;

/// Checks every target against the vocabulary size `v`.
fn check_targets(op: &str, t: &[u32], v: usize) -> candle_core::Result<()> {
    if let Some(&tg) = t.iter().find(|&&tg| tg as usize >= v) {
        candle_core::bail!("{op}: target {tg} >= vocab size {v}");
    }
    Ok(())
}

fn ce_fwd<E: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let z = view::<E>("cross_entropy", s1, l1)?;
    let t = u32_view("cross_entropy", s2, l2)?;
    let v = *l1.dims().last().unwrap_or(&1);
    let n = z.len().checked_div(v).unwrap_or(0).min(t.len());
    check_targets("cross_entropy", &t[..n], v)?;
    // Per-row losses (in parallel when the pool has threads), then added in row order.
    let row_loss = |buf: &mut Vec<E::Acc>, r: usize| {
        let row = E::acc(&z[r * v..(r + 1) * v], buf);
        lse(row) - row[t[r] as usize].f()
    };
    let per = (ROW_TASK_ELEMS / v.max(1)).max(1);
    let losses: Vec<f64> = if parallel(n, per) {
        (0..n)
            .into_par_iter()
            .with_min_len(per)
            .map_init(Vec::new, row_loss)
            .collect()
    } else {
        let mut buf = Vec::new();
        (0..n).map(|r| row_loss(&mut buf, r)).collect()
    };
    let mut total = 0.0f64;
    for l in losses {
        total += l;
    }
    // The loss is returned in the compute dtype (F32 for 16-bit logits), never rounded to 16
    // bits.
    Ok((
        <E::Acc as Flt>::wrap(vec![<E::Acc as Flt>::of(total)]),
        Shape::from(()),
    ))
}

simd_kernel!(
    /// `log sum_j e^(z_j)` in f64: `m + ln sum_j e^(z_j - m)`, `m = max z`, [`exp_f64`], the
    /// sum over 8 fixed lanes.
    fn lse = lse_impl(row: &[T]) -> f64
);
#[inline(always)]
fn lse_impl<T: Flt>(row: &[T]) -> f64 {
    let m = lane_extreme::<T, true>(row).f();
    let mut acc = [0.0f64; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] += exp_f64(c[l].f() - m);
        }
    }
    let mut t = 0.0f64;
    for &v in tail {
        t += exp_f64(v.f() - m);
    }
    let a = (acc[0] + acc[4]) + (acc[1] + acc[5]);
    let b = (acc[2] + acc[6]) + (acc[3] + acc[7]);
    m + (a + b + t).ln()
}

simd_kernel!(
    /// One cross-entropy gradient row: `dz_j = g (e^(z_j - l) - [j = tg])`, in f64, rounded to
    /// the compute type once; `l` the row's log-sum-exp.
    fn ce_bwd_row = ce_bwd_row_impl(row: &[T], l: f64, g: f64, tg: usize, dz: &mut [T])
);
#[inline(always)]
fn ce_bwd_row_impl<T: Flt>(row: &[T], l: f64, g: f64, tg: usize, dz: &mut [T]) {
    for (o, &x) in dz.iter_mut().zip(row) {
        *o = T::of(g * exp_f64(x.f() - l));
    }
    dz[tg] = T::of(g * (exp_f64(row[tg].f() - l) - 1.0));
}

impl CustomOp2 for CrossEntropySum {
    fn name(&self) -> &'static str {
        "fused-cross-entropy-sum"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s1, ce_fwd(s1, l1, s2, l2))
    }
    fn bwd(
        &self,
        z: &Tensor,
        t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // The upstream gradient stays in the compute dtype (f32 for 16-bit logits).
        let g = grad.reshape(1)?.to_dtype(compute_dtype(z.dtype()))?;
        let dz = z.apply_op3_no_bwd(t, &g, &CrossEntropyBwd)?;
        Ok((Some(dz), None))
    }
}

/// Backward of the summed cross-entropy: inputs `(z [N, V], t u32 [N], g [1])` (`g` in the
/// compute dtype), output `g * (softmax(z_n) - onehot(t_n))` per row, dtype of `z`.
struct CrossEntropyBwd;

fn ce_bwd<E: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let z = view::<E>("cross_entropy_bwd", s1, l1)?;
    let t = u32_view("cross_entropy_bwd", s2, l2)?;
    let g = acc_view::<E::Acc>("cross_entropy_bwd", s3, l3)?[0].f();
    let v = *l1.dims().last().unwrap_or(&1);
    let n = z.len().checked_div(v).unwrap_or(0);
    if t.len() < n {
        candle_core::bail!("cross_entropy_bwd: {n} logit rows but {} targets", t.len());
    }
    check_targets("cross_entropy_bwd", &t[..n], v)?;
    let dz = map_rows::<E, _>(n, v, 0, |r, s, dr| {
        let row = E::acc(&z[r * v..(r + 1) * v], &mut s.a);
        ce_bwd_row(row, lse(row), g, t[r] as usize, dr);
    });
    Ok((E::wrap(dz), l1.shape().clone()))
}

impl CustomOp3 for CrossEntropyBwd {
    fn name(&self) -> &'static str {
        "fused-cross-entropy-bwd"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s1, ce_bwd(s1, l1, s2, l2, s3, l3))
    }
}

/// Fused summed cross-entropy: `logits` `[N, V]`, `targets` u32 `[N]` -> a 0-dim scalar
/// `sum_n (logsumexp(logits_n) - logits_n[targets_n])` in nats (per-row terms in f64, added in
/// row order), of dtype [`compute_dtype`]`(logits.dtype())`: F32 for f32, bf16 and f16 logits
/// (a 16-bit loss is not rounded to 16 bits), F64 for f64. Gradient flows to `logits`, in the
/// logits' dtype. Errors: a target `>= V`, `N` mismatch, unsupported dtype.
pub fn cross_entropy_sum(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let (n, _v) = logits.dims2()?;
    if targets.elem_count() != n {
        candle_core::bail!(
            "cross_entropy: {n} logit rows but {} targets",
            targets.elem_count()
        );
    }
    logits
        .contiguous()?
        .apply_op2(&targets.contiguous()?, CrossEntropySum)
}

// ---------------------------------------------------------------------------------------------
// Token + position embedding: h[n] = wte[ids[n]] + wpe[n mod T].

struct Embedding {
    t: usize,
}

fn emb_fwd<E: Elem>(
    t: usize,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let wte = view::<E>("embedding", s1, l1)?;
    let wpe = view::<E>("embedding", s2, l2)?;
    let ids = u32_view("embedding", s3, l3)?;
    let (v, d) = l1.shape().dims2()?;
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= v) {
        candle_core::bail!("Embed: token id {id} >= vocab_size {v}");
    }
    let h = map_rows::<E, _>(ids.len(), d, 0, |n, s, hr| {
        let id = ids[n] as usize;
        let tok = E::acc(&wte[id * d..(id + 1) * d], &mut s.a);
        let p = n % t;
        let pos = E::acc(&wpe[p * d..(p + 1) * d], &mut s.b);
        bias_add_row(tok, pos, hr);
    });
    Ok((E::wrap(h), Shape::from((ids.len(), d))))
}

impl CustomOp3 for Embedding {
    fn name(&self) -> &'static str {
        "fused-embedding"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s1, emb_fwd(self.t, s1, l1, s2, l2, s3, l3))
    }
    fn bwd(
        &self,
        wte: &Tensor,
        wpe: &Tensor,
        ids: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let v = wte.dim(0)?;
        let p = wpe.dim(0)?;
        let packed = grad
            .contiguous()?
            .apply_op2_no_bwd(ids, &EmbeddingBwd { t: self.t, v, p })?;
        Ok((
            Some(packed.narrow(0, 0, v)?),
            Some(packed.narrow(0, v, p)?),
            None,
        ))
    }
}

/// Backward of the embedding: inputs `(g [N, D], ids u32 [N])`, output packed `[V + P, D]`:
/// `dwte` (rows of `g` added into row `ids[n]`, in order `n = 0, 1, ...`) then `dwpe` (row
/// `p` = sum over sequences of `g[b T + p]`, rows `>= T` zero), accumulated in the compute
/// dtype (an f32 `[V + P, D]` buffer for 16-bit `g`) and narrowed once. The result is a fresh
/// sum, so candle adds it to any other gradient of `wte` (a tied LM head) as ONE term: the
/// total is the same bits whether the stages run in one graph or one unit at a time.
struct EmbeddingBwd {
    t: usize,
    v: usize,
    p: usize,
}

fn emb_bwd<E: Elem>(
    (t, v, p): (usize, usize, usize),
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let g = view::<E>("embedding_bwd", s1, l1)?;
    let ids = u32_view("embedding_bwd", s2, l2)?;
    let d = g.len() / ids.len().max(1);
    let mut out = vec![<E::Acc as Flt>::zero(); (v + p) * d];
    let (dwte, dwpe) = out.split_at_mut(v * d);
    let mut gbuf = Vec::new();
    for (n, (&id, gr)) in ids.iter().zip(g.chunks_exact(d)).enumerate() {
        let gr = E::acc(gr, &mut gbuf);
        add_into(&mut dwte[id as usize * d..(id as usize + 1) * d], gr);
        let pos = n % t;
        add_into(&mut dwpe[pos * d..(pos + 1) * d], gr);
    }
    Ok((E::wrap(E::from_acc(out)), Shape::from((v + p, d))))
}

impl CustomOp2 for EmbeddingBwd {
    fn name(&self) -> &'static str {
        "fused-embedding-bwd"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(
            self.name(),
            s1,
            emb_bwd((self.t, self.v, self.p), s1, l1, s2, l2)
        )
    }
}

/// Fused token + position embedding: `wte` `[V, D]`, `wpe` `[P, D]`, `ids` u32 `[B, T]` (`T <=
/// P`) -> `[B * T, D]`, row `b T + i` = `wte[ids[b][i]] + wpe[i]`, dtype of `wte` (16-bit: the
/// sum in f32, rounded once). Gradients flow to `wte` and `wpe`. Errors: a token id `>= V`,
/// `T > P`, mixed or unsupported dtypes.
pub fn embedding(wte: &Tensor, wpe: &Tensor, ids: &Tensor) -> candle_core::Result<Tensor> {
    let (_b, t) = ids.dims2()?;
    let p = wpe.dim(0)?;
    if t > p {
        candle_core::bail!("Embed: sequence length {t} exceeds n_positions {p}");
    }
    same_dtype("embedding", &[("wte", wte), ("wpe", wpe)])?;
    wte.contiguous()?.apply_op3(
        &wpe.contiguous()?,
        &ids.flatten_all()?.contiguous()?,
        Embedding { t },
    )
}

// ---------------------------------------------------------------------------------------------
// Bias add: y = x + b (broadcast over rows). candle's broadcast_add backward reduces over the
// broadcast dim with a strided sum; here the bias gradient is a row-block (vectorised) sum and
// the input gradient is the upstream gradient itself (no copy).

struct BiasAdd;

fn ba_fwd<E: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let x = view::<E>("bias_add", s1, l1)?;
    let b = E::acc_all(view::<E>("bias_add", s2, l2)?);
    let f = b.len();
    let n = x.len().checked_div(f).unwrap_or(0);
    let y = map_rows::<E, _>(n, f, 0, |r, s, out| {
        let xr = E::acc(&x[r * f..(r + 1) * f], &mut s.a);
        bias_add_row(xr, &b, out);
    });
    Ok((E::wrap(y), l1.shape().clone()))
}

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "fused-bias-add"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s1, ba_fwd(s1, l1, s2, l2))
    }
    fn bwd(
        &self,
        _x: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let db = grad
            .contiguous()?
            .apply_op1_no_bwd(&ColumnSum { f: b.elem_count() })?;
        Ok((Some(grad.clone()), Some(db)))
    }
}

/// Column sums of a contiguous `[N, F]` tensor -> `[F]`, in the compute dtype (blocks of
/// [`SUM_BLOCK_ROWS`] rows, see the module docs), narrowed once.
struct ColumnSum {
    f: usize,
}

fn colsum<E: Elem>(
    f: usize,
    s: &CpuStorage,
    l: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let g = view::<E>("column_sum", s, l)?;
    let n = g.len().checked_div(f).unwrap_or(0);
    let out = block_sums::<E::Acc, _>(n, f, 1, |r, s, part| {
        add_into(part, E::acc(&g[r * f..(r + 1) * f], &mut s.a));
    });
    Ok((E::wrap(E::from_acc(out)), Shape::from(f)))
}

impl CustomOp1 for ColumnSum {
    fn name(&self) -> &'static str {
        "column-sum"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s, colsum(self.f, s, l))
    }
}

/// Fused `x + b`: `x` `[N, F]`, `b` `[F]` -> `[N, F]`, dtype of `x` (16-bit: added in f32,
/// rounded once, as candle's own bf16/f16 add). Gradients: `dx = g` (the same tensor),
/// `db = sum_n g_n` (accumulated in the compute dtype in blocks of [`SUM_BLOCK_ROWS`] rows).
/// Errors: shapes that do not match, mixed or unsupported dtypes.
pub fn bias_add(x: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let f = x.dim(candle_core::D::Minus1)?;
    if b.elem_count() != f {
        candle_core::bail!("bias_add: x {:?} vs bias {:?}", x.dims(), b.dims());
    }
    same_dtype("bias_add", &[("x", x), ("bias", b)])?;
    x.contiguous()?.apply_op2(&b.contiguous()?, BiasAdd)
}

// ---------------------------------------------------------------------------------------------
// Fused causal self-attention (its own file: GEMMs on strided head views of the qkv rows).

mod attention;
pub use attention::{causal_attention, ATTN_BLOCK_ROWS};

// ---------------------------------------------------------------------------------------------
// The Llama family's fused ops (their own files): RMSNorm, rotary embedding packed for the
// attention, SwiGLU gate.

mod rms_norm;
mod rope;
mod swiglu;
pub use rms_norm::rms_norm;
pub use rope::rope_qkv;
pub use swiglu::swiglu;

// ---------------------------------------------------------------------------------------------
// Backward seed: a scalar whose gradient with respect to `y` is exactly `g`.

/// A 0-dim tensor `s` such that `s.backward()` delivers exactly `g` as the gradient of `y`
/// (`y`, `g` of the same shape, float dtype (f32, f64, bf16 or f16) and device): the
/// upstream-gradient seed of unit-level backward. It replaces `(y * g).sum_all().backward()`,
/// which gives the same bits for f32 (`1 * g = g`) but costs two strided broadcast multiplies
/// (also computing an unused gradient for `g`) — about 7 ms per `[1024, 256]` stage output on
/// one core — and about three `y`-sized buffers no memory plan counts. The forward value is a
/// 0-dim zero on `y`'s device (CPU, or CUDA with feature `cuda`): see
/// [`fsdp_kernels::tensor::backward_seed`]. Errors: shape, dtype or device mismatch, an
/// unsupported dtype.
pub fn backward_seed(y: &Tensor, g: &Tensor) -> candle_core::Result<Tensor> {
    fsdp_kernels::tensor::backward_seed(y, g)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` values `scale * U(-1, 1)` (a fixed LCG).
    fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                scale * ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Every kernel's AVX-512 and AVX2 builds give the bits of its baseline build (on a CPU
    /// that has them; the baseline always runs), on lengths with vector tails and on special
    /// values (infinities, NaN, zeros, the clamp edges).
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn isa_builds_give_the_same_bits() {
        let has4 = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512bw");
        let has3 = std::arch::is_x86_feature_detected!("avx2");
        let check = |name: &str, f: &dyn Fn(u8) -> Vec<f32>| {
            let base = bits(&f(0));
            if has3 {
                assert_eq!(bits(&f(3)), base, "{name}: AVX2 build differs");
            }
            if has4 {
                assert_eq!(bits(&f(4)), base, "{name}: AVX-512 build differs");
            }
        };
        for n in [1usize, 7, 16, 61, 1003] {
            let mut x = data(n, 1, 14.0);
            let special = [
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                0.0,
                -0.0,
                10.0,
                -10.0,
                1e30,
                -1e30,
                88.5,
            ];
            let k = special.len().min(n);
            x[..k].copy_from_slice(&special[..k]);
            let (b, g, w) = (data(n, 2, 1.0), data(n, 3, 1.0), data(n, 4, 1.0));
            let y = data(n, 5, 0.5).iter().map(|v| v.abs()).collect::<Vec<_>>();
            check("gelu_fwd", &|l| {
                let mut o = vec![0.0; n];
                match l {
                    0 => gelu_fwd_impl(&x, &b, &mut o),
                    // SAFETY: `check` runs level 3 / 4 only on CPUs with the features.
                    3 => unsafe { gelu_fwd_row::v3(&x, &b, &mut o) },
                    _ => unsafe { gelu_fwd_row::v4(&x, &b, &mut o) },
                }
                o
            });
            check("gelu_bwd", &|l| {
                let (mut o, mut db) = (vec![0.0; n], w.clone());
                match l {
                    0 => gelu_bwd_impl(&x, &b, &g, &mut o, &mut db),
                    3 => unsafe { gelu_bwd_row::v3(&x, &b, &g, &mut o, &mut db) },
                    _ => unsafe { gelu_bwd_row::v4(&x, &b, &g, &mut o, &mut db) },
                }
                o.extend(db);
                o
            });
            // Softmax on finite scores (one with an infinity is a NaN row by design).
            let s = data(n, 6, 40.0);
            check("softmax", &|l| {
                let mut o = vec![0.0; n];
                for sc in [0.3f32, -0.7] {
                    match l {
                        0 => softmax_row_impl(&s, sc, &mut o),
                        3 => unsafe { softmax_row::v3(&s, sc, &mut o) },
                        _ => unsafe { softmax_row::v4(&s, sc, &mut o) },
                    }
                }
                o
            });
            check("softmax_bwd", &|l| {
                let mut o = vec![0.0; n];
                match l {
                    0 => softmax_bwd_row_impl(&y, &g, 0.3, &mut o),
                    3 => unsafe { softmax_bwd_row::v3(&y, &g, 0.3, &mut o) },
                    _ => unsafe { softmax_bwd_row::v4(&y, &g, 0.3, &mut o) },
                }
                o
            });
            let xf = data(n, 7, 3.0);
            check("ln_fwd", &|l| {
                let (mut xc, mut o) = (vec![0.0; n], vec![0.0; n]);
                match l {
                    0 => ln_fwd_row_impl(&xf, &w, &b, 1e-5, &mut xc, &mut o),
                    3 => unsafe { ln_fwd_row::v3(&xf, &w, &b, 1e-5, &mut xc, &mut o) },
                    _ => unsafe { ln_fwd_row::v4(&xf, &w, &b, 1e-5, &mut xc, &mut o) },
                }
                o
            });
            check("ln_bwd", &|l| {
                let (mut h, mut gw, mut o) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
                let mut dwb = [w.clone(), b.clone()].concat();
                match l {
                    0 => ln_bwd_row_impl(&xf, &g, &w, 1e-5, &mut h, &mut gw, &mut o, &mut dwb),
                    3 => unsafe {
                        ln_bwd_row::v3(&xf, &g, &w, 1e-5, &mut h, &mut gw, &mut o, &mut dwb)
                    },
                    _ => unsafe {
                        ln_bwd_row::v4(&xf, &g, &w, 1e-5, &mut h, &mut gw, &mut o, &mut dwb)
                    },
                }
                o.extend(dwb);
                o
            });
            check("lse/ce_bwd", &|l| {
                let mut o = vec![0.0; n];
                let lv = match l {
                    0 => lse_impl(&x[k..]),
                    3 => unsafe { lse::v3(&x[k..]) },
                    _ => unsafe { lse::v4(&x[k..]) },
                };
                let row = &xf;
                let tg = n / 2;
                match l {
                    0 => ce_bwd_row_impl(row, lse_impl(row), 0.7, tg, &mut o),
                    3 => unsafe { ce_bwd_row::v3(row, lse::v3(row), 0.7, tg, &mut o) },
                    _ => unsafe { ce_bwd_row::v4(row, lse::v4(row), 0.7, tg, &mut o) },
                }
                o.push(lv as f32);
                o.push((lv - lv as f32 as f64) as f32);
                o
            });
            check("bias_add/add_into", &|l| {
                let (mut o, mut acc) = (vec![0.0; n], w.clone());
                match l {
                    0 => {
                        bias_add_row_impl(&x, &b, &mut o);
                        add_into_impl(&mut acc, &g);
                    }
                    3 => unsafe {
                        bias_add_row::v3(&x, &b, &mut o);
                        add_into::v3(&mut acc, &g);
                    },
                    _ => unsafe {
                        bias_add_row::v4(&x, &b, &mut o);
                        add_into::v4(&mut acc, &g);
                    },
                }
                o.extend(acc);
                o
            });
        }
    }
}

//! The element types the fused ops store and compute in ([`Elem`], [`Flt`]), the dtype they
//! compute in ([`compute_dtype`]), contiguous storage views, the dtype dispatch of an op's
//! generic body and the mixed-dtype check.

use super::simd::exp_f32;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Tensor};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use std::borrow::Cow;
use std::mem::MaybeUninit;

/// The dtype the fused ops compute in for storage dtype `dtype`: F32 for BF16, F16 and F32;
/// F64 for F64 (any other dtype is returned unchanged; the ops refuse it). It is also the dtype
/// of the scalar [`cross_entropy_sum`](super::cross_entropy_sum) returns, and the dtype of its
/// upstream gradient.
pub fn compute_dtype(dtype: DType) -> DType {
    match dtype {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    }
}

/// The float element types the fused kernels compute in (f32, f64).
pub(super) trait Flt: Copy + Send + Sync + 'static + std::fmt::Debug {
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
pub(super) trait Elem: Copy + Send + Sync + 'static {
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

/// The contiguous element slice of `s` under layout `l`, of storage type `E` (the dtype of the
/// op's first float input): another dtype is a mixed-dtype error naming both.
pub(super) fn view<'a, E: Elem>(
    op: &str,
    s: &'a CpuStorage,
    l: &Layout,
) -> candle_core::Result<&'a [E]> {
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
pub(super) fn acc_view<'a, T: Flt>(
    op: &str,
    s: &'a CpuStorage,
    l: &Layout,
) -> candle_core::Result<&'a [T]> {
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

pub(super) fn u32_view<'a>(
    op: &str,
    s: &'a CpuStorage,
    l: &Layout,
) -> candle_core::Result<&'a [u32]> {
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
            candle_core::CpuStorage::F32(_) => $body::<f32>($($arg),*),
            candle_core::CpuStorage::F64(_) => $body::<f64>($($arg),*),
            candle_core::CpuStorage::BF16(_) => $body::<half::bf16>($($arg),*),
            candle_core::CpuStorage::F16(_) => $body::<half::f16>($($arg),*),
            other => candle_core::bail!(
                "{}: dtype {:?} is not supported (f32, f64, bf16, f16)",
                $op,
                candle_core::backend::BackendStorage::dtype(other)
            ),
        }
    };
}
pub(super) use dispatch;

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

//! Fused CPU custom ops for the GPT hot path, each with a hand-written backward pass that
//! candle's autograd calls: LayerNorm, causal softmax, bias + GELU, summed cross-entropy,
//! token + position embedding, bias add (with its column-sum backward) and the backward seed.
//!
//! Composed from candle primitives, each of these is 5-10 full passes over memory and as many
//! temporaries in the autograd graph; fused, it is one pass forward and one backward. Inputs
//! are made contiguous first (a no-op when they already are) and every op computes row by row,
//! sequentially, so results are deterministic.
//!
//! # Dtypes: f32, f64, and bf16 / f16 storage with f32 math
//!
//! Each op takes CPU tensors of ONE float dtype (token ids and targets are u32):
//! - f32 and f64 are computed in their own precision.
//! - bf16 and f16 (a unit computing in `param_dtype`, mixed precision as in Micikevicius et al.
//!   2018, "Mixed Precision Training", §3) are 16-bit STORAGE only: each input row is widened
//!   exactly to f32, computed by the f32 kernel (same f32 operations in the same row-sequential
//!   order, so the same f32 bits as the f32 op on the widened inputs), and each output element
//!   is narrowed back to the input dtype with round-to-nearest-even (`half`'s `from_f32`, what
//!   candle's `to_dtype` does), the way GPU bf16 kernels keep f32 registers and 16-bit memory.
//!   Reductions (LayerNorm statistics and its `dw`/`db`, softmax sums, bias and embedding
//!   gradients, cross-entropy) accumulate in f32 (cross-entropy's loss in f64), never in 16 bits.
//!   Rows are widened one at a time into a reused scratch buffer (no full-tensor f32 copy),
//!   except the embedding gradient, which is accumulated in an f32 `[V + P, D]` buffer.
//!   So a 16-bit op's output is `round16(f32 op(widen(inputs)))` exactly: each element is
//!   within one rounding (relative `2^-8` for bf16, `2^-11` for f16, or half an f16 subnormal
//!   step, `2^-25`, below f16's normal range) of the f32 op on the same values.
//!   The one backward that reads a 16-bit forward OUTPUT is the causal softmax's (it saves `y`,
//!   already rounded), so its gradient carries that rounding through one dot product too.
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
//! compositions (model_device.rs).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use std::borrow::Cow;

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
    fn div(self, o: Self) -> Self;
    fn abs(self) -> Self;
    fn copysign(self, sign: Self) -> Self;
}

macro_rules! impl_flt {
    ($t:ty, $var:ident, $exp:path) => {
        impl Flt for $t {
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
            fn div(self, o: Self) -> Self {
                self / o
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline(always)]
            fn copysign(self, sign: Self) -> Self {
                <$t>::copysign(self, sign)
            }
        }
    };
}
impl_flt!(f32, F32, exp_f32);
impl_flt!(f64, F64, f64::exp);

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
    fn zero() -> Self;
    /// `src` in compute precision: `src` itself, or widened into `buf` (reused scratch).
    fn acc<'a>(src: &'a [Self], buf: &'a mut Vec<Self::Acc>) -> &'a [Self::Acc];
    /// A whole (small: a weight or bias vector) slice in compute precision.
    fn acc_all(src: &[Self]) -> Cow<'_, [Self::Acc]>;
    /// Runs `f` on the output row `dst` in compute precision: on `dst` itself (as initialised,
    /// zeros), or on `buf` zeroed then narrowed into `dst`.
    fn out_row<F: FnOnce(&mut [Self::Acc])>(dst: &mut [Self], buf: &mut Vec<Self::Acc>, f: F);
    /// A compute-precision vector as storage: moved, or narrowed.
    fn from_acc(v: Vec<Self::Acc>) -> Vec<Self>;
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
            fn zero() -> Self {
                0.0
            }
            #[inline(always)]
            fn acc<'a>(src: &'a [Self], _buf: &'a mut Vec<Self>) -> &'a [Self] {
                src
            }
            fn acc_all(src: &[Self]) -> Cow<'_, [Self]> {
                Cow::Borrowed(src)
            }
            #[inline(always)]
            fn out_row<F: FnOnce(&mut [Self])>(dst: &mut [Self], _buf: &mut Vec<Self>, f: F) {
                f(dst)
            }
            fn from_acc(v: Vec<Self>) -> Vec<Self> {
                v
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
            #[inline(always)]
            fn zero() -> Self {
                <$t>::ZERO
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
            fn out_row<F: FnOnce(&mut [f32])>(dst: &mut [Self], buf: &mut Vec<f32>, f: F) {
                buf.clear();
                buf.resize(dst.len(), 0.0);
                f(buf);
                dst.convert_from_f32_slice(buf);
            }
            fn from_acc(v: Vec<f32>) -> Vec<Self> {
                let mut out = vec![<$t>::ZERO; v.len()];
                out.convert_from_f32_slice(&v);
                out
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
/// `[-87, 88]` (results below `e^-87 = 1.6e-38` are returned as that); NaN stays NaN. Relative
/// error: a few ulp (tested against `f32::exp`).
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

/// `tanh u = sign(u) (1 - e) / (1 + e)`, `e = exp(-2 |u|)`, through [`Flt::exp_fast`]:
/// absolute error within a few ulp of 1 (what GELU needs, as it adds 1).
#[inline(always)]
fn tanh_fast<T: Flt>(u: T) -> T {
    let e = T::of(-2.0).mul(u.abs()).exp_fast();
    let one = T::of(1.0);
    one.sub(e).div(one.add(e)).copysign(u)
}

/// Sum of `xs` with 8 independent accumulators (vectorisable, fixed order: deterministic).
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
#[inline]
fn row_stats<T: Flt>(row: &[T], eps: f64, scratch: &mut [T]) -> (T, T) {
    let d = row.len() as f64;
    let mean = T::of(lane_sum(row).f() / d);
    for (c, &x) in scratch.iter_mut().zip(row) {
        *c = x.sub(mean);
    }
    let var = lane_dot(scratch, scratch).f() / d;
    (mean, T::of(1.0 / (var + eps).sqrt()))
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
    let mut y = vec![E::zero(); x.len()];
    let mut xc = vec![<E::Acc as Flt>::zero(); d];
    let (mut xbuf, mut ybuf) = (Vec::new(), Vec::new());
    for (row, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
        let row = E::acc(row, &mut xbuf);
        let (_, rstd) = row_stats(row, eps, &mut xc);
        E::out_row(yr, &mut ybuf, |yr| {
            for j in 0..d {
                yr[j] = xc[j].mul(rstd).mul(w[j]).add(b[j]);
            }
        });
    }
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
/// dtype, rows in order). `dx = rstd * (g w - mean(g w) - xhat * mean(g w xhat))`.
struct LayerNormBwd {
    eps: f64,
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
    let n = x.len() / d;
    let zero = <E::Acc as Flt>::zero();
    let mut out = vec![E::zero(); (n + 2) * d];
    let (dx, rest) = out.split_at_mut(n * d);
    let (dw_out, db_out) = rest.split_at_mut(d);
    let (mut dw, mut db) = (vec![zero; d], vec![zero; d]);
    let mut xhat = vec![zero; d];
    let mut gw = vec![zero; d];
    let (mut xbuf, mut gbuf, mut obuf) = (Vec::new(), Vec::new(), Vec::new());
    for ((xr, gr), dxr) in x
        .chunks_exact(d)
        .zip(g.chunks_exact(d))
        .zip(dx.chunks_exact_mut(d))
    {
        let xr = E::acc(xr, &mut xbuf);
        let gr = E::acc(gr, &mut gbuf);
        let (_, rstd) = row_stats(xr, eps, &mut xhat);
        for j in 0..d {
            xhat[j] = xhat[j].mul(rstd);
            gw[j] = gr[j].mul(w[j]);
            dw[j] = dw[j].add(gr[j].mul(xhat[j]));
            db[j] = db[j].add(gr[j]);
        }
        let m_gw = <E::Acc as Flt>::of(lane_sum(&gw).f() / d as f64);
        let m_gwx = <E::Acc as Flt>::of(lane_dot(&gw, &xhat).f() / d as f64);
        E::out_row(dxr, &mut obuf, |dxr| {
            for j in 0..d {
                dxr[j] = rstd.mul(gw[j].sub(m_gw).sub(xhat[j].mul(m_gwx)));
            }
        });
    }
    E::out_row(dw_out, &mut obuf, |o| o.copy_from_slice(&dw));
    E::out_row(db_out, &mut obuf, |o| o.copy_from_slice(&db));
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
/// docs). Gradients flow to `x`, `w` and `b`. Errors: mixed or unsupported dtypes, shapes that
/// do not match.
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

fn csm_fwd<E: Elem>(
    scale: f64,
    s: &CpuStorage,
    l: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let x = view::<E>("causal_softmax", s, l)?;
    let t = *l.dims().last().unwrap_or(&1);
    let sc = <E::Acc as Flt>::of(scale);
    let mut y = vec![E::zero(); x.len()];
    let (mut xbuf, mut ybuf) = (Vec::new(), Vec::new());
    for (r, (xr, yr)) in x.chunks_exact(t).zip(y.chunks_exact_mut(t)).enumerate() {
        let i = r % t;
        let valid = E::acc(&xr[..=i], &mut xbuf);
        let mut m = valid[0];
        for &v in &valid[1..] {
            m = m.max(v);
        }
        let m = m.mul(sc);
        E::out_row(yr, &mut ybuf, |yr| {
            let out = &mut yr[..=i];
            for (o, &v) in out.iter_mut().zip(valid) {
                *o = v.mul(sc).sub(m).exp_fast();
            }
            let inv = <E::Acc as Flt>::of(1.0 / lane_sum(out).f());
            for v in out.iter_mut() {
                *v = v.mul(inv);
            }
        });
    }
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
    let mut dx = vec![E::zero(); y.len()];
    let (mut ybuf, mut gbuf, mut obuf) = (Vec::new(), Vec::new(), Vec::new());
    for (r, ((yr, gr), dr)) in y
        .chunks_exact(t)
        .zip(g.chunks_exact(t))
        .zip(dx.chunks_exact_mut(t))
        .enumerate()
    {
        let i = r % t;
        let yr = E::acc(&yr[..=i], &mut ybuf);
        let gr = E::acc(&gr[..=i], &mut gbuf);
        let dot = lane_dot(gr, yr);
        E::out_row(dr, &mut obuf, |dr| {
            for j in 0..=i {
                dr[j] = sc.mul(yr[j]).mul(gr[j].sub(dot));
            }
        });
    }
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
/// 0), dtype of `s` (f32, f64, or bf16/f16 computed in f32). Gradient flows to `s`. Errors:
/// unsupported dtype, last two dims not equal.
pub fn causal_softmax(s: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    let dims = s.dims();
    if dims.len() < 2 || dims[dims.len() - 1] != dims[dims.len() - 2] {
        candle_core::bail!("causal_softmax: scores must be [..., T, T], got {dims:?}");
    }
    s.contiguous()?.apply_op1(CausalSoftmax { scale })
}

// ---------------------------------------------------------------------------------------------
// Bias + GELU, tanh approximation (Hendrycks & Gimpel 2016, as GPT-2):
// gelu(z) = 0.5 z (1 + tanh(c (z + 0.044715 z^3))), c = sqrt(2 / pi).

const GELU_C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
const GELU_A: f64 = 0.044_715;

struct BiasGelu;

fn bg_fwd<E: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    type A<E> = <E as Elem>::Acc;
    let x = view::<E>("bias_gelu", s1, l1)?;
    let b = E::acc_all(view::<E>("bias_gelu", s2, l2)?);
    let f = b.len();
    let (c, a, half, one) = (
        A::<E>::of(GELU_C),
        A::<E>::of(GELU_A),
        A::<E>::of(0.5),
        A::<E>::of(1.0),
    );
    let mut y = vec![E::zero(); x.len()];
    let (mut xbuf, mut ybuf) = (Vec::new(), Vec::new());
    for (row, yr) in x.chunks_exact(f).zip(y.chunks_exact_mut(f)) {
        let row = E::acc(row, &mut xbuf);
        E::out_row(yr, &mut ybuf, |yr| {
            for j in 0..f {
                let z = row[j].add(b[j]);
                let u = c.mul(z.add(a.mul(z).mul(z).mul(z)));
                yr[j] = half.mul(z).mul(one.add(tanh_fast(u)));
            }
        });
    }
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
/// rows `dz = g * gelu'(x + b)`, then `db = sum_n dz` (rows added in order, in the compute
/// dtype, from the unrounded `dz`),
/// `gelu'(z) = 0.5 (1 + tanh u) + 0.5 z (1 - tanh^2 u) c (1 + 3 a z^2)`.
struct BiasGeluBwd;

fn bg_bwd<E: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    type A<E> = <E as Elem>::Acc;
    let x = view::<E>("bias_gelu_bwd", s1, l1)?;
    let b = E::acc_all(view::<E>("bias_gelu_bwd", s2, l2)?);
    let g = view::<E>("bias_gelu_bwd", s3, l3)?;
    let f = b.len();
    let (c, a, a3, half, one) = (
        A::<E>::of(GELU_C),
        A::<E>::of(GELU_A),
        A::<E>::of(3.0 * GELU_A),
        A::<E>::of(0.5),
        A::<E>::of(1.0),
    );
    let n = x.len() / f;
    let mut out = vec![E::zero(); (n + 1) * f];
    let (dz, db_out) = out.split_at_mut(n * f);
    let mut db = vec![A::<E>::zero(); f];
    let (mut xbuf, mut gbuf, mut obuf) = (Vec::new(), Vec::new(), Vec::new());
    for ((row, gr), dr) in x
        .chunks_exact(f)
        .zip(g.chunks_exact(f))
        .zip(dz.chunks_exact_mut(f))
    {
        let row = E::acc(row, &mut xbuf);
        let gr = E::acc(gr, &mut gbuf);
        E::out_row(dr, &mut obuf, |dr| {
            for (((o, &xv), &bv), &gv) in dr.iter_mut().zip(row).zip(b.iter()).zip(gr) {
                let z = xv.add(bv);
                let z2 = z.mul(z);
                let th = tanh_fast(c.mul(z.add(a.mul(z2).mul(z))));
                let d = half.mul(one.add(th)).add(
                    half.mul(z)
                        .mul(one.sub(th.mul(th)))
                        .mul(c)
                        .mul(one.add(a3.mul(z2))),
                );
                *o = gv.mul(d);
            }
            for (acc, &v) in db.iter_mut().zip(dr.iter()) {
                *acc = acc.add(v);
            }
        });
    }
    E::out_row(db_out, &mut obuf, |o| o.copy_from_slice(&db));
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
/// rounded to 16 bits before the GELU). Gradients flow to `x` and `b`. Errors: mixed or
/// unsupported dtypes, shapes.
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

fn ce_fwd<E: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let z = view::<E>("cross_entropy", s1, l1)?;
    let t = u32_view("cross_entropy", s2, l2)?;
    let v = *l1.dims().last().unwrap_or(&1);
    let mut total = 0.0f64;
    let mut zbuf = Vec::new();
    for (row, &tg) in z.chunks_exact(v).zip(t) {
        if tg as usize >= v {
            candle_core::bail!("cross_entropy: target {tg} >= vocab size {v}");
        }
        let row = E::acc(row, &mut zbuf);
        total += lse(row) - row[tg as usize].f();
    }
    // The loss is returned in the compute dtype (F32 for 16-bit logits), never rounded to 16
    // bits.
    Ok((
        <E::Acc as Flt>::wrap(vec![<E::Acc as Flt>::of(total)]),
        Shape::from(()),
    ))
}

/// `log sum_j exp(z_j)` with the max subtracted, accumulated in f64.
#[inline]
fn lse<T: Flt>(row: &[T]) -> f64 {
    let m = row.iter().fold(f64::NEG_INFINITY, |m, v| m.max(v.f()));
    m + row.iter().map(|v| (v.f() - m).exp()).sum::<f64>().ln()
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
    let mut dz = vec![E::zero(); z.len()];
    let (mut zbuf, mut obuf) = (Vec::new(), Vec::new());
    for ((row, &tg), dr) in z.chunks_exact(v).zip(t).zip(dz.chunks_exact_mut(v)) {
        let row = E::acc(row, &mut zbuf);
        let l = lse(row);
        E::out_row(dr, &mut obuf, |dr| {
            for (j, (o, x)) in dr.iter_mut().zip(row).enumerate() {
                let p = (x.f() - l).exp();
                let d = if j == tg as usize { p - 1.0 } else { p };
                *o = <E::Acc as Flt>::of(g * d);
            }
        });
    }
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
/// `sum_n (logsumexp(logits_n) - logits_n[targets_n])` in nats (accumulated in f64), of dtype
/// [`compute_dtype`]`(logits.dtype())`: F32 for f32, bf16 and f16 logits (a 16-bit loss is not
/// rounded to 16 bits), F64 for f64. Gradient flows to `logits`, in the logits' dtype.
/// Errors: a target `>= V`, `N` mismatch, unsupported dtype.
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
    let mut h = vec![E::zero(); ids.len() * d];
    let (mut tbuf, mut pbuf, mut obuf) = (Vec::new(), Vec::new(), Vec::new());
    for (n, (&id, hr)) in ids.iter().zip(h.chunks_exact_mut(d)).enumerate() {
        if id as usize >= v {
            candle_core::bail!("Embed: token id {id} >= vocab_size {v}");
        }
        let tok = E::acc(&wte[id as usize * d..(id as usize + 1) * d], &mut tbuf);
        let p = n % t;
        let pos = E::acc(&wpe[p * d..(p + 1) * d], &mut pbuf);
        E::out_row(hr, &mut obuf, |hr| {
            for ((o, a), b) in hr.iter_mut().zip(tok).zip(pos) {
                *o = a.add(*b);
            }
        });
    }
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
        let row = &mut dwte[id as usize * d..(id as usize + 1) * d];
        for (a, b) in row.iter_mut().zip(gr) {
            *a = a.add(*b);
        }
        let pos = n % t;
        let row = &mut dwpe[pos * d..(pos + 1) * d];
        for (a, b) in row.iter_mut().zip(gr) {
            *a = a.add(*b);
        }
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
// broadcast dim with a strided sum; here the bias gradient is a row-by-row (vectorised) sum and
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
    let mut y = vec![E::zero(); x.len()];
    let (mut xbuf, mut ybuf) = (Vec::new(), Vec::new());
    for (xr, yr) in x.chunks_exact(f).zip(y.chunks_exact_mut(f)) {
        let xr = E::acc(xr, &mut xbuf);
        E::out_row(yr, &mut ybuf, |yr| {
            for j in 0..f {
                yr[j] = xr[j].add(b[j]);
            }
        });
    }
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

/// Column sums of a contiguous `[N, F]` tensor -> `[F]`, rows added in order in the compute
/// dtype, narrowed once.
struct ColumnSum {
    f: usize,
}

fn colsum<E: Elem>(
    f: usize,
    s: &CpuStorage,
    l: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let g = view::<E>("column_sum", s, l)?;
    let mut out = vec![<E::Acc as Flt>::zero(); f];
    let mut gbuf = Vec::new();
    for row in g.chunks_exact(f) {
        let row = E::acc(row, &mut gbuf);
        for j in 0..f {
            out[j] = out[j].add(row[j]);
        }
    }
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
/// `db = sum_n g_n` (accumulated in the compute dtype). Errors: shapes that do not match, mixed
/// or unsupported dtypes.
pub fn bias_add(x: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let f = x.dim(candle_core::D::Minus1)?;
    if b.elem_count() != f {
        candle_core::bail!("bias_add: x {:?} vs bias {:?}", x.dims(), b.dims());
    }
    same_dtype("bias_add", &[("x", x), ("bias", b)])?;
    x.contiguous()?.apply_op2(&b.contiguous()?, BiasAdd)
}

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

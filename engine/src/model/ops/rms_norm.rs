//! Fused RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4):
//! `y = x / sqrt(mean(x^2) + eps) * w` over the last dim, one pass forward and one backward.
//!
//! Backward, with `r = 1 / sqrt(mean(x^2) + eps)`, `xhat = x r` and the output gradient `g`
//! (the paper's eq. 9-10 for a gain without bias): `dw = sum_n g xhat` and
//! `dx = r (g w - xhat mean(g w xhat))`. The op keeps nothing for backward beyond its inputs
//! (the backward recomputes `r` from `x`); its output is the only tensor it adds to the graph.

use super::elem::{dispatch, same_dtype, view, Elem, Flt};
use super::rows::{norm_bwd_rows, norm_fwd_rows, NormBwdRow};
use super::simd::{lane_dot, simd_kernel};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};

struct RmsNorm {
    eps: f64,
}

/// `1 / sqrt(mean(x^2) + eps)` of one row: the sum of squares with 8 lanes ([`lane_dot`]),
/// the mean, `+ eps`, the square root and the reciprocal in f64, rounded once to `T`.
#[inline(always)]
fn rms_rstd<T: Flt>(x: &[T], eps: f64) -> T {
    let ms = lane_dot(x, x).f() / x.len() as f64;
    T::of(1.0 / (ms + eps).sqrt())
}

simd_kernel!(
    /// One RMSNorm row: `y = x r w`.
    fn rms_fwd_row = rms_fwd_row_impl(x: &[T], w: &[T], eps: f64, y: &mut [T])
);
#[inline(always)]
fn rms_fwd_row_impl<T: Flt>(x: &[T], w: &[T], eps: f64, y: &mut [T]) {
    let r = rms_rstd(x, eps);
    for ((o, &xv), &wv) in y.iter_mut().zip(x).zip(w) {
        *o = xv.mul(r).mul(wv);
    }
}

fn rms_fwd<E: Elem>(
    eps: f64,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let x = view::<E>("rms_norm", s1, l1)?;
    let w = E::acc_all(view::<E>("rms_norm", s2, l2)?);
    let y = norm_fwd_rows(x, w.len(), |row, _, out| rms_fwd_row(row, &w, eps, out));
    Ok((E::wrap(y), l1.shape().clone()))
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s1, rms_fwd(self.eps, s1, l1, s2, l2))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let n = x.elem_count() / w.elem_count().max(1);
        let packed = x.apply_op3_no_bwd(w, &grad.contiguous()?, &RmsNormBwd { eps: self.eps })?;
        let dx = packed.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = packed.get(n)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// Backward of RMSNorm: inputs `(x [N, D], w [D], g [N, D])`, output packed `[N + 1, D]` =
/// rows `dx`, then `dw = sum_n g xhat` (accumulated in the compute dtype in blocks of
/// [`SUM_BLOCK_ROWS`](super::SUM_BLOCK_ROWS) rows, see the module docs of [`super`]).
struct RmsNormBwd {
    eps: f64,
}

simd_kernel!(
    /// One RMSNorm backward row: `dx` from `x`, `g`; adds `g xhat` to `dw`. `xhat`, `gw` (`D`
    /// elements) are scratch.
    fn rms_bwd_row = rms_bwd_row_impl(
        row: NormBwdRow<'_, T>,
        xhat: &mut [T],
        gw: &mut [T],
        dx: &mut [T],
        dw: &mut [T],
    )
);
#[inline(always)]
fn rms_bwd_row_impl<T: Flt>(
    row: NormBwdRow<'_, T>,
    xhat: &mut [T],
    gw: &mut [T],
    dx: &mut [T],
    dw: &mut [T],
) {
    let NormBwdRow { x, g, w, eps } = row;
    let d = x.len();
    let r = rms_rstd(x, eps);
    for j in 0..d {
        xhat[j] = x[j].mul(r);
        gw[j] = g[j].mul(w[j]);
        dw[j] = dw[j].add(g[j].mul(xhat[j]));
    }
    let m = T::of(lane_dot(gw, xhat).f() / d as f64);
    for ((o, &a), &h) in dx.iter_mut().zip(gw.iter()).zip(xhat.iter()) {
        *o = r.mul(a.sub(h.mul(m)));
    }
}

fn rms_bwd<E: Elem>(
    eps: f64,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let x = view::<E>("rms_norm_bwd", s1, l1)?;
    let w = E::acc_all(view::<E>("rms_norm_bwd", s2, l2)?);
    let g = view::<E>("rms_norm_bwd", s3, l3)?;
    Ok(norm_bwd_rows(x, g, w.len(), 1, |x, g, xhat, gw, dx, dw| {
        rms_bwd_row(NormBwdRow { x, g, w: &w, eps }, xhat, gw, dx, dw)
    }))
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "fused-rms-norm-bwd"
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
        dispatch!(self.name(), s1, rms_bwd(self.eps, s1, l1, s2, l2, s3, l3))
    }
}

/// Fused RMSNorm over the last dim (Zhang & Sennrich 2019): `x` `[N, D]` (or any shape whose
/// last dim is `D`), gain `w` `[D]` -> `x / sqrt(mean(x^2) + eps) * w`, shape and dtype of `x`
/// (f32, f64, or bf16/f16 computed in f32 and rounded once, see the module docs of
/// [`super`]). The mean of squares is accumulated in the compute dtype with 8 lanes and the
/// reciprocal square root taken in f64, then rounded to the compute dtype. Gradients flow to
/// `x` and `w` (`dw` summed over rows in blocks of
/// [`SUM_BLOCK_ROWS`](super::SUM_BLOCK_ROWS); the same bits for any thread count). Errors:
/// `x`'s last dim not `D`, mixed or unsupported dtypes.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let d = w.elem_count();
    if x.dim(candle_core::D::Minus1)? != d {
        candle_core::bail!("rms_norm: x {:?} vs weight [{d}]", x.dims());
    }
    same_dtype("rms_norm", &[("x", x), ("weight", w)])?;
    x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps })
}

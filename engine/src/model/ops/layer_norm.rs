//! LayerNorm (Ba, Kiros & Hinton 2016): y = (x - mean) * rstd * w + b over the last dim.

use super::elem::{dispatch, same_dtype, view, Elem, Flt};
use super::rows::{norm_bwd_rows, norm_fwd_rows, NormBwdRow};
use super::simd::{lane_dot, lane_sum, simd_kernel};
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

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
    let y = norm_fwd_rows(x, w.len(), |row, xc, out| {
        ln_fwd_row(row, &w, &b, eps, xc, out)
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
/// dtype in blocks of [`SUM_BLOCK_ROWS`](super::SUM_BLOCK_ROWS) rows, see the module docs of
/// [`super`]).
/// `dx = rstd * (g w - mean(g w) - xhat * mean(g w xhat))`.
struct LayerNormBwd {
    eps: f64,
}

simd_kernel!(
    /// One LayerNorm backward row: `dx` from `x`, `g`; adds `g * xhat` to `dw` and `g` to `db`.
    /// `xhat`, `gw` (`D` elements) are scratch.
    fn ln_bwd_row = ln_bwd_row_impl(
        row: NormBwdRow<'_, T>,
        xhat: &mut [T],
        gw: &mut [T],
        dx: &mut [T],
        dwb: &mut [T],
    )
);
#[inline(always)]
fn ln_bwd_row_impl<T: Flt>(
    row: NormBwdRow<'_, T>,
    xhat: &mut [T],
    gw: &mut [T],
    dx: &mut [T],
    dwb: &mut [T],
) {
    let NormBwdRow { x, g, w, eps } = row;
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
    Ok(norm_bwd_rows(
        x,
        g,
        w.len(),
        2,
        |x, g, xhat, gw, dx, dwb| ln_bwd_row(NormBwdRow { x, g, w: &w, eps }, xhat, gw, dx, dwb),
    ))
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
/// docs of [`super`]). Gradients flow to `x`, `w` and `b` (`dw`, `db` summed over rows in blocks of
/// [`SUM_BLOCK_ROWS`](super::SUM_BLOCK_ROWS)). Errors: mixed or unsupported dtypes, shapes
/// that do not match.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ops::simd::isa;

    /// The LayerNorm kernels' ISA builds give the same bits.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn isa_builds_give_the_same_bits() {
        for isa::Inputs { n, b, g, w, xf, .. } in isa::inputs() {
            isa::check("ln_fwd", &|l| {
                let (mut xc, mut o) = (vec![0.0; n], vec![0.0; n]);
                match l {
                    0 => ln_fwd_row_impl(&xf, &w, &b, 1e-5, &mut xc, &mut o),
                    // SAFETY: `check` runs level 3 / 4 only on CPUs with the features.
                    3 => unsafe { ln_fwd_row::v3(&xf, &w, &b, 1e-5, &mut xc, &mut o) },
                    _ => unsafe { ln_fwd_row::v4(&xf, &w, &b, 1e-5, &mut xc, &mut o) },
                }
                o
            });
            isa::check("ln_bwd", &|l| {
                let (mut scratch, mut o) = (vec![0.0; n], vec![0.0; n]);
                let mut gw = vec![0.0; n];
                let mut dwb = [w.clone(), b.clone()].concat();
                let row = NormBwdRow {
                    x: &xf,
                    g: &g,
                    w: &w,
                    eps: 1e-5,
                };
                match l {
                    0 => ln_bwd_row_impl(row, &mut scratch, &mut gw, &mut o, &mut dwb),
                    3 => unsafe { ln_bwd_row::v3(row, &mut scratch, &mut gw, &mut o, &mut dwb) },
                    _ => unsafe { ln_bwd_row::v4(row, &mut scratch, &mut gw, &mut o, &mut dwb) },
                }
                o.extend(dwb);
                o
            });
        }
    }
}

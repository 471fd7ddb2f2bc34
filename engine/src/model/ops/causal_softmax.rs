//! Causal softmax: y[i, j] = softmax_j(scale * s[i, j]) over j <= i, 0 for j > i, rows i taken
//! modulo T in a [..., T, T] tensor (Vaswani et al. 2017, §3.2.1, with the decoder mask).

use super::elem::{dispatch, view, Elem, Flt};
use super::rows::map_rows;
use super::simd::{lane_dot, lane_extreme, lane_sum, simd_kernel};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};

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
/// [`exp_f32`](super::exp_f32) in f32, the row sum by 8 fixed lanes, one f64 reciprocal.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ops::simd::isa;

    /// The softmax kernels' ISA builds give the same bits.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn isa_builds_give_the_same_bits() {
        for isa::Inputs { n, g, y, s, .. } in isa::inputs() {
            // Softmax on finite scores (one with an infinity is a NaN row by design).
            isa::check("softmax", &|l| {
                let mut o = vec![0.0; n];
                for sc in [0.3f32, -0.7] {
                    match l {
                        0 => softmax_row_impl(&s, sc, &mut o),
                        // SAFETY: `check` runs level 3 / 4 only on CPUs with the features.
                        3 => unsafe { softmax_row::v3(&s, sc, &mut o) },
                        _ => unsafe { softmax_row::v4(&s, sc, &mut o) },
                    }
                }
                o
            });
            isa::check("softmax_bwd", &|l| {
                let mut o = vec![0.0; n];
                match l {
                    0 => softmax_bwd_row_impl(&y, &g, 0.3, &mut o),
                    3 => unsafe { softmax_bwd_row::v3(&y, &g, 0.3, &mut o) },
                    _ => unsafe { softmax_bwd_row::v4(&y, &g, 0.3, &mut o) },
                }
                o
            });
        }
    }
}

//! Fused SwiGLU gate (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6, the Swish_1 =
//! SiLU gate of Llama's MLP): `y = silu(g) * u` with `silu(g) = g sigmoid(g)` (Hendrycks &
//! Gimpel 2016; Ramachandran et al. 2017), one pass forward and one backward.
//!
//! Computed as `silu(g) = g / (1 + e^(-g))` with [`exp_f32`](super::exp_f32) in f32 (the std
//! `exp` in f64), and in backward, with `e = e^(-g)`, `s = 1 / (1 + e)` and `1 - s = e s` (no
//! cancellation):
//! `silu'(g) = s (1 + g e s)`, `dg = dy u silu'(g)`, `du = dy silu(g)`. The op keeps nothing
//! for backward beyond its inputs `g` and `u` (the matmul outputs the graph keeps anyway); its
//! output is the only tensor it adds.

use super::elem::{dispatch, same_dtype, view, Elem, Flt};
use super::rows::map_rows;
use super::simd::simd_kernel;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};

struct SwiGlu;

simd_kernel!(
    /// `y[j] = silu(g[j]) u[j]`.
    fn swiglu_fwd_row = swiglu_fwd_impl(g: &[T], u: &[T], y: &mut [T])
);
#[inline(always)]
fn swiglu_fwd_impl<T: Flt>(g: &[T], u: &[T], y: &mut [T]) {
    let one = T::of(1.0);
    for ((o, &gv), &uv) in y.iter_mut().zip(g).zip(u) {
        let e = T::zero().sub(gv).exp_fast();
        *o = gv.div(one.add(e)).mul(uv);
    }
}

fn sg_fwd<E: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let g = view::<E>("swiglu", s1, l1)?;
    let u = view::<E>("swiglu", s2, l2)?;
    if g.len() != u.len() {
        candle_core::bail!("swiglu: gate has {} elements, up {}", g.len(), u.len());
    }
    let f = *l1.dims().last().unwrap_or(&1);
    let n = g.len().checked_div(f).unwrap_or(0);
    let y = map_rows::<E, _>(n, f, 0, |r, s, out| {
        let gr = E::acc(&g[r * f..(r + 1) * f], &mut s.a);
        let ur = E::acc(&u[r * f..(r + 1) * f], &mut s.b);
        swiglu_fwd_row(gr, ur, out);
    });
    Ok((E::wrap(y), l1.shape().clone()))
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "fused-swiglu"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s1, sg_fwd(s1, l1, s2, l2))
    }
    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let f = g.dim(candle_core::D::Minus1)?;
        let n = g.elem_count() / f.max(1);
        let packed = g
            .apply_op3_no_bwd(u, &grad.contiguous()?, &SwiGluBwd)?
            .reshape((2 * n, f))?;
        let dg = packed.narrow(0, 0, n)?.reshape(g.shape())?;
        let du = packed.narrow(0, n, n)?.reshape(u.shape())?;
        Ok((Some(dg), Some(du)))
    }
}

/// Backward of the SwiGLU gate: inputs `(g [N, F], u [N, F], dy [N, F])`, output packed
/// `[2N, F]`: rows `dg = dy u silu'(g)`, then rows `du = dy silu(g)`.
struct SwiGluBwd;

simd_kernel!(
    /// `dg[j] = dy[j] u[j] silu'(g[j])`.
    fn swiglu_dg_row = swiglu_dg_impl(g: &[T], u: &[T], dy: &[T], dg: &mut [T])
);
#[inline(always)]
fn swiglu_dg_impl<T: Flt>(g: &[T], u: &[T], dy: &[T], dg: &mut [T]) {
    let one = T::of(1.0);
    for (((o, &gv), &uv), &dv) in dg.iter_mut().zip(g).zip(u).zip(dy) {
        let e = T::zero().sub(gv).exp_fast();
        let s = one.div(one.add(e));
        let d = s.mul(one.add(gv.mul(e.mul(s))));
        *o = dv.mul(uv).mul(d);
    }
}

simd_kernel!(
    /// `du[j] = dy[j] silu(g[j])`.
    fn swiglu_du_row = swiglu_du_impl(g: &[T], dy: &[T], du: &mut [T])
);
#[inline(always)]
fn swiglu_du_impl<T: Flt>(g: &[T], dy: &[T], du: &mut [T]) {
    let one = T::of(1.0);
    for ((o, &gv), &dv) in du.iter_mut().zip(g).zip(dy) {
        let e = T::zero().sub(gv).exp_fast();
        *o = dv.mul(gv.div(one.add(e)));
    }
}

fn sg_bwd<E: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let g = view::<E>("swiglu_bwd", s1, l1)?;
    let u = view::<E>("swiglu_bwd", s2, l2)?;
    let dy = view::<E>("swiglu_bwd", s3, l3)?;
    if g.len() != u.len() || g.len() != dy.len() {
        candle_core::bail!(
            "swiglu_bwd: gate {}, up {} and gradient {} elements differ",
            g.len(),
            u.len(),
            dy.len()
        );
    }
    let f = *l1.dims().last().unwrap_or(&1);
    let n = g.len().checked_div(f).unwrap_or(0);
    let out = map_rows::<E, _>(2 * n, f, 0, |r, s, out| {
        let i = r % n;
        let gr = E::acc(&g[i * f..(i + 1) * f], &mut s.a);
        let dr = E::acc(&dy[i * f..(i + 1) * f], &mut s.c);
        if r < n {
            let ur = E::acc(&u[i * f..(i + 1) * f], &mut s.b);
            swiglu_dg_row(gr, ur, dr, out);
        } else {
            swiglu_du_row(gr, dr, out);
        }
    });
    Ok((E::wrap(out), Shape::from((2 * n, f))))
}

impl CustomOp3 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "fused-swiglu-bwd"
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
        dispatch!(self.name(), s1, sg_bwd(s1, l1, s2, l2, s3, l3))
    }
}

/// Fused SwiGLU gate (Shazeer 2020): gate `g` and up `u` `[N, F]` (any equal shapes) ->
/// `silu(g) * u`, shape and dtype of `g` (f32, f64, or bf16/f16 computed in f32 and rounded
/// once, see the module docs of [`super`]). Gradients flow to `g` and `u`. Every element is
/// independent of the others, so the bits do not depend on the thread count.
/// Errors: shapes that differ, mixed or unsupported dtypes.
pub fn swiglu(g: &Tensor, u: &Tensor) -> candle_core::Result<Tensor> {
    if g.dims() != u.dims() {
        candle_core::bail!("swiglu: gate {:?} vs up {:?}", g.dims(), u.dims());
    }
    same_dtype("swiglu", &[("gate", g), ("up", u)])?;
    g.contiguous()?.apply_op2(&u.contiguous()?, SwiGlu)
}

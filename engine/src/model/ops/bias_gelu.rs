//! Bias + GELU, tanh approximation (Hendrycks & Gimpel 2016, as GPT-2):
//! gelu(z) = 0.5 z (1 + tanh(c (z + 0.044715 z^3))), c = sqrt(2 / pi),
//! computed as z * sigmoid(2u) = z / (1 + e^(-2u)), u = c z (1 + 0.044715 z^2): the same
//! function (0.5 (1 + tanh u) = 1 / (1 + e^(-2u))), one exp and one division, and without the
//! cancellation of 1 + tanh u for negative z.

use super::elem::{dispatch, same_dtype, view, Elem, Flt};
use super::rows::{map_rows, map_rows_sums};
use super::simd::simd_kernel;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};

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
/// unrounded `dz`, in blocks of [`SUM_BLOCK_ROWS`](super::SUM_BLOCK_ROWS) rows), with
/// `s = 1 / (1 + e^(-2u))`:
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
/// in blocks of [`SUM_BLOCK_ROWS`](super::SUM_BLOCK_ROWS)).
///
/// Computed as `z / (1 + e^(-2u))`, `u = c z (1 + a z^2)` (the tanh form rewritten through
/// `0.5 (1 + tanh u) = sigmoid(2u)`: one exp, one division, no cancellation of `1 + tanh u`
/// for negative `z`), with [`exp_f32`](super::exp_f32) in f32; the derivative is
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ops::simd::isa;

    /// The GELU kernels' ISA builds give the same bits.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn isa_builds_give_the_same_bits() {
        for isa::Inputs { n, x, b, g, w, .. } in isa::inputs() {
            isa::check("gelu_fwd", &|l| {
                let mut o = vec![0.0; n];
                match l {
                    0 => gelu_fwd_impl(&x, &b, &mut o),
                    // SAFETY: `check` runs level 3 / 4 only on CPUs with the features.
                    3 => unsafe { gelu_fwd_row::v3(&x, &b, &mut o) },
                    _ => unsafe { gelu_fwd_row::v4(&x, &b, &mut o) },
                }
                o
            });
            isa::check("gelu_bwd", &|l| {
                let (mut o, mut db) = (vec![0.0; n], w.clone());
                match l {
                    0 => gelu_bwd_impl(&x, &b, &g, &mut o, &mut db),
                    3 => unsafe { gelu_bwd_row::v3(&x, &b, &g, &mut o, &mut db) },
                    _ => unsafe { gelu_bwd_row::v4(&x, &b, &g, &mut o, &mut db) },
                }
                o.extend(db);
                o
            });
        }
    }
}

//! Summed cross-entropy: loss = sum_n (logsumexp(z_n) - z_n[t_n]); dz = g (softmax(z) - onehot).

use super::elem::{acc_view, compute_dtype, dispatch, u32_view, view, Elem, Flt};
use super::rows::{map_rows, parallel, ROW_TASK_ELEMS};
use super::simd::{exp_f64, lane_extreme, simd_kernel};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ops::simd::isa;

    /// The log-sum-exp and cross-entropy backward kernels' ISA builds give the same bits.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn isa_builds_give_the_same_bits() {
        for isa::Inputs { n, k, x, xf, .. } in isa::inputs() {
            isa::check("lse/ce_bwd", &|l| {
                let mut o = vec![0.0; n];
                let lv = match l {
                    0 => lse_impl(&x[k..]),
                    // SAFETY: `check` runs level 3 / 4 only on CPUs with the features.
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
        }
    }
}

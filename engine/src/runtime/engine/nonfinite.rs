//! Non-finite gradients and losses: the report that names the step, the parameters and the
//! ranks whose contribution held the values, the per-contribution checks made before each
//! reduction, and what an unapplied step leaves behind (zeroed gradient shards). Used by the
//! end of the backward phase and by clipping.

use super::RankEngine;
use crate::error::{EngineError, Result};
use crate::runtime::staged::StagedModel;
use fsdp_comm::OwnedBuf;
use fsdp_kernels::tensor::TensorKernels;
use serde::{Deserialize, Serialize};

/// One parameter whose reduced gradient held an infinite or NaN element.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NonFiniteParam {
    /// The parameter's name in the model spec (its original, e.g. Hugging Face, name).
    pub name: String,
    /// Ranks whose own contribution (their local gradient, before the reduction summed the
    /// ranks' contributions) held a non-finite element. Empty: every contribution was finite
    /// and their sum overflowed.
    pub ranks: Vec<usize>,
}

/// Why a step was skipped or refused: identical on every rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NonFiniteReport {
    /// 1-based step.
    pub step: u64,
    /// The world's mean loss of the step (may itself be infinite or NaN).
    pub loss: f64,
    /// Ranks whose own loss sum was not finite, with that value.
    pub rank_losses: Vec<(usize, f64)>,
    /// Parameters with a non-finite reduced gradient, in unit and declaration order.
    pub params: Vec<NonFiniteParam>,
    /// Set when every gradient was finite but the global norm was so large that the clip
    /// factor `max_norm / (norm + 1e-6)` rounds to zero in f32: (norm, max_norm).
    pub clip: Option<(f64, f64)>,
}

impl std::fmt::Display for NonFiniteReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "step {}: ", self.step)?;
        if let Some((norm, max_norm)) = self.clip {
            return write!(
                f,
                "gradient norm {norm:e} makes the clip factor {max_norm} / {norm:e} round to 0 in f32"
            );
        }
        const SHOWN: usize = 8;
        if !self.params.is_empty() {
            write!(f, "non-finite gradient in ")?;
            for (i, p) in self.params.iter().take(SHOWN).enumerate() {
                if i > 0 {
                    write!(f, ", ")?;
                }
                if p.ranks.is_empty() {
                    write!(f, "{} (finite on every rank; their sum overflowed)", p.name)?;
                } else {
                    let r: Vec<String> = p.ranks.iter().map(|r| r.to_string()).collect();
                    let who = if p.ranks.len() == 1 { "rank" } else { "ranks" };
                    write!(f, "{} (from {who} {})", p.name, r.join(", "))?;
                }
            }
            if self.params.len() > SHOWN {
                write!(f, " and {} more parameters", self.params.len() - SHOWN)?;
            }
            write!(f, "; ")?;
        }
        write!(f, "loss {}", self.loss)?;
        if !self.rank_losses.is_empty() {
            let r: Vec<String> = self
                .rank_losses
                .iter()
                .map(|(r, l)| format!("rank {r}: {l}"))
                .collect();
            write!(f, " ({})", r.join(", "))?;
        }
        Ok(())
    }
}

impl<M: StagedModel + ?Sized> RankEngine<'_, M> {
    /// Zeroes the gradient shards and forgets the step's non-finite bookkeeping: what an
    /// unapplied step leaves behind.
    pub(super) fn discard_gradients(&mut self) -> Result<()> {
        self.zero_grad()?;
        for flags in self.contribution_nonfinite.iter_mut() {
            flags.fill(false);
        }
        Ok(())
    }

    /// Names, on every rank alike, what was not finite in this step: one all-gather over the
    /// world of each rank's loss sum, the parameters whose contribution from this rank held a
    /// non-finite element (recorded before each reduction), and the parameters whose reduced
    /// gradient shard here holds one. Collective; called only when the step's flag is set, so
    /// every rank calls it.
    pub(super) fn nonfinite_report(
        &mut self,
        loss: f64,
        local_loss: f64,
    ) -> Result<NonFiniteReport> {
        let spec = self.model.spec();
        let counts: Vec<usize> = spec.units.iter().map(|u| u.params.len()).collect();
        let total: usize = counts.iter().sum();
        let mut reduced = vec![false; total];
        let mut base = 0;
        for (u, unit) in self.units.iter().enumerate() {
            for f in unit.flats.iter().filter(|f| f.layout.trainable) {
                let bad = f.grad.max_abs(&f.spans)?;
                if bad.is_finite() {
                    continue;
                }
                let g = f.grad.to_vec()?;
                for sl in f.layout.shard_slices(f.shard_index) {
                    let lo = sl.shard_offset.0 as usize;
                    let hi = lo + sl.numel.0 as usize;
                    if fsdp_kernels::first_nonfinite(&g[lo..hi]).is_some() {
                        reduced[base + f.layout.segments[sl.segment].param_index] = true;
                    }
                }
            }
            base += counts[u];
        }
        let mut mine = Vec::with_capacity(1 + 2 * total);
        mine.push(local_loss);
        mine.extend(
            self.contribution_nonfinite
                .iter()
                .flatten()
                .map(|&b| b as u8 as f64),
        );
        mine.extend(reduced.iter().map(|&b| b as u8 as f64));
        let all = self.comm.all_gather_f64(&mine)?;
        let mut params = Vec::new();
        let mut i = 0;
        for unit in &spec.units {
            for p in &unit.params {
                let from: Vec<usize> = (0..all.len()).filter(|&r| all[r][1 + i] > 0.0).collect();
                let summed = all.iter().any(|v| v[1 + total + i] > 0.0);
                if summed || !from.is_empty() {
                    params.push(NonFiniteParam {
                        name: p.name.clone(),
                        ranks: from,
                    });
                }
                i += 1;
            }
        }
        Ok(NonFiniteReport {
            step: self.step + 1,
            loss,
            rank_losses: all
                .iter()
                .enumerate()
                .filter(|(_, v)| !v[0].is_finite())
                .map(|(r, v)| (r, v[0]))
                .collect(),
            params,
            clip: None,
        })
    }
}

/// Whether every element of an unsharded gradient buffer (a rank's contribution to a
/// reduction, padding included: padding is zero) is finite. On a device an f32 buffer is
/// checked there (one scalar comes back); a 16-bit one is copied to the host first.
pub(super) fn contribution_is_finite(buf: &OwnedBuf, dev: Option<&TensorKernels>) -> Result<bool> {
    Ok(match buf {
        OwnedBuf::F32(v) => fsdp_kernels::first_nonfinite(v).is_none(),
        OwnedBuf::BF16(v) => fsdp_kernels::first_nonfinite_bf16(v).is_none(),
        OwnedBuf::F16(v) => fsdp_kernels::first_nonfinite_f16(v).is_none(),
        OwnedBuf::F64(v) => v.iter().all(|x| x.is_finite()),
        OwnedBuf::Tensor(t) => {
            let k = dev.ok_or_else(|| {
                EngineError::Config("a gradient tensor without the device's kernels".into())
            })?;
            if t.dtype() == candle_core::DType::F32 {
                let n = t.elem_count();
                k.max_abs(t, &[fsdp_kernels::Span::new(0, n, false)])?
                    .is_finite()
            } else {
                fsdp_kernels::first_nonfinite(&k.to_f32(t)?).is_none()
            }
        }
    })
}

/// The parameter indices (declaration order in the unit) of the segments of `layout` whose
/// elements in the unsharded buffer `buf` are not all finite.
pub(super) fn nonfinite_segments(
    buf: &OwnedBuf,
    layout: &fsdp_planner::FlatParamLayout,
    dev: Option<&TensorKernels>,
) -> Result<Vec<usize>> {
    // Only on the non-finite path: a widened host copy keeps this one loop for every dtype.
    let values: Vec<f64> = match buf {
        OwnedBuf::F32(v) => v.iter().map(|&x| x as f64).collect(),
        OwnedBuf::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
        OwnedBuf::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
        OwnedBuf::F64(v) => v.clone(),
        OwnedBuf::Tensor(t) => {
            let k = dev.ok_or_else(|| {
                EngineError::Config("a gradient tensor without the device's kernels".into())
            })?;
            k.to_f32(t)?.into_iter().map(|x| x as f64).collect()
        }
    };
    Ok(layout
        .segments
        .iter()
        .filter(|seg| {
            let r = seg.range();
            !values[r.start as usize..r.end as usize]
                .iter()
                .all(|x| x.is_finite())
        })
        .map(|seg| seg.param_index)
        .collect())
}

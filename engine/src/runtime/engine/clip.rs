//! Gradient norm and clipping (between the backward and optimizer-step phases): the global
//! L2 or max norm over the shard group with padding excluded, the clip factor that is never
//! applied when not a positive finite number, and the f16 dynamic loss scaler whose scale
//! multiplies the loss before backward and divides the gradients with the token count.

use super::nonfinite::NonFiniteReport;
use super::{Clip, NormType, RankEngine};
use crate::error::{EngineError, Result};
use crate::runtime::staged::StagedModel;
use fsdp_comm::{BufMut, Group, ReduceOp};
use serde::{Deserialize, Serialize};

/// Dynamic loss scaling for f16 parameters (Micikevicius et al. 2018, "Mixed Precision
/// Training", sec. 3.2; PyTorch `GradScaler`'s defaults): the loss is multiplied by `scale`
/// before backward so small f16 gradients do not flush to zero; gradients are divided by it
/// again (folded into the one division by the token count). A non-finite gradient on any rank
/// skips the step and halves the scale; `GROWTH_INTERVAL` clean steps in a row double it.
///
/// The engine back-propagates the SUM of the micro-batch's token losses (it divides by the
/// global token count once, after the reduction), so its gradients are up to `tokens per
/// micro-batch` times those of PyTorch's mean loss: the initial scale is
/// [`LossScaler::INIT`] divided by that count rounded up to a power of two (at least 1), the
/// same headroom GradScaler's 2^16 gives a mean loss.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// Current scale (a power of two).
    pub scale: f64,
    /// Clean steps since the last overflow or growth.
    pub clean_steps: u64,
}

impl LossScaler {
    /// Initial scale for a loss averaged over its tokens, 2^16 (see [`LossScaler::initial`]).
    pub const INIT: f64 = 65536.0;

    /// The initial scaler for micro-batches of `tokens` tokens (summed loss):
    /// `INIT / 2^ceil(log2(tokens))`, at least 1.
    pub fn initial(tokens: u64) -> LossScaler {
        let p = tokens.max(1).next_power_of_two() as f64;
        LossScaler {
            scale: (Self::INIT / p).max(1.0),
            clean_steps: 0,
        }
    }
    /// Clean steps before the scale doubles.
    pub const GROWTH_INTERVAL: u64 = 2000;

    pub(super) fn update(&mut self, overflow: bool) {
        if overflow {
            self.scale = (self.scale * 0.5).max(1.0);
            self.clean_steps = 0;
        } else {
            self.clean_steps += 1;
            if self.clean_steps >= Self::GROWTH_INTERVAL {
                self.scale = (self.scale * 2.0).min(2f64.powi(24));
                self.clean_steps = 0;
            }
        }
    }
}

impl<M: StagedModel + ?Sized> RankEngine<'_, M> {
    /// The global gradient norm over every trainable real element of the model (padding
    /// excluded): local sums of squares (f64) summed over the shard group, or local max-abs
    /// maxed over it. Collective over the shard group. The L2 norm reuses the sum of squares
    /// that [`RankEngine::accumulate`] computed for its non-finite check while the gradients
    /// are unchanged (same value, one pass fewer).
    pub fn grad_norm(&mut self, norm: NormType) -> Result<f64> {
        let mut local = 0f64;
        match (norm, self.local_sum_squares) {
            (NormType::L2, Some(v)) => local = v,
            _ => {
                for f in self
                    .units
                    .iter()
                    .flat_map(|u| &u.flats)
                    .filter(|f| f.layout.trainable)
                {
                    match norm {
                        NormType::L2 => local += f.grad.sum_squares(&f.spans)?,
                        NormType::Inf => {
                            let m = f.grad.max_abs(&f.spans)? as f64;
                            local = if m.is_nan() || m > local { m } else { local };
                        }
                    }
                }
            }
        }
        let mut buf = [local];
        let op = match norm {
            NormType::L2 => ReduceOp::Sum,
            NormType::Inf => ReduceOp::Max,
        };
        self.comm
            .all_reduce(Group::Shard, op, BufMut::F64(&mut buf))?;
        Ok(match norm {
            NormType::L2 => buf[0].sqrt(),
            NormType::Inf => buf[0],
        })
    }

    /// The factor clipping multiplies the gradients by for a global `norm`: `None` when no
    /// clipping is needed (`max_norm / (norm + 1e-6) >= 1`), else the factor as f32, or an
    /// error when it is not a positive finite f32 (a non-finite norm, or a norm so large that
    /// the factor rounds to 0): clipping never multiplies by such a factor.
    pub(super) fn clip_factor(
        &self,
        clip: Clip,
        norm: f64,
    ) -> std::result::Result<Option<f32>, NonFiniteReport> {
        let coef = clip.max_norm / (norm + 1e-6);
        if coef >= 1.0 {
            return Ok(None);
        }
        let c = coef as f32;
        if norm.is_finite() && c.is_finite() && c > 0.0 {
            Ok(Some(c))
        } else {
            Err(NonFiniteReport {
                step: self.step + 1,
                loss: f64::NAN,
                rank_losses: Vec::new(),
                params: Vec::new(),
                clip: Some((norm, clip.max_norm)),
            })
        }
    }

    /// Clips the gradient shards by the global norm (see [`Clip`]); returns the norm before
    /// clipping. Collective over the shard group.
    ///
    /// Errors: [`EngineError::Config`] for a `max_norm` that is not > 0;
    /// [`EngineError::NonFinite`] when the norm is not finite or the clip factor rounds to
    /// zero: the gradients are then left as they were (never multiplied by such a factor).
    pub fn clip_grad_norm(&mut self, clip: Clip) -> Result<f64> {
        check_max_norm(clip)?;
        let norm = self.grad_norm(clip.norm)?;
        match self.clip_factor(clip, norm) {
            Ok(Some(c)) => self.scale_grads(c)?,
            Ok(None) => {}
            Err(mut report) => {
                if !norm.is_finite() {
                    report.clip = None;
                    report.loss = norm;
                }
                return Err(EngineError::NonFinite(Box::new(report)));
            }
        }
        Ok(norm)
    }

    pub(super) fn scale_grads(&mut self, c: f32) -> Result<()> {
        self.local_sum_squares = None;
        for f in self.units.iter_mut().flat_map(|u| u.flats.iter_mut()) {
            if f.layout.trainable {
                f.grad.scale(c)?;
            }
        }
        Ok(())
    }
}

pub(super) fn check_max_norm(clip: Clip) -> Result<()> {
    if clip.max_norm.is_nan() || clip.max_norm <= 0.0 || clip.max_norm.is_infinite() {
        return Err(EngineError::Config(format!(
            "max_norm must be a finite number > 0, got {}",
            clip.max_norm
        )));
    }
    Ok(())
}

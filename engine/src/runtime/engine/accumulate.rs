//! Gradient accumulation over one step's micro-batches (plan phases forward and backward):
//! the exchange of micro-batch and token counts, each micro-batch's forward and backward, the
//! one division of the gradient shards by the global token count, and the step's checks that
//! every rank takes alike (ledger against the plan, one all-reduced non-finite flag).

use super::{check_counts, RankEngine};
use crate::error::{EngineError, Result};
use crate::memory::LEDGER_CATEGORIES;
use crate::runtime::staged::{MicroBatch, StagedModel};
use fsdp_comm::{BufMut, Group, ReduceOp};
use fsdp_planner::Phase;
use fsdp_types::DType;

/// What one call of [`RankEngine::accumulate`] produced (identical on every rank).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Accumulated {
    /// The world's mean loss per contributing token: loss sum over all ranks and micro-batches
    /// divided by `tokens`.
    pub loss: f64,
    /// Global number of contributing tokens (samples), the divisor of the gradient.
    pub tokens: u64,
    /// This rank's loss sum (before the world sum).
    pub local_loss_sum: f64,
    /// Some gradient element or the loss was not finite (on some rank) and the policy skips
    /// such steps (f16 loss scaling among them): the gradient shards were zeroed and the
    /// optimizer step must be skipped (identical on every rank).
    pub overflow: bool,
}

impl<M: StagedModel + ?Sized> RankEngine<'_, M> {
    /// Runs forward and backward over this rank's micro-batches and leaves in the gradient
    /// shards the world's mean gradient (sum over every rank's tokens divided by the global
    /// token count once). Collective: every rank must call it with the same number of
    /// micro-batches, else [`EngineError::RankMismatch`] on every rank.
    ///
    /// Errors: [`EngineError::RankMismatch`], [`EngineError::NonFinite`],
    /// [`EngineError::MemoryOverPlan`], [`EngineError::Compute`], [`EngineError::Comm`].
    pub fn accumulate(&mut self, mbs: &[MicroBatch]) -> Result<Accumulated> {
        let local_tokens: u64 = mbs.iter().map(|m| m.count).sum();
        let all = self
            .comm
            .all_gather_f64(&[mbs.len() as f64, local_tokens as f64])?;
        check_counts(&all, "number of micro-batches in a step", "micro-batches")?;
        let tokens: u64 = all.iter().map(|v| v[1] as u64).sum();
        if tokens == 0 {
            return Err(EngineError::Data(
                "a step with no contributing tokens on any rank".into(),
            ));
        }
        if mbs.is_empty() {
            return Err(EngineError::Data(
                "a step needs at least one micro-batch".into(),
            ));
        }
        self.reset_ledger_peaks();
        self.pending_nonfinite = None;
        self.local_sum_squares = None;
        for flags in self.contribution_nonfinite.iter_mut() {
            flags.fill(false);
        }
        // Persistent unsharded gradients (sync on the last micro-batch) belong to the forward
        // phase of the first micro-batch.
        self.enter_phase(Phase::Forward);
        let k_total = mbs.len();
        // Deferred to the last micro-batch under `grad_sync = last`, and always under the
        // replicated shard-optimizer schedule (the planner decides with the same function).
        let sync_last = fsdp_planner::memory::defers_grad_sync(
            &self.plan.config,
            &self.plan.schedule,
            k_total as u64,
        );
        if sync_last {
            for u in 0..self.units.len() {
                if self.units[u].trainable() {
                    self.units[u].alloc_flat_grads(DType::F32, &mut self.ledger)?;
                }
            }
        }
        let mut local_loss = 0f64;
        for (k, mb) in mbs.iter().enumerate() {
            let last = k + 1 == k_total;
            if let Some(tr) = self.comm.tracer_mut() {
                tr.micro_batch = Some(k as u64);
            }
            local_loss += self.micro_batch(mb, sync_last, !sync_last || last)?;
        }
        if let Some(tr) = self.comm.tracer_mut() {
            tr.micro_batch = None;
        }
        // End of the backward phase: everything unsharded goes, except the replicated
        // parameters of shard-optimizer, kept through the optimizer step.
        if !self.plan.schedule.replicated {
            self.transition_to(&[], None, &[])?;
        }
        for u in self.units.iter_mut() {
            u.free_flat_grads(&mut self.ledger);
        }
        let divisor = tokens as f64 * self.scaler.map_or(1.0, |s| s.scale);
        for u in self.units.iter_mut() {
            for f in u.flats.iter_mut().filter(|f| f.layout.trainable) {
                f.grad.div_scalar(divisor as f32)?;
            }
        }
        // One pass over the gradient shards gives this rank's part of the L2 norm and the
        // non-finite check: squares of finite f32 values summed in f64 cannot overflow (at most
        // 2^40 terms of at most 2^256), so the sum is finite exactly when every element is.
        let mut local_sum_squares = 0f64;
        for f in self
            .units
            .iter()
            .flat_map(|u| &u.flats)
            .filter(|f| f.layout.trainable)
        {
            local_sum_squares += f.grad.sum_squares(&f.spans)?;
        }
        self.local_sum_squares = Some(local_sum_squares);
        let local_nonfinite = !local_sum_squares.is_finite()
            || !local_loss.is_finite()
            || self.contribution_nonfinite.iter().flatten().any(|&b| b);
        let violation = self.memory_violation();
        let mut buf = [
            local_loss,
            violation.is_some() as u64 as f64,
            local_nonfinite as u64 as f64,
        ];
        self.comm
            .all_reduce(Group::World, ReduceOp::Sum, BufMut::F64(&mut buf))?;
        if let Some(e) = violation {
            self.discard_gradients()?;
            return Err(e);
        }
        if buf[1] > 0.0 {
            self.discard_gradients()?;
            return Err(EngineError::MemoryOverPlan {
                step: self.step + 1,
                rank: self.rank,
                phase: "backward",
                category: "(another rank)",
                measured: 0,
                planned: 0,
            });
        }
        let loss = buf[0] / tokens as f64;
        if buf[2] > 0.0 || !loss.is_finite() {
            // Every rank got the same flag: all of them take this branch together.
            let report = self.nonfinite_report(loss, local_loss)?;
            self.discard_gradients()?;
            if !self.skip_nonfinite {
                return Err(EngineError::NonFinite(Box::new(report)));
            }
            self.pending_nonfinite = Some(report);
        }
        Ok(Accumulated {
            loss,
            tokens,
            local_loss_sum: local_loss,
            overflow: self.pending_nonfinite.is_some(),
        })
    }

    pub(super) fn memory_violation(&self) -> Option<EngineError> {
        if !self.cfg.enforce_memory_plan {
            return None;
        }
        for phase in [Phase::Forward, Phase::Backward] {
            let planned = self.plan.memory.phase(phase);
            // The device (or host placement) ledger, then an offloaded rank's host ledger.
            for (measured, planned, side) in [
                (self.ledger.peak(phase).max, planned.max, ""),
                (self.host_ledger.peak(phase).max, planned.host_max, "host "),
            ] {
                for c in LEDGER_CATEGORIES {
                    if measured.get(c) > planned.get(c) {
                        return Some(EngineError::MemoryOverPlan {
                            step: self.step + 1,
                            rank: self.rank,
                            phase: phase.name(),
                            category: if side.is_empty() {
                                c.name()
                            } else {
                                host_category_name(c)
                            },
                            measured: measured.get(c).0,
                            planned: planned.get(c).0,
                        });
                    }
                }
            }
        }
        None
    }
}

/// The name a host-ledger category is reported under (`host param_shards`, ...).
fn host_category_name(c: fsdp_planner::Category) -> &'static str {
    use fsdp_planner::Category as C;
    match c {
        C::ParamShards => "host param_shards",
        C::ParamShardsLowPrecision => "host param_shards_low_precision",
        C::GradShards => "host grad_shards",
        C::OptimizerState => "host optimizer_state",
        C::UnshardedParams => "host unsharded_params",
        C::UnshardedGrads => "host unsharded_grads",
        C::Staging => "host staging",
        C::Activations => "host activations",
    }
}

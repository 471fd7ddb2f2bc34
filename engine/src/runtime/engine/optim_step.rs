//! The optimizer step (plan phase optimizer step): the optimizer on every trainable flat shard
//! with the plan's spans (padding untouched, weight decay only on decayed spans), then the
//! gradient shards zeroed. Under shard-optimizer the replicated parameters, kept unsharded
//! since the step's first forward position, are freed after the update.

use super::RankEngine;
use crate::error::Result;
use crate::runtime::staged::StagedModel;
use fsdp_planner::time::{SpanKind, Track};
use fsdp_planner::Phase;

impl<M: StagedModel + ?Sized> RankEngine<'_, M> {
    /// One optimizer step with learning rate `lr` on every trainable flat shard (spans from
    /// the plan: padding untouched, weight decay only on decayed spans), then zeroes the
    /// gradient shards. Frozen flat parameters are never touched.
    pub fn optimizer_step(&mut self, lr: f64) -> Result<()> {
        self.enter_phase(Phase::OptimizerStep);
        let t = self.trace_clock();
        let opt = self.cfg.optimizer.with_lr(lr);
        let step = self.step + 1;
        // AdamW's step counts updates made: skipped steps are not updates.
        let update = step - self.skipped;
        for f in self.units.iter_mut().flat_map(|u| u.flats.iter_mut()) {
            if f.layout.trainable {
                f.step(&opt, update)?;
            }
        }
        if let (Some(t), Some(tr)) = (t, self.comm.tracer_mut()) {
            tr.record(
                Track::Compute,
                SpanKind::Optimizer,
                "optimizer step",
                None,
                t,
                std::time::Instant::now(),
                None,
            );
        }
        self.step = step;
        self.consecutive_skips = 0;
        // Shard-optimizer: the replicated parameters are stale now; they go, and the next
        // step's first forward position gathers every unit's updated shards.
        self.reshard_all()?;
        self.zero_grad()
    }

    /// Reshards every unit (frees what is unsharded). A no-op for units already sharded.
    ///
    /// Errors: the failure of an in-flight all-gather.
    pub(crate) fn reshard_all(&mut self) -> Result<()> {
        self.transition_to(&[], None, &[])
    }

    /// Sets every gradient shard to zero.
    ///
    /// Errors: a device kernel failure.
    pub fn zero_grad(&mut self) -> Result<()> {
        self.local_sum_squares = None;
        for f in self.units.iter_mut().flat_map(|u| u.flats.iter_mut()) {
            f.grad.zero()?;
        }
        Ok(())
    }
}

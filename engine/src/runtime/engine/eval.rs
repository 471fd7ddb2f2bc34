//! Evaluation: forward only (no graph, no gradients) under the plan's forward schedule, with
//! every rank's per-micro-batch loss sums gathered so that the world's sum is added up in one
//! fixed order.

use super::{check_counts, RankEngine};
use crate::error::Result;
use crate::runtime::staged::{MicroBatch, StagedModel};
use crate::runtime::unit::Placement;

impl<M: StagedModel + ?Sized> RankEngine<'_, M> {
    /// Forward only over `mbs` (no graph, no gradients) under the plan's forward schedule;
    /// returns every rank's `(loss sum, target tokens)` per micro-batch, `[rank][j]` for its
    /// `j`-th micro-batch (the same on every rank). Every rank passes the same number of
    /// micro-batches. Collective.
    pub fn eval_each(&mut self, mbs: &[MicroBatch]) -> Result<Vec<Vec<(f64, u64)>>> {
        let all = self.comm.all_gather_f64(&[mbs.len() as f64])?;
        check_counts(&all, "number of validation batches", "batches")?;
        let m = self.stage_units.len();
        let mut local = Vec::with_capacity(2 * mbs.len());
        let mut counts = Vec::with_capacity(mbs.len());
        for mb in mbs {
            let on_device;
            let mb = match &self.placement {
                Placement::Host => mb,
                Placement::Device(d) => {
                    on_device = mb.to_device(d)?;
                    &on_device
                }
            };
            let mut x = mb.input.clone();
            for s in 0..m {
                let u = self.stage_units[s];
                let st = &self.plan.schedule.forward[s];
                self.transition_to(&st.alive, Some(u), &st.prefetch)?;
                let params = self.units[u].plain_params()?;
                if s + 1 == m {
                    let l = self.model.loss(params, &x, mb)?;
                    local.push(l.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?);
                } else {
                    x = self.model.forward(s, params, &x)?;
                }
            }
            counts.push(mb.count as f64);
        }
        self.transition_to(&[], None, &[])?;
        let n = mbs.len();
        local.extend(counts);
        let gathered = self.comm.all_gather_f64(&local)?;
        Ok(gathered
            .iter()
            .map(|v| (0..n).map(|j| (v[j], v[n + j] as u64)).collect())
            .collect())
    }

    /// Forward only over `mbs` as [`RankEngine::eval_each`]; returns the world's (loss sum,
    /// contributing tokens), added up in global batch order: rank `r`'s `j`-th micro-batch is
    /// global batch `j * W + r` (the order of [`crate::data::Sampler::val_batches`]), and the
    /// sums are added one by one from batch 0 on, on every rank the same way. So the result
    /// depends on the batches only, not on how many ranks evaluated them. Collective.
    pub fn eval(&mut self, mbs: &[MicroBatch]) -> Result<(f64, u64)> {
        let all = self.eval_each(mbs)?;
        let (mut sum, mut count) = (0f64, 0u64);
        for j in 0..mbs.len() {
            for rank in &all {
                sum += rank[j].0;
                count += rank[j].1;
            }
        }
        Ok((sum, count))
    }
}

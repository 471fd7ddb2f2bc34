//! Evaluation: forward only (no graph, no gradients) under the plan's forward schedule, with
//! the world's loss sum and token count.

use super::{check_counts, RankEngine};
use crate::error::Result;
use crate::runtime::staged::{MicroBatch, StagedModel};
use crate::runtime::unit::Placement;
use fsdp_comm::{BufMut, Group, ReduceOp};

impl<M: StagedModel + ?Sized> RankEngine<'_, M> {
    /// Forward only over `mbs` (no graph, no gradients) under the plan's forward schedule;
    /// returns the world's (loss sum, contributing tokens). Collective.
    pub fn eval(&mut self, mbs: &[MicroBatch]) -> Result<(f64, u64)> {
        let all = self.comm.all_gather_f64(&[mbs.len() as f64])?;
        check_counts(&all, "number of validation batches", "batches")?;
        let m = self.stage_units.len();
        let mut sum = 0f64;
        let mut count = 0u64;
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
                    sum += l.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
                } else {
                    x = self.model.forward(s, params, &x)?;
                }
            }
            count += mb.count;
        }
        self.transition_to(&[], None, &[])?;
        let mut buf = [sum, count as f64];
        self.comm
            .all_reduce(Group::World, ReduceOp::Sum, BufMut::F64(&mut buf))?;
        Ok((buf[0], buf[1] as u64))
    }
}

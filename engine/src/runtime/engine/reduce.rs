//! Gradient reduction (plan phase backward, the schedule's `reduce_scatter` positions): a
//! unit's unsharded flat gradients are sum-reduce-scattered over the shard group (or
//! all-reduced over the replicate group with a shard group of one), the staging shard is
//! all-reduced over the replicate group under hybrid sharding, and the result is added into the
//! fp32 gradient shard. Each rank's own contribution is checked for non-finite values before it
//! leaves. The division by the token count happens once, after every reduction
//! ([`RankEngine::accumulate`]).

use super::nonfinite::{contribution_is_finite, nonfinite_segments};
use super::RankEngine;
use crate::error::{EngineError, Result};
use crate::runtime::staged::StagedModel;
use crate::runtime::unit::owned_bytes;
use fsdp_comm::{Group, OwnedBuf, PendingOp, ReduceOp};
use fsdp_types::DType;

/// One trainable flat parameter's reduction in flight.
pub(super) struct FlatReduce {
    /// Index among the unit's trainable flat parameters.
    t: usize,
    work: ReduceWork,
    /// The send buffer is the unit's persistent f32 accumulation buffer: give it back.
    keep: bool,
}

pub(super) enum ReduceWork {
    /// A started reduce-scatter or all-reduce.
    Started(PendingOp),
    /// World size 1: nothing to communicate, the buffer is the result.
    Local(OwnedBuf),
}

/// A unit's gradient reduction, started after its last backward use and finished (waited,
/// added into the fp32 gradient shards) after the next backward step gathered its gradients.
pub(super) struct PendingReduce {
    unit: usize,
    flats: Vec<FlatReduce>,
}

impl<M: StagedModel + ?Sized> RankEngine<'_, M> {
    /// Starts the reduction of unit `u`'s unsharded flat gradients (reduce_dtype; under
    /// sync-last the persistent f32 buffer, cast to reduce_dtype first if that differs): a
    /// sum-reduce-scatter over the shard group into a staging buffer of `s_f` elements, or with
    /// a shard group of one an in-place sum-all-reduce over the replicate group. 16-bit
    /// reductions accumulate in f32 inside the collective (bf16 reduction made training unstable
    /// at a large world size: <https://github.com/pytorch/pytorch/issues/106395>).
    pub(super) fn start_reduce(&mut self, u: usize, sync_last: bool) -> Result<PendingReduce> {
        let s = self.comm.group_size(Group::Shard);
        let r = self.comm.group_size(Group::Replicate);
        let rd = self.plan.config.reduce_dtype;
        let trainable: Vec<usize> = (0..self.units[u].flats.len())
            .filter(|&f| self.units[u].flats[f].layout.trainable)
            .collect();
        let mut flats = Vec::new();
        for (t, f) in trainable.into_iter().enumerate() {
            let (send, keep) = if sync_last && rd != DType::F32 {
                let unit = &self.units[u];
                let c = match (unit.flat_grad(t)?, &unit.flats[f].dev) {
                    (OwnedBuf::F32(acc), _) => {
                        let mut c = OwnedBuf::zeros(rd, acc.len());
                        match &mut c {
                            OwnedBuf::BF16(v) => fsdp_kernels::cast::cast_f32_to_bf16(acc, v)?,
                            OwnedBuf::F16(v) => fsdp_kernels::cast::cast_f32_to_f16(acc, v)?,
                            _ => unreachable!("reduce_dtype checked at construction"),
                        }
                        c
                    }
                    (OwnedBuf::Tensor(acc), Some(k)) => {
                        let c = k.zeros(rd, acc.elem_count())?;
                        k.cast_into(&c, 0, acc)?;
                        OwnedBuf::Tensor(c)
                    }
                    _ => {
                        return Err(EngineError::Config(
                            "persistent gradient buffer is not f32".into(),
                        ))
                    }
                };
                self.ledger
                    .alloc(fsdp_planner::Category::UnshardedGrads, owned_bytes(&c));
                (c, false)
            } else {
                (self.units[u].take_flat_grad(t)?, sync_last)
            };
            let fs = &self.units[u].flats[f];
            // This rank's own contribution, before the reduction mixes it with the others': a
            // non-finite element here is attributed to this rank in a non-finite report.
            if !contribution_is_finite(&send, fs.dev.as_deref())? {
                let flags = &mut self.contribution_nonfinite[u];
                for p in nonfinite_segments(&send, &fs.layout, fs.dev.as_deref())? {
                    flags[p] = true;
                }
            }
            let work = if s > 1 {
                let n = fs.shard_numel();
                self.ledger
                    .alloc(fsdp_planner::Category::Staging, rd.size_bytes() * n as u64);
                let recv = match &fs.dev {
                    None => OwnedBuf::zeros(rd, n),
                    Some(k) => OwnedBuf::Tensor(k.zeros(rd, n)?),
                };
                ReduceWork::Started(
                    self.comm
                        .start_reduce_scatter_sum(Group::Shard, send, recv)?,
                )
            } else if r > 1 {
                ReduceWork::Started(self.comm.start_all_reduce(
                    Group::Replicate,
                    ReduceOp::Sum,
                    send,
                )?)
            } else {
                ReduceWork::Local(send)
            };
            flats.push(FlatReduce { t, work, keep });
        }
        if !sync_last {
            // Moved into the reductions; the ledger frees them when they finish.
            self.units[u].clear_lent_flat_grads()?;
        }
        Ok(PendingReduce { unit: u, flats })
    }

    /// Finishes a reduction started by [`RankEngine::start_reduce`]: waits for it (exposed
    /// time), all-reduces the staging shard over the replicate group (hybrid sharding), adds
    /// it into the fp32 gradient shard (widening 16-bit values exactly) and frees the staging
    /// and send buffers (a persistent f32 buffer goes back to the unit).
    pub(super) fn finish_reduce(&mut self, p: PendingReduce) -> Result<()> {
        let s = self.comm.group_size(Group::Shard);
        let r = self.comm.group_size(Group::Replicate);
        for fr in p.flats {
            let (mut reduced, send) = match fr.work {
                ReduceWork::Local(b) => (b, None),
                ReduceWork::Started(op) => {
                    let c = self.comm.wait(op)?;
                    (c.buf, c.send)
                }
            };
            if s > 1 && r > 1 {
                if reduced.tensor().is_none() {
                    self.comm
                        .all_reduce(Group::Replicate, ReduceOp::Sum, reduced.as_buf_mut())?;
                } else {
                    let op =
                        self.comm
                            .start_all_reduce(Group::Replicate, ReduceOp::Sum, reduced)?;
                    reduced = self.comm.wait(op)?.buf;
                }
            }
            let unit = &mut self.units[p.unit];
            let fs = unit
                .flats
                .iter_mut()
                .filter(|f| f.layout.trainable)
                .nth(fr.t)
                .expect("trainable flat index");
            fs.accumulate_reduced(&reduced)?;
            let send = if s > 1 {
                self.ledger
                    .free(fsdp_planner::Category::Staging, owned_bytes(&reduced));
                drop(reduced);
                send.ok_or_else(|| {
                    EngineError::Config("reduce-scatter returned no send buffer".into())
                })?
            } else {
                reduced
            };
            if fr.keep {
                unit.restore_flat_grad(fr.t, send)?;
            } else {
                self.ledger
                    .free(fsdp_planner::Category::UnshardedGrads, owned_bytes(&send));
            }
        }
        Ok(())
    }
}

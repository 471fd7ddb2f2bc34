//! The rank's state outside a step: export and import for checkpoints (master shards, optimizer
//! state, step counts, loss scaler) and the full parameters and gradient shards for
//! inspection.

use super::{LossScaler, RankEngine};
use crate::error::{EngineError, Result};
use crate::optim::Optimizer;
use crate::runtime::staged::StagedModel;
use crate::runtime::unit::{FlatShard, ShardBuf};
use fsdp_comm::{Buf, BufMut, Group};
use serde::{Deserialize, Serialize};

/// One flat parameter's part of a rank's state, for checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlatShardState {
    /// Unit index.
    pub unit: usize,
    /// Index of the flat parameter in the unit's layout (trainable first).
    pub flat: usize,
    /// Whether it is trainable.
    pub trainable: bool,
    /// fp32 master shard (`s_f` elements; padding zero).
    pub param: Vec<f32>,
    /// Optimizer state buffers, named (`exp_avg`, `exp_avg_sq` for AdamW; `momentum_buffer`
    /// for SGD with momentum), `s_f` elements each; empty for frozen flat params.
    pub optimizer_state: Vec<(String, Vec<f32>)>,
}

/// Everything of one rank's engine state a checkpoint needs to resume exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankState {
    /// The rank.
    pub rank: usize,
    /// World size `W`.
    pub world_size: usize,
    /// Shard-group size `S`.
    pub shard_size: usize,
    /// This rank's shard index (`rank % S`).
    pub shard_index: usize,
    /// The plan fingerprint the state belongs to.
    pub plan_fingerprint: String,
    /// Training steps taken (the next step is `optimizer_step + 1`), skipped ones included.
    pub optimizer_step: u64,
    /// Steps skipped by f16 loss scaling (AdamW's bias-correction step is
    /// `optimizer_step - skipped_steps`); 0 in states written before loss scaling existed.
    #[serde(default)]
    pub skipped_steps: u64,
    /// The f16 loss scaler's state (`None` unless param_dtype is f16).
    #[serde(default)]
    pub loss_scaler: Option<LossScaler>,
    /// Every flat parameter of every unit, in unit order.
    pub flats: Vec<FlatShardState>,
}

/// An infinite or NaN value in a rank's shards ([`RankEngine::first_nonfinite_shard`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NonFiniteShard {
    /// Unit index.
    pub unit: usize,
    /// Flat parameter inside the unit.
    pub flat: usize,
    /// The buffer holding it.
    pub buf: ShardBuf,
    /// Element of the shard (padding included in the count).
    pub index: usize,
    /// The value.
    pub value: f32,
}

/// What [`RankEngine::import_shards`] fills buffers from: `(unit, flat parameter, buffer,
/// first element, destination)` writes elements `first..first + destination.len()` of that
/// buffer into the destination.
pub type ShardFill<'a> = dyn FnMut(usize, usize, ShardBuf, usize, &mut [f32]) -> Result<()> + 'a;

pub(super) fn state_names(opt: &Optimizer) -> &'static [&'static str] {
    match opt.state_buffers() {
        2 => &["exp_avg", "exp_avg_sq"],
        1 => &["momentum_buffer"],
        _ => &[],
    }
}

impl<M: StagedModel + ?Sized> RankEngine<'_, M> {
    /// The full (unsharded) model: `[unit][non-tied param][element]` in declaration order, the
    /// same on every rank. Collective (all-gathers every flat parameter).
    pub fn full_params(&mut self) -> Result<Vec<Vec<Vec<f32>>>> {
        let spec = self.model.spec();
        let mut out = Vec::with_capacity(self.units.len());
        for (u, unit) in self.units.iter().enumerate() {
            let mut flat_full: Vec<Vec<f32>> = Vec::with_capacity(unit.flats.len());
            for fs in &unit.flats {
                let shard = fs.param_vec()?;
                let mut full = vec![0f32; fs.padded_numel()];
                self.comm
                    .all_gather(Group::Shard, Buf::F32(&shard), BufMut::F32(&mut full))?;
                flat_full.push(full);
            }
            let mut params = Vec::new();
            for (i, p) in spec.units[u].params.iter().enumerate() {
                if p.tied_to.is_some() {
                    continue;
                }
                for (f, fs) in unit.flats.iter().enumerate() {
                    if let Some(k) = fs.layout.segments.iter().position(|s| s.param_index == i) {
                        params.push(fs.layout.view(&flat_full[f], k).to_vec());
                    }
                }
            }
            out.push(params);
        }
        Ok(out)
    }

    /// This rank's gradient shards, per unit per trainable flat parameter (`s_f` elements;
    /// host copies).
    ///
    /// Errors: a device copy failure.
    pub fn grad_shards(&self) -> Result<Vec<Vec<Vec<f32>>>> {
        self.units
            .iter()
            .map(|u| {
                u.flats
                    .iter()
                    .filter(|f| f.layout.trainable)
                    .map(|f| f.grad_vec())
                    .collect()
            })
            .collect()
    }

    /// Exports this rank's state (master shards, optimizer state, step) for a checkpoint.
    pub fn export_state(&self) -> Result<RankState> {
        let names = state_names(&self.cfg.optimizer);
        let mut flats = Vec::new();
        for unit in &self.units {
            for (f, fs) in unit.flats.iter().enumerate() {
                flats.push(FlatShardState {
                    unit: unit.index,
                    flat: f,
                    trainable: fs.layout.trainable,
                    param: fs.param_vec()?,
                    optimizer_state: names
                        .iter()
                        .zip(fs.state_vecs()?)
                        .map(|(n, v)| (n.to_string(), v))
                        .collect(),
                });
            }
        }
        let topo = self.comm.topology();
        Ok(RankState {
            rank: self.rank,
            world_size: topo.world_size,
            shard_size: topo.shard_size,
            shard_index: self.shard_index,
            plan_fingerprint: self.plan.fingerprint().to_string(),
            optimizer_step: self.step,
            skipped_steps: self.skipped,
            loss_scaler: self.scaler,
            flats,
        })
    }

    /// Imports a state exported by [`RankEngine::export_state`] (or rebuilt for this rank's
    /// layout by a resharding checkpoint reader). Nothing is changed if it does not fit.
    ///
    /// Errors: [`EngineError::State`] naming the unit, flat parameter and sizes that differ.
    pub fn import_state(&mut self, st: &RankState) -> Result<()> {
        let names = state_names(&self.cfg.optimizer);
        let total: usize = self.units.iter().map(|u| u.flats.len()).sum();
        if st.flats.len() != total {
            return Err(EngineError::State(format!(
                "{} flat parameters in the state, {} in the engine",
                st.flats.len(),
                total
            )));
        }
        let mut it = st.flats.iter();
        for unit in &self.units {
            for (f, fs) in unit.flats.iter().enumerate() {
                let s = it.next().expect("counted");
                let n = fs.shard_numel();
                let ok = s.unit == unit.index
                    && s.flat == f
                    && s.trainable == fs.layout.trainable
                    && s.param.len() == n
                    && (!fs.layout.trainable
                        || (s.optimizer_state.len() == names.len()
                            && s.optimizer_state
                                .iter()
                                .zip(names)
                                .all(|((k, v), n2)| k == n2 && v.len() == n)));
                if !ok {
                    return Err(EngineError::State(format!(
                        "unit {} ({}) flat {f}: the state has unit {} flat {} trainable {} with {} elements and {} optimizer buffers; the engine expects trainable {} with {n} elements and buffers {names:?}",
                        unit.index, unit.name, s.unit, s.flat, s.trainable, s.param.len(), s.optimizer_state.len(), fs.layout.trainable
                    )));
                }
            }
        }
        // Unsharded copies (shard-optimizer keeps them between steps) would be stale.
        self.reshard_all()?;
        let mut it = st.flats.iter();
        for unit in self.units.iter_mut() {
            for fs in unit.flats.iter_mut() {
                let s = it.next().expect("checked");
                fs.set_param(&s.param)?;
                for (i, (_, v)) in s.optimizer_state.iter().enumerate() {
                    fs.set_state(i, v)?;
                }
            }
        }
        self.step = st.optimizer_step;
        self.skipped = st.skipped_steps.min(st.optimizer_step);
        if self.scaler.is_some() {
            if let Some(sc) = st.loss_scaler {
                self.scaler = Some(sc);
            }
        }
        Ok(())
    }

    /// Elements a checkpoint streams through host memory at a time: the plan's save buffer
    /// ([`fsdp_planner::memory::save_buffer_bytes`]) in f32 elements.
    pub fn save_chunk(&self) -> usize {
        (fsdp_planner::memory::save_buffer_bytes(&self.plan.units) / 4) as usize
    }

    /// The names of the optimizer state buffers, [`ShardBuf::State`] order (AdamW:
    /// `exp_avg`, `exp_avg_sq`).
    pub fn optimizer_state_names(&self) -> &'static [&'static str] {
        state_names(&self.cfg.optimizer)
    }

    /// Flat parameter `flat` of unit `unit` on this rank.
    fn flat_shard(&self, unit: usize, flat: usize) -> Result<&FlatShard> {
        self.units
            .get(unit)
            .and_then(|u| u.flats.get(flat))
            .ok_or_else(|| EngineError::State(format!("no unit {unit} flat param {flat}")))
    }

    /// Elements of buffer `b` of flat parameter `flat` of unit `unit` (`None`: no such
    /// buffer).
    pub fn shard_len(&self, unit: usize, flat: usize, b: ShardBuf) -> Option<usize> {
        self.flat_shard(unit, flat).ok()?.buf_len(b)
    }

    /// Calls `f` with consecutive host slices that together are elements `range` of buffer
    /// `b` of flat parameter `flat` of unit `unit`: host buffers in place, device buffers
    /// through copies of at most [`RankEngine::save_chunk`] elements
    /// ([`FlatShard::visit`]). What a checkpoint save streams from, without a copy of the
    /// state.
    ///
    /// Errors: [`EngineError::State`] for a buffer or range that does not exist; device copy
    /// failures.
    pub fn visit_shard(
        &self,
        unit: usize,
        flat: usize,
        b: ShardBuf,
        range: std::ops::Range<usize>,
        f: &mut dyn FnMut(&[f32]),
    ) -> Result<()> {
        let chunk = self.save_chunk();
        self.flat_shard(unit, flat)?.visit(b, range, chunk, f)
    }

    /// The first infinite or NaN value among the real elements of this rank's master and
    /// optimizer-state shards, in unit, flat-parameter and buffer order; found in place
    /// ([`FlatShard::first_nonfinite`]).
    ///
    /// Errors: device failures.
    pub fn first_nonfinite_shard(&self) -> Result<Option<NonFiniteShard>> {
        let chunk = self.save_chunk();
        for (u, unit) in self.units.iter().enumerate() {
            for (k, fs) in unit.flats.iter().enumerate() {
                let bufs = std::iter::once(ShardBuf::Param)
                    .chain((0..fs.state.len()).map(ShardBuf::State));
                for b in bufs {
                    if let Some((index, value)) = fs.first_nonfinite(b, chunk)? {
                        return Ok(Some(NonFiniteShard {
                            unit: u,
                            flat: k,
                            buf: b,
                            index,
                            value,
                        }));
                    }
                }
            }
        }
        Ok(None)
    }

    /// Imports a state buffer by buffer, with no copy of the whole state: every flat
    /// parameter's master and (trainable ones) optimizer-state buffers are filled by
    /// `fill(unit, flat, buffer, position, dest)`, which writes elements
    /// `position..position + dest.len()` of that buffer into `dest` (host buffers in one
    /// call, device buffers through one host buffer of [`RankEngine::save_chunk`] elements);
    /// then the step counts and the loss scaler are set as [`RankEngine::import_state`] does.
    /// A failed `fill` leaves the engine partly overwritten: the caller stops the run.
    ///
    /// Errors: `fill`'s errors; device copy failures.
    pub fn import_shards(
        &mut self,
        optimizer_step: u64,
        skipped_steps: u64,
        loss_scaler: Option<LossScaler>,
        fill: &mut ShardFill<'_>,
    ) -> Result<()> {
        // Unsharded copies (shard-optimizer keeps them between steps) would be stale.
        self.reshard_all()?;
        let chunk = self.save_chunk();
        for (u, unit) in self.units.iter_mut().enumerate() {
            for (k, fs) in unit.flats.iter_mut().enumerate() {
                let bufs: Vec<ShardBuf> = std::iter::once(ShardBuf::Param)
                    .chain((0..fs.state.len()).map(ShardBuf::State))
                    .collect();
                for b in bufs {
                    fs.fill(b, chunk, &mut |at, dest| fill(u, k, b, at, dest))?;
                }
            }
        }
        self.step = optimizer_step;
        self.skipped = skipped_steps.min(optimizer_step);
        if self.scaler.is_some() {
            if let Some(sc) = loss_scaler {
                self.scaler = Some(sc);
            }
        }
        Ok(())
    }
}

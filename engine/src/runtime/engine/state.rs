//! The rank's state outside a step: export and import for checkpoints (master shards, optimizer
//! state, step counts, loss scaler) and the full parameters and gradient shards for
//! inspection.

use super::{LossScaler, RankEngine};
use crate::error::{EngineError, Result};
use crate::optim::Optimizer;
use crate::runtime::staged::StagedModel;
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
}

//! [`CheckpointLayout`]: the sharding a checkpoint was saved with (or is loaded into).

use crate::error::{CkptError, Result};
use fsdp_planner::{layout_units, FlatParamLayout, ModelSpec, ShardPlan, UnitLayout};
use serde::Serialize;
use sha2::{Digest, Sha256};

/// The sharding of a model over a world: world size `W = S * R` (shard group size `S`,
/// replicate group size `R`), the flat-parameter layout of every unit for shard size `S`
/// (from [`fsdp_planner::layout_units`]), and the plan fingerprint.
///
/// Rank `r` holds shard index `r % S` of every flat parameter and belongs to replicate index
/// `r / S` (the planner's convention). FSDP (full shard) is `S = W`; DDP is `S = 1`; hybrid
/// sharding has both `S, R > 1`.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointLayout {
    /// The model.
    pub spec: ModelSpec,
    /// World size `W` (ranks).
    pub world_size: u64,
    /// Shard group size `S` (divides `W`).
    pub shard_size: u64,
    /// Segment and shard alignment (elements).
    pub alignment: u64,
    /// Per-unit flat-parameter layouts for shard size `S`.
    pub units: Vec<UnitLayout>,
    /// SHA-256 hex of the plan this layout belongs to. [`CheckpointLayout::new`] derives it
    /// from the layout itself ([`layout_fingerprint`]); an engine running a planner
    /// `ShardPlan` may override it with [`CheckpointLayout::with_plan_fingerprint`].
    pub plan_fingerprint: String,
}

impl CheckpointLayout {
    /// Lays out `spec` for `world_size` ranks in shard groups of `shard_size`, segments aligned
    /// to `alignment` elements.
    ///
    /// Errors: `InvalidArgument` when `world_size` or `shard_size` is 0 or `shard_size` does
    /// not divide `world_size`; `Plan` for an invalid spec or alignment 0.
    pub fn new(spec: ModelSpec, world_size: u64, shard_size: u64, alignment: u64) -> Result<Self> {
        if world_size == 0 {
            return Err(CkptError::InvalidArgument(
                "world size must be at least 1, got 0".into(),
            ));
        }
        if world_size.checked_rem(shard_size) != Some(0) {
            return Err(CkptError::InvalidArgument(format!(
                "shard size {shard_size} does not divide world size {world_size}"
            )));
        }
        let units = layout_units(&spec, shard_size, alignment)?;
        let plan_fingerprint = layout_fingerprint(world_size, shard_size, alignment, &units);
        Ok(CheckpointLayout {
            spec,
            world_size,
            shard_size,
            alignment,
            units,
            plan_fingerprint,
        })
    }

    /// The layout of a planner `ShardPlan` for `spec`: its world and shard sizes, alignment and
    /// unit layouts, and the plan's own fingerprint (so a checkpoint names the exact plan it
    /// was saved under).
    ///
    /// Errors: `InvalidArgument` when the plan's units differ from `layout_units(spec, S,
    /// alignment)` (a plan of another model); as [`CheckpointLayout::new`].
    pub fn from_plan(spec: ModelSpec, plan: &ShardPlan) -> Result<Self> {
        let l = Self::new(
            spec,
            plan.world_size(),
            plan.shard_size,
            plan.config.alignment,
        )?;
        if l.units != plan.units {
            return Err(CkptError::InvalidArgument(format!(
                "the plan (model `{}`) does not lay out model `{}`: unit layouts differ",
                plan.model, l.spec.name
            )));
        }
        Ok(l.with_plan_fingerprint(plan.fingerprint()))
    }

    /// Fully sharded (FSDP / ZeRO-3) layout: `shard_size = world_size`.
    pub fn full_shard(spec: ModelSpec, world_size: u64, alignment: u64) -> Result<Self> {
        Self::new(spec, world_size, world_size, alignment)
    }

    /// Replicated (DDP) layout: `shard_size = 1`, every rank holds the whole model.
    pub fn ddp(spec: ModelSpec, world_size: u64, alignment: u64) -> Result<Self> {
        Self::new(spec, world_size, 1, alignment)
    }

    /// Replaces the plan fingerprint (e.g. with the planner's `ShardPlan` fingerprint).
    pub fn with_plan_fingerprint(mut self, fingerprint: impl Into<String>) -> Self {
        self.plan_fingerprint = fingerprint.into();
        self
    }

    /// Replicate group size `R = W / S`.
    pub fn replicate_size(&self) -> u64 {
        self.world_size / self.shard_size
    }

    /// Shard index of `rank`: `rank % S`.
    pub fn shard_index(&self, rank: u64) -> u64 {
        rank % self.shard_size
    }

    /// Replicate index of `rank`: `rank / S`.
    pub fn replicate_index(&self, rank: u64) -> u64 {
        rank / self.shard_size
    }

    /// Whether `rank` writes model state into a checkpoint: only the ranks of replicate index 0
    /// (ranks `0..S`) do; the other replicas hold identical shards.
    pub fn writes_model_state(&self, rank: u64) -> bool {
        self.replicate_index(rank) == 0
    }

    /// Every flat parameter as `(unit index, flat index inside the unit, layout)`, in unit
    /// order, trainable before frozen.
    pub fn flat_params(&self) -> impl Iterator<Item = (usize, usize, &FlatParamLayout)> {
        self.units.iter().enumerate().flat_map(|(u, ul)| {
            ul.flat_params
                .iter()
                .enumerate()
                .map(move |(k, f)| (u, k, f))
        })
    }

    /// Number of flat parameters over all units.
    pub fn num_flat_params(&self) -> usize {
        self.units.iter().map(|u| u.flat_params.len()).sum()
    }

    /// Checks `rank < world_size`.
    pub fn check_rank(&self, rank: u64) -> Result<()> {
        if rank >= self.world_size {
            return Err(CkptError::InvalidArgument(format!(
                "rank {rank} is out of range for world size {}",
                self.world_size
            )));
        }
        Ok(())
    }
}

/// Name of the rank file tensor holding buffer `what` (`param`, `exp_avg`, `exp_avg_sq`) of
/// flat parameter `k` of unit `u`: `units.{u}.flat{k}.{what}`.
pub fn tensor_name(unit: usize, flat: usize, what: &str) -> String {
    format!("units.{unit}.flat{flat}.{what}")
}

/// SHA-256 hex digest of a layout: world size, shard size, alignment and every unit's flat
/// parameter layout (serialized as JSON). Two ranks (or a checkpoint and a run) with the same
/// digest shard every parameter identically.
pub fn layout_fingerprint(
    world_size: u64,
    shard_size: u64,
    alignment: u64,
    units: &[UnitLayout],
) -> String {
    #[derive(Serialize)]
    struct Fp<'a> {
        world_size: u64,
        shard_size: u64,
        alignment: u64,
        units: &'a [UnitLayout],
    }
    let json = serde_json::to_vec(&Fp {
        world_size,
        shard_size,
        alignment,
        units,
    })
    .expect("layout serializes");
    hex(&Sha256::digest(&json))
}

/// SHA-256 hex digest of a model's identity: every parameter's name, shape, trainability and
/// tie target, in declaration order. Unit grouping and the model name do not enter it, so a
/// checkpoint can be loaded into a model wrapped differently.
pub fn model_fingerprint(spec: &ModelSpec) -> String {
    let mut h = Sha256::new();
    for p in spec.units.iter().flat_map(|u| &u.params) {
        h.update(p.name.as_bytes());
        h.update([0u8]);
        for d in &p.shape {
            h.update(d.to_le_bytes());
        }
        h.update([p.trainable as u8, 0xff]);
        if let Some(t) = &p.tied_to {
            h.update(t.as_bytes());
        }
        h.update([0u8]);
    }
    hex(&h.finalize())
}

/// Lower-case hex of a byte string.
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

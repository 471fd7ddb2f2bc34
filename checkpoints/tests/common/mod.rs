//! Shared helpers of the checkpoint tests: a reference (unsharded) state and its shards.
#![allow(dead_code)]

use fsdp_checkpoints::{CheckpointLayout, FlatShard, FullTensor, RankState, StateKind};
use fsdp_planner::{Architecture, ModelSpec, ParamSpec, UnitSpec};
use std::collections::BTreeMap;

/// `(param name, shape, trainable)`.
pub type P<'a> = (&'a str, Vec<u64>, bool);
/// `(unit name, params)`.
pub type U<'a> = (&'a str, Vec<P<'a>>);

/// A model spec from `(unit name, [(param name, shape, trainable)])`.
pub fn spec(name: &str, units: &[U<'_>]) -> ModelSpec {
    ModelSpec {
        name: name.into(),
        arch: Architecture::Generic,
        units: units
            .iter()
            .map(|(u, ps)| UnitSpec {
                name: u.to_string(),
                params: ps
                    .iter()
                    .map(|(n, s, t)| {
                        let mut p = ParamSpec::new(*n, s);
                        p.trainable = *t;
                        p
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// Reference full state: per parameter name, the three buffers (moments only if trainable).
#[derive(Debug, Clone)]
pub struct Reference {
    pub param: BTreeMap<String, Vec<f32>>,
    pub exp_avg: BTreeMap<String, Vec<f32>>,
    pub exp_avg_sq: BTreeMap<String, Vec<f32>>,
}

impl Reference {
    /// Element `k` (in declaration order over all stored params) of the parameters is
    /// `k + 0.5`; moments `-(k + 0.25)` and `k + 0.125`: no zeros, so a shift is visible.
    pub fn new(spec: &ModelSpec) -> Self {
        let mut r = Reference {
            param: BTreeMap::new(),
            exp_avg: BTreeMap::new(),
            exp_avg_sq: BTreeMap::new(),
        };
        let mut k = 0u64;
        for p in spec.units.iter().flat_map(|u| &u.params) {
            if p.tied_to.is_some() {
                continue;
            }
            let n = p.numel().0;
            let base = k;
            r.param.insert(
                p.name.clone(),
                (0..n).map(|i| (base + i) as f32 + 0.5).collect(),
            );
            if p.trainable {
                r.exp_avg.insert(
                    p.name.clone(),
                    (0..n).map(|i| -((base + i) as f32) - 0.25).collect(),
                );
                r.exp_avg_sq.insert(
                    p.name.clone(),
                    (0..n).map(|i| (base + i) as f32 + 0.125).collect(),
                );
            }
            k += n;
        }
        r
    }

    pub fn get(&self, kind: StateKind) -> &BTreeMap<String, Vec<f32>> {
        match kind {
            StateKind::Param => &self.param,
            StateKind::ExpAvg => &self.exp_avg,
            StateKind::ExpAvgSq => &self.exp_avg_sq,
        }
    }

    /// The shards of `rank` under `layout`, cut from this reference (padding zero).
    pub fn rank_state(&self, layout: &CheckpointLayout, rank: u64) -> RankState {
        let s = layout.shard_index(rank);
        let flats = layout
            .units
            .iter()
            .map(|ul| {
                ul.flat_params
                    .iter()
                    .map(|f| {
                        let cut = |m: &BTreeMap<String, Vec<f32>>| {
                            let parts: Vec<&[f32]> =
                                f.segments.iter().map(|s| m[&s.name].as_slice()).collect();
                            f.shard_of(&f.flatten(&parts), s)
                        };
                        FlatShard {
                            param: cut(&self.param),
                            exp_avg: f.trainable.then(|| cut(&self.exp_avg)),
                            exp_avg_sq: f.trainable.then(|| cut(&self.exp_avg_sq)),
                        }
                    })
                    .collect()
            })
            .collect();
        RankState { rank, flats }
    }

    /// Shards of ranks `0..S`.
    pub fn all_ranks(&self, layout: &CheckpointLayout) -> Vec<RankState> {
        (0..layout.shard_size)
            .map(|r| self.rank_state(layout, r))
            .collect()
    }

    /// Asserts bitwise equality of consolidated tensors with this reference.
    pub fn assert_full_eq(&self, kind: StateKind, got: &[FullTensor]) {
        let want = self.get(kind);
        assert_eq!(got.len(), want.len(), "{kind:?}: tensor count");
        for t in got {
            let w = want
                .get(&t.name)
                .unwrap_or_else(|| panic!("unexpected tensor {}", t.name));
            assert_eq!(t.data.len(), w.len(), "{}: numel", t.name);
            assert!(
                t.data
                    .iter()
                    .zip(w)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{kind:?} {}: values differ",
                t.name
            );
        }
    }
}

/// Saves `reference` at `layout` under `root` with step `step`; returns the checkpoint dir.
pub fn save(
    root: &std::path::Path,
    layout: &CheckpointLayout,
    reference: &Reference,
    train: &fsdp_checkpoints::TrainState,
) -> std::path::PathBuf {
    let ranks = reference.all_ranks(layout);
    let refs: Vec<_> = ranks.iter().map(|r| r.as_refs()).collect();
    fsdp_checkpoints::save_checkpoint(root, layout, &refs, train, 3).expect("save")
}

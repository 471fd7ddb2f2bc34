//! The unshard schedule: forward and backward order of unit uses, which units are unsharded
//! (alive) at each position, which all-gathers are prefetched, and where each unit's gradient is
//! complete and reduce-scattered.
//!
//! Unit uses: every unit is used once in forward order, except a tied-head root unit (the last
//! unit, holding a tied parameter, as `gpt2_spec` builds it) which is used first (embedding)
//! and last (head), like FSDP's root unit. Backward visits the uses in reverse.
//!
//! Alive sets (the contract of the `memory` module), with prefetch depth `p` and `m` uses:
//! - forward, reshard after forward: uses `k..=k+p` (clipped);
//! - forward, keep after forward: uses `0..=k+p`;
//! - backward, reshard after forward: backward uses `k..=k+p`;
//! - backward, keep after forward: backward uses `k..m` (units not yet done with backward);
//! - the root unit is alive from its first forward use until its last backward use;
//! - activation checkpointing does not change the alive sets (parameters), only what the
//!   engine keeps of each use's forward (the memory plan's activations);
//! - replicated parameters (shard-optimizer, ZeRO-1): every unit is alive at every step,
//!   forward and backward: all of them are gathered together at the first forward step (no
//!   prefetch list: nothing is gathered later), and gradient buffers live as under
//!   keep-after-forward (see [`build_replicated_schedule`]).

use crate::layout::UnitLayout;
use crate::spec::ModelSpec;
use serde::{Deserialize, Serialize};

/// What part of the model a unit use computes (for activation estimates).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UseRole {
    /// Token (and position) embedding: a unit named `embed`, or the root's first use.
    Embedding,
    /// A transformer block or any other unit.
    Block,
    /// Final norm and LM head: a unit named `head`, or the root's last use.
    Head,
}

/// One position of the forward or backward schedule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleStep {
    /// Index of the unit computing.
    pub unit: usize,
    /// The role of this use.
    pub role: UseRole,
    /// `h.3`, or `root (embedding)` / `root (head)` for the two uses of a root unit.
    pub label: String,
    /// Units unsharded while this step computes (ascending unit index).
    pub alive: Vec<usize>,
    /// Units whose all-gather is issued ahead at this step (the next `prefetch` uses'
    /// units not alive before this step), in issue order.
    pub prefetch: Vec<usize>,
    /// Backward only: units whose unsharded gradient buffer is alive at this step (the unit
    /// computing plus a root unit between its two backward uses); trainable units only.
    pub grads_alive: Vec<usize>,
    /// Backward only: this step completes the unit's gradient, which is then reduce-scattered
    /// (all-reduced when S == 1) and the unit resharded. False for frozen-only units.
    pub reduce_scatter: bool,
}

/// Forward and backward order with prefetch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schedule {
    /// Whether units are resharded after forward (full shard, hybrid).
    pub reshard_after_forward: bool,
    /// Prefetch depth (units gathered ahead).
    pub prefetch: u64,
    /// The tied-head root unit used first and last, if any.
    pub root_unit: Option<usize>,
    /// Parameters and gradients stay unsharded (replicated) for the whole step, only the
    /// master weights and optimizer state are sharded (shard-optimizer, ZeRO-1). Omitted from
    /// JSON (and from the fingerprint input) when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replicated: bool,
    /// Unit-level activation checkpointing ([`crate::PlanConfig::activation_checkpointing`],
    /// resolved): forward keeps only each use's input and backward recomputes the use's
    /// forward; otherwise every use's autograd graph is kept from forward to its backward.
    /// Independent of `reshard_after_forward`: a resharded unit whose graph is kept has its
    /// unsharded parameter memory freed after forward and re-gathered (into the same parameter
    /// tensors the graph holds) before its backward. The fingerprint input leaves it out when
    /// it equals `reshard_after_forward` (the rule of plans made before the setting existed).
    #[serde(default)]
    pub activation_checkpointing: bool,
    /// Forward steps.
    pub forward: Vec<ScheduleStep>,
    /// Backward steps (reverse of the forward uses).
    pub backward: Vec<ScheduleStep>,
}

/// Builds the schedule of `spec` (already laid out as `units`), with activation
/// checkpointing set to `reshard_after_forward` (the rule before the setting existed; `plan` applies the
/// config's setting).
#[allow(clippy::needless_range_loop)]
pub fn build_schedule(
    spec: &ModelSpec,
    units: &[UnitLayout],
    reshard_after_forward: bool,
    prefetch: u64,
) -> Schedule {
    let n = spec.units.len();
    let last = n - 1;
    let root = (n > 1 && !units[last].tied.is_empty()).then_some(last);
    let mut uses: Vec<(usize, UseRole, String)> = Vec::with_capacity(n + 1);
    let role_of = |i: usize| match spec.units[i].name.as_str() {
        "embed" => UseRole::Embedding,
        "head" => UseRole::Head,
        _ => UseRole::Block,
    };
    if let Some(r) = root {
        let name = &spec.units[r].name;
        uses.push((r, UseRole::Embedding, format!("{name} (embedding)")));
        for i in 0..last {
            uses.push((i, role_of(i), spec.units[i].name.clone()));
        }
        uses.push((r, UseRole::Head, format!("{name} (head)")));
    } else {
        for i in 0..n {
            uses.push((i, role_of(i), spec.units[i].name.clone()));
        }
    }
    let m = uses.len();
    let p = usize::try_from(prefetch).unwrap_or(usize::MAX).min(m);
    let trainable = |u: usize| units[u].flat_params.iter().any(|f| f.trainable);

    let collect = |idx: &mut dyn Iterator<Item = usize>, order: &[usize]| -> Vec<usize> {
        let mut v: Vec<usize> = idx.map(|j| order[j]).collect();
        if let Some(r) = root {
            v.push(r);
        }
        v.sort_unstable();
        v.dedup();
        v
    };
    let fwd_order: Vec<usize> = uses.iter().map(|u| u.0).collect();
    let bwd_order: Vec<usize> = fwd_order.iter().rev().copied().collect();

    let mut forward = Vec::with_capacity(m);
    let mut prev_alive: Vec<usize> = Vec::new();
    for k in 0..m {
        let hi = (k + p).min(m - 1);
        let alive = if reshard_after_forward {
            collect(&mut (k..=hi), &fwd_order)
        } else {
            collect(&mut (0..=hi), &fwd_order)
        };
        let prefetch = prefetch_list(&fwd_order, k, hi, &prev_alive);
        forward.push(ScheduleStep {
            unit: uses[k].0,
            role: uses[k].1,
            label: uses[k].2.clone(),
            alive: alive.clone(),
            prefetch,
            grads_alive: Vec::new(),
            reduce_scatter: false,
        });
        prev_alive = alive;
    }
    let mut first_bwd = vec![m; n];
    let mut last_bwd = vec![0usize; n];
    for (k, &u) in bwd_order.iter().enumerate() {
        first_bwd[u] = first_bwd[u].min(k);
        last_bwd[u] = k;
    }
    // Units whose gradient buffer spans several backward steps (a root unit used twice).
    let multi: Vec<usize> = (0..n).filter(|&x| first_bwd[x] < last_bwd[x]).collect();
    let mut backward = Vec::with_capacity(m);
    for k in 0..m {
        let u = bwd_order[k];
        let hi = (k + p).min(m - 1);
        let alive = if reshard_after_forward {
            collect(&mut (k..=hi), &bwd_order)
        } else {
            collect(&mut (k..m), &bwd_order)
        };
        let prefetch = prefetch_list(&bwd_order, k, hi, &prev_alive);
        let mut grads_alive: Vec<usize> = multi
            .iter()
            .copied()
            .filter(|&x| first_bwd[x] <= k && last_bwd[x] >= k)
            .chain(std::iter::once(u))
            .filter(|&x| trainable(x))
            .collect();
        grads_alive.sort_unstable();
        grads_alive.dedup();
        backward.push(ScheduleStep {
            unit: u,
            role: uses[m - 1 - k].1,
            label: uses[m - 1 - k].2.clone(),
            alive: alive.clone(),
            prefetch,
            grads_alive,
            reduce_scatter: trainable(u) && last_bwd[u] == k,
        });
        prev_alive = alive;
    }
    Schedule {
        reshard_after_forward,
        prefetch,
        root_unit: root,
        replicated: false,
        activation_checkpointing: reshard_after_forward,
        forward,
        backward,
    }
}

/// The schedule of the shard-optimizer strategy (ZeRO-1, Rajbhandari et al. 2020 sec. 5.1):
/// the uses, roles, labels, gradient buffers (`grads_alive`) and `reduce_scatter` flags of the
/// keep-after-forward schedule, but every unit is alive (unsharded) at every forward and
/// backward step: all are gathered together at the first forward step of a step (`prefetch`
/// lists empty) and kept until the optimizer step has updated their shards.
pub fn build_replicated_schedule(spec: &ModelSpec, units: &[UnitLayout]) -> Schedule {
    let mut s = build_schedule(spec, units, false, 0);
    let all: Vec<usize> = (0..units.len()).collect();
    for st in s.forward.iter_mut().chain(s.backward.iter_mut()) {
        st.alive.clone_from(&all);
        st.prefetch.clear();
    }
    s.replicated = true;
    s
}

/// Units of uses `k+1..=hi` not alive at the previous step and not the unit at `k`, in issue
/// order, without repeats.
fn prefetch_list(order: &[usize], k: usize, hi: usize, prev_alive: &[usize]) -> Vec<usize> {
    let mut out = Vec::new();
    for &u in &order[(k + 1).min(order.len())..=hi.max(k)] {
        if u != order[k] && !prev_alive.contains(&u) && !out.contains(&u) {
            out.push(u);
        }
    }
    out
}

/// Whether a step under `schedule` on `world_size` ranks overlaps each unit's gradient
/// reduction with the next backward step (prefetch depth >= 1, `world_size > 1`, not the
/// replicated shard-optimizer schedule, whose units are all gathered at once: it reduces each
/// unit when its gradient is complete and waits for it there). The planner's memory timeline
/// and the engine both decide with this function.
pub fn overlaps_reductions(schedule: &Schedule, world_size: u64) -> bool {
    schedule.prefetch > 0 && world_size > 1 && !schedule.replicated
}

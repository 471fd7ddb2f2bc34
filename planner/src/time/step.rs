//! The step model: the engine's step for a plan, replayed on the [`Timeline`] (see the
//! module doc of [`super`]).

use super::flops::{self, AttentionCount, Grads, OpCost, OpKind, OpShape};
use super::profile::{ComputeFit, GemmCurve, HardwareProfile};
use super::timeline::Timeline;
use super::{
    format_seconds, CollectiveKind, CollectiveTime, GroupKind, PhaseTime, SpanKind, StepPrediction,
    TimeInputs, Track, UseTime,
};
use crate::config::{Offload, Optimizer};
use crate::error::PlanError;
use crate::memory::{defers_grad_sync, Phase};
use crate::plan::ShardPlan;
use crate::schedule::overlaps_reductions;
use fsdp_types::DType;
use serde::Serialize;

/// Where a group's ranks sit: `n` members over `nodes` nodes, `per_node` members per node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Geometry {
    n: u64,
    nodes: u64,
    per_node: u64,
}

impl Geometry {
    fn of(n: u64, nodes: u64) -> Self {
        Geometry {
            n,
            nodes,
            per_node: (n / nodes.max(1)).max(1),
        }
    }
}

/// The worst-placed shard group (contiguous ranks `qS..qS+S`).
fn shard_geometry(s: u64, r: u64, rpn: u64) -> Geometry {
    let nodes = (0..r)
        .map(|q| (q * s + s - 1) / rpn - (q * s) / rpn + 1)
        .max()
        .unwrap_or(1);
    Geometry::of(s, nodes)
}

/// The worst-placed replicate group (ranks `i, i+S, ..., i+(R-1)S`).
fn replicate_geometry(s: u64, r: u64, rpn: u64) -> Geometry {
    let mut worst = 1;
    for i in 0..s {
        let mut nodes = 0;
        let mut last = u64::MAX;
        for j in 0..r {
            let node = (i + j * s) / rpn;
            if node != last {
                nodes += 1;
                last = node;
            }
        }
        worst = worst.max(nodes);
    }
    Geometry::of(r, worst)
}

/// Seconds of one collective of `bytes` (the whole array, nccl-tests' `S`) over `g`.
fn collective_seconds(p: &HardwareProfile, kind: CollectiveKind, g: Geometry, bytes: f64) -> f64 {
    if g.n <= 1 {
        return 0.0;
    }
    let pick = |l: &super::LinkCollectives| match kind {
        CollectiveKind::AllGather => l.all_gather,
        CollectiveKind::ReduceScatter => l.reduce_scatter,
        CollectiveKind::AllReduce => l.all_reduce,
    };
    let intra = pick(&p.collectives.intra_node);
    let inter = pick(&p.collectives.inter_node);
    let n = g.n as f64;
    let nodes = g.nodes as f64;
    let (steps, inter_steps, factor) = match kind {
        CollectiveKind::AllReduce => (2.0 * (n - 1.0), 2.0 * (nodes - 1.0), 2.0 * (n - 1.0) / n),
        _ => (n - 1.0, nodes - 1.0, (n - 1.0) / n),
    };
    let (latency, busbw) = if g.nodes <= 1 {
        (
            intra.latency_s + steps * intra.step_latency_s,
            intra.bus_bandwidth_bytes_per_s,
        )
    } else {
        (
            inter.latency_s
                + (steps - inter_steps) * intra.step_latency_s
                + inter_steps * inter.step_latency_s,
            (g.per_node as f64 * inter.bus_bandwidth_bytes_per_s)
                .min(intra.bus_bandwidth_bytes_per_s),
        )
    };
    latency + bytes * factor / busbw
}

/// The analytical compute of one list of ops, before the profile's [`ComputeFit`].
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct ComputeParts {
    /// Seconds of the GEMMs at the profile's curve.
    pub gemm_s: f64,
    /// Seconds of the elementwise ops (roofline of bandwidth and elementwise rate).
    pub elementwise_s: f64,
    /// Number of ops.
    pub ops: f64,
    /// Seconds of the GEMMs at the dtype's peak: the least their fitted time can be.
    pub gemm_peak_s: f64,
}

impl ComputeParts {
    /// Seconds under `fit`: `max(gemm_scale gemm_s, gemm_peak_s) + elementwise_scale
    /// elementwise_s + op_overhead_s ops`. A GEMM scale under 1 (reference jobs that ran
    /// faster than calibrate's GEMM measurement) never prices a GEMM above the profile's
    /// peak, so MFU stays under 100%.
    pub fn seconds(&self, fit: &ComputeFit) -> f64 {
        (fit.gemm_scale * self.gemm_s).max(self.gemm_peak_s)
            + fit.elementwise_scale * self.elementwise_s
            + fit.op_overhead_s * self.ops
    }
}

/// The analytical compute of one forward position of a plan's schedule.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UseParts {
    /// Position in the forward schedule.
    pub position: usize,
    /// The unit used.
    pub unit: usize,
    /// Its label (`h.3`).
    pub label: String,
    /// Its forward (also what a recompute costs).
    pub forward: ComputeParts,
    /// Its backward (zero parts when the use runs no backward).
    pub backward: ComputeParts,
}

fn parts(ops: &[OpCost], curve: &GemmCurve, p: &HardwareProfile) -> ComputeParts {
    let mut c = ComputeParts::default();
    for o in ops {
        match o.kind {
            OpKind::Gemm => {
                // `calls` equal calls, each at the rate of its shape, or of its own size.
                let calls = o.calls.max(1.0);
                c.gemm_s += match &o.shape {
                    Some(shape) => calls * curve.seconds_of(shape),
                    None => calls * curve.seconds(o.flops / calls),
                };
                c.gemm_peak_s += o.flops / curve.peak_flops_per_s;
            }
            OpKind::Elementwise => {
                c.elementwise_s += p
                    .memory_seconds(o.bytes)
                    .max(o.flops / p.elementwise_flops_per_s)
            }
        }
        c.ops += 1.0;
    }
    c
}

/// The engine's needs_input_grad per forward position: a use needs its input gradient when
/// a trainable unit precedes it.
fn input_grads(plan: &ShardPlan) -> Vec<bool> {
    let trainable = |u: usize| plan.units[u].flat_params.iter().any(|f| f.trainable);
    let mut seen = false;
    plan.schedule
        .forward
        .iter()
        .map(|st| {
            let nig = seen;
            seen |= trainable(st.unit);
            nig
        })
        .collect()
}

/// The analytical compute (GEMM seconds, elementwise seconds, op count) of every forward
/// position's forward and backward, one micro-batch, before the profile's [`ComputeFit`]:
/// what `fsdp calibrate` fits the correction to.
///
/// Errors: [`PlanError::BadProfile`] (an invalid profile, or none for the plan's
/// `param_dtype`), or an architecture the FLOP count does not know.
pub fn use_compute_parts(
    plan: &ShardPlan,
    profile: &HardwareProfile,
) -> Result<Vec<UseParts>, PlanError> {
    profile.validate(&profile.name)?;
    let cfg = &plan.config;
    let curve = profile.gemm_curve(cfg.param_dtype)?;
    let shape = OpShape {
        micro_batch: cfg.micro_batch,
        seq_len: cfg.seq_len,
        dtype: cfg.param_dtype,
        attention: AttentionCount::of(cfg.activations),
    };
    let trainable = |u: usize| plan.units[u].flat_params.iter().any(|f| f.trainable);
    let nig = input_grads(plan);
    let mut out = Vec::with_capacity(nig.len());
    for (k, st) in plan.schedule.forward.iter().enumerate() {
        let grads = Grads {
            input: nig[k],
            weights: trainable(st.unit),
        };
        let fo = flops::forward_ops(&plan.arch, st.role, &shape)?;
        let backward = if grads.input || grads.weights {
            parts(
                &flops::backward_ops(&plan.arch, st.role, &shape, grads)?,
                curve,
                profile,
            )
        } else {
            ComputeParts::default()
        };
        out.push(UseParts {
            position: k,
            unit: st.unit,
            label: st.label.clone(),
            forward: parts(&fo, curve, profile),
            backward,
        });
    }
    Ok(out)
}

#[derive(Debug, Clone)]
enum UnitState {
    Sharded,
    /// All-gathers in flight (collective ids; empty when nothing is gathered).
    Unsharding(Vec<usize>),
    Unsharded,
}

/// The simulation of one rank's step.
struct Sim<'a> {
    plan: &'a ShardPlan,
    p: &'a HardwareProfile,
    tl: Timeline,
    state: Vec<UnitState>,
    pd: f64,
    rd: f64,
    offload: Offload,
    shard: Geometry,
    replicate: Geometry,
    world: Geometry,
}

impl Sim<'_> {
    fn mem(&self, bytes: f64) -> f64 {
        self.p.memory_seconds(bytes)
    }
    fn link(&self, bytes: f64) -> f64 {
        bytes / self.p.host.link_bytes_per_s
    }
    fn host(&self, bytes: f64) -> f64 {
        bytes / self.p.host.optimizer_bytes_per_s
    }
    fn label(&self, u: usize) -> String {
        self.plan.units[u].name.clone()
    }
    fn flat_label(&self, u: usize, f: usize) -> String {
        let unit = &self.plan.units[u];
        if unit.flat_params.len() > 1 && !unit.flat_params[f].trainable {
            format!("{} (frozen)", unit.name)
        } else {
            unit.name.clone()
        }
    }

    fn issue(
        &mut self,
        kind: CollectiveKind,
        group: GroupKind,
        unit: Option<usize>,
        label: String,
        bytes: f64,
    ) -> usize {
        let g = match group {
            GroupKind::Shard => self.shard,
            GroupKind::Replicate => self.replicate,
            GroupKind::World => self.world,
        };
        let secs = collective_seconds(self.p, kind, g, bytes);
        self.tl.issue(kind, group, unit, label, bytes, secs)
    }

    /// Issues and waits (a synchronous call: it drains the queue first, as the engine's);
    /// nothing on a group of one rank, where the engine's calls return at once.
    fn blocking(&mut self, kind: CollectiveKind, group: GroupKind, label: &str, bytes: f64) {
        let n = match group {
            GroupKind::Shard => self.shard.n,
            GroupKind::Replicate => self.replicate.n,
            GroupKind::World => self.world.n,
        };
        if n <= 1 {
            return;
        }
        let id = self.issue(kind, group, None, label.to_string(), bytes);
        self.tl.wait(id);
    }

    /// `FsdpUnit::start_unshard`: per flat parameter, the rank's block (cast from the master,
    /// or copied from the device shard / uploaded from the host when offloaded), then the
    /// in-place all-gather over the shard group.
    fn start_unshard(&mut self, u: usize) {
        let s = self.plan.shard_size;
        let mut ids = Vec::new();
        for f in 0..self.plan.units[u].flat_params.len() {
            let fl = &self.plan.units[u].flat_params[f];
            let shard = fl.shard_numel().0 as f64;
            let padded = fl.padded_numel.0 as f64;
            let label = self.flat_label(u, f);
            match self.offload {
                Offload::Params => {
                    let t = self.link(shard * self.pd);
                    self.tl.compute(
                        t,
                        SpanKind::HostCopy,
                        format!("upload shard {label}"),
                        Some(u),
                    );
                }
                Offload::Optimizer => {
                    let t = self.mem(2.0 * shard * self.pd);
                    self.tl
                        .compute(t, SpanKind::Copy, format!("copy shard {label}"), Some(u));
                }
                Offload::None if s > 1 => {
                    let t = self.mem(shard * (4.0 + self.pd));
                    self.tl
                        .compute(t, SpanKind::Copy, format!("cast shard {label}"), Some(u));
                }
                Offload::None => {}
            }
            if s > 1 {
                ids.push(self.issue(
                    CollectiveKind::AllGather,
                    GroupKind::Shard,
                    Some(u),
                    label,
                    padded * self.pd,
                ));
            }
        }
        self.state[u] = UnitState::Unsharding(ids);
    }

    /// `FsdpUnit::finish_unshard`: waits for the all-gathers; with a shard group of one and
    /// 16-bit parameters, casts the master parameters.
    fn finish_unshard(&mut self, u: usize) {
        if let UnitState::Unsharding(ids) =
            std::mem::replace(&mut self.state[u], UnitState::Unsharded)
        {
            for id in ids {
                self.tl.wait(id);
            }
        }
        let cfg = &self.plan.config;
        if self.plan.shard_size == 1
            && cfg.param_dtype != DType::F32
            && self.offload == Offload::None
        {
            let padded: f64 = self.plan.units[u]
                .flat_params
                .iter()
                .map(|f| f.padded_numel.0 as f64)
                .fold(0.0, |a, b| a + b);
            let t = self.mem(padded * (4.0 + self.pd));
            let name = format!("cast parameters {}", self.label(u));
            self.tl.compute(t, SpanKind::Copy, name, Some(u));
        }
    }

    /// `RankEngine::transition_to`.
    fn transition(&mut self, alive: &[usize], first: Option<usize>, prefetch: &[usize]) {
        for u in 0..self.state.len() {
            if !alive.contains(&u) {
                if let UnitState::Unsharding(ids) =
                    std::mem::replace(&mut self.state[u], UnitState::Sharded)
                {
                    for id in ids {
                        self.tl.wait(id);
                    }
                }
                self.state[u] = UnitState::Sharded;
            }
        }
        if let Some(f) = first {
            match self.state[f] {
                UnitState::Unsharding(_) => self.finish_unshard(f),
                UnitState::Sharded => {
                    self.start_unshard(f);
                    self.finish_unshard(f);
                }
                UnitState::Unsharded => {}
            }
        }
        for &u in prefetch.iter().chain(alive.iter()) {
            if Some(u) != first && matches!(self.state[u], UnitState::Sharded) {
                self.start_unshard(u);
            }
        }
    }

    fn trainable_flats(&self, u: usize) -> Vec<usize> {
        (0..self.plan.units[u].flat_params.len())
            .filter(|&f| self.plan.units[u].flat_params[f].trainable)
            .collect()
    }

    /// `RankEngine::start_reduce`: per trainable flat parameter, the cast of an f32
    /// accumulation (sync-last, 16-bit reduction), the check of the rank's contribution for
    /// non-finite elements (one read), then a reduce-scatter over the shard group,
    /// or an all-reduce over the replicate group with a shard group of one, or nothing on one
    /// rank.
    fn start_reduce(&mut self, u: usize, sync_last: bool) -> Vec<Option<usize>> {
        let (s, r) = (self.plan.shard_size, self.plan.replicate_size);
        let mut ids = Vec::new();
        for f in self.trainable_flats(u) {
            let padded = self.plan.units[u].flat_params[f].padded_numel.0 as f64;
            let label = self.flat_label(u, f);
            if sync_last && self.plan.config.reduce_dtype != DType::F32 {
                let t = self.mem(padded * (4.0 + self.rd));
                self.tl
                    .compute(t, SpanKind::Copy, format!("cast gradient {label}"), Some(u));
            }
            let bytes = padded * self.rd;
            // The rank's own contribution checked for a non-finite element before it is sent
            // (one read), so a non-finite report can name the rank.
            let t = self.mem(bytes);
            self.tl
                .compute(t, SpanKind::Copy, format!("finite check {label}"), Some(u));
            ids.push(if s > 1 {
                Some(self.issue(
                    CollectiveKind::ReduceScatter,
                    GroupKind::Shard,
                    Some(u),
                    label,
                    bytes,
                ))
            } else if r > 1 {
                Some(self.issue(
                    CollectiveKind::AllReduce,
                    GroupKind::Replicate,
                    Some(u),
                    label,
                    bytes,
                ))
            } else {
                None
            });
        }
        ids
    }

    /// `RankEngine::finish_reduce`: waits; under hybrid sharding all-reduces the reduced
    /// shard over the replicate group (blocking); adds it into the f32 gradient shard (over
    /// the host link when offloaded).
    fn finish_reduce(&mut self, u: usize, ids: Vec<Option<usize>>) {
        let (s, r) = (self.plan.shard_size, self.plan.replicate_size);
        for (f, id) in self.trainable_flats(u).into_iter().zip(ids) {
            if let Some(id) = id {
                self.tl.wait(id);
            }
            let fl = &self.plan.units[u].flat_params[f];
            let shard = fl.shard_numel().0 as f64;
            let padded = fl.padded_numel.0 as f64;
            let label = self.flat_label(u, f);
            if s > 1 && r > 1 {
                let id = self.issue(
                    CollectiveKind::AllReduce,
                    GroupKind::Replicate,
                    Some(u),
                    label.clone(),
                    shard * self.rd,
                );
                self.tl.wait(id);
            }
            let n = if s > 1 { shard } else { padded };
            if self.offload.is_some() {
                let t = self.link(n * self.rd) + self.host(n * (8.0 + self.rd));
                self.tl.compute(
                    t,
                    SpanKind::HostCopy,
                    format!("download gradient {label}"),
                    Some(u),
                );
            } else {
                let t = self.mem(n * (8.0 + self.rd));
                self.tl.compute(
                    t,
                    SpanKind::Copy,
                    format!("add reduced gradient {label}"),
                    Some(u),
                );
            }
        }
    }
}

/// The most micro-batches per step [`predict`] simulates: each is replayed span by span
/// (about 16 KB of spans each), so a step of millions would take minutes and gigabytes.
pub const MAX_MICRO_BATCHES: u64 = 4096;

/// Predicts one training step of `plan` on `profile` (see the [`super`] module doc for the
/// model, its sources and what it ignores). Pure and deterministic.
///
/// Errors: `InvalidConfig` for a generic architecture (no ops to count), a
/// `ranks_per_node` of 0 or more than [`MAX_MICRO_BATCHES`] micro-batches; [`PlanError::BadProfile`] for a profile that fails
/// [`HardwareProfile::validate`] or lacks a GEMM curve for the plan's `param_dtype`.
pub fn predict(
    plan: &ShardPlan,
    profile: &HardwareProfile,
    inputs: &TimeInputs,
) -> Result<StepPrediction, PlanError> {
    profile.validate(&profile.name)?;
    let cfg = &plan.config;
    if cfg.grad_accum > MAX_MICRO_BATCHES {
        return Err(PlanError::InvalidConfig(format!(
            "--grad-accum {}: the step-time model simulates every micro-batch of a step, at \
             most {MAX_MICRO_BATCHES}; predict with fewer micro-batches of more sequences \
             (--micro-batch), or plan without --hardware",
            cfg.grad_accum
        )));
    }
    let curve = profile.gemm_curve(cfg.param_dtype)?;
    let rpn = inputs.ranks_per_node.unwrap_or(profile.ranks_per_node);
    if rpn == 0 {
        return Err(PlanError::InvalidConfig(
            "ranks per node must be at least 1, got 0".into(),
        ));
    }
    let sched = &plan.schedule;
    let w = plan.world_size();
    let (s, r) = (plan.shard_size, plan.replicate_size);
    let shape = OpShape {
        micro_batch: cfg.micro_batch,
        seq_len: cfg.seq_len,
        dtype: cfg.param_dtype,
        attention: AttentionCount::of(cfg.activations),
    };
    let m = sched.forward.len();
    let trainable = |u: usize| plan.units[u].flat_params.iter().any(|f| f.trainable);
    // The engine's needs_input_grad / needs_backward per stage.
    let needs_input_grad = input_grads(plan);
    let fit = profile.fit(cfg.param_dtype);
    let ckpt = sched.activation_checkpointing;
    let mut fwd_s = Vec::with_capacity(m);
    let mut bwd_s = Vec::with_capacity(m);
    let mut uses = Vec::with_capacity(m);
    let mut hw_flops_mb = 0.0;
    for (k, st) in sched.forward.iter().enumerate() {
        let fo = flops::forward_ops(&plan.arch, st.role, &shape)?;
        let grads = Grads {
            input: needs_input_grad[k],
            weights: trainable(st.unit),
        };
        let bo = flops::backward_ops(&plan.arch, st.role, &shape, grads)?;
        let (ft, bt) = (
            parts(&fo, curve, profile).seconds(&fit),
            parts(&bo, curve, profile).seconds(&fit),
        );
        let (ff, bf) = (flops::total_flops(&fo, None), flops::total_flops(&bo, None));
        let runs_backward = grads.input || grads.weights;
        let recomputes = ckpt && k + 1 != m && runs_backward;
        hw_flops_mb += ff + bf + if recomputes { ff } else { 0.0 };
        uses.push(UseTime {
            position: k,
            unit: st.unit,
            label: st.label.clone(),
            forward_s: ft,
            recompute_s: if recomputes { ft } else { 0.0 },
            backward_s: bt,
            forward_flops: ff,
            backward_flops: bf,
        });
        fwd_s.push(ft);
        bwd_s.push(bt);
    }

    let mut sim = Sim {
        plan,
        p: profile,
        tl: Timeline::new(
            profile.overlap_slowdown,
            if w > 1 { profile.rank_skew } else { 0.0 },
        ),
        state: vec![UnitState::Sharded; plan.units.len()],
        pd: cfg.param_dtype.size_bytes() as f64,
        rd: cfg.reduce_dtype.size_bytes() as f64,
        offload: cfg.offload_mode(),
        shard: shard_geometry(s, r, rpn),
        replicate: replicate_geometry(s, r, rpn),
        world: Geometry::of(w, (w - 1) / rpn + 1),
    };
    let a = cfg.grad_accum;
    let sync_last = defers_grad_sync(cfg, sched, a);
    let overlap = overlaps_reductions(sched, w);

    // Step start: the world all-gather of (micro-batches, tokens) per rank.
    sim.tl.phase = Phase::Forward;
    sim.blocking(
        CollectiveKind::AllGather,
        GroupKind::World,
        "counts",
        16.0 * w as f64,
    );
    let mut touched = vec![false; plan.units.len()];
    for k in 0..a {
        let reduce = !sync_last || k + 1 == a;
        sim.tl.micro_batch = Some(k);
        sim.tl.phase = Phase::Forward;
        for (i, st) in sched.forward.iter().enumerate() {
            sim.transition(&st.alive, Some(st.unit), &st.prefetch);
            sim.tl.compute(
                fwd_s[i],
                SpanKind::Forward,
                format!("forward {}", st.label),
                Some(st.unit),
            );
        }
        sim.tl.phase = Phase::Backward;
        let mut pending: Option<(usize, Vec<Option<usize>>)> = None;
        touched.iter_mut().for_each(|t| *t = false);
        for (kb, st) in sched.backward.iter().enumerate() {
            let i = m - 1 - kb;
            let u = st.unit;
            sim.transition(&st.alive, Some(u), &st.prefetch);
            if needs_input_grad[i] || trainable(u) {
                if ckpt && i + 1 != m {
                    sim.tl.compute(
                        fwd_s[i],
                        SpanKind::Recompute,
                        format!("recompute {}", st.label),
                        Some(u),
                    );
                }
                sim.tl.compute(
                    bwd_s[i],
                    SpanKind::Backward,
                    format!("backward {}", st.label),
                    Some(u),
                );
                if trainable(u) {
                    let add = sync_last || touched[u];
                    let gd = if sync_last { 4.0 } else { sim.rd };
                    let per = sim.pd + gd * if add { 2.0 } else { 1.0 };
                    let padded: f64 = plan.units[u]
                        .flat_params
                        .iter()
                        .filter(|f| f.trainable)
                        .map(|f| f.padded_numel.0 as f64)
                        .fold(0.0, |a, b| a + b);
                    let t = sim.mem(padded * per);
                    sim.tl.compute(
                        t,
                        SpanKind::Copy,
                        format!("gradient copy {}", st.label),
                        Some(u),
                    );
                    touched[u] = true;
                }
            }
            if let Some((pu, ids)) = pending.take() {
                sim.finish_reduce(pu, ids);
            }
            if st.reduce_scatter && reduce {
                let ids = sim.start_reduce(u, sync_last);
                if overlap {
                    pending = Some((u, ids));
                } else {
                    sim.finish_reduce(u, ids);
                }
            }
        }
        if let Some((pu, ids)) = pending.take() {
            sim.finish_reduce(pu, ids);
        }
    }

    // Optimizer step.
    sim.tl.micro_batch = None;
    sim.tl.phase = Phase::OptimizerStep;
    if !sched.replicated {
        sim.transition(&[], None, &[]);
    }
    let trainable_shard: f64 = plan
        .units
        .iter()
        .flat_map(|u| &u.flat_params)
        .filter(|f| f.trainable)
        .map(|f| f.shard_numel().0 as f64)
        .fold(0.0, |a, b| a + b);
    let post = |sim: &Sim<'_>, bytes: f64| {
        if sim.offload.is_some() {
            sim.host(bytes)
        } else {
            sim.mem(bytes)
        }
    };
    // The divide by the token count (read and write), then the sum of squares (a read; one
    // dependent f64 chain on a CPU, at the profile's norm rate when it has one).
    let squares = match profile.norm_elements_per_s {
        Some(rate) => (trainable_shard / rate).max(post(&sim, 4.0 * trainable_shard)),
        None => post(&sim, 4.0 * trainable_shard),
    };
    let t = post(&sim, 8.0 * trainable_shard) + squares;
    sim.tl.compute(
        t,
        SpanKind::Optimizer,
        "gradient scale and norm".into(),
        None,
    );
    sim.blocking(
        CollectiveKind::AllReduce,
        GroupKind::World,
        "loss and flags",
        24.0,
    );
    if inputs.clip_grad_norm {
        sim.blocking(
            CollectiveKind::AllReduce,
            GroupKind::Shard,
            "gradient norm",
            8.0,
        );
        let t = post(&sim, 8.0 * trainable_shard);
        sim.tl
            .compute(t, SpanKind::Optimizer, "clip gradients".into(), None);
    }
    // The update's bytes, then zeroing the gradient shards (4 per element).
    let update = trainable_shard
        * match cfg.optimizer {
            Optimizer::AdamW => 28.0,
            Optimizer::Sgd { momentum } if momentum != 0.0 => 20.0,
            Optimizer::Sgd { .. } => 12.0,
        };
    let zero = 4.0 * trainable_shard;
    let t = match (sim.offload, profile.optimizer_bytes_per_s) {
        (Offload::None, Some(rate)) => update / rate + sim.mem(zero),
        _ => post(&sim, update + zero),
    };
    sim.tl
        .compute(t, SpanKind::Optimizer, "optimizer step".into(), None);
    if sim.offload == Offload::Optimizer {
        let t = sim.link(trainable_shard * sim.pd);
        sim.tl.compute(
            t,
            SpanKind::HostCopy,
            "upload parameter shards".into(),
            None,
        );
    }
    sim.tl.finish();
    let step_s = sim.tl.now();
    let tl = sim.tl;
    let skew_wait_s = tl.skew_wait;

    // Summaries.
    let sum_kind = |kinds: &[SpanKind]| -> f64 {
        tl.spans
            .iter()
            .filter(|sp| sp.track == Track::Compute && kinds.contains(&sp.kind))
            .map(|sp| sp.end_s - sp.start_s)
            .fold(0.0, |a, b| a + b)
    };
    let compute_s = sum_kind(&[SpanKind::Forward, SpanKind::Recompute, SpanKind::Backward]);
    let exposed_comm_s = sum_kind(&[SpanKind::Wait]);
    let optimizer_s = sum_kind(&[SpanKind::Optimizer]);
    let host_copy_s = sum_kind(&[SpanKind::HostCopy]);
    let copy_s = sum_kind(&[SpanKind::Copy]);
    let comm_busy_s = tl
        .issued
        .iter()
        .map(|c| c.end - c.start)
        .fold(0.0, |a, b| a + b);
    let phases = [Phase::Forward, Phase::Backward, Phase::OptimizerStep]
        .into_iter()
        .map(|ph| {
            let of = |wait: bool| -> f64 {
                tl.spans
                    .iter()
                    .filter(|sp| {
                        sp.track == Track::Compute
                            && sp.phase == ph
                            && (!wait || sp.kind == SpanKind::Wait)
                    })
                    .map(|sp| sp.end_s - sp.start_s)
                    .fold(0.0, |a, b| a + b)
            };
            PhaseTime {
                phase: ph,
                wall_s: of(false),
                exposed_comm_s: of(true),
            }
        })
        .collect();
    let mut collectives: Vec<CollectiveTime> = Vec::new();
    for c in &tl.issued {
        match collectives.iter_mut().find(|x| {
            x.kind == c.kind && x.group == c.group && x.unit == c.unit && x.label == c.label
        }) {
            Some(x) => {
                x.count += 1;
                x.busy_s += c.end - c.start;
                x.exposed_s += c.exposed;
            }
            None => collectives.push(CollectiveTime {
                kind: c.kind,
                group: c.group,
                unit: c.unit,
                label: c.label.clone(),
                count: 1,
                bytes_each: c.bytes,
                busy_s: c.end - c.start,
                exposed_s: c.exposed,
            }),
        }
    }

    let tokens_per_step = w * a * cfg.micro_batch * cfg.seq_len;
    let model_flops_per_step = flops::palm_flops_per_token(&plan.arch, plan.numel.0, cfg.seq_len)?
        * tokens_per_step as f64;
    let hardware_flops_per_step = hw_flops_mb * (a * w) as f64;
    let peak = curve.peak_flops_per_s;
    let util = |f: f64| {
        if step_s > 0.0 {
            f / (step_s * w as f64 * peak)
        } else {
            0.0
        }
    };
    let bottleneck = bottleneck_line(
        step_s,
        [
            compute_s,
            exposed_comm_s - skew_wait_s,
            optimizer_s,
            host_copy_s,
            copy_s,
        ],
        &collectives,
        &uses,
        trainable_shard,
    );
    Ok(StepPrediction {
        hardware: profile.name.clone(),
        world_size: w,
        tokens_per_step,
        step_s,
        tokens_per_s: if step_s > 0.0 {
            tokens_per_step as f64 / step_s
        } else {
            0.0
        },
        compute_s,
        exposed_comm_s,
        skew_wait_s,
        comm_busy_s,
        optimizer_s,
        host_copy_s,
        copy_s,
        model_flops_per_step,
        hardware_flops_per_step,
        flop_formula: flops::PALM_FORMULA.to_string(),
        peak_flops_per_s: peak,
        mfu: util(model_flops_per_step),
        hfu: util(hardware_flops_per_step),
        bottleneck,
        phases,
        uses,
        collectives,
        spans: tl.spans,
    })
}

/// The one-line bottleneck: the largest of compute, exposed communication, the optimizer
/// step, host copies and other copies, with the single largest contributor.
fn bottleneck_line(
    step_s: f64,
    parts: [f64; 5],
    collectives: &[CollectiveTime],
    uses: &[UseTime],
    trainable_shard: f64,
) -> String {
    let [compute, exposed, optimizer, host, copies] = parts;
    let step = format_seconds(step_s);
    let largest = parts.iter().copied().fold(0.0, f64::max);
    if largest <= 0.0 {
        return "idle: the step does no work".into();
    }
    if exposed == largest {
        let worst = collectives
            .iter()
            .max_by(|a, b| a.exposed_s.total_cmp(&b.exposed_s))
            .expect("exposed communication comes from a collective");
        let what = match worst.unit {
            Some(u) => format!("{} of unit {u} ({})", worst.kind.name(), worst.label),
            None => format!("{} of the {}", worst.kind.name(), worst.label),
        };
        return format!(
            "communication-bound: {what} exposed {}; exposed communication {} of a {step} step",
            format_seconds(worst.exposed_s),
            format_seconds(exposed)
        );
    }
    if compute == largest {
        let mut best = ("forward", uses.first(), 0.0);
        for u in uses {
            for (phase, t) in [
                ("forward", u.forward_s),
                ("recompute", u.recompute_s),
                ("backward", u.backward_s),
            ] {
                if t > best.2 {
                    best = (phase, Some(u), t);
                }
            }
        }
        let which = best
            .1
            .map(|u| {
                format!(
                    "; largest: {} of unit {} ({}), {} per micro-batch",
                    best.0,
                    u.unit,
                    u.label,
                    format_seconds(best.2)
                )
            })
            .unwrap_or_default();
        return format!(
            "compute-bound: {} {} of a {step} step{which}",
            super::compute_phases(uses),
            format_seconds(compute)
        );
    }
    if optimizer == largest {
        return format!(
            "optimizer-bound: gradient post-processing and the optimizer step {} of a {step} step ({trainable_shard} trainable shard elements per rank)",
            format_seconds(optimizer)
        );
    }
    if host == largest {
        return format!(
            "host-link-bound: offload copies {} of a {step} step",
            format_seconds(host)
        );
    }
    format!(
        "copy-bound: casts, gradient copies and additions {} of a {step} step",
        format_seconds(copies)
    )
}

//! The time model: how long one training step of a [`ShardPlan`](crate::ShardPlan) takes on a
//! hardware profile, per rank and per phase, where the time goes, and the MFU it implies.
//!
//! [`predict`]`(&plan, &profile, &TimeInputs)` replays the step the engine executes for the
//! plan, on one rank, as an event simulation of the rank's two threads
//! (the `timeline` module: compute in program order; collectives in issue order on one
//! progress thread, compute slowed by the profile's `overlap_slowdown` while one runs):
//!
//! - **Step start**: the world all-gather of micro-batch and token counts.
//! - **Per micro-batch, forward**: at each schedule position, the units that leave the alive
//!   set are resharded; the computing unit's all-gather is waited for (or issued and waited
//!   for when not prefetched); then the all-gathers of the prefetch list and of any other
//!   alive unit not yet gathered are issued (each flat parameter its own collective,
//!   `P_f * param_dtype` bytes over the shard group; the rank's block is first cast from the
//!   f32 master shard, elementwise). Then the use's forward ops ([`flops::forward_ops`]).
//! - **Per micro-batch, backward**: the same unshard rule with the backward schedule; the
//!   recomputed forward under activation checkpointing (every use but the loss's, whose graph
//!   is kept); the backward ops ([`flops::backward_ops`]); the copy of the parameter
//!   gradients into the unit's flat gradient. Then the previous unit's reduction is finished
//!   (waited; under hybrid sharding its shard all-reduced over the replicate group, blocking;
//!   added into the f32 gradient shard) and, where the schedule reduces this unit, its
//!   reduction is issued: a reduce-scatter over the shard group (`P_f * reduce_dtype` bytes),
//!   or with a shard group of one an all-reduce over the replicate group; under
//!   `grad_sync = last` (and always for shard-optimizer with accumulation) only in the last
//!   micro-batch, after casting the f32 accumulation to `reduce_dtype`; before it is sent, the
//!   rank's contribution is checked for non-finite elements (one read). With prefetch >= 1
//!   and more than one rank ([`crate::schedule::overlaps_reductions`]) a reduction is
//!   finished after the next backward use, else at once.
//! - **Optimizer step**: the division of the gradient shards by the token count and their
//!   sum of squares (at the profile's `norm_elements_per_s` when it has one: on a CPU one
//!   dependent f64 chain, latency-bound), the all-reduce of the loss and flags (world), the
//!   gradient-norm all-reduce over the shard group and the clip scaling
//!   ([`TimeInputs::clip_grad_norm`]), the optimizer's pass over the shards (AdamW reads
//!   parameter, gradient and both moments and writes three: 28 bytes per element; SGD 20
//!   with momentum, 12 without), memory-bound or at the profile's `optimizer_bytes_per_s`
//!   when it has one (measured on the rank's compute threads, which a CPU device splits the
//!   step over), then 4 bytes per element to zero the gradient. Offloaded
//!   (`PlanConfig::offload`), the post-processing
//!   and the optimizer run at the host optimizer threads' rate, every reduced gradient shard
//!   crosses the host link device to host, and the `param_dtype` shards cross back (under
//!   `optimizer` after the step, under `params` before each all-gather).
//!
//! Compute: a GEMM call takes `flops / rate(flops)` from the profile's curve for
//! `param_dtype`; an elementwise op `max(bytes / memory bandwidth, flops / elementwise rate)`
//! (the bandwidth of a pass of that many bytes when the profile has a bandwidth curve); a
//! use's compute is `gemm_scale x` its GEMM seconds `+ elementwise_scale x` its elementwise
//! seconds `+ op_overhead_s x` its op count, the profile's [`ComputeFit`] for `param_dtype`
//! (1, 1, 0 without one). Memory-bound passes (casts, copies, the optimizer) take the curve's time too.
//! A collective of `S` bytes over `n` ranks takes NCCL's ring model
//! ([`profile::CollectiveCost`]): latency plus `S (n-1)/n / busbw` (all-gather,
//! reduce-scatter) or `S 2(n-1)/n / busbw` (all-reduce), `S` the whole array (nccl-tests'
//! convention); a group whose ranks span nodes (contiguous ranks, `ranks_per_node` per
//! node) uses the inter-node costs with `k` network ports, `k` its members per node, capped by
//! the intra-node bandwidth.
//!
//! Outputs ([`StepPrediction`]): step seconds, tokens per second (all ranks), exposed
//! communication (the compute thread's blocked time, what the engine's `Collectives` timer
//! measures), per-phase and per-use times, per-collective times, MFU = model FLOPs of the
//! step / (step seconds x W x the dtype's peak) with the PaLM formula
//! ([`flops::palm_flops_per_token`]), HFU with the counted FLOPs (recompute and the attention
//! entries actually computed), a one-line bottleneck, and the timed spans of the rank's
//! two threads for a Chrome-trace writer.
//!
//! Assumptions and what is ignored: every rank does the same work (the plan makes shard
//! lengths equal, and every rank runs the same micro-batch shape), so one rank's timeline is
//! every rank's, except that the ranks do not compute equally fast: the profile's
//! `rank_skew` makes the slowest rank's compute that fraction longer than the simulated
//! (mean) rank's, and a collective starts when the slowest rank issues it (see the
//! `timeline` module); with no skew, when the simulated rank does; a group's collectives are modelled from the worst-placed group of its kind;
//! collectives of different groups do not contend for links; kernel launch overheads beyond
//! the GEMM curve's small sizes, the allocator, the data loader, logging and checkpointing
//! are not modelled; backward computes weight gradients for every matrix of a unit holding a
//! trainable parameter; the clip scaling is always counted (the engine skips it when the norm
//! is under the limit). The model is pure and deterministic: the same inputs give the same
//! bits.

pub mod flops;
pub mod profile;
mod step;
mod timeline;

use crate::memory::Phase;
use serde::{Deserialize, Serialize};

pub use profile::{
    builtin_profile, BandwidthPoint, CollectiveCost, Collectives, ComputeFit, ComputeFits,
    CurvePoint, GemmCurve, GemmLayout, GemmPricing, GemmRates, GemmShape, HardwareProfile,
    HostLink, LinkCollectives, PlausibleRange, ShapePoint, BANDWIDTH, BUILTIN_PROFILE_NAMES,
    CALL_FLOPS, FLOP_RATE, GEMM_DIM, LATENCY, PROFILE_SCHEMA, RANKS_PER_NODE, SKEW, SLOWDOWN,
};
pub use step::{predict, use_compute_parts, ComputeParts, UseParts, MAX_MICRO_BATCHES};

/// What the plan does not say about a step and the time model needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimeInputs {
    /// Whether the step clips the global gradient norm (`fsdp train --clip`, on by default):
    /// one all-reduce over the shard group and a scaling pass over the gradient shards.
    pub clip_grad_norm: bool,
    /// Ranks per node, overriding the profile's `ranks_per_node` (which groups cross nodes).
    pub ranks_per_node: Option<u64>,
}

impl Default for TimeInputs {
    /// `fsdp train`'s defaults: clipping on; the profile's ranks per node.
    fn default() -> Self {
        TimeInputs {
            clip_grad_norm: true,
            ranks_per_node: None,
        }
    }
}

/// The thread a span runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Track {
    /// The rank's compute thread (and its waits).
    Compute,
    /// The rank's communication (progress) thread.
    Communication,
}

/// What a span is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpanKind {
    /// A use's forward.
    Forward,
    /// A use's forward recomputed in backward (activation checkpointing).
    Recompute,
    /// A use's backward.
    Backward,
    /// Casting a master shard into the all-gather buffer, a 16-bit cast of an unsharded
    /// unit, the copy of parameter gradients into the flat gradient, the cast of an f32
    /// accumulation before its reduction, the addition of a reduced shard.
    Copy,
    /// A copy over the host link (offload).
    HostCopy,
    /// Gradient division, norm, clip scaling and the optimizer's pass.
    Optimizer,
    /// The compute thread blocked on a collective.
    Wait,
    /// An all-gather on the communication thread.
    AllGather,
    /// A reduce-scatter on the communication thread.
    ReduceScatter,
    /// An all-reduce on the communication thread.
    AllReduce,
}

/// A collective kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveKind {
    /// All-gather.
    AllGather,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-reduce.
    AllReduce,
}

impl CollectiveKind {
    /// `all-gather`, `reduce-scatter`, `all-reduce`.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllGather => "all-gather",
            CollectiveKind::ReduceScatter => "reduce-scatter",
            CollectiveKind::AllReduce => "all-reduce",
        }
    }

    fn span_kind(self) -> SpanKind {
        match self {
            CollectiveKind::AllGather => SpanKind::AllGather,
            CollectiveKind::ReduceScatter => SpanKind::ReduceScatter,
            CollectiveKind::AllReduce => SpanKind::AllReduce,
        }
    }
}

/// The group a collective runs over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupKind {
    /// The `S` ranks holding the shards of one replica.
    Shard,
    /// The `R` ranks holding the same shard.
    Replicate,
    /// Every rank.
    World,
}

/// One timed span of the simulated rank (seconds from the step's start).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Span {
    /// Compute or communication thread.
    pub track: Track,
    /// What it is.
    pub kind: SpanKind,
    /// `forward h.3`, `all-gather h.3`, `wait reduce-scatter h.2`, `optimizer step`, ...
    pub name: String,
    /// The unit involved, if any.
    pub unit: Option<usize>,
    /// The micro-batch (None in the optimizer step and the step start).
    pub micro_batch: Option<u64>,
    /// The plan phase it belongs to.
    pub phase: Phase,
    /// Start (s).
    pub start_s: f64,
    /// End (s).
    pub end_s: f64,
    /// Collectives: bytes of the whole array (nccl-tests' `S`).
    pub bytes: Option<f64>,
}

/// The phases on a prediction's compute thread, in words: forward and backward, with the
/// recomputed forward named only when a use recomputes (activation checkpointing).
pub fn compute_phases(uses: &[UseTime]) -> &'static str {
    if uses.iter().any(|u| u.recompute_s > 0.0) {
        "forward, recompute and backward"
    } else {
        "forward and backward"
    }
}

/// Compute time of one schedule position (use), per micro-batch, at full speed (without the
/// overlap slowdown).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UseTime {
    /// Index in the forward schedule.
    pub position: usize,
    /// The unit computing.
    pub unit: usize,
    /// `h.3`, `root (embedding)`, ...
    pub label: String,
    /// Forward seconds.
    pub forward_s: f64,
    /// Recomputed forward seconds (0 without activation checkpointing).
    pub recompute_s: f64,
    /// Backward seconds.
    pub backward_s: f64,
    /// Forward FLOPs (all ops).
    pub forward_flops: f64,
    /// Backward FLOPs (all ops; recompute not included).
    pub backward_flops: f64,
}

/// Wall time of one phase on the compute thread, summed over micro-batches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseTime {
    /// The phase.
    pub phase: Phase,
    /// Seconds the compute thread spent in it (working or blocked).
    pub wall_s: f64,
    /// Of which blocked on collectives.
    pub exposed_comm_s: f64,
}

/// All collectives of one kind, group and unit in one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CollectiveTime {
    /// Kind.
    pub kind: CollectiveKind,
    /// Group.
    pub group: GroupKind,
    /// The unit whose parameters or gradients move (None for the scalar collectives).
    pub unit: Option<usize>,
    /// Label (`h.3`, `counts`, `loss and flags`, `gradient norm`).
    pub label: String,
    /// Calls in the step.
    pub count: u64,
    /// Bytes per call (the whole array).
    pub bytes_each: f64,
    /// Seconds on the communication thread, all calls.
    pub busy_s: f64,
    /// Seconds the compute thread waited for them, all calls.
    pub exposed_s: f64,
}

/// The predicted step (see the module doc). Every rank's timeline is the same; `spans` are
/// the simulated rank's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepPrediction {
    /// The hardware profile's name.
    pub hardware: String,
    /// World size `W`.
    pub world_size: u64,
    /// Tokens per step over all ranks (`W * grad_accum * micro_batch * seq_len`).
    pub tokens_per_step: u64,
    /// Seconds per step.
    pub step_s: f64,
    /// Tokens per second over all ranks.
    pub tokens_per_s: f64,
    /// Seconds the compute thread ran forward, recompute and backward (with the slowdown).
    pub compute_s: f64,
    /// Seconds the compute thread was blocked on collectives (exposed communication),
    /// [`StepPrediction::skew_wait_s`] included.
    pub exposed_comm_s: f64,
    /// Of `exposed_comm_s`, the seconds the simulated (mean) rank waited for the slowest rank
    /// (the profile's `rank_skew`; 0 without one).
    pub skew_wait_s: f64,
    /// Seconds the communication thread was busy.
    pub comm_busy_s: f64,
    /// Seconds of the optimizer phase's work (division, norm, clip, optimizer; not its waits).
    pub optimizer_s: f64,
    /// Seconds of copies over the host link (offload).
    pub host_copy_s: f64,
    /// Seconds of other compute-thread work (casts, gradient copies and additions).
    pub copy_s: f64,
    /// Model FLOPs of the step over all ranks ([`flops::PALM_FORMULA`]).
    pub model_flops_per_step: f64,
    /// Counted FLOPs of the step over all ranks (recompute and computed attention included).
    pub hardware_flops_per_step: f64,
    /// The formula of `model_flops_per_step`.
    pub flop_formula: String,
    /// Peak FLOP/s of one rank in `param_dtype`, from the profile.
    pub peak_flops_per_s: f64,
    /// Model FLOPs utilisation: `model_flops_per_step / (step_s * W * peak)`.
    pub mfu: f64,
    /// Hardware FLOPs utilisation: the same with `hardware_flops_per_step`.
    pub hfu: f64,
    /// One line: what bounds the step and by how much.
    pub bottleneck: String,
    /// Per phase.
    pub phases: Vec<PhaseTime>,
    /// Per forward schedule position.
    pub uses: Vec<UseTime>,
    /// Per collective kind, group and unit, in first-issue order.
    pub collectives: Vec<CollectiveTime>,
    /// The simulated rank's spans, in the order they were recorded.
    pub spans: Vec<Span>,
}

/// `1.23 s`, `41.0 ms`, `850 µs`: seconds in a readable unit.
pub fn format_seconds(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{:.0} µs", s * 1e6)
    }
}

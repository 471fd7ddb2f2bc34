//! `MemoryPlan`: bytes per rank, per schedule position, per category, following
//! `MEMORY-CONTRACT.md` exactly; and the activation estimate.
//!
//! Notation (per rank): for each flat parameter `f`, `P_f` = padded numel, `s_f = P_f / S`;
//! `T` = trainable flat params, `A` = all flat params; `pd`, `rd` = bytes of param_dtype and
//! reduce_dtype. Every rank of a plan holds the same bytes, because all shards of a flat
//! parameter have the same length `s_f` (padding makes them equal).

use crate::config::{GradSync, PlanConfig};
use crate::layout::UnitLayout;
use crate::schedule::{Schedule, ScheduleStep, UseRole};
use crate::spec::Architecture;
use fsdp_types::{Bytes, DType};
use serde::{Deserialize, Serialize};
use std::fmt;

/// A memory category (names as in the contract and the JSON schema, snake_case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// f32 master shards of all flat params: `4 * sum_A s_f`.
    ParamShards,
    /// param_dtype copy of the shards when param_dtype != f32: `pd * sum_A s_f`.
    ParamShardsLowPrecision,
    /// f32 accumulated gradient shards, trainable only: `4 * sum_T s_f`.
    GradShards,
    /// Optimizer state: AdamW `8 * sum_T s_f`, SGD momentum `4 * sum_T s_f`.
    OptimizerState,
    /// All-gather outputs alive: `pd * P_unit` per unsharded unit.
    UnshardedParams,
    /// Unsharded flat gradients (transient per unit, or persistent f32 under sync-last).
    UnshardedGrads,
    /// Reduce-scatter outputs: `rd * s_f` of the unit being reduced (0 when S == 1).
    Staging,
    /// Estimated activations (not part of the exact ledger).
    Activations,
}

impl Category {
    /// All categories, in the order of tables, JSON and the SVG stack (bottom first).
    pub const ALL: [Category; 8] = [
        Category::ParamShards,
        Category::ParamShardsLowPrecision,
        Category::GradShards,
        Category::OptimizerState,
        Category::UnshardedParams,
        Category::UnshardedGrads,
        Category::Staging,
        Category::Activations,
    ];

    /// The snake_case name.
    pub fn name(self) -> &'static str {
        match self {
            Category::ParamShards => "param_shards",
            Category::ParamShardsLowPrecision => "param_shards_low_precision",
            Category::GradShards => "grad_shards",
            Category::OptimizerState => "optimizer_state",
            Category::UnshardedParams => "unsharded_params",
            Category::UnshardedGrads => "unsharded_grads",
            Category::Staging => "staging",
            Category::Activations => "activations",
        }
    }
}

/// Bytes per category at one point (or a per-category maximum).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CategoryBytes {
    /// See [`Category::ParamShards`].
    pub param_shards: Bytes,
    /// See [`Category::ParamShardsLowPrecision`].
    pub param_shards_low_precision: Bytes,
    /// See [`Category::GradShards`].
    pub grad_shards: Bytes,
    /// See [`Category::OptimizerState`].
    pub optimizer_state: Bytes,
    /// See [`Category::UnshardedParams`].
    pub unsharded_params: Bytes,
    /// See [`Category::UnshardedGrads`].
    pub unsharded_grads: Bytes,
    /// See [`Category::Staging`].
    pub staging: Bytes,
    /// See [`Category::Activations`].
    pub activations: Bytes,
}

impl CategoryBytes {
    /// The bytes of one category.
    pub fn get(&self, c: Category) -> Bytes {
        match c {
            Category::ParamShards => self.param_shards,
            Category::ParamShardsLowPrecision => self.param_shards_low_precision,
            Category::GradShards => self.grad_shards,
            Category::OptimizerState => self.optimizer_state,
            Category::UnshardedParams => self.unsharded_params,
            Category::UnshardedGrads => self.unsharded_grads,
            Category::Staging => self.staging,
            Category::Activations => self.activations,
        }
    }

    fn get_mut(&mut self, c: Category) -> &mut Bytes {
        match c {
            Category::ParamShards => &mut self.param_shards,
            Category::ParamShardsLowPrecision => &mut self.param_shards_low_precision,
            Category::GradShards => &mut self.grad_shards,
            Category::OptimizerState => &mut self.optimizer_state,
            Category::UnshardedParams => &mut self.unsharded_params,
            Category::UnshardedGrads => &mut self.unsharded_grads,
            Category::Staging => &mut self.staging,
            Category::Activations => &mut self.activations,
        }
    }

    /// Sum of all categories, activations included.
    pub fn total(&self) -> Bytes {
        Category::ALL.iter().map(|&c| self.get(c)).sum()
    }

    /// Sum of the categories in the engine's exact ledger (all but activations).
    pub fn ledger_total(&self) -> Bytes {
        self.total() - self.activations
    }

    /// Model states: param shards (both copies), grad shards, optimizer state — the quantity
    /// the ZeRO paper's formulas count (Rajbhandari et al. 2020, sec. 3.1).
    pub fn model_states(&self) -> Bytes {
        self.param_shards
            + self.param_shards_low_precision
            + self.grad_shards
            + self.optimizer_state
    }

    fn max_with(&mut self, o: &CategoryBytes) {
        for c in Category::ALL {
            let v = self.get_mut(c);
            *v = (*v).max(o.get(c));
        }
    }
}

/// A phase of a training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Forward passes of all micro-batches.
    Forward,
    /// Backward passes (with reduce-scatters) of all micro-batches.
    Backward,
    /// The optimizer step on the shards.
    OptimizerStep,
}

impl Phase {
    /// `forward`, `backward`, `optimizer_step`.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::OptimizerStep => "optimizer_step",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One schedule position of the step timeline: the unit computing and the bytes alive while it
/// computes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimelinePoint {
    /// Micro-batch index (0-based). The timeline lists micro-batch 0 and, when
    /// `grad_accum > 1`, the last one; the ones between repeat micro-batch 0.
    pub micro_batch: u64,
    /// Phase.
    pub phase: Phase,
    /// Index of the step inside the phase's schedule (0 for the optimizer step).
    pub step: usize,
    /// Label of the unit use computing (`h.3`, `root (head)`, `all shards` for the optimizer).
    pub label: String,
    /// Bytes per category.
    pub bytes: CategoryBytes,
}

/// Peak bytes of one phase: the categories at the position of the phase's total peak
/// (`at_peak`), and each category's maximum over the phase (`max`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseMemory {
    /// The phase.
    pub phase: Phase,
    /// Categories at the position with the largest total in this phase (first on ties).
    pub at_peak: CategoryBytes,
    /// Per-category maximum over the phase's positions.
    pub max: CategoryBytes,
    /// `at_peak.total()`.
    pub peak_total: Bytes,
    /// Label of the unit use computing at the peak.
    pub peak_unit: String,
    /// Micro-batch of the peak.
    pub peak_micro_batch: u64,
}

/// The memory plan of one rank (all ranks of a plan are identical; see the module doc).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryPlan {
    /// Forward, backward, optimizer step, in that order.
    pub phases: Vec<PhaseMemory>,
    /// Overall peak bytes (activations included).
    pub peak: Bytes,
    /// Phase of the overall peak.
    pub peak_phase: Phase,
    /// Unit use computing at the overall peak.
    pub peak_unit: String,
    /// Model states per rank (persistent categories), see [`CategoryBytes::model_states`].
    pub model_states: Bytes,
    /// Every schedule position of one step.
    pub timeline: Vec<TimelinePoint>,
}

impl MemoryPlan {
    /// The summary of one phase.
    pub fn phase(&self, p: Phase) -> &PhaseMemory {
        self.phases
            .iter()
            .find(|x| x.phase == p)
            .expect("every phase is planned")
    }
}

/// Activation bytes of one unit use for one micro-batch: the input kept for backward, the
/// tensors created inside the use (its output included), and its output.
///
/// Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
/// Models", sec. 4.1, which counts `s*b*h*(34 + 5*a*s/h)` bytes per GPT layer in 16-bit with
/// dropout. Our blocks have no dropout, so the dropout masks (`2sbh` + `a*s^2*b` bytes) and the
/// dropout output (`2*a*s^2*b`) are removed, and every tensor is counted in elements times
/// `e = size(param_dtype)`:
/// - GPT-2 block: `e*s*b*(16h + a*s)` live (LN1 out, Q, K, V, softmax `a*s*s`, attention out,
///   residual, LN2 out, fc `4h`, GELU `4h`, output), input `e*s*b*h`.
/// - Llama block (SwiGLU, GQA with `kv` heads, ffn width `f`):
///   `e*s*b*((6 + 2*kv/a)*h + 4f + a*s)` live (norm outs, Q, K and V at `kv/a` of `h`,
///   softmax, attention out, residual, gate, up, SiLU, product, output), input `e*s*b*h`.
/// - Embedding: input token ids `4*s*b`; live `e*s*b*h` (Llama) or `2*e*s*b*h` (GPT-2: token
///   plus position embedding sum).
/// - Head: input `e*s*b*h`; live `e*s*b*h` (final norm) + `s*b*V*(e + 4)` (logits and f32
///   log-softmax for the loss); output 4 bytes (the loss).
///
/// `Generic` architectures have no estimate (0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct UseActivations {
    /// Bytes of the use's input tensor (kept for backward under unit-level recompute).
    pub input: Bytes,
    /// Bytes created by the use's forward, its output included.
    pub live: Bytes,
    /// Bytes of the use's output (its gradient arrives in backward).
    pub output: Bytes,
}

/// The activation estimate of one unit use; see [`UseActivations`] for the formulas.
pub fn use_activations(arch: &Architecture, role: UseRole, cfg: &PlanConfig) -> UseActivations {
    let e = cfg.param_dtype.size_bytes();
    let (s, b) = (cfg.seq_len, cfg.micro_batch);
    let sb = s * b;
    let (h, vocab, block_elems, embed_copies) = match arch {
        Architecture::Generic => return UseActivations::default(),
        Architecture::Gpt2(c) => (
            c.d_model,
            c.vocab_size,
            sb * (16 * c.d_model + c.n_head * s),
            2,
        ),
        Architecture::Llama(c) => {
            let kv_elems = 2 * c.d_model * c.n_kv_head / c.n_head.max(1);
            (
                c.d_model,
                c.vocab_size,
                sb * (6 * c.d_model + kv_elems + 4 * c.ffn_hidden + c.n_head * s),
                1,
            )
        }
    };
    let hidden = Bytes(e * sb * h);
    match role {
        UseRole::Embedding => UseActivations {
            input: Bytes(4 * sb),
            live: hidden * embed_copies,
            output: hidden,
        },
        UseRole::Block => UseActivations {
            input: hidden,
            live: Bytes(e * block_elems),
            output: hidden,
        },
        UseRole::Head => UseActivations {
            input: hidden,
            live: hidden + Bytes(sb * vocab * (e + 4)),
            output: Bytes(4),
        },
    }
}

/// Per-unit sums the contract's formulas need, in elements.
struct UnitSums {
    padded_all: u64,
    padded_trainable: u64,
    shard_trainable: u64,
}

/// Builds the memory plan of one rank from the layouts and the schedule (see the contract).
///
/// Activations per micro-batch, at forward step `k` over uses `u_0..u_{m-1}`:
/// with `reshard_after_forward` (unit-level recompute) `sum_{j<=k} input_j + live_k`;
/// otherwise (whole graph kept) `input_0 + sum_{j<=k} live_j`. At backward step `k` (use
/// `u_i`, `i = m-1-k`): the same as forward step `i` plus `output_i` (its incoming gradient).
pub fn memory_plan(
    arch: &Architecture,
    units: &[UnitLayout],
    schedule: &Schedule,
    cfg: &PlanConfig,
    shard_size: u64,
) -> MemoryPlan {
    let pd = cfg.param_dtype.size_bytes();
    let rd = cfg.reduce_dtype.size_bytes();
    let sums: Vec<UnitSums> = units
        .iter()
        .map(|u| UnitSums {
            padded_all: u.flat_params.iter().map(|f| f.padded_numel.0).sum(),
            padded_trainable: u
                .flat_params
                .iter()
                .filter(|f| f.trainable)
                .map(|f| f.padded_numel.0)
                .sum(),
            shard_trainable: u
                .flat_params
                .iter()
                .filter(|f| f.trainable)
                .map(|f| f.shard_numel().0)
                .sum(),
        })
        .collect();
    let shard_all: u64 = units
        .iter()
        .flat_map(|u| &u.flat_params)
        .map(|f| f.shard_numel().0)
        .sum();
    let shard_t: u64 = sums.iter().map(|s| s.shard_trainable).sum();
    let padded_t: u64 = sums.iter().map(|s| s.padded_trainable).sum();

    let persistent = CategoryBytes {
        param_shards: Bytes(4 * shard_all),
        param_shards_low_precision: if cfg.param_dtype != DType::F32 {
            Bytes(pd * shard_all)
        } else {
            Bytes(0)
        },
        grad_shards: Bytes(4 * shard_t),
        optimizer_state: Bytes(cfg.optimizer.state_bytes_per_element() * shard_t),
        ..Default::default()
    };
    let no_copy = shard_size == 1 && cfg.param_dtype == DType::F32;
    let unsharded = |alive: &[usize]| -> Bytes {
        if no_copy {
            Bytes(0)
        } else {
            Bytes(pd * alive.iter().map(|&u| sums[u].padded_all).sum::<u64>())
        }
    };

    let acts: Vec<UseActivations> = schedule
        .forward
        .iter()
        .map(|st| use_activations(arch, st.role, cfg))
        .collect();
    let m = acts.len();
    // Prefix sums of inputs and lives: activation bytes while forward use k computes.
    let mut in_sum = Vec::with_capacity(m);
    let mut live_sum = Vec::with_capacity(m);
    let (mut si, mut sl) = (Bytes(0), Bytes(0));
    for a in &acts {
        si += a.input;
        sl += a.live;
        in_sum.push(si);
        live_sum.push(sl);
    }
    let fwd_act = |k: usize| -> Bytes {
        if schedule.reshard_after_forward {
            in_sum[k] + acts[k].live
        } else {
            acts[0].input + live_sum[k]
        }
    };

    let sync_last = cfg.grad_sync == GradSync::LastMicroBatch && cfg.grad_accum > 1;
    let persistent_grads = Bytes(4 * padded_t);
    let micro_batches: Vec<u64> = if cfg.grad_accum > 1 {
        vec![0, cfg.grad_accum - 1]
    } else {
        vec![0]
    };

    let mut timeline = Vec::new();
    for &mb in &micro_batches {
        let last_mb = mb + 1 == cfg.grad_accum;
        for (k, st) in schedule.forward.iter().enumerate() {
            let mut b = persistent;
            b.unsharded_params = unsharded(&st.alive);
            if sync_last {
                b.unsharded_grads = persistent_grads;
            }
            b.activations = fwd_act(k);
            timeline.push(point(mb, Phase::Forward, k, st, b));
        }
        for (k, st) in schedule.backward.iter().enumerate() {
            let mut b = persistent;
            b.unsharded_params = unsharded(&st.alive);
            let reduce_now = st.reduce_scatter && (!sync_last || last_mb);
            if sync_last {
                // Gradients accumulate straight into the persistent f32 buffer; on the last
                // micro-batch a unit being reduced is cast to reduce_dtype first if needed.
                let cast = if reduce_now && cfg.reduce_dtype != DType::F32 {
                    rd * sums[st.unit].padded_trainable
                } else {
                    0
                };
                b.unsharded_grads = persistent_grads + Bytes(cast);
            } else {
                b.unsharded_grads = Bytes(
                    rd * st
                        .grads_alive
                        .iter()
                        .map(|&u| sums[u].padded_trainable)
                        .sum::<u64>(),
                );
            }
            if reduce_now && shard_size > 1 {
                b.staging = Bytes(rd * sums[st.unit].shard_trainable);
            }
            let i = m - 1 - k;
            b.activations = fwd_act(i) + acts[i].output;
            timeline.push(point(mb, Phase::Backward, k, st, b));
        }
    }
    timeline.push(TimelinePoint {
        micro_batch: cfg.grad_accum - 1,
        phase: Phase::OptimizerStep,
        step: 0,
        label: "all shards".into(),
        bytes: persistent,
    });

    let phases: Vec<PhaseMemory> = [Phase::Forward, Phase::Backward, Phase::OptimizerStep]
        .into_iter()
        .map(|ph| {
            let mut best: Option<&TimelinePoint> = None;
            let mut max = CategoryBytes::default();
            for p in timeline.iter().filter(|p| p.phase == ph) {
                max.max_with(&p.bytes);
                if best.is_none_or(|b| p.bytes.total() > b.bytes.total()) {
                    best = Some(p);
                }
            }
            let best = best.expect("every phase has a position");
            PhaseMemory {
                phase: ph,
                at_peak: best.bytes,
                max,
                peak_total: best.bytes.total(),
                peak_unit: best.label.clone(),
                peak_micro_batch: best.micro_batch,
            }
        })
        .collect();
    let top = phases.iter().fold(
        &phases[0],
        |a, p| if p.peak_total > a.peak_total { p } else { a },
    );
    MemoryPlan {
        peak: top.peak_total,
        peak_phase: top.phase,
        peak_unit: top.peak_unit.clone(),
        model_states: persistent.model_states(),
        phases,
        timeline,
    }
}

fn point(
    mb: u64,
    phase: Phase,
    k: usize,
    st: &ScheduleStep,
    bytes: CategoryBytes,
) -> TimelinePoint {
    TimelinePoint {
        micro_batch: mb,
        phase,
        step: k,
        label: st.label.clone(),
        bytes,
    }
}

//! `MemoryPlan`: bytes per rank, per schedule position, per category, following
//! the contract below exactly; and the activation estimate.
//!
//! Notation (per rank): for each flat parameter `f`, `P_f` = padded numel, `s_f = P_f / S`;
//! `T` = trainable flat params, `A` = all flat params; `pd`, `rd` = bytes of param_dtype and
//! reduce_dtype. Every rank of a plan holds the same bytes, because all shards of a flat
//! parameter have the same length `s_f` (padding makes them equal).
//!
//! **Shard-optimizer (ZeRO-1, Rajbhandari et al. 2020 sec. 5.1, `P_os`)** in these categories
//! (a schedule with `replicated` set): the parameters are replicated: every unit is
//! all-gathered at the first forward position of a step and stays unsharded through forward,
//! backward and the optimizer step (`unsharded_params` = `pd * sum_A P_f` at every point,
//! 0 when `S == 1` and param_dtype is f32: the shard is the parameter). Gradients are reduced
//! once per step, after the last micro-batch's backward, whatever `grad_sync` says (DeepSpeed
//! stage 1 reduces at the accumulation boundary): with accumulation the unsharded f32
//! gradients of every trainable unit accumulate all step (`4 * sum_T P_f`, as under
//! `grad_sync = last`), without it each unit's `rd` gradient lives from its backward to its
//! reduce-scatter. Each reduce-scatter lands in a staging shard and is added into the f32
//! gradient shard (`grad_shards` = `4 * sum_T s_f`), which the optimizer reads; so the
//! gradients are replicated while they are produced and sharded once reduced. `param_shards`
//! and `optimizer_state` are sharded as for every strategy. Model states per rank:
//! `pd*P + 16*s` with AdamW (the paper's `2Psi + 2Psi + 12Psi/N` holds a replicated 2-byte
//! gradient all step instead of the f32 gradient shard).
//!
//! **Offload** ([`crate::Offload`]; Ren et al. 2021, ZeRO-Offload): each point has two
//! memories, the compute device's ([`TimelinePoint::bytes`]) and the host's
//! ([`TimelinePoint::host`]). Offloaded, the f32 master shards, the f32 gradient shards and the
//! optimizer state are host bytes, and so are two reusable staging buffers for the copies,
//! `pd * max_f s_f + rd * max_{f in T} s_f` bytes; the device keeps the `param_dtype`
//! parameter shards (`param_shards_low_precision` = `pd * sum_A s_f`, the all-gather input)
//! under `optimizer`, nothing sharded under `params`. The host side is the same at every point
//! of the step. Without offload the host side is zero and every byte is the device's.
//!
//! **Mixed precision** (`param_dtype` bf16/f16, fp32 master weights; Micikevicius et al. 2018,
//! "Mixed Precision Training"): the all-gather moves `pd`-byte elements, cast from the master
//! shard straight into the gather buffer (no kept low-precision shard); gradients travel in
//! `rd` and are accumulated into fp32 gradient shards. Model states per rank under full
//! shard are `4 s` (master) + `4 s_T` (fp32 gradient) + `8 s_T` (AdamW) = `16 Psi / N` bytes:
//! the `(2 + 2 + 12) Psi / N` of ZeRO-3 (Rajbhandari et al. 2020, sec. 3 and 5.3), with the
//! fp16 parameter and gradient halves held as one fp32 gradient shard instead.
//!
//! **Overlap**: with prefetch depth >= 1 and more than one rank, a unit's reduction is started
//! when its gradient is complete and waited for after the next backward step gathered its
//! gradients; each such backward step has two timeline points: while computing (the previous
//! unit's send buffer and staging still in flight) and after starting its own reduction.

use crate::config::{ActivationModel, GradSync, Offload, PlanConfig};
use crate::layout::UnitLayout;
use crate::schedule::{Schedule, ScheduleStep, UseRole};
use crate::spec::{Architecture, Gpt2Config, LlamaConfig};
use fsdp_types::{Bytes, DType};
use serde::{Deserialize, Serialize};
use std::fmt;

/// A memory category (names as in the contract and the JSON schema, snake_case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// f32 master shards of all flat params: `4 * sum_A s_f`.
    ParamShards,
    /// A persistent param_dtype copy of the shards. Always 0 in plans of this version: each
    /// unshard casts the fp32 master shard straight into this rank's block of the
    /// param_dtype all-gather buffer and gathers in place (FSDP2-style, Zhao et al. 2023; no
    /// FSDP1-style kept low-precision shard). Kept so `fsdp-plan/1` JSON keeps its fields.
    ParamShardsLowPrecision,
    /// f32 accumulated gradient shards, trainable only: `4 * sum_T s_f`.
    GradShards,
    /// Optimizer state: AdamW `8 * sum_T s_f`, SGD momentum `4 * sum_T s_f`.
    OptimizerState,
    /// All-gather outputs alive: `pd * P_unit` per unsharded unit (shard-optimizer: the
    /// replicated parameters, every unit all step).
    UnshardedParams,
    /// Unsharded flat gradients (transient per unit, or persistent f32 while they accumulate
    /// under sync-last and under shard-optimizer with accumulation).
    UnshardedGrads,
    /// Reduce-scatter outputs: `rd * s_f` of the unit being reduced (0 when S == 1). On the
    /// host side under offload: the reusable copy buffer.
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

    /// Whether every category is 0.
    pub fn is_zero(&self) -> bool {
        self.total() == Bytes(0)
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
    /// A checkpoint save after the optimizer step: the rank's shards streamed to its rank
    /// file through one bounded buffer ([`save_buffer_bytes`]), or copied into the
    /// asynchronous save's host staging ([`PlanConfig::ckpt_async`]).
    Save,
}

impl Phase {
    /// `forward`, `backward`, `optimizer_step`, `save`.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::OptimizerStep => "optimizer_step",
            Phase::Save => "save",
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
    /// Bytes per category on the compute device (all of them without offload).
    pub bytes: CategoryBytes,
    /// Bytes per category in host memory beside the device (offload; zero without it, and
    /// then left out of the JSON).
    #[serde(default, skip_serializing_if = "CategoryBytes::is_zero")]
    pub host: CategoryBytes,
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
    /// Host bytes per category, maximum over the phase (offload; zero without it, and then
    /// left out of the JSON).
    #[serde(default, skip_serializing_if = "CategoryBytes::is_zero")]
    pub host_max: CategoryBytes,
}

/// The memory plan of one rank (all ranks of a plan are identical; see the module doc).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryPlan {
    /// Forward, backward, optimizer step, save, in that order. The save is no schedule
    /// position of the step (the timeline has none): its bytes are the model states held
    /// after the optimizer step plus the save's buffer.
    pub phases: Vec<PhaseMemory>,
    /// Overall peak bytes (activations included).
    pub peak: Bytes,
    /// Phase of the overall peak.
    pub peak_phase: Phase,
    /// Unit use computing at the overall peak.
    pub peak_unit: String,
    /// Model states per rank on the device: the bytes held for the whole step, i.e. the
    /// optimizer step's ledger total. For every sharding strategy that is
    /// [`CategoryBytes::model_states`] (param shards, low-precision shards, grad shards,
    /// optimizer state); under shard-optimizer (ZeRO-1) it also counts the replicated
    /// `unsharded_params`, alive all step (see the module doc). Offloaded states are in
    /// [`MemoryPlan::host_peak`] instead.
    pub model_states: Bytes,
    /// Every schedule position of one step.
    pub timeline: Vec<TimelinePoint>,
    /// Host bytes per rank beside the device (offload: master and gradient shards, optimizer
    /// state, the staging buffer; an asynchronous checkpoint's staging copy and write buffer,
    /// [`async_checkpoint_bytes`]; the same at every point). 0 without either, and then left
    /// out of the JSON.
    #[serde(default, skip_serializing_if = "is_zero_bytes")]
    pub host_peak: Bytes,
}

fn is_zero_bytes(b: &Bytes) -> bool {
    b.0 == 0
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
/// tensors its forward creates and keeps in the autograd graph (its output included), its
/// output, and what its backward holds on top of that graph.
///
/// Method: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
/// Models", sec. 4.1: count, op by op, the tensors the forward keeps for backward. Their
/// `s*b*h*(34 + 5*a*s/h)` bytes per layer is for Megatron's 16-bit fused kernels with dropout;
/// this engine differs, so the count below is redone for the ops this engine's GPT
/// (`engine/src/model/gpt.rs`, candle-core autograd) really runs, in elements, times
/// `e = size(param_dtype)`. Notation: `N = b*s` tokens, `h` = d_model, `a` heads, `V` vocab,
/// `P` = the parameter elements the use touches.
///
/// **GPT-2 forward, kept by the graph** (candle keeps every op's output until the graph is
/// dropped; no dropout; attention fused into one op, `fsdp::model::ops::causal_attention`):
/// - Embedding: `h*N` (one fused gather + position add); input: token ids `4*N` bytes.
/// - Block: `N*(23h + a*s)`: LN1 `h`; qkv matmul `3h` and its bias add `3h`; the fused
///   attention's output `h` (already `[N, h]`: no q/k/v or head-transpose copies) and the
///   attention probabilities it keeps for backward `a*s` per token (`[b, a, s, s]`, the
///   scores are never materialised outside a per-thread row block); out projection matmul
///   `h` + bias `h`; residual `h`; LN2 `h`; fc matmul `4h` + fused bias-GELU `4h`; MLP
///   projection matmul `h` + bias `h`; residual `h`. Input `h*N`. (Korthikanti count
///   `16h + a*s` without dropout; the difference is what candle's graph keeps that a
///   hand-fused layer does not, chiefly the matmul outputs under the separate bias adds.)
///   Measured with `cargo run -p fsdp --example activation_bytes`: 0.997-1.000 of the
///   engine's kept bytes. (Before the fused attention: `N*(27h + 2a*s)`, with the q, k, v
///   copies `3h`, the head-transpose copy `h` and the unnormalised scores `a*s`.)
/// - Head: `N*(h + V)`: final LN and logits (the fused cross-entropy keeps no log-softmax).
///   Input `h*N`, output the loss (4 bytes).
///
/// **GPT-2 backward, on top of the kept graph** (the graph stays alive until `backward`
/// returns; candle's gradient store holds the gradients of the nodes whose consumers are done
/// and that are not processed yet — the first gradient of a node is stored as is, later ones
/// summed into it (the vendored candle-core, `vendor/README.md`) — plus every parameter
/// gradient until the engine copies it into the flat gradient):
/// - Embedding: `h*N + P`; Block: `13h*N + P`; Head: `2h*N + V*N + 2P`.
///   The per-token terms are the gradient frontier at its widest (the MLP's `4h` gradients
///   and the residual stream's; the fused attention's backward holds no `a*s` tensor, only
///   its `[N, 3h]` qkv gradient and a per-thread `[s, s]` f32 scratch, not counted);
///   `P` the parameter gradients (the head's weight-gradient matmul transient doubles its
///   `P`). These coefficients are the least-squares fit of the peaks measured on the CPU
///   with the counting allocator by `cargo run -p fsdp --example activation_bytes` over
///   `tiny`/`mini`/`small` and (b, s) in {(2, 64), (8, 128), (4, 256)} (block: 13.00 hN,
///   0.001 a*s*N, 1.00 P, so `13h*N + P`, estimate / measured 0.996-1.000; head 1.9, 1.0,
///   1.6, rounded up; 1.0 and 0.96 P for the embedding), with the backward seeded by
///   `fsdp::model::ops::backward_seed` as the engine does; the forward counts above match
///   those measurements to 0.3%. (Before the fused attention the block's fit was 17.4 hN,
///   1.1 a*s*N, 0.8 P: `18h*N + a*s*N + P`.)
///
/// **Llama** (`engine/src/model/llama.rs` on its fused CPU ops; same method), with `kv` the
/// key/value width `h * n_kv_head / a`, `F` the SwiGLU width, `hd = h / a`, `β` = 1 with
/// q/k/v biases (Qwen2), and `f` the size of what the embedding's table is widened to (4 for
/// bf16/f16, else `e`; `w` = 1 for bf16/f16, else 0):
/// - Embedding: `f (V h + N h) + w e N h` (the table node of its own, `1 * wte` or the widened
///   `wte`, the gathered rows, the narrowed output); backward `e (h*N + 2P)`.
/// - Block forward: `e N (11h + 2kv + 3F + a*s + β (h + 2kv))`: the two RMSNorm outputs `2h`
///   (`fsdp::model::ops::rms_norm`), the q, k, v projections `h + 2kv` (and with biases their
///   bias-add outputs), the packed rotated `[N, 3h]` rows with the key/value heads repeated
///   (`ops::rope_qkv`) `3h`, the fused attention's output `h` and probabilities `a*s`, the
///   output projection `h`, two residuals `2h`, gate, up and the SwiGLU gate
///   (`ops::swiglu`) `3F`, the down projection `h`; plus the rotary op's f64 `cos`/`sin`
///   tables, `8 s hd` bytes. Measured by `cargo run -p fsdp --example activation_bytes --
///   llama` (f32, llama-tiny and llama-mini, (b, s) in {(8, 128), (4, 256)}): 0.9996-1.0000 of
///   the engine's kept bytes.
/// - Block backward: `12h*N + P` on top of the graph (the same measurements: 12.01 hN for
///   both presets, independent of `a*s`, plus the parameter gradients `P`; the fused rotary
///   embedding and attention backward hold no `a*s` tensor).
/// - Head: as GPT-2 (`N*(h + V)` kept; backward `2h*N + V*N + 2P`, 5-7% above the measured
///   peak).
///
/// `Generic` architectures have no estimate (0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct UseActivations {
    /// Bytes of the use's input tensor (kept for backward under unit-level recompute).
    pub input: Bytes,
    /// Bytes created by the use's forward and kept by its graph, its output included.
    pub live: Bytes,
    /// Bytes of the use's output (its gradient arrives in backward).
    pub output: Bytes,
    /// Bytes the use's backward holds at its peak on top of `live` (gradient store,
    /// parameter gradients, transients).
    pub backward: Bytes,
}

/// The activation estimate of one unit use; see [`UseActivations`] for the formulas of the
/// fused ops ([`ActivationModel::Fused`]) and [`composite_gpt2_activations`] for the composite
/// ops ([`ActivationModel::Composite`], GPT-2 only: Llama and generic specs plan the same
/// bytes under both models).
pub fn use_activations(arch: &Architecture, role: UseRole, cfg: &PlanConfig) -> UseActivations {
    if let (ActivationModel::Composite, Architecture::Gpt2(c)) = (cfg.activations, arch) {
        return composite_gpt2_activations(c, role, cfg);
    }
    let e = cfg.param_dtype.size_bytes();
    let (s, b) = (cfg.seq_len, cfg.micro_batch);
    let n = s * b;
    // (d_model, vocab, block forward elements, block params, embed params, head params,
    // block backward per-token elements)
    let (h, vocab, block_elems, block_p, embed_p, head_p, block_bwd_tok) = match arch {
        Architecture::Generic => return UseActivations::default(),
        Architecture::Gpt2(c) => {
            let d = c.d_model;
            let small = if c.bias { 13 * d } else { 2 * d };
            (
                d,
                c.vocab_size,
                n * (23 * d + c.n_head * s),
                12 * d * d + small,
                (c.vocab_size + c.n_positions) * d,
                (if c.bias { 2 * d } else { d }) + c.vocab_size * d,
                13 * d,
            )
        }
        Architecture::Llama(c) => return llama_activations(c, role, cfg),
    };
    let hidden = Bytes(e * n * h);
    match role {
        UseRole::Embedding => UseActivations {
            input: Bytes(4 * n),
            live: hidden,
            output: hidden,
            backward: Bytes(e * (n * h + embed_p)),
        },
        UseRole::Block => UseActivations {
            input: hidden,
            live: Bytes(e * block_elems),
            output: hidden,
            backward: Bytes(e * (n * block_bwd_tok + block_p)),
        },
        UseRole::Head => UseActivations {
            input: hidden,
            live: Bytes(e * n * (h + vocab)),
            output: Bytes(4),
            backward: Bytes(e * (2 * n * h + vocab * n + 2 * head_p)),
        },
    }
}

/// Activation bytes of one Llama unit use on the fused CPU ops: the formulas of the
/// **Llama** paragraph of [`UseActivations`].
fn llama_activations(c: &LlamaConfig, role: UseRole, cfg: &PlanConfig) -> UseActivations {
    let e = cfg.param_dtype.size_bytes();
    let w = u64::from(e == 2);
    let f = if w == 1 { 4 } else { e };
    let (s, n) = (cfg.seq_len, cfg.seq_len * cfg.micro_batch);
    let (h, v, a, ffn) = (c.d_model, c.vocab_size, c.n_head.max(1), c.ffn_hidden);
    let kv = h * c.n_kv_head / a;
    let hd = h / a;
    let bias = if c.qkv_bias { h + 2 * kv } else { 0 };
    let block_p = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h + bias;
    let hidden = Bytes(e * n * h);
    match role {
        UseRole::Embedding => UseActivations {
            input: Bytes(4 * n),
            live: Bytes(f * (v * h + n * h) + w * e * n * h),
            output: hidden,
            backward: Bytes(e * (n * h + 2 * v * h)),
        },
        UseRole::Block => UseActivations {
            input: hidden,
            live: Bytes(e * n * (11 * h + 2 * kv + 3 * ffn + a * s + bias) + 8 * s * hd),
            output: hidden,
            backward: Bytes(e * (12 * n * h + block_p)),
        },
        UseRole::Head => UseActivations {
            input: hidden,
            live: Bytes(e * n * (h + v)),
            output: Bytes(4),
            backward: Bytes(e * (2 * n * h + v * n + 2 * (h + v * h))),
        },
    }
}

/// Activation bytes of one GPT-2 unit use under [`ActivationModel::Composite`]: the composite
/// ops of `engine/src/model/composite.rs` (candle-core primitives differentiated by candle
/// autograd; what a CUDA device runs), counted tensor by tensor.
///
/// Method: as [`UseActivations`] (Korthikanti et al. 2022, sec. 4.1: count what the forward
/// keeps for backward), redone for the composite ops. candle keeps every tracked op's output
/// alive while a later node of the graph refers to it, so the forward keeps the output of
/// every primitive that allocates: views (`reshape`, `narrow`, `transpose`, `broadcast_as`,
/// `get`) and same-dtype `to_dtype` / `contiguous` of a contiguous tensor allocate nothing;
/// the row max is `detach`ed but held by the subtraction that uses it. Notation: `N = b*s`
/// tokens, `h` = d_model, `a` heads, `V` vocab, `P` = n_positions; `e` = size(param_dtype);
/// `f` = size of what the ops compute in (4 for bf16/f16, which widen to f32, else `e`);
/// `w` = 1 for bf16/f16 (the ops widen each input once and narrow the output once), else 0;
/// `β` = 1 with biases. Bytes per token of the ops (`composite.rs`):
/// - LayerNorm: widened `x` (`w f h`), `x - mean`, its square, `* rstd`, `* weight`
///   (`4 f h`), `+ bias` (`β f h`), narrowed output (`w e h`); per row `7 f` (sum and
///   division for the mean and for the variance, `+ eps`, `sqrt`, `recip`).
/// - bias add over `F` features: `β F (f (1 + w) + w e)` (widened `x`, the sum, narrowed).
/// - bias + GELU over `F`: `F (f (w + β + 1) + w e)` (widened `x`, `x + b`, GELU, narrowed).
/// - causal softmax per score element: `f (w + 5) + w e` (widened scores, `scale * s`,
///   `+ mask`, `- max`, `exp`, `* (1 / sum)`, narrowed); per row `3 f` (max, sum, recip); per
///   use the `[s, s]` mask, `f s^2`.
/// - matrix products and the residual adds in `param_dtype`: `e` per output element.
/// - widened parameter vectors (bf16/f16): `f` per LayerNorm weight and bias element.
///
/// **Forward, kept by the graph** (live):
/// - Embedding: `N h (2f + w e) + f h (V + w P)`: the table node of its own (`1 * wte`, or
///   widened `wte`), the widened `wpe` (bf16/f16), the selected rows, the sum with the
///   positions, the narrowed output. Input: token ids `4 N`.
/// - Block: `N (2 LN + 16 e h + bias(3h) + 2 bias(h) + gelu(4h) +
///   a s (e + f (w + 5) + w e) + 3 f a) + f s^2 + widened vectors`, where `16 e h` = the qkv
///   product `3h`, the
///   contiguous q, k, v `3h`, `probs @ v` `h`, the head-transpose copy `h`, the projection
///   products `h + 4h + h`, two residuals `2h`; the scores `e a s` per token.
///   For mini (h 256, a 4) at B 4 x T 256: 63.35 MiB f32, 75.86 MiB bf16 (fused: 27 MiB,
///   13.5 MiB).
/// - Head: `N (LN + e V + f V (w + 2) + 6 f) + f`: final LayerNorm, logits, for the
///   cross-entropy the widened logits (bf16/f16), `logits - max` and its `exp` (`f V`
///   each), per row max, sum, log, `+ max`, the picked logit and the difference; the loss.
///
/// **Backward, on top of the kept graph** (the incoming output gradient is `output`, counted
/// by the memory plan):
/// - Embedding: `w f N h + max(2 f P h, e P h + 2 f V h)`: the incoming gradient widened;
///   candle processes the wpe branch first (the batch sum of `s` rows, the zeros for the
///   other `P - s` rows and the concatenation of `narrow`'s backward: `2 f P h` whatever `s`),
///   then the wte branch (wpe's gradient kept, `e P h`; the zeros and the `index_add` result
///   of `index_select`'s backward, `2 f V h`). Derived from the graph; measured within 1.8 KB
///   (candle's tensor headers).
/// - Block: `N (64 f h + w e h) + e (4h^2 + β h)`, derived: the block's backward peaks in
///   the GELU's backward (candle-core `backprop.rs`, `Op::Unary(arg, UnaryOp::Gelu)`), after
///   the MLP projection's weight and bias gradients (`e (4h^2 + β h)`) are stored. candle
///   builds that derivative from the tracked `arg`, so the gradient it produces is itself a
///   graph that keeps every intermediate alive until the gradient is consumed: the cube, two
///   scaled terms and their sum, tanh, `0.5 tanh`, two more scaled terms and their sum,
///   `tanh^2`, `1 - tanh^2`, the product, two sums (14) and `grad * gelu'` (15), plus the
///   incoming gradient: 16 `[N, 4h]` f32 tensors, `64 f h` per token (in bf16/f16 the GELU
///   runs in f32 too). Measured for the op alone: 64 bytes per `[N, 4h]` f32 element above
///   the kept graph (`engine/tests/engine_memory_composite.rs`, `op_bytes`), and for the
///   block: exactly `260 h` bytes per token in f32 and bf16 (`stage_bytes`, tiny/mini/small,
///   (B, T) in {(2, 64), (2, 256), (8, 128), (4, 256)}, independent of `T`) = this plus the
///   output gradient (`4h` f32; `2h` bf16, where one more `[N, h]` bf16 tensor, `w e h`, is
///   alive: that term is measured, not traced), intercept the parameter term plus 7-8 KB.
/// - Head: `f N (8h + V + 1) + e (V h + h (1 + β))`: the head's parameter gradients, and
///   per token `8h + V + 1` f32 elements, calibrated, not traced: the least-squares line of
///   the same measurements has exactly this slope in f32 and bf16 (intercept = the parameter
///   gradients plus 4.1-4.4 KB). The `8h` matches the final LayerNorm's backward measured
///   alone (8 f32 per element above its kept graph and incoming gradient, `op_bytes`), the
///   `V` one `[N, V]` f32 gradient of the cross-entropy kept alive with it. With the
///   byte-level presets' `V = 256` only, the split between the `V` and the constant term is
///   not separately measured.
///
/// Every estimate is within 0.6% (a few KB of candle tensor headers) of the measured bytes
/// for all 72 (preset, B, T, dtype, stage) cases above. f64 (gradient checks) uses `f = e = 8`
/// and is not measured.
pub fn composite_gpt2_activations(
    c: &Gpt2Config,
    role: UseRole,
    cfg: &PlanConfig,
) -> UseActivations {
    // Element sizes: `e` of the parameters and hidden states, `f` of what the ops compute in
    // (f32 for bf16/f16, else the parameter dtype); `w` = 1 where the ops widen and narrow.
    let e = cfg.param_dtype.size_bytes();
    let w = u64::from(e == 2);
    let f = if w == 1 { 4 } else { e };
    let bias = u64::from(c.bias);
    let (h, a, v, pos) = (c.d_model, c.n_head, c.vocab_size, c.n_positions);
    let (s, n) = (cfg.seq_len, cfg.seq_len * cfg.micro_batch);
    // Bytes per token kept by one composite op (see the doc above), and per use for the
    // widened parameter vectors.
    let ln_tok = h * (f * (w + 4 + bias) + w * e) + 7 * f;
    let ln_par = w * f * h * (1 + bias);
    let bias_tok = |feat: u64| bias * feat * (f * (1 + w) + w * e);
    let bias_par = |feat: u64| bias * w * f * feat;
    let gelu_tok = |feat: u64| feat * (f * (w + bias + 1) + w * e);
    let score_elem = e + f * (w + 5) + w * e;
    let hidden = Bytes(e * n * h);
    match role {
        UseRole::Embedding => UseActivations {
            input: Bytes(4 * n),
            live: Bytes(n * h * (2 * f + w * e) + f * h * (v + w * pos)),
            output: hidden,
            // The incoming gradient widened (bf16/f16), then the larger of the two parameter
            // branches: wpe's (the batch sum of `t` rows, zeros for the other `P - t`, their
            // concatenation: `2 f P h`) and wte's after it (wpe's gradient kept, `e P h`, plus
            // the zeros and the `index_add` of `index_select`'s backward, `2 f V h`).
            backward: Bytes(w * f * n * h + (2 * f * pos * h).max(e * pos * h + 2 * f * v * h)),
        },
        UseRole::Block => {
            let tok = 2 * ln_tok
                + 16 * e * h
                + bias_tok(3 * h)
                + 2 * bias_tok(h)
                + gelu_tok(4 * h)
                + a * s * score_elem
                + 3 * f * a;
            let per_use =
                f * s * s + 2 * ln_par + bias_par(3 * h) + 2 * bias_par(h) + bias_par(4 * h);
            UseActivations {
                input: hidden,
                live: Bytes(n * tok + per_use),
                output: hidden,
                // The GELU backward (see the doc): 16 `[N, 4h]` f32 tensors, one `[N, h]`
                // more for bf16/f16; the MLP projection's weight and bias gradients.
                backward: Bytes(n * (64 * f * h + w * e * h) + e * (4 * h * h + bias * h)),
            }
        }
        UseRole::Head => UseActivations {
            input: hidden,
            live: Bytes(n * (ln_tok + e * v + f * v * (w + 2) + 6 * f) + ln_par + f),
            output: Bytes(4),
            // Calibrated per token (see the doc): `8h + V + 1` f32 elements; the head's
            // parameter gradients in `param_dtype`.
            backward: Bytes(f * n * (8 * h + v + 1) + e * (v * h + h * (1 + bias))),
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
/// Activations per micro-batch over uses `u_0..u_{m-1}` (see [`UseActivations`]), as this
/// engine holds them. `c_j` = `input_j` for the uses that take a gradient for their input
/// (every use but the first: the engine makes the input a fresh autograd variable, a copy),
/// else 0. Forward step `k`:
/// - activation checkpointing (`Schedule::activation_checkpointing`: unit-level recompute, no
///   graph kept; independent of `reshard_after_forward`, which only moves `unsharded_params`):
///   `sum_{j<=k} input_j + live_k`, plus `c_k` for the last use (the loss keeps its graph).
/// - otherwise (whole graph kept): `input_0 + sum_{j<=k} (live_j + c_j)`.
///
/// Backward step of use `i`: recompute: `sum_{j<=i} input_j + live_i + backward_i +
/// output_i` (inputs of later uses are gone; use `i`'s input is now its variable copy, the
/// original dropped; the recomputed graph plus its gradient store and the incoming output
/// gradient are alive); kept graph: the forward value at `i` plus
/// `backward_i + output_i`.
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

    // Shard-optimizer (ZeRO-1): params replicated all step (see the module doc).
    let replicated = schedule.replicated;
    let states = CategoryBytes {
        param_shards: Bytes(4 * shard_all),
        // No persistent low-precision copy: each unshard casts the fp32 master shard straight
        // into this rank's block of the param_dtype all-gather buffer (in-place all-gather).
        param_shards_low_precision: Bytes(0),
        grad_shards: Bytes(4 * shard_t),
        optimizer_state: Bytes(cfg.optimizer.state_bytes_per_element() * shard_t),
        ..Default::default()
    };
    let offload = cfg.offload_mode();
    let (persistent, mut host) = match offload {
        Offload::None => (states, CategoryBytes::default()),
        o => {
            let device = CategoryBytes {
                param_shards_low_precision: if o == Offload::Optimizer {
                    Bytes(pd * shard_all)
                } else {
                    Bytes(0)
                },
                ..Default::default()
            };
            let mut host = states;
            host.staging = Bytes(host_staging_bytes(units, cfg));
            (device, host)
        }
    };
    // An asynchronous checkpoint keeps a host copy of the shards and its writer's buffer
    // from the first save on, while the next steps train.
    if cfg.ckpt_async {
        host.staging += Bytes(async_checkpoint_bytes(units, cfg));
    }
    // The shard is the parameter (no gathered copy) with one shard of f32 master weights on
    // the device; offloaded, the device's parameters are always a gathered copy.
    let no_copy = shard_size == 1 && cfg.param_dtype == DType::F32 && !offload.is_some();
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
    // Prefix sums of inputs and of kept graphs: activation bytes while forward use k computes.
    let copy = |k: usize| if k == 0 { Bytes(0) } else { acts[k].input };
    let mut in_sum = Vec::with_capacity(m);
    let mut kept_sum = Vec::with_capacity(m);
    let (mut si, mut sk) = (Bytes(0), acts.first().map_or(Bytes(0), |a| a.input));
    for (k, a) in acts.iter().enumerate() {
        si += a.input;
        sk += a.live + copy(k);
        in_sum.push(si);
        kept_sum.push(sk);
    }
    let recompute = schedule.activation_checkpointing;
    let fwd_act = |k: usize| -> Bytes {
        if recompute {
            in_sum[k] + acts[k].live + if k + 1 == m { copy(k) } else { Bytes(0) }
        } else {
            kept_sum[k]
        }
    };
    let bwd_act = |i: usize| -> Bytes {
        // Recompute: the engine re-creates the input as an autograd variable (a copy) and
        // drops the kept original before the backward runs, so the input counts once.
        let graph = if recompute {
            in_sum[i] + acts[i].live
        } else {
            kept_sum[i]
        };
        graph + acts[i].backward + acts[i].output
    };

    let sync_last = defers_grad_sync(cfg, schedule, cfg.grad_accum);
    let all_units: Vec<usize> = (0..units.len()).collect();
    let persistent_grads = Bytes(4 * padded_t);
    let micro_batches: Vec<u64> = if cfg.grad_accum > 1 {
        vec![0, cfg.grad_accum - 1]
    } else {
        vec![0]
    };

    // Overlapped reductions (prefetch depth >= 1 and a reduction that communicates): a unit's
    // reduce-scatter (all-reduce when S == 1) is started after its gradient is complete and
    // waited for after the next backward step's gradients were gathered, so during that step
    // its send buffer and its staging output are still alive.
    let overlap = crate::schedule::overlaps_reductions(schedule, cfg.world_size);
    // Bytes of unit u's reduction send buffer beyond what grads_alive already counts, and of
    // its staging output.
    let send_extra = |u: usize| -> u64 {
        if sync_last {
            // The persistent f32 buffer is sent as is, or its rd cast.
            if cfg.reduce_dtype != DType::F32 {
                rd * sums[u].padded_trainable
            } else {
                0
            }
        } else {
            rd * sums[u].padded_trainable
        }
    };
    let staging_of = |u: usize| -> u64 {
        if shard_size > 1 {
            rd * sums[u].shard_trainable
        } else {
            0
        }
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
        // The reduction started at the previous backward step and still in flight.
        let mut pending: Option<usize> = None;
        for (k, st) in schedule.backward.iter().enumerate() {
            let mut b = persistent;
            b.unsharded_params = unsharded(&st.alive);
            let reduce_now = st.reduce_scatter && (!sync_last || last_mb);
            if overlap {
                // Gradients of this step gathered while the previous reduction is in flight.
                let mut a = b;
                a.unsharded_grads = Bytes(if sync_last {
                    4 * padded_t
                } else {
                    rd * st
                        .grads_alive
                        .iter()
                        .map(|&u| sums[u].padded_trainable)
                        .sum::<u64>()
                });
                if let Some(p) = pending.take() {
                    a.unsharded_grads += Bytes(send_extra(p));
                    a.staging = Bytes(staging_of(p));
                }
                a.activations = bwd_act(m - 1 - k);
                timeline.push(point(mb, Phase::Backward, k, st, a));
                if !reduce_now {
                    continue;
                }
                // Then this step's reduction is started (point below) and stays in flight.
                pending = Some(st.unit);
            }
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
            b.activations = bwd_act(m - 1 - k);
            timeline.push(point(mb, Phase::Backward, k, st, b));
        }
    }
    let mut opt_bytes = persistent;
    if replicated {
        opt_bytes.unsharded_params = unsharded(&all_units);
    }
    timeline.push(TimelinePoint {
        micro_batch: cfg.grad_accum - 1,
        phase: Phase::OptimizerStep,
        step: 0,
        label: "all shards".into(),
        bytes: opt_bytes,
        host,
    });
    for t in &mut timeline {
        t.host = host;
    }

    let mut phases: Vec<PhaseMemory> = [Phase::Forward, Phase::Backward, Phase::OptimizerStep]
        .into_iter()
        .map(|ph| {
            let mut best: Option<&TimelinePoint> = None;
            let mut max = CategoryBytes::default();
            let mut host_max = CategoryBytes::default();
            for p in timeline.iter().filter(|p| p.phase == ph) {
                max.max_with(&p.bytes);
                host_max.max_with(&p.host);
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
                host_max,
            }
        })
        .collect();
    // A save after the optimizer step: the model states (the units are resharded) plus the
    // one buffer a rank file streams through, or a device shard is copied to the host
    // through (for an asynchronous save). On a GPU that buffer is host memory, counted here
    // with the device's bytes: it only adds to a phase far below the step's peak.
    let mut save = persistent;
    save.staging = Bytes(save_buffer_bytes(units));
    phases.push(PhaseMemory {
        phase: Phase::Save,
        at_peak: save,
        max: save,
        peak_total: save.total(),
        peak_unit: "checkpoint".into(),
        peak_micro_batch: cfg.grad_accum - 1,
        host_max: host,
    });
    let top = phases.iter().fold(
        &phases[0],
        |a, p| if p.peak_total > a.peak_total { p } else { a },
    );
    MemoryPlan {
        peak: top.peak_total,
        peak_phase: top.phase,
        peak_unit: top.peak_unit.clone(),
        model_states: opt_bytes.ledger_total(),
        phases,
        timeline,
        host_peak: host.total(),
    }
}

/// Upper bound of the buffer a checkpoint save streams a rank file through (bytes): 4 MiB.
pub const SAVE_BUFFER_BYTES: u64 = 4 << 20;

/// Bytes of the one buffer a checkpoint save streams a rank file through (and a device shard
/// is copied to the host through): [`SAVE_BUFFER_BYTES`], or less when the largest flat
/// parameter's shard is smaller (`4 * max_f s_f`). The writer of `fsdp-checkpoints` allocates
/// exactly this, so the plan's `save` phase holds it to the byte.
pub fn save_buffer_bytes(units: &[UnitLayout]) -> u64 {
    let largest = units
        .iter()
        .flat_map(|u| &u.flat_params)
        .map(|f| f.shard_numel().0)
        .max()
        .unwrap_or(0);
    SAVE_BUFFER_BYTES.min(4 * largest).max(4)
}

/// Host bytes per rank of an asynchronous checkpoint ([`PlanConfig::ckpt_async`]): the
/// staging copy of the rank's f32 master shards (`4 * sum_A s_f`) and optimizer state
/// (`sum_T s_f` times the optimizer's state bytes per element), which the background writer
/// saves while the next steps train, plus the writer's buffer ([`save_buffer_bytes`]).
/// Held from the first save to the end of the run.
pub fn async_checkpoint_bytes(units: &[UnitLayout], cfg: &PlanConfig) -> u64 {
    let flats = || units.iter().flat_map(|u| &u.flat_params);
    let all: u64 = flats().map(|f| f.shard_numel().0).sum();
    let trainable: u64 = flats()
        .filter(|f| f.trainable)
        .map(|f| f.shard_numel().0)
        .sum();
    4 * all + cfg.optimizer.state_bytes_per_element() * trainable + save_buffer_bytes(units)
}

/// Bytes of the reusable host staging buffers of an offloaded rank: one for parameters, the
/// largest flat parameter's shard in `param_dtype` (cast from the f32 master on the host, then
/// copied to the device), and one for gradients, the largest trainable flat parameter's shard
/// in `reduce_dtype` (its reduced gradient shard copied from the device, then added into the
/// f32 gradient shard).
pub fn host_staging_bytes(units: &[UnitLayout], cfg: &PlanConfig) -> u64 {
    let flats = || units.iter().flat_map(|u| &u.flat_params);
    let largest = flats().map(|f| f.shard_numel().0).max().unwrap_or(0);
    let largest_trainable = flats()
        .filter(|f| f.trainable)
        .map(|f| f.shard_numel().0)
        .max()
        .unwrap_or(0);
    cfg.param_dtype.size_bytes() * largest + cfg.reduce_dtype.size_bytes() * largest_trainable
}

/// Whether gradients of a step of `micro_batches` micro-batches accumulate unsharded (in f32)
/// and are reduced once, after the last micro-batch's backward: under `grad_sync = last`, and
/// always under the replicated shard-optimizer schedule, with more than one micro-batch. The
/// memory plan and the engine both decide with this function.
pub fn defers_grad_sync(cfg: &PlanConfig, schedule: &Schedule, micro_batches: u64) -> bool {
    micro_batches > 1 && (cfg.grad_sync == GradSync::LastMicroBatch || schedule.replicated)
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
        host: CategoryBytes::default(),
    }
}

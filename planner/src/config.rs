//! `PlanConfig`: how a model is to be trained (world size, sharding strategy, precision,
//! optimizer, gradient accumulation, prefetch, batch shape, memory budget).

use crate::error::PlanError;
use fsdp_types::{Bytes, DType};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// How parameters, gradients and optimizer state are sharded over the world.
///
/// World = shard group x replicate group (`W = S * R`); rank `r` holds shard `r % S` and is
/// replica `r / S`. The ZeRO stages (Rajbhandari et al. 2020, "ZeRO", sec. 5) map to:
/// `FullShard` = ZeRO-3, `ShardGradOp` = ZeRO-2 (plus sharded master weights),
/// `ShardOptimizer` = ZeRO-1 (`P_os`), `NoShard` = DDP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Strategy {
    /// `S = W`, units resharded after forward and re-gathered for backward (FSDP FULL_SHARD).
    FullShard,
    /// `S = W`, units kept unsharded from forward until their backward (FSDP SHARD_GRAD_OP).
    ShardGradOp,
    /// `S = 1`: every rank holds everything; gradients are all-reduced (DDP).
    NoShard,
    /// `S = W`, optimizer-state sharding (ZeRO-1, Rajbhandari et al. 2020 sec. 5.1, `P_os`;
    /// DeepSpeed stage 1): parameters are replicated: every unit is all-gathered at the start
    /// of a step and stays unsharded in `param_dtype` through forward, backward and the
    /// optimizer step (`pd * P` bytes per rank), so a step gathers once instead of once per
    /// unit use. Gradients are reduced once per step, after the last micro-batch (with
    /// accumulation they accumulate unsharded in f32 until then, whatever `grad_sync` says):
    /// each unit's gradient is reduce-scattered into the rank's f32 gradient shard, and the
    /// rank steps the optimizer on its shard of the f32 master weights and optimizer state;
    /// the updated shards are all-gathered back into the replicated parameters at the next
    /// step's start. Model states per rank: `pd*P + 16*s` with AdamW.
    ShardOptimizer,
    /// Full shard inside groups of `shard_size` ranks, replicated across `W / shard_size`
    /// groups (FSDP HYBRID_SHARD).
    Hybrid {
        /// Shard-group size `S`; must divide the world size.
        shard_size: u64,
    },
    /// The fastest strategy whose peak fits `device_memory`, tried in the order NoShard,
    /// ShardOptimizer, ShardGradOp, Hybrid (smallest shard group first), FullShard.
    Auto,
}

impl Strategy {
    /// The command-line name: `full-shard`, `shard-grad-op`, `shard-optimizer`, `no-shard`,
    /// `hybrid`, `auto`.
    pub fn cli_name(&self) -> &'static str {
        match self {
            Strategy::FullShard => "full-shard",
            Strategy::ShardGradOp => "shard-grad-op",
            Strategy::ShardOptimizer => "shard-optimizer",
            Strategy::NoShard => "no-shard",
            Strategy::Hybrid { .. } => "hybrid",
            Strategy::Auto => "auto",
        }
    }

    /// Shard-group size `S` for a world of `world_size` ranks (`Auto` has none: `None`).
    pub fn shard_size(&self, world_size: u64) -> Option<u64> {
        match self {
            Strategy::FullShard | Strategy::ShardGradOp | Strategy::ShardOptimizer => {
                Some(world_size)
            }
            Strategy::NoShard => Some(1),
            Strategy::Hybrid { shard_size } => Some(*shard_size),
            Strategy::Auto => None,
        }
    }

    /// Whether a unit is resharded (its unsharded parameters freed) right after its forward.
    /// True for `FullShard` and `Hybrid`; false for `ShardGradOp`, `ShardOptimizer` and
    /// `NoShard`.
    pub fn reshard_after_forward(&self) -> bool {
        matches!(self, Strategy::FullShard | Strategy::Hybrid { .. })
    }

    /// Whether parameters and gradients stay unsharded (replicated) for the whole step, with
    /// only the optimizer state and master weights sharded: true for `ShardOptimizer` (ZeRO-1)
    /// only.
    pub fn replicated_params_and_grads(&self) -> bool {
        matches!(self, Strategy::ShardOptimizer)
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Strategy::Hybrid { shard_size } => write!(f, "hybrid (shard group {shard_size})"),
            s => f.write_str(s.cli_name()),
        }
    }
}

/// The optimizer, which fixes the optimizer-state bytes per trainable element (all f32).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Optimizer {
    /// AdamW (Loshchilov & Hutter 2019): `exp_avg` and `exp_avg_sq`, 8 bytes per element.
    AdamW,
    /// SGD: a momentum buffer (4 bytes per element) iff `momentum != 0`.
    Sgd {
        /// Momentum coefficient; 0 means no state.
        momentum: f64,
    },
}

impl Optimizer {
    /// Optimizer-state bytes per trainable element: 8 (AdamW), 4 (SGD with momentum), 0.
    pub fn state_bytes_per_element(&self) -> u64 {
        match self {
            Optimizer::AdamW => 8,
            Optimizer::Sgd { momentum } if *momentum != 0.0 => 4,
            Optimizer::Sgd { .. } => 0,
        }
    }
}

/// When gradients are reduced during gradient accumulation (deferring the reduction to the last
/// micro-batch keeps unsharded gradients on every rank:
/// <https://github.com/meta-pytorch/tnt/pull/1057>).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum GradSync {
    /// Reduce-scatter every micro-batch into the f32 gradient shards (the default: gradient
    /// memory stays sharded).
    #[default]
    EveryMicroBatch,
    /// Accumulate unsharded f32 gradients locally and reduce only on the last micro-batch
    /// (`no_sync`): less communication, `4 * sum_T P_f` extra bytes per rank.
    LastMicroBatch,
}

impl FromStr for GradSync {
    type Err = PlanError;
    /// Reads `every` / `every-micro-batch` or `last` / `last-micro-batch`.
    fn from_str(s: &str) -> Result<Self, PlanError> {
        match s {
            "every" | "every-micro-batch" => Ok(GradSync::EveryMicroBatch),
            "last" | "last-micro-batch" => Ok(GradSync::LastMicroBatch),
            _ => Err(PlanError::InvalidConfig(format!(
                "unknown gradient sync `{s}` (expected every-micro-batch or last-micro-batch)"
            ))),
        }
    }
}

/// Which implementation of the GPT's hot ops (embedding, LayerNorm, causal softmax, bias add,
/// bias + GELU, cross-entropy) the activation estimate counts: the engine's
/// `fsdp::model::OpsPath` after it is resolved against the device.
///
/// The two paths keep different tensors for backward (see
/// [`crate::memory::use_activations`]): the fused CPU ops keep about one tensor per op in
/// `param_dtype`, the composite path (candle primitives differentiated by candle autograd, what
/// a CUDA device runs) keeps every primitive's output, in f32 inside the ops for bf16/f16, so
/// its activations are about 2.4x (f32) to 5.6x (bf16) those of the fused path for a GPT-2 block
/// (the fused path runs the whole causal self-attention as one op).
/// Only GPT-2 architectures differ; Llama (planned with the terms of its fused CPU ops under
/// both) and generic specs plan the same bytes under both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActivationModel {
    /// The fused CPU ops (`engine/src/model/ops.rs`; `OpsPath::Fused`, what `OpsPath::Auto`
    /// picks on the CPU). The default; plans made before this choice existed used it.
    #[default]
    Fused,
    /// The composite ops (`engine/src/model/composite.rs`; `OpsPath::Composite`, what
    /// `OpsPath::Auto` picks on a CUDA device: `fsdp train --device cuda`).
    Composite,
}

impl ActivationModel {
    /// The command-line and JSON name: `fused` or `composite`.
    pub fn name(&self) -> &'static str {
        match self {
            ActivationModel::Fused => "fused",
            ActivationModel::Composite => "composite",
        }
    }

    /// Whether this is the default ([`ActivationModel::Fused`]); such configs serialize (and
    /// fingerprint) without the field, exactly as before it existed.
    pub fn is_fused(&self) -> bool {
        *self == ActivationModel::Fused
    }
}

impl fmt::Display for ActivationModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ActivationModel {
    type Err = PlanError;
    /// Reads `fused` or `composite`.
    fn from_str(s: &str) -> Result<Self, PlanError> {
        match s {
            "fused" => Ok(ActivationModel::Fused),
            "composite" => Ok(ActivationModel::Composite),
            _ => Err(PlanError::InvalidConfig(format!(
                "unknown activation model `{s}` (expected fused or composite)"
            ))),
        }
    }
}

/// Where the fp32 master shards, the optimizer state and (optionally) the parameter shards live
/// when the compute device is not the host (ZeRO-Offload, Ren et al. 2021, "ZeRO-Offload:
/// Democratizing Billion-Scale Model Training"; PyTorch FSDP2's `CPUOffloadPolicy`;
/// DeepSpeed's `offload_optimizer` / `offload_param`).
///
/// Under `Optimizer`, each rank's f32 master shards, f32 gradient shards and optimizer state
/// are in host memory and the optimizer step runs on the CPU; the device keeps one
/// `param_dtype` copy of the parameter shards (the all-gather input), refreshed from the
/// host after every step. Under `Params`, that device copy goes too: each unit's shard is cast
/// on the host and copied into its block of the device's all-gather buffer just before the
/// all-gather. Both keep two reusable host staging buffers for the copies (the largest flat
/// parameter's shard in `param_dtype`, the largest trainable one's in `reduce_dtype`), as
/// pinned-memory engines do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Offload {
    /// Everything on the compute device (the default).
    #[default]
    None,
    /// Master weights, gradient shards and optimizer state in host memory; the optimizer step
    /// on the CPU.
    Optimizer,
    /// As `Optimizer`, and the parameter shards too: nothing sharded stays on the device.
    Params,
}

impl Offload {
    /// The command-line and JSON name: `none`, `optimizer` or `params`.
    pub fn name(&self) -> &'static str {
        match self {
            Offload::None => "none",
            Offload::Optimizer => "optimizer",
            Offload::Params => "params",
        }
    }

    /// Whether anything is offloaded (`Optimizer` or `Params`).
    pub fn is_some(&self) -> bool {
        *self != Offload::None
    }
}

impl fmt::Display for Offload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Offload {
    type Err = PlanError;
    /// Reads `none`, `optimizer` or `params`.
    fn from_str(s: &str) -> Result<Self, PlanError> {
        match s {
            "none" => Ok(Offload::None),
            "optimizer" => Ok(Offload::Optimizer),
            "params" => Ok(Offload::Params),
            _ => Err(PlanError::InvalidConfig(format!(
                "unknown offload `{s}` (expected none, optimizer or params)"
            ))),
        }
    }
}

/// The activation-checkpointing default of a strategy when the config does not set it: off
/// for every strategy, as in PyTorch FSDP2, where resharding after forward frees parameters
/// only and recompute is opt-in. (Before the setting existed, full shard and hybrid always
/// recomputed; `Some(true)` plans those exactly, fingerprints included.)
pub fn default_activation_checkpointing(strategy: Strategy) -> bool {
    let _ = strategy;
    false
}

/// Largest world size accepted (keeps every byte count far from `u64` overflow).
pub const MAX_WORLD_SIZE: u64 = 1 << 24;
/// Largest alignment accepted, in elements.
pub const MAX_ALIGNMENT: u64 = 1 << 20;
/// Largest `micro_batch * seq_len` accepted, in tokens.
pub const MAX_TOKENS_PER_MICRO_BATCH: u64 = 1 << 32;

/// Everything about a training run that shapes the plan. Master weights are always f32.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanConfig {
    /// Number of ranks `W` (at least 1).
    pub world_size: u64,
    /// Sharding strategy (`Auto` is resolved by `plan()`).
    pub strategy: Strategy,
    /// dtype of the unsharded parameters used in forward/backward (and sent by all-gather).
    pub param_dtype: DType,
    /// dtype of gradients in the reduce-scatter / all-reduce.
    pub reduce_dtype: DType,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Micro-batches per optimizer step (at least 1).
    pub grad_accum: u64,
    /// When gradients are reduced during accumulation.
    pub grad_sync: GradSync,
    /// Units gathered ahead of the one computing, forward and backward (PyTorch's default 1).
    pub prefetch: u64,
    /// Sequences per micro-batch per rank (at least 1).
    pub micro_batch: u64,
    /// Tokens per sequence (at least 1).
    pub seq_len: u64,
    /// Alignment of each parameter's offset in its flat parameter, in elements (at least 1).
    pub alignment: u64,
    /// Memory per device; needed by `Auto`, used by fit reports.
    pub device_memory: Option<Bytes>,
    /// The ops path whose activations are estimated ([`ActivationModel`]). Left out of the
    /// serialized config (and so of the fingerprint) when it is the default `Fused`, so plans
    /// of default configs keep their bytes and fingerprints.
    #[serde(default, skip_serializing_if = "ActivationModel::is_fused")]
    pub activations: ActivationModel,
    /// Unit-level activation checkpointing (Chen et al. 2016, "Training Deep Nets with
    /// Sublinear Memory Cost"; PyTorch's `checkpoint` wrapped around each FSDP unit): forward
    /// keeps only each unit use's input, and backward recomputes the unit's forward before
    /// back-propagating through it: one extra forward of compute for activation memory of
    /// the inputs plus one unit's graph. `None` is the strategy's default
    /// ([`PlanConfig::activation_checkpointing_for`]); independent of resharding after
    /// forward, which frees the unsharded parameters whether or not the graph is kept
    /// (PyTorch FSDP2's `fully_shard(reshard_after_forward=True)` keeps the graph and
    /// re-gathers the parameters for backward; checkpointing is a separate opt-in). Left out
    /// of the serialized config (and the fingerprint) when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_checkpointing: Option<bool>,
    /// What lives in host memory ([`Offload`]); `None` = not set: no offload, except that
    /// `Strategy::Auto` may choose it as the last resort before "does not fit". Left out of
    /// the serialized config (and the fingerprint) when `None` or `Some(Offload::None)`.
    #[serde(default, skip_serializing_if = "offload_is_default")]
    pub offload: Option<Offload>,
    /// Checkpoints are saved asynchronously (`fsdp plan/train --ckpt-async`): each rank
    /// keeps a host staging copy of its master and optimizer-state shards and a writer's
    /// buffer ([`crate::memory::async_checkpoint_bytes`], host memory at every point). A
    /// setting of the run's saves, not of its sharding: left out of the serialized config
    /// when false and out of the fingerprint always, so a checkpoint records the same plan
    /// fingerprint whether it was saved synchronously or not.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ckpt_async: bool,
}

fn offload_is_default(o: &Option<Offload>) -> bool {
    o.is_none_or(|o| !o.is_some())
}

impl PlanConfig {
    /// Defaults for `world_size` ranks: full shard, f32 params and reduction, AdamW, one
    /// micro-batch of 1 x 1024 tokens, sync every micro-batch, prefetch 1, alignment 1,
    /// activations of the fused ops.
    pub fn new(world_size: u64) -> Self {
        PlanConfig {
            world_size,
            strategy: Strategy::FullShard,
            param_dtype: DType::F32,
            reduce_dtype: DType::F32,
            optimizer: Optimizer::AdamW,
            grad_accum: 1,
            grad_sync: GradSync::EveryMicroBatch,
            prefetch: 1,
            micro_batch: 1,
            seq_len: 1024,
            alignment: 1,
            device_memory: None,
            activations: ActivationModel::Fused,
            activation_checkpointing: None,
            offload: None,
            ckpt_async: false,
        }
    }

    /// The offload in effect: the explicit [`PlanConfig::offload`], else none.
    pub fn offload_mode(&self) -> Offload {
        self.offload.unwrap_or_default()
    }

    /// Refuses an offload that makes no sense under `strategy`: anything offloaded with one
    /// shard per group (no-shard, hybrid with shard groups of one) at more than one rank
    /// (every rank would keep a whole copy of the master weights and optimizer state in host
    /// memory: shard them first), and parameter offload
    /// with no-shard or shard-optimizer (both keep the unsharded parameters on the device all
    /// step, so there is nothing to move).
    ///
    /// Errors: `InvalidConfig` naming the strategy and what to use instead.
    pub fn check_offload(&self, strategy: Strategy) -> Result<(), PlanError> {
        let o = self.offload_mode();
        let w = self.world_size;
        let one_shard = strategy.shard_size(w) == Some(1);
        let instead = if o == Offload::Params {
            "use --strategy shard-grad-op or full-shard with --offload params, or shard-optimizer with --offload optimizer"
        } else {
            "use --strategy shard-optimizer, shard-grad-op or full-shard with --offload"
        };
        match strategy {
            _ if o.is_some() && one_shard && w > 1 => Err(PlanError::InvalidConfig(format!(
                "--offload {o} with {} at {w} ranks makes no sense: with one shard per group every rank would keep a whole copy of the master weights and optimizer state in host memory; {instead}",
                if strategy == Strategy::NoShard {
                    "no-shard".to_string()
                } else {
                    format!("{strategy}")
                }
            ))),
            Strategy::NoShard | Strategy::ShardOptimizer if o == Offload::Params => {
                Err(PlanError::InvalidConfig(format!(
                    "--offload params with {strategy} makes no sense: {strategy} keeps the unsharded parameters on the device all step, so there is no parameter shard to move; use --offload optimizer, or --strategy full-shard / shard-grad-op with --offload params"
                )))
            }
            _ => Ok(()),
        }
    }

    /// Whether units recompute their forward in backward under `strategy`: the explicit
    /// [`PlanConfig::activation_checkpointing`], else [`default_activation_checkpointing`].
    pub fn activation_checkpointing_for(&self, strategy: Strategy) -> bool {
        self.activation_checkpointing
            .unwrap_or_else(|| default_activation_checkpointing(strategy))
    }

    /// Checks the values that need no model: world size (1..=`MAX_WORLD_SIZE`), shard size,
    /// micro-batch, sequence length, accumulation steps, alignment (1..=`MAX_ALIGNMENT`),
    /// tokens per micro-batch, optimizer momentum.
    ///
    /// Errors: `ZeroWorldSize`, `ShardSizeNotDivisor`, `ZeroAlignment`, `InvalidConfig`.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.world_size == 0 {
            return Err(PlanError::ZeroWorldSize(0));
        }
        if let Strategy::Hybrid { shard_size } = self.strategy {
            if shard_size == 0 || !self.world_size.is_multiple_of(shard_size) {
                return Err(PlanError::ShardSizeNotDivisor {
                    shard_size,
                    world_size: self.world_size,
                });
            }
        }
        if self.world_size > MAX_WORLD_SIZE {
            return Err(PlanError::InvalidConfig(format!(
                "world size {} exceeds the planner's limit of {MAX_WORLD_SIZE} ranks",
                self.world_size
            )));
        }
        if self.alignment == 0 {
            return Err(PlanError::ZeroAlignment);
        }
        if self.alignment > MAX_ALIGNMENT {
            return Err(PlanError::InvalidConfig(format!(
                "alignment {} exceeds the limit of {MAX_ALIGNMENT} elements",
                self.alignment
            )));
        }
        let tokens = self.micro_batch.saturating_mul(self.seq_len);
        if tokens > MAX_TOKENS_PER_MICRO_BATCH {
            return Err(PlanError::InvalidConfig(format!(
                "micro-batch {} x sequence length {} = {tokens} tokens exceeds the limit of {MAX_TOKENS_PER_MICRO_BATCH}",
                self.micro_batch, self.seq_len
            )));
        }
        for (v, what) in [
            (self.micro_batch, "micro-batch size"),
            (self.seq_len, "sequence length"),
            (self.grad_accum, "gradient accumulation steps"),
        ] {
            if v == 0 {
                return Err(PlanError::InvalidConfig(format!(
                    "{what} must be at least 1, got 0"
                )));
            }
        }
        if let Optimizer::Sgd { momentum } = self.optimizer {
            if !momentum.is_finite() || !(0.0..1.0).contains(&momentum) {
                return Err(PlanError::InvalidConfig(format!(
                    "SGD momentum must be in [0, 1), got {momentum}"
                )));
            }
        }
        self.check_offload(self.strategy)?;
        if self.strategy == Strategy::Auto && self.device_memory.is_none() {
            return Err(PlanError::InvalidConfig(
                "strategy `auto` needs a device memory budget (--device-memory)".into(),
            ));
        }
        Ok(())
    }
}

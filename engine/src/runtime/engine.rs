//! The per-rank FSDP engine: executes a [`ShardPlan`]'s schedule for one training step.
//!
//! One step (ARCHITECTURE-GUIDE "One training step"; Zhao et al. 2023, "PyTorch FSDP", sec. 3;
//! Rajbhandari et al. 2020, "ZeRO", sec. 5):
//! 1. All ranks exchange their micro-batch count and token count: a different count is an
//!    error naming the ranks instead of a hang in a later collective
//!    (<https://github.com/deepspeedai/DeepSpeed/issues/2223>); the global token count `N` is
//!    known.
//! 2. Per micro-batch, forward: at each schedule position the plan's `alive` units are
//!    unsharded (all-gathered) and the others resharded; a unit computes its stage. With
//!    activation checkpointing (`Schedule::activation_checkpointing`) only the stage input is
//!    kept and the backward recomputes the stage; otherwise the graph is kept, and a unit
//!    resharded after forward (full shard, hybrid) has its parameter storages emptied while
//!    the graph keeps their tensors, which the backward's all-gather refills (as PyTorch
//!    FSDP2's `fully_shard` resizes an unsharded parameter's storage to 0 and back).
//! 3. Backward in reverse order: gradients of the unit's parameters are copied into its
//!    unsharded flat gradient; where the plan says `reduce_scatter` the flat gradient is
//!    sum-reduce-scattered over the shard group, all-reduced over the replicate group and
//!    added into the fp32 gradient shard (every micro-batch, or only on the last one under
//!    `grad_sync = last`, which keeps unsharded gradients:
//!    <https://github.com/meta-pytorch/tnt/pull/1057>).
//! 4. The gradient shards are divided by `N` exactly once (never again per accumulated
//!    micro-batch: <https://github.com/NVIDIA/Megatron-LM/pull/3023>; `N` counts only real
//!    samples, so an uneven last batch is weighted by them); the loss is the world's loss sum
//!    over `N`. Ledger bytes above the plan stop the run on every rank. One
//!    flag, all-reduced with the loss, says whether any gradient element (a rank's own
//!    contribution, checked before each reduction, or a reduced shard, checked in the pass
//!    that also yields the L2 norm) or the loss is not finite; then no rank updates anything
//!    and the step is skipped or refused by [`NonFinitePolicy`].
//! 5. Clipping by the global norm over the shard group, padding excluded (never a rank's local
//!    norm: <https://github.com/areal-project/AReaL/issues/312>); the optimizer
//!    on each flat shard with the plan's spans; gradients zeroed.
//!
//! DDP is the same path with a shard group of one; hybrid sharding has both groups above one.

use crate::error::{EngineError, Result};
use crate::init::{FullValues, ParamSource};
use crate::memory::{MemoryLedger, PhasePeak, LEDGER_CATEGORIES};
use crate::optim::Optimizer;
use crate::runtime::collectives::{f64_chunks_to_u64, u64_to_f64_chunks, Collectives};
use crate::runtime::init_shards::init_shards;
use crate::runtime::staged::{MicroBatch, StagedModel};
use crate::runtime::unit::{owned_bytes, with_f32, FsdpUnit, Placement};
use candle_core::{Tensor, Var};
use fsdp_comm::{Buf, BufMut, Communicator, Group, OwnedBuf, PendingOp, ReduceOp};
use fsdp_kernels::tensor::TensorKernels;
use fsdp_planner::{GradSync, Phase, ShardPlan};
use fsdp_types::DType;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which norm clipping uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NormType {
    /// Euclidean norm over all trainable real elements of the model.
    L2,
    /// Largest absolute value.
    Inf,
}

/// Gradient clipping by the global norm (Pascanu et al. 2013, sec. 3.2): if the norm exceeds
/// `max_norm`, every gradient is multiplied by `max_norm / (norm + 1e-6)` (PyTorch's
/// `clip_grad_norm_` formula).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Clip {
    /// Largest allowed norm (> 0).
    pub max_norm: f64,
    /// The norm.
    pub norm: NormType,
}

/// How the engine makes sure every rank starts from the same weights (ranks initialised
/// differently would train different models: <https://github.com/pytorch/torchtitan/issues/166>).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InitSync {
    /// Each rank builds the initial weights itself (seeded); a 64-bit checksum of the full
    /// initial model is compared with rank 0's and a difference is an error before training.
    #[default]
    Verify,
    /// Rank 0's initial weights are broadcast to every rank (other ranks' values are ignored).
    BroadcastFromRank0,
}

/// Engine settings that are not part of the plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineConfig {
    /// Optimizer and its hyper-parameters (the learning rate is given per step).
    pub optimizer: Optimizer,
    /// Global-norm clipping, if any.
    pub clip: Option<Clip>,
    /// Initial-weight synchronisation.
    pub init_sync: InitSync,
    /// Stop with [`EngineError::MemoryOverPlan`] when ledger bytes exceed the plan.
    pub enforce_memory_plan: bool,
    /// What a step whose gradient or loss is not finite does (see [`NonFinitePolicy`]).
    pub nonfinite: NonFinitePolicy,
    /// Stop with [`EngineError::TooManySkipped`] once this many steps in a row were skipped
    /// (`None`: never). A diverged run then ends instead of skipping forever.
    pub max_consecutive_skips: Option<u64>,
}

/// What the engine does with a step in which some gradient element (after the reduction, or
/// in one rank's own contribution before it) or the loss is infinite or NaN.
///
/// The decision is taken once per step from one flag all-reduced over the world with the loss,
/// so every rank takes the same one. In both cases nothing is updated: parameters, master
/// weights, optimizer state, AdamW's update count and the learning-rate schedule position (the
/// driver advances it on applied updates only, as DeepSpeed does on overflow) stay as they
/// were, and the gradient shards are zeroed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum NonFinitePolicy {
    /// [`NonFinitePolicy::Skip`] when `param_dtype` is f16 (dynamic loss scaling: an overflow
    /// halves the scale and skips the step), [`NonFinitePolicy::Error`] otherwise.
    #[default]
    Auto,
    /// Skip the step: no update; the step counts for the data position and checkpoint
    /// numbering, is reported as skipped ([`StepStats::skipped`], [`StepStats::nonfinite`])
    /// and counted ([`RankEngine::skipped_steps`]).
    Skip,
    /// Return [`EngineError::NonFinite`] on every rank, naming the step and the parameters
    /// whose gradients were not finite and whose rank's contribution held them; the engine is
    /// left as before the step (usable for the next one). Not with f16 parameters, whose loss
    /// scaler must skip overflowing steps.
    Error,
}

/// One parameter whose reduced gradient held an infinite or NaN element.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NonFiniteParam {
    /// The parameter's name in the model spec (its original, e.g. Hugging Face, name).
    pub name: String,
    /// Ranks whose own contribution (their local gradient, before the reduction summed the
    /// ranks' contributions) held a non-finite element. Empty: every contribution was finite
    /// and their sum overflowed.
    pub ranks: Vec<usize>,
}

/// Why a step was skipped or refused: identical on every rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NonFiniteReport {
    /// 1-based step.
    pub step: u64,
    /// The world's mean loss of the step (may itself be infinite or NaN).
    pub loss: f64,
    /// Ranks whose own loss sum was not finite, with that value.
    pub rank_losses: Vec<(usize, f64)>,
    /// Parameters with a non-finite reduced gradient, in unit and declaration order.
    pub params: Vec<NonFiniteParam>,
    /// Set when every gradient was finite but the global norm was so large that the clip
    /// factor `max_norm / (norm + 1e-6)` rounds to zero in f32: (norm, max_norm).
    pub clip: Option<(f64, f64)>,
}

impl std::fmt::Display for NonFiniteReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "step {}: ", self.step)?;
        if let Some((norm, max_norm)) = self.clip {
            return write!(
                f,
                "gradient norm {norm:e} makes the clip factor {max_norm} / {norm:e} round to 0 in f32"
            );
        }
        const SHOWN: usize = 8;
        if !self.params.is_empty() {
            write!(f, "non-finite gradient in ")?;
            for (i, p) in self.params.iter().take(SHOWN).enumerate() {
                if i > 0 {
                    write!(f, ", ")?;
                }
                if p.ranks.is_empty() {
                    write!(f, "{} (finite on every rank; their sum overflowed)", p.name)?;
                } else {
                    let r: Vec<String> = p.ranks.iter().map(|r| r.to_string()).collect();
                    let who = if p.ranks.len() == 1 { "rank" } else { "ranks" };
                    write!(f, "{} (from {who} {})", p.name, r.join(", "))?;
                }
            }
            if self.params.len() > SHOWN {
                write!(f, " and {} more parameters", self.params.len() - SHOWN)?;
            }
            write!(f, "; ")?;
        }
        write!(f, "loss {}", self.loss)?;
        if !self.rank_losses.is_empty() {
            let r: Vec<String> = self
                .rank_losses
                .iter()
                .map(|(r, l)| format!("rank {r}: {l}"))
                .collect();
            write!(f, " ({})", r.join(", "))?;
        }
        Ok(())
    }
}

/// What one call of [`RankEngine::accumulate`] produced (identical on every rank).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Accumulated {
    /// The world's mean loss per contributing token: loss sum over all ranks and micro-batches
    /// divided by `tokens`.
    pub loss: f64,
    /// Global number of contributing tokens (samples), the divisor of the gradient.
    pub tokens: u64,
    /// This rank's loss sum (before the world sum).
    pub local_loss_sum: f64,
    /// Some gradient element or the loss was not finite (on some rank) and the policy skips
    /// such steps (f16 loss scaling among them): the gradient shards were zeroed and the
    /// optimizer step must be skipped (identical on every rank).
    pub overflow: bool,
}

/// Dynamic loss scaling for f16 parameters (Micikevicius et al. 2018, "Mixed Precision
/// Training", sec. 3.2; PyTorch `GradScaler`'s defaults): the loss is multiplied by `scale`
/// before backward so small f16 gradients do not flush to zero; gradients are divided by it
/// again (folded into the one division by the token count). A non-finite gradient on any rank
/// skips the step and halves the scale; `GROWTH_INTERVAL` clean steps in a row double it.
///
/// The engine back-propagates the SUM of the micro-batch's token losses (it divides by the
/// global token count once, after the reduction), so its gradients are up to `tokens per
/// micro-batch` times those of PyTorch's mean loss: the initial scale is
/// [`LossScaler::INIT`] divided by that count rounded up to a power of two (at least 1), the
/// same headroom GradScaler's 2^16 gives a mean loss.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// Current scale (a power of two).
    pub scale: f64,
    /// Clean steps since the last overflow or growth.
    pub clean_steps: u64,
}

impl LossScaler {
    /// Initial scale for a loss averaged over its tokens, 2^16 (see [`LossScaler::initial`]).
    pub const INIT: f64 = 65536.0;

    /// The initial scaler for micro-batches of `tokens` tokens (summed loss):
    /// `INIT / 2^ceil(log2(tokens))`, at least 1.
    pub fn initial(tokens: u64) -> LossScaler {
        let p = tokens.max(1).next_power_of_two() as f64;
        LossScaler {
            scale: (Self::INIT / p).max(1.0),
            clean_steps: 0,
        }
    }
    /// Clean steps before the scale doubles.
    pub const GROWTH_INTERVAL: u64 = 2000;

    fn update(&mut self, overflow: bool) {
        if overflow {
            self.scale = (self.scale * 0.5).max(1.0);
            self.clean_steps = 0;
        } else {
            self.clean_steps += 1;
            if self.clean_steps >= Self::GROWTH_INTERVAL {
                self.scale = (self.scale * 2.0).min(2f64.powi(24));
                self.clean_steps = 0;
            }
        }
    }
}

/// One trainable flat parameter's reduction in flight.
struct FlatReduce {
    /// Index among the unit's trainable flat parameters.
    t: usize,
    work: ReduceWork,
    /// The send buffer is the unit's persistent f32 accumulation buffer: give it back.
    keep: bool,
}

enum ReduceWork {
    /// A started reduce-scatter or all-reduce.
    Started(PendingOp),
    /// World size 1: nothing to communicate, the buffer is the result.
    Local(OwnedBuf),
}

/// A unit's gradient reduction, started after its last backward use and finished (waited,
/// added into the fp32 gradient shards) after the next backward step gathered its gradients.
struct PendingReduce {
    unit: usize,
    flats: Vec<FlatReduce>,
}

/// Timing and measurements of one training step on one rank.
#[derive(Debug, Clone, Serialize)]
pub struct StepStats {
    /// 1-based optimizer step.
    pub step: u64,
    /// World mean loss per token.
    pub loss: f64,
    /// Global contributing tokens of the step.
    pub tokens: u64,
    /// The gradient norm before clipping (when clipping is on).
    pub grad_norm: Option<f64>,
    /// Learning rate used.
    pub lr: f64,
    /// Wall time of the step (seconds).
    pub step_seconds: f64,
    /// Exposed communication time (seconds): wall time this rank's compute thread was blocked
    /// in collectives (synchronous calls and waits for started ones); collectives that ran
    /// on the progress thread while the rank computed are not counted.
    pub comm_exposed_seconds: f64,
    /// Number of collective calls.
    pub comm_calls: u64,
    /// f16 loss scaling: the scale used in this step's backward (`None` unless param_dtype is
    /// f16).
    pub loss_scale: Option<f64>,
    /// The step found a non-finite gradient or loss and was skipped: no update was made.
    pub skipped: bool,
    /// Why the step was skipped (identical on every rank).
    pub nonfinite: Option<NonFiniteReport>,
    /// Ledger peaks per phase: forward, backward, optimizer step.
    pub ledger: [PhasePeak; 3],
}

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

/// The engine of one rank: its FSDP units, the plan, a communicator, a memory ledger.
pub struct RankEngine<'a, M: StagedModel + ?Sized> {
    model: &'a M,
    plan: &'a ShardPlan,
    comm: Collectives<'a>,
    cfg: EngineConfig,
    units: Vec<FsdpUnit>,
    stage_units: Vec<usize>,
    needs_input_grad: Vec<bool>,
    needs_backward: Vec<bool>,
    ledger: MemoryLedger,
    step: u64,
    /// Steps skipped (non-finite gradients or loss; not counted as AdamW updates).
    skipped: u64,
    /// The report of this step's non-finite values when the step is being skipped.
    pending_nonfinite: Option<NonFiniteReport>,
    rank: usize,
    shard_index: usize,
    /// Reductions are started and finished one backward step later (the plan's
    /// [`ShardPlan::overlaps_reductions`]).
    overlap: bool,
    /// f16 dynamic loss scaling.
    scaler: Option<LossScaler>,
    /// Skipped steps in a row (reset by an applied update; not checkpointed).
    consecutive_skips: u64,
    /// Whether a non-finite step is skipped (else refused), [`EngineConfig::nonfinite`]
    /// resolved for the plan's `param_dtype`.
    skip_nonfinite: bool,
    /// Per unit, per parameter (declaration order): this rank's own contribution to the
    /// gradient held a non-finite element in this step (checked before each reduction).
    contribution_nonfinite: Vec<Vec<bool>>,
    /// This rank's sum of squares of its gradient shards, computed once per step with the
    /// non-finite check and reused by the L2 norm; `None` once the gradients change.
    local_sum_squares: Option<f64>,
    /// Where flat buffers live and units compute.
    placement: Placement,
    /// The device kernels under [`Placement::Device`].
    dev: Option<Arc<TensorKernels>>,
}

impl<M: StagedModel + ?Sized> std::fmt::Debug for RankEngine<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankEngine")
            .field("rank", &self.rank)
            .field("units", &self.units.len())
            .field("step", &self.step)
            .finish()
    }
}

/// FNV-1a 64 over bytes (a checksum for cross-rank comparison, not a cryptographic hash).
fn fnv1a(h: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *h ^= *b as u64;
        *h = h.wrapping_mul(0x100000001b3);
    }
}

const FNV_OFFSET: u64 = 0xcbf29ce484222325;

fn state_names(opt: &Optimizer) -> &'static [&'static str] {
    match opt.state_buffers() {
        2 => &["exp_avg", "exp_avg_sq"],
        1 => &["momentum_buffer"],
        _ => &[],
    }
}

impl<'a, M: StagedModel + ?Sized> RankEngine<'a, M> {
    /// Builds the engine of `comm`'s rank: checks that the plan fits the communicator and the
    /// model, compares the plan fingerprint with rank 0's, makes the initial weights identical
    /// on every rank (`cfg.init_sync`) and keeps this rank's shards.
    ///
    /// `init` is `[unit][non-tied param][element]` (see [`StagedModel::init_params`]).
    ///
    /// Errors: [`EngineError::Config`] (a shard-optimizer plan, which this engine does not
    /// execute; world size, shard size, dtypes, optimizer or stages differ from the plan;
    /// wrong init sizes), [`EngineError::RankMismatch`] (fingerprint or
    /// initial-weight checksum differs from rank 0's), [`EngineError::Comm`].
    pub fn new(
        model: &'a M,
        plan: &'a ShardPlan,
        comm: &'a dyn Communicator,
        cfg: EngineConfig,
        init: &[Vec<Vec<f32>>],
    ) -> Result<Self> {
        Self::new_on(model, plan, comm, cfg, init, Placement::Host)
    }

    /// [`RankEngine::new`] with the flat buffers and the compute on `placement`: with
    /// [`Placement::Device`] every flat buffer is a 1-D tensor on that device, the flat-buffer
    /// kernels run there (fsdp-kernels' CUDA kernels on a CUDA device) and the communicator
    /// receives the device tensors (on CUDA only the NCCL backend reaches them).
    ///
    /// Errors: as [`RankEngine::new`]; [`EngineError::Kernel`] when the device's kernels cannot
    /// be set up (no CUDA driver, NVRTC failure).
    pub fn new_on(
        model: &'a M,
        plan: &'a ShardPlan,
        comm: &'a dyn Communicator,
        cfg: EngineConfig,
        init: &[Vec<Vec<f32>>],
        placement: Placement,
    ) -> Result<Self> {
        let values = FullValues::new(init, model.spec()).map_err(EngineError::Config)?;
        Self::new_from(model, plan, comm, cfg, &values, placement)
    }

    /// [`RankEngine::new_on`] with the initial values read from `source`, shard by shard: this
    /// rank asks `source` only for the element ranges of its own flat-parameter shards (the
    /// slices [`fsdp_planner::FlatParamLayout::shard_slices`] gives), so it never holds the
    /// whole model. Under [`InitSync::BroadcastFromRank0`] rank 0 reads each flat parameter
    /// whole, one at a time, and broadcasts it.
    ///
    /// Before training the ranks all-gather `source`'s fingerprint, a checksum of each rank's
    /// shards and whether its reads succeeded: ranks whose fingerprint differs from rank 0's,
    /// or replicas of one shard whose checksums differ, are [`EngineError::RankMismatch`]
    /// ([`InitSync::Verify`]); a failed read on any rank is [`EngineError::Init`] on every
    /// rank, with the failing rank's message.
    ///
    /// Errors: as [`RankEngine::new_on`]; [`EngineError::Init`].
    pub fn new_from(
        model: &'a M,
        plan: &'a ShardPlan,
        comm: &'a dyn Communicator,
        cfg: EngineConfig,
        source: &dyn ParamSource,
        placement: Placement,
    ) -> Result<Self> {
        if plan.strategy.replicated_params_and_grads() {
            return Err(EngineError::Config(format!(
                "strategy {} (ZeRO-1: replicated params and grads, sharded optimizer state) is planned by `fsdp plan` but this engine does not execute it; use full-shard, shard-grad-op, no-shard or hybrid",
                plan.strategy
            )));
        }
        let f16 = plan.config.param_dtype == DType::F16;
        let skip_nonfinite = match cfg.nonfinite {
            NonFinitePolicy::Auto => f16,
            NonFinitePolicy::Skip => true,
            NonFinitePolicy::Error if f16 => {
                return Err(EngineError::Config(
                    "non-finite policy `error` with param_dtype f16: dynamic loss scaling skips every step whose f16 gradients overflow (and halves the scale), so such steps must be skipped; use `skip` (or `auto`) and bound the skips with max_consecutive_skips".into(),
                ))
            }
            NonFinitePolicy::Error => false,
        };
        if cfg.max_consecutive_skips == Some(0) {
            return Err(EngineError::Config(
                "max_consecutive_skips must be at least 1 (None: no limit)".into(),
            ));
        }
        let contribution_nonfinite = model
            .spec()
            .units
            .iter()
            .map(|u| vec![false; u.params.len()])
            .collect();
        let mut comm = Collectives::new(comm);
        let topo = comm.topology();
        let rank = comm.rank();
        if topo.world_size as u64 != plan.world_size() || topo.shard_size as u64 != plan.shard_size
        {
            return Err(EngineError::Config(format!(
                "the plan is for world size {} with shard groups of {}, the communicator has {} ranks in shard groups of {}",
                plan.world_size(),
                plan.shard_size,
                topo.world_size,
                topo.shard_size
            )));
        }
        if !matches!(
            plan.config.param_dtype,
            DType::F32 | DType::BF16 | DType::F16
        ) {
            return Err(EngineError::Config(format!(
                "param_dtype {}: the engine computes in f32, bf16 or f16",
                plan.config.param_dtype
            )));
        }
        // f16 on the wire: the sum over ranks (the engine divides by the token count once,
        // after the reduction) overflows f16's 65504 where every rank's gradient fits, and
        // the loss scale would fall by a factor W; bf16 has f32's range.
        if !matches!(plan.config.reduce_dtype, DType::F32 | DType::BF16) {
            return Err(EngineError::Config(format!(
                "reduce_dtype {}: gradients are reduced in f32 or bf16 (an f16 sum over ranks overflows before the division by the token count); use --reduce-dtype f32 or bf16",
                plan.config.reduce_dtype
            )));
        }
        let planned_state = plan.config.optimizer.state_bytes_per_element();
        if planned_state != 4 * cfg.optimizer.state_buffers() as u64 {
            return Err(EngineError::Config(format!(
                "the plan counts {planned_state} optimizer bytes per element, the optimizer keeps {}",
                4 * cfg.optimizer.state_buffers()
            )));
        }
        let spec = model.spec();
        let stage_units = model.stage_units();
        let planned: Vec<usize> = plan.schedule.forward.iter().map(|s| s.unit).collect();
        if stage_units != planned {
            return Err(EngineError::Config(format!(
                "the model's stages use units {stage_units:?}, the plan's schedule {planned:?}"
            )));
        }
        if spec.units.len() != plan.units.len() {
            return Err(EngineError::Config(format!(
                "model has {} units, plan {}",
                spec.units.len(),
                plan.units.len()
            )));
        }

        // Plan fingerprint against rank 0's.
        let mut h = FNV_OFFSET;
        fnv1a(&mut h, plan.fingerprint().as_bytes());
        let all = comm.all_gather_f64(&u64_to_f64_chunks(h))?;
        let fps: Vec<u64> = all.iter().map(|c| f64_chunks_to_u64(c)).collect();
        if let Some(bad) = fps.iter().position(|&f| f != fps[0]) {
            return Err(EngineError::RankMismatch {
                what: "plan fingerprint",
                detail: format!(
                    "rank {bad} has plan hash {:016x}, rank 0 has {:016x} (this rank: {})",
                    fps[bad],
                    fps[0],
                    plan.fingerprint()
                ),
            });
        }

        let shard_index = rank % topo.shard_size;
        let shards = init_shards(spec, plan, &mut comm, cfg.init_sync, source, shard_index)?;
        let dev = match &placement {
            Placement::Host => None,
            Placement::Device(d) => Some(Arc::new(TensorKernels::new(d)?)),
        };
        let mut ledger = MemoryLedger::new();
        let mut units = Vec::with_capacity(spec.units.len());
        let mut shards_iter = shards.into_iter();
        for (u, (us, ul)) in spec.units.iter().zip(&plan.units).enumerate() {
            units.push(FsdpUnit::new(
                u,
                us,
                ul,
                shards_iter.next().expect("one shard list per unit"),
                shard_index as u64,
                cfg.optimizer.state_buffers(),
                plan.config.param_dtype,
                dev.as_ref(),
                &mut ledger,
            )?);
        }
        let m = stage_units.len();
        let mut needs_input_grad = vec![false; m];
        let mut seen_trainable = false;
        for s in 0..m {
            needs_input_grad[s] = seen_trainable;
            seen_trainable |= units[stage_units[s]].trainable();
        }
        let needs_backward = (0..m)
            .map(|s| needs_input_grad[s] || units[stage_units[s]].trainable())
            .collect();
        Ok(RankEngine {
            model,
            plan,
            comm,
            cfg,
            units,
            stage_units,
            needs_input_grad,
            needs_backward,
            ledger,
            step: 0,
            skipped: 0,
            pending_nonfinite: None,
            rank,
            shard_index,
            overlap: plan.overlaps_reductions(),
            scaler: f16.then(|| LossScaler::initial(plan.config.micro_batch * plan.config.seq_len)),
            consecutive_skips: 0,
            skip_nonfinite,
            contribution_nonfinite,
            local_sum_squares: None,
            placement,
            dev,
        })
    }

    /// Steps skipped so far (non-finite gradients or loss, f16 overflows included; no update
    /// was made in them).
    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    /// Optimizer updates applied so far: steps taken minus steps skipped. AdamW's bias
    /// correction counts these, and the training driver's learning-rate schedule is indexed by
    /// them, so a skipped step moves neither.
    pub fn updates_applied(&self) -> u64 {
        self.step - self.skipped
    }

    /// The f16 dynamic loss scaler's state (`None` unless param_dtype is f16).
    pub fn loss_scaler(&self) -> Option<LossScaler> {
        self.scaler
    }

    /// Where this rank's flat buffers live and its units compute.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// The flat-buffer kernels of the device under [`Placement::Device`] (`None` on the host).
    pub fn tensor_kernels(&self) -> Option<&TensorKernels> {
        self.dev.as_deref()
    }

    /// Device memory (bytes) now and at its peak since the last
    /// [`RankEngine::reset_device_memory_peak`], from the device's allocation pool (see
    /// `fsdp_kernels::tensor::TensorKernels::memory`); `None` on the host and the CPU device.
    ///
    /// Errors: [`EngineError::Kernel`] with the driver's text.
    pub fn device_memory(&self) -> Result<Option<fsdp_kernels::tensor::DeviceMemory>> {
        match &self.dev {
            Some(k) => Ok(k.memory()?),
            None => Ok(None),
        }
    }

    /// Starts a new device-memory peak at the current use (no-op on the host).
    ///
    /// Errors: [`EngineError::Kernel`] with the driver's text.
    pub fn reset_device_memory_peak(&self) -> Result<()> {
        if let Some(k) = &self.dev {
            k.synchronize()?;
            k.reset_memory_peak()?;
        }
        Ok(())
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The plan executed.
    pub fn plan(&self) -> &ShardPlan {
        self.plan
    }

    /// Optimizer steps taken so far.
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// The memory ledger (live bytes and per-phase peaks).
    pub fn ledger(&self) -> &MemoryLedger {
        &self.ledger
    }

    /// The FSDP units (shards, gradient shards, optimizer state).
    pub fn units(&self) -> &[FsdpUnit] {
        &self.units
    }

    /// Returns and resets the time spent in collectives and their count.
    pub fn take_comm_time(&mut self) -> (Duration, u64) {
        self.comm.take_time()
    }

    /// Exchanges the number of batches each rank will train on and errors, on every rank, if
    /// they differ (instead of hanging in a collective later:
    /// <https://github.com/deepspeedai/DeepSpeed/issues/2223>).
    ///
    /// Errors: [`EngineError::RankMismatch`] naming the ranks and counts; [`EngineError::Comm`].
    pub fn check_batch_counts(&mut self, batches: u64) -> Result<()> {
        let all = self.comm.all_gather_f64(&[batches as f64])?;
        check_counts(&all, "number of batches", "batches")
    }

    /// Makes exactly the units in `alive` unsharded (or unsharding): reshards the others first
    /// (so live bytes never exceed either position), makes `first` unsharded — waiting for its
    /// prefetched all-gather, or gathering it now — then starts the all-gathers of the other
    /// alive units, `prefetch` (the schedule's issue order) first; they run on the
    /// communicator's progress thread while `first` computes.
    fn transition_to(
        &mut self,
        alive: &[usize],
        first: Option<usize>,
        prefetch: &[usize],
    ) -> Result<()> {
        for u in 0..self.units.len() {
            if !alive.contains(&u) {
                self.units[u].reshard(&mut self.comm, &mut self.ledger)?;
            }
        }
        if let Some(f) = first {
            let unit = &mut self.units[f];
            if unit.is_unsharding() {
                unit.finish_unshard(&mut self.comm)?;
            } else if !unit.is_unsharded() {
                unit.unshard(&mut self.comm, &mut self.ledger)?;
            }
        }
        let order = prefetch
            .iter()
            .chain(alive.iter())
            .copied()
            .filter(|&u| Some(u) != first);
        for u in order {
            let unit = &mut self.units[u];
            if !unit.is_unsharded() && !unit.is_unsharding() {
                unit.start_unshard(&mut self.comm, &mut self.ledger)?;
            }
        }
        Ok(())
    }

    /// Runs forward and backward over this rank's micro-batches and leaves in the gradient
    /// shards the world's mean gradient (sum over every rank's tokens divided by the global
    /// token count once). Collective: every rank must call it with the same number of
    /// micro-batches, else [`EngineError::RankMismatch`] on every rank.
    ///
    /// Errors: [`EngineError::RankMismatch`], [`EngineError::NonFinite`],
    /// [`EngineError::MemoryOverPlan`], [`EngineError::Compute`], [`EngineError::Comm`].
    pub fn accumulate(&mut self, mbs: &[MicroBatch]) -> Result<Accumulated> {
        let local_tokens: u64 = mbs.iter().map(|m| m.count).sum();
        let all = self
            .comm
            .all_gather_f64(&[mbs.len() as f64, local_tokens as f64])?;
        check_counts(&all, "number of micro-batches in a step", "micro-batches")?;
        let tokens: u64 = all.iter().map(|v| v[1] as u64).sum();
        if tokens == 0 {
            return Err(EngineError::Data(
                "a step with no contributing tokens on any rank".into(),
            ));
        }
        if mbs.is_empty() {
            return Err(EngineError::Data(
                "a step needs at least one micro-batch".into(),
            ));
        }
        self.ledger.reset_peaks();
        self.pending_nonfinite = None;
        self.local_sum_squares = None;
        for flags in self.contribution_nonfinite.iter_mut() {
            flags.fill(false);
        }
        // Persistent unsharded gradients (sync on the last micro-batch) belong to the forward
        // phase of the first micro-batch.
        self.ledger.enter(Phase::Forward);
        let k_total = mbs.len();
        let sync_last = self.plan.config.grad_sync == GradSync::LastMicroBatch && k_total > 1;
        if sync_last {
            for u in 0..self.units.len() {
                if self.units[u].trainable() {
                    self.units[u].alloc_flat_grads(DType::F32, &mut self.ledger)?;
                }
            }
        }
        let mut local_loss = 0f64;
        for (k, mb) in mbs.iter().enumerate() {
            let last = k + 1 == k_total;
            local_loss += self.micro_batch(mb, sync_last, !sync_last || last)?;
        }
        // End of the backward phase: everything unsharded goes.
        self.transition_to(&[], None, &[])?;
        for u in self.units.iter_mut() {
            u.free_flat_grads(&mut self.ledger);
        }
        let divisor = tokens as f64 * self.scaler.map_or(1.0, |s| s.scale);
        for u in self.units.iter_mut() {
            for f in u.flats.iter_mut().filter(|f| f.layout.trainable) {
                f.grad.div_scalar(divisor as f32)?;
            }
        }
        // One pass over the gradient shards gives this rank's part of the L2 norm and the
        // non-finite check: squares of finite f32 values summed in f64 cannot overflow (at most
        // 2^40 terms of at most 2^256), so the sum is finite exactly when every element is.
        let mut local_sum_squares = 0f64;
        for f in self
            .units
            .iter()
            .flat_map(|u| &u.flats)
            .filter(|f| f.layout.trainable)
        {
            local_sum_squares += f.grad.sum_squares(&f.spans)?;
        }
        self.local_sum_squares = Some(local_sum_squares);
        let local_nonfinite = !local_sum_squares.is_finite()
            || !local_loss.is_finite()
            || self.contribution_nonfinite.iter().flatten().any(|&b| b);
        let violation = self.memory_violation();
        let mut buf = [
            local_loss,
            violation.is_some() as u64 as f64,
            local_nonfinite as u64 as f64,
        ];
        self.comm
            .all_reduce(Group::World, ReduceOp::Sum, BufMut::F64(&mut buf))?;
        if let Some(e) = violation {
            self.discard_gradients()?;
            return Err(e);
        }
        if buf[1] > 0.0 {
            self.discard_gradients()?;
            return Err(EngineError::MemoryOverPlan {
                step: self.step + 1,
                rank: self.rank,
                phase: "backward",
                category: "(another rank)",
                measured: 0,
                planned: 0,
            });
        }
        let loss = buf[0] / tokens as f64;
        if buf[2] > 0.0 || !loss.is_finite() {
            // Every rank got the same flag: all of them take this branch together.
            let report = self.nonfinite_report(loss, local_loss)?;
            self.discard_gradients()?;
            if !self.skip_nonfinite {
                return Err(EngineError::NonFinite(Box::new(report)));
            }
            self.pending_nonfinite = Some(report);
        }
        Ok(Accumulated {
            loss,
            tokens,
            local_loss_sum: local_loss,
            overflow: self.pending_nonfinite.is_some(),
        })
    }

    /// Zeroes the gradient shards and forgets the step's non-finite bookkeeping: what an
    /// unapplied step leaves behind.
    fn discard_gradients(&mut self) -> Result<()> {
        self.zero_grad()?;
        for flags in self.contribution_nonfinite.iter_mut() {
            flags.fill(false);
        }
        Ok(())
    }

    /// Names, on every rank alike, what was not finite in this step: one all-gather over the
    /// world of each rank's loss sum, the parameters whose contribution from this rank held a
    /// non-finite element (recorded before each reduction), and the parameters whose reduced
    /// gradient shard here holds one. Collective; called only when the step's flag is set, so
    /// every rank calls it.
    fn nonfinite_report(&mut self, loss: f64, local_loss: f64) -> Result<NonFiniteReport> {
        let spec = self.model.spec();
        let counts: Vec<usize> = spec.units.iter().map(|u| u.params.len()).collect();
        let total: usize = counts.iter().sum();
        let mut reduced = vec![false; total];
        let mut base = 0;
        for (u, unit) in self.units.iter().enumerate() {
            for f in unit.flats.iter().filter(|f| f.layout.trainable) {
                let bad = f.grad.max_abs(&f.spans)?;
                if bad.is_finite() {
                    continue;
                }
                let g = f.grad.to_vec()?;
                for sl in f.layout.shard_slices(f.shard_index) {
                    let lo = sl.shard_offset.0 as usize;
                    let hi = lo + sl.numel.0 as usize;
                    if fsdp_kernels::first_nonfinite(&g[lo..hi]).is_some() {
                        reduced[base + f.layout.segments[sl.segment].param_index] = true;
                    }
                }
            }
            base += counts[u];
        }
        let mut mine = Vec::with_capacity(1 + 2 * total);
        mine.push(local_loss);
        mine.extend(
            self.contribution_nonfinite
                .iter()
                .flatten()
                .map(|&b| b as u8 as f64),
        );
        mine.extend(reduced.iter().map(|&b| b as u8 as f64));
        let all = self.comm.all_gather_f64(&mine)?;
        let mut params = Vec::new();
        let mut i = 0;
        for unit in &spec.units {
            for p in &unit.params {
                let from: Vec<usize> = (0..all.len()).filter(|&r| all[r][1 + i] > 0.0).collect();
                let summed = all.iter().any(|v| v[1 + total + i] > 0.0);
                if summed || !from.is_empty() {
                    params.push(NonFiniteParam {
                        name: p.name.clone(),
                        ranks: from,
                    });
                }
                i += 1;
            }
        }
        Ok(NonFiniteReport {
            step: self.step + 1,
            loss,
            rank_losses: all
                .iter()
                .enumerate()
                .filter(|(_, v)| !v[0].is_finite())
                .map(|(r, v)| (r, v[0]))
                .collect(),
            params,
            clip: None,
        })
    }

    fn memory_violation(&self) -> Option<EngineError> {
        if !self.cfg.enforce_memory_plan {
            return None;
        }
        for phase in [Phase::Forward, Phase::Backward] {
            let measured = self.ledger.peak(phase).max;
            let planned = self.plan.memory.phase(phase).max;
            for c in LEDGER_CATEGORIES {
                if measured.get(c) > planned.get(c) {
                    return Some(EngineError::MemoryOverPlan {
                        step: self.step + 1,
                        rank: self.rank,
                        phase: phase.name(),
                        category: c.name(),
                        measured: measured.get(c).0,
                        planned: planned.get(c).0,
                    });
                }
            }
        }
        None
    }

    /// Forward and backward of one micro-batch; returns its local loss sum.
    fn micro_batch(&mut self, mb: &MicroBatch, sync_last: bool, reduce: bool) -> Result<f64> {
        let on_device;
        let mb = match &self.placement {
            Placement::Host => mb,
            Placement::Device(d) => {
                on_device = mb.to_device(d)?;
                &on_device
            }
        };
        let plan = self.plan;
        let sched = &plan.schedule;
        // Without activation checkpointing every use keeps its graph (with or without resharding
        // after forward: a resharded unit's parameter memory is freed and re-gathered into the
        // same tensors before its backward, see `FsdpUnit::reshard`).
        let keep = !sched.activation_checkpointing;
        let m = self.stage_units.len();
        self.ledger.enter(Phase::Forward);
        // Per stage: the input kept for backward, and (keep mode) the output with its graph.
        let mut inputs: Vec<Option<Tensor>> = vec![None; m];
        let mut outputs: Vec<Option<Tensor>> = vec![None; m];
        let mut x = mb.input.clone();
        let mut loss_value = 0f64;
        for unit in self.units.iter_mut() {
            unit.graph_uses = 0;
        }
        for s in 0..m {
            let u = self.stage_units[s];
            self.transition_to(&sched.forward[s].alive, Some(u), &sched.forward[s].prefetch)?;
            let unit = &self.units[u];
            if s + 1 == m {
                // The loss stage keeps its graph into backward (its unit stays unsharded across
                // the forward/backward boundary in every schedule).
                let x_in = if self.needs_input_grad[s] {
                    Var::from_tensor(&x)?.as_tensor().clone()
                } else {
                    x.clone()
                };
                let params = if self.needs_backward[s] {
                    &unit.vars
                } else {
                    &unit.plain
                };
                let loss = self.model.loss(params, &x_in, mb)?;
                if self.needs_backward[s] {
                    self.units[u].graph_uses += 1;
                }
                loss_value = loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
                inputs[s] = Some(x_in);
                outputs[s] = Some(loss);
            } else if keep && self.needs_backward[s] {
                let x_in = if self.needs_input_grad[s] {
                    Var::from_tensor(&x)?.as_tensor().clone()
                } else {
                    x.clone()
                };
                let y = self.model.forward(s, &unit.vars, &x_in)?;
                self.units[u].graph_uses += 1;
                x = y.detach();
                inputs[s] = Some(x_in);
                outputs[s] = Some(y);
            } else {
                let y = self.model.forward(s, &unit.plain, &x)?;
                inputs[s] = Some(std::mem::replace(&mut x, y));
            }
        }
        drop(x);
        self.ledger.enter(Phase::Backward);
        let mut g_out: Option<Tensor> = None;
        let mut touched = vec![false; self.units.len()];
        let grad_dtype = if sync_last {
            DType::F32
        } else {
            plan.config.reduce_dtype
        };
        let mut pending: Option<PendingReduce> = None;
        for kb in 0..m {
            let s = m - 1 - kb;
            let u = self.stage_units[s];
            self.transition_to(
                &sched.backward[kb].alive,
                Some(u),
                &sched.backward[kb].prefetch,
            )?;
            if self.needs_backward[s] {
                let x_in = inputs[s].take().expect("stage input kept");
                let root = if s + 1 == m {
                    let loss = outputs[s].take().expect("loss kept");
                    match self.scaler {
                        Some(sc) => loss.affine(sc.scale, 0.0)?,
                        None => loss,
                    }
                } else {
                    let g = g_out.take().expect("upstream gradient");
                    let y = match outputs[s].take() {
                        Some(y) => y,
                        None => {
                            let x_var = if self.needs_input_grad[s] {
                                Var::from_tensor(&x_in)?.as_tensor().clone()
                            } else {
                                x_in.clone()
                            };
                            let y = self.model.forward(s, &self.units[u].vars, &x_var)?;
                            inputs[s] = Some(x_var);
                            y
                        }
                    };
                    crate::model::ops::backward_seed(&y, &g)?
                };
                let x_in = inputs[s].take().unwrap_or(x_in);
                let mut grads = root.backward()?;
                drop(root);
                let unit = &mut self.units[u];
                unit.graph_uses = unit.graph_uses.saturating_sub(1);
                if self.needs_input_grad[s] {
                    g_out = Some(
                        grads
                            .remove(&x_in)
                            .ok_or_else(|| {
                                EngineError::Config(format!("stage {s}: no gradient for its input"))
                            })?
                            .detach(),
                    );
                }
                drop(x_in);
                if self.units[u].trainable() {
                    // Keep only the parameter gradients: intermediate gradients go first.
                    let mut params: Vec<Option<Tensor>> =
                        self.units[u].vars.iter().map(|v| grads.remove(v)).collect();
                    drop(grads);
                    self.units[u].alloc_flat_grads(grad_dtype, &mut self.ledger)?;
                    let add = sync_last || touched[u];
                    self.units[u].gather_grads(&mut params, add)?;
                    touched[u] = true;
                }
            }
            // The previous unit's reduction ran while this step computed.
            if let Some(p) = pending.take() {
                self.finish_reduce(p)?;
            }
            if sched.backward[kb].reduce_scatter && reduce {
                let p = self.start_reduce(u, sync_last)?;
                if self.overlap {
                    pending = Some(p);
                } else {
                    self.finish_reduce(p)?;
                }
            }
        }
        if let Some(p) = pending.take() {
            self.finish_reduce(p)?;
        }
        Ok(loss_value)
    }

    /// Starts the reduction of unit `u`'s unsharded flat gradients (reduce_dtype; under
    /// sync-last the persistent f32 buffer, cast to reduce_dtype first if that differs): a
    /// sum-reduce-scatter over the shard group into a staging buffer of `s_f` elements, or with
    /// a shard group of one an in-place sum-all-reduce over the replicate group. 16-bit
    /// reductions accumulate in f32 inside the collective (bf16 reduction made training unstable
    /// at a large world size: <https://github.com/pytorch/pytorch/issues/106395>).
    fn start_reduce(&mut self, u: usize, sync_last: bool) -> Result<PendingReduce> {
        let s = self.comm.group_size(Group::Shard);
        let r = self.comm.group_size(Group::Replicate);
        let rd = self.plan.config.reduce_dtype;
        let unit = &mut self.units[u];
        let mut flats = Vec::new();
        for (t, fs) in unit.flats.iter().filter(|f| f.layout.trainable).enumerate() {
            let (send, keep) = if sync_last && rd != DType::F32 {
                let c = match (&unit.flat_grads[t], &fs.dev) {
                    (OwnedBuf::F32(acc), _) => {
                        let mut c = OwnedBuf::zeros(rd, acc.len());
                        match &mut c {
                            OwnedBuf::BF16(v) => fsdp_kernels::cast::cast_f32_to_bf16(acc, v)?,
                            OwnedBuf::F16(v) => fsdp_kernels::cast::cast_f32_to_f16(acc, v)?,
                            _ => unreachable!("reduce_dtype checked at construction"),
                        }
                        c
                    }
                    (OwnedBuf::Tensor(acc), Some(k)) => {
                        let c = k.zeros(rd, acc.elem_count())?;
                        k.cast_into(&c, 0, acc)?;
                        OwnedBuf::Tensor(c)
                    }
                    _ => {
                        return Err(EngineError::Config(
                            "persistent gradient buffer is not f32".into(),
                        ))
                    }
                };
                self.ledger
                    .alloc(fsdp_planner::Category::UnshardedGrads, owned_bytes(&c));
                (c, false)
            } else {
                let b = std::mem::replace(&mut unit.flat_grads[t], OwnedBuf::F32(Vec::new()));
                (b, sync_last)
            };
            // This rank's own contribution, before the reduction mixes it with the others': a
            // non-finite element here is attributed to this rank in a non-finite report.
            if !contribution_is_finite(&send, fs.dev.as_deref())? {
                let flags = &mut self.contribution_nonfinite[u];
                for p in nonfinite_segments(&send, &fs.layout, fs.dev.as_deref())? {
                    flags[p] = true;
                }
            }
            let work = if s > 1 {
                let n = fs.shard_numel();
                self.ledger
                    .alloc(fsdp_planner::Category::Staging, rd.size_bytes() * n as u64);
                let recv = match &fs.dev {
                    None => OwnedBuf::zeros(rd, n),
                    Some(k) => OwnedBuf::Tensor(k.zeros(rd, n)?),
                };
                ReduceWork::Started(
                    self.comm
                        .start_reduce_scatter_sum(Group::Shard, send, recv)?,
                )
            } else if r > 1 {
                ReduceWork::Started(self.comm.start_all_reduce(
                    Group::Replicate,
                    ReduceOp::Sum,
                    send,
                )?)
            } else {
                ReduceWork::Local(send)
            };
            flats.push(FlatReduce { t, work, keep });
        }
        if !sync_last {
            // Moved into the reductions; the ledger frees them when they finish.
            unit.flat_grads.clear();
        }
        Ok(PendingReduce { unit: u, flats })
    }

    /// Finishes a reduction started by [`RankEngine::start_reduce`]: waits for it (exposed
    /// time), all-reduces the staging shard over the replicate group (hybrid sharding), adds
    /// it into the fp32 gradient shard (widening 16-bit values exactly) and frees the staging
    /// and send buffers (a persistent f32 buffer goes back to the unit).
    fn finish_reduce(&mut self, p: PendingReduce) -> Result<()> {
        let s = self.comm.group_size(Group::Shard);
        let r = self.comm.group_size(Group::Replicate);
        for fr in p.flats {
            let (mut reduced, send) = match fr.work {
                ReduceWork::Local(b) => (b, None),
                ReduceWork::Started(op) => {
                    let c = self.comm.wait(op)?;
                    (c.buf, c.send)
                }
            };
            if s > 1 && r > 1 {
                if reduced.tensor().is_none() {
                    self.comm
                        .all_reduce(Group::Replicate, ReduceOp::Sum, reduced.as_buf_mut())?;
                } else {
                    let op =
                        self.comm
                            .start_all_reduce(Group::Replicate, ReduceOp::Sum, reduced)?;
                    reduced = self.comm.wait(op)?.buf;
                }
            }
            let unit = &mut self.units[p.unit];
            let fs = unit
                .flats
                .iter_mut()
                .filter(|f| f.layout.trainable)
                .nth(fr.t)
                .expect("trainable flat index");
            fs.grad.accumulate(&reduced)?;
            let send = if s > 1 {
                self.ledger
                    .free(fsdp_planner::Category::Staging, owned_bytes(&reduced));
                drop(reduced);
                send.ok_or_else(|| {
                    EngineError::Config("reduce-scatter returned no send buffer".into())
                })?
            } else {
                reduced
            };
            if fr.keep {
                unit.flat_grads[fr.t] = send;
            } else {
                self.ledger
                    .free(fsdp_planner::Category::UnshardedGrads, owned_bytes(&send));
            }
        }
        Ok(())
    }

    /// The global gradient norm over every trainable real element of the model (padding
    /// excluded): local sums of squares (f64) summed over the shard group, or local max-abs
    /// maxed over it. Collective over the shard group. The L2 norm reuses the sum of squares
    /// that [`RankEngine::accumulate`] computed for its non-finite check while the gradients
    /// are unchanged (same value, one pass fewer).
    pub fn grad_norm(&mut self, norm: NormType) -> Result<f64> {
        let mut local = 0f64;
        match (norm, self.local_sum_squares) {
            (NormType::L2, Some(v)) => local = v,
            _ => {
                for f in self
                    .units
                    .iter()
                    .flat_map(|u| &u.flats)
                    .filter(|f| f.layout.trainable)
                {
                    match norm {
                        NormType::L2 => local += f.grad.sum_squares(&f.spans)?,
                        NormType::Inf => {
                            let m = f.grad.max_abs(&f.spans)? as f64;
                            local = if m.is_nan() || m > local { m } else { local };
                        }
                    }
                }
            }
        }
        let mut buf = [local];
        let op = match norm {
            NormType::L2 => ReduceOp::Sum,
            NormType::Inf => ReduceOp::Max,
        };
        self.comm
            .all_reduce(Group::Shard, op, BufMut::F64(&mut buf))?;
        Ok(match norm {
            NormType::L2 => buf[0].sqrt(),
            NormType::Inf => buf[0],
        })
    }

    /// The factor clipping multiplies the gradients by for a global `norm`: `None` when no
    /// clipping is needed (`max_norm / (norm + 1e-6) >= 1`), else the factor as f32, or an
    /// error when it is not a positive finite f32 (a non-finite norm, or a norm so large that
    /// the factor rounds to 0): clipping never multiplies by such a factor.
    fn clip_factor(
        &self,
        clip: Clip,
        norm: f64,
    ) -> std::result::Result<Option<f32>, NonFiniteReport> {
        let coef = clip.max_norm / (norm + 1e-6);
        if coef >= 1.0 {
            return Ok(None);
        }
        let c = coef as f32;
        if norm.is_finite() && c.is_finite() && c > 0.0 {
            Ok(Some(c))
        } else {
            Err(NonFiniteReport {
                step: self.step + 1,
                loss: f64::NAN,
                rank_losses: Vec::new(),
                params: Vec::new(),
                clip: Some((norm, clip.max_norm)),
            })
        }
    }

    /// Clips the gradient shards by the global norm (see [`Clip`]); returns the norm before
    /// clipping. Collective over the shard group.
    ///
    /// Errors: [`EngineError::Config`] for a `max_norm` that is not > 0;
    /// [`EngineError::NonFinite`] when the norm is not finite or the clip factor rounds to
    /// zero: the gradients are then left as they were (never multiplied by such a factor).
    pub fn clip_grad_norm(&mut self, clip: Clip) -> Result<f64> {
        check_max_norm(clip)?;
        let norm = self.grad_norm(clip.norm)?;
        match self.clip_factor(clip, norm) {
            Ok(Some(c)) => self.scale_grads(c)?,
            Ok(None) => {}
            Err(mut report) => {
                if !norm.is_finite() {
                    report.clip = None;
                    report.loss = norm;
                }
                return Err(EngineError::NonFinite(Box::new(report)));
            }
        }
        Ok(norm)
    }

    fn scale_grads(&mut self, c: f32) -> Result<()> {
        self.local_sum_squares = None;
        for f in self.units.iter_mut().flat_map(|u| u.flats.iter_mut()) {
            if f.layout.trainable {
                f.grad.scale(c)?;
            }
        }
        Ok(())
    }

    /// One optimizer step with learning rate `lr` on every trainable flat shard (spans from
    /// the plan: padding untouched, weight decay only on decayed spans), then zeroes the
    /// gradient shards. Frozen flat parameters are never touched.
    pub fn optimizer_step(&mut self, lr: f64) -> Result<()> {
        self.ledger.enter(Phase::OptimizerStep);
        let opt = self.cfg.optimizer.with_lr(lr);
        let step = self.step + 1;
        // AdamW's step counts updates made: skipped steps are not updates.
        let update = step - self.skipped;
        for f in self.units.iter_mut().flat_map(|u| u.flats.iter_mut()) {
            if f.layout.trainable {
                f.step(&opt, update)?;
            }
        }
        self.step = step;
        self.consecutive_skips = 0;
        self.zero_grad()
    }

    /// Sets every gradient shard to zero.
    ///
    /// Errors: a device kernel failure.
    pub fn zero_grad(&mut self) -> Result<()> {
        self.local_sum_squares = None;
        for f in self.units.iter_mut().flat_map(|u| u.flats.iter_mut()) {
            f.grad.zero()?;
        }
        Ok(())
    }

    /// One full training step: [`RankEngine::accumulate`], clipping (if configured),
    /// [`RankEngine::optimizer_step`]. Collective.
    ///
    /// A step whose gradient (any element, on any rank, before or after the reduction) or
    /// loss is not finite, or whose clip factor would round to zero, makes no update on any
    /// rank: under [`NonFinitePolicy::Skip`] (and f16 loss scaling) it is skipped and reported
    /// in [`StepStats::nonfinite`]; under [`NonFinitePolicy::Error`] it returns
    /// [`EngineError::NonFinite`] and the engine is as before the call (gradients zeroed, step
    /// count unchanged), so the caller may go on with the next step.
    ///
    /// Errors: as [`RankEngine::accumulate`]; [`EngineError::NonFinite`];
    /// [`EngineError::TooManySkipped`] when this skip is the
    /// [`EngineConfig::max_consecutive_skips`]-th in a row (the skip itself is recorded).
    pub fn train_step(&mut self, mbs: &[MicroBatch], lr: f64) -> Result<StepStats> {
        let t0 = Instant::now();
        self.comm.take_time();
        let loss_scale = self.scaler.map(|s| s.scale);
        let acc = self.accumulate(mbs)?;
        let mut grad_norm = None;
        let mut nonfinite = self.pending_nonfinite.take();
        if nonfinite.is_none() {
            if let Some(c) = self.cfg.clip {
                check_max_norm(c)?;
                let norm = self.grad_norm(c.norm)?;
                grad_norm = Some(norm);
                match self.clip_factor(c, norm) {
                    Ok(Some(f)) => self.scale_grads(f)?,
                    Ok(None) => {}
                    Err(mut report) => {
                        // The norm is identical on every rank: all decide alike.
                        report.loss = acc.loss;
                        self.discard_gradients()?;
                        if !self.skip_nonfinite {
                            return Err(EngineError::NonFinite(Box::new(report)));
                        }
                        nonfinite = Some(report);
                    }
                }
            }
        }
        let skipped = nonfinite.is_some();
        if let Some(sc) = self.scaler.as_mut() {
            sc.update(skipped);
        }
        if skipped {
            // No update: the step still counts for the data position and checkpoint
            // numbering, not for AdamW's bias correction or the learning-rate schedule.
            self.ledger.enter(Phase::OptimizerStep);
            self.step += 1;
            self.skipped += 1;
            self.consecutive_skips += 1;
            if let Some(max) = self.cfg.max_consecutive_skips {
                if self.consecutive_skips >= max {
                    return Err(EngineError::TooManySkipped {
                        step: self.step,
                        skipped: self.consecutive_skips,
                        last: nonfinite.map(|r| r.to_string()).unwrap_or_default(),
                    });
                }
            }
        } else {
            self.optimizer_step(lr)?;
        }
        // On a device the step is done when the device is: the clock reads after it.
        if let Some(k) = &self.dev {
            k.synchronize()?;
        }
        let (comm, calls) = self.comm.take_time();
        Ok(StepStats {
            step: self.step,
            loss: acc.loss,
            tokens: acc.tokens,
            grad_norm,
            lr,
            step_seconds: t0.elapsed().as_secs_f64(),
            comm_exposed_seconds: comm.as_secs_f64(),
            comm_calls: calls,
            loss_scale,
            skipped,
            nonfinite,
            ledger: [
                self.ledger.peak(Phase::Forward),
                self.ledger.peak(Phase::Backward),
                self.ledger.peak(Phase::OptimizerStep),
            ],
        })
    }

    /// Forward only over `mbs` (no graph, no gradients) under the plan's forward schedule;
    /// returns the world's (loss sum, contributing tokens). Collective.
    pub fn eval(&mut self, mbs: &[MicroBatch]) -> Result<(f64, u64)> {
        let all = self.comm.all_gather_f64(&[mbs.len() as f64])?;
        check_counts(&all, "number of validation batches", "batches")?;
        let m = self.stage_units.len();
        let mut sum = 0f64;
        let mut count = 0u64;
        for mb in mbs {
            let on_device;
            let mb = match &self.placement {
                Placement::Host => mb,
                Placement::Device(d) => {
                    on_device = mb.to_device(d)?;
                    &on_device
                }
            };
            let mut x = mb.input.clone();
            for s in 0..m {
                let u = self.stage_units[s];
                let st = &self.plan.schedule.forward[s];
                self.transition_to(&st.alive, Some(u), &st.prefetch)?;
                let params = &self.units[u].plain;
                if s + 1 == m {
                    let l = self.model.loss(params, &x, mb)?;
                    sum += l.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
                } else {
                    x = self.model.forward(s, params, &x)?;
                }
            }
            count += mb.count;
        }
        self.transition_to(&[], None, &[])?;
        let mut buf = [sum, count as f64];
        self.comm
            .all_reduce(Group::World, ReduceOp::Sum, BufMut::F64(&mut buf))?;
        Ok((buf[0], buf[1] as u64))
    }

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

    /// A barrier that also exchanges one status value per rank: all-gathers `status` over the
    /// world and returns `[rank]`. The checkpoint hooks call it between save phases so that
    /// every rank (thread or process) knows whether every other rank succeeded.
    ///
    /// Errors: [`EngineError::Comm`] when a rank fails or does not arrive in time.
    pub fn barrier_with_status(&mut self, status: f64) -> Result<Vec<f64>> {
        Ok(self
            .comm
            .all_gather_f64(&[status])?
            .into_iter()
            .map(|v| v[0])
            .collect())
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

/// Whether every element of an unsharded gradient buffer (a rank's contribution to a
/// reduction, padding included: padding is zero) is finite. On a device an f32 buffer is
/// checked there (one scalar comes back); a 16-bit one is copied to the host first.
fn contribution_is_finite(buf: &OwnedBuf, dev: Option<&TensorKernels>) -> Result<bool> {
    Ok(match buf {
        OwnedBuf::F32(v) => fsdp_kernels::first_nonfinite(v).is_none(),
        OwnedBuf::BF16(v) => fsdp_kernels::first_nonfinite_bf16(v).is_none(),
        OwnedBuf::F16(v) => fsdp_kernels::first_nonfinite_f16(v).is_none(),
        OwnedBuf::F64(v) => v.iter().all(|x| x.is_finite()),
        OwnedBuf::Tensor(t) => {
            let k = dev.ok_or_else(|| {
                EngineError::Config("a gradient tensor without the device's kernels".into())
            })?;
            if t.dtype() == candle_core::DType::F32 {
                let n = t.elem_count();
                k.max_abs(t, &[fsdp_kernels::Span::new(0, n, false)])?
                    .is_finite()
            } else {
                fsdp_kernels::first_nonfinite(&k.to_f32(t)?).is_none()
            }
        }
    })
}

/// The parameter indices (declaration order in the unit) of the segments of `layout` whose
/// elements in the unsharded buffer `buf` are not all finite.
fn nonfinite_segments(
    buf: &OwnedBuf,
    layout: &fsdp_planner::FlatParamLayout,
    dev: Option<&TensorKernels>,
) -> Result<Vec<usize>> {
    // Only on the non-finite path: a widened host copy keeps this one loop for every dtype.
    let values: Vec<f64> = match buf {
        OwnedBuf::F32(v) => v.iter().map(|&x| x as f64).collect(),
        OwnedBuf::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
        OwnedBuf::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
        OwnedBuf::F64(v) => v.clone(),
        OwnedBuf::Tensor(t) => {
            let k = dev.ok_or_else(|| {
                EngineError::Config("a gradient tensor without the device's kernels".into())
            })?;
            k.to_f32(t)?.into_iter().map(|x| x as f64).collect()
        }
    };
    Ok(layout
        .segments
        .iter()
        .filter(|seg| {
            let r = seg.range();
            !values[r.start as usize..r.end as usize]
                .iter()
                .all(|x| x.is_finite())
        })
        .map(|seg| seg.param_index)
        .collect())
}

fn check_max_norm(clip: Clip) -> Result<()> {
    if clip.max_norm.is_nan() || clip.max_norm <= 0.0 || clip.max_norm.is_infinite() {
        return Err(EngineError::Config(format!(
            "max_norm must be a finite number > 0, got {}",
            clip.max_norm
        )));
    }
    Ok(())
}

fn check_counts(all: &[Vec<f64>], what: &'static str, unit: &str) -> Result<()> {
    let first = all[0][0];
    if all.iter().all(|v| v[0] == first) {
        return Ok(());
    }
    // Name the odd ranks against the most common count.
    let mut counts: Vec<(u64, usize)> = Vec::new();
    for v in all {
        let c = v[0] as u64;
        match counts.iter_mut().find(|(x, _)| *x == c) {
            Some(e) => e.1 += 1,
            None => counts.push((c, 1)),
        }
    }
    let common = counts
        .iter()
        .max_by_key(|(_, n)| *n)
        .map(|(c, _)| *c)
        .unwrap_or(0);
    let odd: Vec<String> = all
        .iter()
        .enumerate()
        .filter(|(_, v)| v[0] as u64 != common)
        .map(|(r, v)| format!("rank {r}: {} {unit}", v[0] as u64))
        .collect();
    Err(EngineError::RankMismatch {
        what,
        detail: format!("{}, others: {common}", odd.join(", ")),
    })
}

/// Reads a 0-dim or 1-element f32 tensor (helper for tests and drivers).
pub fn scalar_f32(t: &Tensor) -> Result<f32> {
    with_f32(t, |x| x[0])
}

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
//!
//! The module follows one step's data flow, one job per file: [`RankEngine`] itself
//! (construction, accessors, [`RankEngine::train_step`]) lives here; `config` holds the
//! settings, `accumulate` steps 1 and 4 around the micro-batches, `unshard` the unshard and
//! prefetch schedule, `forward_backward` one micro-batch (steps 2 and 3), `reduce` the
//! gradient reductions, `nonfinite` the non-finite checks and report, `clip` the norm,
//! clipping and the f16 loss scaler, `optim_step` the optimizer step, `eval` the forward-only
//! evaluation and `state` the checkpoint state export and import.

mod accumulate;
mod clip;
mod config;
mod eval;
mod forward_backward;
mod nonfinite;
mod optim_step;
mod reduce;
mod state;
mod unshard;

pub use accumulate::Accumulated;
pub use clip::LossScaler;
pub use config::{Clip, EngineConfig, InitSync, NonFinitePolicy, NormType};
pub use nonfinite::{NonFiniteParam, NonFiniteReport};
pub use state::{FlatShardState, NonFiniteShard, RankState, ShardFill};

use crate::error::{EngineError, Result};
use crate::init::{FullValues, ParamSource};
use crate::memory::{MemoryLedger, PhasePeak};
use crate::runtime::collectives::{f64_chunks_to_u64, u64_to_f64_chunks, Collectives};
use crate::runtime::init_shards::init_shards;
use crate::runtime::offload::HostStaging;
use crate::runtime::staged::{MicroBatch, StagedModel};
use crate::runtime::unit::{with_f32, FsdpUnit, OffloadInit, Placement, UnitInit};
use candle_core::Tensor;
use clip::check_max_norm;
use fsdp_comm::Communicator;
use fsdp_kernels::tensor::TensorKernels;
use fsdp_planner::{Offload, Phase, ShardPlan};
use fsdp_types::DType;
use serde::Serialize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    /// The host ledger of an offloaded rank (master, gradient and optimizer-state shards, the
    /// staging buffers); empty without offload.
    host_ledger: MemoryLedger,
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

impl<'a, M: StagedModel + ?Sized> RankEngine<'a, M> {
    /// Builds the engine of `comm`'s rank: checks that the plan fits the communicator and the
    /// model, compares the plan fingerprint with rank 0's, makes the initial weights identical
    /// on every rank (`cfg.init_sync`) and keeps this rank's shards.
    ///
    /// `init` is `[unit][non-tied param][element]` (see [`StagedModel::init_params`]).
    ///
    /// Errors: [`EngineError::Config`] (world size, shard size, dtypes, optimizer or stages
    /// differ from the plan; wrong init sizes; an offloading plan on the host placement), [`EngineError::RankMismatch`] (fingerprint or
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
        let offload = plan.config.offload_mode();
        if offload.is_some() && matches!(placement, Placement::Host) {
            return Err(EngineError::Config(format!(
                "the plan offloads with --offload {offload}, which moves state from a compute device to host memory, but this rank computes on the host placement; compute on a device (Placement::Device; `fsdp train --device cpu --offload ...` uses the CPU device) or plan without offload"
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
        let mut host_ledger = MemoryLedger::new();
        let offload = plan.config.offload_mode();
        let staging = offload
            .is_some()
            .then(|| Arc::new(Mutex::new(HostStaging::new(plan, &mut host_ledger))));
        // The offloaded optimizer step's threads: the rank's share of the machine.
        let threads = rayon::current_num_threads().max(1);
        let mut units = Vec::with_capacity(spec.units.len());
        let mut shards_iter = shards.into_iter();
        for (u, (us, ul)) in spec.units.iter().zip(&plan.units).enumerate() {
            let init = UnitInit {
                index: u,
                spec: us,
                layout: ul,
                shards: shards_iter.next().expect("one shard list per unit"),
                shard_index: shard_index as u64,
                state_buffers: cfg.optimizer.state_buffers(),
                param_dtype: plan.config.param_dtype,
                dev: dev.as_ref(),
                offload: staging.as_ref().map(|st| OffloadInit {
                    device_shard: offload == Offload::Optimizer,
                    staging: st.clone(),
                    threads,
                    host: &mut host_ledger,
                }),
            };
            units.push(FsdpUnit::new(init, &mut ledger)?);
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
            host_ledger,
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

    /// The memory ledger of the compute device (or of the host placement): live bytes and
    /// per-phase peaks.
    pub fn ledger(&self) -> &MemoryLedger {
        &self.ledger
    }

    /// The host ledger of an offloaded rank: the bytes the plan counts in host memory beside
    /// the device ([`fsdp_planner::MemoryPlan::host_peak`]); empty without offload.
    pub fn host_ledger(&self) -> &MemoryLedger {
        &self.host_ledger
    }

    /// Enters `phase` in both ledgers.
    pub(crate) fn enter_phase(&mut self, phase: fsdp_planner::Phase) {
        self.ledger.enter(phase);
        self.host_ledger.enter(phase);
    }

    /// Starts new per-phase peaks in both ledgers (at the start of a step).
    pub(crate) fn reset_ledger_peaks(&mut self) {
        self.ledger.reset_peaks();
        self.host_ledger.reset_peaks();
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

    /// Starts recording this rank's trace (`fsdp train --trace`): each unit's forward,
    /// recompute and backward and the optimizer step on the compute track, each collective
    /// from issue to completion on the communication track, and the compute thread's waits.
    pub fn set_tracer(&mut self, tracer: crate::trace::Tracer) {
        self.comm.set_tracer(Some(tracer));
    }

    /// The spans recorded since the last call (none when not tracing).
    pub fn take_trace_spans(&mut self) -> Vec<crate::trace::TraceSpan> {
        self.comm
            .tracer_mut()
            .map(|t| t.take_spans())
            .unwrap_or_default()
    }

    /// The clock of a compute span: `Some(now)` only when tracing.
    pub(super) fn trace_clock(&self) -> Option<Instant> {
        self.comm.is_tracing().then(Instant::now)
    }

    /// Records a compute span of schedule stage `stage` (unit `unit`) begun at `start` (from
    /// [`RankEngine::trace_clock`]), named `what` and the stage's label.
    pub(super) fn trace_compute(
        &mut self,
        start: Option<Instant>,
        kind: fsdp_planner::time::SpanKind,
        what: &str,
        stage: usize,
        unit: usize,
    ) {
        if let Some(t) = start {
            let label = &self.plan.schedule.forward[stage].label;
            if let Some(tr) = self.comm.tracer_mut() {
                tr.record(
                    fsdp_planner::time::Track::Compute,
                    kind,
                    format!("{what} {label}"),
                    Some(unit),
                    t,
                    Instant::now(),
                    None,
                );
            }
        }
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
        let step = self.step + 1;
        if let Some(tr) = self.comm.tracer_mut() {
            tr.step = step;
        }
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
            self.enter_phase(Phase::OptimizerStep);
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

//! The training driver behind `fsdp train`: plans the run, starts one thread per rank on the
//! thread backend, feeds each rank its micro-batches from the distributed sampler, runs the
//! engine step by step with a warmup + cosine learning rate, evaluates, and reports metrics and
//! memory (ledger against the plan, and the process peak from the counting allocator).
//!
//! Threads: `W` rank threads share the machine's cores; each rank runs its compute inside its
//! own rayon pool of `max(1, cores / W)` threads (candle's matmul and kernels use the current
//! rayon pool), so `W` ranks never oversubscribe the cores.

use crate::data::{Batch, Sampler, SamplerConfig, StreamOrigin, TextData, TokenSource};
use crate::error::{EngineError, Result};
use crate::init::{FileWeights, ParamSource};
use crate::memory::{CountingAllocator, PhasePeak, PHASES};
use crate::model::decoder::Decoder;
use crate::optim::{AdamWConfig, LrSchedule, Optimizer};
use crate::run::PreparedRun;
use crate::runtime::{Clip, EngineConfig, InitSync, MicroBatch, NormType, RankEngine, StagedModel};
use candle_core::Device;
use fsdp_comm::{run_threads, CommError, Communicator, Topology, DEFAULT_TIMEOUT};
use fsdp_planner::{plan, ShardPlan};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

/// The options, model and auto search of a run, defined in the stages before the driver
/// ([`crate::options`], [`crate::strategy`]) and re-exported here, where callers of the
/// driver have always found them.
pub use crate::options::{
    check_seq_len, model_of, plan_config, validate, TrainOptions, BYTE_VOCAB, DEFAULT_MAX_SKIPPED,
};
pub use crate::strategy::{resolve_auto, search_auto, AutoChoice};

/// Hooks the checkpoint layer plugs into the training loop. Every method is called on every
/// rank at the same point (so implementations may use collectives through the engine).
pub trait TrainHooks: Sync {
    /// Before the first step: imports the state to resume into `rank`'s `engine` and returns
    /// the 0-based step to continue from (`None`: start fresh at step 0). The data position is
    /// [`TrainHooks::stream_origin`].
    fn resume(&self, _rank: usize, _engine: &mut RankEngine<'_, Decoder>) -> Result<Option<u64>> {
        Ok(None)
    }

    /// Where the run starts in the training stream, the same on every rank: the resumed
    /// checkpoint's step and count of consumed sequences ([`StreamOrigin::START`] for a fresh
    /// run). A resume's step must equal its origin's step.
    fn stream_origin(&self) -> StreamOrigin {
        StreamOrigin::START
    }

    /// After optimizer step `step` (1-based) on `rank`. `stop`: every rank agreed that the run
    /// stops after this step ([`TrainHooks::stop_requested`]) although steps remain; a
    /// checkpoint hook saves this step then, due or not (once: the same call also saves a due
    /// step).
    fn after_step(
        &self,
        _rank: usize,
        _step: u64,
        _engine: &mut RankEngine<'_, Decoder>,
        _stop: bool,
    ) -> Result<()> {
        Ok(())
    }

    /// Whether this rank asks the run to stop: 0 for no, any other code for yes (`fsdp
    /// train`: the number of the signal received). Asked on every rank before the first step
    /// and after every step but the last; the ranks' answers are all-gathered (one value per
    /// rank), and when any rank asks, every rank stops at that same step boundary — after the
    /// step, with [`TrainHooks::after_step`]'s `stop` set, or before the first step without
    /// training — and [`TrainReport::stopped`] holds the lowest asking rank's code.
    fn stop_requested(&self) -> u32 {
        0
    }
}

/// No hooks.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHooks;
impl TrainHooks for NoHooks {}

/// One line of training progress (rank 0's view; loss and tokens are global).
#[derive(Debug, Clone, Serialize)]
pub struct StepReport {
    /// 1-based optimizer step.
    pub step: u64,
    /// World mean training loss (nats per token).
    pub loss: f64,
    /// Learning rate of the step.
    pub lr: f64,
    /// Gradient L2 norm before clipping (when clipping is on).
    pub grad_norm: Option<f64>,
    /// Global tokens of the step.
    pub tokens: u64,
    /// Global tokens per second of this step.
    pub tokens_per_s: f64,
    /// Wall time of the step (seconds).
    pub step_seconds: f64,
    /// Rank 0's exposed communication time (seconds): blocked in collectives, not hidden
    /// behind compute by prefetching.
    pub comm_exposed_seconds: f64,
    /// f16 dynamic loss scale used in the step (`None` unless param_dtype is f16).
    pub loss_scale: Option<f64>,
    /// The step was skipped: a gradient or the loss was not finite (f16 overflows
    /// included); no update was made and the learning-rate schedule did not advance.
    pub skipped: bool,
    /// What was not finite in a skipped step (parameters, ranks, loss), as one line.
    pub nonfinite: Option<String>,
    /// Rank 0's engine-owned live bytes after the step.
    pub live_bytes: u64,
    /// Process heap bytes now (all ranks), if a counting allocator is installed.
    pub process_bytes: Option<u64>,
    /// Validation loss, when evaluated at this step.
    pub val_loss: Option<f64>,
}

/// Measured against planned bytes of one category in one phase, on one rank.
#[derive(Debug, Clone, Serialize)]
pub struct CategoryReport {
    /// Phase name.
    pub phase: &'static str,
    /// Category name.
    pub category: &'static str,
    /// Largest live bytes measured by the ledger in the phase.
    pub measured: u64,
    /// The plan's per-category maximum in the phase.
    pub planned: u64,
}

/// The end-of-run summary.
#[derive(Debug, Clone, Serialize)]
pub struct TrainReport {
    /// Model preset and parameter count.
    pub model: String,
    /// Parameters (tied once).
    pub params: u64,
    /// Data source name.
    pub data: String,
    /// World size, shard and replicate group sizes.
    pub world_size: usize,
    /// Shard-group size.
    pub shard_size: u64,
    /// Strategy executed.
    pub strategy: String,
    /// Whether units recompute their forward in backward (unit-level activation checkpointing,
    /// the plan's resolved setting).
    pub activation_checkpointing: bool,
    /// Precision in use: compute (param_dtype), reduction dtype and its accumulation dtype,
    /// master weights, loss scaling.
    pub precision: String,
    /// Rank 0's exposed communication time over all steps (seconds).
    pub comm_exposed_seconds: f64,
    /// Steps skipped in this run (non-finite gradients or loss, f16 overflows included; no
    /// update).
    pub skipped_steps: u64,
    /// Every step's report (rank 0).
    pub steps: Vec<StepReport>,
    /// Mean training loss of the last min(10, steps) steps.
    pub final_train_loss: f64,
    /// Validation loss at the end.
    pub final_val_loss: f64,
    /// Global tokens per second over the whole run (setup excluded).
    pub tokens_per_s: f64,
    /// Wall time of the training loop (seconds).
    pub seconds: f64,
    /// Per rank, per phase, per category: measured ledger bytes against the plan.
    pub memory: Vec<Vec<CategoryReport>>,
    /// The plan's peak bytes per rank (all categories, activations estimated).
    pub plan_peak_per_rank: u64,
    /// Per rank (this process's ranks, in rank order): the most engine-owned bytes the ledger
    /// measured live at once during training (its categories, any phase; no activations).
    pub measured_peak_per_rank: Vec<u64>,
    /// The plan's most engine-owned bytes at one schedule position (the ledger's categories,
    /// activations excluded): what `measured_peak_per_rank` is held against.
    pub plan_engine_peak_per_rank: u64,
    /// Per rank (as `measured_peak_per_rank`): the bytes the host ledger holds under offload
    /// (master, gradient and optimizer-state shards, staging buffers); 0 without offload.
    pub host_peak_per_rank: Vec<u64>,
    /// The plan's host bytes per rank ([`fsdp_planner::MemoryPlan::host_peak`]; 0 without
    /// offload).
    pub plan_host_peak_per_rank: u64,
    /// Process heap peak during training minus the heap before the engines were built.
    pub process_peak: Option<u64>,
    /// On a CUDA device: the plan's peak bytes per rank against the largest measured device
    /// peak of this process's ranks (`None` on the host).
    pub device_memory: Option<DeviceMemoryReport>,
    /// Plan fingerprint.
    pub fingerprint: String,
    /// The run stopped early because a rank asked to ([`TrainHooks::stop_requested`]);
    /// `None` when it ran every step.
    pub stopped: Option<EarlyStop>,
    /// The process's thread pools and the most threads it held at the end of a step.
    pub threads: crate::threads::ThreadReport,
}

/// Where and why a run stopped before its last step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct EarlyStop {
    /// The last step completed (1-based; the resumed step, or 0, when the run stopped before
    /// its first step).
    pub after_step: u64,
    /// The lowest asking rank's [`TrainHooks::stop_requested`] code (`fsdp train`: the
    /// signal number).
    pub code: u32,
}

/// A rank's device memory: the plan's peak against the measured peak (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct DeviceMemoryReport {
    /// The plan's peak bytes per rank (every category, activations estimated for the ops path
    /// the device runs).
    pub plan_bytes: u64,
    /// The most device bytes allocated at once during the training loop (the device's
    /// allocation pool; see `fsdp_kernels::tensor::TensorKernels::memory`).
    pub measured_peak_bytes: u64,
}

/// The tensors of a sampler batch, on the host.
pub(crate) fn to_micro_batch(b: &Batch) -> Result<MicroBatch> {
    let (input, target) = b.to_tensors(&Device::Cpu)?;
    Ok(MicroBatch {
        input,
        target,
        count: b.tokens() as u64,
    })
}

/// Trains the model of `o` ([`model_of`]: a GPT or a Llama-family decoder) on `o.data` with `o.world_size` rank threads. `progress` receives every
/// step's report from rank 0 as it happens; `alloc` is the process's counting allocator, if
/// installed; `hooks` lets checkpoints save and resume.
///
/// Errors: [`EngineError::Config`] / [`EngineError::Plan`] / [`EngineError::Data`] for bad
/// options (before any rank starts), and any run failure of a rank (the first rank's error in
/// rank order): non-finite loss, memory over plan, collective failures.
pub fn train(
    o: &TrainOptions,
    alloc: Option<&'static CountingAllocator>,
    hooks: &dyn TrainHooks,
    progress: &(dyn Fn(&StepReport) + Sync),
) -> Result<TrainReport> {
    train_with(o, alloc, hooks, progress, None)
}

/// Builds this process's communicator for the run's topology (world = shard x replicate, from
/// the plan); used when the process is one rank of a multi-process job (MPI).
pub type CommFactory<'a> =
    &'a dyn Fn(Topology) -> std::result::Result<Box<dyn Communicator>, CommError>;

/// As [`train`]; with `process_rank = Some(factory)` this process runs as ONE rank (its rank
/// and world size are the communicator's; `o.world_size` must equal that world size) instead of
/// `o.world_size` rank threads. Everything else (plan, sampler, engine) is identical, so the
/// same options give the same losses on either backend. The report holds this rank's view: its
/// memory rows only, the steps and losses as rank 0 sees them on rank 0.
///
/// Errors: as [`train`]; [`EngineError::Config`] when the communicator's world does not match
/// `o.world_size` or the plan's topology; [`EngineError::CommSetup`] when it cannot be built.
pub fn train_with(
    o: &TrainOptions,
    alloc: Option<&'static CountingAllocator>,
    hooks: &dyn TrainHooks,
    progress: &(dyn Fn(&StepReport) + Sync),
    process_rank: Option<CommFactory<'_>>,
) -> Result<TrainReport> {
    validate(o)?;
    let model = model_of(o)?;
    let plan: ShardPlan = plan(model.spec(), &plan_config(o))?;
    let run = PreparedRun {
        options: o.clone(),
        model,
        plan,
        auto: None,
    };
    train_prepared(&run, alloc, hooks, progress, process_rank)
}

/// Executes a prepared run ([`crate::run::prepare`]): its model and its plan, computed once
/// before, under its options; otherwise as [`train_with`].
///
/// Errors: as [`train_with`].
pub fn train_prepared(
    run: &PreparedRun,
    alloc: Option<&'static CountingAllocator>,
    hooks: &dyn TrainHooks,
    progress: &(dyn Fn(&StepReport) + Sync),
    process_rank: Option<CommFactory<'_>>,
) -> Result<TrainReport> {
    let PreparedRun {
        options: o,
        model,
        plan,
        ..
    } = run;
    if process_rank.is_none() && o.world_size > 1 && o.placement.device().is_cuda() {
        return Err(EngineError::Config(format!(
            "--device cuda with {} rank threads: the thread backend cannot reach GPU memory; start one process per GPU with `fsdp launch --nproc {} -- train --device cuda --backend nccl ...`",
            o.world_size, o.world_size
        )));
    }
    let text = match &o.data {
        Some(p) => TokenSource::open(p).map_err(|e| EngineError::Data(e.to_string()))?,
        None => TextData::embedded().into(),
    };
    text.check_vocab(model.name(), model.vocab_size())
        .map_err(|e| EngineError::Data(e.to_string()))?;
    let data_name = text.name().to_string();
    let sampler = Sampler::new(
        text,
        SamplerConfig {
            seq_len: o.seq_len,
            micro_batch: o.micro_batch,
            grad_accum: o.grad_accum,
            world_size: o.world_size,
            seed: o.seed,
        },
    )
    .map_err(|e| EngineError::Data(e.to_string()))?
    .with_origin(hooks.stream_origin());
    let init: Box<dyn ParamSource> = match &o.init_from {
        Some(p) => Box::new(
            FileWeights::open(p, model.spec())
                .map_err(|source| EngineError::InitFiles { source })?,
        ),
        None => Box::new(model.random_init(o.seed)),
    };
    let s = plan.shard_size as usize;
    let topo =
        Topology::new(s, o.world_size / s).map_err(|e| EngineError::Config(e.to_string()))?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = o.threads_per_rank.unwrap_or((cores / o.world_size).max(1));
    let ecfg = EngineConfig {
        optimizer: Optimizer::AdamW(AdamWConfig {
            lr: o.lr,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: o.weight_decay,
        }),
        clip: o.clip.map(|max_norm| Clip {
            max_norm,
            norm: NormType::L2,
        }),
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: o.nonfinite,
        max_consecutive_skips: o.max_skipped,
    };
    let sched = LrSchedule {
        peak: o.lr,
        min: o.min_lr,
        warmup: o.warmup,
        total: o.steps,
    };
    let heap_before = alloc.map(|a| {
        a.reset_peak();
        a.current()
    });
    let t_start = Instant::now();
    let ctx = RankContext {
        t_start,
        model,
        plan,
        ecfg,
        init: &*init,
        sampler: &sampler,
        o,
        sched: &sched,
        alloc,
        hooks,
        progress,
    };
    let ctx = &ctx;
    let body = |comm: Box<dyn Communicator>| -> Result<RankOutcome> {
        let rank = comm.rank();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("rank{rank}-compute{i}"))
            .build()
            .map_err(|e| EngineError::Config(format!("thread pool: {e}")))?;
        pool.install(move || run_rank(ctx, &*comm))
    };
    let one_process_rank = process_rank.is_some();
    let results: Vec<std::result::Result<Result<RankOutcome>, CommError>> = match process_rank {
        None => run_threads(topo, DEFAULT_TIMEOUT, |comm| body(Box::new(comm))),
        Some(factory) => {
            let comm = factory(topo).map_err(|source| EngineError::CommSetup {
                topology: topo.to_string(),
                source: Box::new(source),
            })?;
            if comm.topology() != topo {
                return Err(EngineError::Config(format!(
                    "the communicator's world ({}) is not the plan's ({topo})",
                    comm.topology()
                )));
            }
            vec![Ok(body(comm))]
        }
    };
    let seconds = t_start.elapsed().as_secs_f64();
    let mut outcomes = rank_outcomes(results)?;
    if let Some(path) = &o.trace {
        write_run_trace(path, &mut outcomes, o.world_size as u64, one_process_rank)?;
    }
    let r0 = &outcomes[0];
    let tail = r0.steps.len().clamp(1, 10);
    let final_train_loss = r0
        .steps
        .iter()
        .rev()
        .take(tail)
        .map(|s| s.loss)
        .sum::<f64>()
        / tail as f64;
    let tokens: u64 = r0.steps.iter().map(|s| s.tokens).sum();
    let loop_seconds: f64 = r0.steps.iter().map(|s| s.step_seconds).sum();
    let device_memory = outcomes
        .iter()
        .filter_map(|x| x.device_peak)
        .max()
        .map(|m| DeviceMemoryReport {
            plan_bytes: plan.memory.peak.0,
            measured_peak_bytes: m,
        });
    let memory = outcomes
        .iter()
        .map(|x| {
            let mut v = Vec::new();
            for (i, ph) in PHASES.iter().enumerate() {
                let planned = plan.memory.phase(*ph).max;
                for c in crate::memory::LEDGER_CATEGORIES {
                    v.push(CategoryReport {
                        phase: ph.name(),
                        category: c.name(),
                        measured: x.peaks[i].max.get(c).0,
                        planned: planned.get(c).0,
                    });
                }
            }
            v
        })
        .collect();
    let measured_peak_per_rank = outcomes
        .iter()
        .map(|x| x.peaks.iter().map(|p| p.peak_total.0).max().unwrap_or(0))
        .collect();
    let host_peak_per_rank = outcomes.iter().map(|x| x.host_peak).collect();
    // Every rank stopped at the same agreed step.
    let stopped = outcomes[0].stopped;
    // The pools as this run sized them, with rank 0's count of the threads the process held.
    let mut threads = crate::threads::ThreadReport::configured(
        if one_process_rank { 1 } else { o.world_size },
        threads,
    );
    threads.live_peak = outcomes[0].threads.live_peak;
    threads.live_by_name = outcomes[0].threads.live_by_name.clone();
    Ok(TrainReport {
        model: model.name().to_string(),
        params: model.spec().numel().0,
        data: data_name,
        world_size: o.world_size,
        shard_size: plan.shard_size,
        strategy: plan.strategy.to_string(),
        activation_checkpointing: plan.schedule.activation_checkpointing,
        precision: format!(
            "compute {}, reduce {} (accumulated in f32), master weights f32{}",
            plan.config.param_dtype,
            plan.config.reduce_dtype,
            if plan.config.param_dtype == fsdp_types::DType::F16 {
                ", dynamic loss scaling"
            } else {
                ""
            }
        ),
        comm_exposed_seconds: outcomes[0]
            .steps
            .iter()
            .map(|s| s.comm_exposed_seconds)
            .sum(),
        skipped_steps: outcomes[0].steps.iter().filter(|s| s.skipped).count() as u64,
        final_train_loss,
        final_val_loss: r0.val_loss,
        tokens_per_s: tokens as f64 / loop_seconds.max(1e-9),
        seconds,
        steps: outcomes.swap_remove(0).steps,
        memory,
        plan_peak_per_rank: plan.memory.peak.0,
        measured_peak_per_rank,
        host_peak_per_rank,
        plan_host_peak_per_rank: plan.memory.host_peak.0,
        plan_engine_peak_per_rank: plan
            .memory
            .timeline
            .iter()
            .map(|t| (t.bytes.total() - t.bytes.activations).0)
            .max()
            .unwrap_or(0),
        process_peak: alloc
            .zip(heap_before)
            .map(|(a, b)| a.peak().saturating_sub(b)),
        device_memory,
        fingerprint: plan.fingerprint().to_string(),
        stopped,
        threads,
    })
}

/// Writes the ranks' trace spans of a run to `path` (a process rank R > 0 of a multi-process
/// job to `path.rankR`).
fn write_run_trace(
    path: &std::path::Path,
    outcomes: &mut [RankOutcome],
    world_size: u64,
    one_process_rank: bool,
) -> Result<()> {
    let spans: Vec<crate::trace::TraceSpan> = outcomes
        .iter_mut()
        .flat_map(|x| std::mem::take(&mut x.trace))
        .collect();
    let doc = if one_process_rank {
        let rank = outcomes.first().map_or(0, |x| x.rank);
        crate::trace::chrome_trace(&spans, [rank], |r| format!("rank {r}"))
    } else {
        crate::trace::measured_trace(&spans, world_size)
    };
    let target = match outcomes.first().map(|x| x.rank) {
        Some(r) if one_process_rank && r > 0 => {
            let mut p = path.as_os_str().to_owned();
            p.push(format!(".rank{r}"));
            PathBuf::from(p)
        }
        _ => path.to_path_buf(),
    };
    crate::trace::write_trace(&target, &doc)
        .map_err(|e| EngineError::Config(format!("--trace: {e}")))
}

struct RankOutcome {
    /// The rank.
    rank: u64,
    /// Its trace spans (`--trace`; empty without it).
    trace: Vec<crate::trace::TraceSpan>,
    steps: Vec<StepReport>,
    val_loss: f64,
    peaks: [PhasePeak; 3],
    /// Peak device bytes during the training loop (a CUDA placement only).
    device_peak: Option<u64>,
    /// Bytes of the host ledger (offload; 0 without it).
    host_peak: u64,
    /// Where the ranks agreed to stop early, if they did.
    stopped: Option<EarlyStop>,
    /// Rank 0: the process's threads counted after each step (others: no count).
    threads: crate::threads::ThreadReport,
}

/// What every rank of a run shares: the model, the plan, the engine configuration, the
/// initial values, the sampler, the options and schedule, and the run's callbacks.
struct RankContext<'a> {
    /// The run's start: the origin of every rank's trace.
    t_start: Instant,
    model: &'a Decoder,
    plan: &'a ShardPlan,
    ecfg: EngineConfig,
    init: &'a dyn ParamSource,
    sampler: &'a Sampler,
    o: &'a TrainOptions,
    sched: &'a LrSchedule,
    alloc: Option<&'static CountingAllocator>,
    hooks: &'a dyn TrainHooks,
    progress: &'a (dyn Fn(&StepReport) + Sync),
}

/// Trains one rank over `comm` from `ctx`'s start (or its hooks' resume) to the last step.
fn run_rank(ctx: &RankContext<'_>, comm: &dyn Communicator) -> Result<RankOutcome> {
    let RankContext {
        t_start,
        model,
        plan,
        ecfg,
        init,
        sampler,
        o,
        sched,
        alloc,
        hooks,
        progress,
    } = *ctx;
    let mut e = RankEngine::new_from(model, plan, comm, ecfg, init, o.placement.clone())?;
    let rank = e.rank();
    let mut start = 0u64;
    if let Some(next) = hooks.resume(rank, &mut e)? {
        start = next;
    }
    if start != sampler.origin().step {
        return Err(EngineError::State(format!(
            "rank {rank} resumes at step {start} but the data stream starts at step {}",
            sampler.origin().step
        )));
    }
    // Every rank trains the same number of steps; say so loudly if not (instead of hanging).
    e.check_batch_counts((o.steps - start.min(o.steps)) * o.grad_accum as u64)?;
    let data_err = |e: crate::data::DataError| EngineError::Data(format!("rank {rank}: {e}"));
    // The validation batches: the first `--eval-batches N` global batches of the split (0:
    // all), batch `v` on rank `v % W`, so every world size evaluates the same windows.
    let w = o.world_size.max(1);
    let val_batches = sampler.eval_batch_count(crate::data::EvalSplit::Validation, o.eval_batches);
    let val = crate::eval::rank_batches(
        sampler,
        crate::data::EvalSplit::Validation,
        val_batches,
        w,
        rank,
    )?;
    let mut steps = Vec::new();
    let mut peaks = [PhasePeak::default(); 3];
    let mut val_loss = f64::NAN;
    // The device peak counts the training loop: model states already allocated, start-up
    // transients (initial values, checkpoint import) not.
    e.reset_device_memory_peak()?;
    if o.trace.is_some() {
        e.set_tracer(crate::trace::Tracer::new(rank as u64, t_start));
    }
    // Whether any rank asks to stop: one flag per rank, all-gathered, so that every rank
    // (thread or process, any backend) takes the same decision at the same step boundary.
    let agree_stop = |e: &mut RankEngine<'_, Decoder>| -> Result<Option<u32>> {
        let asked = f64::from(hooks.stop_requested());
        let all = e.barrier_with_status(asked)?;
        Ok(all.into_iter().find(|&x| x != 0.0).map(|x| x as u32))
    };
    let mut stopped = None;
    let mut threads = crate::threads::ThreadReport::default();
    if start < o.steps {
        stopped = agree_stop(&mut e)?.map(|code| EarlyStop {
            after_step: start,
            code,
        });
    }
    for step in start..o.steps {
        if stopped.is_some() {
            break;
        }
        let mbs: Vec<MicroBatch> = (0..o.grad_accum)
            .map(|k| to_micro_batch(&sampler.try_micro_batch(step, k, rank).map_err(data_err)?))
            .collect::<Result<_>>()?;
        // The schedule advances on applied updates only: a skipped step is retried at the
        // same learning rate (DeepSpeed does the same on an f16 overflow).
        let lr = sched.lr(e.updates_applied() + 1);
        let st = e.train_step(&mbs, lr)?;
        for (p, q) in peaks.iter_mut().zip(st.ledger.iter()) {
            if q.peak_total > p.peak_total {
                p.peak_total = q.peak_total;
                p.at_peak = q.at_peak;
            }
            for c in crate::memory::LEDGER_CATEGORIES {
                let m = slot_max(&mut p.max, c);
                *m = (*m).max(q.max.get(c));
            }
        }
        let last = step + 1 == o.steps;
        let code = if last { None } else { agree_stop(&mut e)? };
        let stop = code.is_some();
        hooks.after_step(rank, st.step, &mut e, stop)?;
        stopped = code.map(|code| EarlyStop {
            after_step: st.step,
            code,
        });
        // A stopping run does not evaluate: the time before the scheduler's kill is the save's.
        let eval_now = !stop && (last || (o.eval_every > 0 && (step + 1) % o.eval_every == 0));
        let v = if eval_now {
            let (sum, n) = crate::eval::sum_in_batch_order(&e.eval_each(&val)?, val_batches, w);
            val_loss = sum / n.max(1) as f64;
            Some(val_loss)
        } else {
            None
        };
        let rep = StepReport {
            step: st.step,
            loss: st.loss,
            lr,
            grad_norm: st.grad_norm,
            tokens: st.tokens,
            tokens_per_s: st.tokens as f64 / st.step_seconds.max(1e-9),
            step_seconds: st.step_seconds,
            comm_exposed_seconds: st.comm_exposed_seconds,
            loss_scale: st.loss_scale,
            skipped: st.skipped,
            nonfinite: st.nonfinite.as_ref().map(|r| r.to_string()),
            live_bytes: e.ledger().live_total().0,
            process_bytes: alloc.map(|a| a.current()),
            val_loss: v,
        };
        if rank == 0 {
            threads.sample();
            progress(&rep);
        }
        steps.push(rep);
    }
    let device_peak = e.device_memory()?.map(|m| m.peak);
    // The host ledger of an offloaded rank holds the same bytes all run.
    let host_peak = e.host_ledger().live_total().0;
    Ok(RankOutcome {
        rank: rank as u64,
        trace: e.take_trace_spans(),
        steps,
        val_loss,
        peaks,
        device_peak,
        host_peak,
        stopped,
        threads,
    })
}

fn slot_max(
    b: &mut fsdp_planner::CategoryBytes,
    c: fsdp_planner::Category,
) -> &mut fsdp_types::Bytes {
    use fsdp_planner::Category as C;
    match c {
        C::ParamShards => &mut b.param_shards,
        C::ParamShardsLowPrecision => &mut b.param_shards_low_precision,
        C::GradShards => &mut b.grad_shards,
        C::OptimizerState => &mut b.optimizer_state,
        C::UnshardedParams => &mut b.unsharded_params,
        C::UnshardedGrads => &mut b.unsharded_grads,
        C::Staging => &mut b.staging,
        C::Activations => &mut b.activations,
    }
}

/// Every rank's outcome in rank order, or the error that ended the run: a data error first (a
/// token file truncated or damaged under the run is the cause; the other ranks then only saw
/// their peer leave), else the lowest rank's error.
pub(crate) fn rank_outcomes<T>(
    results: Vec<std::result::Result<Result<T>, CommError>>,
) -> Result<Vec<T>> {
    let mut outcomes = Vec::with_capacity(results.len());
    let mut first_err = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(x)) => outcomes.push(x),
            Ok(Err(e @ EngineError::Data(_))) => {
                if !matches!(first_err, Some(EngineError::Data(_))) {
                    first_err = Some(e);
                }
            }
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(e) => {
                first_err.get_or_insert(EngineError::Comm {
                    rank,
                    source: Box::new(e),
                });
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(outcomes),
    }
}

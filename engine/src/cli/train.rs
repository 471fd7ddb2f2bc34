//! `fsdp train`: train a byte-level GPT on a text file (default: the embedded project corpus)
//! with `--world-size` rank threads under a sharding strategy, with a progress bar or JSON
//! lines, and a summary of losses, speed and memory (measured against the plan).
//!
//! Output never ends the run: when standard output or standard error closes (`fsdp train |
//! head -1`, a closed terminal) training goes on, saves its checkpoints and stops printing
//! there ([`crate::output`]); `--log-file` keeps every line. SIGINT and SIGTERM stop every
//! rank after the same step, save it and exit 130 / 143 ([`super::stop`]).

use super::args::{BackendArg, CheckpointingArg, DTypeArg, OffloadArg, StrategyArg};
use super::{cli_error, CliError};
use crate::checkpoint::{CheckpointHooks, SaveReport};
use crate::memory::CountingAllocator;
use crate::options::TrainOptions;
use crate::output::{errln, outln};
use crate::preflight::{
    available_memory, cap_threads, cores, launcher_local_ranks, RankHost, RankMemory,
};
use crate::run::{prepare, RunRequest};
use crate::runtime::Placement;
use crate::strategy::{AutoResolution, Budget};
use crate::train::{train_prepared, StepReport, TrainReport};
use fsdp_planner::{GradSync, Strategy};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};

/// Parses `fsdp train --eval-batches`: a count, `0` or `all` (every batch of the split).
///
/// Errors: the rule and the fix, for clap's message.
fn eval_batches_or_zero(s: &str) -> Result<usize, String> {
    match s.trim() {
        "0" => Ok(0),
        v => super::args::eval_batches(v),
    }
}

/// Where flat buffers live and the units compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceArg {
    /// Host memory and CPU compute.
    Cpu,
    /// The GPU `LOCAL_RANK` (0 without a launcher): parameters, gradients, optimizer state and
    /// activations in device memory, CUDA kernels, cuBLAS matmuls. Needs `--features cuda`.
    Cuda,
}

/// When gradients are reduced during gradient accumulation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GradSyncArg {
    /// Reduce-scatter every micro-batch (sharded gradient memory).
    Every,
    /// Accumulate unsharded gradients, reduce on the last micro-batch only (more memory).
    Last,
}

/// `--nonfinite`: what a step with a non-finite gradient or loss does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NonFiniteArg {
    /// Make no update, report the step as skipped and go on.
    Skip,
    /// Stop every rank before anything is updated, naming the step, parameters and ranks.
    Error,
}

/// `--on-save-error`: what a failed checkpoint save does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnSaveErrorArg {
    /// End the run (exit 1) naming the error, the bytes the checkpoint needs and the bytes free.
    Stop,
    /// Print the same as a warning and train on; the next due save tries again (a failed
    /// final save still exits 1).
    Continue,
}

/// The preset `fsdp train` trains when neither `--model`, `--hf-config` nor an `--init-from`
/// model directory names a model.
pub const DEFAULT_MODEL: &str = "tiny";

/// Arguments of `fsdp train`. Negative numbers are read as values (`--lr -1` is refused by the
/// value check naming the rule, not by the parser as an unknown flag).
#[derive(Debug, clap::Args)]
#[command(allow_negative_numbers = true, after_help = EXIT_HELP)]
pub struct TrainArgs {
    /// Text to train on (bytes are tokens): a file, or a pipe, FIFO or `/dev/stdin`, read whole
    /// into memory at the start; or a token file from `fsdp data tokenize` (recognised by its
    /// header; a `*.bin` file must be one), read window by window. Default: this project's own
    /// source code and documentation, embedded at build time.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Model preset: tiny (0.89M params), mini (3.55M), small (11.2M), base (43.7M), gpt2
    /// (124M), gpt2-medium, gpt2-large, gpt2-xl, llama-tiny (0.80M), llama-mini (3.03M),
    /// llama2-7b, llama3-8b, llama3-70b. Default: tiny, or the config.json of an
    /// `--init-from` model directory.
    #[arg(long)]
    pub model: Option<String>,
    /// A Hugging Face config.json (GPT-2, Llama, Mistral, Qwen2) to train instead of a preset:
    /// the model `fsdp plan --hf-config` plans, the same fingerprint for the same flags, with
    /// random weights unless `--init-from` gives them. Its vocab_size must be at least 256 on
    /// text (bytes are tokens), at least the token file's vocabulary on a token file.
    #[arg(long, value_name = "config.json", conflicts_with = "model")]
    pub hf_config: Option<PathBuf>,
    /// Number of ranks (threads on the in-process backend).
    #[arg(long, default_value_t = 1, value_parser = super::checks::at_least_one)]
    pub world_size: usize,
    /// Transport: rank threads in this process, MPI processes (start with `mpirun -n W`), or
    /// NCCL processes on GPUs (start with `fsdp launch --nproc N`).
    #[arg(long, value_enum, default_value_t = BackendArg::Threads)]
    pub backend: BackendArg,
    /// Where the model's flat buffers live and its units compute.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Seconds a rank waits for its peers inside a collective before failing with an error
    /// that names them (`--backend mpi`; the thread backend waits 60 s).
    #[arg(long, default_value_t = 60.0, value_parser = super::checks::seconds)]
    pub comm_timeout: f64,
    /// Sharding strategy.
    #[arg(long, value_enum, default_value_t = StrategyArg::FullShard)]
    pub strategy: StrategyArg,
    /// Shard-group size for `--strategy hybrid` (must divide the world size).
    #[arg(long, value_parser = super::checks::at_least_one_u64)]
    pub shard_size: Option<u64>,
    /// Memory budget per rank, e.g. 80GiB, 40GB, 512MiB (as `fsdp plan --device-memory`). With
    /// `--strategy auto` the budget auto fits (default on the CPU: available memory / ranks on
    /// this node, less a 25% margin; required with `--device cuda`). With another strategy the
    /// run is refused (exit 2) when the plan's per-rank peak exceeds it.
    #[arg(long, value_name = "BYTES", allow_hyphen_values = true)]
    pub device_memory: Option<String>,
    /// Sequences per micro-batch per rank.
    #[arg(long, default_value_t = 8, value_parser = super::checks::at_least_one)]
    pub micro_batch: usize,
    /// Micro-batches per optimizer step (gradient accumulation).
    #[arg(long, default_value_t = 1, value_parser = super::checks::at_least_one)]
    pub grad_accum: usize,
    /// Gradient reduction during accumulation: every micro-batch or the last only.
    #[arg(long, value_enum, default_value_t = GradSyncArg::Every)]
    pub grad_sync: GradSyncArg,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128, value_parser = super::checks::at_least_one)]
    pub seq_len: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 200, value_parser = super::checks::at_least_one_u64)]
    pub steps: u64,
    /// Peak learning rate (AdamW).
    #[arg(long, default_value_t = 1e-3, value_parser = super::checks::positive)]
    pub lr: f64,
    /// Linear warmup steps.
    #[arg(long, default_value_t = 20, value_parser = super::checks::whole_number_u64)]
    pub warmup: u64,
    /// Learning rate at the end of the cosine decay.
    #[arg(long, default_value_t = 1e-4, value_parser = super::checks::non_negative)]
    pub min_lr: f64,
    /// AdamW decoupled weight decay (matrices only).
    #[arg(long, default_value_t = 0.1, value_parser = super::checks::non_negative)]
    pub weight_decay: f64,
    /// Global gradient L2-norm clip (0 disables clipping).
    #[arg(long, default_value_t = 1.0, value_parser = super::checks::non_negative)]
    pub clip: f64,
    /// Seed of the initial weights and the data order.
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// Evaluate the validation loss every N steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    pub eval_every: u64,
    /// Validation micro-batches per evaluation over all ranks (0 or `all`: every micro-batch of the
    /// split): the first N of the split in file order, shared by the ranks, so a run at
    /// any world size with the same --micro-batch evaluates the same windows (and `fsdp eval
    /// --eval-batches N` on its checkpoint the same).
    #[arg(long, value_name = "N|all", default_value = "16", value_parser = eval_batches_or_zero)]
    pub eval_batches: usize,
    /// Without a terminal, print a progress line every N steps or every 30 seconds, whichever
    /// comes first, and at the last step: step, loss, lr, tokens/s, exposed communication and
    /// memory. With a terminal the progress bar shows the same; --json prints every step.
    #[arg(long, default_value_t = 10, value_parser = super::checks::at_least_one_u64)]
    pub log_every: u64,
    /// Units all-gathered ahead of the one computing (0: no prefetch and no overlap: every
    /// collective runs synchronously). From 1 on, all-gathers and reduce-scatters run on a
    /// communication thread while the rank computes.
    #[arg(long, default_value_t = 1, value_parser = super::checks::whole_number_u64)]
    pub prefetch: u64,
    /// Unit-level activation checkpointing (`on`/`off`; default: the strategy's).
    #[arg(long, value_enum, value_name = "on|off", help = super::args::CHECKPOINTING_HELP)]
    pub activation_checkpointing: Option<CheckpointingArg>,
    /// What lives in host memory (`none`/`optimizer`/`params`); on the CPU the run computes
    /// on the CPU device.
    #[arg(long, value_enum, value_name = "none|optimizer|params", help = super::args::OFFLOAD_HELP)]
    pub offload: Option<OffloadArg>,
    /// dtype the units compute in and the all-gather moves: f32, bf16 or f16 (mixed precision:
    /// master weights, gradient shards and optimizer state stay f32; f16 adds dynamic loss
    /// scaling).
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    pub param_dtype: DTypeArg,
    /// dtype of gradients on the wire (reduce-scatter / all-reduce): f32 or bf16 (bf16
    /// reductions accumulate in f32); f16 is refused (its sum over ranks overflows).
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    pub reduce_dtype: DTypeArg,
    /// Compute threads per rank (default: cores / world size, at least 1). More threads than
    /// cores / ranks oversubscribe the cores and are lowered to that, with a warning.
    #[arg(long, value_parser = super::checks::at_least_one)]
    pub threads_per_rank: Option<usize>,
    /// A step whose gradient (any rank's contribution or their sum) or loss is infinite or
    /// NaN: `error` stops every rank before anything is updated, naming the step, the
    /// parameters and the ranks (the last checkpoint stays intact for --resume); `skip` makes
    /// no update and goes on. Default: error, or skip with --param-dtype f16 (loss scaling).
    #[arg(long, value_enum, value_name = "skip|error")]
    pub nonfinite: Option<NonFiniteArg>,
    /// Stop after N skipped steps in a row (non-finite gradients or loss; f16 overflows).
    #[arg(
        long,
        value_name = "N",
        default_value_t = crate::options::DEFAULT_MAX_SKIPPED,
        value_parser = super::checks::whole_number_u64
    )]
    pub max_skipped: u64,
    /// One JSON line per step on stdout (and a JSON summary) instead of the progress bar.
    #[arg(long)]
    pub json: bool,
    /// After the summary, print the memory report: per rank, phase and category the
    /// engine-owned bytes measured (ledger peak) against the plan, the precision and the
    /// process heap peak against the plan.
    #[arg(long)]
    pub memory_report: bool,
    /// Train although the data's token ids were not made by the model's tokenizer: the
    /// `tokenizer.json` of an `--init-from` model directory, or the tokenizer of the token
    /// file a resumed checkpoint trained on (by default such a run is refused, exit 2).
    #[arg(long)]
    pub allow_tokenizer_mismatch: bool,
    /// Also append every line the run prints (progress lines, checkpoint and stop messages,
    /// notes, warnings, errors, the summary) to this file, created if missing (its directory
    /// must exist), each line written as it happens; under a terminal's progress bar the file
    /// gets the plain progress line of every --log-every steps. The run then outlives its
    /// terminal: SIGHUP is ignored (as under nohup). In a job of several processes (--backend
    /// mpi or nccl) each rank writes its own file, like torchrun's per-rank logs: rank 0 PATH,
    /// rank R PATH.rankR.
    #[arg(long, value_name = "PATH")]
    pub log_file: Option<PathBuf>,
    /// What a failed checkpoint save does (a full disk, a file size limit, a permission
    /// lost): `stop` ends the run with exit 1 naming the error, the bytes the checkpoint needs
    /// and the bytes free on its file system; `continue` prints that as a warning and trains
    /// on, trying again at the next due save (a failed final save still exits 1). Either way
    /// the failed save's temporary directory is removed at once and `latest` keeps naming the
    /// previous checkpoint. Needs --ckpt-dir.
    #[arg(long, value_enum, value_name = "stop|continue", default_value_t = OnSaveErrorArg::Stop, requires = "ckpt_dir")]
    pub on_save_error: OnSaveErrorArg,
    /// Save checkpoints asynchronously: at a save each rank copies its master and optimizer
    /// shards into host staging buffers (kept for the run; `fsdp plan --ckpt-async` shows
    /// their bytes, the memory pre-flight counts them) and a background writer saves them with
    /// the same atomic protocol while the next steps train. At most one save is in flight (a
    /// next due save waits for it); the last one is waited for before the run ends. The
    /// summary reports the step time lost to saves either way. Needs --ckpt-dir.
    #[arg(long, requires = "ckpt_dir")]
    pub ckpt_async: bool,
    /// Write a Chrome trace event JSON of the training steps (opens in Perfetto or
    /// chrome://tracing): per rank a compute track (each unit's forward, recompute and
    /// backward, the optimizer step, the waits on collectives) and a communication track (each
    /// collective from issue to completion). In a job of several processes rank R > 0 writes
    /// FILE.rankR.
    #[arg(long, value_name = "FILE.json")]
    pub trace: Option<PathBuf>,
    /// Predict the step time on this hardware profile and compare it with the run's: the
    /// summary prints the predicted and measured step time with the error, the measured
    /// tokens/s and MFU; `--strategy auto` ranks the plans that fit by predicted step time
    /// (see `TRAIN_HARDWARE_HELP`).
    #[arg(long, value_name = "NAME|FILE", help = super::timing::TRAIN_HARDWARE_HELP)]
    pub hardware: Option<String>,
    /// Checkpoints: --ckpt-dir, --ckpt-every, --keep-last, --resume, --init-from.
    #[command(flatten)]
    pub ckpt: super::args::TrainCkptArgs,
}

/// The end of `fsdp train --help`: exit codes and what a signal does.
pub const EXIT_HELP: &str = "Exit codes: 0 the run finished; 1 it failed; 2 bad input (nothing \
ran); 130 (SIGINT, Ctrl-C) or 143 (SIGTERM, a scheduler's stop): every rank stopped after the \
same step, saved it to --ckpt-dir (nothing is saved without one) and printed the command that \
resumes it (--resume). A second signal (1 s or more after the first) exits at once with the \
same code, without a final checkpoint (the newest complete one is unchanged).";

impl TrainArgs {
    /// The training options these flags describe.
    ///
    /// Errors: [`CliError::Usage`] for a flag combination that cannot run.
    pub fn options(&self) -> Result<TrainOptions, CliError> {
        let strategy = match (self.strategy, self.shard_size) {
            (StrategyArg::Hybrid, Some(s)) => Strategy::Hybrid { shard_size: s },
            (StrategyArg::Auto, Some(s)) => {
                return Err(CliError::Usage(format!(
                    "--shard-size {s} does not apply to --strategy auto: auto chooses hybrid \
                     shard-group sizes itself (use --strategy hybrid --shard-size {s} to fix one)"
                )))
            }
            (StrategyArg::Hybrid, None) => {
                return Err(CliError::Usage(
                    "--strategy hybrid needs --shard-size S (S divides --world-size)".into(),
                ))
            }
            (_, Some(s)) => {
                return Err(CliError::Usage(format!(
                    "--shard-size {s} only applies to --strategy hybrid"
                )))
            }
            (StrategyArg::FullShard, None) => Strategy::FullShard,
            (StrategyArg::ShardGradOp, None) => Strategy::ShardGradOp,
            (StrategyArg::NoShard, None) => Strategy::NoShard,
            (StrategyArg::ShardOptimizer, None) => Strategy::ShardOptimizer,
            // Resolved by `run` once the world size and the memory budget are known.
            (StrategyArg::Auto, None) => Strategy::Auto,
        };
        if self.clip < 0.0 || !self.clip.is_finite() {
            return Err(CliError::Usage(format!(
                "--clip must be >= 0 (0 disables it), got {}",
                self.clip
            )));
        }
        Ok(TrainOptions {
            data: self.data.clone(),
            model: self.model.clone().unwrap_or_else(|| DEFAULT_MODEL.into()),
            hf_config: self.hf_config.clone().or_else(|| {
                // `--init-from DIR` of a model directory: its config.json is the model, as
                // `from_pretrained(DIR)` reads it, unless --model or --hf-config says otherwise.
                let dir = self.ckpt.init_from.as_ref().filter(|d| d.is_dir())?;
                let cfg = dir.join(fsdp_checkpoints::hfdir::CONFIG_FILE);
                (self.model.is_none() && cfg.is_file()).then_some(cfg)
            }),
            world_size: self.world_size,
            strategy,
            micro_batch: self.micro_batch,
            grad_accum: self.grad_accum,
            grad_sync: match self.grad_sync {
                GradSyncArg::Every => GradSync::EveryMicroBatch,
                GradSyncArg::Last => GradSync::LastMicroBatch,
            },
            seq_len: self.seq_len,
            steps: self.steps,
            lr: self.lr,
            min_lr: self.min_lr,
            warmup: self.warmup,
            weight_decay: self.weight_decay,
            clip: (self.clip > 0.0).then_some(self.clip),
            seed: self.seed,
            eval_every: self.eval_every,
            eval_batches: self.eval_batches,
            prefetch: self.prefetch,
            activation_checkpointing: self.activation_checkpointing.map(CheckpointingArg::enabled),
            offload: self.offload.map(OffloadArg::offload),
            param_dtype: self.param_dtype.dtype(),
            reduce_dtype: self.reduce_dtype.dtype(),
            threads_per_rank: self.threads_per_rank,
            nonfinite: match self.nonfinite {
                None => crate::runtime::NonFinitePolicy::Auto,
                Some(NonFiniteArg::Skip) => crate::runtime::NonFinitePolicy::Skip,
                Some(NonFiniteArg::Error) => crate::runtime::NonFinitePolicy::Error,
            },
            max_skipped: Some(self.max_skipped),
            ckpt_async: self.ckpt_async,
            trace: self.trace.clone(),
            hardware: self
                .hardware
                .as_deref()
                .map(super::timing::load_hardware)
                .transpose()?,
            init_from: self.ckpt.init_from.clone(),
            placement: match self.device {
                DeviceArg::Cpu => Placement::Host,
                DeviceArg::Cuda => {
                    let ordinal = match std::env::var("LOCAL_RANK") {
                        Ok(v) => v.parse::<usize>().map_err(|_| {
                            CliError::Usage(format!(
                                "--device cuda: LOCAL_RANK={v:?} is not a GPU index"
                            ))
                        })?,
                        Err(_) => 0,
                    };
                    Placement::Device(super::open_cuda(ordinal)?.0)
                }
            },
        })
    }
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

/// Runs `fsdp train`; `alloc` is the binary's counting allocator (process peak), if any.
pub fn run(args: TrainArgs, alloc: Option<&'static CountingAllocator>) -> Result<(), CliError> {
    // No output file may replace one of the inputs (checked before the log file opens).
    let inputs: [(&str, Option<&Path>); 3] = [
        ("--data", args.data.as_deref()),
        (
            "--hardware",
            args.hardware
                .as_deref()
                .and_then(super::timing::hardware_file),
        ),
        ("--hf-config", args.hf_config.as_deref()),
    ];
    for (flag, out) in [("--log-file", &args.log_file), ("--trace", &args.trace)] {
        if let Some(o) = out {
            crate::output::check_not_an_input(flag, o, &inputs).map_err(CliError::Usage)?;
        }
    }
    // A log file that cannot be written is refused before anything else; one rank thread
    // process opens it now, so that even a bad flag's error is in it.
    if let Some(p) = &args.log_file {
        crate::output::check_log_path(p).map_err(CliError::Usage)?;
        if args.backend == BackendArg::Threads {
            open_log_file(p, None)?;
        }
    }
    // So is a trace file that cannot be written (a bad hardware profile is refused with the
    // options): before any training.
    if let Some(t) = &args.trace {
        crate::trace::check_trace_path("--trace", t)?;
    }
    let mut opts = args.options()?;
    // Under `fsdp launch` (torchrun's environment) every process would otherwise train its
    // own copy of the model as a world of --world-size threads: refuse instead.
    if args.backend == BackendArg::Threads {
        if let Some(w) = std::env::var("WORLD_SIZE")
            .ok()
            .filter(|_| std::env::var_os("RANK").is_some())
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|&w| w > 1)
        {
            return Err(CliError::Usage(format!(
                "this process is one of {w} ranks started by a launcher (RANK / WORLD_SIZE are set), but --backend threads runs all ranks as threads of one process: run `fsdp train --world-size {w}` without a launcher, `mpirun -n {w} fsdp train --backend mpi`, or on GPUs `fsdp launch --nproc {w} -- train --device cuda --backend nccl`"
            )));
        }
    }
    let budget = args
        .device_memory
        .as_deref()
        .map(|raw| {
            super::args::parse_device_memory(raw).map(|b| Budget {
                bytes: b.0,
                given: raw.to_string(),
            })
        })
        .transpose()?;
    let mpi = match args.backend {
        BackendArg::Threads | BackendArg::Nccl => None,
        BackendArg::Mpi => Some(crate::process::mpi::MpiProcess::init(
            args.world_size,
            args.comm_timeout,
            &mut opts,
        )?),
    };
    let nccl = match args.backend {
        BackendArg::Nccl => Some(crate::process::NcclProcess::init(
            args.world_size,
            args.comm_timeout,
            &mut opts,
        )?),
        _ => None,
    };
    let process_rank = mpi
        .as_ref()
        .map(|m| m.rank())
        .or(nccl.as_ref().map(|n| n.rank()));
    let root = process_rank.is_none_or(|r| r == 0);
    if let (Some(p), Some(r)) = (&args.log_file, process_rank) {
        open_log_file(p, Some(r))?;
    }
    // From here on SIGINT / SIGTERM stop every rank at the next step boundary (saved).
    super::stop::install(args.log_file.is_some()).map_err(CliError::Failed)?;
    // Every MPI rank's node memory, gathered once, so that every rank resolves auto and
    // decides the pre-flight on the same numbers.
    let host = !opts.placement.device().is_cuda();
    let ranks = match (&mpi, &nccl) {
        (Some(m), _) if host => RankMemory::Mpi {
            hosts: Some(m.gather_hosts(RankHost::this_process())?),
        },
        (None, None) if host => RankMemory::Threads {
            available: available_memory(),
        },
        _ => RankMemory::Device,
    };
    // `--init-from` names weights; the model comes from --model, --hf-config or the
    // directory's config.json. A directory without one names no model: refuse rather than
    // load its weights into the default preset.
    if let Some(from) = args.ckpt.init_from.as_deref() {
        if std::fs::metadata(from).is_err() {
            return Err(CliError::Usage(format!(
                "--init-from {}: no such file or directory; pass a Hugging Face model \
                 directory, a .safetensors file or a model.safetensors.index.json",
                from.display()
            )));
        }
        let named = args.model.is_some() || args.hf_config.is_some();
        let cfg = fsdp_checkpoints::hfdir::CONFIG_FILE;
        if !named && from.is_dir() && !from.join(cfg).is_file() {
            return Err(CliError::Usage(format!(
                "--init-from {} holds no {cfg}, so it names no model: pass the model's config \
                 with --hf-config CONFIG.json, or a preset with --model",
                from.display()
            )));
        }
        if !named && from.is_file() && root {
            errln!(
                "note: --init-from {} is a weights file, which names no model: the model is the \
                 default `{DEFAULT_MODEL}`; pass --hf-config CONFIG.json or --model for another",
                from.display()
            );
        }
    }
    // A model directory with its tokenizer: the data must be tokens of that tokenizer.
    if let Some(dir) = args.ckpt.init_from.as_deref().filter(|d| d.is_dir()) {
        let flag = format!("--init-from {}", dir.display());
        let note = super::checks::check_data_tokenizer(
            &flag,
            dir,
            opts.data.as_deref(),
            args.allow_tokenizer_mismatch,
        )?;
        if let (Some(n), true) = (note, root) {
            errln!("{n}");
        }
    }
    // One pass: the model, the plan (auto resolved), the pre-flight on that plan.
    let mut run = prepare(RunRequest {
        options: opts,
        budget,
        ranks,
    })?;
    // The prediction for this plan, before any work (a profile without the plan's dtype is
    // refused here).
    let prediction = match &run.options.hardware {
        Some(h) => Some(
            fsdp_planner::time::predict(&run.plan, h, &crate::options::time_inputs(&run.options))
                .map_err(|e| CliError::Usage(format!("--hardware: {e}")))?,
        ),
        None => None,
    };
    let mismatch =
        run.options.hardware.as_ref().and_then(|h| {
            super::timing::device_mismatch(h, run.options.placement.device().is_cuda())
        });
    let (threads, warning) = cap_threads(
        run.options.threads_per_rank,
        match (&mpi, &nccl) {
            (None, None) => run.options.world_size,
            _ => launcher_local_ranks(|k| std::env::var(k).ok()).unwrap_or(1) as usize,
        },
        cores(),
    );
    run.options.threads_per_rank = threads;
    if root {
        let ranks_note = run.options.hardware.as_ref().and_then(|h| {
            super::timing::calibrated_ranks_note(
                h,
                match (&mpi, &nccl) {
                    (None, None) => run.options.world_size as u64,
                    _ => launcher_local_ranks(|k| std::env::var(k).ok()).unwrap_or(1),
                },
            )
        });
        for note in [
            mismatch.clone(),
            ranks_note,
            warning,
            super::checks::warmup_note(&run.options),
            super::checks::grad_sync_note(&run.options),
        ]
        .into_iter()
        .flatten()
        {
            errln!("{note}");
        }
    }
    let mut ckpt = args.ckpt.config()?;
    ckpt.allow_tokenizer_mismatch = args.allow_tokenizer_mismatch;
    ckpt.on_save_error = match args.on_save_error {
        OnSaveErrorArg::Stop => crate::checkpoint::OnSaveError::Stop,
        OnSaveErrorArg::Continue => crate::checkpoint::OnSaveError::Continue,
    };
    if ckpt.dir.is_some() {
        // A file size limit (`ulimit -f`) makes a checkpoint write fail with EFBIG, a save
        // error handled by --on-save-error, instead of killing the run with SIGXFSZ.
        // SAFETY: setting a signal's disposition to "ignore" installs no handler code.
        unsafe {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        }
    }
    let mut hooks = CheckpointHooks::new(&ckpt, &run, &mut |line| errln!("{line}"))?;
    // `--init-from DIR --resume` with a checkpoint to resume: the weights (and optimizer
    // state) are the checkpoint's, DIR names the model only.
    if let (Some((step, dir)), Some(from)) = (hooks.resume_step(), &run.options.init_from) {
        if root {
            errln!(
                "note: the weights come from the checkpoint of step {step} ({}); --init-from {} gives the model only",
                dir.display(),
                from.display()
            );
        }
        run.options.init_from = None;
    }
    let opts = &run.options;
    let auto = run.auto.clone();
    // A checkpoint already at or past --steps leaves no step to run: say so and succeed
    // (exit 0) rather than print a summary of zero steps (no loss, no speed to report).
    if let Some((step, dir)) = hooks.resume_step().filter(|(s, _)| *s >= opts.steps) {
        if root {
            let msg = format!(
                "checkpoint {} is at step {step} >= --steps {}: nothing to train",
                dir.display(),
                opts.steps
            );
            if args.json {
                errln!("{msg}");
            } else {
                outln!("{msg}");
            }
        }
        return Ok(());
    }
    let bar = if args.json || !root {
        None
    } else {
        let b = ProgressBar::new(opts.steps);
        b.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .map_err(|e| CliError::Failed(e.to_string()))?,
        );
        Some(b)
    };
    let json = args.json;
    // The newest checkpoint this run saved (rank 0): where a stop says it went.
    let last_save = std::sync::Arc::new(std::sync::Mutex::new(None::<(u64, PathBuf)>));
    {
        let bar = bar.clone();
        let last_save = last_save.clone();
        hooks.on_save(Box::new(move |s: &SaveReport| {
            *last_save.lock().unwrap_or_else(|p| p.into_inner()) = Some((s.step, s.path.clone()));
            if json {
                let line = serde_json::json!({
                    "event": "checkpoint",
                    "step": s.step,
                    "path": s.path,
                    "bytes": s.bytes,
                    "seconds": s.seconds,
                });
                outln!("{line}");
                return;
            }
            let line = format!(
                "saved step {} to {} in {:.2} s ({})",
                s.step,
                s.path.display(),
                s.seconds,
                fsdp_types::Bytes(s.bytes)
            );
            print_line(bar.as_ref(), &line);
        }));
    }
    if let (Some(a), true, false) = (&auto, root, json) {
        outln!(
            "strategy auto: {}, activation checkpointing {} (budget {} per rank: {}); {}",
            a.choice.strategy,
            if a.choice.activation_checkpointing == Some(true) {
                "on"
            } else {
                "off"
            },
            a.choice.budget,
            a.source,
            a.choice.reason
        );
    }
    // Without a terminal the bar is hidden (or would litter a log with redraws): print a plain
    // line every --log-every steps or 30 s instead (`PlainLog`).
    let plain = {
        use std::io::IsTerminal;
        !json && root && !(std::io::stdout().is_terminal() && std::io::stderr().is_terminal())
    };
    // Under a terminal's bar the log file gets the plain lines the terminal does not show.
    let plain_to_log = !json && root && !plain && args.log_file.is_some();
    let total_steps = opts.steps;
    let log = super::progress::PlainLog::new(args.log_every, opts.data.clone());
    let progress = |r: &StepReport| {
        log.watch_data(r.step);
        if json {
            if let Ok(s) = serde_json::to_string(r) {
                outln!("{s}");
            }
            return;
        }
        let scale = r
            .loss_scale
            .map(|s| {
                format!(
                    " | loss scale {s}{}",
                    if r.skipped { " (step skipped)" } else { "" }
                )
            })
            .unwrap_or_default();
        if let Some(why) = &r.nonfinite {
            // The report starts with "step N: ".
            let why = why.split_once(": ").map_or(why.as_str(), |(_, rest)| rest);
            let line = format!("step {}/{total_steps} skipped, no update: {why}", r.step);
            if root {
                print_line(bar.as_ref(), &line);
            }
        }
        // Plain output: every --log-every steps or 30 s, the last step, evaluated steps and
        // every step skipped.
        if (plain || plain_to_log) && log.due(r, total_steps) {
            let line = super::progress::log_line(r, total_steps);
            if plain {
                outln!("{line}");
            } else {
                crate::output::log_only(&format!("{line}\n"));
            }
        }
        if let Some(b) = &bar {
            let val = r
                .val_loss
                .map(|v| format!(" val {v:.4}"))
                .unwrap_or_default();
            // `r.step` is 1-based: the bar shows it next to its own loss (also after --resume).
            b.set_position(r.step);
            b.set_message(format!(
                "loss {:.4}{val} | {:.0} tok/s | comm exposed {:.0} ms | live {}{}{scale}",
                r.loss,
                r.tokens_per_s,
                1e3 * r.comm_exposed_seconds,
                mib(r.live_bytes),
                r.process_bytes
                    .map(|p| format!(" | heap {}", mib(p)))
                    .unwrap_or_default()
            ));
        }
    };
    let resume_dir = hooks.resume_step().map(|(_, d)| d.to_path_buf());
    let stop_hooks = super::stop::StopOnSignal { inner: &hooks };
    let report = match (&mpi, &nccl) {
        (Some(m), _) => m.train(&run, alloc, &stop_hooks, &progress),
        (None, Some(n)) => n.train(&run, alloc, &stop_hooks, &progress),
        (None, None) => train_prepared(&run, alloc, &stop_hooks, &progress, None),
    }
    .map_err(cli_error)?;
    let stopped = report.stopped.map(|s| (s.after_step, s.code as i32));
    if !root {
        return match stopped {
            Some((_, sig)) => Err(CliError::Stopped(sig)),
            None => Ok(()),
        };
    }
    if let Some(b) = &bar {
        if stopped.is_some() {
            b.abandon();
        } else {
            b.finish();
        }
    }
    let stats = args.ckpt.ckpt_dir.is_some().then(|| hooks.save_stats());
    let step_seconds: Vec<f64> = report.steps.iter().map(|s| s.step_seconds).collect();
    let comparison = prediction
        .as_ref()
        .and_then(|p| super::timing::compare(p, &step_seconds));
    if json {
        let mut v = summary_json(&report, auto.as_ref());
        if let Some(st) = stats {
            v["checkpoint_saves"] = serde_json::json!(st);
        }
        if let Some(c) = &comparison {
            v["step_time"] = super::timing::comparison_json(c);
            v["step_time"]["profile_of_another_device"] = mismatch.is_some().into();
            if mismatch.is_some() {
                // As the text says: no error, MFU or HFU of this run against another device.
                v["step_time"]["step_time_error"] = serde_json::Value::Null;
                v["step_time"]["mfu"] = serde_json::Value::Null;
                v["step_time"]["hfu"] = serde_json::Value::Null;
            }
        }
        let s = serde_json::to_string(&v).map_err(|e| CliError::Failed(e.to_string()))?;
        outln!("{s}");
    } else if !report.steps.is_empty() {
        print_summary(&report, args.memory_report);
        if let Some(c) = &comparison {
            let text = if mismatch.is_some() {
                super::timing::render_other_device(c)
            } else {
                super::timing::render_comparison(c)
            };
            for line in text.lines() {
                outln!("{line}");
            }
        }
        if let Some(st) = stats {
            outln!("{}", save_line(&st));
        }
    }
    let Some((after, sig)) = stopped else {
        if let Some(sig) = super::stop::received() {
            errln!(
                "note: {} arrived during the last step; the run finished it",
                super::stop::signal_name(sig)
            );
        }
        return Ok(());
    };
    let saved = last_save
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .filter(|(step, _)| *step == after);
    // Stopped before its first step, a resumed run's checkpoint is still the newest.
    let resumed = resume_dir.filter(|_| report.steps.is_empty());
    let command = resume_command(&mpi, &nccl, opts.world_size);
    let name = super::stop::signal_name(sig);
    let at = if report.steps.is_empty() {
        "before its first step".to_string()
    } else {
        format!("after step {after} of {}", opts.steps)
    };
    let (checkpoint, message) = match (&saved, &resumed, &ckpt.dir) {
        (Some((_, dir)), _, _) => (
            Some(dir.clone()),
            format!(
                "stopped by {name} {at}: saved the checkpoint of step {after} to {}; resume \
                 with:\n  {command}",
                dir.display()
            ),
        ),
        (None, Some(dir), _) => (
            Some(dir.clone()),
            format!(
                "stopped by {name} {at}: nothing trained; the checkpoint of step {after} in {} \
                 is unchanged; resume with:\n  {command}",
                dir.display()
            ),
        ),
        (None, None, Some(_)) if report.steps.is_empty() => (
            None,
            format!("stopped by {name} {at}: nothing trained, nothing saved"),
        ),
        (None, None, _) => (
            None,
            format!(
                "stopped by {name} {at}: nothing was saved (no --ckpt-dir); pass --ckpt-dir \
                 DIR to keep the work of a stopped run"
            ),
        ),
    };
    if json {
        let line = serde_json::json!({
            "event": "stopped",
            "signal": name,
            "step": after,
            "steps": opts.steps,
            "checkpoint": checkpoint,
            "resume": checkpoint.as_ref().map(|_| command.clone()),
        });
        outln!("{line}");
    }
    errln!("{message}");
    Err(CliError::Stopped(sig))
}

/// The command that resumes a stopped run: under `fsdp launch` (directly, or through a
/// program it started such as mpirun) the launcher's own command line with `--resume`
/// ([`super::stop::LAUNCH_COMMAND_ENV`]); else this process's arguments with `--resume`,
/// under the launcher that started it (MPI: `mpirun -n W`, NCCL: `fsdp launch --nproc W
/// --`).
fn resume_command(
    mpi: &Option<crate::process::mpi::MpiProcess>,
    nccl: &Option<crate::process::NcclProcess>,
    world_size: usize,
) -> String {
    let launcher = std::env::var(super::stop::LAUNCH_COMMAND_ENV)
        .ok()
        .and_then(|c| shlex::split(&c))
        .filter(|words| !words.is_empty());
    if let Some(words) = launcher {
        return super::stop::resume_command_of(words);
    }
    let args: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    match (mpi, nccl) {
        (Some(_), _) => format!(
            "mpirun -n {world_size} {}",
            super::stop::resume_command_of(args)
        ),
        (None, Some(_)) => format!(
            "{} launch --nproc {world_size} -- {}",
            shlex::try_quote(&args[0]).map_or(args[0].clone(), |q| q.into_owned()),
            super::stop::resume_command_of(args.into_iter().skip(1))
        ),
        (None, None) => super::stop::resume_command_of(args),
    }
}

/// Prints `line` above a visible progress bar (and into the log file), else on stdout.
fn print_line(bar: Option<&ProgressBar>, line: &str) {
    match bar {
        Some(b) if !b.is_hidden() => {
            b.println(line);
            crate::output::log_only(&format!("{line}\n"));
        }
        _ => outln!("{line}"),
    }
}

/// Opens `--log-file PATH` for this process: PATH for rank 0 (and for a process of rank
/// threads, `rank` None), PATH.rankR for rank R of a job of several processes; its first line
/// names the command line and the process.
///
/// Errors: [`CliError::Usage`] naming the path when it cannot be opened for appending.
fn open_log_file(path: &std::path::Path, rank: Option<usize>) -> Result<(), CliError> {
    let path = match rank {
        Some(r) if r > 0 => {
            let mut p = path.as_os_str().to_owned();
            p.push(format!(".rank{r}"));
            PathBuf::from(p)
        }
        _ => path.to_path_buf(),
    };
    crate::output::open_log(&path).map_err(CliError::Usage)?;
    let args: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    crate::output::log_only(&format!(
        "== {} (pid {}{})\n",
        shlex::try_join(args.iter().map(String::as_str)).unwrap_or_else(|_| args.join(" ")),
        std::process::id(),
        rank.map(|r| format!(", rank {r}")).unwrap_or_default()
    ));
    Ok(())
}

/// The summary line of the run's checkpoint saves: how many, and the step time lost to them.
fn save_line(s: &crate::checkpoint::SaveStats) -> String {
    let per = s.blocked_seconds / s.saves.max(1) as f64;
    let steady = if s.asynchronous && s.saves > 1 {
        format!(
            "; {:.3} s per save before the last, which is waited for",
            (s.blocked_seconds - s.final_blocked_seconds) / (s.saves - 1) as f64
        )
    } else {
        String::new()
    };
    format!(
        "checkpoints: {} {} saves, training blocked {:.2} s by them ({per:.3} s per save{steady})",
        s.saves,
        if s.asynchronous {
            "asynchronous"
        } else {
            "synchronous"
        },
        s.blocked_seconds
    )
}

/// The `auto_ranking` object of the JSON summary: the profile, the chosen candidate and the
/// runner-up with their predicted step times, and every candidate that fit, fastest first.
fn ranking_json(r: &fsdp_planner::AutoRanking) -> serde_json::Value {
    let one = |c: &fsdp_planner::RankedCandidate| {
        serde_json::json!({
            "name": c.name,
            "strategy": c.strategy.to_string(),
            "activation_checkpointing": c.activation_checkpointing == Some(true),
            "offload": c.offload.map(|o| o.to_string()),
            "peak_per_rank": c.peak.0,
            "predicted_step_s": c.step_s,
        })
    };
    serde_json::json!({
        "ranked_by": "predicted step time",
        "hardware": r.hardware,
        "budget_per_rank": r.budget.0,
        "fitting": r.fitting.len(),
        "chosen": r.fitting.first().map(one),
        "runner_up": r.fitting.get(1).map(one),
        "candidates": r.fitting.iter().map(one).collect::<Vec<_>>(),
        "rejected": r.rejected,
    })
}

fn summary_json(r: &TrainReport, auto: Option<&AutoResolution>) -> serde_json::Value {
    serde_json::json!({
        "strategy_requested": if auto.is_some() { "auto".to_string() } else { r.strategy.clone() },
        "auto_reason": auto.map(|a| a.choice.reason.clone()),
        "auto_ranking": auto.and_then(|a| a.choice.ranking.as_ref()).map(ranking_json),
        "memory_budget_per_rank": auto.map(|a| a.choice.budget.0),
        "memory_budget_source": auto.map(|a| a.source.clone()),
        "summary": true,
        "model": r.model,
        "params": r.params,
        "data": r.data,
        "world_size": r.world_size,
        "shard_size": r.shard_size,
        "strategy": r.strategy,
        "activation_checkpointing": r.activation_checkpointing,
        "precision": r.precision,
        "comm_exposed_seconds": r.comm_exposed_seconds,
        "skipped_steps": r.skipped_steps,
        "final_train_loss": r.final_train_loss,
        "final_val_loss": r.final_val_loss,
        "tokens_per_s": r.tokens_per_s,
        "threads": r.threads,
        "seconds": r.seconds,
        "plan_peak_per_rank": r.plan_peak_per_rank,
        "plan_host_peak_per_rank": r.plan_host_peak_per_rank,
        "host_peak_per_rank": r.host_peak_per_rank,
        "process_peak": r.process_peak,
        "device_memory": r.device_memory,
        "memory": r.memory,
        "fingerprint": r.fingerprint,
        "stopped_after_step": r.stopped.map(|s| s.after_step),
        "stop_signal": r.stopped.map(|s| super::stop::signal_name(s.code as i32)),
    })
}

/// The end-of-run summary: what ran, the losses, the speed, and per rank the engine-owned
/// memory peak against the plan; with `memory_report` also the precision, the per-phase and
/// per-category table and the process heap against the plan.
fn print_summary(r: &TrainReport, memory_report: bool) {
    if let Some(s) = r.stopped {
        outln!(
            "stopped early by {} after step {} (the summary covers the steps of this run)",
            super::stop::signal_name(s.code as i32),
            s.after_step
        );
    }
    outln!(
        "trained {} ({} params) on {} | world {} ({}, shard group {}, activation checkpointing {})",
        r.model,
        fsdp_types::group_thousands(r.params),
        r.data,
        r.world_size,
        r.strategy,
        r.shard_size,
        if r.activation_checkpointing {
            "on"
        } else {
            "off"
        }
    );
    outln!(
        "train loss {:.4} (mean of last steps) | val loss {}{}",
        r.final_train_loss,
        if r.final_val_loss.is_nan() && r.stopped.is_some() {
            "not evaluated (stopped early)".to_string()
        } else {
            format!("{:.4}", r.final_val_loss)
        },
        if r.skipped_steps > 0 {
            format!(
                " | {} steps skipped (non-finite gradients or loss)",
                r.skipped_steps
            )
        } else {
            String::new()
        }
    );
    outln!(
        "{} tokens/s over all {} steps (the first included) | {:.1} s | communication exposed \
         (rank 0): {:.2} s",
        fsdp_types::group_thousands(r.tokens_per_s.round() as u64),
        r.steps.len(),
        r.seconds,
        r.comm_exposed_seconds
    );
    outln!("{}", r.threads.summary_line());
    for (rank, peak) in r.measured_peak_per_rank.iter().enumerate() {
        let host = match r.host_peak_per_rank.get(rank) {
            Some(&h) if h > 0 => format!(
                "; offloaded to host memory {} of plan {}",
                mib(h),
                mib(r.plan_host_peak_per_rank)
            ),
            _ => String::new(),
        };
        outln!(
            "memory rank {rank}: engine-owned peak {} of plan {} ({:.1}%){host}",
            mib(*peak),
            mib(r.plan_engine_peak_per_rank),
            100.0 * *peak as f64 / r.plan_engine_peak_per_rank.max(1) as f64
        );
    }
    if let Some(d) = r.device_memory {
        outln!(
            "device memory: plan {} B, measured peak {} B ({:.4})",
            d.plan_bytes,
            d.measured_peak_bytes,
            d.measured_peak_bytes as f64 / d.plan_bytes.max(1) as f64
        );
    }
    if memory_report {
        print_memory_report(r);
    }
}

/// The memory report of `--memory-report`.
fn print_memory_report(r: &TrainReport) {
    outln!("precision: {}", r.precision);
    outln!("memory per rank, engine-owned bytes: measured (ledger peak) / plan, per phase");
    outln!(
        "{:<6} {:<15} {:<28} {:>14} {:>14}",
        "rank",
        "phase",
        "category",
        "measured B",
        "plan B"
    );
    for (rank, cats) in r.memory.iter().enumerate() {
        for c in cats.iter().filter(|c| c.planned > 0 || c.measured > 0) {
            let mark = if c.measured > c.planned { "  OVER" } else { "" };
            outln!(
                "{:<6} {:<15} {:<28} {:>14} {:>14}{mark}",
                rank,
                c.phase,
                c.category,
                fsdp_types::group_thousands(c.measured),
                fsdp_types::group_thousands(c.planned)
            );
        }
    }
    match r.process_peak {
        Some(p) => outln!(
            "process heap peak during training {} (all {} ranks) vs plan peak {} per rank x {} = {}",
            mib(p),
            r.world_size,
            mib(r.plan_peak_per_rank),
            r.world_size,
            mib(r.plan_peak_per_rank * r.world_size as u64)
        ),
        None => outln!("process heap: not measured (no counting allocator installed)"),
    }
}

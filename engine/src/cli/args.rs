//! The command-line argument types more than one subcommand reads: the `--strategy` names of
//! `fsdp train` (also `fsdp ckpt reshard` and the launcher's view of a train command), the
//! `--backend` of `fsdp train` (also read by `fsdp launch`), the dtypes of `--param-dtype` /
//! `--reduce-dtype` (`fsdp plan`, `fsdp train`, `fsdp eval`), `--activation-checkpointing`
//! and `--offload` with their help texts and `--device-memory` (`fsdp plan`, `fsdp train`),
//! `--eval-batches` (`fsdp train`, `fsdp eval`) and the checkpoint flags of `fsdp train`
//! (which the launcher reads too). Each subcommand module imports them from here and never
//! from another subcommand's module.

use super::CliError;
use crate::checkpoint::{CheckpointConfig, ResumeFrom};
use fsdp_types::Bytes;
use std::path::PathBuf;

/// Sharding strategy names on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StrategyArg {
    /// Shard params, grads and optimizer state; reshard after forward (ZeRO-3; alias zero3).
    #[value(alias = "zero3")]
    FullShard,
    /// Shard grads and optimizer state; keep params unsharded from forward to backward
    /// (ZeRO-2; alias zero2).
    #[value(alias = "zero2")]
    ShardGradOp,
    /// Replicate everything; all-reduce gradients (DDP; alias ddp).
    #[value(alias = "ddp")]
    NoShard,
    /// Shard master weights, reduced gradients and optimizer state; keep the parameters
    /// replicated through the step and gather them once per step (ZeRO-1; alias zero1).
    #[value(alias = "zero1")]
    ShardOptimizer,
    /// Full shard inside groups of `--shard-size` ranks, replicated across groups (HSDP;
    /// alias hsdp).
    #[value(alias = "hsdp")]
    Hybrid,
    /// The fastest strategy whose per-rank plan peak fits `--device-memory` (default: this
    /// node's available memory per rank on the CPU), without activation checkpointing first,
    /// then with it, then with --offload when nothing else fits, as `fsdp plan --strategy
    /// auto`; the choice and why are printed before training.
    Auto,
}

/// Which transport runs the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendArg {
    /// `--world-size` rank threads in this process (shared memory).
    Threads,
    /// This process is one rank of an MPI job (`mpirun -n W fsdp train --backend mpi`); rank
    /// and world size come from MPI. Needs a binary built with `--features mpi`.
    Mpi,
    /// This process is one rank of an NCCL job on GPUs (`fsdp launch --nproc N -- train
    /// --device cuda --backend nccl`); rank, world size and GPU (`LOCAL_RANK`) come from
    /// torchrun's environment. Needs a binary built with `--features cuda`.
    Nccl,
}

/// A floating-point dtype for `--param-dtype` / `--reduce-dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DTypeArg {
    /// IEEE binary32 (aliases fp32, float32).
    #[value(alias = "fp32", alias = "float32")]
    F32,
    /// bfloat16, 8-bit exponent, 7-bit mantissa (alias bfloat16).
    #[value(alias = "bfloat16")]
    Bf16,
    /// IEEE binary16 (aliases fp16, float16, half).
    #[value(alias = "fp16", alias = "float16", alias = "half")]
    F16,
}

impl DTypeArg {
    /// The dtype.
    pub fn dtype(self) -> fsdp_types::DType {
        match self {
            DTypeArg::F32 => fsdp_types::DType::F32,
            DTypeArg::Bf16 => fsdp_types::DType::BF16,
            DTypeArg::F16 => fsdp_types::DType::F16,
        }
    }
}

/// `--activation-checkpointing` values (shared by `fsdp plan` and `fsdp train`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CheckpointingArg {
    /// Keep only each FSDP unit's input; recompute the unit's forward in backward.
    On,
    /// Keep every unit's autograd graph from forward to its backward.
    Off,
}

impl CheckpointingArg {
    /// The `PlanConfig::activation_checkpointing` value.
    pub fn enabled(self) -> bool {
        self == CheckpointingArg::On
    }
}

/// `--offload` values (shared by `fsdp plan` and `fsdp train`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OffloadArg {
    /// Everything on the compute device.
    None,
    /// f32 master and gradient shards and the optimizer state in host memory; the optimizer
    /// step on the CPU (ZeRO-Offload).
    Optimizer,
    /// As `optimizer`, and the parameter shards too (copied to the device for each
    /// all-gather).
    Params,
}

impl OffloadArg {
    /// The planner's value.
    pub fn offload(self) -> fsdp_planner::Offload {
        match self {
            OffloadArg::None => fsdp_planner::Offload::None,
            OffloadArg::Optimizer => fsdp_planner::Offload::Optimizer,
            OffloadArg::Params => fsdp_planner::Offload::Params,
        }
    }
}

/// Help text of `--offload` (the same for `fsdp plan` and `fsdp train`).
pub const OFFLOAD_HELP: &str = "What lives in host memory instead of on the compute device (ZeRO-Offload). `optimizer`: the f32 master and gradient shards and the optimizer state, with the optimizer step on the CPU; the device keeps the param_dtype shards. `params`: those and the parameter shards, each copied to the device for its all-gather. Default: none, except that --strategy auto offloads when nothing else fits (in `fsdp plan`, and in `fsdp train` on a GPU: on the CPU the device is host memory already), and says so";

/// Help text of `--activation-checkpointing` (the same for `fsdp plan` and `fsdp train`).
pub const CHECKPOINTING_HELP: &str = "Unit-level activation checkpointing. `on`: keep only each \
FSDP unit's input and recompute its forward in backward (activation memory of the unit inputs \
plus one unit's graph, for one extra forward of compute). `off`: keep every unit's autograd \
graph until its backward (more activation memory, no recompute). Independent of the strategy: \
full-shard without it still frees the unsharded parameters after forward and all-gathers them \
again for backward. Default: off (as PyTorch FSDP2: resharding frees parameters, \
recompute is opt-in)";

/// Parses a `--device-memory` value (shared by `fsdp plan` and `fsdp train`): bytes per
/// device (per rank), as `80GiB`, `80 GiB`, `40GB` (10^9), `512MiB`, `1.5TiB` or a plain byte
/// count (see `fsdp_types::Bytes`'s `FromStr`).
///
/// Errors: [`CliError::Usage`] (exit 2) naming the flag and the value.
pub fn parse_device_memory(s: &str) -> Result<Bytes, CliError> {
    let b = s
        .parse::<Bytes>()
        .map_err(|e| CliError::Usage(format!("--device-memory: {e}")))?;
    if b.0 == 0 {
        return Err(CliError::Usage(format!(
            "--device-memory {s}: a device of 0 bytes holds nothing; give the memory of one \
             device (per rank), e.g. 80GiB, or leave the flag out"
        )));
    }
    Ok(b)
}

/// Parses `--eval-batches`: a count of at least 1, or `all` (0).
///
/// Errors: the rule and the fix, for clap's message.
pub fn eval_batches(s: &str) -> Result<usize, String> {
    if s.trim() == "all" {
        return Ok(0);
    }
    match s.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "`{s}` is not a number of micro-batches; give a count of at least 1 or `all`"
        )),
    }
}

/// Checkpoint flags of `fsdp train` (flattened into its arguments).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TrainCkptArgs {
    /// Checkpoint root: sharded checkpoints `step-N/` and the `latest` pointer go here.
    #[arg(long)]
    pub ckpt_dir: Option<PathBuf>,
    /// Save a checkpoint every N optimizer steps (0: only after the last step). Needs
    /// --ckpt-dir.
    #[arg(long, default_value_t = 0, requires = "ckpt_dir")]
    pub ckpt_every: u64,
    /// Keep the newest K checkpoints (0: keep all). Needs --ckpt-dir.
    #[arg(long, default_value_t = 3, requires = "ckpt_dir")]
    pub keep_last: usize,
    /// Resume from the newest complete checkpoint in --ckpt-dir (start fresh if there is none).
    /// The run continues exactly: same losses and parameters as an uninterrupted run with the
    /// same flags. A different --world-size / --strategy reshards the state on load. A
    /// checkpoint already at or past --steps: "nothing to train", exit 0.
    /// A newest checkpoint that is damaged or incomplete is refused, naming it and the newest
    /// intact one (see --resume-from).
    #[arg(long, requires = "ckpt_dir")]
    pub resume: bool,
    /// Resume (as --resume) from checkpoint step STEP of --ckpt-dir, or from the newest intact
    /// one with `latest-valid`. Newer step directories (damaged, or from the abandoned run)
    /// are kept, moved aside as `step-N.damaged` / `step-N.superseded` at the first save, so
    /// new checkpoints and `latest` never mix with them.
    #[arg(long, value_name = "STEP|latest-valid", requires = "ckpt_dir")]
    pub resume_from: Option<String>,
    /// Start from published weights: a Hugging Face model directory (its config.json is the
    /// model unless --model or --hf-config is given), a model.safetensors, a sharded
    /// model.safetensors.index.json, or `fsdp ckpt consolidate` output; f32, bf16 or f16
    /// stored. Strict name and shape matching; every rank reads only its own shards' bytes;
    /// fresh optimizer state. With --resume the same command continues from the newest
    /// checkpoint in --ckpt-dir when there is one (its weights and optimizer state; the model
    /// still from this directory) and starts from these weights when there is none.
    /// With a tied config (tie_word_embeddings: true) a stored lm_head.weight must equal the
    /// embedding, else the run is refused (exit 2) naming both tensors: set
    /// "tie_word_embeddings": false to train the file's own head (transformers 4.x would
    /// overwrite it with the embedding, 5.x loads it untied).
    /// A directory's tokenizer and generation files are carried in every checkpoint and
    /// copied into `fsdp ckpt consolidate` model directories.
    #[arg(long)]
    pub init_from: Option<PathBuf>,
}

impl TrainCkptArgs {
    /// The resume these flags ask for, `None` for a fresh run.
    ///
    /// Errors: [`CliError::Usage`] for a `--resume-from` value that is neither a step number
    /// nor `latest-valid`.
    pub fn resume_mode(&self) -> Result<Option<ResumeFrom>, CliError> {
        match self.resume_from.as_deref().map(str::trim) {
            Some("latest-valid") => Ok(Some(ResumeFrom::LatestValid)),
            Some(v) => v
                .parse::<u64>()
                .map(|s| Some(ResumeFrom::Step(s)))
                .map_err(|_| {
                    CliError::Usage(format!(
                    "--resume-from {v}: expected a checkpoint step (e.g. --resume-from 20, see \
                     `fsdp ckpt inspect DIR`) or `latest-valid` (the newest intact checkpoint)"
                ))
                }),
            None if self.resume => Ok(Some(ResumeFrom::Newest)),
            None => Ok(None),
        }
    }

    /// The checkpoint configuration of the run these flags ask for.
    ///
    /// Errors: as [`TrainCkptArgs::resume_mode`].
    pub fn config(&self) -> Result<CheckpointConfig, CliError> {
        Ok(CheckpointConfig {
            dir: self.ckpt_dir.clone(),
            every: self.ckpt_every,
            keep_last: self.keep_last,
            resume: self.resume_mode()?,
            ..CheckpointConfig::default()
        })
    }
}

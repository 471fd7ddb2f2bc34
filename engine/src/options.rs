//! The options of a run, the first stage of its preparation: what `fsdp train` can be told
//! ([`TrainOptions`]), the checks that need no model ([`validate`]), the model the options
//! name ([`model_of`]) and the planner configuration they describe ([`plan_config`]).
//!
//! A run is prepared in one direction, each stage using only the ones before it:
//! options (this module) -> plan ([`crate::strategy`]: the strategy, `auto` resolved for a
//! memory budget) -> pre-flight ([`crate::preflight`]: the hosts' memory against the plan) ->
//! run ([`crate::run::prepare`] composes them into a [`crate::run::PreparedRun`], which
//! [`crate::train::train_prepared`] executes).

use crate::error::{EngineError, Result};
use crate::model::decoder::Decoder;
use crate::runtime::{NonFinitePolicy, Placement};
use fsdp_planner::{GradSync, PlanConfig, Strategy};
use std::path::PathBuf;

/// Everything `fsdp train` can be told.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Text file to train on (bytes are tokens) or token file (`fsdp data tokenize`, read
    /// window by window); `None`: the embedded project corpus.
    pub data: Option<PathBuf>,
    /// Model preset (`tiny`, `mini`, `small`, `base`, `llama-tiny`, ...); ignored when
    /// `hf_config` is set.
    pub model: String,
    /// A Hugging Face `config.json` to build the model from instead of a preset (`fsdp train
    /// --hf-config`): the spec `fsdp plan --hf-config` plans, with random weights.
    pub hf_config: Option<PathBuf>,
    /// Number of ranks (threads).
    pub world_size: usize,
    /// Sharding strategy (not `Auto`: [`crate::strategy::resolve_auto`] turns it into the strategy to run for a
    /// memory budget, as `fsdp train --strategy auto` does).
    pub strategy: Strategy,
    /// Sequences per micro-batch per rank.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step per rank.
    pub grad_accum: usize,
    /// Gradient sync every micro-batch or only on the last.
    pub grad_sync: GradSync,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Optimizer steps.
    pub steps: u64,
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate of the cosine decay.
    pub min_lr: f64,
    /// Linear warmup steps.
    pub warmup: u64,
    /// AdamW decoupled weight decay (on matrices only; the plan's spans).
    pub weight_decay: f64,
    /// Global L2 clipping norm (`None`: off).
    pub clip: Option<f64>,
    /// Seed of the initial weights and of the data order.
    pub seed: u64,
    /// Evaluate the validation loss every N steps (0: only at the end).
    pub eval_every: u64,
    /// At most this many global validation micro-batches per evaluation, shared by the
    /// ranks (0: all), so every world size evaluates the same windows.
    pub eval_batches: usize,
    /// Units gathered ahead (prefetch depth).
    pub prefetch: u64,
    /// Unit-level activation checkpointing (`fsdp train --activation-checkpointing`):
    /// `None` is the strategy's default (`fsdp_planner::config::default_activation_checkpointing`).
    pub activation_checkpointing: Option<bool>,
    /// What lives in host memory instead of on the compute device (`fsdp train --offload`):
    /// `None` is none, except that a resolved `--strategy auto` may set it when nothing else
    /// fits. An offloading run on the CPU computes on the CPU device
    /// ([`crate::run::prepare`] sets the placement).
    pub offload: Option<fsdp_planner::Offload>,
    /// dtype the units compute in and the all-gather moves (f32, bf16, f16); master weights,
    /// gradient shards and optimizer state stay f32. f16 turns on dynamic loss scaling.
    pub param_dtype: fsdp_types::DType,
    /// dtype of gradients in the reduce-scatter / all-reduce (f32 or bf16; the engine refuses
    /// f16); bf16 reductions accumulate in f32 (bf16 reduction made training unstable at a large
    /// world size: <https://github.com/pytorch/pytorch/issues/106395>).
    pub reduce_dtype: fsdp_types::DType,
    /// Compute threads per rank (`None`: cores / world size, at least 1).
    pub threads_per_rank: Option<usize>,
    /// Published weights to start from instead of the seeded initialisation (`fsdp train
    /// --init-from`): a Hugging Face model directory, a `.safetensors` file or a
    /// `model.safetensors.index.json`. Every rank reads only its own shards' bytes.
    pub init_from: Option<PathBuf>,
    /// Where flat buffers live and units compute (`fsdp train --device`): the host (default)
    /// or a device (CUDA: one process per GPU, `--backend nccl` when the world is larger
    /// than 1).
    pub placement: Placement,
    /// What a step with a non-finite gradient or loss does (`fsdp train --nonfinite`):
    /// `Auto` is skip under f16 loss scaling, error otherwise.
    pub nonfinite: NonFinitePolicy,
    /// Stop after this many skipped steps in a row (`fsdp train --max-skipped`; `None`: no
    /// limit).
    pub max_skipped: Option<u64>,
    /// Checkpoints are saved asynchronously (`fsdp train --ckpt-async`): each rank copies its
    /// shards into host staging buffers and a background writer saves them while the next
    /// steps train; the plan counts the staging in host memory.
    pub ckpt_async: bool,
    /// Write a Chrome trace of the training steps here (`fsdp train --trace`; see
    /// [`crate::trace`]). In a job of several processes rank R > 0 writes `PATH.rankR`.
    pub trace: Option<PathBuf>,
    /// The hardware profile of `fsdp train --hardware`: with `Strategy::Auto` the candidates
    /// that fit the budget are ranked by their step time predicted on it
    /// ([`fsdp_planner::plan_fastest_ranked`]) instead of the fixed order, and the run's step
    /// is predicted on it. `None`: the fixed order, no prediction.
    pub hardware: Option<fsdp_planner::time::HardwareProfile>,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            data: None,
            model: "tiny".into(),
            hf_config: None,
            world_size: 1,
            strategy: Strategy::FullShard,
            micro_batch: 8,
            grad_accum: 1,
            grad_sync: GradSync::EveryMicroBatch,
            seq_len: 128,
            steps: 200,
            lr: 1e-3,
            min_lr: 1e-4,
            warmup: 20,
            weight_decay: 0.1,
            clip: Some(1.0),
            seed: 1337,
            eval_every: 0,
            eval_batches: 16,
            prefetch: 1,
            activation_checkpointing: None,
            offload: None,
            param_dtype: fsdp_types::DType::F32,
            reduce_dtype: fsdp_types::DType::F32,
            threads_per_rank: None,
            init_from: None,
            placement: Placement::Host,
            nonfinite: NonFinitePolicy::Auto,
            max_skipped: Some(DEFAULT_MAX_SKIPPED),
            ckpt_async: false,
            trace: None,
            hardware: None,
        }
    }
}

/// Default of [`TrainOptions::max_skipped`]: 50 skipped steps in a row stop the run. f16 loss
/// scaling recovers from an overflow in at most 24 (2^24 is the largest scale), so only a run
/// whose gradients stay non-finite gets there.
pub const DEFAULT_MAX_SKIPPED: u64 = 50;

/// The smallest vocabulary that trains on bytes as tokens (every byte value is a token id).
pub const BYTE_VOCAB: u64 = 256;

/// The model `o` names (`o.hf_config`, else the preset `o.model`), checked against what the
/// run feeds it: byte tokens need a vocabulary of at least [`BYTE_VOCAB`], a token file one of
/// at least its header's vocabulary size (only the header of `o.data` is read), and
/// `o.seq_len` may not exceed a Llama's sliding window (Mistral), within which attention is
/// exact.
///
/// Errors: [`EngineError::Config`] naming the model, the field and the fix;
/// [`EngineError::Data`] for a token file whose header is bad or whose vocabulary is larger
/// than the model's.
pub fn model_of(o: &TrainOptions) -> Result<Decoder> {
    let model = Decoder::resolve(&o.model, o.hf_config.as_deref())
        .map_err(|e| EngineError::Config(e.to_string()))?;
    let token_file = match &o.data {
        Some(p) => crate::data::tokens::probe(p).map_err(|e| EngineError::Data(e.to_string()))?,
        None => None,
    };
    // Data that is not there is the first thing to name (not the vocabulary it cannot have).
    if let (None, Some(p)) = (token_file, &o.data) {
        if let Err(source) = std::fs::metadata(p) {
            return Err(EngineError::Data(
                crate::data::DataError::Io {
                    path: p.clone(),
                    source,
                }
                .to_string(),
            ));
        }
    }
    if let (Some(h), Some(p)) = (token_file, &o.data) {
        if h.vocab_size > model.vocab_size() {
            return Err(EngineError::Data(
                crate::data::DataError::VocabTooLarge {
                    source_name: p.display().to_string(),
                    vocab_size: h.vocab_size,
                    model: model.name().to_string(),
                    model_vocab: model.vocab_size(),
                }
                .to_string(),
            ));
        }
    } else if model.vocab_size() < BYTE_VOCAB {
        return Err(EngineError::Config(format!(
            "model {}: vocab_size {} is smaller than {BYTE_VOCAB}: fsdp train feeds bytes as token ids (0..=255); use a model with a vocabulary of at least {BYTE_VOCAB}",
            model.name(),
            model.vocab_size()
        )));
    }
    check_seq_len(&model, o.seq_len as u64)?;
    Ok(model)
}

/// Refuses a sequence length beyond a Llama-family model's sliding window (Mistral), within
/// which its attention is exact; `fsdp plan` and `fsdp train` refuse alike.
///
/// Errors: [`EngineError::Config`] naming the model, the window and the fix.
pub fn check_seq_len(model: &Decoder, seq_len: u64) -> Result<()> {
    if let (Decoder::Llama(_), Some((w, field))) = (model, model.max_seq_len()) {
        if seq_len > w {
            return Err(EngineError::Config(format!(
                "--seq-len {seq_len} exceeds model {}'s {field} {w}: attention is exact only \
                 within the window (sliding-window attention beyond it is not implemented); use \
                 --seq-len {w} or less",
                model.name()
            )));
        }
    }
    Ok(())
}

/// The inputs of the step-time model for a run of `o`: the global-norm clip when `--clip` is
/// on, the profile's ranks per node.
pub fn time_inputs(o: &TrainOptions) -> fsdp_planner::time::TimeInputs {
    fsdp_planner::time::TimeInputs {
        clip_grad_norm: o.clip.is_some(),
        ranks_per_node: None,
    }
}

/// Builds the plan configuration of `o`.
pub fn plan_config(o: &TrainOptions) -> PlanConfig {
    let mut c = PlanConfig::new(o.world_size as u64);
    c.strategy = o.strategy;
    c.grad_accum = o.grad_accum as u64;
    c.grad_sync = o.grad_sync;
    c.micro_batch = o.micro_batch as u64;
    c.seq_len = o.seq_len as u64;
    c.prefetch = o.prefetch;
    c.activation_checkpointing = o.activation_checkpointing;
    c.offload = o.offload;
    c.param_dtype = o.param_dtype;
    c.reduce_dtype = o.reduce_dtype;
    c.ckpt_async = o.ckpt_async;
    // On CUDA the model computes through the composite ops (`OpsPath::Auto`), which keep
    // other activations than the fused CPU ops.
    if o.placement.device().is_cuda() {
        c.activations = fsdp_planner::ActivationModel::Composite;
    }
    c
}

/// Checks the options that need no model or data.
///
/// Errors: [`EngineError::Config`] naming the flag and the value.
pub fn validate(o: &TrainOptions) -> Result<()> {
    let bad = |m: String| Err(EngineError::Config(m));
    if o.world_size == 0 {
        return bad("--world-size must be at least 1".into());
    }
    for (v, f) in [
        (o.micro_batch, "--micro-batch"),
        (o.grad_accum, "--grad-accum"),
        (o.seq_len, "--seq-len"),
    ] {
        if v == 0 {
            return bad(format!("{f} must be at least 1"));
        }
    }
    if o.steps == 0 {
        return bad("--steps must be at least 1".into());
    }
    if !(o.lr.is_finite() && o.lr > 0.0) {
        return bad(format!("--lr must be a positive number, got {}", o.lr));
    }
    if !(o.min_lr.is_finite() && o.min_lr >= 0.0 && o.min_lr <= o.lr) {
        return bad(format!("--min-lr must be in [0, --lr], got {}", o.min_lr));
    }
    if let Some(c) = o.clip {
        if !(c.is_finite() && c > 0.0) {
            return bad(format!("--clip must be a positive number, got {c}"));
        }
    }
    if o.strategy == Strategy::Auto {
        return bad("--strategy auto needs a memory budget: resolve it first (`resolve_auto`, as `fsdp train --strategy auto` does) or pick full-shard, shard-grad-op, no-shard or hybrid".into());
    }
    if o.threads_per_rank == Some(0) {
        return bad("--threads-per-rank must be at least 1".into());
    }
    if o.nonfinite == NonFinitePolicy::Error && o.param_dtype == fsdp_types::DType::F16 {
        return bad("--nonfinite error with --param-dtype f16: f16 loss scaling must skip the steps whose gradients overflow (it halves the scale and retries); use --nonfinite skip (the f16 default) and bound it with --max-skipped N".into());
    }
    if o.max_skipped == Some(0) {
        return bad("--max-skipped must be at least 1 (0 would stop at the first skipped step: use --nonfinite error for that)".into());
    }
    Ok(())
}

//! Evaluation of a model's weights on a data split (`fsdp eval`): the mean cross-entropy and
//! the perplexity over fixed windows, computed with the training engine's forward schedule on
//! `W` rank threads (full shard: every rank holds a shard of the weights and all-gathers each
//! unit for its forward), as training evaluates.
//!
//! The windows are those a training run evaluates: global evaluation micro-batch `v` holds the
//! split's windows `v*B .. (v+1)*B` in file order ([`Sampler::try_eval_batch`]). Batch `v` is
//! computed by rank `v % W`; every rank runs the same number of forwards (a rank past the last
//! batch recomputes an earlier one, whose loss is not counted). The per-batch loss sums are
//! gathered and added in batch order, so the loss is bitwise the same at every world size, and
//! equal to what `fsdp train` reports when it evaluates the same batches.

use crate::checkpoint::ckpt_to_engine;
use crate::data::{EvalSplit, Sampler, SamplerConfig, TokenSource};
use crate::error::{EngineError, Result};
use crate::init::{FileWeights, ParamSource};
use crate::model::decoder::Decoder;
use crate::optim::{AdamWConfig, Optimizer};
use crate::options::{check_seq_len, plan_config, TrainOptions};
use crate::runtime::{EngineConfig, InitSync, NonFinitePolicy, Placement, RankEngine, StagedModel};
use crate::train::to_micro_batch;
use fsdp_checkpoints::{Checkpoint, CheckpointLayout};
use fsdp_comm::{run_threads, Communicator, Topology, DEFAULT_TIMEOUT};
use fsdp_planner::{plan, Strategy};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

/// Where the weights evaluated come from.
#[derive(Debug, Clone, Copy)]
pub enum EvalWeights<'a> {
    /// Published weights, as `fsdp train --init-from` reads them: a Hugging Face model
    /// directory, a `.safetensors` file or a `model.safetensors.index.json`.
    Files(&'a std::path::Path),
    /// The master weights of an `fsdp train` checkpoint (opened and verified), resharded to
    /// the evaluation's world on load.
    Checkpoint(&'a Checkpoint),
}

/// What `fsdp eval` can be told.
#[derive(Debug, Clone)]
pub struct EvalOptions {
    /// The data: a token file (`fsdp data tokenize`) or a text (bytes as tokens).
    pub data: PathBuf,
    /// The windows evaluated: the validation split or the whole source.
    pub split: EvalSplit,
    /// Number of rank threads `W`.
    pub world_size: usize,
    /// Tokens per window `T` (each window is `T + 1` tokens).
    pub seq_len: usize,
    /// Windows per micro-batch `B`.
    pub micro_batch: usize,
    /// At most this many global micro-batches (0: the whole split).
    pub eval_batches: usize,
    /// dtype the units compute in (the weights are held in f32).
    pub param_dtype: fsdp_types::DType,
    /// Compute threads per rank (`None`: cores / world size, at least 1).
    pub threads_per_rank: Option<usize>,
}

/// The result of an evaluation.
#[derive(Debug, Clone, Serialize)]
pub struct EvalReport {
    /// The model's name.
    pub model: String,
    /// Parameters (tied once).
    pub params: u64,
    /// The data source's name.
    pub data: String,
    /// `val` or `all`.
    pub split: &'static str,
    /// Rank threads that evaluated.
    pub world_size: usize,
    /// Tokens per window.
    pub seq_len: usize,
    /// Windows per micro-batch.
    pub micro_batch: usize,
    /// Global micro-batches evaluated.
    pub batches: usize,
    /// Windows of the split (the batches may use fewer, or wrap around them when the split
    /// holds fewer than one micro-batch).
    pub split_windows: usize,
    /// Target tokens counted.
    pub tokens: u64,
    /// Sum of the per-token cross-entropies (nats).
    pub loss_sum: f64,
    /// Mean cross-entropy per target token (nats): `loss_sum / tokens`.
    pub loss: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
    /// Wall time of the evaluation (seconds, setup included).
    pub seconds: f64,
}

impl EvalSplit {
    /// `val` or `all`, as `fsdp eval --split` spells it.
    pub fn name(self) -> &'static str {
        match self {
            EvalSplit::Validation => "val",
            EvalSplit::All => "all",
        }
    }
}

/// Evaluates `model` with `weights` on `o.data` (see the module docs for the windows and the
/// order of the sum).
///
/// Errors: [`EngineError::Data`] for data that cannot be read, holds ids beyond the model's
/// vocabulary, or is shorter than one window; [`EngineError::Config`] / [`EngineError::Plan`]
/// for sizes the model or the planner refuse; [`EngineError::InitFiles`] for weight files
/// that do not hold this model; a checkpoint's read errors; any rank's failure.
pub fn evaluate(model: &Decoder, weights: EvalWeights<'_>, o: &EvalOptions) -> Result<EvalReport> {
    let t0 = Instant::now();
    let data_err = |e: crate::data::DataError| EngineError::Data(e.to_string());
    check_seq_len(model, o.seq_len as u64)?;
    let source = TokenSource::open(&o.data).map_err(data_err)?;
    source
        .check_vocab(model.name(), model.vocab_size())
        .map_err(data_err)?;
    let data_name = source.name().to_string();
    let w = o.world_size.max(1);
    let sampler = Sampler::new(
        source,
        SamplerConfig {
            seq_len: o.seq_len,
            micro_batch: o.micro_batch,
            grad_accum: 1,
            world_size: w,
            seed: 0,
        },
    )
    .map_err(data_err)?;
    let batches = sampler.eval_batch_count(o.split, o.eval_batches);
    if w > batches {
        return Err(EngineError::Config(format!(
            "--world-size {w} exceeds the {batches} micro-batch(es) evaluated: ranks beyond \
             them would only repeat work; pass --world-size {batches} or less (the loss is \
             the same at every world size)"
        )));
    }
    let topts = TrainOptions {
        world_size: w,
        strategy: Strategy::FullShard,
        micro_batch: o.micro_batch,
        seq_len: o.seq_len,
        param_dtype: o.param_dtype,
        data: Some(o.data.clone()),
        ..TrainOptions::default()
    };
    let plan = plan(model.spec(), &plan_config(&topts))?;
    let layout = match weights {
        EvalWeights::Checkpoint(_) => {
            Some(CheckpointLayout::from_plan(model.spec().clone(), &plan)?)
        }
        EvalWeights::Files(_) => None,
    };
    let init: Box<dyn ParamSource> = match weights {
        EvalWeights::Files(p) => Box::new(
            FileWeights::open(p, model.spec())
                .map_err(|source| EngineError::InitFiles { source })?,
        ),
        // Overwritten by the checkpoint's master weights before any forward.
        EvalWeights::Checkpoint(_) => Box::new(model.random_init(0)),
    };
    let ecfg = EngineConfig {
        optimizer: Optimizer::AdamW(AdamWConfig {
            lr: 0.0,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
        }),
        clip: None,
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // At most cores / W per rank, as training (more only spin for cores the others hold).
    let threads = crate::preflight::cap_threads(o.threads_per_rank, w, cores)
        .0
        .unwrap_or((cores / w).max(1));
    let topo = Topology::new(plan.shard_size as usize, w / plan.shard_size as usize)
        .map_err(|e| EngineError::Config(e.to_string()))?;
    let (sampler, plan, layout, init) = (&sampler, &plan, &layout, &*init);
    let body = |comm: &dyn Communicator| -> Result<(f64, u64)> {
        let rank = comm.rank();
        let mut e = RankEngine::new_from(model, plan, comm, ecfg, init, Placement::Host)?;
        if let (EvalWeights::Checkpoint(ck), Some(layout)) = (weights, layout) {
            let st = ck.load_rank(layout, rank as u64)?;
            let step = ck.manifest().train.step;
            e.import_state(&ckpt_to_engine(layout, rank as u64, st, step))?;
        }
        let mbs = rank_batches(sampler, o.split, batches, w, rank)?;
        Ok(sum_in_batch_order(&e.eval_each(&mbs)?, batches, w))
    };
    let results = run_threads(topo, DEFAULT_TIMEOUT, |comm| {
        let rank = comm.rank();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("rank{rank}-compute{i}"))
            .build()
            .map_err(|e| EngineError::Config(format!("thread pool: {e}")))?;
        let comm: Box<dyn Communicator> = Box::new(comm);
        pool.install(move || body(&*comm))
    });
    let outcome = crate::train::rank_outcomes(results)?.into_iter().next();
    let (loss_sum, tokens) =
        outcome.ok_or_else(|| EngineError::Config("no rank evaluated".into()))?;
    let loss = loss_sum / tokens.max(1) as f64;
    Ok(EvalReport {
        model: model.name().to_string(),
        params: model.spec().numel().0,
        data: data_name,
        split: o.split.name(),
        world_size: w,
        seq_len: o.seq_len,
        micro_batch: o.micro_batch,
        batches,
        split_windows: sampler.split_windows(o.split),
        tokens,
        loss_sum,
        loss,
        perplexity: loss.exp(),
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Rank `rank`'s share of the first `batches` global evaluation micro-batches of `split` on
/// `w` ranks: batches `rank, rank + W, ...`, `ceil(batches / W)` of them, so every rank runs
/// the same number of forwards; a rank past the last batch recomputes batch `v % batches`,
/// which [`sum_in_batch_order`] does not count.
///
/// Errors: [`EngineError::Data`] (naming the rank) when a token file cannot be read.
pub(crate) fn rank_batches(
    sampler: &Sampler,
    split: EvalSplit,
    batches: usize,
    w: usize,
    rank: usize,
) -> Result<Vec<crate::runtime::staged::MicroBatch>> {
    let batches = batches.max(1);
    (0..batches.div_ceil(w))
        .map(|j| {
            let b = sampler
                .try_eval_batch(split, (j * w + rank) % batches)
                .map_err(|e| EngineError::Data(format!("rank {rank}: {e}")))?;
            to_micro_batch(&b)
        })
        .collect()
}

/// The world's `(loss sum, target tokens)` over global batches `0..batches` from the
/// per-rank, per-micro-batch sums of [`RankEngine::eval_each`] over [`rank_batches`]: batch
/// `v` is rank `v % W`'s `v / W`-th, added one by one in batch order, so the sum depends on
/// the batches only, not on the world size.
pub(crate) fn sum_in_batch_order(all: &[Vec<(f64, u64)>], batches: usize, w: usize) -> (f64, u64) {
    let (mut sum, mut count) = (0f64, 0u64);
    for v in 0..batches.max(1) {
        let (s, c) = all[v % w][v / w];
        sum += s;
        count += c;
    }
    (sum, count)
}

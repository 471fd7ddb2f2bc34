//! `fsdp eval`: the loss and perplexity of a model's weights (a Hugging Face model directory
//! or an `fsdp train` checkpoint) on a data split, sharded over `--world-size` rank threads
//! as training is, over the windows training evaluates ([`crate::eval`]). The number does not
//! depend on the world size, bit for bit.

use super::args::{eval_batches, DTypeArg};
use super::{cli_error, CliError};
use crate::checkpoint::offline::open_verified;
use crate::checkpoint::resume::tokenizer_change;
use crate::checkpoint::HF_CONFIG_KEY;
use crate::data::EvalSplit;
use crate::eval::{evaluate, EvalOptions, EvalReport, EvalWeights};
use crate::model::decoder::Decoder;
use crate::runtime::StagedModel;
use fsdp_checkpoints::Checkpoint;
use std::path::PathBuf;

/// `--split`: which windows are evaluated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SplitArg {
    /// The held-out validation split (the last 10% of the tokens), as `fsdp train` evaluates.
    Val,
    /// The whole data, training split included.
    All,
}

/// Arguments of `fsdp eval`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("weights").required(true).args(["model_dir", "ckpt"])))]
pub struct EvalArgs {
    /// A Hugging Face model directory: its config.json and safetensors weights (as `fsdp
    /// train --init-from DIR`); its tokenizer.json, when present, is checked against the data.
    #[arg(long, value_name = "DIR")]
    pub model_dir: Option<PathBuf>,
    /// A checkpoint of `fsdp train`: a checkpoint root (its newest checkpoint) or a step
    /// directory. The model, --seq-len, --micro-batch and --param-dtype default to the
    /// checkpoint's.
    #[arg(long, value_name = "CK")]
    pub ckpt: Option<PathBuf>,
    /// The data: a token file from `fsdp data tokenize` or a text (bytes as tokens).
    #[arg(long, value_name = "FILE")]
    pub data: PathBuf,
    /// The windows evaluated: `val`, the held-out split `fsdp train` evaluates, or `all`.
    #[arg(long, value_enum, default_value_t = SplitArg::Val)]
    pub split: SplitArg,
    /// Rank threads sharing the work (full shard, as training); the loss is the same at every
    /// world size.
    #[arg(long, default_value_t = 1, value_parser = super::checks::at_least_one)]
    pub world_size: usize,
    /// Tokens per window (default: the checkpoint's, else 128).
    #[arg(long, value_parser = super::checks::at_least_one)]
    pub seq_len: Option<usize>,
    /// Windows per micro-batch (default: the checkpoint's, else 8).
    #[arg(long, value_parser = super::checks::at_least_one)]
    pub micro_batch: Option<usize>,
    /// Micro-batches evaluated, over all ranks: the first N of the split in file order, or
    /// `all`. `fsdp train --eval-batches N` (0 for all) evaluates the same windows at any
    /// world size.
    #[arg(long, value_name = "N|all", default_value = "16", value_parser = eval_batches)]
    pub eval_batches: usize,
    /// dtype the units compute in (default: the checkpoint's, else f32).
    #[arg(long, value_enum)]
    pub param_dtype: Option<DTypeArg>,
    /// Compute threads per rank (default: cores / world size, at least 1).
    #[arg(long, value_parser = super::checks::at_least_one)]
    pub threads_per_rank: Option<usize>,
    /// Evaluate although the data's token ids were not made by the model's tokenizer (the
    /// model directory's tokenizer.json, or the tokenizer of the checkpoint's token file).
    #[arg(long)]
    pub allow_tokenizer_mismatch: bool,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// The model of checkpoint `ck`: its preset, or the config.json `fsdp train` recorded in its
/// manifest; checked to be the checkpoint's model.
///
/// Errors: [`CliError::Usage`] when the checkpoint names neither, or they describe another
/// model.
fn checkpoint_model(ck: &Checkpoint) -> Result<Decoder, CliError> {
    let m = ck.manifest();
    let manifest = ck.dir().join(fsdp_checkpoints::MANIFEST_FILE);
    if let Ok(d) = Decoder::from_preset(&m.model_name) {
        if ck.check_model(d.spec()).is_ok() {
            return Ok(d);
        }
    }
    let Some(text) = m.train.extra.get(HF_CONFIG_KEY) else {
        return Err(CliError::Usage(format!(
            "{}: model {} is not a preset and the checkpoint records no config.json \
             (train.extra.{HF_CONFIG_KEY}); export it with `fsdp ckpt export --hf-config \
             CONFIG.json` and evaluate the export with --model-dir",
            manifest.display(),
            m.model_name
        )));
    };
    let file = format!("{} (train.extra.{HF_CONFIG_KEY})", manifest.display());
    let d = Decoder::from_hf_config_text(text, &file, &m.model_name)
        .map_err(|e| CliError::Usage(e.to_string()))?;
    ck.check_model(d.spec())
        .map_err(|e| CliError::Usage(e.to_string()))?;
    Ok(d)
}

/// Runs `fsdp eval`.
///
/// Errors: [`CliError::Usage`] (exit 2) for bad input: a missing or damaged model directory
/// or checkpoint, data of another tokenizer, sizes the model refuses; [`CliError::Failed`]
/// (exit 1) when a rank fails.
pub fn run(a: EvalArgs) -> Result<(), CliError> {
    crate::preflight::check_thread_world_size(a.world_size)?;
    let ck = match &a.ckpt {
        Some(p) => Some(open_verified(p, &mut |line| {
            crate::output::errln!("{line}")
        })?),
        None => None,
    };
    let extra = ck.as_ref().map(|c| &c.manifest().train.extra);
    let recorded = |key: &str| extra.and_then(|e| e.get(key)).cloned();
    let recorded_size = |key: &str| recorded(key).and_then(|v| v.parse::<usize>().ok());
    let (model, weights) = match (&ck, &a.model_dir) {
        (Some(ck), _) => {
            let model = checkpoint_model(ck)?;
            if let Some(change) = tokenizer_change(&ck.manifest().train.extra, Some(&a.data)) {
                let problem = format!(
                    "--data {}: {change}; pass the token file the checkpoint trained on ({}) or \
                     one made with the same tokenizer",
                    a.data.display(),
                    ck.manifest()
                        .train
                        .extra
                        .get("data")
                        .map_or("not recorded", String::as_str)
                );
                if a.allow_tokenizer_mismatch {
                    crate::output::errln!("note: --allow-tokenizer-mismatch: {problem}");
                } else {
                    return Err(CliError::Usage(format!(
                        "{problem} (or pass --allow-tokenizer-mismatch to evaluate anyway)"
                    )));
                }
            }
            (model, EvalWeights::Checkpoint(ck))
        }
        (None, Some(dir)) => {
            let cfg = dir.join(fsdp_checkpoints::hfdir::CONFIG_FILE);
            if !dir.is_dir() || !cfg.is_file() {
                return Err(CliError::Usage(format!(
                    "--model-dir {}: {}; pass a Hugging Face model directory (config.json and \
                     model.safetensors), or an `fsdp train` checkpoint with --ckpt",
                    dir.display(),
                    if dir.is_dir() {
                        "holds no config.json"
                    } else if dir.exists() {
                        "is not a directory"
                    } else {
                        "does not exist"
                    }
                )));
            }
            let flag = format!("--model-dir {}", dir.display());
            if let Some(n) = super::checks::check_data_tokenizer(
                &flag,
                dir,
                Some(&a.data),
                a.allow_tokenizer_mismatch,
            )? {
                crate::output::errln!("{n}");
            }
            let model =
                Decoder::from_hf_config(&cfg).map_err(|e| CliError::Usage(e.to_string()))?;
            (model, EvalWeights::Files(dir))
        }
        (None, None) => {
            return Err(CliError::Usage(
                "fsdp eval needs weights: --model-dir DIR or --ckpt CK".into(),
            ))
        }
    };
    let param_dtype = match a.param_dtype {
        Some(d) => d.dtype(),
        None => recorded("param_dtype")
            .and_then(|v| v.parse::<fsdp_types::DType>().ok())
            .unwrap_or(fsdp_types::DType::F32),
    };
    let o = EvalOptions {
        data: a.data.clone(),
        split: match a.split {
            SplitArg::Val => EvalSplit::Validation,
            SplitArg::All => EvalSplit::All,
        },
        world_size: a.world_size,
        seq_len: a
            .seq_len
            .or_else(|| recorded_size("seq_len"))
            .unwrap_or(128),
        micro_batch: a
            .micro_batch
            .or_else(|| recorded_size("micro_batch"))
            .unwrap_or(8),
        eval_batches: a.eval_batches,
        param_dtype,
        threads_per_rank: {
            let (t, warning) = crate::preflight::cap_threads(
                a.threads_per_rank,
                a.world_size,
                crate::preflight::cores(),
            );
            if let Some(w) = warning {
                crate::output::errln!("{w}");
            }
            t
        },
    };
    let report = evaluate(&model, weights, &o).map_err(cli_error)?;
    let source = match (&a.ckpt, &a.model_dir, &ck) {
        (Some(_), _, Some(ck)) => ck.dir().display().to_string(),
        (_, Some(d), _) => d.display().to_string(),
        _ => String::new(),
    };
    if a.json {
        let mut v = serde_json::to_value(&report).map_err(|e| CliError::Failed(e.to_string()))?;
        v["weights"] = serde_json::Value::String(source);
        v["param_dtype"] = serde_json::Value::String(param_dtype.to_string());
        crate::output::outln!("{v}");
    } else {
        print_report(&report, &source);
    }
    Ok(())
}

fn print_report(r: &EvalReport, source: &str) {
    crate::output::outln!(
        "evaluated {} ({} params) from {source} on {} | split {}: {} micro-batches of {} windows \
         of {} tokens ({} tokens) | world {}",
        r.model,
        fsdp_types::group_thousands(r.params),
        r.data,
        r.split,
        r.batches,
        r.micro_batch,
        r.seq_len,
        fsdp_types::group_thousands(r.tokens),
        r.world_size
    );
    crate::output::outln!(
        "loss {:.6} nats per token | perplexity {:.4} | {:.1} s",
        r.loss,
        r.perplexity,
        r.seconds
    );
}

//! `fsdp ckpt`: inspect, consolidate and reshard sharded checkpoints offline (no device, no
//! communicator). The work is in
//! [`crate::checkpoint`]; this module parses the flags and prints. Every bad input (truncated
//! or corrupted file, missing rank file, unknown format version, a checkpoint of another
//! model) is an error naming the file and the problem, exit code 2.

use super::args::StrategyArg;
use super::CliError;
use crate::checkpoint::offline::{
    consolidate, open_verified, reshard_checkpoint, ConsolidateRequest, Consolidated,
    ReshardRequest,
};
use fsdp_checkpoints::CkptError;
use fsdp_planner::config::MAX_WORLD_SIZE;
use fsdp_types::{Bytes, DType, Numel};
use std::path::PathBuf;

impl From<CkptError> for CliError {
    /// Every checkpoint error is bad input (exit code 2).
    fn from(e: CkptError) -> Self {
        CliError::Usage(e.to_string())
    }
}

/// Arguments of `fsdp ckpt`.
#[derive(Debug, clap::Args)]
pub struct CkptArgs {
    /// The checkpoint action.
    #[command(subcommand)]
    pub action: CkptAction,
}

/// `fsdp ckpt` actions. `DIR` is a checkpoint directory (`step-N`, with `manifest.json`) or a
/// checkpoint root (the newest complete checkpoint named by its `latest` pointer is used).
#[derive(Debug, clap::Subcommand)]
pub enum CkptAction {
    /// Print parameters (names, shapes, dtypes), world size, step, sizes; verify every
    /// file's SHA-256.
    Inspect {
        /// Checkpoint directory or root.
        dir: PathBuf,
        /// Print the manifest as JSON instead of a table (after verification).
        #[arg(long)]
        json: bool,
    },
    /// Write the full fp32 model with the original parameter names and shapes (tied
    /// parameters once, under the target's name, as Hugging Face does): one safetensors file,
    /// or for a GPT-2 or Llama-family model (Llama, Mistral, Qwen2) a Hugging Face model
    /// directory that
    /// `from_pretrained` loads (`config.json`, `model.safetensors` or shards with
    /// `model.safetensors.index.json`), with the tokenizer and generation files of the model
    /// directory the run started from (`--init-from DIR`, carried in the checkpoint) and
    /// bos/eos ids in config.json.
    Consolidate {
        /// Checkpoint directory or root.
        dir: PathBuf,
        /// Output: a new or empty directory for a GPT-2 or Llama-family model, else a
        /// safetensors file
        /// (a path ending in `.safetensors` writes the single file instead).
        #[arg(short, long)]
        output: PathBuf,
        /// Largest weight file of a model directory, as transformers' `max_shard_size`:
        /// `5GB` (10^9, the default), `500MB`, `2GiB`, or bytes. Above it the weights are
        /// split into `model-0000i-of-0000N.safetensors` files with an index.
        #[arg(long, value_name = "SIZE")]
        max_shard_size: Option<String>,
        /// The model's `config.json` for a model directory, for a checkpoint that does not
        /// record it (saved by an older build from `--hf-config`); it must describe the
        /// checkpoint's model.
        #[arg(long, value_name = "FILE")]
        hf_config: Option<PathBuf>,
        /// Also write the Adam moments (`{name}.exp_avg`, `{name}.exp_avg_sq`) to this file.
        #[arg(long)]
        optimizer_out: Option<PathBuf>,
    },
    /// Rewrite the checkpoint for another world size and/or sharding strategy.
    Reshard {
        /// Checkpoint directory or root.
        dir: PathBuf,
        /// Target world size (ranks).
        #[arg(long)]
        world_size: u64,
        /// Target strategy, the names of `fsdp train`: full-shard (zero3), shard-grad-op
        /// (zero2), shard-optimizer (zero1), all S = W; no-shard (ddp), S = 1; hybrid (hsdp,
        /// needs --shard-size).
        #[arg(long, value_enum, default_value_t = StrategyArg::FullShard)]
        strategy: StrategyArg,
        /// Shard-group size for `--strategy hybrid` (must divide the world size).
        #[arg(long)]
        shard_size: Option<u64>,
        /// Target segment alignment in elements (default: the source's).
        #[arg(long)]
        alignment: Option<u64>,
        /// Output checkpoint root (a `step-N` directory and a `latest` pointer are written).
        #[arg(short, long)]
        output: PathBuf,
        /// Write the checkpoint even when the shard size exceeds some unit's element count,
        /// so that ranks from that count on hold only padding of that unit.
        #[arg(long)]
        allow_padding_ranks: bool,
    },
}

/// Shard-group size of `strategy` at `world_size` (the `--strategy` of `fsdp train`).
///
/// Errors: [`CliError::Usage`] for hybrid without `--shard-size`, `--shard-size` with another
/// strategy, and `auto` (a checkpoint layout needs a definite strategy).
pub fn shard_size_for(
    strategy: StrategyArg,
    world_size: u64,
    shard_size: Option<u64>,
) -> Result<u64, CliError> {
    use StrategyArg as S;
    match (strategy, shard_size) {
        (S::FullShard | S::ShardGradOp | S::ShardOptimizer, None) => Ok(world_size),
        (S::NoShard, None) => Ok(1),
        (S::Hybrid, Some(s)) => Ok(s),
        (S::Hybrid, None) => Err(CliError::Usage(
            "--strategy hybrid needs --shard-size S (S divides --world-size)".into(),
        )),
        (S::Auto, _) => Err(CliError::Usage(
            "--strategy auto does not name a layout: reshard to full-shard, shard-grad-op, \
             shard-optimizer, no-shard or hybrid (fsdp train --resume reshards on load under auto)"
                .into(),
        )),
        (other, Some(_)) => Err(CliError::Usage(format!(
            "--shard-size only applies to --strategy hybrid (got {other:?})"
        ))),
    }
}

/// Prints a note or warning of the library on stderr.
fn note(line: String) {
    crate::output::errln!("{line}");
}

/// Runs `fsdp ckpt`.
pub fn run(args: CkptArgs) -> Result<(), CliError> {
    match args.action {
        CkptAction::Inspect { dir, json } => inspect(&dir, json),
        CkptAction::Consolidate {
            dir,
            output,
            optimizer_out,
            max_shard_size,
            hf_config,
        } => {
            let max_shard_size = max_shard_size
                .as_deref()
                .map(parse_max_shard_size)
                .transpose()?;
            let req = ConsolidateRequest {
                dir,
                output,
                max_shard_size,
                hf_config,
                optimizer_out,
            };
            let done = consolidate(&req, &mut note)?;
            use std::fmt::Write as _;
            let mut text = String::new();
            match &done.written {
                Consolidated::ModelDir(rep) => {
                    let _ = writeln!(
                        text,
                        "consolidated {} (step {}, world size {}) -> {}: config.json and {} weight \
                         file(s), {} tensors, {} elements, {}",
                        done.source.display(),
                        done.step,
                        done.world_size,
                        rep.dir.display(),
                        rep.files.len(),
                        rep.tensors,
                        Numel(rep.numel),
                        Bytes(rep.total_size)
                    );
                    for (file, bytes) in &rep.files {
                        let _ = writeln!(text, "  {file}: {}", Bytes(*bytes));
                    }
                    for (file, bytes) in &rep.other_files {
                        let _ = writeln!(text, "  {file}: {}", Bytes(*bytes));
                    }
                    for line in &done.notes {
                        let _ = writeln!(text, "  {line}");
                    }
                    for (tied, target) in &rep.tied_omitted {
                        let _ = writeln!(
                            text,
                            "  `{tied}` is tied to `{target}`: written once, as `{target}`"
                        );
                    }
                }
                Consolidated::File(rep) => {
                    let _ = writeln!(
                        text,
                        "consolidated {} (step {}, world size {}) -> {}: {} tensors, {} elements, {}",
                        done.source.display(),
                        done.step,
                        done.world_size,
                        rep.path.display(),
                        rep.tensors,
                        Numel(rep.numel),
                        Bytes(rep.bytes)
                    );
                    for (tied, target) in &rep.tied_omitted {
                        let _ = writeln!(
                            text,
                            "  `{tied}` is tied to `{target}`: written once, as `{target}`"
                        );
                    }
                }
            }
            if let Some((o, n)) = &done.optimizer {
                let _ = writeln!(text, "  optimizer state -> {}: {n} tensors", o.display());
            }
            // A closed pipe (`| head`) is not an error: the files are written.
            emit(&text)
        }
        CkptAction::Reshard {
            dir,
            world_size,
            strategy,
            shard_size,
            alignment,
            output,
            allow_padding_ranks,
        } => {
            if world_size == 0 {
                return Err(CliError::Usage("--world-size must be at least 1".into()));
            }
            if world_size > MAX_WORLD_SIZE {
                return Err(CliError::Usage(format!(
                    "--world-size {world_size} exceeds the planner's limit of {MAX_WORLD_SIZE} ranks"
                )));
            }
            let shard_size = shard_size_for(strategy, world_size, shard_size)?;
            let req = ReshardRequest {
                dir,
                world_size,
                shard_size,
                alignment,
                output,
                allow_padding_ranks,
            };
            let r = reshard_checkpoint(&req, &mut note)?;
            crate::output::outln!(
                "resharded {} (world size {} = shard {} x replicate {}) -> {} (world size {} = shard {} x replicate {}), step {}",
                r.source.display(),
                r.from.world_size,
                r.from.shard_size,
                r.from.replicate_size(),
                r.written.display(),
                r.to.world_size,
                r.to.shard_size,
                r.to.replicate_size(),
                r.step
            );
            Ok(())
        }
    }
}

/// `writeln!` into a `String` (infallible).
macro_rules! outln {
    ($o:expr) => {
        $o.push('\n')
    };
    ($o:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($o, $($arg)*);
    }};
}

/// Prints `text` to stdout; a closed stdout (`| head`) ends the printing, not the command
/// ([`crate::output`]).
fn emit(text: &str) -> Result<(), CliError> {
    crate::output::print_out(text);
    Ok(())
}

fn inspect(dir: &std::path::Path, json: bool) -> Result<(), CliError> {
    let ck = open_verified(dir, &mut note)?;
    let m = ck.manifest();
    let mut o = String::new();
    if json {
        outln!(
            o,
            "{}",
            serde_json::to_string_pretty(m).map_err(|e| CliError::Failed(e.to_string()))?
        );
        return emit(&o);
    }
    let l = ck.layout();
    let t = &m.train;
    outln!(o, "checkpoint   {}", ck.dir().display());
    outln!(o, "format       {} version {}", m.format, m.format_version);
    outln!(
        o,
        "model        {} (fingerprint {})",
        m.model_name,
        &m.model_fingerprint[..16]
    );
    outln!(o, "plan         {}", m.plan_fingerprint);
    outln!(
        o,
        "world size   {} = shard group {} x replicate group {} (alignment {} elements)",
        m.world_size,
        m.shard_size,
        m.replicate_size,
        m.alignment
    );
    outln!(o,
        "step         {} (optimizer {} step {}, lr {}, betas ({}, {}), eps {}, weight decay {}); data position {}{}",
        t.step,
        t.optimizer.name,
        t.optimizer.step,
        t.optimizer.lr,
        t.optimizer.beta1,
        t.optimizer.beta2,
        t.optimizer.eps,
        t.optimizer.weight_decay,
        t.data_position,
        match t.extra.get(crate::checkpoint::resume::DATA_POSITION_UNIT_KEY) {
            Some(unit) => format!(" {unit} consumed"),
            None => String::new(),
        }
    );
    let (mut real, mut pad, mut trainable) = (0u64, 0u64, 0u64);
    for (_, _, f) in l.flat_params() {
        real += f.real_numel().0;
        pad += f.padding_numel().0;
        if f.trainable {
            trainable += f.real_numel().0;
        }
    }
    outln!(
        o,
        "elements     {} ({} trainable), padding {} (never written to a file)",
        Numel(real),
        Numel(trainable),
        Numel(pad)
    );
    outln!(o);
    let w = l
        .spec
        .units
        .iter()
        .flat_map(|u| &u.params)
        .map(|p| p.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    outln!(
        o,
        "{:<w$}  {:<16} {:<5} {:>12}  {:<10} {:<9} state",
        "name",
        "shape",
        "dtype",
        "numel",
        "unit",
        "trainable"
    );
    for u in &l.spec.units {
        for p in &u.params {
            let state = match (&p.tied_to, p.trainable) {
                (Some(t), _) => format!("tied to {t}"),
                (None, true) => "param, exp_avg, exp_avg_sq".into(),
                (None, false) => "param".into(),
            };
            outln!(
                o,
                "{:<w$}  {:<16} {:<5} {:>12}  {:<10} {:<9} {state}",
                p.name,
                format!("{:?}", p.shape),
                DType::F32.name(),
                p.numel().to_string(),
                u.name,
                if p.trainable { "yes" } else { "no" },
            );
        }
    }
    outln!(o);
    let mut total = 0u64;
    for f in &m.files {
        total += f.bytes;
        outln!(
            o,
            "{}  rank {} (shard {})  {:>12}  sha256 {}  OK",
            f.file,
            f.rank,
            f.shard_index,
            Bytes(f.bytes).to_string(),
            f.sha256
        );
    }
    outln!(o,
        "{} rank files, {}: sizes and SHA-256 checksums verified (ranks of replicate index 0 write model state)",
        m.files.len(),
        Bytes(total)
    );
    for f in &m.model_files {
        outln!(
            o,
            "{}/{}  {:>12}  sha256 {}  OK",
            fsdp_checkpoints::MODEL_FILES_DIR,
            f.file,
            Bytes(f.bytes).to_string(),
            f.sha256
        );
    }
    emit(&o)
}

/// Parses `--max-shard-size` (transformers' `max_shard_size` spelling: `5GB` = 5 * 10^9,
/// `2GiB` = 2 * 2^30, or a byte count).
///
/// Errors: [`CliError::Usage`] (exit 2) for an unreadable or zero size.
pub fn parse_max_shard_size(s: &str) -> Result<Bytes, CliError> {
    let b = s
        .parse::<Bytes>()
        .map_err(|e| CliError::Usage(format!("--max-shard-size: {e}")))?;
    if b.0 == 0 {
        return Err(CliError::Usage(format!(
            "--max-shard-size {s}: a weight file holds at least one tensor; give a size such \
             as 5GB or 500MB"
        )));
    }
    Ok(b)
}

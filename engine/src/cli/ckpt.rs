//! `fsdp ckpt`: inspect, consolidate and reshard sharded checkpoints offline (no device, no
//! communicator). Every bad input (truncated or corrupted file, missing rank file, unknown
//! format version, a checkpoint of another model) is an error naming the file and the problem,
//! exit code 2.

use super::CliError;
use fsdp_checkpoints::{
    consolidate_optimizer_to_file, consolidate_to_file, consolidate_to_hf_dir, reshard, Checkpoint,
    CheckpointLayout, CkptError, Verify, DEFAULT_MAX_SHARD_BYTES,
};
use fsdp_planner::config::MAX_WORLD_SIZE;
use fsdp_types::{Bytes, DType, Numel};
use std::path::{Path, PathBuf};

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
    /// `model.safetensors.index.json`).
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
        /// (zero2), both S = W; no-shard (ddp), S = 1; hybrid (hsdp, needs --shard-size).
        /// shard-optimizer (zero1) is plan-only and refused.
        #[arg(long, value_enum, default_value_t = super::train::StrategyArg::FullShard)]
        strategy: super::train::StrategyArg,
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

/// Refuses a reshard output root `out` that already holds checkpoints (a `latest` pointer or a
/// step directory) or is the source checkpoint `src_dir` itself: writing there would replace a
/// checkpoint of the same step and move `latest` to the resharded one, possibly backwards past
/// newer checkpoints. A new or empty directory is fine.
///
/// Errors: [`CliError::Usage`] (exit 2) naming the directory.
fn refuse_occupied_output(out: &Path, src_dir: &Path) -> Result<(), CliError> {
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same(out, src_dir) {
        return Err(CliError::Usage(format!(
            "-o {}: is the source checkpoint; reshard into a new or empty directory",
            out.display()
        )));
    }
    if out.is_dir() {
        let held = fsdp_checkpoints::list_checkpoints(out)?;
        if out.join(fsdp_checkpoints::LATEST_FILE).is_file() || !held.is_empty() {
            return Err(CliError::Usage(format!(
                "-o {}: already holds checkpoints ({} step directories); resharding into it \
                 would replace them and move `latest`: choose a new or empty directory",
                out.display(),
                held.len()
            )));
        }
    }
    Ok(())
}

/// Refuses a reshard whose shard-group size `shard_size` exceeds the element count of the
/// source's largest flat parameter: shard indices from that count on would hold nothing but
/// padding in every flat parameter, so those rank files (one per shard index, each read and
/// written in full) would be empty of model state. This also bounds the number of files a
/// reshard writes by the model's size.
///
/// Errors: [`CliError::Usage`] giving the shard size, the element count and the world size.
pub fn check_reshard_size(
    src: &CheckpointLayout,
    world_size: u64,
    shard_size: u64,
) -> Result<(), CliError> {
    let largest = src
        .flat_params()
        .map(|(_, _, f)| f.unpadded_numel.0)
        .max()
        .unwrap_or(0);
    if shard_size > largest {
        return Err(CliError::Usage(format!(
            "--world-size {world_size}: shard size {shard_size} exceeds the {largest} elements of \
             the model's largest flat parameter, so ranks {largest}..{shard_size} of each shard \
             group would hold only padding; use a shard size of at most {largest} (--world-size, \
             or --strategy hybrid --shard-size)"
        )));
    }
    Ok(())
}

/// Shard-group size of `strategy` at `world_size` (the `--strategy` of `fsdp train`).
///
/// Errors: [`CliError::Usage`] for hybrid without `--shard-size`, `--shard-size` with another
/// strategy, and `auto` (a checkpoint layout needs a definite strategy).
pub fn shard_size_for(
    strategy: super::train::StrategyArg,
    world_size: u64,
    shard_size: Option<u64>,
) -> Result<u64, CliError> {
    use super::train::StrategyArg as S;
    match (strategy, shard_size) {
        (S::FullShard | S::ShardGradOp, None) => Ok(world_size),
        (S::NoShard, None) => Ok(1),
        (S::Hybrid, Some(s)) => Ok(s),
        (S::Hybrid, None) => Err(CliError::Usage(
            "--strategy hybrid needs --shard-size S (S divides --world-size)".into(),
        )),
        (S::ShardOptimizer, _) => Err(CliError::Usage(
            super::train::SHARD_OPTIMIZER_PLAN_ONLY.into(),
        )),
        (S::Auto, _) => Err(CliError::Usage(
            "--strategy auto does not name a layout: reshard to full-shard, shard-grad-op, \
             no-shard or hybrid (fsdp train --resume reshards on load under auto)"
                .into(),
        )),
        (other, Some(_)) => Err(CliError::Usage(format!(
            "--shard-size only applies to --strategy hybrid (got {other:?})"
        ))),
    }
}

/// Refuses, unless `allowed` (`--allow-padding-ranks`), a reshard whose shard size exceeds
/// the element count of some FSDP unit: the ranks from that count on hold nothing of that
/// unit but padding. The message names how many units are affected, the smallest one, and
/// the number of rank files the reshard would write.
///
/// Errors: [`CliError::Usage`] with the numbers and the two ways on.
pub fn check_padding_ranks(
    src: &CheckpointLayout,
    world_size: u64,
    shard_size: u64,
    allowed: bool,
) -> Result<(), CliError> {
    let mut sizes: Vec<(String, u64)> =
        src.spec.units.iter().map(|u| (u.name.clone(), 0)).collect();
    for (u, _, f) in src.flat_params() {
        sizes[u].1 += f.unpadded_numel.0;
    }
    let short: Vec<&(String, u64)> = sizes.iter().filter(|(_, n)| *n < shard_size).collect();
    let Some((name, smallest)) = short.iter().min_by_key(|(_, n)| *n).map(|x| (*x).clone()) else {
        return Ok(());
    };
    let g = fsdp_types::group_thousands;
    let msg = format!(
        "--world-size {world_size}: shard size {} exceeds the elements of {} of {} units \
         (smallest: {name}, {} elements), so ranks from there on hold only their padding; the \
         reshard would write {} rank files",
        g(shard_size),
        short.len(),
        sizes.len(),
        g(smallest),
        g(shard_size)
    );
    if allowed {
        eprintln!("warning: {msg} (--allow-padding-ranks)");
        return Ok(());
    }
    Err(CliError::Usage(format!(
        "{msg}; use a shard size of at most {} elements (--world-size, or --strategy hybrid \
         --shard-size), or pass --allow-padding-ranks to write it anyway",
        g(smallest)
    )))
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
            let max_shard = max_shard_size
                .as_deref()
                .map(parse_max_shard_size)
                .transpose()?;
            if let Some(o) = &optimizer_out {
                check_output_file("--optimizer-out", o)?;
            }
            let ck = Checkpoint::open(&dir, Verify::Checksums)?;
            // GPT-2 (with biases, as GPT2LMHeadModel has) and the Llama family export as a
            // model directory; a GPT without biases only as one state-dict file.
            let has_dir_form = match ck.manifest().spec.arch {
                fsdp_planner::Architecture::Llama(_) => true,
                fsdp_planner::Architecture::Gpt2(c) => c.bias,
                fsdp_planner::Architecture::Generic => false,
            };
            let to_file =
                !has_dir_form || output.extension().and_then(|e| e.to_str()) == Some("safetensors");
            if to_file {
                if max_shard.is_some() || hf_config.is_some() {
                    return Err(CliError::Usage(format!(
                        "--max-shard-size and --hf-config apply to a model directory, which \
                         is written for GPT-2 and Llama-family models to an -o path not \
                         ending in .safetensors; -o {} writes one safetensors file: leave them \
                         out",
                        output.display()
                    )));
                }
                check_output_file("-o", &output)?;
            } else {
                check_output_model_dir(&output)?;
            }
            for w in passed_over(&dir, ck.dir()) {
                eprintln!("{w}");
            }
            ck.verify_all()?;
            if !to_file {
                let config = export_config(&ck, hf_config.as_deref())?;
                let rep = consolidate_to_hf_dir(
                    &ck,
                    &output,
                    &config,
                    max_shard.map_or(DEFAULT_MAX_SHARD_BYTES, |b| b.0),
                )?;
                use std::fmt::Write as _;
                let mut text = String::new();
                let _ = writeln!(
                    text,
                    "consolidated {} (step {}, world size {}) -> {}: config.json and {} weight \
                     file(s), {} tensors, {} elements, {}",
                    ck.dir().display(),
                    ck.manifest().train.step,
                    ck.manifest().world_size,
                    rep.dir.display(),
                    rep.files.len(),
                    rep.tensors,
                    Numel(rep.numel),
                    Bytes(rep.total_size)
                );
                for (file, bytes) in &rep.files {
                    let _ = writeln!(text, "  {file}: {}", Bytes(*bytes));
                }
                for (tied, target) in &rep.tied_omitted {
                    let _ = writeln!(
                        text,
                        "  `{tied}` is tied to `{target}`: written once, as `{target}`"
                    );
                }
                if let Some(o) = optimizer_out {
                    let n = consolidate_optimizer_to_file(&ck, &o)?;
                    let _ = writeln!(text, "  optimizer state -> {}: {n} tensors", o.display());
                }
                return emit(&text);
            }
            if has_dir_form {
                eprintln!(
                    "note: writing one safetensors state dict; -o DIR (a path not ending in \
                     .safetensors) writes a Hugging Face model directory with config.json"
                );
            }
            let rep = consolidate_to_file(&ck, &output)?;
            use std::fmt::Write as _;
            let mut text = String::new();
            let _ = writeln!(
                text,
                "consolidated {} (step {}, world size {}) -> {}: {} tensors, {} elements, {}",
                ck.dir().display(),
                ck.manifest().train.step,
                ck.manifest().world_size,
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
            if let Some(o) = optimizer_out {
                let n = consolidate_optimizer_to_file(&ck, &o)?;
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
            let s = shard_size_for(strategy, world_size, shard_size)?;
            if output.exists() && !output.is_dir() {
                return Err(CliError::Usage(format!(
                    "-o {}: exists and is not a directory; give a new or empty directory",
                    output.display()
                )));
            }
            let ck = open_verified(&dir)?;
            let src = ck.layout();
            check_reshard_size(src, world_size, s)?;
            check_padding_ranks(src, world_size, s, allow_padding_ranks)?;
            let target = CheckpointLayout::new(
                src.spec.clone(),
                world_size,
                s,
                alignment.unwrap_or(src.alignment),
            )?;
            refuse_occupied_output(&output, ck.dir())?;
            let out = reshard(&ck, &target, &output)?;
            println!(
                "resharded {} (world size {} = shard {} x replicate {}) -> {} (world size {} = shard {} x replicate {}), step {}",
                ck.dir().display(),
                src.world_size,
                src.shard_size,
                src.replicate_size(),
                out.display(),
                target.world_size,
                target.shard_size,
                target.replicate_size(),
                ck.manifest().train.step
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

/// Prints `text` to stdout; a closed pipe (`| head`) is not an error.
fn emit(text: &str) -> Result<(), CliError> {
    use std::io::Write as _;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(CliError::Failed(format!("stdout: {e}")))
        }
        _ => Ok(()),
    }
}

fn inspect(dir: &std::path::Path, json: bool) -> Result<(), CliError> {
    let ck = open_verified(dir)?;
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
        "step         {} (optimizer {} step {}, lr {}, betas ({}, {}), eps {}, weight decay {}); data position {}",
        t.step,
        t.optimizer.name,
        t.optimizer.step,
        t.optimizer.lr,
        t.optimizer.beta1,
        t.optimizer.beta2,
        t.optimizer.eps,
        t.optimizer.weight_decay,
        t.data_position
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
    emit(&o)
}

/// Converts an engine rank state ([`crate::runtime::RankEngine::export_state`]) into the
/// checkpoint crate's `[unit][flat]` shards for `layout` (the run's layout).
///
/// Only AdamW state (`exp_avg`, `exp_avg_sq`) is stored by format version 1; a trainable
/// flat parameter with other optimizer buffers (SGD momentum) or without both moments is an
/// error, as is a flat parameter missing from the state.
///
/// Errors: `CkptError::InvalidArgument` naming the unit and flat parameter.
pub fn engine_to_ckpt(
    layout: &CheckpointLayout,
    st: &crate::runtime::RankState,
) -> Result<fsdp_checkpoints::RankState, CkptError> {
    let mut flats: Vec<Vec<Option<fsdp_checkpoints::FlatShard>>> = layout
        .units
        .iter()
        .map(|u| vec![None; u.flat_params.len()])
        .collect();
    for f in &st.flats {
        let slot = flats
            .get_mut(f.unit)
            .and_then(|u| u.get_mut(f.flat))
            .ok_or_else(|| {
                CkptError::InvalidArgument(format!(
                    "rank {}: the engine state has unit {} flat {}, which the layout lacks",
                    st.rank, f.unit, f.flat
                ))
            })?;
        let get = |name: &str| {
            f.optimizer_state
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        let (exp_avg, exp_avg_sq) = if f.trainable {
            match (get("exp_avg"), get("exp_avg_sq"), f.optimizer_state.len()) {
                (Some(m), Some(v), 2) => (Some(m), Some(v)),
                _ => {
                    return Err(CkptError::InvalidArgument(format!(
                        "rank {} unit {} flat {}: optimizer state {:?} is not AdamW's (exp_avg, exp_avg_sq); checkpoint format {} stores AdamW state only",
                        st.rank,
                        f.unit,
                        f.flat,
                        f.optimizer_state.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
                        fsdp_checkpoints::FORMAT_VERSION
                    )))
                }
            }
        } else {
            (None, None)
        };
        *slot = Some(fsdp_checkpoints::FlatShard {
            param: f.param.clone(),
            exp_avg,
            exp_avg_sq,
        });
    }
    let flats = flats
        .into_iter()
        .enumerate()
        .map(|(u, v)| {
            v.into_iter()
                .enumerate()
                .map(|(k, f)| {
                    f.ok_or_else(|| {
                        CkptError::InvalidArgument(format!(
                            "rank {}: the engine state lacks unit {u} flat {k}",
                            st.rank
                        ))
                    })
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(fsdp_checkpoints::RankState {
        rank: st.rank as u64,
        flats,
    })
}

/// Converts shards loaded for `rank` under `layout` (e.g. by
/// [`Checkpoint::load_rank`], possibly resharded) into the engine's rank state, ready for
/// [`crate::runtime::RankEngine::import_state`]. `optimizer_step` is Adam's step count; trainable
/// flat parameters without moments (a full file) get zero moments (a fresh AdamW state).
pub fn ckpt_to_engine(
    layout: &CheckpointLayout,
    rank: u64,
    st: fsdp_checkpoints::RankState,
    optimizer_step: u64,
) -> crate::runtime::RankState {
    let mut flats = Vec::new();
    for (u, unit) in st.flats.into_iter().enumerate() {
        for (k, f) in unit.into_iter().enumerate() {
            let trainable = layout.units[u].flat_params[k].trainable;
            let n = f.param.len();
            let optimizer_state = if trainable {
                vec![
                    (
                        "exp_avg".to_string(),
                        f.exp_avg.unwrap_or_else(|| vec![0.0; n]),
                    ),
                    (
                        "exp_avg_sq".to_string(),
                        f.exp_avg_sq.unwrap_or_else(|| vec![0.0; n]),
                    ),
                ]
            } else {
                Vec::new()
            };
            flats.push(crate::runtime::FlatShardState {
                unit: u,
                flat: k,
                trainable,
                param: f.param,
                optimizer_state,
            });
        }
    }
    crate::runtime::RankState {
        rank: rank as usize,
        world_size: layout.world_size as usize,
        shard_size: layout.shard_size as usize,
        shard_index: layout.shard_index(rank) as usize,
        plan_fingerprint: layout.plan_fingerprint.clone(),
        optimizer_step,
        skipped_steps: 0,
        loss_scaler: None,
        flats,
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
    /// fresh optimizer state.
    #[arg(long, conflicts_with_all = ["resume", "resume_from"])]
    pub init_from: Option<PathBuf>,
}

/// Which checkpoint a resume starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeFrom {
    /// The newest checkpoint; refused when it is damaged or incomplete (`--resume`).
    Newest,
    /// The newest checkpoint that opens and verifies (`--resume-from latest-valid`).
    LatestValid,
    /// The checkpoint of this step (`--resume-from STEP`).
    Step(u64),
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
}

/// A `step-N` directory under a checkpoint root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepDir {
    /// The step N.
    pub step: u64,
    /// The directory.
    pub path: PathBuf,
    /// Whether it holds `manifest.json` (a save writes it last: without it the directory is
    /// incomplete or damaged).
    pub has_manifest: bool,
}

/// Every `step-N` directory under `root` (with or without a manifest), newest first.
///
/// Errors: [`CliError::Usage`] when `root` cannot be listed.
pub fn step_dirs(root: &Path) -> Result<Vec<StepDir>, CliError> {
    let rd = std::fs::read_dir(root)
        .map_err(|e| CliError::Usage(format!("cannot list {}: {e}", root.display())))?;
    let mut out = Vec::new();
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(step) = fsdp_checkpoints::parse_step_dir(&name) {
            if e.path().is_dir() {
                out.push(StepDir {
                    step,
                    has_manifest: e.path().join(fsdp_checkpoints::MANIFEST_FILE).is_file(),
                    path: e.path(),
                });
            }
        }
    }
    out.sort_by_key(|d| std::cmp::Reverse(d.step));
    Ok(out)
}

/// Warnings about what resolving the checkpoint root `root` to `chosen` passed over: a
/// `latest` pointer naming a directory that is missing or has no manifest, and step
/// directories newer than `chosen` without a manifest. Empty when `root` is itself a
/// checkpoint directory.
pub fn passed_over(root: &Path, chosen: &Path) -> Vec<String> {
    let mut w = Vec::new();
    if root.join(fsdp_checkpoints::MANIFEST_FILE).is_file() {
        return w;
    }
    let chosen_step = chosen
        .file_name()
        .and_then(|n| fsdp_checkpoints::parse_step_dir(&n.to_string_lossy()))
        .unwrap_or(0);
    let latest = root.join(fsdp_checkpoints::LATEST_FILE);
    let mut named = None;
    if let Ok(t) = std::fs::read_to_string(&latest) {
        let name = t.trim().to_string();
        let d = root.join(&name);
        if d != chosen {
            let why = if d.is_dir() {
                "has no manifest.json (incomplete or damaged)"
            } else {
                "does not exist"
            };
            w.push(format!(
                "warning: {} names {name}, which {why}; using {}",
                latest.display(),
                chosen.display()
            ));
            named = Some(d);
        }
    }
    for d in step_dirs(root).unwrap_or_default() {
        if d.step > chosen_step && !d.has_manifest && Some(&d.path) != named.as_ref() {
            w.push(format!(
                "warning: {} has no manifest.json (incomplete or damaged), newer than {}; using {}",
                d.path.display(),
                chosen.display(),
                chosen.display()
            ));
        }
    }
    w
}

/// Opens the checkpoint at `dir` (a step directory or a root) as every `fsdp ckpt` action
/// does, printing on stderr what [`passed_over`] finds, then verifies every file.
///
/// Errors: any [`CkptError`] as [`CliError::Usage`].
fn open_verified(dir: &Path) -> Result<Checkpoint, CliError> {
    let ck = Checkpoint::open(dir, Verify::Checksums)?;
    for w in passed_over(dir, ck.dir()) {
        eprintln!("{w}");
    }
    ck.verify_all()?;
    Ok(ck)
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

/// Refuses a model-directory output before any work: an existing file, a non-empty directory
/// or a missing parent directory, naming the path and the fix.
///
/// Errors: [`CliError::Usage`] (exit 2).
pub fn check_output_model_dir(path: &Path) -> Result<(), CliError> {
    if path.is_file() {
        return Err(CliError::Usage(format!(
            "-o {}: is a file; a GPT-2 or Llama-family model is exported as a Hugging Face \
             model directory: give a new or empty directory, or a path ending in .safetensors \
             for one state-dict file",
            path.display()
        )));
    }
    if path.is_dir() {
        let n = std::fs::read_dir(path)
            .map_err(|e| CliError::Usage(format!("-o {}: {e}", path.display())))?
            .count();
        if n > 0 {
            return Err(CliError::Usage(format!(
                "-o {}: the directory is not empty ({n} entries); the export would mix with \
                 its files: give a new or empty directory",
                path.display()
            )));
        }
    }
    check_parent_exists("-o", path)
}

/// Manifest `train.extra` key holding the Hugging Face `config.json` text of a Llama-family
/// model, recorded by `fsdp train` at every save.
pub const HF_CONFIG_KEY: &str = "hf_config";

/// The `config.json` text to record for `model`, trained from the `config.json` at
/// `hf_config` (its text, as given) or a preset (generated from the preset's sizes and
/// numerics); `None` for a GPT without biases (its export is one safetensors file).
///
/// Errors: [`CliError::Usage`] when `hf_config` cannot be read.
pub fn hf_config_text(
    model: &crate::model::decoder::Decoder,
    hf_config: Option<&Path>,
) -> Result<Option<String>, CliError> {
    if let Some(p) = hf_config {
        return std::fs::read_to_string(p)
            .map(Some)
            .map_err(|e| CliError::Usage(format!("--hf-config {}: {e}", p.display())));
    }
    Ok(match model {
        crate::model::decoder::Decoder::Llama(l) => {
            Some(fsdp_planner::hf::llama_hf_config(&l.cfg, &l.numerics).to_string())
        }
        crate::model::decoder::Decoder::Gpt(g) => {
            fsdp_planner::hf::gpt2_hf_config(&g.cfg).map(|v| v.to_string())
        }
    })
}

/// The `config.json` of a GPT-2 or Llama-family checkpoint's model directory: `--hf-config FILE` when
/// given, else the text `fsdp train` recorded in the manifest ([`HF_CONFIG_KEY`]), else the
/// preset of the checkpoint's model name; checked to describe the checkpoint's model
/// ([`fsdp_planner::hf::export_hf_config`]).
///
/// Errors: [`CliError::Usage`] (exit 2) when none is available (naming `--hf-config`) or the
/// config describes another model.
fn export_config(ck: &Checkpoint, hf_config: Option<&Path>) -> Result<serde_json::Value, CliError> {
    let m = ck.manifest();
    let manifest = ck.dir().join(fsdp_checkpoints::MANIFEST_FILE);
    let (text, file) = if let Some(p) = hf_config {
        let t = std::fs::read_to_string(p)
            .map_err(|e| CliError::Usage(format!("--hf-config {}: {e}", p.display())))?;
        // A recorded config is the model trained: another file may not change its math.
        if let Some(recorded) = m.train.extra.get(HF_CONFIG_KEY) {
            let f = p.display().to_string();
            let same_shapes = fsdp_planner::hf::parse_hf_arch(&t, &f).ok() == Some(m.spec.arch);
            if let (fsdp_planner::Architecture::Llama(_), true) = (m.spec.arch, same_shapes) {
                let given = fsdp_planner::hf::parse_llama_numerics(&t, &f)
                    .map_err(|e| CliError::Usage(e.to_string()))?;
                let was = fsdp_planner::hf::parse_llama_numerics(recorded, "the manifest")
                    .map_err(|e| CliError::Usage(e.to_string()))?;
                if given != was {
                    let words = |n: &fsdp_planner::LlamaNumerics| {
                        format!(
                            "rms_norm_eps {}, rope_theta {}, rope_scaling {}, sliding_window {}",
                            n.rms_norm_eps,
                            n.rope_theta,
                            n.rope_scaling
                                .map_or("none".into(), |s| format!("llama3 x{}", s.factor)),
                            n.sliding_window.map_or("none".into(), |w| w.to_string())
                        )
                    };
                    return Err(CliError::Usage(format!(
                        "--hf-config {f}: its numerics ({}) are not those the checkpoint was \
                         trained with ({}, recorded in {}); transformers would compute another \
                         model. Leave --hf-config out to write the recorded config.json",
                        words(&given),
                        words(&was),
                        manifest.display()
                    )));
                }
            }
        }
        (t, p.display().to_string())
    } else if let Some(t) = m.train.extra.get(HF_CONFIG_KEY) {
        (
            t.clone(),
            format!("{} (train.extra.{HF_CONFIG_KEY})", manifest.display()),
        )
    } else if let (Some(c), Some(n)) = (
        fsdp_planner::presets::llama_config(&m.model_name),
        fsdp_planner::presets::llama_numerics(&m.model_name),
    ) {
        (
            fsdp_planner::hf::llama_hf_config(&c, &n).to_string(),
            format!("preset {}", m.model_name),
        )
    } else if let Some(v) = match m.spec.arch {
        fsdp_planner::Architecture::Gpt2(c) => fsdp_planner::hf::gpt2_hf_config(&c),
        _ => None,
    } {
        // A GPT-2's sizes are all in its architecture; its numerics are fixed.
        (
            v.to_string(),
            format!("the checkpoint's GPT-2 model {}", m.model_name),
        )
    } else {
        return Err(CliError::Usage(format!(
            "{}: the checkpoint does not record its model's config.json (model {}); pass \
             the config.json it was trained from with --hf-config FILE",
            manifest.display(),
            m.model_name
        )));
    };
    fsdp_planner::hf::export_hf_config(&text, &file, &m.spec.arch)
        .map_err(|e| CliError::Usage(e.to_string()))
}

/// Refuses an output file path that cannot be written, before any work: an existing
/// directory, or a parent directory that does not exist. `flag` names the flag in messages.
///
/// Errors: [`CliError::Usage`] naming the flag, the path and the fix.
pub fn check_output_file(flag: &str, path: &Path) -> Result<(), CliError> {
    if path.is_dir() {
        return Err(CliError::Usage(format!(
            "{flag} {}: is a directory; give a file path, e.g. {flag} {}",
            path.display(),
            path.join("model.safetensors").display()
        )));
    }
    check_parent_exists(flag, path)
}

/// Refuses an output `path` (given with `flag`) whose parent directory does not exist.
///
/// Errors: [`CliError::Usage`] (exit 2) naming the directory and the `mkdir -p` that fixes it.
fn check_parent_exists(flag: &str, path: &Path) -> Result<(), CliError> {
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return Err(CliError::Usage(format!(
            "{flag} {}: the directory {} does not exist; create it first (mkdir -p {})",
            path.display(),
            parent.display(),
            parent.display()
        )));
    }
    Ok(())
}

/// Checks `--init-from` against the run's model before any rank starts: opens the weight
/// files (headers only) and binds every tensor to a parameter strictly
/// ([`crate::init::FileWeights::open`]). Each rank later reads only its own shards' bytes.
///
/// Errors: [`CliError::Usage`] (exit 2) naming the file and the tensor: a missing, unexpected
/// or mis-shaped tensor (with the model's name and how to name the right configuration), a
/// truncated or malformed file, a per-rank shard file.
pub fn check_init_from(o: &crate::train::TrainOptions) -> Result<(), CliError> {
    let Some(p) = &o.init_from else {
        return Ok(());
    };
    let model = crate::train::model_of(o).map_err(super::train::cli_error)?;
    match crate::init::FileWeights::open(p, crate::runtime::StagedModel::spec(&model)) {
        Ok(_) => Ok(()),
        Err(
            e @ (CkptError::MissingKey { .. }
            | CkptError::UnexpectedKey { .. }
            | CkptError::ShapeMismatch { .. }),
        ) => {
            let model_desc = format!(
                "model {}{}",
                model.name(),
                o.hf_config
                    .as_ref()
                    .map(|c| format!(" (from {})", c.display()))
                    .unwrap_or_else(|| " (a preset)".into())
            );
            // What the files hold, to point at the right model.
            let family = fsdp_checkpoints::WeightFiles::open(p).ok().map(|w| {
                let names = w.tensors();
                if names.iter().any(|t| t.name.contains("model.layers.")) {
                    "Llama-family names (model.layers.N....)"
                } else if names
                    .iter()
                    .any(|t| t.name.starts_with("transformer.") || t.name.starts_with("h."))
                {
                    "GPT-2 names"
                } else {
                    "names of another model"
                }
            });
            let sibling = p
                .parent()
                .map(|d| d.join(fsdp_checkpoints::hfdir::CONFIG_FILE))
                .filter(|c| !p.is_dir() && c.is_file() && o.hf_config.as_deref() != Some(c));
            let fix = match (&sibling, o.hf_config.is_some()) {
                (Some(c), _) => format!(
                    "pass the config.json beside them (--hf-config {}), or their directory as \
                     --init-from",
                    c.display()
                ),
                (None, true) => "pass the config.json they were saved with (--hf-config)".into(),
                (None, false) => "name their model: --hf-config with the config.json they were \
                     saved with, --model with the preset they were trained as, or their model \
                     directory as --init-from"
                    .into(),
            };
            let why = if matches!(e, CkptError::MissingKey { .. }) {
                "Either the weights are incomplete (a file or an index entry missing) or they \
                 belong to another model than"
            } else {
                "The weights belong to another model than"
            };
            Err(CliError::Usage(format!(
                "{e}. {why} {model_desc}{}: {fix}",
                family
                    .map(|f| format!("; the files hold {f}"))
                    .unwrap_or_default()
            )))
        }
        Err(e) => Err(e.into()),
    }
}

/// The checkpoint layer of `fsdp train` ([`crate::train::TrainHooks`]): resumes every rank
/// from the newest complete checkpoint (resharding if the run's layout differs) and saves a
/// sharded checkpoint every `--ckpt-every` steps and after the last step, with the crash-safe
/// protocol of `fsdp_checkpoints::save`.
///
/// Saving: rank 0 creates the temporary directory; every rank of replicate index 0 writes its
/// own rank file (in parallel); rank 0 writes the manifest, renames the directory into place
/// and updates `latest`. Between the phases the ranks all-gather a status (a barrier that works
/// for rank threads and MPI processes alike), so every rank fails together and nothing partial
/// is ever published.
pub struct CheckpointHooks {
    root: Option<PathBuf>,
    every: u64,
    keep_last: usize,
    last_step: u64,
    layout: CheckpointLayout,
    resume_from: Option<Checkpoint>,
    train: fsdp_checkpoints::TrainState,
    /// Step directories newer than the resumed checkpoint and where rank 0 moves them before
    /// the first save (`--resume-from`); emptied once done.
    set_aside: std::sync::Mutex<Vec<(PathBuf, PathBuf)>>,
    on_save: Option<SaveCallback>,
}

/// What a completed checkpoint save reports (rank 0): [`CheckpointHooks::on_save`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SaveReport {
    /// The step saved.
    pub step: u64,
    /// The checkpoint directory written.
    pub path: PathBuf,
    /// Bytes of its files (rank files and manifest).
    pub bytes: u64,
    /// Wall time of the save, from the first rank's export to `latest` updated.
    pub seconds: f64,
}

/// The callback [`CheckpointHooks::on_save`] installs.
pub type SaveCallback = Box<dyn Fn(&SaveReport) + Send + Sync>;

impl std::fmt::Debug for CheckpointHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointHooks")
            .field("root", &self.root)
            .field("every", &self.every)
            .field("resume_from", &self.resume_from)
            .finish()
    }
}

impl CheckpointHooks {
    /// Builds the hooks of a run with options `o` (after `--init-from` was applied) and flags
    /// `a`. With `--resume` / `--resume-from`, picks the checkpoint ([`choose_resume`]),
    /// verifies every checksum and checks that it holds this model and was trained with this
    /// `--seed` (the data order depends on it), before any rank starts; prints on stderr what
    /// the resume changes ([`super::checks::resume_changes`]).
    ///
    /// Errors: [`CliError::Usage`] (exit 2) for any checkpoint problem, naming the file.
    pub fn new(a: &TrainCkptArgs, o: &crate::train::TrainOptions) -> Result<Self, CliError> {
        let model = crate::train::model_of(o).map_err(super::train::cli_error)?;
        let spec = crate::runtime::StagedModel::spec(&model);
        let plan = fsdp_planner::plan(spec, &crate::train::plan_config(o))
            .map_err(|e| CliError::Usage(e.to_string()))?;
        let layout = CheckpointLayout::from_plan(spec.clone(), &plan)?;
        if let Some(root) = &a.ckpt_dir {
            check_ckpt_dir(root)?;
            if a.resume_mode()?.is_none() {
                refuse_fresh_run_into_checkpoints(root)?;
            }
        }
        let mut resume_from = None;
        let mut set_aside = Vec::new();
        if let Some(mode) = a.resume_mode()? {
            let root = a
                .ckpt_dir
                .as_deref()
                .expect("clap: --resume / --resume-from require --ckpt-dir");
            let dirs = step_dirs(root)?;
            if dirs.is_empty() && mode != ResumeFrom::Newest {
                return Err(CliError::Usage(format!(
                    "--resume-from {}: {} holds no checkpoint (no step-N directory)",
                    a.resume_from.as_deref().unwrap_or(""),
                    root.display()
                )));
            }
            if dirs.is_empty() {
                eprintln!(
                    "no checkpoint in {} yet: starting from step 0",
                    root.display()
                );
            } else {
                let (ck, aside) = choose_resume(root, &dirs, mode, spec)?;
                let saved_seed = ck.manifest().train.extra.get("seed").cloned();
                if let Some(s) = saved_seed.filter(|s| *s != o.seed.to_string()) {
                    return Err(CliError::Usage(format!(
                        "{}: the checkpoint was trained with --seed {s}, this run has --seed {}; the data order would differ (pass --seed {s})",
                        ck.dir().join(fsdp_checkpoints::MANIFEST_FILE).display(),
                        o.seed
                    )));
                }
                eprintln!(
                    "resuming from {} (step {}, saved at world size {} = shard {} x replicate {})",
                    ck.dir().display(),
                    ck.manifest().train.step,
                    ck.manifest().world_size,
                    ck.manifest().shard_size,
                    ck.manifest().replicate_size
                );
                for (key, now) in [
                    ("param_dtype", o.param_dtype.to_string()),
                    ("reduce_dtype", o.reduce_dtype.to_string()),
                ] {
                    if let Some(was) = ck.manifest().train.extra.get(key).filter(|w| **w != now) {
                        eprintln!(
                            "note: the checkpoint was trained with {key} {was}, this run uses {now} (master weights and optimizer state are f32 either way)"
                        );
                    }
                }
                for line in super::checks::resume_changes(
                    &ck.manifest().train.extra,
                    ck.manifest().world_size,
                    ck.manifest().train.step,
                    o,
                ) {
                    eprintln!("note: resuming with {line}");
                }
                for (from, to) in &aside {
                    eprintln!(
                        "note: {} is newer than the checkpoint resumed; it is kept and moved to {} at the first save",
                        from.display(),
                        to.display()
                    );
                }
                set_aside = aside;
                resume_from = Some(ck);
            }
        }
        let mut extra = std::collections::BTreeMap::new();
        for (k, v) in [
            ("model", o.model.clone()),
            ("seed", o.seed.to_string()),
            ("steps", o.steps.to_string()),
            ("warmup", o.warmup.to_string()),
            ("min_lr", o.min_lr.to_string()),
            ("micro_batch", o.micro_batch.to_string()),
            ("grad_accum", o.grad_accum.to_string()),
            ("seq_len", o.seq_len.to_string()),
            ("strategy", plan.strategy.cli_name().to_string()),
            ("param_dtype", o.param_dtype.to_string()),
            ("reduce_dtype", o.reduce_dtype.to_string()),
            (
                "data",
                o.data
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "(embedded corpus)".into()),
            ),
        ] {
            extra.insert(k.to_string(), v);
        }
        extra.extend(super::checks::data_extra(o));
        if let Some(t) = hf_config_text(&model, o.hf_config.as_deref())? {
            extra.insert(HF_CONFIG_KEY.to_string(), t);
        }
        let train = fsdp_checkpoints::TrainState {
            step: 0,
            data_position: 0,
            rng_state: vec![o.seed],
            optimizer: fsdp_checkpoints::OptimizerState {
                name: "adamw".into(),
                lr: o.lr,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: o.weight_decay,
                step: 0,
            },
            extra,
        };
        Ok(CheckpointHooks {
            root: a.ckpt_dir.clone(),
            every: a.ckpt_every,
            keep_last: a.keep_last,
            last_step: o.steps,
            layout,
            resume_from,
            train,
            set_aside: std::sync::Mutex::new(set_aside),
            on_save: None,
        })
    }

    /// Calls `f` on rank 0 after every completed save (`fsdp train` prints `saved step N to
    /// DIR in S s`, or a `{"event": "checkpoint", ...}` line with `--json`).
    pub fn on_save(&mut self, f: SaveCallback) {
        self.on_save = Some(f);
    }
}

/// A name beside `dir` for setting it aside: `step-N.<what>`, then `step-N.<what>.2`, ... up
/// to the first that does not exist.
fn aside_name(dir: &Path, what: &str) -> PathBuf {
    let base = format!("{}.{what}", dir.display());
    let mut p = PathBuf::from(&base);
    let mut i = 2;
    while p.exists() {
        p = PathBuf::from(format!("{base}.{i}"));
        i += 1;
    }
    p
}

/// Opens and fully verifies the checkpoint directory `dir` for `spec`.
fn open_intact(dir: &Path, spec: &fsdp_planner::ModelSpec) -> Result<Checkpoint, CkptError> {
    let ck = Checkpoint::open(dir, Verify::Checksums)?;
    ck.verify_all()?;
    ck.check_model(spec)?;
    Ok(ck)
}

/// Picks the checkpoint a resume starts from among `dirs` (the step directories of `root`,
/// newest first, from [`step_dirs`]) and the newer step directories to set aside before the
/// first save (damaged ones as `step-N.damaged`, intact ones as `step-N.superseded`).
///
/// - [`ResumeFrom::Newest`]: the newest step directory (or the one `latest` names, if newer
///   is absent); when it is damaged or incomplete, refuses, naming it, the error and the
///   newest intact checkpoint with the flag that resumes from it.
/// - [`ResumeFrom::LatestValid`]: the newest that opens and verifies; each damaged newer one
///   is named on stderr.
/// - [`ResumeFrom::Step`]: that step's directory, which must be intact.
///
/// Errors: [`CliError::Usage`] (exit 2) naming the directories.
pub fn choose_resume(
    root: &Path,
    dirs: &[StepDir],
    mode: ResumeFrom,
    spec: &fsdp_planner::ModelSpec,
) -> Result<(Checkpoint, Vec<(PathBuf, PathBuf)>), CliError> {
    let why = |d: &StepDir| -> Option<String> {
        if !d.has_manifest {
            return Some("no manifest.json (incomplete or damaged)".into());
        }
        open_intact(&d.path, spec).err().map(|e| e.to_string())
    };
    let newest_intact = |skip: usize| -> Option<(usize, Checkpoint)> {
        dirs.iter()
            .enumerate()
            .skip(skip)
            .find_map(|(i, d)| open_intact(&d.path, spec).ok().map(|c| (i, c)))
    };
    let aside_of = |upto: usize, damaged: &[usize]| -> Vec<(PathBuf, PathBuf)> {
        dirs[..upto]
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let what = if damaged.contains(&i) {
                    "damaged"
                } else {
                    "superseded"
                };
                (d.path.clone(), aside_name(&d.path, what))
            })
            .collect()
    };
    match mode {
        ResumeFrom::Newest => {
            let newest = &dirs[0];
            let latest = root.join(fsdp_checkpoints::LATEST_FILE);
            let pointer = std::fs::read_to_string(&latest)
                .ok()
                .map(|t| t.trim().to_string());
            if let Some(problem) = why(newest) {
                let pointer_note = match &pointer {
                    Some(p) if root.join(p) == newest.path => " (`latest` names it)".to_string(),
                    _ => String::new(),
                };
                let hint = match newest_intact(1) {
                    Some((_, ck)) => format!(
                        "the newest intact checkpoint is {} (step {}): resume from it with \
                         --resume-from latest-valid (or --resume-from {}), which keeps {}, moved \
                         aside as {}.damaged",
                        ck.dir().display(),
                        ck.manifest().train.step,
                        ck.manifest().train.step,
                        newest.path.display(),
                        newest.path.display()
                    ),
                    None => format!(
                        "no older checkpoint in {} is intact either; start over without \
                         --resume in a new --ckpt-dir",
                        root.display()
                    ),
                };
                return Err(CliError::Usage(format!(
                    "cannot resume from the newest checkpoint {}{pointer_note}: {problem}; {hint}",
                    newest.path.display()
                )));
            }
            let ck = open_intact(&newest.path, spec)?;
            for w in passed_over(root, ck.dir()) {
                eprintln!("{w}");
            }
            Ok((ck, Vec::new()))
        }
        ResumeFrom::LatestValid => {
            let Some((i, ck)) = newest_intact(0) else {
                return Err(CliError::Usage(format!(
                    "--resume-from latest-valid: none of the {} checkpoints in {} is intact; \
                     start over without --resume in a new --ckpt-dir",
                    dirs.len(),
                    root.display()
                )));
            };
            let damaged: Vec<usize> = (0..i).collect();
            for d in &dirs[..i] {
                eprintln!(
                    "warning: skipping {}: {}",
                    d.path.display(),
                    why(d).unwrap_or_else(|| "damaged".into())
                );
            }
            Ok((ck, aside_of(i, &damaged)))
        }
        ResumeFrom::Step(step) => {
            let Some(i) = dirs.iter().position(|d| d.step == step) else {
                let have: Vec<String> = dirs.iter().rev().map(|d| d.step.to_string()).collect();
                return Err(CliError::Usage(format!(
                    "--resume-from {step}: {} has no checkpoint of step {step} (steps there: {})",
                    root.display(),
                    have.join(", ")
                )));
            };
            if let Some(problem) = why(&dirs[i]) {
                return Err(CliError::Usage(format!(
                    "--resume-from {step}: {}: {problem}; pick another step or --resume-from \
                     latest-valid",
                    dirs[i].path.display()
                )));
            }
            let ck = open_intact(&dirs[i].path, spec)?;
            let damaged: Vec<usize> = (0..i).filter(|&k| why(&dirs[k]).is_some()).collect();
            Ok((ck, aside_of(i, &damaged)))
        }
    }
}

/// Makes sure `--ckpt-dir` can take checkpoints before any rank starts, so a bad path is
/// refused in a second rather than after the whole run, when the first save would fail and the
/// training would be lost: creates the directory (and its parents) if missing, then creates and
/// removes a probe file in it.
///
/// Errors: [`CliError::Usage`] (exit 2) when the path exists and is not a directory, cannot be
/// created, or is not writable, naming the path and the OS error.
fn check_ckpt_dir(root: &std::path::Path) -> Result<(), CliError> {
    let bad = |what: &str, e: std::io::Error| {
        CliError::Usage(format!(
            "--ckpt-dir {}: {what} ({e}); no training was started",
            root.display()
        ))
    };
    if root.exists() && !root.is_dir() {
        return Err(CliError::Usage(format!(
            "--ckpt-dir {}: exists and is not a directory; no training was started",
            root.display()
        )));
    }
    if root.join(fsdp_checkpoints::MANIFEST_FILE).is_file() {
        let parent = root
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let step = root
            .file_name()
            .and_then(|n| fsdp_checkpoints::parse_step_dir(&n.to_string_lossy()));
        return Err(CliError::Usage(format!(
            "--ckpt-dir {}: is a checkpoint (it holds manifest.json), not a checkpoint root: new \
             checkpoints and `latest` would be written inside it; use --ckpt-dir {}{}",
            root.display(),
            parent.display(),
            step.map(|s| format!(" --resume-from {s}"))
                .unwrap_or_default()
        )));
    }
    std::fs::create_dir_all(root).map_err(|e| bad("cannot create the directory", e))?;
    let probe = root.join(format!(".fsdp-write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| bad("cannot write into the directory", e))?;
    std::fs::remove_file(&probe).map_err(|e| bad("cannot remove a file from the directory", e))?;
    Ok(())
}

/// Refuses a fresh run (no `--resume`) whose `--ckpt-dir` already holds checkpoints: its saves
/// would mix with another run's, `--keep-last` would prune by step number (deleting the new
/// run's lower steps while keeping the old run's higher ones), and a later `--resume` could
/// continue the wrong run.
///
/// Errors: [`CliError::Usage`] (exit 2) naming the directory, its newest step and the fixes.
fn refuse_fresh_run_into_checkpoints(root: &Path) -> Result<(), CliError> {
    let dirs = step_dirs(root)?;
    let latest = root.join(fsdp_checkpoints::LATEST_FILE).is_file();
    if dirs.is_empty() && !latest {
        return Ok(());
    }
    let newest = dirs
        .iter()
        .map(|d| d.path.display().to_string())
        .next()
        .unwrap_or_else(|| {
            root.join(fsdp_checkpoints::LATEST_FILE)
                .display()
                .to_string()
        });
    Err(CliError::Usage(format!(
        "--ckpt-dir {}: already holds checkpoints of a run ({} step directories, newest {newest}); \
         a fresh run would mix its checkpoints with them: pass --resume (or --resume-from STEP) \
         to continue that run, or give a new or empty --ckpt-dir",
        root.display(),
        dirs.len()
    )))
}

impl CheckpointHooks {
    /// The 0-based step a `--resume` run continues from (the number of optimizer steps the
    /// checkpoint has completed) and the checkpoint's directory; `None` when the run starts
    /// fresh.
    pub fn resume_step(&self) -> Option<(u64, &std::path::Path)> {
        self.resume_from
            .as_ref()
            .map(|ck| (ck.manifest().train.step, ck.dir()))
    }
}

/// Total bytes of the files directly in `dir` (0 for what cannot be read).
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

impl CheckpointHooks {
    /// Rank 0, before the first save of a `--resume-from` run: moves the newer step
    /// directories aside (kept, renamed) so that the new checkpoints, `latest` and pruning
    /// never mix with them.
    fn move_aside(&self) -> Result<(), String> {
        let mut pending = self
            .set_aside
            .lock()
            .map_err(|_| "set-aside list poisoned".to_string())?;
        for (from, to) in pending.drain(..) {
            std::fs::rename(&from, &to).map_err(|e| {
                format!(
                    "cannot move {} aside to {}: {e}",
                    from.display(),
                    to.display()
                )
            })?;
            eprintln!("moved {} aside to {}", from.display(), to.display());
        }
        Ok(())
    }
}

impl crate::train::TrainHooks for CheckpointHooks {
    fn resume(
        &self,
        rank: usize,
    ) -> crate::error::Result<Option<(crate::runtime::RankState, u64)>> {
        let Some(ck) = &self.resume_from else {
            return Ok(None);
        };
        let st = ck
            .load_rank(&self.layout, rank as u64)
            .map_err(|e| crate::error::EngineError::State(e.to_string()))?;
        let t = &ck.manifest().train;
        let mut state = ckpt_to_engine(&self.layout, rank as u64, st, t.step);
        // Steps skipped by f16 loss scaling made no AdamW update: the manifest's optimizer
        // step counts updates, `step` counts training steps.
        state.skipped_steps = t.step.saturating_sub(t.optimizer.step);
        state.loss_scaler = match (
            t.extra.get("loss_scale").map(|v| v.parse::<f64>()),
            t.extra
                .get("loss_scale_clean_steps")
                .map(|v| v.parse::<u64>()),
        ) {
            (Some(Ok(scale)), Some(Ok(clean_steps))) if scale.is_finite() && scale >= 1.0 => {
                Some(crate::runtime::LossScaler { scale, clean_steps })
            }
            (None, None) => None,
            _ => {
                return Err(crate::error::EngineError::State(format!(
                    "checkpoint {}: unreadable loss_scale / loss_scale_clean_steps in the manifest",
                    ck.dir().display()
                )))
            }
        };
        Ok(Some((state, t.step)))
    }

    fn after_step(
        &self,
        rank: usize,
        step: u64,
        engine: &mut crate::runtime::RankEngine<'_, crate::model::decoder::Decoder>,
    ) -> crate::error::Result<()> {
        let Some(root) = &self.root else {
            return Ok(());
        };
        let due =
            step == self.last_step || (self.every > 0 && step.checked_rem(self.every) == Some(0));
        if !due {
            return Ok(());
        }
        let rank = rank as u64;
        let t0 = std::time::Instant::now();
        let fail = |what: &str, e: String| {
            crate::error::EngineError::Checkpoint(format!(
                "checkpoint of step {step} in {}: {what}: {e}",
                root.display()
            ))
        };
        // Phase 1: every rank exports its state; rank 0 starts the save. Ranks agree on the
        // outcome through a status all-gather (threads or processes alike).
        let exported = engine
            .export_state()
            .map_err(|e| e.to_string())
            .and_then(|s| engine_to_ckpt(&self.layout, &s).map_err(|e| e.to_string()));
        let begun = if rank == 0 {
            self.move_aside()
                .and_then(|()| {
                    fsdp_checkpoints::begin_save(root, &self.layout, step)
                        .map_err(|e| e.to_string())
                })
                .map(Some)
        } else {
            Ok(None)
        };
        let mut local_err = exported.as_ref().err().or(begun.as_ref().err()).cloned();
        // A state holding an infinite or NaN value is never saved. The status says which
        // value (as -(1 + 3 * global parameter index + state kind)), so every rank can name
        // the parameter, not only the one that holds it.
        let bad = exported
            .as_ref()
            .ok()
            .and_then(|st| fsdp_checkpoints::find_nonfinite(&self.layout, rank, &st.as_refs()));
        let status = match &bad {
            Some(b) => {
                let before: usize = self.layout.spec.units[..b.unit]
                    .iter()
                    .map(|u| u.params.len())
                    .sum();
                let kind = fsdp_checkpoints::StateKind::ALL
                    .iter()
                    .position(|&k| k == b.kind)
                    .unwrap_or(0);
                -(1.0 + (3 * (before + b.param_index) + kind) as f64)
            }
            None => local_err.is_none() as u8 as f64,
        };
        let ok = engine.barrier_with_status(status)?;
        if let Some((r, &code)) = ok.iter().enumerate().find(|(_, &x)| x < 0.0) {
            let code = (-code - 1.0) as usize;
            let (p, kind) = (code / 3, fsdp_checkpoints::StateKind::ALL[code % 3]);
            let name = self
                .layout
                .spec
                .units
                .iter()
                .flat_map(|u| &u.params)
                .nth(p)
                .map_or_else(|| format!("#{p}"), |x| x.name.clone());
            return Err(crate::error::EngineError::Checkpoint(format!(
                "checkpoint of step {step} in {}: refused: the {} of parameter {name} on rank {r} is not finite, and a checkpoint is never written from a non-finite state; the newest complete checkpoint is unchanged",
                root.display(),
                kind.suffix()
            )));
        }
        if let Some(r) = ok.iter().position(|&x| x == 0.0) {
            return Err(fail(
                "begin",
                local_err.unwrap_or_else(|| format!("rank {r} failed")),
            ));
        }
        // Phase 2: the ranks of replicate index 0 write their files concurrently.
        if self.layout.writes_model_state(rank) {
            let st = exported.as_ref().expect("checked above");
            let written = fsdp_checkpoints::PendingCheckpoint::attach(root, &self.layout, step)
                .and_then(|p| p.write_rank(rank, &st.as_refs()));
            local_err = written.err().map(|e| e.to_string());
        }
        let ok = engine.barrier_with_status(local_err.is_none() as u8 as f64)?;
        if let Some(r) = ok.iter().position(|&x| x == 0.0) {
            // Nothing is published; the next save removes the temporary directory.
            return Err(fail(
                "write",
                local_err.unwrap_or_else(|| format!("rank {r} failed to write its file")),
            ));
        }
        // Phase 3: rank 0 writes the manifest, renames into place, updates `latest`.
        if let Ok(Some(p)) = begun {
            let mut t = self.train.clone();
            t.step = step;
            t.data_position = step;
            t.optimizer.step = engine.steps_taken() - engine.skipped_steps();
            if let Some(sc) = engine.loss_scaler() {
                t.extra.insert("loss_scale".into(), sc.scale.to_string());
                t.extra
                    .insert("loss_scale_clean_steps".into(), sc.clean_steps.to_string());
            }
            match p.commit(&t, self.keep_last) {
                Ok(dir) => {
                    if let Some(f) = &self.on_save {
                        f(&SaveReport {
                            step,
                            bytes: dir_bytes(&dir),
                            path: dir,
                            seconds: t0.elapsed().as_secs_f64(),
                        });
                    }
                }
                Err(e) => local_err = Some(e.to_string()),
            }
        }
        let ok = engine.barrier_with_status(local_err.is_none() as u8 as f64)?;
        if ok.contains(&0.0) {
            return Err(fail(
                "commit",
                local_err.unwrap_or_else(|| "rank 0 failed to commit".into()),
            ));
        }
        Ok(())
    }
}

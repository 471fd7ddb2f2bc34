//! `fsdp ckpt`: inspect, consolidate and reshard sharded checkpoints offline (no device, no
//! communicator). Every bad input (truncated or corrupted file, missing rank file, unknown
//! format version, a checkpoint of another model) is an error naming the file and the problem,
//! exit code 2.

use super::CliError;
use fsdp_checkpoints::{
    consolidate_optimizer_to_file, consolidate_to_file, reshard, Checkpoint, CheckpointLayout,
    CkptError, Verify,
};
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
    /// Write the full fp32 model as one safetensors file with the original parameter names
    /// and shapes (tied parameters once, under the target's name, as Hugging Face does).
    Consolidate {
        /// Checkpoint directory or root.
        dir: PathBuf,
        /// Output safetensors file.
        #[arg(short, long)]
        output: PathBuf,
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
        /// Target strategy: full-shard, shard-grad-op (both S = W), no-shard / ddp (S = 1),
        /// hybrid (needs --shard-size).
        #[arg(long, default_value = "full-shard")]
        strategy: String,
        /// Shard-group size for `--strategy hybrid` (must divide the world size).
        #[arg(long)]
        shard_size: Option<u64>,
        /// Target segment alignment in elements (default: the source's).
        #[arg(long)]
        alignment: Option<u64>,
        /// Output checkpoint root (a `step-N` directory and a `latest` pointer are written).
        #[arg(short, long)]
        output: PathBuf,
    },
}

/// Shard-group size of `strategy` at `world_size` (`--strategy` names of `fsdp train`).
pub fn shard_size_for(
    strategy: &str,
    world_size: u64,
    shard_size: Option<u64>,
) -> Result<u64, CliError> {
    match (strategy, shard_size) {
        ("full-shard" | "shard-grad-op", None) => Ok(world_size),
        ("no-shard" | "ddp", None) => Ok(1),
        ("hybrid", Some(s)) => Ok(s),
        ("hybrid", None) => Err(CliError::Usage(
            "--strategy hybrid needs --shard-size".into(),
        )),
        ("full-shard" | "shard-grad-op" | "no-shard" | "ddp", Some(_)) => Err(CliError::Usage(
            format!("--shard-size is only valid with --strategy hybrid (got {strategy})"),
        )),
        (other, _) => Err(CliError::Usage(format!(
            "unknown strategy `{other}` (expected full-shard, shard-grad-op, no-shard, ddp, hybrid)"
        ))),
    }
}

/// Runs `fsdp ckpt`.
pub fn run(args: CkptArgs) -> Result<(), CliError> {
    match args.action {
        CkptAction::Inspect { dir, json } => inspect(&dir, json),
        CkptAction::Consolidate {
            dir,
            output,
            optimizer_out,
        } => {
            let ck = Checkpoint::open(&dir, Verify::Checksums)?;
            ck.verify_all()?;
            let rep = consolidate_to_file(&ck, &output)?;
            println!(
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
                println!("  `{tied}` is tied to `{target}`: written once, as `{target}`");
            }
            if let Some(o) = optimizer_out {
                let n = consolidate_optimizer_to_file(&ck, &o)?;
                println!("  optimizer state -> {}: {n} tensors", o.display());
            }
            Ok(())
        }
        CkptAction::Reshard {
            dir,
            world_size,
            strategy,
            shard_size,
            alignment,
            output,
        } => {
            if world_size == 0 {
                return Err(CliError::Usage("--world-size must be at least 1".into()));
            }
            let s = shard_size_for(&strategy, world_size, shard_size)?;
            let ck = Checkpoint::open(&dir, Verify::Checksums)?;
            ck.verify_all()?;
            let src = ck.layout();
            let target = CheckpointLayout::new(
                src.spec.clone(),
                world_size,
                s,
                alignment.unwrap_or(src.alignment),
            )?;
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

fn inspect(dir: &std::path::Path, json: bool) -> Result<(), CliError> {
    let ck = Checkpoint::open(dir, Verify::Checksums)?;
    ck.verify_all()?;
    let m = ck.manifest();
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(m).map_err(|e| CliError::Failed(e.to_string()))?
        );
        return Ok(());
    }
    let l = ck.layout();
    let t = &m.train;
    println!("checkpoint   {}", ck.dir().display());
    println!("format       {} version {}", m.format, m.format_version);
    println!(
        "model        {} (fingerprint {})",
        m.model_name,
        &m.model_fingerprint[..16]
    );
    println!("plan         {}", m.plan_fingerprint);
    println!(
        "world size   {} = shard group {} x replicate group {} (alignment {} elements)",
        m.world_size, m.shard_size, m.replicate_size, m.alignment
    );
    println!(
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
    println!(
        "elements     {} ({} trainable), padding {} (never written to a file)",
        Numel(real),
        Numel(trainable),
        Numel(pad)
    );
    println!();
    let w = l
        .spec
        .units
        .iter()
        .flat_map(|u| &u.params)
        .map(|p| p.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    println!(
        "{:<w$}  {:<16} {:<5} {:>12}  {:<10} {:<9} state",
        "name", "shape", "dtype", "numel", "unit", "trainable"
    );
    for u in &l.spec.units {
        for p in &u.params {
            let state = match (&p.tied_to, p.trainable) {
                (Some(t), _) => format!("tied to {t}"),
                (None, true) => "param, exp_avg, exp_avg_sq".into(),
                (None, false) => "param".into(),
            };
            println!(
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
    println!();
    let mut total = 0u64;
    for f in &m.files {
        total += f.bytes;
        println!(
            "{}  rank {} (shard {})  {:>12}  sha256 {}  OK",
            f.file,
            f.rank,
            f.shard_index,
            Bytes(f.bytes).to_string(),
            f.sha256
        );
    }
    println!(
        "{} rank files, {}: sizes and SHA-256 checksums verified (ranks of replicate index 0 write model state)",
        m.files.len(),
        Bytes(total)
    );
    Ok(())
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
        flats,
    }
}

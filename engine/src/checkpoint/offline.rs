//! Offline checkpoint work (no device, no communicator): inspect a checkpoint, consolidate it
//! into one safetensors file or a Hugging Face model directory, reshard it for another world
//! size or strategy, with every check of their inputs and outputs before any work.

use crate::run::RunError;
use fsdp_checkpoints::{
    consolidate_optimizer_to_file, consolidate_to_file, consolidate_to_hf_dir, reshard, Checkpoint,
    CheckpointLayout, Verify, DEFAULT_MAX_SHARD_BYTES,
};
use fsdp_types::Bytes;
use std::path::{Path, PathBuf};

use super::resume::{passed_over, HF_CONFIG_KEY};

/// Refuses a reshard output root `out` that already holds checkpoints (a `latest` pointer or a
/// step directory) or is the source checkpoint `src_dir` itself: writing there would replace a
/// checkpoint of the same step and move `latest` to the resharded one, possibly backwards past
/// newer checkpoints. A new or empty directory is fine.
///
/// Errors: [`RunError::Refused`] naming the directory.
pub fn refuse_occupied_output(out: &Path, src_dir: &Path) -> Result<(), RunError> {
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same(out, src_dir) {
        return Err(RunError::Refused(format!(
            "-o {}: is the source checkpoint; reshard into a new or empty directory",
            out.display()
        )));
    }
    if out.is_dir() {
        let held = fsdp_checkpoints::list_checkpoints(out)?;
        if out.join(fsdp_checkpoints::LATEST_FILE).is_file() || !held.is_empty() {
            return Err(RunError::Refused(format!(
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
/// Errors: [`RunError::Refused`] giving the shard size, the element count and the world size.
pub fn check_reshard_size(
    src: &CheckpointLayout,
    world_size: u64,
    shard_size: u64,
) -> Result<(), RunError> {
    let largest = src
        .flat_params()
        .map(|(_, _, f)| f.unpadded_numel.0)
        .max()
        .unwrap_or(0);
    if shard_size > largest {
        return Err(RunError::Refused(format!(
            "--world-size {world_size}: shard size {shard_size} exceeds the {largest} elements of \
             the model's largest flat parameter, so ranks {largest}..{shard_size} of each shard \
             group would hold only padding; use a shard size of at most {largest} (--world-size, \
             or --strategy hybrid --shard-size)"
        )));
    }
    Ok(())
}

/// Refuses, unless `allowed` (`--allow-padding-ranks`), a reshard whose shard size exceeds
/// the element count of some FSDP unit: the ranks from that count on hold nothing of that
/// unit but padding (with `allowed`, a warning goes to `note`). The message names how many units are affected, the smallest one, and
/// the number of rank files the reshard would write.
///
/// Errors: [`RunError::Refused`] with the numbers and the two ways on.
pub fn check_padding_ranks(
    src: &CheckpointLayout,
    world_size: u64,
    shard_size: u64,
    allowed: bool,
    note: &mut dyn FnMut(String),
) -> Result<(), RunError> {
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
        note(format!("warning: {msg} (--allow-padding-ranks)"));
        return Ok(());
    }
    Err(RunError::Refused(format!(
        "{msg}; use a shard size of at most {} elements (--world-size, or --strategy hybrid \
         --shard-size), or pass --allow-padding-ranks to write it anyway",
        g(smallest)
    )))
}

/// Opens the checkpoint at `dir` (a step directory or a root) as every `fsdp ckpt` action
/// does, giving `note` what [`passed_over`] finds, then verifies every file.
///
/// Errors: any `CkptError` as [`RunError::Refused`].
pub fn open_verified(dir: &Path, note: &mut dyn FnMut(String)) -> Result<Checkpoint, RunError> {
    let ck = Checkpoint::open(dir, Verify::Checksums)?;
    for w in passed_over(dir, ck.dir()) {
        note(w);
    }
    ck.verify_all()?;
    Ok(ck)
}

/// Refuses a model-directory output before any work: an existing file, a non-empty directory
/// or a missing parent directory, naming the path and the fix.
///
/// Errors: [`RunError::Refused`].
pub fn check_output_model_dir(path: &Path) -> Result<(), RunError> {
    if path.is_file() {
        return Err(RunError::Refused(format!(
            "-o {}: is a file; a GPT-2 or Llama-family model is exported as a Hugging Face \
             model directory: give a new or empty directory, or a path ending in .safetensors \
             for one state-dict file",
            path.display()
        )));
    }
    if path.is_dir() {
        let n = std::fs::read_dir(path)
            .map_err(|e| RunError::Refused(format!("-o {}: {e}", path.display())))?
            .count();
        if n > 0 {
            return Err(RunError::Refused(format!(
                "-o {}: the directory is not empty ({n} entries); the export would mix with \
                 its files: give a new or empty directory",
                path.display()
            )));
        }
    }
    check_parent_exists("-o", path)
}

/// The `config.json` of a GPT-2 or Llama-family checkpoint's model directory: `--hf-config FILE` when
/// given, else the text `fsdp train` recorded in the manifest ([`HF_CONFIG_KEY`]), else the
/// preset of the checkpoint's model name; checked to describe the checkpoint's model
/// ([`fsdp_planner::hf::export_hf_config`]).
///
/// Errors: [`RunError::Refused`] when none is available (naming `--hf-config`) or the
/// config describes another model.
pub fn export_config(
    ck: &Checkpoint,
    hf_config: Option<&Path>,
) -> Result<serde_json::Value, RunError> {
    let m = ck.manifest();
    let manifest = ck.dir().join(fsdp_checkpoints::MANIFEST_FILE);
    let (text, file) = if let Some(p) = hf_config {
        let t = std::fs::read_to_string(p)
            .map_err(|e| RunError::Refused(format!("--hf-config {}: {e}", p.display())))?;
        // A recorded config is the model trained: another file may not change its math.
        if let Some(recorded) = m.train.extra.get(HF_CONFIG_KEY) {
            let f = p.display().to_string();
            let same_shapes = fsdp_planner::hf::parse_hf_arch(&t, &f).ok() == Some(m.spec.arch);
            if let (fsdp_planner::Architecture::Llama(_), true) = (m.spec.arch, same_shapes) {
                let given = fsdp_planner::hf::parse_llama_numerics(&t, &f)
                    .map_err(|e| RunError::Refused(e.to_string()))?;
                let was = fsdp_planner::hf::parse_llama_numerics(recorded, "the manifest")
                    .map_err(|e| RunError::Refused(e.to_string()))?;
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
                    return Err(RunError::Refused(format!(
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
        return Err(RunError::Refused(format!(
            "{}: the checkpoint does not record its model's config.json (model {}); pass \
             the config.json it was trained from with --hf-config FILE",
            manifest.display(),
            m.model_name
        )));
    };
    fsdp_planner::hf::export_hf_config(&text, &file, &m.spec.arch)
        .map_err(|e| RunError::Refused(e.to_string()))
}

/// Refuses an output file path that cannot be written, before any work
/// ([`crate::output::check_output_path`]). `flag` names the flag in messages.
///
/// Errors: [`RunError::Refused`] naming the flag, the path and the fix.
pub fn check_output_file(flag: &str, path: &Path) -> Result<(), RunError> {
    crate::output::check_output_path(flag, path, "model.safetensors").map_err(RunError::Refused)
}

/// Refuses an output `path` (given with `flag`) whose parent directory does not exist.
///
/// Errors: [`RunError::Refused`] naming the directory and the `mkdir -p` that fixes it.
fn check_parent_exists(flag: &str, path: &Path) -> Result<(), RunError> {
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return Err(RunError::Refused(format!(
            "{flag} {}: the directory {} does not exist; create it first (mkdir -p {})",
            path.display(),
            parent.display(),
            parent.display()
        )));
    }
    Ok(())
}

/// What `fsdp ckpt consolidate` is asked to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsolidateRequest {
    /// Checkpoint directory or root.
    pub dir: PathBuf,
    /// A new or empty directory (a model directory), or a file (a path ending in
    /// `.safetensors`, or any path for a model without a directory form).
    pub output: PathBuf,
    /// Largest weight file of a model directory (`None`: transformers' 5 GB).
    pub max_shard_size: Option<Bytes>,
    /// The model's `config.json` for a model directory, when the checkpoint does not record
    /// it.
    pub hf_config: Option<PathBuf>,
    /// Also write the Adam moments to this file.
    pub optimizer_out: Option<PathBuf>,
}

/// What a consolidation wrote.
#[derive(Debug, Clone)]
pub enum Consolidated {
    /// A Hugging Face model directory.
    ModelDir(fsdp_checkpoints::hfdir::HfDirReport),
    /// One safetensors state dict.
    File(fsdp_checkpoints::ConsolidateReport),
}

/// The outcome of [`consolidate`].
#[derive(Debug, Clone)]
pub struct ConsolidateOutcome {
    /// The checkpoint directory read.
    pub source: PathBuf,
    /// Its step.
    pub step: u64,
    /// Its world size.
    pub world_size: u64,
    /// What was written.
    pub written: Consolidated,
    /// The optimizer-state file and its tensor count, when asked for.
    pub optimizer: Option<(PathBuf, usize)>,
    /// Summary lines of a model directory: where its tokenizer and special tokens come from,
    /// or why there are none ([`super::model_files::export_files`]).
    pub notes: Vec<String>,
}

/// Consolidates a checkpoint: the full fp32 model with its original parameter names, as a
/// Hugging Face model directory for GPT-2 (with biases) and Llama-family models (unless the
/// output ends in `.safetensors`), else as one safetensors file; optionally the Adam moments.
/// A model directory is complete: `config.json` with `bos_token_id` / `eos_token_id`, the
/// tokenizer and generation files the checkpoint carries, or a derived
/// `generation_config.json` ([`super::model_files::export_files`]).
/// Every output is checked before any work; warnings and notes go to `note`.
///
/// Errors: [`RunError::Refused`] for a bad output, flags that do not apply to the chosen
/// form, a damaged checkpoint, a missing or mismatched `config.json`.
pub fn consolidate(
    req: &ConsolidateRequest,
    note: &mut dyn FnMut(String),
) -> Result<ConsolidateOutcome, RunError> {
    let ConsolidateRequest {
        dir,
        output,
        max_shard_size,
        hf_config,
        optimizer_out,
    } = req;
    if let Some(o) = optimizer_out {
        check_output_file("--optimizer-out", o)?;
    }
    let ck = Checkpoint::open(dir, Verify::Checksums)?;
    // GPT-2 (with biases, as GPT2LMHeadModel has) and the Llama family export as a model
    // directory; a GPT without biases only as one state-dict file.
    let has_dir_form = match ck.manifest().spec.arch {
        fsdp_planner::Architecture::Llama(_) => true,
        fsdp_planner::Architecture::Gpt2(c) => c.bias,
        fsdp_planner::Architecture::Generic => false,
    };
    let to_file =
        !has_dir_form || output.extension().and_then(|e| e.to_str()) == Some("safetensors");
    if to_file {
        if max_shard_size.is_some() || hf_config.is_some() {
            return Err(RunError::Refused(format!(
                "--max-shard-size and --hf-config apply to a model directory, which \
                 is written for GPT-2 and Llama-family models to an -o path not \
                 ending in .safetensors; -o {} writes one safetensors file: leave them \
                 out",
                output.display()
            )));
        }
        check_output_file("-o", output)?;
    } else {
        check_output_model_dir(output)?;
    }
    for w in passed_over(dir, ck.dir()) {
        note(w);
    }
    ck.verify_all()?;
    let mut notes = Vec::new();
    let written = if !to_file {
        let mut config = export_config(&ck, hf_config.as_deref())?;
        let extra = super::model_files::export_files(&ck, &mut config)?;
        notes = extra.notes;
        Consolidated::ModelDir(consolidate_to_hf_dir(
            &ck,
            output,
            &config,
            &extra.files,
            max_shard_size.map_or(DEFAULT_MAX_SHARD_BYTES, |b| b.0),
        )?)
    } else {
        if has_dir_form {
            note(
                "note: writing one safetensors state dict; -o DIR (a path not ending in \
                 .safetensors) writes a Hugging Face model directory with config.json"
                    .into(),
            );
        }
        Consolidated::File(consolidate_to_file(&ck, output)?)
    };
    let optimizer = match optimizer_out {
        Some(o) => Some((o.clone(), consolidate_optimizer_to_file(&ck, o)?)),
        None => None,
    };
    Ok(ConsolidateOutcome {
        source: ck.dir().to_path_buf(),
        step: ck.manifest().train.step,
        world_size: ck.manifest().world_size,
        written,
        optimizer,
        notes,
    })
}

/// What `fsdp ckpt reshard` is asked to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReshardRequest {
    /// Checkpoint directory or root.
    pub dir: PathBuf,
    /// Target world size.
    pub world_size: u64,
    /// Target shard-group size (dividing the world size).
    pub shard_size: u64,
    /// Target segment alignment in elements (`None`: the source's).
    pub alignment: Option<u64>,
    /// Output checkpoint root (new or empty).
    pub output: PathBuf,
    /// Write even when some unit has fewer elements than the shard size.
    pub allow_padding_ranks: bool,
}

/// The outcome of [`reshard_checkpoint`]: both layouts and where the new checkpoint is.
#[derive(Debug, Clone)]
pub struct ReshardOutcome {
    /// The source checkpoint directory.
    pub source: PathBuf,
    /// The source layout.
    pub from: CheckpointLayout,
    /// The target layout.
    pub to: CheckpointLayout,
    /// The checkpoint directory written.
    pub written: PathBuf,
    /// The checkpoint's step.
    pub step: u64,
}

/// Rewrites a checkpoint for another world size, shard-group size or alignment, after
/// checking the output root, the shard size against the model ([`check_reshard_size`],
/// [`check_padding_ranks`]) and every file of the source.
///
/// Errors: [`RunError::Refused`] for an output that is not a new or empty directory, a shard
/// size the model cannot fill, a damaged source.
pub fn reshard_checkpoint(
    req: &ReshardRequest,
    note: &mut dyn FnMut(String),
) -> Result<ReshardOutcome, RunError> {
    let (output, s) = (&req.output, req.shard_size);
    if output.exists() && !output.is_dir() {
        return Err(RunError::Refused(format!(
            "-o {}: exists and is not a directory; give a new or empty directory",
            output.display()
        )));
    }
    let ck = open_verified(&req.dir, note)?;
    let src = ck.layout();
    check_reshard_size(src, req.world_size, s)?;
    check_padding_ranks(src, req.world_size, s, req.allow_padding_ranks, note)?;
    let target = CheckpointLayout::new(
        src.spec.clone(),
        req.world_size,
        s,
        req.alignment.unwrap_or(src.alignment),
    )?;
    refuse_occupied_output(output, ck.dir())?;
    let written = reshard(&ck, &target, output)?;
    Ok(ReshardOutcome {
        source: ck.dir().to_path_buf(),
        from: src.clone(),
        to: target,
        written,
        step: ck.manifest().train.step,
    })
}

//! The checkpoint layer of a training run: which checkpoint a resume starts from (newest,
//! newest intact, a given step; newer step directories set aside, never deleted), what a
//! resume changes, the hooks that resume every rank and save sharded checkpoints with the
//! crash-safe protocol of `fsdp_checkpoints`, and the check of `--init-from` weights against
//! the run's model.

use crate::run::RunError;
use crate::train::TrainOptions;
use fsdp_checkpoints::{Checkpoint, CheckpointLayout, CkptError, Verify};
use std::path::{Path, PathBuf};

/// Where a run's checkpoints go and whether it resumes: the checkpoint flags of `fsdp train`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckpointConfig {
    /// Checkpoint root (`step-N/` directories and the `latest` pointer); `None`: no
    /// checkpoints.
    pub dir: Option<PathBuf>,
    /// Save every N optimizer steps (0: only after the last step).
    pub every: u64,
    /// Keep the newest K checkpoints (0: keep all).
    pub keep_last: usize,
    /// The resume asked for; `None` for a fresh run.
    pub resume: Option<ResumeFrom>,
    /// Resume although the data's tokens were not made by the tokenizer of the data the
    /// checkpoint trained on (`--allow-tokenizer-mismatch`): a note instead of a refusal.
    pub allow_tokenizer_mismatch: bool,
    /// What a failed save does (`--on-save-error`): stop the run (default) or go on.
    pub on_save_error: super::save::OnSaveError,
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

impl ResumeFrom {
    /// The `--resume-from` value that asks for it (`latest-valid`, a step; empty for the
    /// newest, which `--resume` asks for).
    pub fn flag_value(&self) -> String {
        match self {
            ResumeFrom::Newest => String::new(),
            ResumeFrom::LatestValid => "latest-valid".into(),
            ResumeFrom::Step(s) => s.to_string(),
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
/// Errors: [`RunError::Refused`] when `root` cannot be listed.
pub fn step_dirs(root: &Path) -> Result<Vec<StepDir>, RunError> {
    let rd = std::fs::read_dir(root)
        .map_err(|e| RunError::Refused(format!("cannot list {}: {e}", root.display())))?;
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

/// Manifest `train.extra` key holding the Hugging Face `config.json` text of a Llama-family
/// model, recorded by `fsdp train` at every save.
pub const HF_CONFIG_KEY: &str = "hf_config";

/// The `config.json` text to record for `model`, trained from the `config.json` at
/// `hf_config` (its text, as given) or a preset (generated from the preset's sizes and
/// numerics); `None` for a GPT without biases (its export is one safetensors file).
///
/// Errors: [`RunError::Refused`] when `hf_config` cannot be read.
pub fn hf_config_text(
    model: &crate::model::decoder::Decoder,
    hf_config: Option<&Path>,
) -> Result<Option<String>, RunError> {
    if let Some(p) = hf_config {
        return std::fs::read_to_string(p)
            .map(Some)
            .map_err(|e| RunError::Refused(format!("--hf-config {}: {e}", p.display())));
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

/// The checkpoint layer of `fsdp train` ([`crate::train::TrainHooks`]): resumes every rank
/// from the newest complete checkpoint (resharding if the run's layout differs) and saves a
/// sharded checkpoint every `--ckpt-every` steps and after the last step, with the crash-safe
/// protocol of `fsdp_checkpoints::save`.
///
/// Saving: rank 0 creates the temporary directory; every rank of replicate index 0 writes its
/// own rank file (in parallel); rank 0 writes the model's carried files
/// ([`super::model_files::carried_files`]) and the manifest, renames the directory into place
/// and updates `latest`. Between the phases the ranks all-gather a status (a barrier that works
/// for rank threads and MPI processes alike), so every rank fails together and nothing partial
/// is ever published.
pub struct CheckpointHooks {
    pub(super) root: Option<PathBuf>,
    pub(super) every: u64,
    pub(super) keep_last: usize,
    pub(super) last_step: u64,
    pub(super) layout: CheckpointLayout,
    resume_from: Option<Checkpoint>,
    pub(super) train: fsdp_checkpoints::TrainState,
    /// Step directories newer than the resumed checkpoint and where rank 0 moves them before
    /// the first save (`--resume-from`); emptied once done.
    set_aside: std::sync::Mutex<Vec<(PathBuf, PathBuf)>>,
    pub(super) on_save: Option<SaveCallback>,
    /// The model's own files written into every checkpoint ([`super::model_files`]).
    pub(super) model_files: Vec<(String, Vec<u8>)>,
    /// What a failed save does.
    pub(super) on_save_error: super::save::OnSaveError,
    /// The errors of the ranks of this process in the current save: `(step, rank, error)`.
    pub(super) save_errors: std::sync::Mutex<Vec<(u64, u64, String)>>,
    /// Where this run starts in the training stream (the resumed checkpoint's step and
    /// consumed sequences, or the start).
    pub(super) origin: crate::data::StreamOrigin,
    /// Sequences one optimizer step of this run consumes (`B * grad_accum * W`).
    pub(super) sequences_per_step: u64,
    /// Saves are asynchronous (`--ckpt-async`, the plan's `ckpt_async`).
    pub(super) ckpt_async: bool,
    /// Per rank (of the world; only this process's are used): its asynchronous save.
    pub(super) async_ranks: Vec<std::sync::Mutex<super::save::AsyncRank>>,
    /// What the saves cost, as rank 0 measured.
    pub(super) save_stats: std::sync::Mutex<super::save::SaveStats>,
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
    /// Builds the checkpoint hooks of the prepared run `run` (its options after
    /// `--init-from` was applied, its model and its plan: the checkpoint layout) under `a`.
    /// With a resume, picks the checkpoint ([`choose_resume`]), verifies every checksum and
    /// checks that it holds this model and was trained with this `--seed` (the data order
    /// depends on it), before any rank starts. What the resume finds and changes
    /// ([`resume_changes`]) goes to `note`, one line per call, as it is found.
    ///
    /// Errors: [`RunError::Refused`] for any checkpoint problem, naming the file.
    pub fn new(
        a: &CheckpointConfig,
        run: &crate::run::PreparedRun,
        note: &mut dyn FnMut(String),
    ) -> Result<Self, RunError> {
        let (o, model, plan) = (&run.options, &run.model, &run.plan);
        let spec = crate::runtime::StagedModel::spec(model);
        let layout = CheckpointLayout::from_plan(spec.clone(), plan)?;
        if let Some(root) = &a.dir {
            check_ckpt_dir(root)?;
            if a.resume.is_none() {
                refuse_fresh_run_into_checkpoints(root)?;
            }
        }
        let mut resume_from = None;
        let mut set_aside = Vec::new();
        let mut origin = crate::data::StreamOrigin::START;
        if let Some(mode) = a.resume {
            let Some(root) = a.dir.as_deref() else {
                return Err(RunError::Refused(
                    "a resume needs a checkpoint directory (--ckpt-dir)".into(),
                ));
            };
            let dirs = step_dirs(root)?;
            if dirs.is_empty() && mode != ResumeFrom::Newest {
                return Err(RunError::Refused(format!(
                    "--resume-from {}: {} holds no checkpoint (no step-N directory)",
                    mode.flag_value(),
                    root.display()
                )));
            }
            if dirs.is_empty() {
                note(format!(
                    "no checkpoint in {} yet: starting from step 0",
                    root.display()
                ));
            } else {
                let (ck, aside) = choose_resume(root, &dirs, mode, spec, note)?;
                let saved_seed = ck.manifest().train.extra.get("seed").cloned();
                if let Some(s) = saved_seed.filter(|s| *s != o.seed.to_string()) {
                    return Err(RunError::Refused(format!(
                        "{}: the checkpoint was trained with --seed {s}, this run has --seed {}; the data order would differ (pass --seed {s})",
                        ck.dir().join(fsdp_checkpoints::MANIFEST_FILE).display(),
                        o.seed
                    )));
                }
                if let Some(change) =
                    tokenizer_change(&ck.manifest().train.extra, o.data.as_deref())
                {
                    if !a.allow_tokenizer_mismatch {
                        return Err(RunError::Refused(format!(
                            "cannot resume from {} (step {}) on {change}. Pass --data with the \
                             token file the checkpoint trained on ({}), or one made from your \
                             text with the same tokenizer (`fsdp data tokenize --tokenizer \
                             TOKENIZER.json TEXT -o tokens.bin`); or pass \
                             --allow-tokenizer-mismatch to resume anyway",
                            ck.dir().display(),
                            ck.manifest().train.step,
                            ck.manifest()
                                .train
                                .extra
                                .get("data")
                                .map_or("not recorded", String::as_str)
                        )));
                    }
                }
                note(format!(
                    "resuming from {} (step {}, saved at world size {} = shard {} x replicate {})",
                    ck.dir().display(),
                    ck.manifest().train.step,
                    ck.manifest().world_size,
                    ck.manifest().shard_size,
                    ck.manifest().replicate_size
                ));
                for (key, now) in [
                    ("param_dtype", o.param_dtype.to_string()),
                    ("reduce_dtype", o.reduce_dtype.to_string()),
                ] {
                    if let Some(was) = ck.manifest().train.extra.get(key).filter(|w| **w != now) {
                        note(format!(
                            "note: the checkpoint was trained with {key} {was}, this run uses {now} (master weights and optimizer state are f32 either way)"
                        ));
                    }
                }
                let (at, unrecorded) = stream_origin_of(
                    &ck.manifest().train,
                    ck.manifest().world_size,
                    sequences_per_step(o),
                );
                if let Some(n) = unrecorded {
                    note(n);
                }
                origin = at;
                for line in resume_changes(
                    &ck.manifest().train.extra,
                    ck.manifest().world_size,
                    ck.manifest().train.step,
                    at.sequences,
                    o,
                ) {
                    note(format!("note: resuming with {line}"));
                }
                for (from, to) in &aside {
                    note(format!(
                        "note: {} is newer than the checkpoint resumed; it is kept and moved to {} at the first save",
                        from.display(),
                        to.display()
                    ));
                }
                set_aside = aside;
                resume_from = Some(ck);
            }
        }
        let carried = super::model_files::carried_files(o, resume_from.as_ref())?;
        if let Some(n) = carried.note {
            note(n);
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
        extra.extend(data_extra(o));
        if let Some(t) = hf_config_text(model, o.hf_config.as_deref())? {
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
            root: a.dir.clone(),
            every: a.every,
            keep_last: a.keep_last,
            last_step: o.steps,
            layout,
            resume_from,
            train,
            set_aside: std::sync::Mutex::new(set_aside),
            on_save: None,
            model_files: carried.files,
            origin,
            sequences_per_step: sequences_per_step(o),
            on_save_error: a.on_save_error,
            save_errors: std::sync::Mutex::new(Vec::new()),
            ckpt_async: plan.config.ckpt_async,
            async_ranks: (0..plan.world_size())
                .map(|_| std::sync::Mutex::new(super::save::AsyncRank::default()))
                .collect(),
            save_stats: std::sync::Mutex::new(super::save::SaveStats {
                asynchronous: plan.config.ckpt_async,
                ..Default::default()
            }),
        })
    }

    /// Calls `f` on rank 0 after every completed save (`fsdp train` prints `saved step N to
    /// DIR in S s`, or a `{"event": "checkpoint", ...}` line with `--json`).
    pub fn on_save(&mut self, f: SaveCallback) {
        self.on_save = Some(f);
    }

    /// What the run's saves cost so far, as rank 0 measured: saves completed and the seconds
    /// the training thread was blocked by them (the summary's step time lost to saves).
    pub fn save_stats(&self) -> super::save::SaveStats {
        self.save_stats.lock().map(|s| *s).unwrap_or_default()
    }
}

/// Refuses an engine whose optimizer state is not AdamW's (`exp_avg`, `exp_avg_sq`): the only
/// optimizer state checkpoint format 1 stores.
///
/// Errors: [`crate::error::EngineError::Checkpoint`] naming the optimizer's buffers.
pub(super) fn check_adamw(
    engine: &crate::runtime::RankEngine<'_, crate::model::decoder::Decoder>,
    dir: &Path,
) -> crate::error::Result<()> {
    let names = engine.optimizer_state_names();
    if names != ["exp_avg", "exp_avg_sq"] {
        return Err(crate::error::EngineError::Checkpoint(format!(
            "checkpoint {}: the optimizer's state {names:?} is not AdamW's (exp_avg, \
             exp_avg_sq); checkpoint format {} stores AdamW state only",
            dir.display(),
            fsdp_checkpoints::FORMAT_VERSION
        )));
    }
    Ok(())
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

/// What a step directory holds for a run of model `spec`.
enum Examined {
    /// A checkpoint of this model whose files all verify.
    Intact(Box<Checkpoint>),
    /// A readable checkpoint of another model: the refusal naming both models.
    OtherModel(String),
    /// Incomplete or damaged: the problem.
    Damaged(String),
}

/// Opens the step directory `d`, checks its model against `spec` (before the checksums, so a
/// checkpoint of another model is named as such) and verifies every file.
fn examine(d: &StepDir, spec: &fsdp_planner::ModelSpec) -> Examined {
    if !d.has_manifest {
        return Examined::Damaged("no manifest.json (incomplete or damaged)".into());
    }
    let ck = match Checkpoint::open(&d.path, Verify::Checksums) {
        Ok(ck) => ck,
        Err(e) => return Examined::Damaged(e.to_string()),
    };
    if let Err(e) = ck.check_model(spec) {
        let m = ck.manifest();
        let short = |f: &str| f[..f.len().min(12)].to_string();
        let detail = match e {
            CkptError::ModelMismatch { problem, .. } => problem,
            other => other.to_string(),
        };
        return Examined::OtherModel(format!(
            "checkpoint step {} in {} is of model {} (fingerprint {}..), this run is model {} \
             (fingerprint {}..): a checkpoint of another model ({detail}); pass the config it \
             was trained with (--hf-config, or --init-from the model directory it was trained \
             from) or another --ckpt-dir",
            m.train.step,
            d.path.parent().unwrap_or(&d.path).display(),
            m.model_name,
            short(&m.model_fingerprint),
            spec.name,
            short(&fsdp_checkpoints::model_fingerprint(spec))
        ));
    }
    match ck.verify_all() {
        Ok(()) => Examined::Intact(Box::new(ck)),
        Err(e) => Examined::Damaged(e.to_string()),
    }
}

/// Picks the checkpoint a resume starts from among `dirs` (the step directories of `root`,
/// newest first, from [`step_dirs`]) and the newer step directories to set aside before the
/// first save (damaged ones as `step-N.damaged`, intact ones as `step-N.superseded`).
///
/// - [`ResumeFrom::Newest`]: the newest step directory (or the one `latest` names, if newer
///   is absent); when it is damaged or incomplete, refuses, naming it, the error and the
///   newest intact checkpoint with the flag that resumes from it.
/// - [`ResumeFrom::LatestValid`]: the newest that opens and verifies; each damaged newer one
///   is named through `note`.
/// - [`ResumeFrom::Step`]: that step's directory, which must be intact.
///
/// Errors: [`RunError::Refused`] naming the directories.
pub fn choose_resume(
    root: &Path,
    dirs: &[StepDir],
    mode: ResumeFrom,
    spec: &fsdp_planner::ModelSpec,
    note: &mut dyn FnMut(String),
) -> Result<(Checkpoint, Vec<(PathBuf, PathBuf)>), RunError> {
    let why = |d: &StepDir| -> Option<String> {
        match examine(d, spec) {
            Examined::Intact(_) => None,
            Examined::OtherModel(m) | Examined::Damaged(m) => Some(m),
        }
    };
    let newest_intact = |skip: usize| -> Option<(usize, Checkpoint)> {
        dirs.iter()
            .enumerate()
            .skip(skip)
            .find_map(|(i, d)| match examine(d, spec) {
                Examined::Intact(c) => Some((i, *c)),
                _ => None,
            })
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
            let problem = match examine(newest, spec) {
                Examined::Intact(ck) => {
                    for w in passed_over(root, ck.dir()) {
                        note(w);
                    }
                    return Ok((*ck, Vec::new()));
                }
                Examined::OtherModel(m) => return Err(RunError::Refused(m)),
                Examined::Damaged(problem) => problem,
            };
            {
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
                Err(RunError::Refused(format!(
                    "cannot resume from the newest checkpoint {}{pointer_note}: {problem}; {hint}",
                    newest.path.display()
                )))
            }
        }
        ResumeFrom::LatestValid => {
            let mut found = None;
            for (i, d) in dirs.iter().enumerate() {
                match examine(d, spec) {
                    Examined::Intact(ck) => {
                        found = Some((i, *ck));
                        break;
                    }
                    Examined::OtherModel(m) => return Err(RunError::Refused(m)),
                    Examined::Damaged(_) => {}
                }
            }
            let Some((i, ck)) = found else {
                return Err(RunError::Refused(format!(
                    "--resume-from latest-valid: none of the {} checkpoints in {} is intact; \
                     start over without --resume in a new --ckpt-dir",
                    dirs.len(),
                    root.display()
                )));
            };
            let damaged: Vec<usize> = (0..i).collect();
            for d in &dirs[..i] {
                note(format!(
                    "warning: skipping {}: {}",
                    d.path.display(),
                    why(d).unwrap_or_else(|| "damaged".into())
                ));
            }
            Ok((ck, aside_of(i, &damaged)))
        }
        ResumeFrom::Step(step) => {
            let Some(i) = dirs.iter().position(|d| d.step == step) else {
                let have: Vec<String> = dirs.iter().rev().map(|d| d.step.to_string()).collect();
                return Err(RunError::Refused(format!(
                    "--resume-from {step}: {} has no checkpoint of step {step} (steps there: {})",
                    root.display(),
                    have.join(", ")
                )));
            };
            let ck = match examine(&dirs[i], spec) {
                Examined::Intact(ck) => *ck,
                Examined::OtherModel(m) => return Err(RunError::Refused(m)),
                Examined::Damaged(problem) => {
                    return Err(RunError::Refused(format!(
                        "--resume-from {step}: {}: {problem}; pick another step or \
                         --resume-from latest-valid",
                        dirs[i].path.display()
                    )))
                }
            };
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
/// Errors: [`RunError::Refused`] when the path exists and is not a directory, cannot be
/// created, or is not writable, naming the path and the OS error.
fn check_ckpt_dir(root: &std::path::Path) -> Result<(), RunError> {
    let bad = |what: &str, e: std::io::Error| {
        RunError::Refused(format!(
            "--ckpt-dir {}: {what} ({e}); no training was started",
            root.display()
        ))
    };
    if root.exists() && !root.is_dir() {
        return Err(RunError::Refused(format!(
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
        return Err(RunError::Refused(format!(
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
/// Errors: [`RunError::Refused`] naming the directory, its newest step and the fixes.
fn refuse_fresh_run_into_checkpoints(root: &Path) -> Result<(), RunError> {
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
    Err(RunError::Refused(format!(
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
pub(super) fn dir_bytes(dir: &Path) -> u64 {
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
    pub(super) fn move_aside(&self) -> Result<(), String> {
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
            crate::output::errln!("moved {} aside to {}", from.display(), to.display());
        }
        Ok(())
    }
}

impl crate::train::TrainHooks for CheckpointHooks {
    fn stream_origin(&self) -> crate::data::StreamOrigin {
        self.origin
    }

    fn resume(
        &self,
        rank: usize,
        engine: &mut crate::runtime::RankEngine<'_, crate::model::decoder::Decoder>,
    ) -> crate::error::Result<Option<u64>> {
        let Some(ck) = &self.resume_from else {
            return Ok(None);
        };
        let t = &ck.manifest().train;
        // Steps skipped by f16 loss scaling made no AdamW update: the manifest's optimizer
        // step counts updates, `step` counts training steps.
        let skipped = t.step.saturating_sub(t.optimizer.step);
        let scaler = match (
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
        check_adamw(engine, ck.dir())?;
        // The reader maps the checkpoint's rank files only while this rank's state streams
        // into its buffers: dropped at the end of this call, nothing of the file stays mapped.
        let reader = ck.reader(&self.layout)?;
        engine.import_shards(t.step, skipped, scaler, &mut |u, k, b, at, dest| {
            let kind = match b {
                crate::runtime::ShardBuf::Param => fsdp_checkpoints::StateKind::Param,
                crate::runtime::ShardBuf::State(0) => fsdp_checkpoints::StateKind::ExpAvg,
                crate::runtime::ShardBuf::State(_) => fsdp_checkpoints::StateKind::ExpAvgSq,
            };
            reader
                .read_shard(rank as u64, u, k, kind, at, dest)
                .map_err(crate::error::EngineError::from)
        })?;
        Ok(Some(t.step))
    }

    fn after_step(
        &self,
        rank: usize,
        step: u64,
        engine: &mut crate::runtime::RankEngine<'_, crate::model::decoder::Decoder>,
        stop: bool,
    ) -> crate::error::Result<()> {
        let Some(root) = &self.root else {
            return Ok(());
        };
        // A run stopping early (a signal) saves the step it stops after.
        self.save_at(rank as u64, step, engine, root, stop)
    }
}

/// What a resume changes, given the checkpoint's saved flags (`extra`, the manifest's
/// `train.extra`), its world size `saved_world`, completed `step` and `consumed` sequences of
/// the training stream ([`stream_origin_of`]), against the run's options: one line per
/// changed setting (the data file, the tokenizer of a token file, `--seq-len`,
/// `--micro-batch`, `--grad-accum`, the world size); a new shape of the step says that the
/// stream continues at sequence `consumed` and whether the global batch changes. Empty when
/// nothing changes.
pub fn resume_changes(
    extra: &std::collections::BTreeMap<String, String>,
    saved_world: u64,
    step: u64,
    consumed: u64,
    o: &TrainOptions,
) -> Vec<String> {
    let mut lines = Vec::new();
    let data_now = o
        .data
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "(embedded corpus)".into());
    let get = |k: &str| extra.get(k).cloned();
    let num = |k: &str| get(k).and_then(|v| v.parse::<u64>().ok());
    let tokens_now = data_extra(o);
    // A token file is the same data when its header is: the same tokenizer, token count and
    // vocabulary, wherever the file now lies.
    let same_token_file = [DATA_TOKENIZER_KEY, "data_tokens", "data_vocab_size"]
        .iter()
        .all(|k| extra.get(*k).is_some() && extra.get(*k) == tokens_now.get(*k));
    if let Some(was) = get("data").filter(|w| *w != data_now && !same_token_file) {
        lines.push(format!(
            "--data {data_now} (the checkpoint trained on {was}): the sample stream is cut from \
             the new text, so steps from {} see other windows than an uninterrupted run",
            step + 1
        ));
    } else if let (Some(was), Some(now)) = (get("data_tokens"), tokens_now.get("data_tokens")) {
        // The same path, another file: its header says so.
        if !same_token_file
            && get(DATA_TOKENIZER_KEY).as_ref() == tokens_now.get(DATA_TOKENIZER_KEY)
        {
            lines.push(format!(
                "--data {data_now} changed since the checkpoint ({now} tokens, the checkpoint's \
                 file had {was}): the sample stream is cut from the new tokens, so steps from {} \
                 see other windows than an uninterrupted run",
                step + 1
            ));
        }
    }
    lines.extend(tokenizer_change(extra, o.data.as_deref()));
    // The model's math beyond its shapes (rotary base, norm epsilon, scaling, window): the
    // checkpoint's shapes were checked, these are not in them.
    let cfg_now = o
        .hf_config
        .as_ref()
        .and_then(|p| std::fs::read_to_string(p).ok());
    if let (Some(was), Some(now)) = (get(HF_CONFIG_KEY), cfg_now) {
        let parse = |t: &str| fsdp_planner::hf::parse_llama_numerics(t, "config.json").ok();
        if let (Some(a), Some(b)) = (parse(&was), parse(&now)) {
            if a != b {
                let scaling = |s: Option<fsdp_planner::Llama3RopeScaling>| {
                    s.map_or("none".into(), |s| format!("llama3 x{}", s.factor))
                };
                let window = |w: Option<u64>| w.map_or("none".into(), |w| w.to_string());
                let changed: Vec<String> = [
                    (
                        "rms_norm_eps",
                        b.rms_norm_eps.to_string(),
                        a.rms_norm_eps.to_string(),
                    ),
                    (
                        "rope_theta",
                        b.rope_theta.to_string(),
                        a.rope_theta.to_string(),
                    ),
                    (
                        "rope_scaling",
                        scaling(b.rope_scaling),
                        scaling(a.rope_scaling),
                    ),
                    (
                        "sliding_window",
                        window(b.sliding_window),
                        window(a.sliding_window),
                    ),
                ]
                .into_iter()
                .filter(|(_, now, was)| now != was)
                .map(|(k, now, was)| format!("{k} {now} was {was}"))
                .collect();
                lines.push(format!(
                    "--hf-config {} computes another model than the checkpoint's config.json \
                     ({}): the same weights give other outputs",
                    o.hf_config
                        .as_ref()
                        .map_or(String::new(), |p| p.display().to_string()),
                    changed.join(", ")
                ));
            }
        }
    }
    let seq_now = o.seq_len as u64;
    if let Some(was) = num("seq_len").filter(|w| *w != seq_now) {
        lines.push(format!(
            "--seq-len {seq_now} (the checkpoint used {was}): the text is re-cut into windows of \
             {} bytes, so the window order differs from step {} on",
            seq_now + 1,
            step + 1
        ));
    }
    let (mb_was, ga_was) = (num("micro_batch"), num("grad_accum"));
    let (mb_now, ga_now, w_now) = (
        o.micro_batch as u64,
        o.grad_accum as u64,
        o.world_size as u64,
    );
    let mut shape = Vec::new();
    if let Some(was) = mb_was.filter(|w| *w != mb_now) {
        shape.push(format!("--micro-batch {mb_now} (was {was})"));
    }
    if let Some(was) = ga_was.filter(|w| *w != ga_now) {
        shape.push(format!("--grad-accum {ga_now} (was {was})"));
    }
    if saved_world != w_now {
        shape.push(format!("world size {w_now} (was {saved_world})"));
    }
    if !shape.is_empty() {
        let per_step_was = mb_was
            .unwrap_or(mb_now)
            .saturating_mul(ga_was.unwrap_or(ga_now))
            .saturating_mul(saved_world);
        let per_step_now = mb_now.saturating_mul(ga_now).saturating_mul(w_now);
        let g = fsdp_types::group_thousands;
        let batch = if per_step_now == per_step_was {
            String::new()
        } else {
            format!(
                "; the global batch changes from {} to {} sequences per step (the \
                 learning-rate schedule still counts steps)",
                g(per_step_was),
                g(per_step_now)
            )
        };
        lines.push(format!(
            "{}: the checkpoint consumed {} sequences of the stream ({step} steps); this run \
             continues at sequence {}, none skipped or repeated{batch}",
            shape.join(", "),
            g(consumed),
            g(consumed)
        ));
    }
    lines
}

/// The manifest's `train.extra` key saying what `train.data_position` counts: `sequences`
/// (the global count of training sequences consumed, at any world size). A checkpoint
/// without it recorded the step there; its stream position is the step times its own
/// sequences per step ([`stream_origin_of`]).
pub const DATA_POSITION_UNIT_KEY: &str = "data_position_unit";

/// Sequences one optimizer step of the run `o` consumes: `micro_batch * grad_accum * W`.
pub fn sequences_per_step(o: &TrainOptions) -> u64 {
    (o.micro_batch as u64)
        .saturating_mul(o.grad_accum as u64)
        .saturating_mul(o.world_size as u64)
}

/// Where a run resumed from a checkpoint with train state `t` (saved at world size
/// `saved_world`) starts in the training stream: the checkpoint's step and its count of
/// consumed sequences, `t.data_position` when it records sequences
/// ([`DATA_POSITION_UNIT_KEY`]), else its step times its own `micro_batch * grad_accum *
/// saved_world` (from `t.extra`). A checkpoint that records neither is taken to have used
/// `this_per_step` sequences per step, and the second value says so (a note for the user).
pub fn stream_origin_of(
    t: &fsdp_checkpoints::TrainState,
    saved_world: u64,
    this_per_step: u64,
) -> (crate::data::StreamOrigin, Option<String>) {
    let num = |k: &str| t.extra.get(k).and_then(|v| v.parse::<u64>().ok());
    let (sequences, note) =
        if t.extra.get(DATA_POSITION_UNIT_KEY).map(String::as_str) == Some("sequences") {
            (t.data_position, None)
        } else if let (Some(mb), Some(ga)) = (num("micro_batch"), num("grad_accum")) {
            (
                t.step
                    .saturating_mul(mb)
                    .saturating_mul(ga)
                    .saturating_mul(saved_world),
                None,
            )
        } else {
            (
                t.step.saturating_mul(this_per_step),
                Some(format!(
                    "note: the checkpoint records neither its stream position nor its \
                     micro-batch and accumulation; taking {} sequences per step, as this run",
                    this_per_step
                )),
            )
        };
    (
        crate::data::StreamOrigin {
            step: t.step,
            sequences,
        },
        note,
    )
}

/// The checkpoint key recording the SHA-256 of the tokenizer a token file `--data` was made
/// with (64 hex digits, from the file's header).
pub const DATA_TOKENIZER_KEY: &str = "data_tokenizer_sha256";

/// The change of tokens between the data a checkpoint trained on (its manifest's
/// `train.extra`, [`data_extra`]) and `data` (`None`: the embedded corpus, as bytes): a token
/// file made with another tokenizer (both SHA-256 named), text as bytes after a token file,
/// or a token file after text. `None` when the tokens mean the same, or when the checkpoint
/// records nothing about its data.
pub fn tokenizer_change(
    extra: &std::collections::BTreeMap<String, String>,
    data: Option<&Path>,
) -> Option<String> {
    let now = data_extra_of(data);
    let shown = data.map_or("the embedded corpus".to_string(), |p| {
        format!("--data {}", p.display())
    });
    match (extra.get(DATA_TOKENIZER_KEY), now.get(DATA_TOKENIZER_KEY)) {
        (Some(was), Some(now)) if was != now => Some(format!(
            "a token file made with another tokenizer ({shown}: sha256 {}.., the checkpoint's \
             {}..): its token ids name other pieces of text than the ones the model learned",
            &now[..now.len().min(12)],
            &was[..was.len().min(12)]
        )),
        (Some(was), None) => Some(format!(
            "text as bytes ({shown}; the checkpoint trained on a token file of tokenizer sha256 \
             {}..): byte values are read as the token ids the model learned",
            &was[..was.len().min(12)]
        )),
        (None, Some(_)) if extra.contains_key("data") => Some(format!(
            "a token file ({shown}; the checkpoint trained on text as bytes): its token ids \
             are not the byte values the model learned"
        )),
        _ => None,
    }
}

/// What the checkpoint records about a token file `--data` (empty for text): its tokenizer
/// hash ([`DATA_TOKENIZER_KEY`]), token count (`data_tokens`) and vocabulary size
/// (`data_vocab_size`), from the header. Text and the embedded corpus record nothing here.
pub fn data_extra(o: &TrainOptions) -> std::collections::BTreeMap<String, String> {
    data_extra_of(o.data.as_deref())
}

/// [`data_extra`] of the data at `data`.
pub fn data_extra_of(data: Option<&Path>) -> std::collections::BTreeMap<String, String> {
    let mut m = std::collections::BTreeMap::new();
    if let Some(h) = data.and_then(|p| crate::data::tokens::probe(p).ok().flatten()) {
        m.insert(DATA_TOKENIZER_KEY.to_string(), h.tokenizer_hex());
        m.insert("data_tokens".to_string(), h.count.to_string());
        m.insert("data_vocab_size".to_string(), h.vocab_size.to_string());
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_changes_name_other_model_math() {
        let t = tempfile::tempdir().unwrap();
        let cfg = |theta: &str| {
            format!(
                r#"{{"model_type":"llama","vocab_size":256,"hidden_size":32,
                "intermediate_size":64,"num_hidden_layers":1,"num_attention_heads":2,
                "rope_theta":{theta}}}"#
            )
        };
        let mut extra = std::collections::BTreeMap::new();
        extra.insert(super::HF_CONFIG_KEY.to_string(), cfg("10000.0"));
        let p = t.path().join("config.json");
        std::fs::write(&p, cfg("10000.0")).unwrap();
        let o = TrainOptions {
            hf_config: Some(p.clone()),
            ..TrainOptions::default()
        };
        assert!(resume_changes(&extra, 1, 5, 0, &o).is_empty());
        std::fs::write(&p, cfg("1234.0")).unwrap();
        let l = resume_changes(&extra, 1, 5, 0, &o);
        assert_eq!(l.len(), 1, "{l:?}");
        assert!(l[0].contains("rope_theta 1234 was 10000"), "{l:?}");
    }

    #[test]
    fn resume_changes_say_where_the_stream_continues() {
        let mut extra = std::collections::BTreeMap::new();
        extra.insert("micro_batch".to_string(), "8".to_string());
        extra.insert("grad_accum".to_string(), "1".to_string());
        extra.insert("seq_len".to_string(), "128".to_string());
        extra.insert("data".to_string(), "(embedded corpus)".to_string());
        let o = TrainOptions {
            micro_batch: 16,
            seq_len: 128,
            world_size: 1,
            ..TrainOptions::default()
        };
        let l = resume_changes(&extra, 1, 20, 160, &o);
        assert_eq!(l.len(), 1, "{l:?}");
        assert!(
            l[0].contains("consumed 160 sequences of the stream (20 steps); this run continues at sequence 160, none skipped or repeated; the global batch changes from 8 to 16"),
            "{l:?}"
        );
        let same = TrainOptions {
            micro_batch: 8,
            ..o.clone()
        };
        assert!(resume_changes(&extra, 1, 20, 160, &same).is_empty());
        // The same global batch at another world size: no batch change.
        let w2 = TrainOptions {
            micro_batch: 4,
            world_size: 2,
            ..o
        };
        let l = resume_changes(&extra, 1, 20, 160, &w2);
        assert!(
            l[0].starts_with("--micro-batch 4 (was 8), world size 2 (was 1): ")
                && !l[0].contains("global batch"),
            "{l:?}"
        );
    }

    #[test]
    fn stream_origin_reads_sequences_or_derives_them_from_an_older_checkpoint() {
        let mut t = fsdp_checkpoints::TrainState {
            step: 20,
            data_position: 20,
            rng_state: vec![],
            optimizer: fsdp_checkpoints::OptimizerState {
                name: "adamw".into(),
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.0,
                step: 20,
            },
            extra: Default::default(),
        };
        // Neither recorded: this run's shape, said.
        let (o, note) = stream_origin_of(&t, 2, 12);
        assert_eq!((o.step, o.sequences), (20, 240));
        assert!(note.unwrap().contains("12 sequences per step"));
        // An older checkpoint: the step was recorded, its shape gives the count.
        t.extra.insert("micro_batch".into(), "3".into());
        t.extra.insert("grad_accum".into(), "5".into());
        let (o, note) = stream_origin_of(&t, 2, 12);
        assert_eq!((o.step, o.sequences, note), (20, 20 * 3 * 5 * 2, None));
        // A checkpoint that records sequences: taken as is.
        t.extra
            .insert(DATA_POSITION_UNIT_KEY.into(), "sequences".into());
        t.data_position = 77;
        let (o, note) = stream_origin_of(&t, 2, 12);
        assert_eq!((o.step, o.sequences, note), (20, 77, None));
    }

    #[test]
    fn resume_changes_name_another_tokenizer() {
        use crate::data::tokens::TokenWriter;
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, sha: u8| {
            let p = dir.path().join(name);
            let mut w = TokenWriter::create(&p, 500, [sha; 32]).unwrap();
            w.push(&[1, 2, 3]).unwrap();
            w.finish().unwrap();
            p
        };
        let (a, b) = (file("a.bin", 0xaa), file("b.bin", 0xbb));
        let on = |p: &std::path::Path| TrainOptions {
            data: Some(p.to_path_buf()),
            ..TrainOptions::default()
        };
        let saved = data_extra(&on(&a));
        assert_eq!(saved[DATA_TOKENIZER_KEY], "aa".repeat(32));
        assert_eq!(saved["data_tokens"], "3");
        assert_eq!(saved["data_vocab_size"], "500");
        let mut extra = saved.clone();
        extra.insert("data".into(), a.display().to_string());
        assert!(resume_changes(&extra, 1, 5, 0, &on(&a)).is_empty());
        // The same path rewritten by another tokenizer.
        std::fs::copy(&b, &a).unwrap();
        let l = resume_changes(&extra, 1, 5, 0, &on(&a));
        assert_eq!(l.len(), 1, "{l:?}");
        assert!(
            l[0].contains("another tokenizer (--data ")
                && l[0].contains("sha256 bbbbbbbbbbbb.., the checkpoint's aaaaaaaaaaaa..)"),
            "{l:?}"
        );
        // The same path, the same tokenizer, another token count: another file.
        let c = file("c.bin", 0xaa);
        let mut extra_c = data_extra(&on(&c));
        extra_c.insert("data".into(), c.display().to_string());
        assert!(resume_changes(&extra_c, 1, 5, 0, &on(&c)).is_empty());
        let mut w = TokenWriter::create(&c, 500, [0xaa; 32]).unwrap();
        w.push(&[1, 2, 3, 4]).unwrap();
        w.finish().unwrap();
        let l = resume_changes(&extra_c, 1, 5, 0, &on(&c));
        assert_eq!(l.len(), 1, "{l:?}");
        assert!(
            l[0].contains("changed since the checkpoint (4 tokens, the checkpoint's file had 3)"),
            "{l:?}"
        );
        // Text after a token file.
        let text = dir.path().join("t.txt");
        std::fs::write(&text, "text").unwrap();
        let l = resume_changes(&extra, 1, 5, 0, &on(&text));
        assert!(l.iter().any(|x| x.starts_with("text as bytes")), "{l:?}");
    }
}

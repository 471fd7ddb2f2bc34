//! The save of a training run's checkpoint, every rank together: the three phases of the
//! crash-safe protocol of `fsdp_checkpoints::save` with a status barrier after each, and what
//! a failed save does (`--on-save-error`).
//!
//! A save fails when a phase's file-system work fails on any rank (a full disk, a file size
//! limit, a permission lost): rank 0 then removes the temporary directory at once (so the
//! failed save keeps no space), `latest` keeps naming the previous checkpoint, and every rank
//! either stops with the same error ([`OnSaveError::Stop`]) or goes on training until the next
//! due save ([`OnSaveError::Continue`]; a failed final save still stops the run, since nothing
//! of the final state would be kept). The error names the failure, the checkpoint's bytes
//! (its rank files, computed from the layout) and the bytes free on that file system.

use super::resume::{CheckpointHooks, SaveReport};
use crate::error::{EngineError, Result};
use crate::model::decoder::Decoder;
use crate::runtime::{RankEngine, ShardBuf};
use fsdp_checkpoints::{CkptError, ShardSource, StateKind};
use std::path::Path;

/// The engine buffer a checkpoint tensor kind is stored from (AdamW's state order).
fn buf_of(kind: StateKind) -> ShardBuf {
    match kind {
        StateKind::Param => ShardBuf::Param,
        StateKind::ExpAvg => ShardBuf::State(0),
        StateKind::ExpAvgSq => ShardBuf::State(1),
    }
}

/// This rank's own engine buffers as the source of its rank file: host buffers are written
/// in place, device buffers through copies of at most the plan's save buffer.
pub(super) struct EngineShards<'e, 'a> {
    pub(super) engine: &'e RankEngine<'a, Decoder>,
}

impl ShardSource for EngineShards<'_, '_> {
    fn shard_len(&self, unit: usize, flat: usize, kind: StateKind) -> Option<usize> {
        self.engine.shard_len(unit, flat, buf_of(kind))
    }

    fn visit(
        &self,
        unit: usize,
        flat: usize,
        kind: StateKind,
        range: std::ops::Range<usize>,
        f: &mut dyn FnMut(&[f32]) -> fsdp_checkpoints::Result<()>,
    ) -> fsdp_checkpoints::Result<()> {
        let mut failed = None;
        self.engine
            .visit_shard(unit, flat, buf_of(kind), range, &mut |x| {
                if failed.is_none() {
                    failed = f(x).err();
                }
            })
            .map_err(|e| CkptError::StateRead(e.to_string()))?;
        failed.map_or(Ok(()), Err)
    }
}

/// The status of a rank whose state cannot be read for a save (a device copy failed, an
/// optimizer whose state the format does not store): the run stops, whatever
/// `--on-save-error` says, since no retry can help.
const UNREADABLE: f64 = 0.5;

/// What a run does when a checkpoint save fails (`fsdp train --on-save-error`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OnSaveError {
    /// Stop every rank with exit status 1, naming the error (the default).
    #[default]
    Stop,
    /// Print a warning naming the error and go on training; the next due save tries again. A
    /// failed final save still stops the run.
    Continue,
}

/// A save every rank agreed has failed: the phase and the error.
pub(super) struct FailedSave {
    /// `start`, `write` or `commit`.
    pub(super) phase: &'static str,
    /// The error, with the path it concerns.
    pub(super) error: String,
}

/// Bytes available to an unprivileged writer on the file system holding `path` (statvfs
/// `f_bavail * f_frsize`); `None` when it cannot be asked.
pub fn free_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path and `st` points to writable memory of the right
    // type; statvfs only writes into it.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    // The field types differ between platforms (u32 or u64).
    #[allow(clippy::unnecessary_cast)]
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

impl CheckpointHooks {
    /// Notes this rank's error of the save of `step`, for the ranks of this process to name
    /// it (rank threads share the hooks).
    fn note_error(&self, step: u64, rank: u64, error: &str) {
        if let Ok(mut v) = self.save_errors.lock() {
            v.retain(|(s, _, _)| *s == step);
            v.push((step, rank, error.to_string()));
        }
    }

    /// The error of a phase every rank agreed failed (`statuses`, one per rank, 0.0 = failed):
    /// this rank's own, else the first failing rank's as noted in this process, else a line
    /// pointing at that rank's own output.
    fn agreed_error(&self, step: u64, statuses: &[f64], local: Option<String>) -> String {
        if let Some(e) = local {
            return e;
        }
        let Some(r) = statuses.iter().position(|&x| x == 0.0) else {
            return "a rank failed".into();
        };
        self.save_errors
            .lock()
            .ok()
            .and_then(|v| {
                v.iter()
                    .find(|(s, q, _)| *s == step && *q == r as u64)
                    .map(|(_, _, e)| format!("rank {r}: {e}"))
            })
            .unwrap_or_else(|| format!("rank {r} failed (its own output names the error)"))
    }

    /// Saves the checkpoint of `step` with every rank: export, start (rank 0), write (ranks of
    /// replicate index 0), commit (rank 0), a status barrier after each phase.
    ///
    /// Returns `Ok(Err(_))` for a save that failed on some rank's file-system work (every rank
    /// gets the same outcome; the temporary directory is already removed).
    ///
    /// Errors: [`EngineError::Checkpoint`] for a state holding an infinite or NaN value (never
    /// saved); collective failures.
    pub(super) fn save_sync(
        &self,
        rank: u64,
        step: u64,
        engine: &mut RankEngine<'_, Decoder>,
        root: &Path,
    ) -> Result<std::result::Result<(), FailedSave>> {
        let t0 = std::time::Instant::now();
        // Phase 1: every rank checks its state in place; rank 0 starts the save. Ranks agree
        // on the outcome through a status all-gather (threads or processes alike).
        let checked = super::resume::check_adamw(engine, root)
            .and_then(|()| engine.first_nonfinite_shard())
            .map_err(|e| format!("cannot read the state of rank {rank}: {e}"));
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
        let mut local_err = begun.as_ref().err().cloned();
        // A state holding an infinite or NaN value is never saved. The status says which
        // value (as -(1 + 3 * global parameter index + state kind)), so every rank can name
        // the parameter, not only the one that holds it.
        let bad = checked
            .as_ref()
            .ok()
            .and_then(|b| b.as_ref())
            .map(|b| self.param_of(rank, b.unit, b.flat, b.index, b.buf));
        // 1: ready; 0: the file system failed; 0.5: the state cannot be read.
        let status = match (bad, &checked) {
            (Some((param, kind)), _) => -(1.0 + (3 * param + kind) as f64),
            (None, Err(_)) => UNREADABLE,
            (None, Ok(_)) => local_err.is_none() as u8 as f64,
        };
        if let Err(e) = &checked {
            self.note_error(step, rank, e);
        }
        if let Some(e) = &local_err {
            self.note_error(step, rank, e);
        }
        let ok = engine.barrier_with_status(status)?;
        if let Some((r, &code)) = ok.iter().enumerate().find(|(_, &x)| x < 0.0) {
            if let Ok(Some(p)) = &begun {
                let _ = p.abort();
            }
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
            return Err(EngineError::Checkpoint(format!(
                "checkpoint of step {step} in {}: refused: the {} of parameter {name} on rank {r} is not finite, and a checkpoint is never written from a non-finite state; the newest complete checkpoint is unchanged",
                root.display(),
                kind.suffix()
            )));
        }
        if let Some(r) = ok.iter().position(|&x| x == UNREADABLE) {
            if let Ok(Some(p)) = &begun {
                let _ = p.abort();
            }
            let mut unreadable = ok.clone();
            unreadable
                .iter_mut()
                .for_each(|x| *x = (*x != UNREADABLE) as u8 as f64);
            return Err(EngineError::Checkpoint(format!(
                "checkpoint of step {step} in {}: refused: {}; nothing was written",
                root.display(),
                self.agreed_error(
                    step,
                    &unreadable,
                    checked.err().filter(|_| r == rank as usize)
                )
            )));
        }
        if ok.contains(&0.0) {
            if let Ok(Some(p)) = &begun {
                let _ = p.abort();
            }
            return Ok(Err(FailedSave {
                phase: "start",
                error: self.agreed_error(step, &ok, local_err),
            }));
        }
        // Phase 2: the ranks of replicate index 0 stream their files from their own buffers,
        // concurrently.
        if self.layout.writes_model_state(rank) {
            let src = EngineShards { engine: &*engine };
            let written = fsdp_checkpoints::PendingCheckpoint::attach(root, &self.layout, step)
                .and_then(|p| p.write_rank_from(rank, &src));
            local_err = written.err().map(|e| e.to_string());
        }
        if let Some(e) = &local_err {
            self.note_error(step, rank, e);
        }
        let ok = engine.barrier_with_status(local_err.is_none() as u8 as f64)?;
        if ok.contains(&0.0) {
            // Every rank has stopped writing: nothing of this save is kept.
            if let Ok(Some(p)) = &begun {
                let _ = p.abort();
            }
            return Ok(Err(FailedSave {
                phase: "write",
                error: self.agreed_error(step, &ok, local_err),
            }));
        }
        // Phase 3: rank 0 writes the manifest, renames into place, updates `latest`.
        if let Ok(Some(p)) = begun {
            let tmp = p.tmp_dir().to_path_buf();
            let t = self.train_state(step, engine);
            let committed = self
                .model_files
                .iter()
                .try_for_each(|(name, bytes)| p.write_model_file(name, bytes))
                .and_then(|()| p.commit(&t, self.keep_last));
            match committed {
                Ok(dir) => {
                    if let Some(f) = &self.on_save {
                        f(&SaveReport {
                            step,
                            bytes: super::resume::dir_bytes(&dir),
                            path: dir,
                            seconds: t0.elapsed().as_secs_f64(),
                        });
                    }
                }
                Err(e) => {
                    // Before the rename the directory is still temporary: remove it.
                    if let Err(r) = std::fs::remove_dir_all(&tmp) {
                        if r.kind() != std::io::ErrorKind::NotFound {
                            eprintln!("warning: cannot remove {}: {r}", tmp.display());
                        }
                    }
                    local_err = Some(e.to_string());
                }
            }
        }
        if let Some(e) = &local_err {
            self.note_error(step, rank, e);
        }
        let ok = engine.barrier_with_status(local_err.is_none() as u8 as f64)?;
        if ok.contains(&0.0) {
            return Ok(Err(FailedSave {
                phase: "commit",
                error: self.agreed_error(step, &ok, local_err),
            }));
        }
        Ok(Ok(()))
    }

    /// The global parameter index (over all units, declaration order) and the state-kind
    /// index (param 0, exp_avg 1, exp_avg_sq 2) of element `i` of buffer `b` of flat
    /// parameter `k` of unit `u` on `rank`.
    fn param_of(&self, rank: u64, u: usize, k: usize, i: usize, b: ShardBuf) -> (usize, usize) {
        let before: usize = self.layout.spec.units[..u]
            .iter()
            .map(|x| x.params.len())
            .sum();
        let f = &self.layout.units[u].flat_params[k];
        let seg = f
            .shard_slices(self.layout.shard_index(rank))
            .iter()
            .find(|s| (s.shard_offset.0..s.shard_offset.0 + s.numel.0).contains(&(i as u64)))
            .map_or(0, |s| f.segments[s.segment].param_index);
        let kind = match b {
            ShardBuf::Param => 0,
            ShardBuf::State(j) => 1 + j.min(1),
        };
        (before + seg, kind)
    }

    /// The training state the manifest of the save of `step` records.
    fn train_state(
        &self,
        step: u64,
        engine: &RankEngine<'_, Decoder>,
    ) -> fsdp_checkpoints::TrainState {
        let mut t = self.train.clone();
        t.step = step;
        // The global count of sequences consumed: a resume at any world size,
        // micro-batch or accumulation continues at the next one.
        t.data_position = self.origin.sequences
            + step.saturating_sub(self.origin.step) * self.sequences_per_step;
        t.extra.insert(
            super::resume::DATA_POSITION_UNIT_KEY.into(),
            "sequences".into(),
        );
        t.optimizer.step = engine.steps_taken() - engine.skipped_steps();
        if let Some(sc) = engine.loss_scaler() {
            t.extra.insert("loss_scale".into(), sc.scale.to_string());
            t.extra
                .insert("loss_scale_clean_steps".into(), sc.clean_steps.to_string());
        }
        t
    }

    /// The step of the next save after `step` (`--ckpt-every`, and the last step).
    fn next_save(&self, step: u64) -> u64 {
        let by_every = step
            .checked_div(self.every)
            .map_or(u64::MAX, |n| (n + 1) * self.every);
        by_every.min(self.last_step)
    }

    /// What a failed save of `step` does under `--on-save-error`: the error naming the phase,
    /// the failure, the checkpoint's bytes and the bytes free, with `latest` unchanged; `Ok`
    /// with a warning (rank 0) to go on training, or the run's error.
    ///
    /// Errors: [`EngineError::Checkpoint`] under [`OnSaveError::Stop`], and for a failed final
    /// save under [`OnSaveError::Continue`].
    pub(super) fn failed_save(
        &self,
        rank: u64,
        step: u64,
        root: &Path,
        failed: FailedSave,
    ) -> Result<()> {
        let g = fsdp_types::group_thousands;
        let needed = match fsdp_checkpoints::checkpoint_bytes(&self.layout) {
            Ok(b) => format!("{} bytes ({})", g(b), fsdp_types::Bytes(b)),
            Err(e) => format!("an unknown number of bytes ({e})"),
        };
        let free = match free_bytes(root) {
            Some(b) => format!("{} bytes ({}) are free", g(b), fsdp_types::Bytes(b)),
            None => "the free space is unknown".into(),
        };
        let latest = std::fs::read_to_string(root.join(fsdp_checkpoints::LATEST_FILE))
            .map(|t| format!("`latest` still names {}", t.trim()))
            .unwrap_or_else(|_| "no earlier checkpoint exists".into());
        let msg = format!(
            "checkpoint of step {step} in {} failed to {}: {}; its rank files need {needed}, \
             {free} on that file system; nothing of this save is kept (the temporary directory \
             is removed) and {latest}",
            root.display(),
            failed.phase,
            failed.error
        );
        match self.on_save_error {
            OnSaveError::Stop => Err(EngineError::Checkpoint(format!(
                "{msg}. The run stops (--on-save-error stop): free space (or fix the directory) \
                 and continue with --resume, or pass --on-save-error continue to train on \
                 without this checkpoint"
            ))),
            OnSaveError::Continue if step >= self.last_step => {
                Err(EngineError::Checkpoint(format!(
                    "{msg}. This was the final save: the final state of step {step} is not saved \
                     (--on-save-error continue keeps training only until the last step)"
                )))
            }
            OnSaveError::Continue => {
                if rank == 0 {
                    eprintln!(
                        "warning: {msg}; training continues (--on-save-error continue), the next \
                         save is due at step {}",
                        self.next_save(step)
                    );
                }
                Ok(())
            }
        }
    }
}

//! The save of a training run's checkpoint, every rank together: the three phases of the
//! crash-safe protocol of `fsdp_checkpoints::save` with a status barrier after each, and what
//! a failed save does (`--on-save-error`).
//!
//! A synchronous save streams each rank file from the engine's own buffers. An asynchronous
//! one (`--ckpt-async`, after PyTorch DCP's `async_save`) copies them into host staging that a
//! writer thread saves while the next steps train; at every step boundary while it is in
//! flight the ranks exchange their writers' status on the training thread (no collective ever
//! runs on a writer thread), and rank 0 commits once every rank file is written and fsynced.
//! One save is in flight at most, and the run's last save is waited for.
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
use fsdp_checkpoints::{CkptError, PendingCheckpoint, ShardSource, StateKind};
use std::path::Path;
use std::time::Instant;

/// The status of a rank whose asynchronous writer is still writing.
const BUSY: f64 = 2.0;

/// What the saves of a run cost it, as rank 0 measured (`fsdp train` prints it in the
/// summary).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct SaveStats {
    /// Saves completed (committed).
    pub saves: u64,
    /// Seconds the training thread was blocked by saves: a synchronous save whole; for an
    /// asynchronous one its start, the copy into host staging, the wait for a previous save
    /// still writing, the commit and the status barriers at the steps it was in flight.
    pub blocked_seconds: f64,
    /// Of `blocked_seconds`, the seconds of the run's last save (always waited for, also
    /// when asynchronous).
    pub final_blocked_seconds: f64,
    /// Whether saves were asynchronous (`--ckpt-async`).
    pub asynchronous: bool,
}

/// A rank's asynchronous save: its host staging buffers (kept from one save to the next) and
/// the save in flight.
#[derive(Debug, Default)]
pub(super) struct AsyncRank {
    staging: Option<fsdp_checkpoints::RankState>,
    in_flight: Option<InFlight>,
}

/// An asynchronous save being written.
#[derive(Debug)]
struct InFlight {
    /// The step saved.
    step: u64,
    /// The writer thread (ranks of replicate index 0): gives the staging buffers back with
    /// the outcome.
    writer: Option<
        std::thread::JoinHandle<(fsdp_checkpoints::RankState, std::result::Result<(), String>)>,
    >,
    /// Rank 0: the save to commit.
    begun: Option<PendingCheckpoint>,
    /// The training state of the step saved (the manifest's).
    train: fsdp_checkpoints::TrainState,
    /// When the save started.
    t0: Instant,
}

/// Host staging buffers for `rank`'s shards under `layout`: the master (and the moments of
/// trainable flat parameters) of every flat parameter, `shard_numel` elements each.
fn staging_for(
    layout: &fsdp_checkpoints::CheckpointLayout,
    rank: u64,
) -> fsdp_checkpoints::RankState {
    let flats = layout
        .units
        .iter()
        .map(|u| {
            u.flat_params
                .iter()
                .map(|f| {
                    let n = f.shard_numel().as_usize();
                    fsdp_checkpoints::FlatShard {
                        param: vec![0.0; n],
                        exp_avg: f.trainable.then(|| vec![0.0; n]),
                        exp_avg_sq: f.trainable.then(|| vec![0.0; n]),
                    }
                })
                .collect()
        })
        .collect();
    fsdp_checkpoints::RankState { rank, flats }
}

/// Copies the engine's master and moments into `staging` (host buffers straight, device ones
/// through copies of at most the plan's save buffer).
///
/// Errors: [`EngineError::Checkpoint`] for a buffer whose length differs; device failures.
fn copy_into_staging(
    engine: &RankEngine<'_, Decoder>,
    staging: &mut fsdp_checkpoints::RankState,
) -> Result<()> {
    for (u, unit) in staging.flats.iter_mut().enumerate() {
        for (k, f) in unit.iter_mut().enumerate() {
            let bufs = [
                (StateKind::Param, Some(&mut f.param)),
                (StateKind::ExpAvg, f.exp_avg.as_mut()),
                (StateKind::ExpAvgSq, f.exp_avg_sq.as_mut()),
            ];
            for (kind, dst) in bufs {
                let Some(dst) = dst else { continue };
                if engine.shard_len(u, k, buf_of(kind)) != Some(dst.len()) {
                    return Err(EngineError::Checkpoint(format!(
                        "unit {u} flat param {k}: the engine's {} shard has {:?} elements, the \
                         checkpoint layout's {}",
                        kind.suffix(),
                        engine.shard_len(u, k, buf_of(kind)),
                        dst.len()
                    )));
                }
                let mut at = 0;
                engine.visit_shard(u, k, buf_of(kind), 0..dst.len(), &mut |x| {
                    dst[at..at + x.len()].copy_from_slice(x);
                    at += x.len();
                })?;
            }
        }
    }
    Ok(())
}

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

/// The OS error number a failed save's error text carries: the `N` of the last
/// `(os error N)`, the form in which `std::io::Error` prints an OS error. The text is what
/// crosses ranks (each rank's error is noted as text), so the number is read back from it.
fn os_error_code(error: &str) -> Option<i32> {
    let at = error.rfind("(os error ")? + "(os error ".len();
    let digits: String = error[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// This process's file size limit (`RLIMIT_FSIZE`, what `ulimit -f` sets) in bytes; `None`
/// when unlimited or when it cannot be read.
fn file_size_limit() -> Option<u64> {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `l` is a valid, writable rlimit; getrlimit only writes into it.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &mut l) };
    // The field type differs between platforms.
    #[allow(clippy::unnecessary_cast)]
    let cur = l.rlim_cur as u64;
    (rc == 0 && l.rlim_cur != libc::RLIM_INFINITY).then_some(cur)
}

/// What to do about a failed save, chosen by the OS error its text carries
/// ([`os_error_code`]): a full file system or quota (ENOSPC, EDQUOT), a file size limit
/// (EFBIG: `largest_file`, the largest rank file in bytes, against `fsize_limit`, this
/// process's `RLIMIT_FSIZE` in bytes if any), a permission or read-only mount (EACCES, EPERM,
/// EROFS); any other error is left as the OS words it (the error text already holds them).
/// `fsdp train` has no option that cuts a rank file into pieces, so a file system whose
/// maximum file size is too small is left for another `--ckpt-dir`.
fn save_error_advice(error: &str, largest_file: Option<u64>, fsize_limit: Option<u64>) -> String {
    let g = fsdp_types::group_thousands;
    match os_error_code(error) {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => "free space on that file system (or raise \
             the disk quota), or pass another --ckpt-dir with room for the rank files"
            .into(),
        Some(libc::EFBIG) => {
            let file = largest_file.map_or_else(
                || "a rank file".to_string(),
                |b| format!("a rank file of {} bytes ({})", g(b), fsdp_types::Bytes(b)),
            );
            let limit = fsize_limit.map_or_else(
                || {
                    "no file size limit is set for this process, so the limit is the file \
                    system's maximum file size"
                        .to_string()
                },
                |b| {
                    format!(
                        "this process's file size limit is {} bytes (`ulimit -f` counts \
                         1024-byte blocks)",
                        g(b)
                    )
                },
            );
            format!(
                "{file} exceeds the size a file may have ({limit}): raise the limit \
                 (`ulimit -f unlimited` in the shell that starts fsdp, or the job scheduler's \
                 file size limit), or pass a --ckpt-dir on a file system whose maximum file \
                 size holds the rank file (rank files are not split); freeing space does not \
                 help"
            )
        }
        Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => {
            "make the checkpoint directory writable by this user (its permissions, or a \
             read-only mount), or pass a writable --ckpt-dir"
                .into()
        }
        _ => "fix what the error names".into(),
    }
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

    /// Saves the checkpoint of `step` with every rank, blocking: start (every rank checks its
    /// state in place, rank 0 creates the temporary directory), write (the ranks of replicate
    /// index 0 stream their files from their own buffers), commit (rank 0), a status barrier
    /// after each phase.
    ///
    /// Returns `Ok(Err(_))` for a save that failed on some rank's file-system work (every rank
    /// gets the same outcome; the temporary directory is already removed).
    ///
    /// Errors: [`EngineError::Checkpoint`] for a state holding an infinite or NaN value (never
    /// saved) or one that cannot be read; collective failures.
    pub(super) fn save_sync(
        &self,
        rank: u64,
        step: u64,
        engine: &mut RankEngine<'_, Decoder>,
        root: &Path,
    ) -> Result<std::result::Result<(), FailedSave>> {
        let t0 = Instant::now();
        let begun = match self.start_phase(rank, step, engine, root)? {
            Ok(b) => b,
            Err(f) => return Ok(Err(f)),
        };
        // The ranks of replicate index 0 stream their files from their own buffers,
        // concurrently.
        let mut local_err = None;
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
            if let Some(p) = &begun {
                let _ = p.abort();
            }
            return Ok(Err(FailedSave {
                phase: "write",
                error: self.agreed_error(step, &ok, local_err),
            }));
        }
        let train = self.train_state(step, engine);
        self.commit_phase(rank, step, engine, begun, &train, t0)
    }

    /// The first phase of a save: every rank checks its state in place (AdamW's, no infinite
    /// or NaN value), rank 0 moves set-aside directories and creates the temporary directory;
    /// a status barrier. Returns rank 0's pending checkpoint (`None` on other ranks), or the
    /// failed save (the temporary directory already removed).
    ///
    /// Errors: [`EngineError::Checkpoint`] for a state holding an infinite or NaN value, or
    /// one that cannot be read (no retry helps either); collective failures.
    fn start_phase(
        &self,
        rank: u64,
        step: u64,
        engine: &mut RankEngine<'_, Decoder>,
        root: &Path,
    ) -> Result<std::result::Result<Option<PendingCheckpoint>, FailedSave>> {
        // Ranks agree on the outcome through a status all-gather (threads or processes alike).
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
        let local_err = begun.as_ref().err().cloned();
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
        let abort = || {
            if let Ok(Some(p)) = &begun {
                let _ = p.abort();
            }
        };
        if let Some((r, &code)) = ok.iter().enumerate().find(|(_, &x)| x < 0.0) {
            abort();
            let code = (-code - 1.0) as usize;
            let (p, kind) = (code / 3, StateKind::ALL[code % 3]);
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
            abort();
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
            abort();
            return Ok(Err(FailedSave {
                phase: "start",
                error: self.agreed_error(step, &ok, local_err),
            }));
        }
        Ok(Ok(begun.unwrap_or(None)))
    }

    /// The last phase of a save whose rank files are all written: rank 0 writes the carried
    /// model files and the manifest (`train`), renames the directory into place, updates
    /// `latest` and prunes; a status barrier. On success rank 0 reports the save (its
    /// seconds since `t0`).
    ///
    /// Errors: collective failures.
    fn commit_phase(
        &self,
        rank: u64,
        step: u64,
        engine: &mut RankEngine<'_, Decoder>,
        begun: Option<PendingCheckpoint>,
        train: &fsdp_checkpoints::TrainState,
        t0: Instant,
    ) -> Result<std::result::Result<(), FailedSave>> {
        let mut local_err = None;
        if let Some(p) = begun {
            let tmp = p.tmp_dir().to_path_buf();
            let committed = self
                .model_files
                .iter()
                .try_for_each(|(name, bytes)| p.write_model_file(name, bytes))
                .and_then(|()| p.commit(train, self.keep_last));
            match committed {
                Ok(dir) => {
                    if let Ok(mut s) = self.save_stats.lock() {
                        s.saves += 1;
                    }
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
                            crate::output::errln!("warning: cannot remove {}: {r}", tmp.display());
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

    /// Starts the asynchronous save of `step` (`--ckpt-async`): the start phase as a
    /// synchronous save, then each rank of replicate index 0 copies its master and moments
    /// into its host staging buffers (allocated at the first save, reused after) and a
    /// background thread writes its rank file from them with the same protocol while the next
    /// steps train. The save completes at a later step boundary ([`CheckpointHooks::settle`]).
    ///
    /// Errors: as [`CheckpointHooks::save_sync`]'s start phase; a state that cannot be copied.
    fn start_async(
        &self,
        rank: u64,
        step: u64,
        engine: &mut RankEngine<'_, Decoder>,
        root: &Path,
    ) -> Result<std::result::Result<(), FailedSave>> {
        let t0 = Instant::now();
        let begun = match self.start_phase(rank, step, engine, root)? {
            Ok(b) => b,
            Err(f) => return Ok(Err(f)),
        };
        let mut slot = self.async_slot(rank)?;
        let writer = if self.layout.writes_model_state(rank) {
            let mut staging = match slot.staging.take() {
                Some(s) => s,
                None => staging_for(&self.layout, rank),
            };
            copy_into_staging(engine, &mut staging)?;
            let (root, layout) = (root.to_path_buf(), self.layout.clone());
            let handle = std::thread::Builder::new()
                .name(format!("rank{rank}-ckpt-writer"))
                .spawn(move || {
                    let written = fsdp_checkpoints::PendingCheckpoint::attach(&root, &layout, step)
                        .and_then(|p| p.write_rank_from(rank, &staging))
                        .map(|_| ())
                        .map_err(|e| e.to_string());
                    (staging, written)
                })
                .map_err(|e| {
                    EngineError::Checkpoint(format!(
                        "checkpoint of step {step}: cannot start the writer thread of rank {rank}: {e}"
                    ))
                })?;
            Some(handle)
        } else {
            None
        };
        slot.in_flight = Some(InFlight {
            step,
            writer,
            begun,
            train: self.train_state(step, engine),
            t0,
        });
        Ok(Ok(()))
    }

    /// This rank's asynchronous save state.
    fn async_slot(&self, rank: u64) -> Result<std::sync::MutexGuard<'_, AsyncRank>> {
        self.async_ranks
            .get(rank as usize)
            .ok_or_else(|| EngineError::Checkpoint(format!("rank {rank} out of range")))?
            .lock()
            .map_err(|_| EngineError::Checkpoint("a checkpoint writer panicked".into()))
    }

    /// At a step boundary with an asynchronous save in flight: every rank says whether its
    /// writer is done, failed or still writing (a status barrier; with `wait`, after waiting
    /// for it). When every rank is done, rank 0 commits the save (manifest, rename, `latest`)
    /// on this, the training thread; when one failed, every rank waits for its own writer and
    /// rank 0 removes the temporary directory, then `--on-save-error` decides. Nothing when no
    /// save is in flight.
    ///
    /// Errors: as [`CheckpointHooks::failed_save`]; collective failures.
    pub(super) fn settle(
        &self,
        rank: u64,
        engine: &mut RankEngine<'_, Decoder>,
        root: &Path,
        wait: bool,
    ) -> Result<()> {
        let mut slot = self.async_slot(rank)?;
        let Some(fl) = slot.in_flight.as_mut() else {
            return Ok(());
        };
        let step = fl.step;
        let mut local_err = None;
        let join = |fl: &mut InFlight, slot_staging: &mut Option<fsdp_checkpoints::RankState>| {
            if let Some(h) = fl.writer.take() {
                match h.join() {
                    Ok((staging, written)) => {
                        *slot_staging = Some(staging);
                        written.err()
                    }
                    Err(_) => Some("the checkpoint writer thread panicked".to_string()),
                }
            } else {
                None
            }
        };
        let status = {
            let AsyncRank { staging, in_flight } = &mut *slot;
            let fl = in_flight.as_mut().expect("checked above");
            if wait || fl.writer.as_ref().is_none_or(|h| h.is_finished()) {
                local_err = join(fl, staging);
                local_err.is_none() as u8 as f64
            } else {
                BUSY
            }
        };
        if let Some(e) = &local_err {
            self.note_error(step, rank, e);
        }
        let ok = engine.barrier_with_status(status)?;
        let (failed, busy) = (ok.contains(&0.0), ok.contains(&BUSY));
        if busy && !failed {
            return Ok(());
        }
        let AsyncRank { staging, in_flight } = &mut *slot;
        let mut fl = in_flight.take().expect("checked above");
        // Every rank settles: a writer still running is waited for.
        if let Some(e) = join(&mut fl, staging) {
            self.note_error(step, rank, &e);
            local_err = Some(e);
        }
        drop(slot);
        if failed {
            if busy {
                // Rank 0 removes the directory only once every writer has stopped.
                engine.barrier_with_status(1.0)?;
            }
            if let Some(p) = &fl.begun {
                let _ = p.abort();
            }
            let failed = FailedSave {
                phase: "write",
                error: self.agreed_error(step, &ok, local_err),
            };
            return self.failed_save(rank, step, root, failed);
        }
        match self.commit_phase(rank, step, engine, fl.begun, &fl.train, fl.t0)? {
            Ok(()) => Ok(()),
            Err(f) => self.failed_save(rank, step, root, f),
        }
    }

    /// The save work of the step boundary after optimizer step `step`: an asynchronous save in
    /// flight is settled (waited for when another save is due or the run ends), then the due
    /// save is made, synchronously or asynchronously (the run's last save is waited for).
    /// The time the training thread spends here, while a save is in flight or due, is the
    /// step time lost to saves ([`CheckpointHooks::save_stats`]).
    ///
    /// Errors: as [`CheckpointHooks::failed_save`] and the start phase; collective failures.
    pub(super) fn save_at(
        &self,
        rank: u64,
        step: u64,
        engine: &mut RankEngine<'_, Decoder>,
        root: &Path,
        stop: bool,
    ) -> Result<()> {
        // `stop`: the run stops after this step (a signal): saved, and waited for.
        let last = stop || step == self.last_step;
        let due = last || (self.every > 0 && step.checked_rem(self.every) == Some(0));
        let in_flight = self.ckpt_async && self.async_slot(rank)?.in_flight.is_some();
        if !due && !in_flight {
            return Ok(());
        }
        let t = Instant::now();
        let result = (|| {
            if in_flight {
                // At most one save in flight: a due save waits for the previous one.
                self.settle(rank, engine, root, due)?;
            }
            if !due {
                return Ok(());
            }
            if !self.ckpt_async {
                return match self.save_sync(rank, step, engine, root)? {
                    Ok(()) => Ok(()),
                    Err(failed) => self.failed_save(rank, step, root, failed),
                };
            }
            if let Err(failed) = self.start_async(rank, step, engine, root)? {
                return self.failed_save(rank, step, root, failed);
            }
            if last {
                // The run's last save is waited for before the run ends.
                self.settle(rank, engine, root, true)?;
            }
            Ok(())
        })();
        if rank == 0 {
            if let Ok(mut s) = self.save_stats.lock() {
                let blocked = t.elapsed().as_secs_f64();
                s.blocked_seconds += blocked;
                if step == self.last_step {
                    s.final_blocked_seconds = blocked;
                }
            }
        }
        result
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
        t.data_position =
            self.origin.sequences + step.saturating_sub(self.origin.step) * self.sequences_per_step;
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
        let largest = (0..self.layout.shard_size)
            .filter_map(|r| fsdp_checkpoints::RankFilePlan::new(&self.layout, r).ok())
            .map(|p| p.file_bytes())
            .max();
        let advice = save_error_advice(&failed.error, largest, file_size_limit());
        match self.on_save_error {
            OnSaveError::Stop => Err(EngineError::Checkpoint(format!(
                "{msg}. The run stops (--on-save-error stop): {advice}, and continue with \
                 --resume, or pass --on-save-error continue to train on without this checkpoint"
            ))),
            OnSaveError::Continue if step >= self.last_step => {
                Err(EngineError::Checkpoint(format!(
                    "{msg}. This was the final save: the final state of step {step} is not saved \
                     (--on-save-error continue keeps training only until the last step); {advice}"
                )))
            }
            OnSaveError::Continue => {
                if rank == 0 {
                    crate::output::errln!(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_advice_follows_the_os_error() {
        let full = save_error_advice(
            "/ck/.tmp-step-4/rank-0000.safetensors: cannot write: No space left on device (os error 28)",
            Some(3 << 20),
            None,
        );
        assert!(full.starts_with("free space on that file system"), "{full}");
        let big = save_error_advice(
            "/ck/.tmp-step-4/rank-0000.safetensors: cannot write: File too large (os error 27)",
            Some(3 << 20),
            Some(1 << 20),
        );
        assert!(
            big.contains("a rank file of 3,145,728 bytes")
                && big.contains("file size limit is 1,048,576 bytes")
                && big.contains("ulimit -f")
                && big.contains("freeing space does not help"),
            "{big}"
        );
        let unlimited = save_error_advice("x: File too large (os error 27)", None, None);
        assert!(
            unlimited.contains("the file system's maximum file size"),
            "{unlimited}"
        );
        for code in [13, 1, 30] {
            let e = format!("/ck: cannot create: denied (os error {code})");
            assert!(
                save_error_advice(&e, None, None).contains("writable --ckpt-dir"),
                "{code}"
            );
        }
        assert_eq!(
            save_error_advice("/ck: Input/output error (os error 5)", None, None),
            "fix what the error names"
        );
        assert_eq!(
            save_error_advice("rank 1 failed (its own output names the error)", None, None),
            "fix what the error names"
        );
    }
}

//! The crash-safe save protocol.
//!
//! 1. [`begin_save`] removes stale temporary directories left by a killed save and creates
//!    `ROOT/.tmp-step-{step:08}`.
//! 2. Each rank of replicate index 0 writes and fsyncs its rank file into it
//!    ([`PendingCheckpoint::write_rank_from`], thread-safe), streamed tensor by tensor through
//!    one bounded buffer and hashed as written, with its record (size, SHA-256) beside it; the
//!    other replicas write nothing. A failed save is abandoned with
//!    [`PendingCheckpoint::abort`], which removes the temporary directory at once.
//! 3. Rank 0 may add the model's own files (tokenizer, generation config) into its
//!    `model-files/` subdirectory ([`PendingCheckpoint::write_model_file`]).
//! 4. [`PendingCheckpoint::commit`] writes and fsyncs `manifest.json` (with every file's size and
//!    SHA-256, model files included) LAST, fsyncs the directory, renames it to `ROOT/step-{step:08}`, fsyncs `ROOT`,
//!    then replaces `ROOT/latest` atomically (write `latest.tmp`, fsync, rename, fsync `ROOT`),
//!    and finally deletes all but the newest `keep_last` checkpoints (each first renamed to a
//!    `.trash-*` name, so a visible `step-*` directory is always complete).
//!
//! A process killed at any moment leaves either the previous `latest` or the new one, both
//! complete; `.tmp-*` and `.trash-*` directories are never taken for checkpoints.

use crate::error::{io_err, CkptError, Result};
use crate::layout::CheckpointLayout;
use crate::manifest::{
    check_model_file_name, rank_file_name, FileRecord, Manifest, ModelFileRecord, TrainState,
    MANIFEST_FILE, MODEL_FILES_DIR,
};
use crate::rankfile::write_rank_file;
use crate::state::{FlatShardRef, ShardRefs, ShardSource};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Name of the pointer file holding the directory name of the newest complete checkpoint.
pub const LATEST_FILE: &str = "latest";

/// Directory name of the checkpoint of `step`: `step-{step:08}`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Parses a `step-{n}` directory name.
pub fn parse_step_dir(name: &str) -> Option<u64> {
    let n = name.strip_prefix("step-")?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

/// fsyncs a directory (so that renames and creations inside it are durable).
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io_err(dir, "fsync directory"))
}

/// Writes `bytes` to `path` through `path.tmp`, fsync and rename (atomic replace), then fsyncs
/// the parent directory.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut f = fs::File::create(&tmp).map_err(io_err(&tmp, "create"))?;
        let written = f.write_all(bytes).and_then(|_| f.sync_all());
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(io_err(&tmp, "write")(e));
        }
    }
    if let Err(e) = fs::rename(&tmp, path) {
        // E.g. `path` is a directory: leave nothing behind.
        let _ = fs::remove_file(&tmp);
        return Err(io_err(path, "rename into place")(e));
    }
    if let Some(parent) = path.parent() {
        let parent = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        sync_dir(parent)?;
    }
    Ok(())
}

/// A checkpoint being written: rank files go into a temporary directory until
/// [`PendingCheckpoint::commit`].
#[derive(Debug)]
pub struct PendingCheckpoint {
    root: PathBuf,
    tmp: PathBuf,
    step: u64,
    layout: CheckpointLayout,
    records: Mutex<Vec<FileRecord>>,
}

/// Starts saving the checkpoint of `step` under `root` (created if needed) for `layout`.
/// Stale `.tmp-*` / `.trash-*` directories of killed saves are removed first: one writer per
/// root at a time.
///
/// Errors: `Io`.
pub fn begin_save(root: &Path, layout: &CheckpointLayout, step: u64) -> Result<PendingCheckpoint> {
    fs::create_dir_all(root).map_err(io_err(root, "create directory"))?;
    for e in fs::read_dir(root).map_err(io_err(root, "list"))? {
        let e = e.map_err(io_err(root, "list"))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(".tmp-") || name.starts_with(".trash-") {
            let p = e.path();
            fs::remove_dir_all(&p).map_err(io_err(&p, "remove stale directory"))?;
        }
    }
    let tmp = root.join(format!(".tmp-{}", step_dir_name(step)));
    fs::create_dir(&tmp).map_err(io_err(&tmp, "create directory"))?;
    Ok(PendingCheckpoint {
        root: root.to_path_buf(),
        tmp,
        step,
        layout: layout.clone(),
        records: Mutex::new(Vec::new()),
    })
}

impl PendingCheckpoint {
    /// Joins a save that [`begin_save`] started (possibly in another process, e.g. MPI rank 0)
    /// for `step` under `root`, to write this rank's file into it. Removes nothing.
    ///
    /// Errors: `NoCheckpoint` when the temporary directory does not exist.
    pub fn attach(root: &Path, layout: &CheckpointLayout, step: u64) -> Result<Self> {
        let tmp = root.join(format!(".tmp-{}", step_dir_name(step)));
        if !tmp.is_dir() {
            return Err(CkptError::NoCheckpoint {
                dir: tmp.display().to_string(),
                reason: format!("no save of step {step} in progress"),
            });
        }
        Ok(PendingCheckpoint {
            root: root.to_path_buf(),
            tmp,
            step,
            layout: layout.clone(),
            records: Mutex::new(Vec::new()),
        })
    }

    /// The layout being saved.
    pub fn layout(&self) -> &CheckpointLayout {
        &self.layout
    }

    /// The temporary directory the rank files go to.
    pub fn tmp_dir(&self) -> &Path {
        &self.tmp
    }

    /// Writes (and fsyncs) the rank file of `rank` from its shards `shards[u][k]` (each
    /// `shard_numel` f32 elements; moments exactly for trainable flat parameters; padding zero).
    /// Ranks of replicate index > 0 write nothing and return `Ok(None)`: their shards equal
    /// those of the rank with the same shard index in replicate group 0.
    ///
    /// Safe to call concurrently from the rank threads.
    ///
    /// Errors: `InvalidArgument`, `ShardLength`, `NonZeroPadding`, `NonFinite` (the first
    /// infinite or NaN value in unit, flat-parameter, state-kind and element order), `Io`.
    pub fn write_rank(
        &self,
        rank: u64,
        shards: &[Vec<FlatShardRef<'_>>],
    ) -> Result<Option<FileRecord>> {
        self.layout.check_rank(rank)?;
        if !self.layout.writes_model_state(rank) {
            return Ok(None);
        }
        if shards.len() != self.layout.units.len()
            || shards
                .iter()
                .zip(&self.layout.units)
                .any(|(a, b)| a.len() != b.flat_params.len())
        {
            return Err(CkptError::InvalidArgument(format!(
                "rank {rank}: shards given for {} units ({} flat params), the layout has {} units ({} flat params)",
                shards.len(),
                shards.iter().map(Vec::len).sum::<usize>(),
                self.layout.units.len(),
                self.layout.num_flat_params()
            )));
        }
        if let Some(bad) = crate::state::find_nonfinite(&self.layout, rank, shards) {
            return Err(CkptError::NonFinite {
                rank,
                name: bad.name,
                kind: bad.kind.suffix(),
                index: bad.index,
                value: bad.value,
            });
        }
        self.write_rank_from(rank, &ShardRefs(shards))
    }

    /// Writes (and fsyncs) the rank file of `rank` from `src`, streaming it tensor by tensor
    /// through one bounded buffer ([`fsdp_planner::memory::save_buffer_bytes`]): no copy of
    /// the rank's state is made. Each value is checked right before it is written; an infinite
    /// or NaN value, a short buffer or a write error (a full disk, a file size limit) stops the
    /// write and removes the partial file. Ranks of replicate index > 0 write nothing and
    /// return `Ok(None)`.
    ///
    /// Beside the rank file goes its record (size and SHA-256 of the bytes written), which
    /// [`PendingCheckpoint::commit`] reads instead of hashing the file again, and removes.
    ///
    /// Safe to call concurrently from the rank threads.
    ///
    /// Errors: `InvalidArgument`, `ShardLength`, `NonZeroPadding`, `NonFinite`, `StateRead`,
    /// `Io`.
    pub fn write_rank_from(&self, rank: u64, src: &dyn ShardSource) -> Result<Option<FileRecord>> {
        self.layout.check_rank(rank)?;
        if !self.layout.writes_model_state(rank) {
            return Ok(None);
        }
        let path = self.tmp.join(rank_file_name(rank));
        let rec = write_rank_file(&path, &self.layout, rank, src)?;
        let side = record_path(&self.tmp, &rec.file);
        let json = serde_json::to_vec(&rec).expect("a file record serializes");
        fs::write(&side, json).map_err(io_err(&side, "write"))?;
        self.records
            .lock()
            .expect("no rank panicked while holding the record lock")
            .push(rec.clone());
        Ok(Some(rec))
    }

    /// Abandons the save: removes the temporary directory and everything written into it, so
    /// that a failed save (a full disk) keeps no space; `latest` and every complete
    /// checkpoint are untouched. Call it once every rank has stopped writing.
    ///
    /// Errors: `Io` when the directory exists and cannot be removed.
    pub fn abort(&self) -> Result<()> {
        match fs::remove_dir_all(&self.tmp) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(&self.tmp, "remove")(e)),
        }
    }

    /// Writes (and fsyncs) `bytes` as the carried model file `name` (e.g. `tokenizer.json`)
    /// into the checkpoint's `model-files/` directory; [`PendingCheckpoint::commit`] records
    /// its size and SHA-256 in the manifest. Called by the process that commits (rank 0).
    ///
    /// Errors: `InvalidArgument` for a name that is not a plain file name
    /// ([`check_model_file_name`]); `Io`.
    pub fn write_model_file(&self, name: &str, bytes: &[u8]) -> Result<()> {
        check_model_file_name(name)?;
        let dir = self.tmp.join(MODEL_FILES_DIR);
        if !dir.is_dir() {
            fs::create_dir(&dir).map_err(io_err(&dir, "create directory"))?;
        }
        write_atomic(&dir.join(name), bytes)
    }

    /// Completes the save once every rank of replicate index 0 has written: manifest last,
    /// rename into place, `latest` updated, old checkpoints pruned to `keep_last` (0 = keep
    /// all). Returns the checkpoint directory.
    ///
    /// Errors: `InvalidArgument` when a rank file is missing (the temporary directory is left
    /// for the next save to remove, nothing becomes visible), `Io`.
    pub fn commit(self, train: &TrainState, keep_last: usize) -> Result<PathBuf> {
        let mut records = self.records.into_inner().expect("record lock not poisoned");
        // Rank files written through other handles (other threads' or processes' `attach`):
        // complete once they carry their final name; hash them here.
        for i in 0..self.layout.shard_size {
            if records.iter().any(|r| r.shard_index == i) {
                continue;
            }
            let path = self.tmp.join(rank_file_name(i));
            if path.is_file() {
                records.push(match written_record(&self.tmp, i, &path)? {
                    Some(rec) => rec,
                    None => {
                        let (bytes, sha256) = crate::rankfile::sync_and_hash(&path)?;
                        FileRecord {
                            file: rank_file_name(i),
                            rank: i,
                            shard_index: i,
                            bytes,
                            sha256,
                        }
                    }
                });
            }
        }
        // The records beside the rank files are not part of the checkpoint.
        for i in 0..self.layout.shard_size {
            let side = record_path(&self.tmp, &rank_file_name(i));
            if let Err(e) = fs::remove_file(&side) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    return Err(io_err(&side, "remove")(e));
                }
            }
        }
        let mut have: Vec<u64> = records.iter().map(|r| r.shard_index).collect();
        have.sort_unstable();
        have.dedup();
        if have.len() as u64 != self.layout.shard_size || records.len() != have.len() {
            let missing: Vec<u64> = (0..self.layout.shard_size)
                .filter(|i| !have.contains(i))
                .collect();
            return Err(CkptError::InvalidArgument(format!(
                "cannot commit checkpoint of step {}: rank files missing for ranks {missing:?} (have {} of {})",
                self.step,
                have.len(),
                self.layout.shard_size
            )));
        }
        let mut manifest = Manifest::new(&self.layout, train.clone(), records);
        manifest.model_files = model_file_records(&self.tmp)?;
        let json = serde_json::to_vec_pretty(&manifest).expect("manifest serializes");
        let mpath = self.tmp.join(MANIFEST_FILE);
        {
            let mut f = fs::File::create(&mpath).map_err(io_err(&mpath, "create"))?;
            f.write_all(&json).map_err(io_err(&mpath, "write"))?;
            f.sync_all().map_err(io_err(&mpath, "fsync"))?;
        }
        sync_dir(&self.tmp)?;
        let name = step_dir_name(self.step);
        let dest = self.root.join(&name);
        if dest.exists() {
            let trash = self.root.join(format!(".trash-{name}"));
            fs::rename(&dest, &trash).map_err(io_err(&dest, "move aside"))?;
            fs::remove_dir_all(&trash).map_err(io_err(&trash, "remove"))?;
        }
        fs::rename(&self.tmp, &dest).map_err(io_err(&dest, "rename into place"))?;
        sync_dir(&self.root)?;
        write_atomic(&self.root.join(LATEST_FILE), format!("{name}\n").as_bytes())?;
        prune(&self.root, keep_last, self.step)?;
        Ok(dest)
    }
}

/// The record a rank wrote beside its rank file `file` in `dir`.
fn record_path(dir: &Path, file: &str) -> PathBuf {
    dir.join(format!("{file}.record"))
}

/// The record rank `i` wrote beside its rank file `path` (size and SHA-256 of the bytes it
/// wrote), when there is one and the file still has that size; `None` otherwise (the file is
/// then hashed as read back).
///
/// Errors: `Io` for a record that exists and cannot be read.
fn written_record(dir: &Path, i: u64, path: &Path) -> Result<Option<FileRecord>> {
    let side = record_path(dir, &rank_file_name(i));
    let bytes = match fs::read(&side) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(&side, "read")(e)),
    };
    let Ok(rec) = serde_json::from_slice::<FileRecord>(&bytes) else {
        return Ok(None);
    };
    let on_disk = fs::metadata(path).map_err(io_err(path, "stat"))?.len();
    let matches = rec.file == rank_file_name(i) && rec.shard_index == i && rec.bytes == on_disk;
    if !matches {
        return Ok(None);
    }
    fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io_err(path, "fsync"))?;
    Ok(Some(rec))
}

/// The size and SHA-256 of every file in `dir/model-files/` (none when it does not exist),
/// sorted by name; leftover `*.tmp` files of an interrupted write are not model files.
fn model_file_records(dir: &Path) -> Result<Vec<ModelFileRecord>> {
    let sub = dir.join(MODEL_FILES_DIR);
    if !sub.is_dir() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for e in fs::read_dir(&sub).map_err(io_err(&sub, "list"))? {
        let e = e.map_err(io_err(&sub, "list"))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(".tmp") {
            continue;
        }
        check_model_file_name(&name)?;
        let (bytes, sha256) = crate::rankfile::sync_and_hash(&e.path())?;
        out.push(ModelFileRecord {
            file: name,
            bytes,
            sha256,
        });
    }
    out.sort_by(|a, b| a.file.cmp(&b.file));
    sync_dir(&sub)?;
    Ok(out)
}

/// Complete checkpoints under `root` (directories `step-N` holding a manifest), sorted by step.
pub fn list_checkpoints(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    for e in fs::read_dir(root).map_err(io_err(root, "list"))? {
        let e = e.map_err(io_err(root, "list"))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(step) = parse_step_dir(&name) {
            if e.path().join(MANIFEST_FILE).is_file() {
                out.push((step, e.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Deletes all but the newest `keep_last` checkpoints (never the one of `current`).
fn prune(root: &Path, keep_last: usize, current: u64) -> Result<()> {
    if keep_last == 0 {
        return Ok(());
    }
    let all = list_checkpoints(root)?;
    let n = all.len();
    for (step, path) in all.into_iter().take(n.saturating_sub(keep_last)) {
        if step == current {
            continue;
        }
        let trash = root.join(format!(".trash-{}", step_dir_name(step)));
        fs::rename(&path, &trash).map_err(io_err(&path, "move aside"))?;
        fs::remove_dir_all(&trash).map_err(io_err(&trash, "remove"))?;
    }
    Ok(())
}

/// Saves a whole checkpoint in one call (ranks simulated in one process): `ranks[i]` holds the
/// shards of rank `i` for `i` in `0..S` (the ranks of replicate index 0; further entries are
/// ignored). Returns the checkpoint directory.
///
/// Errors: as [`begin_save`], [`PendingCheckpoint::write_rank`], [`PendingCheckpoint::commit`].
pub fn save_checkpoint(
    root: &Path,
    layout: &CheckpointLayout,
    ranks: &[Vec<Vec<FlatShardRef<'_>>>],
    train: &TrainState,
    keep_last: usize,
) -> Result<PathBuf> {
    if (ranks.len() as u64) < layout.shard_size {
        return Err(CkptError::InvalidArgument(format!(
            "shards of {} ranks given, the shard group has {}",
            ranks.len(),
            layout.shard_size
        )));
    }
    let pending = begin_save(root, layout, train.step)?;
    for (r, shards) in ranks.iter().enumerate().take(layout.shard_size as usize) {
        pending.write_rank(r as u64, shards)?;
    }
    pending.commit(train, keep_last)
}

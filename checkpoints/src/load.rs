//! Opening, verifying, loading (with resharding) and consolidating a sharded checkpoint.
//!
//! Resharding intersects layouts by parameter NAME: for every slice of a parameter that a
//! target rank's shard holds (target layout), it finds the source shards whose stored slices
//! of the same parameter overlap it (source layout) and copies exactly the overlap, from a
//! memory map of the source rank file. Padding is never read or written; it comes back as
//! zeros. This works for any source and target world size and shard size (FSDP <-> DDP <->
//! hybrid), for different alignments, and even for a different grouping of parameters into
//! units, because the only shared coordinate is (parameter name, element offset). The same
//! routine over the full range `[0, numel)` is consolidation.

use crate::error::{bad_file, CkptError, Result};
use crate::layout::{tensor_name, CheckpointLayout};
use crate::manifest::{Manifest, ModelFileRecord, MANIFEST_FILE, MODEL_FILES_DIR};
use crate::rankfile::{decode_f32, shard_meta, RankFile};
use crate::save::{list_checkpoints, LATEST_FILE};
use crate::state::{FlatShard, FullTensor, RankState, StateKind};
use fsdp_planner::ModelSpec;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// How much of each rank file to check when it is first read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verify {
    /// Size and SHA-256 of every file that is read (the default for loading).
    Checksums,
    /// Size only (faster; a flipped byte would go unnoticed).
    SizesOnly,
}

/// Finds the checkpoint directory for `path`: `path` itself if it holds a `manifest.json`;
/// else the directory named by `path/latest`; else (no pointer yet, or it names a directory
/// that is gone) the complete `step-*` directory with the highest step.
///
/// Errors: `NoCheckpoint` when none is found, `BadFile` for a malformed `latest`, `Io`.
pub fn resolve_checkpoint_dir(path: &Path) -> Result<PathBuf> {
    if path.join(MANIFEST_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        return Err(CkptError::NoCheckpoint {
            dir: path.display().to_string(),
            reason: "not a directory".into(),
        });
    }
    let latest = path.join(LATEST_FILE);
    if latest.is_file() {
        let text =
            std::fs::read_to_string(&latest).map_err(crate::error::io_err(&latest, "read"))?;
        let name = text.trim();
        if name.is_empty() || name.contains('/') || name.contains('\\') || name.starts_with('.') {
            return Err(bad_file(&latest, format!("malformed pointer `{name}`")));
        }
        let dir = path.join(name);
        if dir.join(MANIFEST_FILE).is_file() {
            return Ok(dir);
        }
    }
    match list_checkpoints(path)?.pop() {
        Some((_, dir)) => Ok(dir),
        None => Err(CkptError::NoCheckpoint {
            dir: path.display().to_string(),
            reason: "no manifest.json, no `latest` pointer and no complete step-* directory".into(),
        }),
    }
}

/// An opened sharded checkpoint: manifest read and checked, rank files mapped lazily.
pub struct Checkpoint {
    dir: PathBuf,
    manifest_path: PathBuf,
    manifest: Manifest,
    layout: CheckpointLayout,
    verify: Verify,
    /// Rank files mapped once for the offline readers (consolidation, full tensors).
    files: Vec<OnceLock<RankFile>>,
    /// Rank files whose SHA-256 was checked against the manifest.
    verified: Vec<OnceLock<()>>,
    /// parameter name -> (unit, flat, segment) in the source layout.
    index: HashMap<String, (usize, usize, usize)>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("step", &self.manifest.train.step)
            .field("world_size", &self.manifest.world_size)
            .finish()
    }
}

impl Checkpoint {
    /// Opens the checkpoint at `path` (a checkpoint directory or a root with `latest`, see
    /// [`resolve_checkpoint_dir`]): reads the manifest, checks format name and version,
    /// recomputes the layout from the recorded spec and sizes, and checks that every rank file
    /// exists with the recorded size. Checksums are verified when a file is first read (with
    /// [`Verify::Checksums`]) or by [`Checkpoint::verify_all`].
    ///
    /// Errors: `NoCheckpoint`, `BadFile`, `UnsupportedVersion`, `MissingFile`, `SizeMismatch`,
    /// `Io`.
    pub fn open(path: &Path, verify: Verify) -> Result<Self> {
        let dir = resolve_checkpoint_dir(path)?;
        let manifest_path = dir.join(MANIFEST_FILE);
        let manifest = Manifest::read(&manifest_path)?;
        let layout = manifest.layout(&manifest_path)?;
        for rec in &manifest.files {
            let p = dir.join(&rec.file);
            match std::fs::metadata(&p) {
                Ok(m) if m.len() == rec.bytes => {}
                Ok(m) => {
                    return Err(CkptError::SizeMismatch {
                        file: p.display().to_string(),
                        expected: rec.bytes,
                        found: m.len(),
                    })
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(CkptError::MissingFile {
                        file: p.display().to_string(),
                        rank: rec.rank,
                        world_size: manifest.world_size,
                    })
                }
                Err(e) => return Err(crate::error::io_err(&p, "stat")(e)),
            }
        }
        for rec in &manifest.model_files {
            let p = dir.join(MODEL_FILES_DIR).join(&rec.file);
            match std::fs::metadata(&p) {
                Ok(m) if m.len() == rec.bytes => {}
                Ok(m) => {
                    return Err(CkptError::SizeMismatch {
                        file: p.display().to_string(),
                        expected: rec.bytes,
                        found: m.len(),
                    })
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(bad_file(
                        &p,
                        format!(
                            "missing: {} lists this model file (the checkpoint is incomplete)",
                            manifest_path.display()
                        ),
                    ))
                }
                Err(e) => return Err(crate::error::io_err(&p, "stat")(e)),
            }
        }
        let mut index = HashMap::new();
        for (u, k, f) in layout.flat_params() {
            for (s, seg) in f.segments.iter().enumerate() {
                index.insert(seg.name.clone(), (u, k, s));
            }
        }
        let files = manifest.files.iter().map(|_| OnceLock::new()).collect();
        let verified = manifest.files.iter().map(|_| OnceLock::new()).collect();
        Ok(Checkpoint {
            dir,
            manifest_path,
            manifest,
            layout,
            verify,
            files,
            verified,
            index,
        })
    }

    /// The checkpoint directory (after resolving `latest`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The layout the checkpoint was saved with.
    pub fn layout(&self) -> &CheckpointLayout {
        &self.layout
    }

    /// The model's own files carried with the checkpoint (tokenizer, generation config), as
    /// the manifest lists them; empty when the run started from no model directory.
    pub fn model_files(&self) -> &[ModelFileRecord] {
        &self.manifest.model_files
    }

    /// The bytes of the carried model file `name`, checked against the manifest's size and
    /// SHA-256 (whatever [`Verify`] the checkpoint was opened with: the file is small and is
    /// copied as is into exports and resharded checkpoints).
    ///
    /// Errors: `InvalidArgument` when the manifest lists no such file; `Io`;
    /// `SizeMismatch`, `ChecksumMismatch` for a damaged file.
    pub fn read_model_file(&self, name: &str) -> Result<Vec<u8>> {
        let rec = self
            .manifest
            .model_files
            .iter()
            .find(|r| r.file == name)
            .ok_or_else(|| {
                CkptError::InvalidArgument(format!(
                    "{}: lists no model file `{name}`",
                    self.manifest_path.display()
                ))
            })?;
        let p = self.dir.join(MODEL_FILES_DIR).join(&rec.file);
        let bytes = std::fs::read(&p).map_err(crate::error::io_err(&p, "read"))?;
        if bytes.len() as u64 != rec.bytes {
            return Err(CkptError::SizeMismatch {
                file: p.display().to_string(),
                expected: rec.bytes,
                found: bytes.len() as u64,
            });
        }
        use sha2::Digest as _;
        let found = crate::layout::hex(&sha2::Sha256::digest(&bytes));
        if found != rec.sha256 {
            return Err(CkptError::ChecksumMismatch {
                file: p.display().to_string(),
                expected: rec.sha256.clone(),
                found,
            });
        }
        Ok(bytes)
    }

    /// Opens and checks every rank file (size, SHA-256, header, shard metadata, every expected
    /// tensor's dtype and length) and every carried model file (size, SHA-256). Each file is
    /// mapped only while it is checked: nothing stays mapped afterwards.
    ///
    /// Errors: `MissingFile`, `SizeMismatch`, `ChecksumMismatch`, `BadFile`,
    /// `UnsupportedVersion`, `Io`.
    pub fn verify_all(&self) -> Result<()> {
        for rec in &self.manifest.model_files {
            self.read_model_file(&rec.file)?;
        }
        for i in 0..self.files.len() {
            let f = self.open_rank_file(i as u64, true)?;
            for (u, k, fl) in self.layout.flat_params() {
                let n = fl.shard_real_numel(i as u64).0;
                if n == 0 {
                    continue;
                }
                for kind in StateKind::ALL {
                    if kind == StateKind::Param || fl.trainable {
                        f.tensor_bytes(&tensor_name(u, k, kind.suffix()), n)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Maps rank file `shard_index`, verifying its SHA-256 when `force_verify`, or when the
    /// checkpoint was opened with [`Verify::Checksums`] and the file was not verified yet.
    fn open_rank_file(&self, shard_index: u64, force_verify: bool) -> Result<RankFile> {
        let i = shard_index as usize;
        let verify =
            force_verify || (self.verify == Verify::Checksums && self.verified[i].get().is_none());
        let f = RankFile::open(
            &self.dir,
            &self.manifest.files[i],
            self.manifest.world_size,
            verify,
        )?;
        if verify {
            let _ = self.verified[i].set(());
        }
        Ok(f)
    }

    /// A reader of rank shards for the `target` layout (any world size, shard size or
    /// alignment: resharding), after checking that `target` is a layout of this checkpoint's
    /// model. The reader maps the rank files it reads and unmaps them when it is dropped, so
    /// that a resumed run keeps no mapping of the checkpoint once its state is loaded.
    ///
    /// Errors: `ModelMismatch`.
    pub fn reader<'c>(&'c self, target: &'c CheckpointLayout) -> Result<ShardReader<'c>> {
        self.check_model(&target.spec)?;
        Ok(ShardReader {
            ck: self,
            target,
            files: self
                .files
                .iter()
                .map(|_| std::cell::OnceCell::new())
                .collect(),
        })
    }

    /// Checks that `spec` describes the same model as the checkpoint: the same parameter
    /// names with the same shapes, trainability and ties (unit grouping may differ).
    ///
    /// Errors: `ModelMismatch` naming the first differing parameter.
    pub fn check_model(&self, spec: &ModelSpec) -> Result<()> {
        check_same_model(&self.manifest_path, &self.layout.spec, spec)
    }

    /// Reads elements `[p0, p1)` of buffer `kind` of parameter `name` (flattened, row-major)
    /// into `dest` (`p1 - p0` elements), from every source shard that holds a part of it.
    fn read_param_range(
        &self,
        files: &dyn RankFiles,
        name: &str,
        kind: StateKind,
        p0: u64,
        p1: u64,
        dest: &mut [f32],
    ) -> Result<()> {
        let &(u, k, si) = self.index.get(name).ok_or_else(|| {
            bad_file(
                &self.manifest_path,
                format!("parameter `{name}` is not in the checkpoint"),
            )
        })?;
        let f = &self.layout.units[u].flat_params[k];
        if kind != StateKind::Param && !f.trainable {
            return Err(bad_file(
                &self.manifest_path,
                format!(
                    "parameter `{name}` is frozen in the checkpoint: it has no {}",
                    kind.suffix()
                ),
            ));
        }
        let seg = &f.segments[si];
        let n = f.shard_numel().0;
        let (lo, hi) = (seg.offset.0 + p0, seg.offset.0 + p1);
        if p0 >= p1 {
            return Ok(());
        }
        let mut copied = 0u64;
        for i in lo / n..=(hi - 1) / n {
            let meta = shard_meta(&self.layout, u, k, f, i);
            let Some(sl) = meta.slices.iter().find(|s| s.name == seg.name) else {
                continue;
            };
            let a = p0.max(sl.param_offset);
            let b = p1.min(sl.param_offset + sl.numel);
            if a >= b {
                continue;
            }
            let file = files.rank_file(i)?;
            let bytes = file.tensor_bytes(&tensor_name(u, k, kind.suffix()), meta.stored_numel)?;
            let t0 = (sl.tensor_offset + (a - sl.param_offset)) as usize;
            decode_f32(
                &bytes[t0 * 4..(t0 + (b - a) as usize) * 4],
                &mut dest[(a - p0) as usize..(b - p0) as usize],
            );
            copied += b - a;
        }
        if copied != p1 - p0 {
            return Err(bad_file(
                &self.manifest_path,
                format!("parameter `{name}`: shards hold {copied} of elements [{p0}, {p1})"),
            ));
        }
        Ok(())
    }

    /// Loads the state of `rank` under the `target` layout (any world size, shard size or
    /// alignment: resharding). Each shard is `shard_numel` elements with padding zero;
    /// moments are `Some` for trainable flat parameters. Only the byte ranges this rank needs
    /// are read from the memory-mapped source files (plus a full SHA-256 pass over each file
    /// touched, with [`Verify::Checksums`]).
    ///
    /// Errors: `InvalidArgument` (rank out of range), `ModelMismatch`, and the file errors of
    /// [`Checkpoint::verify_all`].
    pub fn load_rank(&self, target: &CheckpointLayout, rank: u64) -> Result<RankState> {
        target.check_rank(rank)?;
        let reader = self.reader(target)?;
        let mut flats = Vec::with_capacity(target.units.len());
        for (u, ul) in target.units.iter().enumerate() {
            let mut unit = Vec::with_capacity(ul.flat_params.len());
            for (k, f) in ul.flat_params.iter().enumerate() {
                let n = f.shard_numel().as_usize();
                let read = |kind: StateKind| -> Result<Vec<f32>> {
                    let mut buf = vec![0f32; n];
                    reader.read_shard(rank, u, k, kind, 0, &mut buf)?;
                    Ok(buf)
                };
                let param = read(StateKind::Param)?;
                let (exp_avg, exp_avg_sq) = if f.trainable {
                    (
                        Some(read(StateKind::ExpAvg)?),
                        Some(read(StateKind::ExpAvgSq)?),
                    )
                } else {
                    (None, None)
                };
                unit.push(FlatShard {
                    param,
                    exp_avg,
                    exp_avg_sq,
                });
            }
            flats.push(unit);
        }
        Ok(RankState { rank, flats })
    }

    /// The full (unsharded) tensor of buffer `kind` of parameter `name`; a tied name reads its
    /// target.
    ///
    /// Errors: `BadFile` for an unknown name or a frozen parameter's moments; file errors.
    pub fn full_tensor(&self, name: &str, kind: StateKind) -> Result<FullTensor> {
        let target = self
            .layout
            .units
            .iter()
            .flat_map(|u| &u.tied)
            .find(|(t, _)| t == name)
            .map(|(_, target)| target.as_str())
            .unwrap_or(name);
        let &(u, k, si) = self.index.get(target).ok_or_else(|| {
            bad_file(
                &self.manifest_path,
                format!("parameter `{name}` is not in the checkpoint"),
            )
        })?;
        let seg = &self.layout.units[u].flat_params[k].segments[si];
        let mut data = vec![0f32; seg.numel.as_usize()];
        self.read_param_range(self, target, kind, 0, seg.numel.0, &mut data)?;
        Ok(FullTensor {
            name: name.to_string(),
            shape: seg.shape.clone(),
            data,
        })
    }

    /// Every stored parameter's full tensor of buffer `kind`, in declaration order, tied
    /// parameters left out (they are views of their target). For `ExpAvg` / `ExpAvgSq` frozen
    /// parameters are left out too.
    ///
    /// Errors: file errors.
    pub fn consolidate(&self, kind: StateKind) -> Result<Vec<FullTensor>> {
        let mut out = Vec::new();
        for (_, _, f) in self.layout.flat_params() {
            if kind != StateKind::Param && !f.trainable {
                continue;
            }
            for seg in &f.segments {
                out.push(self.full_tensor(&seg.name, kind)?);
            }
        }
        // Declaration order across flat params of one unit (trainable and frozen interleaved).
        let order: HashMap<&str, usize> = self
            .layout
            .spec
            .units
            .iter()
            .flat_map(|u| &u.params)
            .enumerate()
            .map(|(i, p)| (p.name.as_str(), i))
            .collect();
        out.sort_by_key(|t| order.get(t.name.as_str()).copied().unwrap_or(usize::MAX));
        Ok(out)
    }
}

/// Where [`Checkpoint::read_param_range`] gets a mapped rank file.
trait RankFiles {
    /// Rank file `shard_index`, mapped (and verified as the checkpoint asks).
    fn rank_file(&self, shard_index: u64) -> Result<&RankFile>;
}

impl RankFiles for Checkpoint {
    /// Mapped once and kept for the checkpoint's life (offline readers).
    fn rank_file(&self, shard_index: u64) -> Result<&RankFile> {
        let cell = &self.files[shard_index as usize];
        if let Some(f) = cell.get() {
            return Ok(f);
        }
        let _ = cell.set(self.open_rank_file(shard_index, false)?);
        Ok(cell.get().expect("just set"))
    }
}

/// Reads the shards of any rank of a target layout from a [`Checkpoint`] ([`Checkpoint::reader`])
/// through memory maps of its own, released when the reader is dropped.
pub struct ShardReader<'c> {
    ck: &'c Checkpoint,
    target: &'c CheckpointLayout,
    files: Vec<std::cell::OnceCell<RankFile>>,
}

impl RankFiles for ShardReader<'_> {
    fn rank_file(&self, shard_index: u64) -> Result<&RankFile> {
        let cell = &self.files[shard_index as usize];
        if let Some(f) = cell.get() {
            return Ok(f);
        }
        let _ = cell.set(self.ck.open_rank_file(shard_index, false)?);
        Ok(cell.get().expect("just set"))
    }
}

impl ShardReader<'_> {
    /// Fills `dest` with elements `offset..offset + dest.len()` of buffer `kind` of the shard
    /// of flat parameter `flat` of unit `unit` that `rank` holds under the target layout:
    /// real elements from every source shard that holds a part of them, padding as zeros.
    /// Only the byte ranges needed are read.
    ///
    /// Errors: `InvalidArgument` for a rank, flat parameter or range out of the target layout,
    /// or moments of a frozen one; the file errors of [`Checkpoint::verify_all`].
    pub fn read_shard(
        &self,
        rank: u64,
        unit: usize,
        flat: usize,
        kind: StateKind,
        offset: usize,
        dest: &mut [f32],
    ) -> Result<()> {
        let target = self.target;
        target.check_rank(rank)?;
        let f = target
            .units
            .get(unit)
            .and_then(|u| u.flat_params.get(flat))
            .ok_or_else(|| {
                CkptError::InvalidArgument(format!(
                    "unit {unit} flat param {flat} is not in the target layout"
                ))
            })?;
        let n = f.shard_numel().as_usize();
        let end = offset + dest.len();
        if end > n || (kind != StateKind::Param && !f.trainable) {
            return Err(CkptError::InvalidArgument(format!(
                "unit {unit} flat param {flat} (trainable {}): elements {offset}..{end} of its \
                 {} shard of {n}",
                f.trainable,
                kind.suffix()
            )));
        }
        dest.fill(0.0);
        for sl in f.shard_slices(target.shard_index(rank)) {
            let (a, b) = (
                sl.shard_offset.as_usize(),
                (sl.shard_offset + sl.numel).as_usize(),
            );
            let (lo, hi) = (a.max(offset), b.min(end));
            if lo >= hi {
                continue;
            }
            let p0 = sl.param_offset.0 + (lo - a) as u64;
            self.ck.read_param_range(
                self,
                &f.segments[sl.segment].name,
                kind,
                p0,
                p0 + (hi - lo) as u64,
                &mut dest[lo - offset..hi - offset],
            )?;
        }
        Ok(())
    }
}

/// Checks that `found` (recorded in `file`) and `expected` describe the same parameters.
pub(crate) fn check_same_model(file: &Path, found: &ModelSpec, expected: &ModelSpec) -> Result<()> {
    let err = |problem: String| CkptError::ModelMismatch {
        file: file.display().to_string(),
        found_model: found.name.clone(),
        expected_model: expected.name.clone(),
        problem,
    };
    let have: HashMap<&str, &fsdp_planner::ParamSpec> = found
        .units
        .iter()
        .flat_map(|u| &u.params)
        .map(|p| (p.name.as_str(), p))
        .collect();
    let mut n_expected = 0;
    for p in expected.units.iter().flat_map(|u| &u.params) {
        n_expected += 1;
        let Some(q) = have.get(p.name.as_str()) else {
            return Err(err(format!(
                "parameter `{}` (shape {:?}) is not in the checkpoint",
                p.name, p.shape
            )));
        };
        if q.shape != p.shape {
            return Err(err(format!(
                "parameter `{}` has shape {:?} in the checkpoint, the model expects {:?}",
                p.name, q.shape, p.shape
            )));
        }
        if q.trainable != p.trainable {
            return Err(err(format!(
                "parameter `{}` is {} in the checkpoint but {} in the model",
                p.name,
                if q.trainable { "trainable" } else { "frozen" },
                if p.trainable { "trainable" } else { "frozen" }
            )));
        }
        if q.tied_to != p.tied_to {
            return Err(err(format!(
                "parameter `{}` is tied to {:?} in the checkpoint, to {:?} in the model",
                p.name, q.tied_to, p.tied_to
            )));
        }
    }
    if have.len() != n_expected {
        let names: std::collections::HashSet<&str> = expected
            .units
            .iter()
            .flat_map(|u| &u.params)
            .map(|p| p.name.as_str())
            .collect();
        let extra = found
            .units
            .iter()
            .flat_map(|u| &u.params)
            .find(|p| !names.contains(p.name.as_str()))
            .map(|p| p.name.clone())
            .unwrap_or_default();
        return Err(err(format!(
            "the checkpoint has parameter `{extra}`, which the model lacks"
        )));
    }
    Ok(())
}

/// Reshards the checkpoint `src` to `target` and saves it under `out_root` (a new checkpoint
/// root, with its `latest` pointer), one target rank at a time (memory: one rank's state).
/// Training state (step, optimizer, data position, RNG) is carried over unchanged, and so are
/// the carried model files (tokenizer, generation config), byte for byte after their
/// checksums are verified.
///
/// Errors: as [`Checkpoint::load_rank`] and [`crate::save_checkpoint`]; when loading or writing
/// a rank fails, the temporary `.tmp-step-*` directory is removed before returning the error.
pub fn reshard(src: &Checkpoint, target: &CheckpointLayout, out_root: &Path) -> Result<PathBuf> {
    let train = src.manifest().train.clone();
    let pending = crate::save::begin_save(out_root, target, train.step)?;
    let written = (0..target.shard_size)
        .try_for_each(|r| {
            let st = src.load_rank(target, r)?;
            pending.write_rank(r, &st.as_refs()).map(|_| ())
        })
        .and_then(|()| {
            // The model's own files travel with the checkpoint, byte for byte.
            src.model_files()
                .iter()
                .try_for_each(|m| pending.write_model_file(&m.file, &src.read_model_file(&m.file)?))
        });
    if let Err(e) = written {
        // Best effort: the error being returned matters more than a failed cleanup.
        let _ = std::fs::remove_dir_all(pending.tmp_dir());
        return Err(e);
    }
    pending.commit(&train, 0)
}

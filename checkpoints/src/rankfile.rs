//! Per-rank safetensors files: writing one rank's shards and reading ranges back through a
//! memory map.
//!
//! A rank file holds, for every flat parameter, only the REAL elements of the rank's shard
//! (the shard's parameter slices concatenated in flat order; padding is never written), as 1-D
//! f32 tensors `units.{u}.flat{k}.param` / `.exp_avg` / `.exp_avg_sq`. A shard with no real
//! element (possible when a flat parameter is smaller than the shard group) has no tensor. The
//! safetensors `__metadata__` marks the file as a shard and maps each tensor back to parameter
//! names, full shapes and offsets, so a file can be understood on its own.

use crate::error::{bad_file, io_err, CkptError, Result};
use crate::layout::{hex, tensor_name, CheckpointLayout};
use crate::manifest::{FileRecord, FORMAT_VERSION};
use crate::state::{ShardSource, StateKind};
use fsdp_planner::FlatParamLayout;
use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

#[cfg(target_endian = "big")]
compile_error!("fsdp-checkpoints stores little-endian f32 and assumes a little-endian host");

/// `__metadata__["format"]` of a rank file. Hugging Face loaders only accept `pt`/`tf`/`flax`/
/// `mlx`, so they refuse a shard file instead of reading it as a model.
pub const SHARD_FORMAT: &str = "fsdp-rs-shard";

/// One parameter slice inside a rank-file tensor (metadata `fsdp_rs.shards`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SliceMeta {
    /// Parameter name.
    pub name: String,
    /// Full parameter shape (elements).
    pub shape: Vec<u64>,
    /// First element of the slice inside the flattened parameter.
    pub param_offset: u64,
    /// Elements in the slice.
    pub numel: u64,
    /// Position of the slice inside the (padded) shard (elements).
    pub shard_offset: u64,
    /// Position of the slice inside the stored tensor (elements).
    pub tensor_offset: u64,
}

/// One flat parameter's shard inside a rank file (metadata `fsdp_rs.shards`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardMeta {
    /// Tensor prefix, `units.{u}.flat{k}`.
    pub tensor: String,
    /// Unit index.
    pub unit: usize,
    /// Unit name.
    pub unit_name: String,
    /// Flat-parameter index in the unit.
    pub flat: usize,
    /// Whether the flat parameter is trainable (moments stored).
    pub trainable: bool,
    /// Unsharded flat length including padding (elements).
    pub padded_numel: u64,
    /// `[start, end)` of this shard inside the unsharded flat parameter (elements).
    pub shard_range: [u64; 2],
    /// Real elements stored (length of each stored tensor).
    pub stored_numel: u64,
    /// The parameter slices, in order.
    pub slices: Vec<SliceMeta>,
}

/// Slices of shard `shard_index` of `f`, with their positions inside the stored tensor.
pub(crate) fn shard_meta(
    layout: &CheckpointLayout,
    u: usize,
    k: usize,
    f: &FlatParamLayout,
    shard_index: u64,
) -> ShardMeta {
    let r = f.shard_range(shard_index);
    let mut t = 0u64;
    let slices = f
        .shard_slices(shard_index)
        .iter()
        .map(|s| {
            let seg = &f.segments[s.segment];
            let m = SliceMeta {
                name: seg.name.clone(),
                shape: seg.shape.clone(),
                param_offset: s.param_offset.0,
                numel: s.numel.0,
                shard_offset: s.shard_offset.0,
                tensor_offset: t,
            };
            t += s.numel.0;
            m
        })
        .collect();
    ShardMeta {
        tensor: format!("units.{u}.flat{k}"),
        unit: u,
        unit_name: layout.units[u].name.clone(),
        flat: k,
        trainable: f.trainable,
        padded_numel: f.padded_numel.0,
        shard_range: [r.start, r.end],
        stored_numel: t,
        slices,
    }
}

/// The `__metadata__` of the rank file of `rank` (shard index `s`): format, sizes, rank, model,
/// plan fingerprint and the shard map `metas`.
fn rank_metadata(
    layout: &CheckpointLayout,
    rank: u64,
    s: u64,
    metas: &[ShardMeta],
) -> HashMap<String, String> {
    let mut md = HashMap::new();
    md.insert("format".to_string(), SHARD_FORMAT.to_string());
    md.insert("fsdp_rs.kind".into(), "shard".into());
    md.insert("fsdp_rs.format_version".into(), FORMAT_VERSION.to_string());
    md.insert("fsdp_rs.world_size".into(), layout.world_size.to_string());
    md.insert("fsdp_rs.rank".into(), rank.to_string());
    md.insert("fsdp_rs.shard_size".into(), layout.shard_size.to_string());
    md.insert(
        "fsdp_rs.replicate_size".into(),
        layout.replicate_size().to_string(),
    );
    md.insert("fsdp_rs.shard_index".into(), s.to_string());
    md.insert("fsdp_rs.model".into(), layout.spec.name.clone());
    md.insert(
        "fsdp_rs.plan_fingerprint".into(),
        layout.plan_fingerprint.clone(),
    );
    md.insert(
        "fsdp_rs.shards".into(),
        serde_json::to_string(metas).expect("shard metadata serializes"),
    );
    md
}

/// One tensor of a rank file: buffer `kind` of flat parameter `flat` of unit `unit`, `numel`
/// real elements.
#[derive(Debug, Clone)]
struct StoredTensor {
    name: String,
    unit: usize,
    flat: usize,
    kind: StateKind,
    numel: u64,
}

/// A rank file known before any value is read: its tensors in data order and the exact bytes
/// that precede the data (the 8-byte header length and the canonical header), computed from
/// the layout alone. The bytes are those `safetensors::serialize_to_file` writes for the same
/// tensors, header canonicalised (`header.rs`): tensors in data order by name, the
/// header padded with spaces to a multiple of 8 bytes.
#[derive(Debug, Clone)]
pub struct RankFilePlan {
    rank: u64,
    prefix: Vec<u8>,
    tensors: Vec<StoredTensor>,
    /// Shard metadata per flat parameter, in layout order.
    metas: Vec<ShardMeta>,
    data_bytes: u64,
}

impl RankFilePlan {
    /// The rank file of `rank` (replicate index 0) under `layout`.
    ///
    /// Errors: `InvalidArgument` for a rank out of range or of replicate index > 0, or a header
    /// safetensors refuses.
    pub fn new(layout: &CheckpointLayout, rank: u64) -> Result<Self> {
        layout.check_rank(rank)?;
        if !layout.writes_model_state(rank) {
            return Err(CkptError::InvalidArgument(format!(
                "rank {rank} has replicate index {} > 0: only ranks 0..{} write model state",
                layout.replicate_index(rank),
                layout.shard_size
            )));
        }
        let s = layout.shard_index(rank);
        let mut metas = Vec::with_capacity(layout.num_flat_params());
        let mut tensors = Vec::new();
        for (u, k, f) in layout.flat_params() {
            let meta = shard_meta(layout, u, k, f, s);
            if meta.stored_numel > 0 {
                for kind in StateKind::ALL {
                    if kind == StateKind::Param || f.trainable {
                        tensors.push(StoredTensor {
                            name: tensor_name(u, k, kind.suffix()),
                            unit: u,
                            flat: k,
                            kind,
                            numel: meta.stored_numel,
                        });
                    }
                }
            }
            metas.push(meta);
        }
        // safetensors orders tensors by dtype, then name: all are F32 here.
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let mut offset = 0usize;
        let infos = tensors
            .iter()
            .map(|t| {
                let n = t.numel as usize * 4;
                let info = TensorInfo {
                    dtype: Dtype::F32,
                    shape: vec![t.numel as usize],
                    data_offsets: (offset, offset + n),
                };
                offset += n;
                (t.name.clone(), info)
            })
            .collect();
        let md = rank_metadata(layout, rank, s, &metas);
        let header = Metadata::new(Some(md), infos).map_err(|e| {
            CkptError::InvalidArgument(format!("rank {rank}: rank file header: {e}"))
        })?;
        let mut json = serde_json::to_string(&header)
            .expect("safetensors metadata serializes")
            .into_bytes();
        json.resize(json.len().next_multiple_of(8), b' ');
        let json = crate::header::canonical_header(&json).map_err(|e| {
            CkptError::InvalidArgument(format!("rank {rank}: rank file header: {e}"))
        })?;
        let mut prefix = (json.len() as u64).to_le_bytes().to_vec();
        prefix.extend_from_slice(&json);
        Ok(RankFilePlan {
            rank,
            prefix,
            tensors,
            metas,
            data_bytes: offset as u64,
        })
    }

    /// Size of the file in bytes: header length field, header and data.
    pub fn file_bytes(&self) -> u64 {
        self.prefix.len() as u64 + self.data_bytes
    }

    /// The shard metadata of flat parameter `flat` of unit `unit`.
    fn meta(&self, unit: usize, flat: usize) -> &ShardMeta {
        self.metas
            .iter()
            .find(|m| m.unit == unit && m.flat == flat)
            .expect("every flat parameter has its metadata")
    }
}

/// Bytes of the rank files of a checkpoint of `layout` (ranks `0..S`; the manifest and the
/// carried model files are not counted): what a save needs on disk, known before writing.
///
/// Errors: as [`RankFilePlan::new`].
pub fn checkpoint_bytes(layout: &CheckpointLayout) -> Result<u64> {
    (0..layout.shard_size)
        .map(|r| RankFilePlan::new(layout, r).map(|p| p.file_bytes()))
        .sum()
}

/// Checks what `src` holds for `rank` against the layout before anything is written: every
/// flat parameter's master shard, both moments exactly for trainable ones, each `shard_numel`
/// elements, padding all zero.
///
/// Errors: `InvalidArgument`, `ShardLength`, `NonZeroPadding`, `StateRead`.
fn check_source(
    plan: &RankFilePlan,
    layout: &CheckpointLayout,
    src: &dyn ShardSource,
) -> Result<()> {
    let rank = plan.rank;
    for (u, k, f) in layout.flat_params() {
        let meta = plan.meta(u, k);
        let n = f.shard_numel().0;
        for kind in StateKind::ALL {
            let len = match (kind, src.shard_len(u, k, kind)) {
                (StateKind::Param, None) => {
                    return Err(CkptError::InvalidArgument(format!(
                        "rank {rank}, unit {u} flat param {k} has no param shard"
                    )))
                }
                (_, None) if f.trainable => {
                    return Err(CkptError::InvalidArgument(format!(
                        "rank {rank}, unit {u} flat param {k} is trainable but has no {} shard",
                        kind.suffix()
                    )))
                }
                (_, None) => continue,
                (StateKind::Param, Some(len)) => len,
                (_, Some(_)) if !f.trainable => {
                    return Err(CkptError::InvalidArgument(format!(
                        "rank {rank}, unit {u} flat param {k} is frozen but a {} shard was given",
                        kind.suffix()
                    )))
                }
                (_, Some(len)) => len,
            };
            if len as u64 != n {
                return Err(CkptError::ShardLength {
                    rank,
                    unit: u,
                    flat: k,
                    what: kind.suffix(),
                    expected: n,
                    found: len as u64,
                });
            }
            // Padding: the gaps before, between and after the real slices.
            let mut count = 0u64;
            let mut first = 0u64;
            let mut gaps = Vec::with_capacity(meta.slices.len() + 1);
            let mut pos = 0u64;
            for s in &meta.slices {
                gaps.push(pos..s.shard_offset);
                pos = s.shard_offset + s.numel;
            }
            gaps.push(pos..n);
            for g in gaps.into_iter().filter(|g| g.start < g.end) {
                let mut at = g.start;
                src.visit(u, k, kind, g.start as usize..g.end as usize, &mut |part| {
                    for (i, x) in part.iter().enumerate() {
                        if x.to_bits() != 0 {
                            if count == 0 {
                                first = at + i as u64;
                            }
                            count += 1;
                        }
                    }
                    at += part.len() as u64;
                    Ok(())
                })?;
            }
            if count > 0 {
                return Err(CkptError::NonZeroPadding {
                    rank,
                    unit: u,
                    flat: k,
                    what: kind.suffix(),
                    count,
                    first,
                });
            }
        }
    }
    Ok(())
}

/// Writes a file through one bounded buffer, hashing (SHA-256) what it writes.
struct HashingWriter<'p> {
    file: std::fs::File,
    path: &'p Path,
    buf: Vec<u8>,
    hasher: Sha256,
    written: u64,
}

impl<'p> HashingWriter<'p> {
    fn new(file: std::fs::File, path: &'p Path, capacity: usize) -> Self {
        HashingWriter {
            file,
            path,
            buf: Vec::with_capacity(capacity),
            hasher: Sha256::new(),
            written: 0,
        }
    }

    fn put(&mut self, mut bytes: &[u8]) -> Result<()> {
        while !bytes.is_empty() {
            let take = (self.buf.capacity() - self.buf.len()).min(bytes.len());
            self.buf.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.buf.len() == self.buf.capacity() {
                self.flush()?;
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        use std::io::Write as _;
        self.file
            .write_all(&self.buf)
            .map_err(io_err(self.path, "write"))?;
        self.hasher.update(&self.buf);
        self.written += self.buf.len() as u64;
        self.buf.clear();
        Ok(())
    }

    /// Writes what is buffered, fsyncs, and returns the bytes written and their SHA-256 (hex).
    fn finish(mut self) -> Result<(u64, String)> {
        self.flush()?;
        self.file.sync_all().map_err(io_err(self.path, "fsync"))?;
        Ok((self.written, hex(&self.hasher.finalize())))
    }
}

/// Writes the rank file of `rank` (replicate index 0) to `path` from `src`, streaming tensor
/// by tensor through one buffer of [`fsdp_planner::memory::save_buffer_bytes`] bytes (never a
/// copy of the whole state), fsyncs it, and returns its record (size, SHA-256 of the bytes
/// written). The file is written as `<path>.part` and renamed into place once complete; on
/// any error the part file is removed.
///
/// Every value is checked right before it is written: an infinite or NaN one stops the write
/// (a checkpoint never holds one). The bytes equal those of the safetensors writer for the
/// same state (`RankFilePlan`).
///
/// Errors: `InvalidArgument`, `ShardLength`, `NonZeroPadding`, `NonFinite`, `StateRead`, `Io`.
pub(crate) fn write_rank_file(
    path: &Path,
    layout: &CheckpointLayout,
    rank: u64,
    src: &dyn ShardSource,
) -> Result<FileRecord> {
    let plan = RankFilePlan::new(layout, rank)?;
    check_source(&plan, layout, src)?;
    // Written as `<name>.part`, fsynced, then renamed: a file with the final name is always
    // complete, even if another process (an MPI rank 0) picks it up.
    let mut part = path.as_os_str().to_owned();
    part.push(".part");
    let part = PathBuf::from(part);
    let capacity = fsdp_planner::memory::save_buffer_bytes(&layout.units) as usize;
    let written = std::fs::File::create(&part)
        .map_err(io_err(&part, "create"))
        .and_then(|file| {
            let mut w = HashingWriter::new(file, &part, capacity);
            w.put(&plan.prefix)?;
            for t in &plan.tensors {
                for sl in &plan.meta(t.unit, t.flat).slices {
                    let lo = sl.shard_offset as usize;
                    let mut at = sl.param_offset;
                    src.visit(
                        t.unit,
                        t.flat,
                        t.kind,
                        lo..lo + sl.numel as usize,
                        &mut |chunk| {
                            if let Some(i) = chunk.iter().position(|v| !v.is_finite()) {
                                return Err(CkptError::NonFinite {
                                    rank,
                                    name: sl.name.clone(),
                                    kind: t.kind.suffix(),
                                    index: at + i as u64,
                                    value: chunk[i],
                                });
                            }
                            at += chunk.len() as u64;
                            w.put(bytemuck::cast_slice(chunk))
                        },
                    )?;
                }
            }
            w.finish()
        })
        .and_then(|(bytes, sha256)| {
            if bytes != plan.file_bytes() {
                return Err(CkptError::InvalidArgument(format!(
                    "{}: {bytes} bytes written, the layout's rank file has {}",
                    part.display(),
                    plan.file_bytes()
                )));
            }
            std::fs::rename(&part, path).map_err(io_err(path, "rename into place"))?;
            Ok((bytes, sha256))
        });
    let (bytes, sha256) = match written {
        Ok(x) => x,
        Err(e) => {
            // Leave no partial file holding the space (a full disk, a size limit).
            let _ = std::fs::remove_file(&part);
            return Err(e);
        }
    };
    Ok(FileRecord {
        file: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        rank,
        shard_index: layout.shard_index(rank),
        bytes,
        sha256,
    })
}

/// fsyncs `path` and returns its size and SHA-256 (hex), hashing the bytes as read back.
pub(crate) fn sync_and_hash(path: &Path) -> Result<(u64, String)> {
    let mut f = std::fs::File::open(path).map_err(io_err(path, "open"))?;
    f.sync_all().map_err(io_err(path, "fsync"))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let r = f.read(&mut buf).map_err(io_err(path, "read"))?;
        if r == 0 {
            break;
        }
        h.update(&buf[..r]);
        n += r as u64;
    }
    Ok((n, hex(&h.finalize())))
}

/// A rank file opened through a memory map, header parsed and checked.
pub(crate) struct RankFile {
    path: PathBuf,
    mmap: Mmap,
    data_start: usize,
    meta: Metadata,
}

impl RankFile {
    /// Opens `record` inside `dir`: checks existence and size, maps it, verifies the SHA-256 if
    /// `verify`, parses the safetensors header and checks its shard metadata against the
    /// manifest (`world_size`).
    pub(crate) fn open(
        dir: &Path,
        record: &FileRecord,
        world_size: u64,
        verify: bool,
    ) -> Result<Self> {
        let path = dir.join(&record.file);
        let file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(CkptError::MissingFile {
                    file: path.display().to_string(),
                    rank: record.rank,
                    world_size,
                })
            }
            Err(e) => return Err(io_err(&path, "open")(e)),
        };
        let len = file.metadata().map_err(io_err(&path, "stat"))?.len();
        if len != record.bytes {
            return Err(CkptError::SizeMismatch {
                file: path.display().to_string(),
                expected: record.bytes,
                found: len,
            });
        }
        // SAFETY: the map is read-only; checkpoint files are immutable once renamed into place
        // (a writer never modifies a committed directory, it writes a new one).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io_err(&path, "memory-map"))?;
        if verify {
            let found = hex(&Sha256::digest(&mmap[..]));
            if found != record.sha256 {
                return Err(CkptError::ChecksumMismatch {
                    file: path.display().to_string(),
                    expected: record.sha256.clone(),
                    found,
                });
            }
        }
        let (n, meta) = safetensors::SafeTensors::read_metadata(&mmap[..])
            .map_err(|e| bad_file(&path, format!("bad safetensors header: {e}")))?;
        let md = meta.metadata().clone().unwrap_or_default();
        let get = |k: &str| md.get(k).map(String::as_str).unwrap_or("(missing)");
        if get("format") != SHARD_FORMAT {
            return Err(bad_file(
                &path,
                format!(
                    "not an fsdp-rs rank file (metadata format `{}`)",
                    get("format")
                ),
            ));
        }
        if get("fsdp_rs.format_version") != FORMAT_VERSION.to_string() {
            return Err(CkptError::UnsupportedVersion {
                file: path.display().to_string(),
                found: get("fsdp_rs.format_version").to_string(),
                supported: FORMAT_VERSION,
            });
        }
        if get("fsdp_rs.rank") != record.rank.to_string()
            || get("fsdp_rs.world_size") != world_size.to_string()
        {
            return Err(bad_file(
                &path,
                format!(
                    "metadata says rank {} of world size {}, the manifest expects rank {} of {}",
                    get("fsdp_rs.rank"),
                    get("fsdp_rs.world_size"),
                    record.rank,
                    world_size
                ),
            ));
        }
        Ok(RankFile {
            path,
            mmap,
            data_start: 8 + n,
            meta,
        })
    }

    /// The stored tensor `name`, checked to be F32 of shape `[expected_numel]`, as raw bytes.
    pub(crate) fn tensor_bytes(&self, name: &str, expected_numel: u64) -> Result<&[u8]> {
        let info = self.meta.info(name).ok_or_else(|| {
            bad_file(
                &self.path,
                format!("tensor `{name}` is missing ({expected_numel} elements expected)"),
            )
        })?;
        if info.dtype != Dtype::F32 || info.shape != [expected_numel as usize] {
            return Err(bad_file(
                &self.path,
                format!(
                    "tensor `{name}` is {:?} {:?}, expected F32 [{expected_numel}]",
                    info.dtype, info.shape
                ),
            ));
        }
        let (a, b) = info.data_offsets;
        Ok(&self.mmap[self.data_start + a..self.data_start + b])
    }
}

/// Decodes little-endian f32 bytes into `dest` (`bytes.len() == 4 * dest.len()`).
pub(crate) fn decode_f32(bytes: &[u8], dest: &mut [f32]) {
    debug_assert_eq!(bytes.len(), dest.len() * 4);
    // Tensor data is 4-byte aligned in a memory map (page-aligned base, 8-byte padded header,
    // f32-only tensors): then this is one memcpy.
    if let Ok(src) = bytemuck::try_cast_slice::<u8, f32>(bytes) {
        dest.copy_from_slice(src);
        return;
    }
    for (d, c) in dest.iter_mut().zip(bytes.chunks_exact(4)) {
        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

/// The writer this crate used before saves streamed: the whole rank file assembled by
/// `safetensors::serialize_to_file`, then its header canonicalised. Kept to prove that the
/// streaming writer writes the same bytes.
#[cfg(test)]
mod reference {
    use super::*;
    use safetensors::tensor::View;
    use std::borrow::Cow;

    /// A 1-D f32 tensor made of borrowed pieces (the real slices of a shard).
    struct Packed<'a> {
        parts: Vec<&'a [f32]>,
        shape: [usize; 1],
    }

    impl View for Packed<'_> {
        fn dtype(&self) -> Dtype {
            Dtype::F32
        }
        fn shape(&self) -> &[usize] {
            &self.shape
        }
        fn data(&self) -> Cow<'_, [u8]> {
            if self.parts.len() == 1 {
                Cow::Borrowed(bytemuck::cast_slice(self.parts[0]))
            } else {
                let mut v = Vec::with_capacity(self.shape[0] * 4);
                for p in &self.parts {
                    v.extend_from_slice(bytemuck::cast_slice(p));
                }
                Cow::Owned(v)
            }
        }
        fn data_len(&self) -> usize {
            self.shape[0] * 4
        }
    }

    /// Checks one buffer of a shard: length `shard_numel`, padding all zero.
    fn check_buffer(
        rank: u64,
        u: usize,
        k: usize,
        what: StateKind,
        buf: &[f32],
        f: &FlatParamLayout,
        meta: &ShardMeta,
    ) -> Result<()> {
        let n = f.shard_numel().0;
        if buf.len() as u64 != n {
            return Err(CkptError::ShardLength {
                rank,
                unit: u,
                flat: k,
                what: what.suffix(),
                expected: n,
                found: buf.len() as u64,
            });
        }
        let mut count = 0u64;
        let mut first = 0u64;
        let mut pos = 0u64;
        let mut check = |lo: u64, hi: u64| {
            for (i, x) in buf[lo as usize..hi as usize].iter().enumerate() {
                if x.to_bits() != 0 {
                    if count == 0 {
                        first = lo + i as u64;
                    }
                    count += 1;
                }
            }
        };
        for s in &meta.slices {
            check(pos, s.shard_offset);
            pos = s.shard_offset + s.numel;
        }
        check(pos, n);
        if count > 0 {
            return Err(CkptError::NonZeroPadding {
                rank,
                unit: u,
                flat: k,
                what: what.suffix(),
                count,
                first,
            });
        }
        Ok(())
    }

    /// Writes the rank file of `rank` (replicate index 0) to `path`, fsyncs it, and returns its
    /// record (size, SHA-256 of the bytes on disk). `shards[u][k]` must follow `layout`.
    ///
    /// Errors: `InvalidArgument` (wrong number of shards, a replica rank), `ShardLength`,
    /// `NonZeroPadding`, `Io`.
    pub(super) fn write_rank_file_reference(
        path: &Path,
        layout: &CheckpointLayout,
        rank: u64,
        shards: &[Vec<crate::state::FlatShardRef<'_>>],
    ) -> Result<FileRecord> {
        layout.check_rank(rank)?;
        if !layout.writes_model_state(rank) {
            return Err(CkptError::InvalidArgument(format!(
                "rank {rank} has replicate index {} > 0: only ranks 0..{} write model state",
                layout.replicate_index(rank),
                layout.shard_size
            )));
        }
        let s = layout.shard_index(rank);
        if shards.len() != layout.units.len()
            || shards
                .iter()
                .zip(&layout.units)
                .any(|(a, b)| a.len() != b.flat_params.len())
        {
            return Err(CkptError::InvalidArgument(format!(
            "rank {rank}: shards given for {} units ({} flat params), the layout has {} units ({} flat params)",
            shards.len(),
            shards.iter().map(Vec::len).sum::<usize>(),
            layout.units.len(),
            layout.num_flat_params()
        )));
        }
        if let Some(bad) = crate::state::find_nonfinite(layout, rank, shards) {
            return Err(CkptError::NonFinite {
                rank,
                name: bad.name,
                kind: bad.kind.suffix(),
                index: bad.index,
                value: bad.value,
            });
        }
        let mut metas = Vec::with_capacity(layout.num_flat_params());
        let mut tensors: Vec<(String, Packed<'_>)> = Vec::new();
        for (u, k, f) in layout.flat_params() {
            let meta = shard_meta(layout, u, k, f, s);
            let sh = &shards[u][k];
            for kind in StateKind::ALL {
                let buf = match (kind, sh.get(kind)) {
                    (_, Some(b)) => b,
                    (StateKind::Param, None) => unreachable!("param is always present"),
                    (_, None) if f.trainable => {
                        return Err(CkptError::InvalidArgument(format!(
                            "rank {rank}, unit {u} flat param {k} is trainable but has no {} shard",
                            kind.suffix()
                        )))
                    }
                    (_, None) => continue,
                };
                if kind != StateKind::Param && !f.trainable {
                    return Err(CkptError::InvalidArgument(format!(
                        "rank {rank}, unit {u} flat param {k} is frozen but a {} shard was given",
                        kind.suffix()
                    )));
                }
                check_buffer(rank, u, k, kind, buf, f, &meta)?;
                if meta.stored_numel > 0 {
                    let parts = meta
                        .slices
                        .iter()
                        .map(|sl| {
                            &buf[sl.shard_offset as usize..(sl.shard_offset + sl.numel) as usize]
                        })
                        .collect();
                    tensors.push((
                        tensor_name(u, k, kind.suffix()),
                        Packed {
                            parts,
                            shape: [meta.stored_numel as usize],
                        },
                    ));
                }
            }
            metas.push(meta);
        }
        let mut md = HashMap::new();
        md.insert("format".to_string(), SHARD_FORMAT.to_string());
        md.insert("fsdp_rs.kind".into(), "shard".into());
        md.insert("fsdp_rs.format_version".into(), FORMAT_VERSION.to_string());
        md.insert("fsdp_rs.world_size".into(), layout.world_size.to_string());
        md.insert("fsdp_rs.rank".into(), rank.to_string());
        md.insert("fsdp_rs.shard_size".into(), layout.shard_size.to_string());
        md.insert(
            "fsdp_rs.replicate_size".into(),
            layout.replicate_size().to_string(),
        );
        md.insert("fsdp_rs.shard_index".into(), s.to_string());
        md.insert("fsdp_rs.model".into(), layout.spec.name.clone());
        md.insert(
            "fsdp_rs.plan_fingerprint".into(),
            layout.plan_fingerprint.clone(),
        );
        md.insert(
            "fsdp_rs.shards".into(),
            serde_json::to_string(&metas).expect("shard metadata serializes"),
        );
        // Written as `<name>.part`, fsynced, then renamed: a file with the final name is always
        // complete, even if another process (an MPI rank 0) picks it up.
        let mut part = path.as_os_str().to_owned();
        part.push(".part");
        let part = PathBuf::from(part);
        safetensors::serialize_to_file(tensors, Some(md), &part)
            .map_err(|e| bad_file(&part, format!("cannot write safetensors: {e}")))?;
        // Same state, same bytes: the metadata map's order would otherwise vary per save.
        crate::header::canonicalize_file(&part)?;
        let (bytes, sha256) = sync_and_hash(&part)?;
        std::fs::rename(&part, path).map_err(io_err(path, "rename into place"))?;
        Ok(FileRecord {
            file: path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            rank,
            shard_index: s,
            bytes,
            sha256,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{FlatShard, RankState};
    use fsdp_planner::{Architecture, ModelSpec, ParamSpec, UnitSpec};

    /// A model with trainable and frozen parameters, weight decay and none, of odd sizes.
    fn spec() -> ModelSpec {
        let p = |name: &str, shape: &[u64], trainable: bool| ParamSpec {
            trainable,
            ..ParamSpec::new(name, shape)
        };
        let unit = |name: &str, params: Vec<ParamSpec>| UnitSpec {
            name: name.into(),
            params,
        };
        ModelSpec {
            name: "mixed".into(),
            arch: Architecture::Generic,
            units: vec![
                unit(
                    "embed",
                    vec![p("wte", &[37, 5], true), p("pos", &[7], false)],
                ),
                unit("block", vec![p("w", &[11, 3], true), p("b", &[3], true)]),
                unit("tiny", vec![p("g", &[1], true)]),
            ],
        }
    }

    /// Every buffer of `rank`'s shards filled with distinct values (padding zero).
    fn state(layout: &CheckpointLayout, rank: u64) -> RankState {
        let s = layout.shard_index(rank);
        let flats = layout
            .units
            .iter()
            .enumerate()
            .map(|(u, ul)| {
                ul.flat_params
                    .iter()
                    .enumerate()
                    .map(|(k, f)| {
                        let n = f.shard_numel().as_usize();
                        let fill = |salt: f32| {
                            let mut v = vec![0f32; n];
                            for sl in f.shard_slices(s) {
                                let d = sl.shard_offset.as_usize();
                                for i in 0..sl.numel.as_usize() {
                                    v[d + i] = salt + (u * 1000 + k * 100 + d + i) as f32 * 0.25;
                                }
                            }
                            v
                        };
                        FlatShard {
                            param: fill(1.0),
                            exp_avg: f.trainable.then(|| fill(-3.0)),
                            exp_avg_sq: f.trainable.then(|| fill(0.5)),
                        }
                    })
                    .collect()
            })
            .collect();
        RankState { rank, flats }
    }

    #[test]
    fn streaming_writer_writes_the_bytes_of_the_safetensors_writer() {
        let dir = tempfile::tempdir().unwrap();
        for (w, s, align) in [(1, 1, 1), (2, 2, 1), (3, 3, 4), (4, 2, 8), (8, 8, 1)] {
            let layout = CheckpointLayout::new(spec(), w, s, align).unwrap();
            for rank in 0..s {
                let st = state(&layout, rank);
                let a = dir.path().join(format!("a-{w}-{s}-{rank}"));
                let b = dir.path().join(format!("b-{w}-{s}-{rank}"));
                let ra =
                    reference::write_rank_file_reference(&a, &layout, rank, &st.as_refs()).unwrap();
                let rb = write_rank_file(&b, &layout, rank, &st).unwrap();
                let (fa, fb) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
                assert_eq!(fa, fb, "W={w} S={s} alignment {align} rank {rank}");
                assert_eq!((ra.bytes, ra.sha256), (rb.bytes, rb.sha256));
                let plan = RankFilePlan::new(&layout, rank).unwrap();
                assert_eq!(plan.file_bytes(), fa.len() as u64);
            }
        }
    }
}

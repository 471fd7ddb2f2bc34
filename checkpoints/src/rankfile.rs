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
use crate::state::{FlatShardRef, StateKind};
use fsdp_planner::FlatParamLayout;
use memmap2::Mmap;
use safetensors::tensor::{Metadata, View};
use safetensors::Dtype;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::borrow::Cow;
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
pub(crate) fn write_rank_file(
    path: &Path,
    layout: &CheckpointLayout,
    rank: u64,
    shards: &[Vec<FlatShardRef<'_>>],
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
                    .map(|sl| &buf[sl.shard_offset as usize..(sl.shard_offset + sl.numel) as usize])
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

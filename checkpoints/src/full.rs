//! Full (consolidated, unsharded) safetensors files: the model's own parameter names and
//! shapes, readable by Python's `safetensors` and Hugging Face `transformers`.
//!
//! Tied parameters are written ONCE, under the target's name (e.g. GPT-2's `lm_head.weight`
//! is tied to `transformer.wte.weight`, so only `transformer.wte.weight` is written), the way
//! Hugging Face `save_pretrained` drops tied weights; loaders re-tie them. When reading, a tied
//! name may be present, but its values must equal the target's.

use crate::error::{bad_file, io_err, CkptError, Result};
use crate::layout::CheckpointLayout;
use crate::load::Checkpoint;
use crate::rankfile::SHARD_FORMAT;
use crate::save::write_atomic;
use crate::state::{FlatShard, FullTensor, RankState, StateKind};
use fsdp_planner::ModelSpec;
use memmap2::Mmap;
use safetensors::{Dtype, View};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// `__metadata__["fsdp_rs.kind"]` of a full file.
pub const FULL_KIND: &str = "full";

struct F32View<'a> {
    data: &'a [f32],
    shape: Vec<usize>,
}

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(bytemuck::cast_slice(self.data))
    }
    fn data_len(&self) -> usize {
        self.data.len() * 4
    }
}

/// Writes `tensors` as an F32 safetensors file at `path`, atomically (`path.tmp`, fsync,
/// rename), with `__metadata__` `format = pt` (required by `transformers`), `fsdp_rs.kind =
/// full` plus `extra`. Returns the file size (bytes).
///
/// Errors: `InvalidArgument` for a tensor whose length is not the product of its shape or a
/// zero-size shape (never written: a "full" file of empty placeholders cannot be loaded,
/// <https://github.com/huggingface/transformers/issues/20082>), `BadFile` / `Io` when writing.
pub fn write_full(path: &Path, tensors: &[FullTensor], extra: &[(&str, String)]) -> Result<u64> {
    for t in tensors {
        let n: u64 = t.shape.iter().product();
        if n != t.data.len() as u64 || n == 0 {
            return Err(CkptError::InvalidArgument(format!(
                "tensor `{}`: shape {:?} ({n} elements) but {} values",
                t.name,
                t.shape,
                t.data.len()
            )));
        }
    }
    let mut md = HashMap::new();
    md.insert("format".to_string(), "pt".to_string());
    md.insert("fsdp_rs.kind".into(), FULL_KIND.into());
    for (k, v) in extra {
        md.insert(format!("fsdp_rs.{k}"), v.clone());
    }
    let views = tensors.iter().map(|t| {
        (
            t.name.clone(),
            F32View {
                data: &t.data,
                shape: t.shape.iter().map(|&d| d as usize).collect(),
            },
        )
    });
    let mut bytes = safetensors::serialize(views, Some(md))
        .map_err(|e| bad_file(path, format!("cannot serialize safetensors: {e}")))?;
    crate::header::canonicalize_bytes(&mut bytes, path)?;
    write_atomic(path, &bytes)?;
    Ok(bytes.len() as u64)
}

/// What [`consolidate_to_file`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsolidateReport {
    /// Output file.
    pub path: PathBuf,
    /// Tensors written.
    pub tensors: usize,
    /// Elements written (real parameters only; padding never is).
    pub numel: u64,
    /// File size (bytes).
    pub bytes: u64,
    /// Tied parameters left out, as `(tied name, target name)`.
    pub tied_omitted: Vec<(String, String)>,
}

/// Consolidates the fp32 master parameters of `ckpt` into one full safetensors file at `out`
/// (original names and shapes; tied parameters written once under the target's name).
///
/// Errors: file errors of the checkpoint, `Io` on the output.
pub fn consolidate_to_file(ckpt: &Checkpoint, out: &Path) -> Result<ConsolidateReport> {
    let tensors = ckpt.consolidate(StateKind::Param)?;
    let m = ckpt.manifest();
    let tied: Vec<(String, String)> = ckpt
        .layout()
        .units
        .iter()
        .flat_map(|u| u.tied.clone())
        .collect();
    let tied_s = tied
        .iter()
        .map(|(a, b)| format!("{a}={b}"))
        .collect::<Vec<_>>()
        .join(",");
    let bytes = write_full(
        out,
        &tensors,
        &[
            ("model", m.model_name.clone()),
            ("step", m.train.step.to_string()),
            ("source_world_size", m.world_size.to_string()),
            ("tied", tied_s),
        ],
    )?;
    Ok(ConsolidateReport {
        path: out.to_path_buf(),
        tensors: tensors.len(),
        numel: tensors.iter().map(|t| t.data.len() as u64).sum(),
        bytes,
        tied_omitted: tied,
    })
}

/// Consolidates both Adam moments of `ckpt` into one safetensors file at `out`, with tensors
/// `{name}.exp_avg` and `{name}.exp_avg_sq` for every trainable parameter. Returns the number
/// of tensors written.
///
/// Errors: as [`consolidate_to_file`].
pub fn consolidate_optimizer_to_file(ckpt: &Checkpoint, out: &Path) -> Result<usize> {
    let mut all = Vec::new();
    for kind in [StateKind::ExpAvg, StateKind::ExpAvgSq] {
        for mut t in ckpt.consolidate(kind)? {
            t.name = format!("{}.{}", t.name, kind.suffix());
            all.push(t);
        }
    }
    write_full(
        out,
        &all,
        &[
            ("model", ckpt.manifest().model_name.clone()),
            (
                "optimizer_step",
                ckpt.manifest().train.optimizer.step.to_string(),
            ),
        ],
    )?;
    Ok(all.len())
}

/// A full state dict read from a safetensors file, converted to f32.
#[derive(Debug, Clone, PartialEq)]
pub struct FullState {
    /// The file read.
    pub file: PathBuf,
    /// Tensors by name.
    pub tensors: BTreeMap<String, FullTensor>,
}

/// Converts IEEE binary16 bits to f32 exactly.
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: value = m * 2^-24.
            let v = m as f32 * f32::from_bits(0x3380_0000);
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7fc0_0000 | (m << 13),
        (e, m) => sign | ((e + 112) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// Checks the framing of a safetensors file before parsing it: an 8-byte little-endian
/// header length `N`, then `N` bytes of JSON header, then the tensor data. A file shorter than
/// the 8 bytes, or one declaring a header longer than what follows, is truncated or not a
/// safetensors file at all (safetensors' own error for the latter, "header too large", hides
/// the sizes).
///
/// Errors: [`CkptError`] via `bad_file`, naming the file and both sizes in bytes.
fn check_safetensors_sizes(path: &Path, bytes: &[u8]) -> Result<()> {
    let len = bytes.len() as u64;
    let Some(head) = bytes.get(..8) else {
        return Err(bad_file(
            path,
            format!(
                "is {len} bytes: truncated or not a safetensors file (one needs at least the \
                 8-byte header length)"
            ),
        ));
    };
    let n = u64::from_le_bytes(head.try_into().expect("8 bytes"));
    if n > len - 8 {
        return Err(bad_file(
            path,
            format!(
                "is {len} bytes but declares a {n}-byte JSON header after its 8-byte length: \
                 truncated or not a safetensors file"
            ),
        ));
    }
    Ok(())
}

/// Reads a full safetensors file (F32, F16, BF16 or F64 tensors, converted to f32).
///
/// Errors: `NotAFullCheckpoint` for a per-rank shard file of a sharded checkpoint (never taken for
/// a full model); `BadFile` for a malformed file or another dtype; `Io`.
pub fn read_full(path: &Path) -> Result<FullState> {
    let file = std::fs::File::open(path).map_err(io_err(path, "open"))?;
    // SAFETY: read-only map of a file we do not modify.
    let mmap = unsafe { Mmap::map(&file) }.map_err(io_err(path, "memory-map"))?;
    check_safetensors_sizes(path, &mmap[..])?;
    let st = safetensors::SafeTensors::deserialize(&mmap[..])
        .map_err(|e| bad_file(path, format!("not a valid safetensors file: {e}")))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&mmap[..])
        .map_err(|e| bad_file(path, format!("not a valid safetensors file: {e}")))?;
    let md = meta.metadata().clone().unwrap_or_default();
    let is_shard = md.get("format").map(String::as_str) == Some(SHARD_FORMAT)
        || md.get("fsdp_rs.kind").map(String::as_str) == Some("shard")
        || st
            .names()
            .iter()
            .any(|n| n.starts_with("units.") && n.contains(".flat"));
    if is_shard {
        return Err(CkptError::NotAFullCheckpoint {
            file: path.display().to_string(),
            rank: md
                .get("fsdp_rs.rank")
                .cloned()
                .unwrap_or_else(|| "?".into()),
            world_size: md
                .get("fsdp_rs.world_size")
                .cloned()
                .unwrap_or_else(|| "?".into()),
        });
    }
    let mut tensors = BTreeMap::new();
    for (name, view) in st.tensors() {
        let b = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
                .collect(),
            Dtype::F16 => b.chunks_exact(2).map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect(),
            Dtype::F64 => b
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
                .collect(),
            other => {
                return Err(bad_file(
                    path,
                    format!("tensor `{name}` has dtype {other:?}; only F32, F16, BF16 and F64 parameters can be loaded"),
                ))
            }
        };
        let shape = view.shape().iter().map(|&d| d as u64).collect();
        tensors.insert(name.clone(), FullTensor { name, shape, data });
    }
    Ok(FullState {
        file: path.to_path_buf(),
        tensors,
    })
}

impl FullState {
    /// Strict key matching against `spec` (the model's own names): every non-tied parameter present
    /// with its exact shape, no tensor that is not a parameter; a tied parameter may be present
    /// only with the same shape and values as its target.
    ///
    /// Errors: `MissingKey`, `UnexpectedKey`, `ShapeMismatch`, `TiedCopyDiffers` (a stored tied
    /// copy whose bits differ from its target's: the file holds two tensors where the model
    /// has one).
    pub fn check_strict(&self, spec: &ModelSpec) -> Result<()> {
        let file = self.file.display().to_string();
        let params: HashMap<&str, &fsdp_planner::ParamSpec> = spec
            .units
            .iter()
            .flat_map(|u| &u.params)
            .map(|p| (p.name.as_str(), p))
            .collect();
        for p in spec.units.iter().flat_map(|u| &u.params) {
            match (self.tensors.get(&p.name), &p.tied_to) {
                (None, None) => {
                    return Err(CkptError::MissingKey {
                        file,
                        name: p.name.clone(),
                        shape: p.shape.clone(),
                    })
                }
                (None, Some(_)) => {}
                (Some(t), tied) => {
                    if t.shape != p.shape {
                        return Err(CkptError::ShapeMismatch {
                            file,
                            name: p.name.clone(),
                            expected: p.shape.clone(),
                            found: t.shape.clone(),
                        });
                    }
                    if let Some(target) = tied {
                        if let Some(tt) = self.tensors.get(target) {
                            if let Some(k) = (0..t.data.len().min(tt.data.len()))
                                .find(|&k| t.data[k].to_bits() != tt.data[k].to_bits())
                            {
                                return Err(CkptError::TiedCopyDiffers(Box::new(
                                    crate::error::TiedCopyDiffers {
                                        file,
                                        config: String::new(),
                                        tied: p.name.clone(),
                                        target: target.clone(),
                                        index: k as u64,
                                        tied_value: t.data[k],
                                        target_value: tt.data[k],
                                    },
                                )));
                            }
                        }
                    }
                }
            }
        }
        if let Some(name) = self
            .tensors
            .keys()
            .find(|k| !params.contains_key(k.as_str()))
        {
            return Err(CkptError::UnexpectedKey {
                file,
                name: name.clone(),
            });
        }
        Ok(())
    }

    /// The shards of `rank` under `layout`, cut from this full state after
    /// [`FullState::check_strict`]: parameters only, padding zero, moments `None` (a full
    /// file carries no optimizer state; a fresh Adam state is zero).
    ///
    /// Errors: as [`FullState::check_strict`]; `InvalidArgument` for a rank out of range.
    pub fn shard(&self, layout: &CheckpointLayout, rank: u64) -> Result<RankState> {
        layout.check_rank(rank)?;
        self.check_strict(&layout.spec)?;
        let s = layout.shard_index(rank);
        let flats = layout
            .units
            .iter()
            .map(|ul| {
                ul.flat_params
                    .iter()
                    .map(|f| {
                        let mut param = vec![0f32; f.shard_numel().as_usize()];
                        for sl in f.shard_slices(s) {
                            let seg = &f.segments[sl.segment];
                            let t = &self.tensors[&seg.name];
                            let a = sl.param_offset.as_usize();
                            let n = sl.numel.as_usize();
                            let d = sl.shard_offset.as_usize();
                            param[d..d + n].copy_from_slice(&t.data[a..a + n]);
                        }
                        FlatShard {
                            param,
                            exp_avg: None,
                            exp_avg_sq: None,
                        }
                    })
                    .collect()
            })
            .collect();
        Ok(RankState { rank, flats })
    }
}

/// Assembles the full parameters of `layout` from in-memory shards (`shards[i][u][k]` is shard
/// index `i`'s param shard of flat `k` of unit `u`, for `i` in `0..S`) and writes them with
/// [`write_full`]: the engine's "save full model" path, which never writes placeholder or empty
/// tensors (<https://github.com/huggingface/transformers/issues/20082>). Returns the file size
/// (bytes).
///
/// Errors: `InvalidArgument` for a wrong number or length of shards; as [`write_full`].
pub fn write_full_from_shards(
    path: &Path,
    layout: &CheckpointLayout,
    shards: &[Vec<Vec<&[f32]>>],
) -> Result<u64> {
    if shards.len() as u64 != layout.shard_size {
        return Err(CkptError::InvalidArgument(format!(
            "{} shards given, the shard group has {}",
            shards.len(),
            layout.shard_size
        )));
    }
    let mut tensors = Vec::new();
    for (u, k, f) in layout.flat_params() {
        let n = f.shard_numel().0;
        let parts: Vec<&[f32]> = shards
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let b = s.get(u).and_then(|x| x.get(k)).copied().unwrap_or(&[]);
                if b.len() as u64 != n {
                    Err(CkptError::ShardLength {
                        rank: i as u64,
                        unit: u,
                        flat: k,
                        what: "param",
                        expected: n,
                        found: b.len() as u64,
                    })
                } else {
                    Ok(b)
                }
            })
            .collect::<Result<_>>()?;
        let flat = f.unshard(&parts);
        for (si, seg) in f.segments.iter().enumerate() {
            tensors.push(FullTensor {
                name: seg.name.clone(),
                shape: seg.shape.clone(),
                data: f.view(&flat, si).to_vec(),
            });
        }
    }
    let order: HashMap<&str, usize> = layout
        .spec
        .units
        .iter()
        .flat_map(|u| &u.params)
        .enumerate()
        .map(|(i, p)| (p.name.as_str(), i))
        .collect();
    tensors.sort_by_key(|t| order[t.name.as_str()]);
    write_full(path, &tensors, &[("model", layout.spec.name.clone())])
}

//! The JSON manifest (`manifest.json`) of a sharded checkpoint.

use crate::error::{bad_file, CkptError, Result};
use crate::layout::{model_fingerprint, tensor_name, CheckpointLayout};
use fsdp_planner::ModelSpec;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// Value of the manifest's `format` field.
pub const FORMAT_NAME: &str = "fsdp-rs-checkpoint";
/// The format version this build writes and reads. Bumped on any incompatible change.
pub const FORMAT_VERSION: u32 = 1;
/// File name of the manifest inside a checkpoint directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// AdamW hyper-parameters and step count (Loshchilov & Hutter 2019, "Decoupled Weight Decay
/// Regularization", Algorithm 2). Stored as f64; an f32 value round-trips exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerState {
    /// Optimizer name (`adamw`, `adam`, `sgd`).
    pub name: String,
    /// Learning rate of the next step.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Number of optimizer steps taken (Adam's `t`, for bias correction).
    pub step: u64,
}

impl Default for OptimizerState {
    /// AdamW with lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0, step 0.
    fn default() -> Self {
        OptimizerState {
            name: "adamw".into(),
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            step: 0,
        }
    }
}

/// Training progress stored in the manifest: what a resumed run needs besides the tensors.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TrainState {
    /// Number of completed training steps.
    pub step: u64,
    /// Position in the data order (the engine's cursor: e.g. batches or samples consumed).
    pub data_position: u64,
    /// Random-generator state words (opaque to this crate; the engine defines them).
    pub rng_state: Vec<u64>,
    /// Optimizer hyper-parameters and step.
    pub optimizer: OptimizerState,
    /// Engine-defined extra settings (e.g. schedule, seed), as strings.
    #[serde(default)]
    pub extra: BTreeMap<String, String>,
}

/// One parameter inside a flat parameter, as recorded in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentRecord {
    /// The model's own parameter name (no wrapper or flat-buffer segments).
    pub name: String,
    /// Full shape (elements).
    pub shape: Vec<u64>,
    /// Offset of the first element inside the unsharded flat parameter (elements).
    pub offset: u64,
    /// Number of elements.
    pub numel: u64,
    /// Whether weight decay applies.
    pub weight_decay: bool,
}

/// One flat parameter of a unit, as recorded in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatRecord {
    /// Rank-file tensor prefix, `units.{u}.flat{k}` (tensors `.param`, `.exp_avg`,
    /// `.exp_avg_sq`).
    pub tensor: String,
    /// Whether it holds trainable parameters (and so has Adam moments).
    pub trainable: bool,
    /// Real elements (sum of the segments).
    pub real_numel: u64,
    /// Padding elements (alignment gaps plus tail padding): `padded_numel - real_numel`.
    pub padding_numel: u64,
    /// Unsharded length including padding (elements).
    pub padded_numel: u64,
    /// Shard length: `padded_numel / shard_size` (elements).
    pub shard_numel: u64,
    /// Parameters in flat order.
    pub segments: Vec<SegmentRecord>,
}

/// One unit, as recorded in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitRecord {
    /// Unit name.
    pub name: String,
    /// Flat parameters (trainable first, then frozen).
    pub flat_params: Vec<FlatRecord>,
    /// `[tied name, target name]` pairs: tied parameters take no storage.
    pub tied: Vec<(String, String)>,
}

/// One rank file of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// File name relative to the checkpoint directory, `rank-{rank:05}.safetensors`.
    pub file: String,
    /// The rank that wrote it (replicate index 0, so equal to its shard index).
    pub rank: u64,
    /// Its shard index.
    pub shard_index: u64,
    /// File size (bytes).
    pub bytes: u64,
    /// SHA-256 of the whole file, lower-case hex.
    pub sha256: String,
}

/// Subdirectory of a checkpoint directory holding the model's own files carried with it
/// ([`ModelFileRecord`]): the tokenizer and generation files of the model directory a run
/// started from, so that an export is a complete model directory without that directory.
pub const MODEL_FILES_DIR: &str = "model-files";

/// One file of the model carried in a checkpoint (`MODEL_FILES_DIR/{file}`), copied byte for
/// byte from the model directory the run started from (`tokenizer.json`,
/// `tokenizer_config.json`, `generation_config.json`, ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelFileRecord {
    /// File name (a plain name: no directory part, see [`check_model_file_name`]).
    pub file: String,
    /// File size (bytes).
    pub bytes: u64,
    /// SHA-256 of the file, lower-case hex.
    pub sha256: String,
}

/// Refuses a carried model file name that is not a plain file name: empty, `.` or `..`,
/// holding a `/` or a NUL byte, or starting with `.` (temporary files of a save). Such a name
/// in a manifest could reach outside the checkpoint directory.
///
/// Errors: `InvalidArgument` naming the name.
pub fn check_model_file_name(name: &str) -> Result<()> {
    if name.is_empty() || name.starts_with('.') || name.contains('/') || name.contains('\0') {
        return Err(CkptError::InvalidArgument(format!(
            "model file name {name:?} is not a plain file name"
        )));
    }
    Ok(())
}

/// The manifest of one checkpoint directory: everything needed to read, verify, consolidate
/// and reshard the rank files without the engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// [`FORMAT_VERSION`] at save time.
    pub format_version: u32,
    /// Model name.
    pub model_name: String,
    /// [`model_fingerprint`] of `spec`.
    pub model_fingerprint: String,
    /// Plan fingerprint of the saving run (SHA-256 hex).
    pub plan_fingerprint: String,
    /// World size `W` of the saving run.
    pub world_size: u64,
    /// Shard group size `S`.
    pub shard_size: u64,
    /// Replicate group size `R = W / S`.
    pub replicate_size: u64,
    /// Segment alignment (elements).
    pub alignment: u64,
    /// Element type of every stored tensor (`f32`: master weights and moments).
    pub dtype: String,
    /// Per-unit layout (names, shapes, offsets, padding) for humans and other tools; checked
    /// against the layout recomputed from `spec` on open.
    pub units: Vec<UnitRecord>,
    /// Training progress.
    pub train: TrainState,
    /// Rank files (one per shard index), with sizes and SHA-256.
    pub files: Vec<FileRecord>,
    /// The model spec the checkpoint was saved from.
    pub spec: ModelSpec,
    /// The model's own files carried with the checkpoint (tokenizer, generation config),
    /// sorted by name, with sizes and SHA-256; empty (and not written) when the run started
    /// from no model directory. Older manifests without the field read as empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub model_files: Vec<ModelFileRecord>,
}

impl Manifest {
    /// Builds the manifest of `layout` with `train` state and `files`.
    pub fn new(layout: &CheckpointLayout, train: TrainState, mut files: Vec<FileRecord>) -> Self {
        files.sort_by_key(|f| f.shard_index);
        Manifest {
            format: FORMAT_NAME.into(),
            format_version: FORMAT_VERSION,
            model_name: layout.spec.name.clone(),
            model_fingerprint: model_fingerprint(&layout.spec),
            plan_fingerprint: layout.plan_fingerprint.clone(),
            world_size: layout.world_size,
            shard_size: layout.shard_size,
            replicate_size: layout.replicate_size(),
            alignment: layout.alignment,
            dtype: "f32".into(),
            units: unit_records(layout),
            train,
            files,
            spec: layout.spec.clone(),
            model_files: Vec::new(),
        }
    }

    /// Reads and checks `path`: JSON syntax, format name and version first (so a future
    /// version is reported as such, not as a parse error), then the rest.
    ///
    /// Errors: `Io`, `BadFile`, `UnsupportedVersion`.
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(crate::error::io_err(path, "read"))?;
        let value: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| bad_file(path, format!("manifest is not valid JSON: {e}")))?;
        match value.get("format").and_then(|f| f.as_str()) {
            Some(FORMAT_NAME) => {}
            other => {
                return Err(bad_file(
                    path,
                    format!("not an fsdp-rs checkpoint manifest (format field {other:?}, expected \"{FORMAT_NAME}\")"),
                ))
            }
        }
        match value.get("format_version") {
            Some(v) if v.as_u64() == Some(FORMAT_VERSION as u64) => {}
            other => {
                return Err(CkptError::UnsupportedVersion {
                    file: path.display().to_string(),
                    found: other
                        .map(|v| v.to_string())
                        .unwrap_or_else(|| "(missing)".into()),
                    supported: FORMAT_VERSION,
                })
            }
        }
        let m: Manifest = serde_json::from_value(value)
            .map_err(|e| bad_file(path, format!("malformed manifest: {e}")))?;
        Ok(m)
    }

    /// The layout this manifest describes, recomputed from its spec and sizes, and checked
    /// against the recorded units, file list and fingerprints.
    ///
    /// Errors: `BadFile` (naming `path`) on any disagreement.
    pub fn layout(&self, path: &Path) -> Result<CheckpointLayout> {
        if self.shard_size == 0
            || self.shard_size.checked_mul(self.replicate_size) != Some(self.world_size)
        {
            return Err(bad_file(
                path,
                format!(
                    "world size {} != shard size {} x replicate size {}",
                    self.world_size, self.shard_size, self.replicate_size
                ),
            ));
        }
        if self.dtype != "f32" {
            return Err(bad_file(
                path,
                format!("unsupported tensor dtype `{}` (expected f32)", self.dtype),
            ));
        }
        let layout = CheckpointLayout::new(
            self.spec.clone(),
            self.world_size,
            self.shard_size,
            self.alignment,
        )
        .map_err(|e| bad_file(path, format!("model spec in manifest is invalid: {e}")))?
        .with_plan_fingerprint(self.plan_fingerprint.clone());
        if model_fingerprint(&self.spec) != self.model_fingerprint {
            return Err(bad_file(
                path,
                "model fingerprint does not match the model spec it records",
            ));
        }
        if unit_records(&layout) != self.units {
            return Err(bad_file(
                path,
                "recorded unit layout differs from the layout of the recorded model spec",
            ));
        }
        if self.files.len() as u64 != self.shard_size {
            return Err(bad_file(
                path,
                format!(
                    "lists {} rank files, the shard size is {}",
                    self.files.len(),
                    self.shard_size
                ),
            ));
        }
        for m in &self.model_files {
            check_model_file_name(&m.file).map_err(|e| bad_file(path, e.to_string()))?;
        }
        for (i, f) in self.files.iter().enumerate() {
            if f.shard_index != i as u64 || f.rank != i as u64 || f.file != rank_file_name(f.rank) {
                return Err(bad_file(
                    path,
                    format!(
                        "rank file entry {i} is `{}` (rank {}, shard {}), expected `{}`",
                        f.file,
                        f.rank,
                        f.shard_index,
                        rank_file_name(i as u64)
                    ),
                ));
            }
        }
        Ok(layout)
    }
}

/// File name of the rank file written by `rank`: `rank-{rank:05}.safetensors`.
pub fn rank_file_name(rank: u64) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// The manifest's per-unit records of `layout`.
pub fn unit_records(layout: &CheckpointLayout) -> Vec<UnitRecord> {
    layout
        .units
        .iter()
        .enumerate()
        .map(|(u, ul)| UnitRecord {
            name: ul.name.clone(),
            tied: ul.tied.clone(),
            flat_params: ul
                .flat_params
                .iter()
                .enumerate()
                .map(|(k, f)| FlatRecord {
                    tensor: tensor_name(u, k, "").trim_end_matches('.').to_string(),
                    trainable: f.trainable,
                    real_numel: f.real_numel().0,
                    padding_numel: f.padding_numel().0,
                    padded_numel: f.padded_numel.0,
                    shard_numel: f.shard_numel().0,
                    segments: f
                        .segments
                        .iter()
                        .map(|s| SegmentRecord {
                            name: s.name.clone(),
                            shape: s.shape.clone(),
                            offset: s.offset.0,
                            numel: s.numel.0,
                            weight_decay: s.weight_decay,
                        })
                        .collect(),
                })
                .collect(),
        })
        .collect()
}

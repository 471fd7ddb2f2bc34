//! The one error type of `fsdp-checkpoints`.

use fsdp_planner::PlanError;
use thiserror::Error;

/// Everything that can go wrong while saving, loading, consolidating or resharding a checkpoint.
///
/// Every variant that concerns a file carries its path and the numbers needed to see what is
/// wrong (expected against found); the CLI maps every variant to exit code 2 (bad input).
#[derive(Debug, Error)]
pub enum CkptError {
    /// An operating-system I/O error on `path` while doing `op` (e.g. "create", "fsync").
    #[error("{path}: cannot {op}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// What was being done.
        op: &'static str,
        /// The underlying error.
        source: std::io::Error,
    },
    /// No checkpoint at the given path: no `manifest.json`, no `latest` pointer and no
    /// complete `step-*` directory.
    #[error("{dir}: no checkpoint found ({reason})")]
    NoCheckpoint {
        /// The directory looked at.
        dir: String,
        /// Why nothing was found.
        reason: String,
    },
    /// A rank file listed in the manifest does not exist.
    #[error("{file}: missing rank file (rank {rank} of a world of {world_size}); the checkpoint is incomplete")]
    MissingFile {
        /// The missing file.
        file: String,
        /// The rank that wrote it.
        rank: u64,
        /// The world size of the saving run.
        world_size: u64,
    },
    /// A file whose size differs from the manifest (a truncated or appended file).
    #[error("{file}: size is {found} bytes, the manifest says {expected} bytes (truncated or overwritten file)")]
    SizeMismatch {
        /// The file.
        file: String,
        /// Size recorded in the manifest (bytes).
        expected: u64,
        /// Size on disk (bytes).
        found: u64,
    },
    /// A file whose SHA-256 differs from the manifest (a flipped byte, a replaced file).
    #[error("{file}: SHA-256 checksum mismatch (manifest {expected}, file {found}): the file is corrupted")]
    ChecksumMismatch {
        /// The file.
        file: String,
        /// Hex digest recorded in the manifest.
        expected: String,
        /// Hex digest of the bytes on disk.
        found: String,
    },
    /// A manifest or rank file of a format version this build cannot read.
    #[error(
        "{file}: unknown checkpoint format version {found} (this build reads version {supported})"
    )]
    UnsupportedVersion {
        /// The file.
        file: String,
        /// The version found.
        found: String,
        /// The version this build reads and writes.
        supported: u32,
    },
    /// A malformed file: bad JSON, a bad safetensors header, a tensor of the wrong dtype or
    /// length, metadata that disagrees with the manifest.
    #[error("{file}: {problem}")]
    BadFile {
        /// The file.
        file: String,
        /// What is wrong, with the numbers.
        problem: String,
    },
    /// A checkpoint of another model than the one being loaded (different parameter names,
    /// shapes or trainability).
    #[error("{file}: checkpoint of another model (`{found_model}`, expected `{expected_model}`): {problem}")]
    ModelMismatch {
        /// The manifest or full file.
        file: String,
        /// Model name recorded in the checkpoint.
        found_model: String,
        /// Model name expected by the caller.
        expected_model: String,
        /// The first difference found, naming the parameter.
        problem: String,
    },
    /// A per-rank shard file given where a full (consolidated) checkpoint is expected
    /// (a shard file must never pass for a full model).
    #[error("{file}: this is a per-rank SHARD file (rank {rank} of world size {world_size}) of a sharded fsdp-rs checkpoint, not a full checkpoint; run `fsdp ckpt consolidate <checkpoint dir> -o model.safetensors` first")]
    NotAFullCheckpoint {
        /// The file.
        file: String,
        /// The rank that wrote the shard.
        rank: String,
        /// The saving run's world size.
        world_size: String,
    },
    /// A full state dict lacks a parameter of the model (strict loading).
    #[error("{file}: missing parameter `{name}` (shape {shape:?})")]
    MissingKey {
        /// The full file.
        file: String,
        /// The model's parameter name.
        name: String,
        /// Its expected shape (elements).
        shape: Vec<u64>,
    },
    /// A full state dict holds a tensor that is not a parameter of the model (strict loading).
    #[error("{file}: unexpected tensor `{name}`: the model has no parameter of that name")]
    UnexpectedKey {
        /// The full file.
        file: String,
        /// The tensor name found.
        name: String,
    },
    /// A tensor whose shape differs from the model's parameter.
    #[error("{file}: tensor `{name}` has shape {found:?}, the model expects {expected:?}")]
    ShapeMismatch {
        /// The file.
        file: String,
        /// Parameter name.
        name: String,
        /// Shape the model expects (elements).
        expected: Vec<u64>,
        /// Shape in the file (elements).
        found: Vec<u64>,
    },
    /// A tied parameter stored in the weights with other values than its target: the model's
    /// configuration ties them (one tensor, e.g. `tie_word_embeddings: true`), the file holds
    /// two different ones. Loading would keep one and silently drop the other, so it is
    /// refused; the fix is in the message (untie in `config.json`, or drop the stored copy).
    #[error(transparent)]
    TiedCopyDiffers(Box<TiedCopyDiffers>),
    /// A shard handed to the writer whose length is not the layout's shard length.
    #[error("rank {rank}, unit {unit} flat param {flat}, {what}: {found} elements, the layout's shard has {expected}")]
    ShardLength {
        /// Rank.
        rank: u64,
        /// Unit index.
        unit: usize,
        /// Flat-parameter index inside the unit.
        flat: usize,
        /// Which buffer (`param`, `exp_avg`, `exp_avg_sq`).
        what: &'static str,
        /// Shard length required by the layout (elements).
        expected: u64,
        /// Length given (elements).
        found: u64,
    },
    /// A shard whose padding elements are not zero: an engine bug that would otherwise leak
    /// into a norm or a consolidated file.
    #[error("rank {rank}, unit {unit} flat param {flat}, {what}: {count} padding element(s) are non-zero (first at shard element {first}); padding must stay 0.0")]
    NonZeroPadding {
        /// Rank.
        rank: u64,
        /// Unit index.
        unit: usize,
        /// Flat-parameter index inside the unit.
        flat: usize,
        /// Which buffer.
        what: &'static str,
        /// Number of non-zero padding elements.
        count: u64,
        /// Index of the first one inside the shard (elements).
        first: u64,
    },
    /// An invalid argument: world size 0, a shard size that does not divide the world size,
    /// a rank out of range, a wrong number of shards.
    #[error("{0}")]
    InvalidArgument(String),
    /// A value to be saved is infinite or NaN: a checkpoint is never written from such a
    /// state, so the newest complete checkpoint stays the one to resume from.
    #[error("rank {rank}: {kind} of parameter {name} is {value} at element {index}: a checkpoint is never written from a non-finite state (the newest complete checkpoint is unchanged)")]
    NonFinite {
        /// The rank whose shard holds the value.
        rank: u64,
        /// The parameter's name.
        name: String,
        /// What holds it: `param`, `exp_avg` or `exp_avg_sq`.
        kind: &'static str,
        /// Element index inside the flattened parameter.
        index: u64,
        /// The value.
        value: f32,
    },
    /// The state being saved could not be read (a device copy failed, a buffer is missing):
    /// nothing was published.
    #[error("cannot read the state being saved: {0}")]
    StateRead(String),
    /// The planner rejected the model spec or the sizes.
    #[error(transparent)]
    Plan(#[from] PlanError),
}

/// The details of [`CkptError::TiedCopyDiffers`]: which tensors, where they first differ, and
/// the `config.json` that ties them.
#[derive(Debug, Clone, PartialEq, Error)]
#[error(
    "{file}: `{tied}` differs from `{target}` (first at element {index}: {tied_value} against \
         {target_value}), but the model's configuration{config} ties them (`{tied}` is \
         `{target}`); training tied would silently drop the file's `{tied}`. (transformers \
         4.x re-ties after loading, overwriting `{tied}` with `{target}`; 5.x warns and loads \
         them untied under a config that still ties them, so its next `tie_weights()` drops \
         `{tied}`.) Set \"tie_word_embeddings\": false in the config.json to train the file's \
         own `{tied}`, or remove `{tied}` from the weights to train them tied"
)]
pub struct TiedCopyDiffers {
    /// The file holding the tied copy.
    pub file: String,
    /// ` (config.json path)` when known, else empty.
    pub config: String,
    /// The tied parameter's name (e.g. `lm_head.weight`).
    pub tied: String,
    /// The parameter it is tied to (e.g. `model.embed_tokens.weight`).
    pub target: String,
    /// First differing element (row-major index).
    pub index: u64,
    /// The tied copy's value there (as f32).
    pub tied_value: f32,
    /// The target's value there (as f32).
    pub target_value: f32,
}

/// Result alias of this crate.
pub type Result<T, E = CkptError> = std::result::Result<T, E>;

/// Builds an [`CkptError::Io`] for `path`.
pub(crate) fn io_err(
    path: &std::path::Path,
    op: &'static str,
) -> impl FnOnce(std::io::Error) -> CkptError {
    let path = path.display().to_string();
    move |source| CkptError::Io { path, op, source }
}

/// Builds an [`CkptError::BadFile`] for `path`.
pub(crate) fn bad_file(path: &std::path::Path, problem: impl Into<String>) -> CkptError {
    CkptError::BadFile {
        file: path.display().to_string(),
        problem: problem.into(),
    }
}

//! fsdp-checkpoints: sharded checkpoints that never lose data.
//!
//! One job: write, verify, load, reshard and consolidate the per-rank state of a sharded
//! training run, with no device, no communicator and no engine: every file is readable by this
//! crate (and by any safetensors reader) alone. Key design decision: parameters are addressed
//! by (parameter NAME, element offset), never by flat-buffer position, so a checkpoint saved at
//! one world size / strategy / alignment loads at any other one, and padding never reaches a
//! file.
//!
//! # On-disk format (version [`FORMAT_VERSION`])
//! ```text
//! ROOT/
//!   latest                      "step-00000042\n": newest complete checkpoint (atomic replace)
//!   step-00000042/
//!     rank-00000.safetensors    rank 0's shards (shard index 0)
//!     ...
//!     rank-{S-1}.safetensors    only the S ranks of replicate index 0 write model state
//!     model-files/              optional: the model directory's tokenizer and generation
//!       tokenizer.json ...      files, copied byte for byte (carried into exports)
//!     manifest.json             written LAST; sizes + SHA-256 of every rank and model file
//! ```
//! * **Rank file** (safetensors): for every flat parameter `k` of every unit `u` (layout of
//!   `fsdp_planner::layout_units`), 1-D F32 tensors `units.{u}.flat{k}.param` (fp32 master
//!   shard) and, if trainable, `units.{u}.flat{k}.exp_avg` / `.exp_avg_sq` (AdamW moments).
//!   Each holds only the shard's REAL elements (its parameter slices concatenated; padding is
//!   never written; an all-padding shard has no tensor). `__metadata__`: `format =
//!   fsdp-rs-shard` (so it can never be taken for a full model), `fsdp_rs.kind = shard`,
//!   format version, world / shard / replicate size, rank, shard index, model name, plan
//!   fingerprint, and `fsdp_rs.shards`: JSON mapping each tensor to its shard range and each
//!   parameter slice to (name, full shape, offset in the parameter, offset in the shard,
//!   offset in the tensor), with the model's own names, never wrapper or flat-buffer names.
//! * **Manifest** (JSON, [`Manifest`]): format name and version, model name, model and plan
//!   fingerprints, world / shard / replicate sizes, alignment, dtype, the `ModelSpec`, per
//!   unit the flat-parameter layout (names, shapes, offsets, real and padding element counts,
//!   shard length), the training state ([`TrainState`]: step, data position, RNG words,
//!   optimizer hyper-parameters and step) and each rank file's size and SHA-256.
//! * **Full file** (consolidated): one safetensors file, F32, the model's own parameter names
//!   and shapes (Hugging Face GPT-2 names for the GPT presets), `__metadata__ format = pt`; tied
//!   parameters are written once under the target's name, as Hugging Face does.
//!
//! # Save protocol
//! See [`save`]: temporary directory, fsync every file and the directory, rename into place,
//! manifest last, `latest` replaced atomically, keep the last K.
//!
//! # Loading and resharding
//! See [`load`]: [`Checkpoint::open`] checks the manifest, sizes and (lazily) SHA-256s;
//! [`Checkpoint::load_rank`] loads any rank of any target layout by intersecting the source
//! and target layouts, reading only the needed ranges through `memmap2`.

#![warn(missing_docs)]

pub mod error;
pub mod full;
mod header;
pub mod hfdir;
pub mod layout;
pub mod load;
pub mod manifest;
pub mod rankfile;
pub mod save;
pub mod state;
pub mod weights;

pub use error::{CkptError, Result, TiedCopyDiffers};
pub use full::{
    consolidate_optimizer_to_file, consolidate_to_file, read_full, write_full,
    write_full_from_shards, ConsolidateReport, FullState,
};
pub use hfdir::{
    consolidate_to_hf_dir, shard_ranges, HfDirReport, DEFAULT_MAX_SHARD_BYTES, INDEX_FILE,
    SINGLE_WEIGHTS_FILE,
};
pub use layout::{layout_fingerprint, model_fingerprint, tensor_name, CheckpointLayout};
pub use load::{reshard, resolve_checkpoint_dir, Checkpoint, ShardReader, Verify};
pub use manifest::{
    check_model_file_name, rank_file_name, FileRecord, FlatRecord, Manifest, ModelFileRecord,
    OptimizerState, SegmentRecord, TrainState, UnitRecord, FORMAT_NAME, FORMAT_VERSION,
    MANIFEST_FILE, MODEL_FILES_DIR,
};
pub use rankfile::{checkpoint_bytes, RankFilePlan, ShardMeta, SliceMeta, SHARD_FORMAT};
pub use save::{
    begin_save, list_checkpoints, parse_step_dir, save_checkpoint, step_dir_name,
    PendingCheckpoint, LATEST_FILE,
};
pub use state::{
    find_nonfinite, FlatShard, FlatShardRef, FullTensor, NonFiniteValue, RankState, ShardRefs,
    ShardSource, StateKind,
};
pub use weights::{StoredDtype, TensorEntry, WeightBinding, WeightFiles, LOAD_CHUNK_BYTES};

//! The engine's checkpoint glue, between a run (or the offline `fsdp ckpt` actions) and the
//! `fsdp_checkpoints` crate: the per-rank state mapping ([`convert`]), the resume choice and
//! training hooks ([`resume`]), the save of a run and its failures ([`save`]), inspect / consolidate / reshard ([`offline`]), and the model's
//! own files (tokenizer, generation config) carried from a model directory into exports
//! ([`model_files`]).

pub mod convert;
pub mod model_files;
pub mod offline;
pub mod resume;
pub mod save;

pub use convert::{ckpt_to_engine, engine_to_ckpt};
pub use resume::{
    choose_resume, hf_config_text, passed_over, step_dirs, CheckpointConfig, CheckpointHooks,
    ResumeFrom, SaveCallback, SaveReport, StepDir, HF_CONFIG_KEY,
};
pub use save::{free_bytes, OnSaveError, SaveStats};

//! The engine's checkpoint glue, between a run (or the offline `fsdp ckpt` actions) and the
//! `fsdp_checkpoints` crate: the per-rank state mapping ([`convert`]), the resume choice and
//! training hooks ([`resume`]), and inspect / consolidate / reshard ([`offline`]).

pub mod convert;
pub mod offline;
pub mod resume;

pub use convert::{ckpt_to_engine, engine_to_ckpt};
pub use resume::{
    check_init_from, choose_resume, hf_config_text, passed_over, step_dirs, CheckpointConfig,
    CheckpointHooks, ResumeFrom, SaveCallback, SaveReport, StepDir, HF_CONFIG_KEY,
};

//! fsdp-planner: `ModelSpec -> ShardPlan`.
//!
//! One job: decide, as a pure deterministic function with no I/O and no device, how every
//! parameter, gradient and optimizer state is laid out in per-rank flat shards, in which order
//! units are unsharded, and how many bytes each rank holds in each phase of a step. The engine
//! executes this plan and never invents layout at run time.
//!
//! Key design decision: the memory plan is not an estimate of model states but a ledger the
//! engine must match byte for byte (the `memory` module); only activations are estimated
//! (Korthikanti et al. 2022). Readers of model descriptions (`hf`) are the only code that does
//! I/O, and they only produce a `ModelSpec`.
//!
//! The `time` module predicts how long a step of a plan takes on a hardware profile (FLOPs
//! per op, collectives per the schedule, an event simulation of each rank's compute and
//! communication threads); hardware profiles are parsed from JSON text the caller reads.

#![warn(missing_docs)]

pub mod config;
pub mod error;
pub mod hf;
pub mod layout;
pub mod memory;
pub mod plan;
pub mod presets;
pub mod report;
pub mod schedule;
pub mod spec;
pub mod time;

pub use config::{ActivationModel, GradSync, Offload, Optimizer, PlanConfig, Strategy};
pub use error::PlanError;
pub use layout::{layout_units, FlatParamLayout, Segment, ShardSlice, ShardSpan, UnitLayout};
pub use memory::{Category, CategoryBytes, MemoryPlan, Phase, PhaseMemory, TimelinePoint};
pub use plan::{
    auto_candidates, min_world_sizes, plan, plan_fastest, plan_fastest_ranked, AutoRanking,
    MinWorld, PaddingReport, RankPlacement, RankedCandidate, ShardPlan, LOAD_STAGING_BYTES,
};
pub use presets::{preset, PRESET_NAMES};
pub use schedule::{Schedule, ScheduleStep, UseRole};
pub use spec::{
    Architecture, Gpt2Config, Llama3RopeScaling, LlamaConfig, LlamaNumerics, ModelSpec, ParamSpec,
    UnitSpec,
};
pub use time::{
    builtin_profile, predict, HardwareProfile, StepPrediction, TimeInputs, BUILTIN_PROFILE_NAMES,
};

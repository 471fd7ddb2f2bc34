//! fsdp-planner: `ModelSpec -> ShardPlan`.
//!
//! One job: decide, as a pure deterministic function with no I/O and no device, how every
//! parameter, gradient and optimizer state is laid out in per-rank flat shards, in which order
//! units are unsharded, and how many bytes each rank holds in each phase of a step. The engine
//! executes this plan and never invents layout at run time.

pub mod error;
pub mod layout;
pub mod presets;
pub mod spec;

pub use error::PlanError;
pub use layout::{
    layout_units, FlatParamLayout, Segment, ShardSlice, ShardSpan, UnitLayout,
};
pub use spec::{Architecture, Gpt2Config, LlamaConfig, ModelSpec, ParamSpec, UnitSpec};

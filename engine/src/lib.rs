//! fsdp: the engine and CLI of fsdp-rs. It executes a `ShardPlan` from the planner: unshard
//! (all-gather) each FSDP unit just before use, compute, reshard, reduce-scatter gradients, and
//! step the optimizer on the local shard.

pub mod cli;
pub mod model;

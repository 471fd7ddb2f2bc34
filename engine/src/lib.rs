//! fsdp: the engine and CLI of fsdp-rs. It executes a `ShardPlan` from the planner: unshard
//! (all-gather) each FSDP unit just before use, compute, reshard, reduce-scatter gradients, and
//! step the optimizer on the local shard.

#![warn(missing_docs)]

pub mod calibrate;
pub mod checkpoint;
pub mod cli;
pub mod data;
pub mod error;
pub mod eval;
pub mod init;
pub mod memory;
pub mod model;
pub mod optim;
pub mod options;
pub mod output;
pub mod preflight;
pub mod process;
pub mod run;
pub mod runtime;
pub mod strategy;
pub mod threads;
pub mod trace;
pub mod train;

pub use error::EngineError;

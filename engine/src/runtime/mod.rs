//! The FSDP runtime: FSDP units and their state transitions ([`mod@unit`]), the per-rank step loop
//! executing a plan ([`engine`]), the model interface it runs ([`staged`]), the collectives
//! wrapper ([`collectives`]), the host side of an offloaded rank ([`offload`]) and the GPT
//! adapter ([`gpt`]).

pub mod collectives;
pub mod engine;
pub mod gpt;
mod init_shards;
pub mod offload;
pub mod staged;
pub mod unit;

pub use engine::{
    Accumulated, Clip, EngineConfig, FlatShardState, InitSync, LossScaler, NonFiniteParam,
    NonFinitePolicy, NonFiniteReport, NonFiniteShard, NormType, RankEngine, RankState, ShardFill,
    StepStats,
};
pub use staged::{MicroBatch, StagedModel};
pub use unit::{FlatShard, FsdpUnit, Placement, ShardBuf, UnitState};

//! fsdp-comm: collective communication for fsdp-rs behind one narrow trait.
//!
//! One job: move and reduce flat buffers between the ranks of a data-parallel world. The
//! [`Communicator`] trait offers all-gather, reduce-scatter, all-reduce, broadcast and barrier
//! over the world, a shard group or a replicate group ([`Group`], [`Topology`]), synchronously
//! on borrowed dtype-tagged buffers ([`Buf`], [`BufMut`]) or started and waited for later on
//! owned ones ([`OwnedBuf`], [`PendingOp`]) so the engine can prefetch. It knows buffers and
//! ranks, nothing of FSDP.
//!
//! Key design decision: **every backend reduces in rank order** (`((x_0 + x_1) + x_2) + ...`,
//! 16-bit dtypes accumulated in f32, `Avg` = one division by the group size), so results are
//! deterministic and bit-identical across backends and runs; [`reduce_in_rank_order`] is that
//! arithmetic for any backend to reuse. Mismatched calls and dead peers are errors
//! ([`CommError`]), never hangs.
//!
//! Backends: [`ThreadComm`] (ranks are threads of one process; memcpy through shared memory;
//! the default and the reference). The [`conformance`] suite runs against any backend through a
//! [`conformance::Launcher`].

#![warn(missing_docs)]

// The call agreement and wire encodings shared by the multi-process backends; the default
// build (threads only) compiles them for their unit tests.
#[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
mod agreement;
mod buf;
#[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
mod codec;
mod comm;
pub mod conformance;
mod error;
/// The MPI backend (feature `mpi`): [`mpi::MpiComm`] over Open MPI through rsmpi.
#[cfg(feature = "mpi")]
pub mod mpi;
/// The NCCL backend (feature `cuda`): [`nccl::NcclComm`] over CUDA device memory.
#[cfg(feature = "cuda")]
pub mod nccl;
mod process;
mod progress;
mod reduce;
// The NCCL backend's reduction kernel source and launch arithmetic (used with `cuda`; tested
// in every build).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod reduce_launch;
pub mod rendezvous;
mod thread;
mod topology;

pub use buf::{Buf, BufMut, Element, OwnedBuf};
pub use comm::{check_call, CallRequest, Communicator, Completed, PendingOp, PendingWait};
pub use error::{CallDesc, CommError, OpKind, RankCalls};
pub use process::{nccl_from_env, NCCL_BUILT};
pub use reduce::{reduce_in_rank_order, BLOCK};
pub use thread::{run_threads, thread_communicators, ThreadComm, DEFAULT_TIMEOUT};
pub use topology::{Group, ReduceOp, Topology};

/// Re-exported dtype tag (from fsdp-types).
pub use fsdp_types::DType;

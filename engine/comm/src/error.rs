//! The one error type of fsdp-comm, and the description of a collective call it quotes.

use crate::topology::{Group, ReduceOp};
use fsdp_types::DType;
use std::fmt;

/// Which collective a call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// [`crate::Communicator::all_gather`].
    AllGather,
    /// [`crate::Communicator::reduce_scatter`].
    ReduceScatter,
    /// [`crate::Communicator::all_reduce`].
    AllReduce,
    /// [`crate::Communicator::broadcast`].
    Broadcast,
    /// [`crate::Communicator::barrier`].
    Barrier,
}

impl OpKind {
    /// snake_case name (`all_gather`, `reduce_scatter`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllReduce => "all_reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::Barrier => "barrier",
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything that must agree across the ranks of a group for one collective call: the
/// collective, the group, the reduction, the dtype, the element counts (not bytes) and the
/// per-group call number. Errors quote it so a mismatch names both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CallDesc {
    /// The collective.
    pub op: OpKind,
    /// The group it runs over.
    pub group: Group,
    /// The reduction (reduce-scatter and all-reduce only).
    pub reduce: Option<ReduceOp>,
    /// Element dtype (`None` for a barrier).
    pub dtype: Option<DType>,
    /// Elements sent by this rank (the in-place buffer length for all-reduce and broadcast).
    pub send_numel: usize,
    /// Elements received by this rank (the in-place buffer length for all-reduce and broadcast).
    pub recv_numel: usize,
    /// Root group rank (broadcast only).
    pub root: Option<usize>,
    /// 0-based index of this call among the calling rank's calls on this group.
    pub seq: u64,
}

impl fmt::Display for CallDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(group={}", self.op, self.group)?;
        if let Some(r) = self.reduce {
            write!(f, ", op={r}")?;
        }
        if let Some(d) = self.dtype {
            write!(
                f,
                ", dtype={d}, send={}, recv={}",
                self.send_numel, self.recv_numel
            )?;
        }
        if let Some(root) = self.root {
            write!(f, ", root={root}")?;
        }
        write!(f, ") call #{} on this group", self.seq)
    }
}

/// A list of `(rank, call)` pairs rendered as `rank 0: all_gather(...); rank 1: barrier(...)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankCalls(pub Vec<(usize, CallDesc)>);

impl fmt::Display for RankCalls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (r, c)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "rank {r}: {c}")?;
        }
        Ok(())
    }
}

/// Errors of collective communication. Every variant carries the ranks, sizes (in elements),
/// dtypes and calls involved.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    /// A topology whose factors are 0 or do not multiply to the world size.
    #[error("invalid topology (world {world_size}, shard {shard_size}, replicate {replicate_size}): {reason}")]
    InvalidTopology {
        /// World size given.
        world_size: usize,
        /// Shard-group size given.
        shard_size: usize,
        /// Replicate-group size given.
        replicate_size: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// A buffer has the wrong number of elements for the call (checked on the calling rank).
    #[error("rank {rank}: {op} on the {group} group of {group_size} ranks: {what} has {got} elements, expected {expected}")]
    SizeMismatch {
        /// Calling rank.
        rank: usize,
        /// The collective.
        op: OpKind,
        /// The group.
        group: Group,
        /// Ranks in the group.
        group_size: usize,
        /// Which buffer (`recv`, `send`).
        what: &'static str,
        /// Elements required.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// The send and receive buffers of one call have different dtypes.
    #[error("rank {rank}: {op}: send buffer is {send} but receive buffer is {recv}")]
    DTypeMismatch {
        /// Calling rank.
        rank: usize,
        /// The collective.
        op: OpKind,
        /// Send dtype.
        send: DType,
        /// Receive dtype.
        recv: DType,
    },
    /// A broadcast root outside the group.
    #[error("rank {rank}: broadcast on the {group} group: root group rank {root} is not below the group size {group_size}")]
    InvalidRoot {
        /// Calling rank.
        rank: usize,
        /// The group.
        group: Group,
        /// Root given.
        root: usize,
        /// Ranks in the group.
        group_size: usize,
    },
    /// The ranks of one group made different calls (collective, group, op, dtype, size, root or
    /// call number differ), or ranks wait on different groups so none can proceed.
    #[error("mismatched collective calls: {calls}")]
    MismatchedCalls {
        /// Every involved rank and the call it made.
        calls: RankCalls,
    },
    /// A peer finished (dropped its communicator) without making the call this rank waits in.
    #[error("rank {rank}: {call} cannot complete: rank {peer} has exited after {peer_calls} collective calls")]
    PeerExited {
        /// Waiting rank.
        rank: usize,
        /// The call it waits in.
        call: CallDesc,
        /// The rank that exited.
        peer: usize,
        /// Total collective calls the exited rank made.
        peer_calls: u64,
    },
    /// A peer panicked or failed; the world is unusable.
    #[error("rank {peer} failed ({reason}); the communicator world is aborted")]
    PeerFailed {
        /// The failed rank.
        peer: usize,
        /// Why (a panic message or error text).
        reason: String,
    },
    /// The call waited longer than the timeout for peers.
    #[error("rank {rank}: {call} timed out after {waited_ms} ms waiting for ranks {missing:?}")]
    Timeout {
        /// Waiting rank.
        rank: usize,
        /// The call it waited in.
        call: CallDesc,
        /// Milliseconds waited.
        waited_ms: u64,
        /// Ranks of the group that had not made the call.
        missing: Vec<usize>,
    },
    /// The rank's own code panicked (reported by a launcher for that rank).
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
    /// The backend cannot do what was asked.
    #[error("{backend} backend: {what}")]
    Unsupported {
        /// Backend name.
        backend: &'static str,
        /// What is not supported.
        what: String,
    },
    /// A bootstrap environment variable (torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `MASTER_ADDR`, `MASTER_PORT`) is missing or does not parse (see [`crate::rendezvous`]).
    #[error("environment variable {name}{}: {reason}", value.as_ref().map(|v| format!("={v:?}")).unwrap_or_default())]
    Env {
        /// The variable's name.
        name: &'static str,
        /// Its value (`None` when it is not set).
        value: Option<String>,
        /// What is wrong with it.
        reason: String,
    },
    /// The TCP rendezvous that hands every rank the NCCL unique id failed: address in use, a
    /// rank that never arrived, world-size disagreement, a broken connection.
    #[error("rendezvous at {addr} (rank {rank} of world size {world_size}): {reason}")]
    Rendezvous {
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// The rank that reports the failure.
        rank: usize,
        /// The world size that rank expects.
        world_size: usize,
        /// What went wrong, with the numbers (ranks, seconds, sizes).
        reason: String,
    },
    /// A buffer in device memory (a CUDA tensor, [`crate::OwnedBuf::Tensor`]) was given to a
    /// backend that moves data through host memory (threads, MPI), which cannot read or write
    /// it. Nothing moved; peers that made the call with host buffers wait for this rank as for
    /// any rank that did not make the call.
    #[error("rank {rank}: {op} got a {dtype} buffer of {numel} elements on {device}, but the {backend} backend cannot reach device memory: use the NCCL backend (`--backend nccl`, a build with the `cuda` feature) for device buffers, or pass host buffers")]
    DeviceBufferUnreachable {
        /// Calling rank.
        rank: usize,
        /// The collective.
        op: OpKind,
        /// The backend's name (`threads`, `mpi`).
        backend: &'static str,
        /// The buffer's element dtype.
        dtype: DType,
        /// The buffer's element count.
        numel: usize,
        /// Where the buffer lives (`cuda:0`).
        device: String,
    },
    /// A tensor buffer ([`crate::OwnedBuf::Tensor`]) that is not a collective buffer: a dtype
    /// other than f32/bf16/f16/f64, a strided (non-contiguous) layout, or (NCCL) a device
    /// other than the communicator's.
    #[error("rank {rank}: {op}: tensor of dtype {dtype}, shape {shape:?} on {device} is not a collective buffer: {reason}")]
    InvalidTensor {
        /// Calling rank.
        rank: usize,
        /// The collective.
        op: OpKind,
        /// The tensor's candle dtype (`u8`, `f32`, ...).
        dtype: String,
        /// The tensor's shape (elements per dimension).
        shape: Vec<usize>,
        /// Where the tensor lives (`cpu`, `cuda:0`).
        device: String,
        /// What is wrong, with the numbers (strides, devices).
        reason: String,
    },
    /// A CUDA driver, NCCL or candle call failed; `message` is the library's own text
    /// (`cuGetErrorString`, `ncclGetErrorString` + `ncclGetLastError`, candle's error).
    #[error("rank {rank}: {library} {call} failed: {message}")]
    Device {
        /// The rank whose call failed.
        rank: usize,
        /// `cuda`, `nccl` or `candle`.
        library: &'static str,
        /// The call, with its sizes (e.g. `ncclAllGather(1024 x bf16)`).
        call: String,
        /// The library's error text.
        message: String,
    },
}

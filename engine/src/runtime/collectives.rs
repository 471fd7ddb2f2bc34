//! The engine's view of a [`Communicator`]: the calls it makes, their errors mapped to
//! [`EngineError::Comm`], and the exposed communication time: wall time the calling (compute)
//! thread spends blocked in collectives — inside synchronous calls, starting a collective and
//! waiting for a started one. Time a started collective runs on the progress thread while the
//! caller computes is hidden and not counted.

use crate::error::{EngineError, Result};
use fsdp_comm::{
    Buf, BufMut, Communicator, Completed, Group, OwnedBuf, PendingOp, ReduceOp, Topology,
};
use std::time::{Duration, Instant};

/// A borrowed communicator plus a stopwatch of exposed communication time.
pub struct Collectives<'a> {
    comm: &'a dyn Communicator,
    /// Wall time the caller was blocked in collectives since the last
    /// [`Collectives::take_time`].
    spent: Duration,
    /// Number of collective calls since the last [`Collectives::take_time`].
    calls: u64,
}

impl std::fmt::Debug for Collectives<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Collectives")
            .field("rank", &self.comm.rank())
            .field("backend", &self.comm.backend_name())
            .finish()
    }
}

impl<'a> Collectives<'a> {
    /// Wraps `comm`.
    pub fn new(comm: &'a dyn Communicator) -> Self {
        Collectives {
            comm,
            spent: Duration::ZERO,
            calls: 0,
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The topology (world = shard group x replicate group).
    pub fn topology(&self) -> Topology {
        self.comm.topology()
    }

    /// Size of `group`.
    pub fn group_size(&self, group: Group) -> usize {
        self.comm.group_size(group)
    }

    /// Returns and resets (exposed communication time, number of collective calls).
    pub fn take_time(&mut self) -> (Duration, u64) {
        let r = (self.spent, self.calls);
        self.spent = Duration::ZERO;
        self.calls = 0;
        r
    }

    fn timed<T>(
        &mut self,
        f: impl FnOnce(&dyn Communicator) -> std::result::Result<T, fsdp_comm::CommError>,
    ) -> Result<T> {
        let t = Instant::now();
        let r = f(self.comm);
        self.spent += t.elapsed();
        self.calls += 1;
        r.map_err(|source| EngineError::Comm {
            rank: self.comm.rank(),
            source: Box::new(source),
        })
    }

    /// Starts an in-place all-gather of `buf` over `group` (this rank's block already filled;
    /// see [`Communicator::all_gather_in_place`]); [`Collectives::wait`] returns it filled.
    pub fn start_all_gather_in_place(&mut self, group: Group, buf: OwnedBuf) -> Result<PendingOp> {
        self.timed(|c| c.start_all_gather_in_place(group, buf))
    }

    /// Starts a sum-reduce-scatter of `send` (group size x n elements) into `recv` (n).
    pub fn start_reduce_scatter_sum(
        &mut self,
        group: Group,
        send: OwnedBuf,
        recv: OwnedBuf,
    ) -> Result<PendingOp> {
        self.timed(|c| c.start_reduce_scatter(group, ReduceOp::Sum, send, recv))
    }

    /// Starts an in-place all-reduce of `buf` with `op` over `group`.
    pub fn start_all_reduce(
        &mut self,
        group: Group,
        op: ReduceOp,
        buf: OwnedBuf,
    ) -> Result<PendingOp> {
        self.timed(|c| c.start_all_reduce(group, op, buf))
    }

    /// Waits for a started collective; the blocked time is exposed communication time (not
    /// counted as another call).
    pub fn wait(&mut self, op: PendingOp) -> Result<Completed> {
        let t = Instant::now();
        let r = op.wait_all();
        self.spent += t.elapsed();
        r.map_err(|source| EngineError::Comm {
            rank: self.comm.rank(),
            source: Box::new(source),
        })
    }

    /// All-gather `send` from every rank of `group` into `recv` (group size x len).
    pub fn all_gather(&mut self, group: Group, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        if self.comm.group_size(group) == 1 {
            return copy_buf(send, recv);
        }
        self.timed(|c| c.all_gather(group, send, recv))
    }

    /// Sum-reduce-scatter: `recv` (n elements) gets this rank's block of the rank-order sum of
    /// every rank's `send` (group size x n).
    pub fn reduce_scatter_sum(
        &mut self,
        group: Group,
        send: Buf<'_>,
        recv: BufMut<'_>,
    ) -> Result<()> {
        self.timed(|c| c.reduce_scatter(group, ReduceOp::Sum, send, recv))
    }

    /// In-place all-reduce with `op` over `group` (a no-op for a group of one).
    pub fn all_reduce(&mut self, group: Group, op: ReduceOp, buf: BufMut<'_>) -> Result<()> {
        if self.comm.group_size(group) == 1 {
            return Ok(());
        }
        self.timed(|c| c.all_reduce(group, op, buf))
    }

    /// Broadcast from group rank `root` over `group`.
    pub fn broadcast(&mut self, group: Group, root: usize, buf: BufMut<'_>) -> Result<()> {
        if self.comm.group_size(group) == 1 {
            return Ok(());
        }
        self.timed(|c| c.broadcast(group, root, buf))
    }

    /// All-gathers `values` (the same length on every rank) over the world: `[rank][i]`.
    pub fn all_gather_f64(&mut self, values: &[f64]) -> Result<Vec<Vec<f64>>> {
        let w = self.comm.world_size();
        let mut out = vec![0f64; w * values.len()];
        self.all_gather(Group::World, Buf::F64(values), BufMut::F64(&mut out))?;
        Ok(out
            .chunks(values.len().max(1))
            .map(|c| c.to_vec())
            .collect())
    }
}

fn copy_buf(send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
    match (send, recv) {
        (Buf::F32(s), BufMut::F32(r)) if s.len() == r.len() => r.copy_from_slice(s),
        (Buf::F64(s), BufMut::F64(r)) if s.len() == r.len() => r.copy_from_slice(s),
        (Buf::BF16(s), BufMut::BF16(r)) if s.len() == r.len() => r.copy_from_slice(s),
        (Buf::F16(s), BufMut::F16(r)) if s.len() == r.len() => r.copy_from_slice(s),
        _ => {
            return Err(EngineError::Config(
                "all-gather over a group of one: send and recv differ in dtype or length".into(),
            ))
        }
    }
    Ok(())
}

/// Encodes a 64-bit value as four exact f64 chunks of 16 bits (for exchanging hashes through
/// f64 collectives without relying on NaN payloads).
pub fn u64_to_f64_chunks(x: u64) -> [f64; 4] {
    [0, 1, 2, 3].map(|i| ((x >> (16 * i)) & 0xffff) as f64)
}

/// Inverse of [`u64_to_f64_chunks`].
pub fn f64_chunks_to_u64(c: &[f64]) -> u64 {
    c.iter()
        .take(4)
        .enumerate()
        .fold(0u64, |acc, (i, v)| acc | ((*v as u64) << (16 * i)))
}

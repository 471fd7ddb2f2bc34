//! The engine's view of a [`Communicator`]: the calls it makes, their errors mapped to
//! [`EngineError::Comm`], and the exposed communication time: wall time the calling (compute)
//! thread spends blocked in collectives — inside synchronous calls, starting a collective and
//! waiting for a started one. Time a started collective runs on the progress thread while the
//! caller computes is hidden and not counted.

use crate::error::{EngineError, Result};
use crate::trace::Tracer;
use fsdp_comm::{
    Buf, BufMut, Communicator, Completed, Group, OpKind, OwnedBuf, PendingOp, ReduceOp, Topology,
};
use fsdp_planner::time::{SpanKind, Track};
use std::time::{Duration, Instant};

/// A borrowed communicator plus a stopwatch of exposed communication time.
pub struct Collectives<'a> {
    comm: &'a dyn Communicator,
    /// Wall time the caller was blocked in collectives since the last
    /// [`Collectives::take_time`].
    spent: Duration,
    /// Number of collective calls since the last [`Collectives::take_time`].
    calls: u64,
    /// The rank's trace (`fsdp train --trace`): every collective on the communication track,
    /// every blocked wait on the compute track. None: nothing is recorded.
    tracer: Option<Tracer>,
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
            tracer: None,
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

    /// Starts (or stops, with None) recording this rank's trace.
    pub fn set_tracer(&mut self, tracer: Option<Tracer>) {
        self.tracer = tracer;
    }

    /// Whether a tracer records.
    pub fn is_tracing(&self) -> bool {
        self.tracer.is_some()
    }

    /// The rank's tracer, when tracing.
    pub fn tracer_mut(&mut self) -> Option<&mut Tracer> {
        self.tracer.as_mut()
    }

    /// Takes the tracer out (tracing stops).
    pub fn take_tracer(&mut self) -> Option<Tracer> {
        self.tracer.take()
    }

    /// A synchronous call `f`: timed, counted, and traced as `kind` of `bytes` on `group`.
    fn timed<T>(
        &mut self,
        kind: OpKind,
        group: Group,
        bytes: f64,
        f: impl FnOnce(&dyn Communicator) -> std::result::Result<T, fsdp_comm::CommError>,
    ) -> Result<T> {
        let t = Instant::now();
        let r = f(self.comm);
        let end = Instant::now();
        self.spent += end - t;
        self.calls += 1;
        if let Some(tr) = self.tracer.as_mut() {
            let (span, name) = span_kind(kind);
            let label = format!("{name} ({group})");
            tr.record(
                Track::Communication,
                span,
                label.clone(),
                None,
                t,
                end,
                Some(bytes),
            );
            tr.record(
                Track::Compute,
                SpanKind::Wait,
                format!("wait {label}"),
                None,
                t,
                end,
                None,
            );
        }
        r.map_err(|source| EngineError::Comm {
            rank: self.comm.rank(),
            source: Box::new(source),
        })
    }

    /// Starts an in-place all-gather of `buf` over `group` (this rank's block already filled;
    /// see [`Communicator::all_gather_in_place`]); [`Collectives::wait`] returns it filled.
    pub fn start_all_gather_in_place(&mut self, group: Group, buf: OwnedBuf) -> Result<PendingOp> {
        self.started(|c| c.start_all_gather_in_place(group, buf))
    }

    /// Starts a sum-reduce-scatter of `send` (group size x n elements) into `recv` (n).
    pub fn start_reduce_scatter_sum(
        &mut self,
        group: Group,
        send: OwnedBuf,
        recv: OwnedBuf,
    ) -> Result<PendingOp> {
        self.started(|c| c.start_reduce_scatter(group, ReduceOp::Sum, send, recv))
    }

    /// Starts an in-place all-reduce of `buf` with `op` over `group`.
    pub fn start_all_reduce(
        &mut self,
        group: Group,
        op: ReduceOp,
        buf: OwnedBuf,
    ) -> Result<PendingOp> {
        self.started(|c| c.start_all_reduce(group, op, buf))
    }

    /// Waits for a started collective; the blocked time is exposed communication time (not
    /// counted as another call).
    pub fn wait(&mut self, op: PendingOp) -> Result<Completed> {
        let t = Instant::now();
        let Some(tr) = self.tracer.as_mut() else {
            let r = op.wait_all();
            self.spent += t.elapsed();
            return r.map_err(|source| EngineError::Comm {
                rank: self.comm.rank(),
                source: Box::new(source),
            });
        };
        let call = *op.call();
        let issued = op.issued_at().unwrap_or(t);
        let (r, finished) = op.wait_all_timed();
        let end = Instant::now();
        self.spent += end - t;
        // The collective from issue to completion on the progress thread (or, where the
        // backend does not say, to the wait's return).
        let (span, name) = span_kind(call.op);
        let label = format!("{name} ({})", call.group);
        let bytes = call
            .dtype
            .map(|d| call.send_numel.max(call.recv_numel) as f64 * d.size_bytes() as f64);
        tr.record(
            Track::Communication,
            span,
            label.clone(),
            None,
            issued,
            finished.unwrap_or(end),
            bytes,
        );
        tr.record(
            Track::Compute,
            SpanKind::Wait,
            format!("wait {label}"),
            None,
            t,
            end,
            None,
        );
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
        let bytes = recv.len() as f64 * recv.dtype().size_bytes() as f64;
        self.timed(OpKind::AllGather, group, bytes, |c| {
            c.all_gather(group, send, recv)
        })
    }

    /// Sum-reduce-scatter: `recv` (n elements) gets this rank's block of the rank-order sum of
    /// every rank's `send` (group size x n).
    pub fn reduce_scatter_sum(
        &mut self,
        group: Group,
        send: Buf<'_>,
        recv: BufMut<'_>,
    ) -> Result<()> {
        let bytes = send.len() as f64 * send.dtype().size_bytes() as f64;
        self.timed(OpKind::ReduceScatter, group, bytes, |c| {
            c.reduce_scatter(group, ReduceOp::Sum, send, recv)
        })
    }

    /// In-place all-reduce with `op` over `group` (a no-op for a group of one).
    pub fn all_reduce(&mut self, group: Group, op: ReduceOp, buf: BufMut<'_>) -> Result<()> {
        if self.comm.group_size(group) == 1 {
            return Ok(());
        }
        let bytes = buf.len() as f64 * buf.dtype().size_bytes() as f64;
        self.timed(OpKind::AllReduce, group, bytes, |c| {
            c.all_reduce(group, op, buf)
        })
    }

    /// Broadcast from group rank `root` over `group`.
    pub fn broadcast(&mut self, group: Group, root: usize, buf: BufMut<'_>) -> Result<()> {
        if self.comm.group_size(group) == 1 {
            return Ok(());
        }
        let bytes = buf.len() as f64 * buf.dtype().size_bytes() as f64;
        self.timed(OpKind::Broadcast, group, bytes, |c| {
            c.broadcast(group, root, buf)
        })
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

impl Collectives<'_> {
    /// Starts a collective with `f`: the time to issue it is exposed, the call counted, and
    /// when tracing, the handle remembers when it was issued.
    fn started(
        &mut self,
        f: impl FnOnce(&dyn Communicator) -> std::result::Result<PendingOp, fsdp_comm::CommError>,
    ) -> Result<PendingOp> {
        let t = Instant::now();
        let r = f(self.comm);
        self.spent += t.elapsed();
        self.calls += 1;
        let mut op = r.map_err(|source| EngineError::Comm {
            rank: self.comm.rank(),
            source: Box::new(source),
        })?;
        if self.tracer.is_some() {
            op.set_issued_at(t);
        }
        Ok(op)
    }
}

/// The trace kind and name of a collective.
fn span_kind(op: OpKind) -> (SpanKind, &'static str) {
    match op {
        OpKind::AllGather => (SpanKind::AllGather, "all-gather"),
        OpKind::ReduceScatter => (SpanKind::ReduceScatter, "reduce-scatter"),
        OpKind::AllReduce => (SpanKind::AllReduce, "all-reduce"),
        // Broadcasts and barriers (start-up only) are drawn with the all-reduces.
        OpKind::Broadcast => (SpanKind::AllReduce, "broadcast"),
        OpKind::Barrier => (SpanKind::AllReduce, "barrier"),
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

//! The [`Communicator`] trait every transport implements, and the [`PendingOp`] handle of a
//! started collective.

use crate::buf::{Buf, BufMut, OwnedBuf};
use crate::error::{CallDesc, CommError, OpKind};
use crate::topology::{Group, ReduceOp, Topology};
use fsdp_types::DType;
use std::time::Instant;

/// The buffers a finished started collective hands back.
#[derive(Debug, Clone, PartialEq)]
pub struct Completed {
    /// The send buffer, unchanged (all-gather and reduce-scatter); `None` for in-place calls.
    pub send: Option<OwnedBuf>,
    /// The result: the gathered buffer, the reduced shard, or the in-place buffer.
    pub buf: OwnedBuf,
}

/// A backend's waitable completion of a started collective (see [`PendingOp::deferred`]).
pub trait PendingWait: Send {
    /// Blocks until the collective finished on this rank and returns its buffers.
    ///
    /// Errors: whatever the collective failed with (mismatch, peer exit, timeout, ...).
    fn wait(self: Box<Self>) -> Result<Completed, CommError>;
    /// True when [`PendingWait::wait`] would return without blocking.
    fn is_complete(&self) -> bool;
    /// Like [`PendingWait::wait`], also returning when the collective finished on the host
    /// (the progress thread's clock), where the backend knows it; the default knows nothing.
    ///
    /// Errors: as [`PendingWait::wait`].
    fn wait_timed(self: Box<Self>) -> (Result<Completed, CommError>, Option<Instant>) {
        (self.wait(), None)
    }
}

enum Inner {
    Ready(Result<Completed, CommError>),
    Deferred(Box<dyn PendingWait>),
}

/// A started collective: issue with `Communicator::start_*`, compute, then [`PendingOp::wait`].
///
/// The buffers were moved into the operation and come back from `wait`. Collectives complete in
/// the order each rank issued them; a synchronous call waits for the rank's started ones first.
/// Dropping a `PendingOp` without waiting lets the collective finish and drops its buffers.
pub struct PendingOp {
    call: CallDesc,
    inner: Inner,
    /// When the caller issued it, if it asked to know ([`PendingOp::set_issued_at`]).
    issued_at: Option<Instant>,
}

impl std::fmt::Debug for PendingOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingOp")
            .field("call", &self.call)
            .field("complete", &self.is_complete())
            .finish()
    }
}

impl PendingOp {
    /// A handle whose collective already finished (used by backends that run eagerly).
    pub fn ready(call: CallDesc, result: Result<Completed, CommError>) -> PendingOp {
        PendingOp {
            call,
            inner: Inner::Ready(result),
            issued_at: None,
        }
    }

    /// A handle that completes when `pending` does.
    pub fn deferred(call: CallDesc, pending: Box<dyn PendingWait>) -> PendingOp {
        PendingOp {
            call,
            inner: Inner::Deferred(pending),
            issued_at: None,
        }
    }

    /// Records when the caller issued the collective (a trace draws it from there).
    pub fn set_issued_at(&mut self, at: Instant) {
        self.issued_at = Some(at);
    }

    /// When the caller issued the collective, if recorded with [`PendingOp::set_issued_at`].
    pub fn issued_at(&self) -> Option<Instant> {
        self.issued_at
    }

    /// Like [`PendingOp::wait_all`], also returning when the collective finished on the host:
    /// the progress thread's clock for a started collective of the host backends, `None` for
    /// a handle that was complete when returned or a device-side completion (NCCL on CUDA
    /// tensors), where the wait's return is the caller's best knowledge.
    ///
    /// Errors: the collective's [`CommError`].
    pub fn wait_all_timed(self) -> (Result<Completed, CommError>, Option<Instant>) {
        match self.inner {
            Inner::Ready(r) => (r, None),
            Inner::Deferred(p) => p.wait_timed(),
        }
    }

    /// The call this handle stands for.
    pub fn call(&self) -> &CallDesc {
        &self.call
    }

    /// True when `wait` would return without blocking.
    pub fn is_complete(&self) -> bool {
        match &self.inner {
            Inner::Ready(_) => true,
            Inner::Deferred(p) => p.is_complete(),
        }
    }

    /// Blocks until the collective finished; returns the result buffer (the gathered buffer of
    /// `group size x shard` elements, the reduced shard, or the in-place buffer). Exception:
    /// on the NCCL backend a collective on CUDA tensors ([`OwnedBuf::Tensor`]) is finished on
    /// the device, not the host: `wait` makes the tensors' candle stream wait for it (candle
    /// work queued afterwards sees the result) and returns without blocking the host.
    ///
    /// Errors: the collective's [`CommError`].
    pub fn wait(self) -> Result<OwnedBuf, CommError> {
        self.wait_all().map(|c| c.buf)
    }

    /// Like [`PendingOp::wait`], also handing back the send buffer for reuse.
    ///
    /// Errors: the collective's [`CommError`].
    pub fn wait_all(self) -> Result<Completed, CommError> {
        match self.inner {
            Inner::Ready(r) => r,
            Inner::Deferred(p) => p.wait(),
        }
    }
}

/// Collective communication over the ranks of a [`Topology`]; one value per rank.
///
/// The calls know buffers and ranks, nothing of FSDP. Every rank of a group must make the same
/// calls on that group in the same order, with the same collective, reduction, dtype and element
/// counts; a backend reports a difference as [`CommError::MismatchedCalls`] and a peer that
/// stops calling as [`CommError::PeerExited`] or [`CommError::Timeout`], never a hang.
/// Reductions sum in rank order and `Avg` divides by the group size once (see [`ReduceOp`]).
/// Algorithms: reduce-scatter + all-gather composition of all-reduce as in Thakur, Rabenseifner
/// and Gropp, "Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005), 4.4.
pub trait Communicator: Send {
    /// This rank, `0 <= rank < world_size`.
    fn rank(&self) -> usize;

    /// The topology (world, shard and replicate sizes).
    fn topology(&self) -> Topology;

    /// Number of ranks `W`.
    fn world_size(&self) -> usize {
        self.topology().world_size
    }

    /// Number of ranks in `group`.
    fn group_size(&self, group: Group) -> usize {
        self.topology().group_size(group)
    }

    /// This rank's position in `group`.
    fn group_rank(&self, group: Group) -> usize {
        self.topology().group_rank(group, self.rank())
    }

    /// Short backend name for messages (`threads`, `mpi`, `nccl`).
    fn backend_name(&self) -> &'static str;

    /// Gathers every group rank's `send` (n elements) into `recv` (`group size x n` elements,
    /// shard `i` from group rank `i` at offset `i x n`).
    ///
    /// Errors: [`CommError::SizeMismatch`] / [`CommError::DTypeMismatch`] for bad buffers;
    /// mismatch, peer exit, timeout.
    fn all_gather(&self, group: Group, send: Buf<'_>, recv: BufMut<'_>) -> Result<(), CommError>;

    /// In-place all-gather (MPI's `MPI_IN_PLACE` all-gather; NCCL's in-place form, send buffer
    /// = `buf + group_rank x n`): `buf` holds `group size x n` elements and this rank's own
    /// shard is already in block `[g x n, (g+1) x n)`, `g` its group rank; afterwards block `i`
    /// holds group rank `i`'s shard. Saves the separate send buffer (the engine casts its fp32
    /// master shard straight into its block of the unsharded buffer). The default copies the
    /// own block out and calls [`Communicator::all_gather`]; backends override it to gather
    /// without the copy. Matches other ranks' [`Communicator::all_gather`] calls of the same
    /// sizes.
    ///
    /// Errors: [`CommError::SizeMismatch`] when `buf.len()` is not a multiple of the group
    /// size; mismatch, peer exit, timeout.
    fn all_gather_in_place(&self, group: Group, mut buf: BufMut<'_>) -> Result<(), CommError> {
        let own = own_block(self, group, &buf.as_buf())?;
        self.all_gather(group, own.as_buf(), buf.reborrow())
    }

    /// Reduces every group rank's `send` (`group size x n` elements) element-wise with `op` and
    /// writes elements `[i x n, (i+1) x n)` of the result to group rank `i`'s `recv` (n elements).
    ///
    /// Errors: as [`Communicator::all_gather`].
    fn reduce_scatter(
        &self,
        group: Group,
        op: ReduceOp,
        send: Buf<'_>,
        recv: BufMut<'_>,
    ) -> Result<(), CommError>;

    /// Reduces `buf` (n elements, the same n on every rank) element-wise with `op` over the
    /// group, in place.
    ///
    /// Errors: mismatch, peer exit, timeout.
    fn all_reduce(&self, group: Group, op: ReduceOp, buf: BufMut<'_>) -> Result<(), CommError>;

    /// Copies group rank `root`'s `buf` into every other group rank's `buf` (same length).
    ///
    /// Errors: [`CommError::InvalidRoot`]; mismatch, peer exit, timeout.
    fn broadcast(&self, group: Group, root: usize, buf: BufMut<'_>) -> Result<(), CommError>;

    /// Returns once every rank of the group called `barrier` on it.
    ///
    /// Errors: mismatch, peer exit, timeout.
    fn barrier(&self, group: Group) -> Result<(), CommError>;

    /// Starts an all-gather of `send` into `recv` (`group size x send.len()` elements, same
    /// dtype); [`PendingOp::wait`] returns the filled `recv`. The default runs it eagerly.
    ///
    /// Errors: bad buffers immediately; communication errors from `wait`.
    fn start_all_gather(
        &self,
        group: Group,
        send: OwnedBuf,
        recv: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        eager_start_all_gather(self, group, send, recv)
    }

    /// Starts an in-place all-gather of `buf` (see [`Communicator::all_gather_in_place`]);
    /// [`PendingOp::wait`] returns `buf` with every block filled. The default runs it eagerly.
    ///
    /// Errors: bad buffers immediately; communication errors from `wait`.
    fn start_all_gather_in_place(
        &self,
        group: Group,
        buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        eager_start_all_gather_in_place(self, group, buf)
    }

    /// Starts a reduce-scatter of `send` (`group size x recv.len()` elements) into `recv`;
    /// [`PendingOp::wait`] returns the reduced `recv`. The default runs it eagerly.
    ///
    /// Errors: bad buffers immediately; communication errors from `wait`.
    fn start_reduce_scatter(
        &self,
        group: Group,
        op: ReduceOp,
        send: OwnedBuf,
        recv: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        eager_start_reduce_scatter(self, group, op, send, recv)
    }

    /// Starts an in-place all-reduce of `buf`; [`PendingOp::wait`] returns it reduced. The
    /// default runs it eagerly.
    ///
    /// Errors: communication errors from `wait`.
    fn start_all_reduce(
        &self,
        group: Group,
        op: ReduceOp,
        buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        eager_start_all_reduce(self, group, op, buf)
    }

    /// Starts a broadcast from group rank `root`; [`PendingOp::wait`] returns `buf` holding the
    /// root's elements. The default runs it eagerly.
    ///
    /// Errors: [`CommError::InvalidRoot`] immediately; communication errors from `wait`.
    fn start_broadcast(
        &self,
        group: Group,
        root: usize,
        buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        eager_start_broadcast(self, group, root, buf)
    }
}

/// The eager form (runs at once, the handle is ready) of
/// [`Communicator::start_all_gather`] on host buffers (vectors, CPU tensors in place): the
/// trait's default, and the host-buffer case of a backend's override.
///
/// Errors: as [`Communicator::start_all_gather`].
pub(crate) fn eager_start_all_gather<C: Communicator + ?Sized>(
    comm: &C,
    group: Group,
    send: OwnedBuf,
    mut recv: OwnedBuf,
) -> Result<PendingOp, CommError> {
    let (rank, backend) = (comm.rank(), comm.backend_name());
    let (s, r) = host_pair(rank, OpKind::AllGather, backend, &send, &mut recv)?;
    let call = describe(comm, OpKind::AllGather, group, None, &send, &recv, None)?;
    // SAFETY: `host_pair` checked both buffers (host memory, disjoint); they live here.
    let (sv, rv) = unsafe { (host_view(s, &send), host_view_mut(r, &recv)) };
    let r = comm.all_gather(group, sv, rv);
    Ok(PendingOp::ready(
        call,
        r.map(|()| Completed {
            send: Some(send),
            buf: recv,
        }),
    ))
}

/// The eager form (runs at once, the handle is ready) of
/// [`Communicator::start_all_gather_in_place`] on host buffers (vectors, CPU tensors in place): the
/// trait's default, and the host-buffer case of a backend's override.
///
/// Errors: as [`Communicator::start_all_gather_in_place`].
pub(crate) fn eager_start_all_gather_in_place<C: Communicator + ?Sized>(
    comm: &C,
    group: Group,
    mut buf: OwnedBuf,
) -> Result<PendingOp, CommError> {
    let p = buf.host_addr_mut(comm.rank(), OpKind::AllGather, comm.backend_name())?;
    // SAFETY: checked host memory of `buf`, which lives here.
    let own = own_block(comm, group, &unsafe { host_view(p, &buf) })?;
    let call = describe(comm, OpKind::AllGather, group, None, &own, &buf, None)?;
    // SAFETY: as above; `own` is a separate copy.
    let r = comm.all_gather(group, own.as_buf(), unsafe { host_view_mut(p, &buf) });
    Ok(PendingOp::ready(
        call,
        r.map(|()| Completed { send: None, buf }),
    ))
}

/// The eager form (runs at once, the handle is ready) of
/// [`Communicator::start_reduce_scatter`] on host buffers (vectors, CPU tensors in place): the
/// trait's default, and the host-buffer case of a backend's override.
///
/// Errors: as [`Communicator::start_reduce_scatter`].
pub(crate) fn eager_start_reduce_scatter<C: Communicator + ?Sized>(
    comm: &C,
    group: Group,
    op: ReduceOp,
    send: OwnedBuf,
    mut recv: OwnedBuf,
) -> Result<PendingOp, CommError> {
    let (rank, backend) = (comm.rank(), comm.backend_name());
    let (s, r) = host_pair(rank, OpKind::ReduceScatter, backend, &send, &mut recv)?;
    let call = describe(
        comm,
        OpKind::ReduceScatter,
        group,
        Some(op),
        &send,
        &recv,
        None,
    )?;
    // SAFETY: `host_pair` checked both buffers (host memory, disjoint); they live here.
    let (sv, rv) = unsafe { (host_view(s, &send), host_view_mut(r, &recv)) };
    let r = comm.reduce_scatter(group, op, sv, rv);
    Ok(PendingOp::ready(
        call,
        r.map(|()| Completed {
            send: Some(send),
            buf: recv,
        }),
    ))
}

/// The eager form (runs at once, the handle is ready) of
/// [`Communicator::start_all_reduce`] on host buffers (vectors, CPU tensors in place): the
/// trait's default, and the host-buffer case of a backend's override.
///
/// Errors: as [`Communicator::start_all_reduce`].
pub(crate) fn eager_start_all_reduce<C: Communicator + ?Sized>(
    comm: &C,
    group: Group,
    op: ReduceOp,
    mut buf: OwnedBuf,
) -> Result<PendingOp, CommError> {
    let p = buf.host_addr_mut(comm.rank(), OpKind::AllReduce, comm.backend_name())?;
    let call = describe(comm, OpKind::AllReduce, group, Some(op), &buf, &buf, None)?;
    // SAFETY: checked host memory of `buf`, which lives here.
    let r = comm.all_reduce(group, op, unsafe { host_view_mut(p, &buf) });
    Ok(PendingOp::ready(
        call,
        r.map(|()| Completed { send: None, buf }),
    ))
}

/// The eager form (runs at once, the handle is ready) of
/// [`Communicator::start_broadcast`] on host buffers (vectors, CPU tensors in place): the
/// trait's default, and the host-buffer case of a backend's override.
///
/// Errors: as [`Communicator::start_broadcast`].
pub(crate) fn eager_start_broadcast<C: Communicator + ?Sized>(
    comm: &C,
    group: Group,
    root: usize,
    mut buf: OwnedBuf,
) -> Result<PendingOp, CommError> {
    let p = buf.host_addr_mut(comm.rank(), OpKind::Broadcast, comm.backend_name())?;
    let call = describe(comm, OpKind::Broadcast, group, None, &buf, &buf, Some(root))?;
    // SAFETY: checked host memory of `buf`, which lives here.
    let r = comm.broadcast(group, root, unsafe { host_view_mut(p, &buf) });
    Ok(PendingOp::ready(
        call,
        r.map(|()| Completed { send: None, buf }),
    ))
}

/// Host addresses of a call's send and receive buffers (see `OwnedBuf::host_addr`): both must
/// be host memory, and their elements must not overlap (a plain all-gather or reduce-scatter
/// reads `send` while peers' data lands in `recv`; an all-gather into a buffer that holds its
/// own send block is `start_all_gather_in_place`). Vectors never overlap; two tensors can
/// (narrows of one storage).
///
/// Errors: as `OwnedBuf::check_host`; [`CommError::InvalidTensor`] when the buffers overlap.
pub(crate) fn host_pair(
    rank: usize,
    op: OpKind,
    backend: &'static str,
    send: &OwnedBuf,
    recv: &mut OwnedBuf,
) -> Result<(usize, usize), CommError> {
    let s = send.host_addr(rank, op, backend)?;
    let r = recv.host_addr_mut(rank, op, backend)?;
    let (sb, rb) = (bytes_of(send), bytes_of(recv));
    if sb > 0 && rb > 0 && s < r + rb && r < s + sb {
        let t = send
            .tensor()
            .or(recv.tensor())
            .expect("only tensors can overlap");
        return Err(CommError::InvalidTensor {
            rank,
            op,
            dtype: t.dtype().as_str().to_string(),
            shape: t.dims().to_vec(),
            device: crate::buf::device_name(t),
            reason: format!(
                "the send buffer (bytes {s:#x}..{:#x}) overlaps the receive buffer (bytes \
                 {r:#x}..{:#x}); an all-gather into a buffer holding its own block is \
                 all_gather_in_place",
                s + sb,
                r + rb
            ),
        });
    }
    Ok((s, r))
}

/// Bytes of a checked buffer.
fn bytes_of(b: &OwnedBuf) -> usize {
    b.len() * b.try_dtype().map_or(0, |d| d.size_bytes() as usize)
}

/// A read-only view of `buf`'s elements at its host address `addr`.
///
/// # Safety
/// `addr` is `buf.host_addr(..)` (or `host_addr_mut`) of this `buf`, the view is used only
/// while `buf` lives, and nothing writes those elements meanwhile.
pub(crate) unsafe fn host_view(addr: usize, buf: &OwnedBuf) -> Buf<'_> {
    let n = buf.len();
    match buf.dtype() {
        DType::F32 => Buf::F32(std::slice::from_raw_parts(addr as *const f32, n)),
        DType::BF16 => Buf::BF16(std::slice::from_raw_parts(addr as *const half::bf16, n)),
        DType::F16 => Buf::F16(std::slice::from_raw_parts(addr as *const half::f16, n)),
        DType::F64 => Buf::F64(std::slice::from_raw_parts(addr as *const f64, n)),
    }
}

/// A writable view of `buf`'s elements at its host address `addr`.
///
/// # Safety
/// `addr` is `buf.host_addr_mut(..)` of this `buf`, the view is used only while `buf` lives,
/// and nothing else reads or writes those elements meanwhile (the caller's start-to-wait
/// contract; a tensor's storage lock is not held).
#[allow(clippy::mut_from_ref)]
pub(crate) unsafe fn host_view_mut(addr: usize, buf: &OwnedBuf) -> BufMut<'_> {
    let n = buf.len();
    match buf.dtype() {
        DType::F32 => BufMut::F32(std::slice::from_raw_parts_mut(addr as *mut f32, n)),
        DType::BF16 => BufMut::BF16(std::slice::from_raw_parts_mut(addr as *mut half::bf16, n)),
        DType::F16 => BufMut::F16(std::slice::from_raw_parts_mut(addr as *mut half::f16, n)),
        DType::F64 => BufMut::F64(std::slice::from_raw_parts_mut(addr as *mut f64, n)),
    }
}

/// A copy of this rank's block of an in-place all-gather buffer (`buf.len() / group size`
/// elements at `group_rank x n`).
///
/// Errors: [`CommError::SizeMismatch`] when `buf.len()` is not a multiple of the group size.
pub(crate) fn own_block<C: Communicator + ?Sized>(
    comm: &C,
    group: Group,
    buf: &Buf<'_>,
) -> Result<OwnedBuf, CommError> {
    let len = buf.len();
    let n = in_place_shard(comm.rank(), comm.topology(), group, len)?;
    let r = comm.group_rank(group) * n..(comm.group_rank(group) + 1) * n;
    Ok(match buf {
        Buf::F32(x) => OwnedBuf::F32(x[r].to_vec()),
        Buf::BF16(x) => OwnedBuf::BF16(x[r].to_vec()),
        Buf::F16(x) => OwnedBuf::F16(x[r].to_vec()),
        Buf::F64(x) => OwnedBuf::F64(x[r].to_vec()),
    })
}

/// The shard length `n` (elements) of an in-place all-gather buffer of `len` elements on
/// `group`: `len / group size`.
///
/// Errors: [`CommError::SizeMismatch`] (`what` = `in-place buf`, `expected` = `len` rounded up
/// to a multiple of the group size) when `len` is not a multiple of the group size.
pub(crate) fn in_place_shard(
    rank: usize,
    topology: Topology,
    group: Group,
    len: usize,
) -> Result<usize, CommError> {
    let g = topology.group_size(group);
    if g == 0 || !len.is_multiple_of(g) {
        return Err(CommError::SizeMismatch {
            rank,
            op: OpKind::AllGather,
            group,
            group_size: g,
            what: "in-place buf",
            expected: len.div_ceil(g.max(1)) * g.max(1),
            got: len,
        });
    }
    Ok(len / g)
}

/// Checks an in-place all-gather buffer of `dtype` and `len` elements on `group` and describes
/// the call (number `seq`) exactly as a plain all-gather of `len / group size` elements into
/// `len`, so in-place and plain ranks of one group match.
///
/// Errors: as [`in_place_shard`].
pub(crate) fn check_in_place_call(
    rank: usize,
    topology: Topology,
    group: Group,
    dtype: DType,
    len: usize,
    seq: u64,
) -> Result<CallDesc, CommError> {
    let n = in_place_shard(rank, topology, group, len)?;
    check_call(
        rank,
        topology,
        CallRequest::new(OpKind::AllGather, group, (dtype, n), (dtype, len)),
        seq,
    )
}

/// Checks the buffers of one started call on the calling rank and describes it (call number
/// 0: a ready handle's description).
///
/// Errors: [`CommError::DTypeMismatch`], [`CommError::SizeMismatch`], [`CommError::InvalidRoot`].
fn describe<C: Communicator + ?Sized>(
    comm: &C,
    op: OpKind,
    group: Group,
    reduce: Option<ReduceOp>,
    send: &OwnedBuf,
    recv: &OwnedBuf,
    root: Option<usize>,
) -> Result<CallDesc, CommError> {
    let req = CallRequest {
        op,
        group,
        reduce,
        send: (send.dtype(), send.len()),
        recv: (recv.dtype(), recv.len()),
        root,
    };
    check_call(comm.rank(), comm.topology(), req, 0)
}

/// One collective call as the caller makes it, before its buffers are checked against the
/// group: what [`check_call`] validates and turns into a [`CallDesc`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallRequest {
    /// The collective.
    pub op: OpKind,
    /// The group it runs over.
    pub group: Group,
    /// The reduction (reduce-scatter and all-reduce only).
    pub reduce: Option<ReduceOp>,
    /// The send buffer's dtype and element count (the buffer itself for an in-place call).
    pub send: (DType, usize),
    /// The receive buffer's dtype and element count (the buffer itself for an in-place call).
    pub recv: (DType, usize),
    /// Root group rank (broadcast only).
    pub root: Option<usize>,
}

impl CallRequest {
    /// `op` on `group` from a send buffer to a receive buffer (dtype, elements each), without
    /// a reduction or a root.
    pub fn new(op: OpKind, group: Group, send: (DType, usize), recv: (DType, usize)) -> Self {
        CallRequest {
            op,
            group,
            reduce: None,
            send,
            recv,
            root: None,
        }
    }

    /// The same call with reduction `op`.
    pub fn reduce(self, op: ReduceOp) -> Self {
        CallRequest {
            reduce: Some(op),
            ..self
        }
    }

    /// The same call with root group rank `root`.
    pub fn root(self, root: usize) -> Self {
        CallRequest {
            root: Some(root),
            ..self
        }
    }
}

/// Validates one call's buffers against its group size and returns its description (with call
/// number `seq`).
///
/// Errors: [`CommError::DTypeMismatch`], [`CommError::SizeMismatch`], [`CommError::InvalidRoot`].
pub fn check_call(
    rank: usize,
    topology: Topology,
    req: CallRequest,
    seq: u64,
) -> Result<CallDesc, CommError> {
    let CallRequest {
        op,
        group,
        reduce,
        send: (send_dtype, send_numel),
        recv: (recv_dtype, recv_numel),
        root,
    } = req;
    let g = topology.group_size(group);
    if send_dtype != recv_dtype {
        return Err(CommError::DTypeMismatch {
            rank,
            op,
            send: send_dtype,
            recv: recv_dtype,
        });
    }
    let size_err = |what, expected, got| CommError::SizeMismatch {
        rank,
        op,
        group,
        group_size: g,
        what,
        expected,
        got,
    };
    match op {
        OpKind::AllGather => {
            let expected = send_numel.saturating_mul(g);
            if recv_numel != expected {
                return Err(size_err("recv", expected, recv_numel));
            }
        }
        OpKind::ReduceScatter => {
            let expected = recv_numel.saturating_mul(g);
            if send_numel != expected {
                return Err(size_err("send", expected, send_numel));
            }
        }
        OpKind::AllReduce | OpKind::Broadcast | OpKind::Barrier => {
            if send_numel != recv_numel {
                return Err(size_err("recv", send_numel, recv_numel));
            }
        }
    }
    if let Some(root) = root {
        if root >= g {
            return Err(CommError::InvalidRoot {
                rank,
                group,
                root,
                group_size: g,
            });
        }
    }
    Ok(CallDesc {
        op,
        group,
        reduce,
        dtype: if op == OpKind::Barrier {
            None
        } else {
            Some(send_dtype)
        },
        send_numel,
        recv_numel,
        root,
        seq,
    })
}

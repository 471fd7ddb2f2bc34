//! The in-process backend: every rank is a thread, data moves by memcpy through shared memory.
//!
//! Protocol of one collective on a group of `g` ranks:
//! 1. **Post** (checked rendezvous): each rank posts a [`CallDesc`] and the addresses of its
//!    buffers in the group's slot table under one world-wide mutex, then waits until all `g`
//!    have posted. The last arrival snapshots the table. While waiting, a rank returns an error
//!    instead of hanging when a peer it waits for has exited, a peer failed, the ranks wait on
//!    each other in a cycle (a wait-for graph with no running rank: mismatched groups), or the
//!    timeout passes.
//! 2. **Compare**: every rank checks that all posted calls are equal (collective, group,
//!    reduction, dtype, element counts, call number); otherwise all return
//!    [`CommError::MismatchedCalls`] naming every rank's call, before any byte is touched.
//! 3. **Move**: each rank reads its peers' buffers directly. All-gather: copy every member's
//!    shard into the own receive buffer, every rank in the same block order so ranks running
//!    at once read the same lines and the shared last-level cache serves the repeats (in place,
//!    `MPI_IN_PLACE`-style: the send buffer a rank posts is its own block of its receive
//!    buffer, which peers read while it writes the other blocks, and which it does not copy
//!    onto itself). Reduce-scatter: group rank `i` reduces chunk `i` of all send buffers, in
//!    rank order, into its receive buffer, so the `g` ranks split the arithmetic. All-reduce:
//!    the same reduction of chunk `i` in place, a rendezvous, then each rank copies the other
//!    reduced chunks (reduce-scatter + all-gather, Rabenseifner's algorithm as in Thakur,
//!    Rabenseifner and Gropp, IJHPCA 2005, section 4.4, with shared memory instead of
//!    messages). A rank whose collective writes more than fits its share of the last-level
//!    cache (3/4 of the cache over the larger of the CPUs sharing it and the world size, see
//!    `stream.rs`) writes with non-temporal stores, copies keeping four pages in flight, and
//!    one `sfence` before the release; the reduction reads all its inputs in one fused pass
//!    (`reduce.rs`).
//! 4. **Release** (unchecked rendezvous): nobody returns, and so frees its buffers, before every
//!    peer has finished reading them. Phases 3 and 4 cannot block indefinitely: every rank past
//!    phase 2 runs them without waiting on anything else.
//!
//! Any failure aborts the whole world: later calls on every rank return the same error.

use crate::buf::OwnedBuf;
use crate::comm::{
    check_call, check_in_place_call, host_pair, CallRequest, Communicator, Completed, PendingOp,
};
use crate::error::{CallDesc, CommError, OpKind, RankCalls};
use crate::progress::{Job, ProgressQueue};
use crate::reduce::{reduce_dyn, reduce_dyn_streaming};
use crate::topology::{Group, ReduceOp, Topology};
use crate::{Buf, BufMut};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub(crate) mod stream;

/// How long a rank waits for its peers to join a collective before [`CommError::Timeout`]: 60 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// One rank's posting for one collective: its call and its buffer addresses.
#[derive(Clone, Copy)]
struct Slot {
    call: CallDesc,
    send: usize,
    recv: usize,
}

#[derive(Clone, Copy, Debug)]
enum Status {
    /// Computing, or inside a collective past its post phase: will make progress.
    Running,
    /// Waiting in the post phase of a collective on group instance `inst`.
    Blocked { inst: usize, call: CallDesc },
    /// Dropped its communicator after `calls` collective calls.
    Exited { calls: u64 },
    /// Panicked.
    Failed,
}

/// The rendezvous table of one group instance.
struct Rendezvous {
    members: Vec<usize>,
    generation: u64,
    slots: Vec<Option<Slot>>,
    count: usize,
    last: Option<Arc<Vec<Slot>>>,
}

struct State {
    rendezvous: Vec<Rendezvous>,
    status: Vec<Status>,
    calls: Vec<u64>,
    abort: Option<CommError>,
    exit_epoch: u64,
}

struct World {
    topology: Topology,
    timeout: Duration,
    /// A rank whose collective writes at least this many bytes copies with non-temporal stores
    /// ([`stream::non_temporal_threshold`] of the world size).
    stream_from: usize,
    state: Mutex<State>,
    cv: Condvar,
}

/// Aborts the process if a panic unwinds through a data phase: peers may be reading this rank's
/// buffers, which unwinding would free.
struct AbortOnUnwind;
impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("fsdp-comm: panic while peers read this rank's buffers; aborting");
            std::process::abort();
        }
    }
}

impl World {
    fn new(topology: Topology, timeout: Duration, stream_from: usize) -> Result<World, CommError> {
        topology.validate()?;
        let w = topology.world_size;
        let mut rendezvous: Vec<Option<Rendezvous>> =
            (0..topology.num_group_instances()).map(|_| None).collect();
        for rank in 0..w {
            for group in [Group::World, Group::Shard, Group::Replicate] {
                let inst = topology.group_instance(group, rank);
                if rendezvous[inst].is_none() {
                    let members = topology.group_members(group, rank);
                    rendezvous[inst] = Some(Rendezvous {
                        slots: vec![None; members.len()],
                        members,
                        generation: 0,
                        count: 0,
                        last: None,
                    });
                }
            }
        }
        Ok(World {
            topology,
            timeout,
            stream_from,
            state: Mutex::new(State {
                rendezvous: rendezvous.into_iter().flatten().collect(),
                status: vec![Status::Running; w],
                calls: vec![0; w],
                abort: None,
                exit_epoch: 0,
            }),
            cv: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; recover the guard regardless.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn abort_with(&self, e: &CommError) {
        let mut st = self.lock();
        if st.abort.is_none() {
            st.abort = Some(e.clone());
        }
        self.cv.notify_all();
    }

    /// Posts `slot` for `rank` on group instance `inst` and waits for the whole group.
    /// `checked`: the post phase (may fail); otherwise an inner phase that always completes.
    fn rendezvous(
        &self,
        rank: usize,
        inst: usize,
        grank: usize,
        slot: Slot,
        checked: bool,
    ) -> Result<Arc<Vec<Slot>>, CommError> {
        let mut st = self.lock();
        if checked {
            if let Some(e) = &st.abort {
                return Err(e.clone());
            }
            st.calls[rank] += 1;
        }
        let rv = &mut st.rendezvous[inst];
        debug_assert!(rv.slots[grank].is_none());
        rv.slots[grank] = Some(slot);
        rv.count += 1;
        let generation = rv.generation;
        if rv.count == rv.slots.len() {
            let snap: Vec<Slot> = rv.slots.iter_mut().flat_map(|s| s.take()).collect();
            let snap = Arc::new(snap);
            rv.last = Some(snap.clone());
            rv.count = 0;
            rv.generation += 1;
            // Release the waiting members now, so nobody's stall detection sees them blocked.
            let members = rv.members.clone();
            for m in members {
                if matches!(st.status[m], Status::Blocked { inst: i, .. } if i == inst) {
                    st.status[m] = Status::Running;
                }
            }
            st.status[rank] = Status::Running;
            self.cv.notify_all();
            return Ok(snap);
        }
        if !checked {
            loop {
                st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                let rv = &st.rendezvous[inst];
                if rv.generation != generation {
                    return Ok(rv
                        .last
                        .clone()
                        .expect("completed rendezvous has a snapshot"));
                }
            }
        }
        st.status[rank] = Status::Blocked {
            inst,
            call: slot.call,
        };
        let start = Instant::now();
        let deadline = start + self.timeout;
        let mut seen_epoch = None;
        loop {
            let rv = &st.rendezvous[inst];
            if rv.generation != generation {
                let snap = rv
                    .last
                    .clone()
                    .expect("completed rendezvous has a snapshot");
                st.status[rank] = Status::Running;
                return Ok(snap);
            }
            if let Some(e) = &st.abort {
                let e = e.clone();
                st.status[rank] = Status::Running;
                return Err(e);
            }
            if seen_epoch != Some(st.exit_epoch) {
                seen_epoch = Some(st.exit_epoch);
                if let Err(e) = detect_stall(&st, rank, inst, &slot.call) {
                    st.status[rank] = Status::Running;
                    st.abort = Some(e.clone());
                    self.cv.notify_all();
                    return Err(e);
                }
            }
            let now = Instant::now();
            if now >= deadline {
                let rv = &st.rendezvous[inst];
                let missing = rv
                    .members
                    .iter()
                    .zip(&rv.slots)
                    .filter(|(_, s)| s.is_none())
                    .map(|(&m, _)| m)
                    .collect();
                let e = CommError::Timeout {
                    rank,
                    call: slot.call,
                    waited_ms: (now - start).as_millis() as u64,
                    missing,
                };
                st.status[rank] = Status::Running;
                st.abort = Some(e.clone());
                self.cv.notify_all();
                return Err(e);
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn mark_exit(&self, rank: usize, failed: bool) {
        let mut st = self.lock();
        if failed {
            st.status[rank] = Status::Failed;
            if st.abort.is_none() {
                st.abort = Some(CommError::PeerFailed {
                    peer: rank,
                    reason: "the rank panicked".into(),
                });
            }
        } else {
            let calls = st.calls[rank];
            st.status[rank] = Status::Exited { calls };
        }
        st.exit_epoch += 1;
        self.cv.notify_all();
    }
}

/// Decides whether `rank`, waiting on instance `inst`, can still be released.
///
/// Errors: [`CommError::PeerExited`] / [`CommError::PeerFailed`] when a missing member of its own
/// group is gone; [`CommError::MismatchedCalls`] when every rank it (transitively) waits for is
/// itself waiting or gone, so no rank can move (e.g. ranks calling on different groups).
fn detect_stall(st: &State, rank: usize, inst: usize, call: &CallDesc) -> Result<(), CommError> {
    let rv = &st.rendezvous[inst];
    for (g, &m) in rv.members.iter().enumerate() {
        if rv.slots[g].is_none() {
            match st.status[m] {
                Status::Exited { calls } => {
                    return Err(CommError::PeerExited {
                        rank,
                        call: *call,
                        peer: m,
                        peer_calls: calls,
                    })
                }
                Status::Failed => {
                    return Err(CommError::PeerFailed {
                        peer: m,
                        reason: "the rank panicked".into(),
                    })
                }
                _ => {}
            }
        }
    }
    let w = st.status.len();
    let mut visited = vec![false; w];
    visited[rank] = true;
    let mut stack = vec![rank];
    let mut stuck = Vec::new();
    while let Some(x) = stack.pop() {
        let Status::Blocked { inst: xi, call: xc } = st.status[x] else {
            continue;
        };
        stuck.push((x, xc));
        let rv = &st.rendezvous[xi];
        for (g, &m) in rv.members.iter().enumerate() {
            if rv.slots[g].is_some() || visited[m] {
                continue;
            }
            visited[m] = true;
            match st.status[m] {
                Status::Running => return Ok(()),
                Status::Blocked { .. } => stack.push(m),
                Status::Exited { .. } | Status::Failed => {}
            }
        }
    }
    stuck.sort_by_key(|&(r, _)| r);
    Err(CommError::MismatchedCalls {
        calls: RankCalls(stuck),
    })
}

/// Start of chunk `i` when `n` elements are split into `g` nearly equal contiguous chunks.
fn chunk_start(n: usize, g: usize, i: usize) -> usize {
    (n / g) * i + i.min(n % g)
}

/// Runs one collective for `rank` with raw buffer addresses.
///
/// SAFETY contract (upheld by the callers in this module): `send` is valid for reads of
/// `call.send_numel` elements and `recv` for reads and writes of `call.recv_numel` elements of
/// `call.dtype` until this function returns, and nothing else accesses `recv` meanwhile. The
/// one allowed overlap: an all-gather's `send` may be block `group rank` of `recv` (in place),
/// which this rank then only reads (peers read it too) while writing the other blocks.
fn execute(
    world: &World,
    rank: usize,
    call: CallDesc,
    send: usize,
    recv: usize,
) -> Result<(), CommError> {
    let topo = world.topology;
    let inst = topo.group_instance(call.group, rank);
    let grank = topo.group_rank(call.group, rank);
    let g = topo.group_size(call.group);
    let slot = Slot { call, send, recv };
    let snap = world.rendezvous(rank, inst, grank, slot, true)?;
    if snap.iter().any(|s| s.call != snap[0].call) {
        let members = topo.group_members(call.group, rank);
        let e = CommError::MismatchedCalls {
            calls: RankCalls(
                members
                    .into_iter()
                    .zip(snap.iter().map(|s| s.call))
                    .collect(),
            ),
        };
        world.abort_with(&e);
        return Err(e);
    }
    let Some(dtype) = call.dtype else {
        return Ok(()); // barrier: the post phase was the whole collective
    };
    let esize = dtype.size_bytes() as usize;
    let _guard = AbortOnUnwind;
    match call.op {
        OpKind::Barrier => {}
        OpKind::AllGather => {
            let bytes = call.send_numel * esize;
            // Streaming when the whole receive buffer reaches the rank's threshold: every block
            // then takes the streaming copy (four pages in flight, faster than glibc's large
            // copy here: 9.1 against 8.0 GB/s for 256 MiB on one core).
            let stream = call.recv_numel * esize >= world.stream_from;
            // Every member copies the blocks in the same order (0, 1, ...), so members running
            // at the same time read the same send buffer at about the same time and the shared
            // last-level cache serves all but the first read of a line.
            for j in 0..g {
                let dst = recv + j * bytes;
                if snap[j].send == dst {
                    // In-place all-gather: our own shard already sits in its block (and peers
                    // may be reading it right now); never copy a block onto itself.
                    continue;
                }
                // SAFETY: peer j's send buffer stays valid until the release rendezvous and is
                // only read; block j of our receive buffer is written by us alone and is
                // disjoint from it (a peer's send buffer never lies in our receive buffer, and
                // our own send block was skipped above when it does).
                unsafe {
                    stream::copy_unfenced(snap[j].send as *const u8, dst as *mut u8, bytes, stream)
                };
            }
            if stream {
                stream::fence();
            }
        }
        OpKind::ReduceScatter => {
            let n = call.recv_numel;
            let inputs: Vec<*const u8> = snap
                .iter()
                .map(|s| (s.send + grank * n * esize) as *const u8)
                .collect();
            // Stream the output when the bytes this rank moves (g x n read, n written) are at
            // least those of a copy that memcpy would stream (2 x its threshold).
            let stream = (g + 1) * n * esize >= world.stream_from.saturating_mul(2);
            // SAFETY: chunk `grank` of every send buffer is only read; our recv is ours alone.
            unsafe {
                reduce_dyn_streaming(
                    dtype,
                    &inputs,
                    recv as *mut u8,
                    n,
                    call.reduce.unwrap_or(ReduceOp::Sum),
                    stream,
                )
            };
        }
        OpKind::AllReduce => {
            let n = call.recv_numel;
            let lo = chunk_start(n, g, grank);
            let hi = chunk_start(n, g, grank + 1);
            let inputs: Vec<*const u8> = snap
                .iter()
                .map(|s| (s.recv + lo * esize) as *const u8)
                .collect();
            // SAFETY: during this phase chunk `grank` of every buffer is touched by this rank
            // only; the reduction reads each block fully before writing it into our own chunk.
            unsafe {
                reduce_dyn(
                    dtype,
                    &inputs,
                    (recv + lo * esize) as *mut u8,
                    hi - lo,
                    call.reduce.unwrap_or(ReduceOp::Sum),
                )
            };
            if g > 1 {
                world.rendezvous(rank, inst, grank, slot, false)?;
                let stream = (n - (hi - lo)) * esize >= world.stream_from;
                for j in (0..g).filter(|&j| j != grank) {
                    let (l, h) = (chunk_start(n, g, j), chunk_start(n, g, j + 1));
                    // SAFETY: chunk j of peer j's buffer is final and only read now; chunk j of
                    // ours is written by us only.
                    unsafe {
                        stream::copy_unfenced(
                            (snap[j].recv + l * esize) as *const u8,
                            (recv + l * esize) as *mut u8,
                            (h - l) * esize,
                            stream,
                        )
                    };
                }
                if stream {
                    stream::fence();
                }
            }
        }
        OpKind::Broadcast => {
            let root = call.root.unwrap_or(0);
            if grank != root {
                // SAFETY: the root's buffer is only read during this phase.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        snap[root].recv as *const u8,
                        recv as *mut u8,
                        call.recv_numel * esize,
                    )
                };
            }
        }
    }
    if g > 1 {
        world.rendezvous(rank, inst, grank, slot, false)?;
    }
    Ok(())
}

/// One rank of an in-process thread world; create them with [`thread_communicators`] or
/// [`run_threads`] and move each into its own thread.
///
/// Synchronous calls run on the calling thread; started calls (`start_*`) run in issue order on
/// a progress thread owned by this value, and a synchronous call first waits for them. Dropping
/// the value finishes the started calls and tells the peers this rank has exited, so a peer
/// waiting for it gets [`CommError::PeerExited`] rather than hanging. A drop during a panic
/// aborts the world ([`CommError::PeerFailed`] for every peer).
pub struct ThreadComm {
    world: Arc<World>,
    rank: usize,
    seq: Cell<[u64; 3]>,
    progress: ProgressQueue,
}

impl std::fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadComm")
            .field("rank", &self.rank)
            .field("topology", &self.world.topology)
            .finish()
    }
}

/// Creates the `world_size` communicators of a thread world (index = rank), with `timeout` as
/// the longest a rank waits for its peers to join a collective.
///
/// Errors: [`CommError::InvalidTopology`].
pub fn thread_communicators(
    topology: Topology,
    timeout: Duration,
) -> Result<Vec<ThreadComm>, CommError> {
    communicators_streaming_from(
        topology,
        timeout,
        stream::non_temporal_threshold(topology.world_size),
    )
}

/// [`thread_communicators`] with the non-temporal copy threshold given (bytes a rank writes in
/// one collective from which it streams).
fn communicators_streaming_from(
    topology: Topology,
    timeout: Duration,
    stream_from: usize,
) -> Result<Vec<ThreadComm>, CommError> {
    let world = Arc::new(World::new(topology, timeout, stream_from)?);
    Ok((0..topology.world_size)
        .map(|rank| ThreadComm {
            world: world.clone(),
            rank,
            seq: Cell::new([0; 3]),
            progress: ProgressQueue::new("threads", rank, format!("rank{rank}-comm")),
        })
        .collect())
}

/// Text of a panic payload.
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Runs `f` once per rank of `topology`, each on its own thread with its [`ThreadComm`], and
/// returns the results in rank order.
///
/// `timeout` bounds how long any rank waits for peers inside a collective (use
/// [`DEFAULT_TIMEOUT`], 60 s, unless a test needs less). A rank whose `f` panics yields
/// [`CommError::RankPanicked`] with the message; its peers' pending and later collectives fail
/// with [`CommError::PeerFailed`] instead of hanging.
///
/// An invalid topology yields one [`CommError::InvalidTopology`] per claimed rank.
pub fn run_threads<R: Send>(
    topology: Topology,
    timeout: Duration,
    f: impl Fn(ThreadComm) -> R + Sync,
) -> Vec<Result<R, CommError>> {
    let comms = match thread_communicators(topology, timeout) {
        Ok(c) => c,
        Err(e) => {
            return (0..topology.world_size.max(1))
                .map(|_| Err(e.clone()))
                .collect()
        }
    };
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let rank = comm.rank;
                let h = std::thread::Builder::new()
                    .name(format!("fsdp-rank-{rank}"))
                    .spawn_scoped(s, move || {
                        catch_unwind(AssertUnwindSafe(|| f(comm))).map_err(|p| {
                            CommError::RankPanicked {
                                rank,
                                message: panic_message(&*p),
                            }
                        })
                    });
                (rank, h)
            })
            .collect();
        handles
            .into_iter()
            .map(|(rank, h)| match h {
                Ok(h) => h.join().unwrap_or_else(|p| {
                    Err(CommError::RankPanicked {
                        rank,
                        message: panic_message(&*p),
                    })
                }),
                Err(e) => Err(CommError::Unsupported {
                    backend: "threads",
                    what: format!("cannot spawn the thread of rank {rank}: {e}"),
                }),
            })
            .collect()
    })
}

impl ThreadComm {
    fn next_seq(&self, group: Group) -> u64 {
        let mut s = self.seq.get();
        let i = group as usize;
        let v = s[i];
        s[i] += 1;
        self.seq.set(s);
        v
    }

    /// Waits until every started collective of this rank has finished.
    fn drain(&self) {
        self.progress.drain();
    }

    fn describe(
        &self,
        op: OpKind,
        group: Group,
        reduce: Option<ReduceOp>,
        send: (fsdp_types::DType, usize),
        recv: (fsdp_types::DType, usize),
        root: Option<usize>,
    ) -> Result<CallDesc, CommError> {
        let seq = self.next_seq(group);
        let req = CallRequest {
            op,
            group,
            reduce,
            send,
            recv,
            root,
        };
        check_call(self.rank, self.world.topology, req, seq)
    }

    /// Describes an in-place all-gather of `len` elements of `dtype` on `group` (takes a call
    /// number, like every call, so ranks stay in step after an identical bad call) and returns
    /// the call with the byte offset of this rank's own block in the buffer.
    fn describe_in_place(
        &self,
        group: Group,
        dtype: fsdp_types::DType,
        len: usize,
    ) -> Result<(CallDesc, usize), CommError> {
        let seq = self.next_seq(group);
        let call = check_in_place_call(self.rank, self.world.topology, group, dtype, len, seq)?;
        let own = self.world.topology.group_rank(group, self.rank)
            * call.send_numel
            * dtype.size_bytes() as usize;
        Ok((call, own))
    }

    fn run_sync(&self, call: CallDesc, send: usize, recv: usize) -> Result<(), CommError> {
        execute(&self.world, self.rank, call, send, recv)
    }

    /// Queues `job` on the progress thread (started on first use).
    fn submit(&self, call: CallDesc, job: Job) -> Result<PendingOp, CommError> {
        self.progress.submit(call, job)
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        let failed = std::thread::panicking();
        if failed {
            // Tell the peers first, so a started collective waiting for them fails fast.
            self.world.mark_exit(self.rank, true);
        }
        self.progress.shutdown();
        if !failed {
            self.world.mark_exit(self.rank, false);
        }
    }
}

/// Raw addresses of a borrowed buffer pair.
fn addrs(send: &Buf<'_>, recv: &mut BufMut<'_>) -> (usize, usize) {
    (send.as_ptr() as usize, recv.as_mut_ptr() as usize)
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn topology(&self) -> Topology {
        self.world.topology
    }

    fn backend_name(&self) -> &'static str {
        "threads"
    }

    fn all_gather(
        &self,
        group: Group,
        send: Buf<'_>,
        mut recv: BufMut<'_>,
    ) -> Result<(), CommError> {
        self.drain();
        let call = self.describe(
            OpKind::AllGather,
            group,
            None,
            (send.dtype(), send.len()),
            (recv.dtype(), recv.len()),
            None,
        )?;
        let (s, r) = addrs(&send, &mut recv);
        self.run_sync(call, s, r)
    }

    /// In place, without a copy: this rank posts its own block as its send buffer; peers read
    /// it while this rank fills the other blocks (disjoint ranges), and the own block is never
    /// copied onto itself. Matches peers' plain [`Communicator::all_gather`] of the same sizes.
    fn all_gather_in_place(&self, group: Group, mut buf: BufMut<'_>) -> Result<(), CommError> {
        self.drain();
        let (call, own) = self.describe_in_place(group, buf.dtype(), buf.len())?;
        let base = buf.as_mut_ptr() as usize;
        self.run_sync(call, base + own, base)
    }

    fn reduce_scatter(
        &self,
        group: Group,
        op: ReduceOp,
        send: Buf<'_>,
        mut recv: BufMut<'_>,
    ) -> Result<(), CommError> {
        self.drain();
        let call = self.describe(
            OpKind::ReduceScatter,
            group,
            Some(op),
            (send.dtype(), send.len()),
            (recv.dtype(), recv.len()),
            None,
        )?;
        let (s, r) = addrs(&send, &mut recv);
        self.run_sync(call, s, r)
    }

    fn all_reduce(&self, group: Group, op: ReduceOp, mut buf: BufMut<'_>) -> Result<(), CommError> {
        self.drain();
        let d = (buf.dtype(), buf.len());
        let call = self.describe(OpKind::AllReduce, group, Some(op), d, d, None)?;
        let p = buf.as_mut_ptr() as usize;
        self.run_sync(call, p, p)
    }

    fn broadcast(&self, group: Group, root: usize, mut buf: BufMut<'_>) -> Result<(), CommError> {
        self.drain();
        let d = (buf.dtype(), buf.len());
        let call = self.describe(OpKind::Broadcast, group, None, d, d, Some(root))?;
        let p = buf.as_mut_ptr() as usize;
        self.run_sync(call, p, p)
    }

    fn barrier(&self, group: Group) -> Result<(), CommError> {
        self.drain();
        let d = (fsdp_types::DType::F32, 0);
        let call = self.describe(OpKind::Barrier, group, None, d, d, None)?;
        self.run_sync(call, 0, 0)
    }

    fn start_all_gather(
        &self,
        group: Group,
        send: OwnedBuf,
        mut recv: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        let (s, r) = host_pair(self.rank, OpKind::AllGather, "threads", &send, &mut recv)?;
        let call = self.describe(
            OpKind::AllGather,
            group,
            None,
            (send.dtype(), send.len()),
            (recv.dtype(), recv.len()),
            None,
        )?;
        let world = self.world.clone();
        let rank = self.rank;
        self.submit(
            call,
            Box::new(move || {
                execute(&world, rank, call, s, r)?;
                Ok(Completed {
                    send: Some(send),
                    buf: recv,
                })
            }),
        )
    }

    /// Queued on this rank's progress thread like the other started calls; in place as
    /// [`ThreadComm::all_gather_in_place`]. `wait` hands `buf` back (`send` is `None`).
    fn start_all_gather_in_place(
        &self,
        group: Group,
        mut buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        let base = buf.host_addr_mut(self.rank, OpKind::AllGather, "threads")?;
        let (call, own) = self.describe_in_place(group, buf.dtype(), buf.len())?;
        let world = self.world.clone();
        let rank = self.rank;
        self.submit(
            call,
            Box::new(move || {
                execute(&world, rank, call, base + own, base)?;
                Ok(Completed { send: None, buf })
            }),
        )
    }

    fn start_reduce_scatter(
        &self,
        group: Group,
        op: ReduceOp,
        send: OwnedBuf,
        mut recv: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        let (s, r) = host_pair(
            self.rank,
            OpKind::ReduceScatter,
            "threads",
            &send,
            &mut recv,
        )?;
        let call = self.describe(
            OpKind::ReduceScatter,
            group,
            Some(op),
            (send.dtype(), send.len()),
            (recv.dtype(), recv.len()),
            None,
        )?;
        let world = self.world.clone();
        let rank = self.rank;
        self.submit(
            call,
            Box::new(move || {
                execute(&world, rank, call, s, r)?;
                Ok(Completed {
                    send: Some(send),
                    buf: recv,
                })
            }),
        )
    }

    fn start_all_reduce(
        &self,
        group: Group,
        op: ReduceOp,
        mut buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        let p = buf.host_addr_mut(self.rank, OpKind::AllReduce, "threads")?;
        let d = (buf.dtype(), buf.len());
        let call = self.describe(OpKind::AllReduce, group, Some(op), d, d, None)?;
        let world = self.world.clone();
        let rank = self.rank;
        self.submit(
            call,
            Box::new(move || {
                execute(&world, rank, call, p, p)?;
                Ok(Completed { send: None, buf })
            }),
        )
    }

    fn start_broadcast(
        &self,
        group: Group,
        root: usize,
        mut buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        let p = buf.host_addr_mut(self.rank, OpKind::Broadcast, "threads")?;
        let d = (buf.dtype(), buf.len());
        let call = self.describe(OpKind::Broadcast, group, None, d, d, Some(root))?;
        let world = self.world.clone();
        let rank = self.rank;
        self.submit(
            call,
            Box::new(move || {
                execute(&world, rank, call, p, p)?;
                Ok(Completed { send: None, buf })
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The streaming paths (all-gather blocks, the reduce-scatter output, the all-reduce
    /// gather phase) give the same bytes as ordinary stores: per shard length `n` (odd, so
    /// blocks start at every alignment) a world of 3 ranks streaming from `8n` bytes, so every
    /// collective streams (blocks of 70,001 f32 run whole interleaved four-page sets), against
    /// the reference values.
    #[test]
    fn streaming_all_gather_and_all_reduce_are_exact() {
        let topo = Topology::fully_sharded(3).unwrap();
        let v = |r: usize, i: usize| (r * 100_003 + i * 7) as f32;
        for n in [0usize, 1, 13, 1001, 70_001] {
            let comms =
                communicators_streaming_from(topo, DEFAULT_TIMEOUT, (8 * n).max(1)).unwrap();
            std::thread::scope(|s| {
                for c in comms {
                    s.spawn(move || {
                        let mine: Vec<f32> = (0..n).map(|i| v(c.rank(), i)).collect();
                        let mut all = vec![0.0f32; 3 * n];
                        c.all_gather(Group::World, (&mine).into(), (&mut all).into())
                            .unwrap();
                        for r in 0..3 {
                            for i in 0..n {
                                assert_eq!(all[r * n + i], v(r, i), "n={n} block {r} elem {i}");
                            }
                        }
                        let mut inplace = vec![-1.0f32; 3 * n];
                        inplace[c.rank() * n..(c.rank() + 1) * n].copy_from_slice(&mine);
                        c.all_gather_in_place(Group::World, (&mut inplace).into())
                            .unwrap();
                        assert_eq!(inplace, all);
                        let send: Vec<f32> = (0..3 * n).map(|i| v(c.rank(), i)).collect();
                        let mut shard = vec![0.0f32; n];
                        c.reduce_scatter(
                            Group::World,
                            ReduceOp::Sum,
                            (&send).into(),
                            (&mut shard).into(),
                        )
                        .unwrap();
                        for (i, &s) in shard.iter().enumerate() {
                            let e = c.rank() * n + i;
                            assert_eq!(s, (v(0, e) + v(1, e)) + v(2, e), "n={n} elem {i}");
                        }
                        let mut x: Vec<f32> = (0..3 * n).map(|i| v(c.rank(), i)).collect();
                        c.all_reduce(Group::World, ReduceOp::Sum, (&mut x).into())
                            .unwrap();
                        for (i, &xi) in x.iter().enumerate() {
                            assert_eq!(xi, (v(0, i) + v(1, i)) + v(2, i), "n={n} elem {i}");
                        }
                    });
                }
            });
        }
    }
}

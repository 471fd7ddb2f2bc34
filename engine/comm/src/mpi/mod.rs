//! The MPI backend (feature `mpi`): one rank per process, started by `mpirun -n W` or `srun`,
//! over the system MPI library (Open MPI) through rsmpi (`mpi` 0.8).
//!
//! # Groups
//! The ranks `0..W` of the MPI job (or of its first `W` processes, see
//! [`MpiComm::split_world`]) form the world; the shard and replicate groups of the [`Topology`]
//! are MPI sub-communicators made with `MPI_Comm_split` (shard: colour `rank / S`, key
//! `rank % S`; replicate: colour `rank % S`, key `rank / S`), so an MPI group rank equals
//! [`Topology::group_rank`].
//!
//! # One collective
//! 1. **Header rendezvous** (checked, abortable): the call agreement shared with the NCCL
//!    backend (`agreement.rs`, encodings in `codec.rs`), over this transport. Every group
//!    member sends its [`CallDesc`]
//!    (8 x u64: collective, group, reduction, dtype, element counts, root, per-group call
//!    number) to every other member (`MPI_Isend`/`MPI_Irecv`, tag 1 on the group communicator)
//!    and polls with `MPI_Test` until it holds all of them. Meanwhile it polls a control
//!    communicator for abort and exit notices from any rank of the world. It returns
//!    [`CommError::MismatchedCalls`] when the headers differ (every member sees the same
//!    headers, so every member reports the same calls), [`CommError::PeerExited`] when a
//!    missing member dropped its communicator with fewer calls on this group,
//!    [`CommError::PeerFailed`] (or the peer's own error) on an abort notice, and
//!    [`CommError::Timeout`] naming the missing members after the timeout. Any such error aborts
//!    this rank's world (later calls return it) and is sent to every other rank as an abort
//!    notice, so nobody waits for the timeout twice. Unmatched receives are cancelled
//!    (`MPI_Cancel`), so no buffer is written after the call returned. A barrier is exactly this
//!    phase: nobody leaves before every member arrived.
//! 2. **Data phase** (blocking MPI collectives on the group communicator, only after every
//!    member's header matched, so every member is inside the same call):
//!    * all-gather: `MPI_Allgather` with `MPI_IN_PLACE` on every member, straight into the
//!      caller's buffer: an in-place call ([`Communicator::all_gather_in_place`]) already holds
//!      its shard in its block; a plain call first copies its send buffer into its own block
//!      of the receive buffer (the copy MPI itself makes for a separate send buffer). Every
//!      member passes `MPI_IN_PLACE` because the MPI standard (4.1, section 6.7) requires it
//!      at all processes or none, and in-place and plain ranks form one collective here. With
//!      an MPI library whose `MPI_IN_PLACE` value is not known (see
//!      [`MpiUniverse::in_place_sentinel`]) every member passes a send buffer instead (an
//!      in-place rank copies its block out first);
//!    * reduce-scatter: `MPI_Alltoall` of the `g` chunks into a staging buffer (group rank `i`
//!      receives chunk `i` of every member, in rank order), then the rank-order reduction of
//!      [`crate::reduce_in_rank_order`] (16-bit dtypes accumulated in f32, `Avg` = one division
//!      by `g`) into the caller's buffer;
//!    * all-reduce: the same reduce-scatter over near-equal chunks (`MPI_Alltoallv`), then
//!      `MPI_Allgatherv` of the reduced chunks (Rabenseifner's reduce-scatter + all-gather,
//!      Thakur, Rabenseifner and Gropp, IJHPCA 2005, section 4.4);
//!    * broadcast: `MPI_Bcast`.
//!
//!    A watchdog thread bounds the data phase by the same timeout: a collective whose peers
//!    were all present at the rendezvous can only stall if a peer died or stopped inside it,
//!    and an MPI collective cannot be cancelled, so the watchdog prints the call and aborts
//!    the process (exit status 134), which makes `mpirun`/`srun` end the job: an error exit,
//!    never a hang. (Open MPI also ends the whole job by itself when a process is killed.)
//!
//! # Why reductions are done by us, not by `MPI_Reduce_scatter`
//! MPI's reductions add in an algorithm-dependent order and cannot add bf16/f16 at all. Moving
//! the raw contributions with `MPI_Alltoall` and adding them locally in rank order makes every
//! result bit-identical to [`crate::ThreadComm`] (and across runs and world layouts), with
//! 16-bit values on the wire and f32 accumulation (bf16 reduction made training unstable at a
//! large world size: <https://github.com/pytorch/pytorch/issues/106395>). The bandwidth cost
//! is nil on the wire: each rank sends and receives `(g-1) x n` elements, the same as a ring or
//! pairwise reduce-scatter; the costs are a staging buffer of `g x n` elements per rank and the
//! local reduction of `g x n` elements (memory-bound, done by each rank for its own chunk only).
//! An all-reduce moves `2 (g-1)/g x N` elements per rank, again the bandwidth-optimal amount.
//!
//! # Started calls
//! `start_*` calls queue the collective on a per-communicator helper thread that runs them in
//! issue order (MPI initialised with `MPI_THREAD_SERIALIZED`; every MPI call of a communicator
//! happens under one mutex); a synchronous call first waits for the started ones. The engine's
//! compute overlaps the transfer because the helper thread, not the caller, drives MPI.

mod launcher;

pub use launcher::MpiLauncher;

use crate::agreement::{self, Peers, Transport};
use crate::buf::{Buf, BufMut, OwnedBuf};
use crate::codec::{self, Descriptor};
use crate::comm::{
    check_call, check_in_place_call, host_pair, CallRequest, Communicator, Completed, PendingOp,
};
use crate::error::{CallDesc, CommError, OpKind};
use crate::progress::{Job, ProgressQueue};
use crate::reduce::reduce_dyn;
use crate::topology::{Group, ReduceOp, Topology};
use fsdp_types::DType;
use mpi::ffi;
use std::cell::Cell;
use std::os::raw::{c_int, c_void};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const TAG_HEADER: c_int = 1;
const TAG_ABORT: c_int = 2;
const TAG_EXIT: c_int = 3;

/// The initialised MPI library of this process: create one with [`MpiUniverse::init`], keep
/// it (an `Arc`) while any [`MpiComm`] lives; MPI is finalised when the last clone is dropped.
pub struct MpiUniverse {
    universe: mpi::environment::Universe,
    rank: usize,
    size: usize,
    in_place: Option<usize>,
}

// SAFETY: the universe only finalises MPI on drop; MPI is initialised with
// MPI_THREAD_SERIALIZED and the communicators serialise their MPI calls.
unsafe impl Send for MpiUniverse {}
// SAFETY: as above; the shared accessors only read plain integers.
unsafe impl Sync for MpiUniverse {}

impl std::fmt::Debug for MpiUniverse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiUniverse")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl MpiUniverse {
    /// Initialises MPI (`MPI_Init_thread`, `MPI_THREAD_SERIALIZED`) and reads this process's
    /// rank and the job's size from `MPI_COMM_WORLD`.
    ///
    /// Errors: [`CommError::Unsupported`] if MPI was already initialised in this process or
    /// the library cannot serialise calls from several threads.
    pub fn init() -> Result<Arc<MpiUniverse>, CommError> {
        let (universe, provided) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or_else(|| CommError::Unsupported {
                backend: "mpi",
                what: "MPI is already initialised in this process (MpiUniverse::init may be \
                           called once)"
                    .into(),
            })?;
        if provided < mpi::Threading::Serialized {
            return Err(CommError::Unsupported {
                backend: "mpi",
                what: format!(
                    "the MPI library provides thread level {provided:?}; MPI_THREAD_SERIALIZED is \
                     needed for started collectives"
                ),
            });
        }
        let world = unsafe { ffi::RSMPI_COMM_WORLD };
        let (mut rank, mut size) = (0 as c_int, 0 as c_int);
        // SAFETY: MPI is initialised; the out-pointers are valid.
        unsafe {
            ffi::MPI_Comm_rank(world, &mut rank);
            ffi::MPI_Comm_size(world, &mut size);
        }
        let in_place = in_place_for(&mpi::environment::library_version().unwrap_or_default());
        Ok(Arc::new(MpiUniverse {
            universe,
            rank: rank as usize,
            size: size as usize,
            in_place,
        }))
    }

    /// This process's rank in `MPI_COMM_WORLD`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of processes of the MPI job (`MPI_COMM_WORLD` size).
    pub fn size(&self) -> usize {
        self.size
    }

    /// The address value of the library's `MPI_IN_PLACE` (a C macro the bindings cannot
    /// export): `1` for Open MPI (`(void *) 1` in its `mpi.h`), `usize::MAX` for MPICH and its
    /// derivatives Intel MPI and MVAPICH (`(void *) -1`), `None` for another library, which
    /// then gathers with separate send buffers.
    pub fn in_place_sentinel(&self) -> Option<usize> {
        self.in_place
    }

    /// The MPI library's version string (e.g. `Open MPI v4.1.4, ...`).
    pub fn library_version(&self) -> String {
        mpi::environment::library_version().unwrap_or_else(|_| "unknown".into())
    }

    /// Ends every process of the job with exit status `code` (`MPI_Abort` on
    /// `MPI_COMM_WORLD`): for a rank that failed, so its peers never wait for it.
    pub fn abort(&self, code: i32) -> ! {
        // SAFETY: MPI is initialised; MPI_Abort does not return.
        unsafe { ffi::MPI_Abort(self.world_handle(), code as c_int) };
        std::process::exit(code)
    }

    pub(crate) fn world_handle(&self) -> ffi::MPI_Comm {
        let _ = &self.universe;
        unsafe { ffi::RSMPI_COMM_WORLD }
    }
}

/// `MPI_IN_PLACE` of the library whose `MPI_Get_library_version` string is `version` (see
/// [`MpiUniverse::in_place_sentinel`]).
fn in_place_for(version: &str) -> Option<usize> {
    let v = version.trim_start();
    if v.starts_with("Open MPI") {
        Some(1)
    } else if v.starts_with("MPICH") || v.starts_with("Intel(R) MPI") || v.starts_with("MVAPICH") {
        Some(usize::MAX)
    } else {
        None
    }
}

/// A raw MPI handle that may move between threads (used only under [`Core`]'s mutex).
#[derive(Clone, Copy)]
struct Handle(ffi::MPI_Comm);
// SAFETY: MPI handles are plain identifiers; all use is serialised by the Core mutex.
unsafe impl Send for Handle {}

/// Everything one rank's MPI calls touch; always used under the mutex of [`MpiComm`].
struct Core {
    rank: usize,
    topology: Topology,
    timeout: Duration,
    /// Communicators of the world, shard and replicate groups (indexed by `Group as usize`).
    comms: [Handle; 3],
    /// Abort and exit notices travel here, never mixed with collective traffic.
    control: Handle,
    /// The error that aborted this rank's world (later calls return it) and the peers' exit
    /// notices.
    peers: Peers,
    /// Abort / exit notices in flight (request, payload kept alive until sent).
    notices: Vec<(ffi::MPI_Request, Vec<u8>)>,
    /// Staging for reductions (u64 words so every dtype is aligned).
    stage: Vec<u64>,
    /// The library's `MPI_IN_PLACE` ([`MpiUniverse::in_place_sentinel`]).
    in_place: Option<usize>,
    watchdog: Arc<Watchdog>,
}

// SAFETY: raw handles and requests are identifiers; Core is only used under its mutex.
unsafe impl Send for Core {}

fn mpi_dtype(d: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading the predefined datatype handles exported by the MPI library.
    unsafe {
        match d {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::BF16 | DType::F16 => ffi::RSMPI_UINT16_T,
        }
    }
}

/// First element of chunk `i` when `n` elements are cut into `g` near-equal chunks.
fn chunk_start(n: usize, g: usize, i: usize) -> usize {
    (n / g) * i + i.min(n % g)
}

fn count(n: usize, call: &CallDesc) -> Result<c_int, CommError> {
    c_int::try_from(n).map_err(|_| CommError::Unsupported {
        backend: "mpi",
        what: format!(
            "{call}: {n} elements exceed the MPI count limit of {} per message",
            c_int::MAX
        ),
    })
}

fn status_zeroed() -> ffi::MPI_Status {
    // SAFETY: MPI_Status is a plain C struct of integers.
    unsafe { std::mem::zeroed() }
}

fn request_null() -> ffi::MPI_Request {
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// Backs off while polling: yield for the first rounds, then sleep briefly.
fn backoff(round: &mut u32) {
    *round += 1;
    if *round < 64 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(if *round < 1000 { 20 } else { 200 }));
    }
}

impl Core {
    fn comm(&self, g: Group) -> ffi::MPI_Comm {
        self.comms[codec::group_code(g) as usize].0
    }

    /// Sends `payload` with `tag` to every other rank of the world on the control communicator.
    fn notify_all(&mut self, tag: c_int, payload: Vec<u8>) {
        for peer in 0..self.topology.world_size {
            if peer == self.rank {
                continue;
            }
            let p = payload.clone();
            let mut req = request_null();
            // SAFETY: `p` stays alive in `notices` until the send completed (or forever).
            unsafe {
                ffi::MPI_Isend(
                    p.as_ptr() as *const c_void,
                    p.len() as c_int,
                    ffi::RSMPI_UINT8_T,
                    peer as c_int,
                    tag,
                    self.control.0,
                    &mut req,
                );
            }
            self.notices.push((req, p));
        }
        self.reap_notices();
    }

    /// Drops the notices whose sends completed.
    fn reap_notices(&mut self) {
        self.notices.retain_mut(|(req, _)| {
            let mut flag: c_int = 0;
            // SAFETY: `req` is an active send request owned here.
            unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
            flag == 0
        });
    }

    /// Records `e` as this world's abort reason and tells every other rank.
    fn abort_with(&mut self, e: CommError) -> CommError {
        if self.peers.abort(&e) {
            let mut w = codec::Writer::default();
            codec::encode_error(&e, &mut w);
            self.notify_all(TAG_ABORT, w.0);
        }
        e
    }

    /// Receives every pending control notice; returns the abort error if one arrived (or the
    /// world was aborted before).
    fn poll_control(&mut self) -> Result<(), CommError> {
        loop {
            let mut flag: c_int = 0;
            let mut st = status_zeroed();
            // SAFETY: valid out-pointers; the control communicator is alive.
            unsafe {
                ffi::MPI_Iprobe(
                    ffi::RSMPI_ANY_SOURCE,
                    ffi::RSMPI_ANY_TAG,
                    self.control.0,
                    &mut flag,
                    &mut st,
                )
            };
            if flag == 0 {
                break;
            }
            let mut n: c_int = 0;
            unsafe { ffi::MPI_Get_count(&st, ffi::RSMPI_UINT8_T, &mut n) };
            let mut buf = vec![0u8; n.max(0) as usize];
            // SAFETY: the probed message has exactly `n` bytes.
            unsafe {
                ffi::MPI_Recv(
                    buf.as_mut_ptr() as *mut c_void,
                    n,
                    ffi::RSMPI_UINT8_T,
                    st.MPI_SOURCE,
                    st.MPI_TAG,
                    self.control.0,
                    ffi::RSMPI_STATUS_IGNORE,
                )
            };
            let peer = st.MPI_SOURCE as usize;
            match st.MPI_TAG {
                TAG_EXIT => self.peers.exit_notice(peer, &buf),
                // Not re-broadcast: the sender told every rank itself.
                _ => self.peers.abort_notice(peer, &buf),
            }
        }
        self.peers.aborted()
    }
}

/// Phase 1 of a collective (see the module docs): the descriptors travel point to point on the
/// group communicator (tag [`TAG_HEADER`]) while the control communicator is polled for notices.
impl Transport for Core {
    fn exchange(
        &mut self,
        call: &CallDesc,
        mine: &Descriptor,
    ) -> Result<Vec<Descriptor>, CommError> {
        let members = self.topology.group_members(call.group, self.rank);
        let g = members.len();
        let gr = self.topology.group_rank(call.group, self.rank);
        let comm = self.comm(call.group);
        let mine: Box<Descriptor> = Box::new(*mine);
        let mut theirs = vec![[0u64; codec::CALL_WORDS]; g];
        theirs[gr] = *mine;
        let mut recvs = vec![request_null(); g];
        let mut sends = vec![request_null(); g];
        let mut got = vec![false; g];
        got[gr] = true;
        let mut sent_done = vec![false; g];
        sent_done[gr] = true;
        let u64t = unsafe { ffi::RSMPI_UINT64_T };
        for j in (0..g).filter(|&j| j != gr) {
            // SAFETY: `theirs[j]` and `mine` outlive the requests: receives are completed or
            // cancelled before return, unfinished sends are leaked with their buffer below.
            unsafe {
                ffi::MPI_Irecv(
                    theirs[j].as_mut_ptr() as *mut c_void,
                    codec::CALL_WORDS as c_int,
                    u64t,
                    j as c_int,
                    TAG_HEADER,
                    comm,
                    &mut recvs[j],
                );
                ffi::MPI_Isend(
                    mine.as_ptr() as *const c_void,
                    codec::CALL_WORDS as c_int,
                    u64t,
                    j as c_int,
                    TAG_HEADER,
                    comm,
                    &mut sends[j],
                );
            }
        }
        let start = Instant::now();
        let mut round = 0u32;
        let outcome: Result<(), CommError> = loop {
            for j in 0..g {
                let mut flag: c_int = 0;
                if !got[j] {
                    unsafe { ffi::MPI_Test(&mut recvs[j], &mut flag, ffi::RSMPI_STATUS_IGNORE) };
                    got[j] = flag != 0;
                }
                if !sent_done[j] {
                    unsafe { ffi::MPI_Test(&mut sends[j], &mut flag, ffi::RSMPI_STATUS_IGNORE) };
                    sent_done[j] = flag != 0;
                }
            }
            if got.iter().all(|&x| x) {
                break Ok(());
            }
            if let Err(e) = self.poll_control() {
                break Err(e);
            }
            let missing: Vec<usize> = (0..g).filter(|&j| !got[j]).map(|j| members[j]).collect();
            if let Err(e) = self
                .peers
                .check_wait(self.rank, call, &missing, start, self.timeout)
            {
                break Err(self.abort_with(e));
            }
            backoff(&mut round);
        };
        if outcome.is_err() {
            for j in 0..g {
                if !got[j] {
                    // SAFETY: cancelling our own receive; MPI_Wait completes it (cancelled or
                    // matched) so `theirs` is never written after this function returns.
                    unsafe {
                        ffi::MPI_Cancel(&mut recvs[j]);
                        ffi::MPI_Wait(&mut recvs[j], ffi::RSMPI_STATUS_IGNORE);
                    }
                }
            }
        }
        // Finish the header sends; a send a vanished peer never takes is released to complete
        // on its own, and its 64-byte buffer is leaked so MPI may still read it.
        let mut leak = false;
        let send_deadline = Instant::now() + Duration::from_millis(100);
        while sent_done.iter().any(|&d| !d) && Instant::now() < send_deadline {
            for j in 0..g {
                if !sent_done[j] {
                    let mut flag: c_int = 0;
                    unsafe { ffi::MPI_Test(&mut sends[j], &mut flag, ffi::RSMPI_STATUS_IGNORE) };
                    sent_done[j] = flag != 0;
                }
            }
            std::thread::yield_now();
        }
        for j in 0..g {
            if !sent_done[j] {
                unsafe { ffi::MPI_Request_free(&mut sends[j]) };
                leak = true;
            }
        }
        if leak {
            std::mem::forget(mine);
        }
        outcome?;
        // An abort notice sent before the last header arrived (a peer that gave up on this call)
        // is honoured even though the headers are complete.
        self.poll_control()?;
        Ok(theirs)
    }

    /// A disagreement aborts the world: every peer gets the error as an abort notice.
    fn disagreed(&mut self, e: CommError) -> CommError {
        self.abort_with(e)
    }
}

impl Core {
    /// Runs one collective: rendezvous, then the data phase (see the module docs).
    ///
    /// SAFETY contract: `send` is valid for reads of `call.send_numel` elements and `recv` for
    /// reads and writes of `call.recv_numel` elements of `call.dtype` until this returns. An
    /// all-gather's `send` may be block `group rank` of `recv` (in place); no other overlap.
    fn execute(&mut self, call: CallDesc, send: usize, recv: usize) -> Result<(), CommError> {
        self.poll_control()?;
        agreement::agree(self, self.topology, self.rank, &call)?;
        let Some(dtype) = call.dtype else {
            return Ok(()); // barrier: the rendezvous is the barrier
        };
        let g = self.topology.group_size(call.group);
        let gr = self.topology.group_rank(call.group, self.rank);
        let es = dtype.size_bytes() as usize;
        let comm = self.comm(call.group);
        let t = mpi_dtype(dtype);
        let send = send as *mut u8;
        let recv = recv as *mut u8;
        match call.op {
            OpKind::Barrier => Ok(()),
            OpKind::AllGather => {
                let n = call.send_numel;
                if n == 0 {
                    return Ok(());
                }
                let c = count(n, &call)?;
                count(n * g, &call)?;
                let bytes = n * es;
                // SAFETY: block `gr` lies inside `recv` (g x n elements).
                let own = unsafe { recv.add(gr * bytes) };
                let in_place = send == own;
                let src: *const u8 = match self.in_place {
                    Some(sentinel) => {
                        if !in_place {
                            // SAFETY: a plain call's send buffer (n elements) is disjoint from
                            // its receive buffer; block `gr` is ours to write.
                            unsafe { std::ptr::copy_nonoverlapping(send, own, bytes) };
                        }
                        sentinel as *const u8
                    }
                    None if in_place => {
                        let stage = self.stage_ptr(bytes);
                        // SAFETY: the stage holds `bytes` bytes and is not the caller's buffer.
                        unsafe { std::ptr::copy_nonoverlapping(own, stage, bytes) };
                        stage
                    }
                    None => send,
                };
                self.guarded(&call, || unsafe {
                    ffi::MPI_Allgather(src as *const c_void, c, t, recv as *mut c_void, c, t, comm);
                });
                Ok(())
            }
            OpKind::ReduceScatter => {
                let n = call.recv_numel;
                if n == 0 {
                    return Ok(());
                }
                let op = call.reduce.unwrap_or(ReduceOp::Sum);
                if g == 1 {
                    // SAFETY: per the contract; one input, distinct output.
                    unsafe { reduce_dyn(dtype, &[send as *const u8], recv, n, op) };
                    return Ok(());
                }
                let c = count(n, &call)?;
                count(n * g, &call)?;
                let stage = self.stage_ptr(n * g * es);
                self.guarded(&call, || unsafe {
                    ffi::MPI_Alltoall(
                        send as *const c_void,
                        c,
                        t,
                        stage as *mut c_void,
                        c,
                        t,
                        comm,
                    );
                });
                let inputs: Vec<*const u8> = (0..g)
                    .map(|j| unsafe { stage.add(j * n * es) } as *const u8)
                    .collect();
                // SAFETY: the stage holds g x n elements; `recv` holds n and is distinct.
                unsafe { reduce_dyn(dtype, &inputs, recv, n, op) };
                Ok(())
            }
            OpKind::AllReduce => {
                let n = call.recv_numel;
                if n == 0 || g == 1 {
                    // One contribution: the rank-order reduction is the identity (x, x/1).
                    return Ok(());
                }
                let op = call.reduce.unwrap_or(ReduceOp::Sum);
                count(n, &call)?;
                let starts: Vec<c_int> = (0..g).map(|j| chunk_start(n, g, j) as c_int).collect();
                let lens: Vec<c_int> = (0..g)
                    .map(|j| (chunk_start(n, g, j + 1) - chunk_start(n, g, j)) as c_int)
                    .collect();
                let mine = lens[gr] as usize;
                let rcounts = vec![mine as c_int; g];
                let rdispls: Vec<c_int> = (0..g).map(|j| (j * mine) as c_int).collect();
                let stage = self.stage_ptr((g + 1) * mine * es);
                let reduced = unsafe { stage.add(g * mine * es) };
                self.guarded(&call, || unsafe {
                    ffi::MPI_Alltoallv(
                        recv as *const c_void,
                        lens.as_ptr(),
                        starts.as_ptr(),
                        t,
                        stage as *mut c_void,
                        rcounts.as_ptr(),
                        rdispls.as_ptr(),
                        t,
                        comm,
                    );
                });
                let inputs: Vec<*const u8> = (0..g)
                    .map(|j| unsafe { stage.add(j * mine * es) } as *const u8)
                    .collect();
                // SAFETY: the stage holds (g + 1) x mine elements; the output is its last chunk.
                unsafe { reduce_dyn(dtype, &inputs, reduced, mine, op) };
                self.guarded(&call, || unsafe {
                    ffi::MPI_Allgatherv(
                        reduced as *const c_void,
                        mine as c_int,
                        t,
                        recv as *mut c_void,
                        lens.as_ptr(),
                        starts.as_ptr(),
                        t,
                        comm,
                    );
                });
                Ok(())
            }
            OpKind::Broadcast => {
                let n = call.recv_numel;
                if n == 0 || g == 1 {
                    return Ok(());
                }
                let c = count(n, &call)?;
                let root = call.root.unwrap_or(0) as c_int;
                self.guarded(&call, || unsafe {
                    ffi::MPI_Bcast(recv as *mut c_void, c, t, root, comm);
                });
                Ok(())
            }
        }
    }

    /// A staging area of at least `bytes` bytes, 8-byte aligned.
    fn stage_ptr(&mut self, bytes: usize) -> *mut u8 {
        let words = bytes.div_ceil(8);
        if self.stage.len() < words {
            self.stage = vec![0u64; words];
        }
        self.stage.as_mut_ptr() as *mut u8
    }

    /// Runs a blocking data-phase MPI call under the watchdog.
    fn guarded(&self, call: &CallDesc, f: impl FnOnce()) {
        self.watchdog.arm(self.rank, *call, self.timeout);
        f();
        self.watchdog.disarm();
    }
}

/// Bounds blocking data-phase collectives: aborts the process when one outlives the timeout.
struct Watchdog {
    state: Mutex<WatchState>,
    cv: Condvar,
}

struct WatchState {
    armed: Option<(Instant, usize, CallDesc, Duration)>,
    stop: bool,
}

impl Watchdog {
    fn spawn() -> Result<(Arc<Watchdog>, JoinHandle<()>), CommError> {
        let w = Arc::new(Watchdog {
            state: Mutex::new(WatchState {
                armed: None,
                stop: false,
            }),
            cv: Condvar::new(),
        });
        let w2 = w.clone();
        let h = std::thread::Builder::new()
            .name("fsdp-mpi-watchdog".into())
            .spawn(move || w2.run())
            .map_err(|e| CommError::Unsupported {
                backend: "mpi",
                what: format!("cannot spawn the watchdog thread: {e}"),
            })?;
        Ok((w, h))
    }

    fn lock(&self) -> MutexGuard<'_, WatchState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn arm(&self, rank: usize, call: CallDesc, timeout: Duration) {
        self.lock().armed = Some((Instant::now() + timeout, rank, call, timeout));
        self.cv.notify_all();
    }

    fn disarm(&self) {
        self.lock().armed = None;
    }

    fn stop(&self) {
        self.lock().stop = true;
        self.cv.notify_all();
    }

    fn run(&self) {
        let mut st = self.lock();
        loop {
            if st.stop {
                return;
            }
            match st.armed {
                None => st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
                Some((deadline, rank, call, timeout)) => {
                    let now = Instant::now();
                    if now >= deadline {
                        // Not `eprintln!`: with stderr closed it would panic this thread
                        // instead of ending the process.
                        use std::io::Write as _;
                        let _ = writeln!(
                            std::io::stderr(),
                            "fsdp-comm mpi: rank {rank}: {call} did not complete within {} ms \
                             after every peer joined it: a peer died or stopped inside the \
                             collective; aborting this process so the job ends",
                            timeout.as_millis()
                        );
                        std::process::abort();
                    }
                    st = self
                        .cv
                        .wait_timeout(st, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
    }
}

/// One rank of an MPI world: implements [`Communicator`] over MPI communicators (see the module
/// docs for the protocol).
///
/// Create it with [`MpiComm::world`] (every process of the job is a rank) or
/// [`MpiComm::split_world`] (the first `W` processes). Dropping it finishes the started calls,
/// tells every peer how many calls it made (so a peer waiting for it gets
/// [`CommError::PeerExited`] rather than a timeout) and frees its communicators.
pub struct MpiComm {
    core: Arc<Mutex<Core>>,
    rank: usize,
    topology: Topology,
    seq: Cell<[u64; 3]>,
    progress: ProgressQueue,
    watchdog: Option<JoinHandle<()>>,
    universe: Arc<MpiUniverse>,
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("topology", &self.topology)
            .finish()
    }
}

impl MpiComm {
    /// The communicator of this process in a world of every process of the MPI job:
    /// `topology.world_size` must equal the job size, this rank is the `MPI_COMM_WORLD` rank.
    /// Collective over `MPI_COMM_WORLD`. `timeout` bounds every wait for peers (use
    /// [`crate::DEFAULT_TIMEOUT`], 60 s).
    ///
    /// Errors: [`CommError::InvalidTopology`] if the topology is invalid or its world size is
    /// not the number of processes (the reason says so; the numbers are in the error).
    pub fn world(
        universe: &Arc<MpiUniverse>,
        topology: Topology,
        timeout: Duration,
    ) -> Result<MpiComm, CommError> {
        if topology.world_size != universe.size() {
            return Err(CommError::InvalidTopology {
                world_size: topology.world_size,
                shard_size: topology.shard_size,
                replicate_size: topology.replicate_size,
                reason: "the world size must equal the number of MPI processes (mpirun -n)",
            });
        }
        Ok(MpiComm::split_world(universe, topology, timeout)?
            .expect("every process of the job is a rank when W equals the job size"))
    }

    /// Builds a world of `topology` from the first `topology.world_size` processes of the job
    /// (world rank = `MPI_COMM_WORLD` rank); the other processes get `None`. Collective over
    /// `MPI_COMM_WORLD`: every process must call it with the same topology.
    ///
    /// Errors: [`CommError::InvalidTopology`] for an invalid topology or one larger than the
    /// job; [`CommError::Unsupported`] if a thread cannot be spawned.
    pub fn split_world(
        universe: &Arc<MpiUniverse>,
        topology: Topology,
        timeout: Duration,
    ) -> Result<Option<MpiComm>, CommError> {
        topology.validate()?;
        if topology.world_size > universe.size() {
            return Err(CommError::InvalidTopology {
                world_size: topology.world_size,
                shard_size: topology.shard_size,
                replicate_size: topology.replicate_size,
                reason: "the world size exceeds the number of MPI processes (mpirun -n)",
            });
        }
        let me = universe.rank();
        let w = topology.world_size;
        let job = universe.world_handle();
        let undefined = unsafe { ffi::RSMPI_UNDEFINED };
        let mut lw: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: collective over the job's world; out-pointer valid.
        unsafe {
            ffi::MPI_Comm_split(
                job,
                if me < w { 0 } else { undefined },
                me as c_int,
                &mut lw,
            )
        };
        if me >= w {
            return Ok(None);
        }
        let s = topology.shard_size;
        let split = |color: usize, key: usize| {
            let mut c: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
            unsafe { ffi::MPI_Comm_split(lw, color as c_int, key as c_int, &mut c) };
            Handle(c)
        };
        let shard = split(me / s, me % s);
        let replicate = split(me % s, me / s);
        let mut control: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
        unsafe { ffi::MPI_Comm_dup(lw, &mut control) };
        let (watchdog, handle) = Watchdog::spawn()?;
        let core = Core {
            rank: me,
            topology,
            timeout,
            comms: [Handle(lw), shard, replicate],
            control: Handle(control),
            peers: Peers::new(w),
            notices: Vec::new(),
            stage: Vec::new(),
            in_place: universe.in_place_sentinel(),
            watchdog,
        };
        Ok(Some(MpiComm {
            core: Arc::new(Mutex::new(core)),
            rank: me,
            topology,
            seq: Cell::new([0; 3]),
            progress: ProgressQueue::new("mpi", me, format!("rank{me}-comm")),
            watchdog: Some(handle),
            universe: universe.clone(),
        }))
    }

    /// The universe this communicator belongs to.
    pub fn universe(&self) -> &Arc<MpiUniverse> {
        &self.universe
    }

    /// Marks this rank's world aborted with `error` and tells every peer (their waiting and
    /// later calls return `error`), e.g. when this rank's own code failed. Idempotent: the first
    /// error wins.
    pub fn fail(&self, error: CommError) {
        self.drain();
        let mut core = self.lock();
        core.abort_with(error);
    }

    fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn next_seq(&self, group: Group) -> u64 {
        let mut s = self.seq.get();
        let i = codec::group_code(group) as usize;
        let v = s[i];
        s[i] += 1;
        self.seq.set(s);
        v
    }

    fn describe(
        &self,
        op: OpKind,
        group: Group,
        reduce: Option<ReduceOp>,
        send: (DType, usize),
        recv: (DType, usize),
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
        check_call(self.rank, self.topology, req, seq)
    }

    /// Waits until every started collective of this rank has finished.
    fn drain(&self) {
        self.progress.drain();
    }

    fn run_sync(&self, call: CallDesc, send: usize, recv: usize) -> Result<(), CommError> {
        self.lock().execute(call, send, recv)
    }

    /// Describes an in-place all-gather of `len` elements of `dtype` on `group` (it takes a
    /// call number even when the length is wrong, as every call does) and returns the call and
    /// the byte offset of this rank's block.
    fn describe_in_place(
        &self,
        group: Group,
        dtype: DType,
        len: usize,
    ) -> Result<(CallDesc, usize), CommError> {
        let seq = self.next_seq(group);
        let call = check_in_place_call(self.rank, self.topology, group, dtype, len, seq)?;
        let own = self.topology.group_rank(group, self.rank)
            * call.send_numel
            * dtype.size_bytes() as usize;
        Ok((call, own))
    }

    fn submit(&self, call: CallDesc, job: Job) -> Result<PendingOp, CommError> {
        self.progress.submit(call, job)
    }

    /// Host addresses of a started call's buffers, checked before the call is described: the
    /// separate send buffer's (or `None` for an in-place call) and `buf`'s. Vectors and CPU
    /// tensors are used in place; a CUDA tensor is [`CommError::DeviceBufferUnreachable`].
    fn host_addrs(
        &self,
        op: OpKind,
        send: Option<&OwnedBuf>,
        buf: &mut OwnedBuf,
    ) -> Result<(Option<usize>, usize), CommError> {
        match send {
            Some(s) => host_pair(self.rank, op, "mpi", s, buf).map(|(s, r)| (Some(s), r)),
            None => buf.host_addr_mut(self.rank, op, "mpi").map(|r| (None, r)),
        }
    }

    /// Queues `call` on the progress thread. `send`: the separate send buffer, or `None` for an
    /// in-place call, whose send data starts `own` bytes into `buf`; `addrs`: their host
    /// addresses from [`MpiComm::host_addrs`].
    fn start_job(
        &self,
        call: CallDesc,
        send: Option<OwnedBuf>,
        buf: OwnedBuf,
        own: usize,
        addrs: (Option<usize>, usize),
    ) -> Result<PendingOp, CommError> {
        let core = self.core.clone();
        self.submit(
            call,
            Box::new(move || {
                let r = addrs.1;
                let s = addrs.0.unwrap_or(r + own);
                core.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .execute(call, s, r)?;
                Ok(Completed { send, buf })
            }),
        )
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        let failed = std::thread::panicking();
        if failed {
            self.lock().abort_with(CommError::PeerFailed {
                peer: self.rank,
                reason: "the rank panicked".into(),
            });
        }
        self.progress.shutdown();
        let seq = self.seq.get();
        let mut core = self.lock();
        core.notify_all(TAG_EXIT, codec::encode_exit(seq));
        // Give the notices a moment to leave (eager sends complete at once), then release them.
        let deadline = Instant::now() + Duration::from_millis(200);
        while !core.notices.is_empty() && Instant::now() < deadline {
            core.reap_notices();
            std::thread::yield_now();
        }
        for (mut req, payload) in std::mem::take(&mut core.notices) {
            unsafe { ffi::MPI_Request_free(&mut req) };
            std::mem::forget(payload);
        }
        // The communicators are not freed (MPI_Finalize releases them): Open MPI reuses a freed
        // context id for the next communicator and delivers notices still in flight for the
        // old one to the new one, which would corrupt a later world of the same process.
        core.watchdog.stop();
        drop(core);
        if let Some(h) = self.watchdog.take() {
            let _ = h.join();
        }
    }
}

fn addrs(send: &Buf<'_>, recv: &mut BufMut<'_>) -> (usize, usize) {
    (send.as_ptr() as usize, recv.as_mut_ptr() as usize)
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn topology(&self) -> Topology {
        self.topology
    }

    fn backend_name(&self) -> &'static str {
        "mpi"
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

    /// `MPI_Allgather` with `MPI_IN_PLACE` (see the module docs); no copy of the own block.
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
        let d = (DType::F32, 0);
        let call = self.describe(OpKind::Barrier, group, None, d, d, None)?;
        self.run_sync(call, 0, 0)
    }

    fn start_all_gather(
        &self,
        group: Group,
        send: OwnedBuf,
        mut recv: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        let a = self.host_addrs(OpKind::AllGather, Some(&send), &mut recv)?;
        let call = self.describe(
            OpKind::AllGather,
            group,
            None,
            (send.dtype(), send.len()),
            (recv.dtype(), recv.len()),
            None,
        )?;
        self.start_job(call, Some(send), recv, 0, a)
    }

    /// Queued on the progress thread; in place as [`MpiComm::all_gather_in_place`].
    fn start_all_gather_in_place(
        &self,
        group: Group,
        mut buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        let a = self.host_addrs(OpKind::AllGather, None, &mut buf)?;
        let (call, own) = self.describe_in_place(group, buf.dtype(), buf.len())?;
        self.start_job(call, None, buf, own, a)
    }

    fn start_reduce_scatter(
        &self,
        group: Group,
        op: ReduceOp,
        send: OwnedBuf,
        mut recv: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        let a = self.host_addrs(OpKind::ReduceScatter, Some(&send), &mut recv)?;
        let call = self.describe(
            OpKind::ReduceScatter,
            group,
            Some(op),
            (send.dtype(), send.len()),
            (recv.dtype(), recv.len()),
            None,
        )?;
        self.start_job(call, Some(send), recv, 0, a)
    }

    fn start_all_reduce(
        &self,
        group: Group,
        op: ReduceOp,
        mut buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        let a = self.host_addrs(OpKind::AllReduce, None, &mut buf)?;
        let d = (buf.dtype(), buf.len());
        let call = self.describe(OpKind::AllReduce, group, Some(op), d, d, None)?;
        self.start_job(call, None, buf, 0, a)
    }

    fn start_broadcast(
        &self,
        group: Group,
        root: usize,
        mut buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        let a = self.host_addrs(OpKind::Broadcast, None, &mut buf)?;
        let d = (buf.dtype(), buf.len());
        let call = self.describe(OpKind::Broadcast, group, None, d, d, Some(root))?;
        self.start_job(call, None, buf, 0, a)
    }
}

#[cfg(test)]
mod tests {
    use super::in_place_for;

    #[test]
    fn in_place_sentinel_by_library() {
        // Open MPI's mpi.h: `#define MPI_IN_PLACE ((void *) 1)`; MPICH's: `(void *) -1`.
        assert_eq!(
            in_place_for("Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4"),
            Some(1)
        );
        assert_eq!(
            in_place_for("MPICH Version:\t4.0.2\nMPICH Release date: ..."),
            Some(usize::MAX)
        );
        assert_eq!(
            in_place_for("Intel(R) MPI Library 2021.6"),
            Some(usize::MAX)
        );
        assert_eq!(in_place_for("Some Other MPI 1.0"), None);
    }
}

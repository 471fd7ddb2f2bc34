//! The NCCL backend (feature `cuda`): [`NcclComm`], one rank per process (or per GPU), NCCL
//! communicators over CUDA device memory, through cudarc's NCCL binding (NCCL 2.28 ABI).
//!
//! **Two faces.** As a [`Communicator`] it takes host buffers like every backend: each call
//! copies them to device memory on the communicator's stream, runs the NCCL operation, copies
//! the result back and waits (so the conformance suite runs unchanged). For the engine it has
//! device-buffer methods — [`NcclComm::all_gather_device`] (in place, into an engine-owned
//! buffer), [`NcclComm::reduce_scatter_device`], [`NcclComm::all_reduce_device`] — that only
//! enqueue work on the communicator's own CUDA stream after the producer stream's work (an event
//! wait, no host block) and return a [`DeviceOp`] whose CUDA event the consumer stream waits on
//! ([`DeviceOp::then`]): the next unit's all-gather runs while the current unit computes, a
//! unit's reduce-scatter while the next unit's backward computes.
//!
//! **Tensor buffers.** The started calls (`start_all_gather`, `start_all_gather_in_place`,
//! `start_reduce_scatter`, `start_all_reduce`, `start_broadcast`) take candle CUDA tensors
//! ([`crate::OwnedBuf::Tensor`] on this communicator's device) and use them in place on the
//! communicator's stream, ordered after the work candle already queued on the tensors' stream
//! (an event, no host block); `wait` orders candle's stream after the collective without
//! blocking the host (details in `tensor.rs`). Host buffers (vectors, CPU tensors) go the
//! staged way of the synchronous calls. One call takes all-device or all-host buffers.
//!
//! **Arithmetic.** With [`Reduction::RankOrder`] (the default) reductions are bit-identical to
//! the thread and MPI backends: contributions move with grouped `ncclSend`/`ncclRecv` (an
//! all-to-all of chunks: reduce-scatter sends `(g-1)/g` of the buffer per rank, as NCCL's ring
//! does) and a kernel adds them in rank order — f32/f64 in their type, bf16/f16 widened to f32
//! and rounded once (bf16 on the wire, f32 accumulation), `Avg` one division by the
//! group size after the sum, `Max` NaN-propagating. All-reduce gathers every
//! contribution (`(g-1)` buffers per rank, more than a ring's `2(g-1)/g` when g > 2) and reduces
//! locally, so every rank computes the same bits. [`Reduction::Nccl`] uses `ncclReduceScatter` /
//! `ncclAllReduce` with `ncclSum` / `ncclAvg` / `ncclMax` instead: fastest, but the order of the
//! additions is NCCL's (ring or tree, varies with W and size), and for bf16/f16 NCCL adds in the
//! 16-bit type: its device reduction `FuncSum<__nv_bfloat16>` returns a bf16 (`__hadd2` on
//! sm_80+, i.e. float add rounded to bf16) and ring partial sums travel as bf16, so a sum over
//! W ranks carries up to W-1 roundings to bf16 instead of one (in the conformance suite's bf16
//! check, up to 1.3 % off at W = 8); use it for f32 only, where the bound is NCCL's reassociation.
//!
//! **Errors, never hangs.** Communicators are non-blocking (see [`raw`]): every wait polls the
//! CUDA event and `ncclCommGetAsyncError` against [`NcclOptions::timeout`]. With
//! [`NcclOptions::check_calls`] every collective is preceded by the call agreement shared with
//! the MPI backend (`agreement.rs`): an all-gather of the call
//! descriptions (collective, group, reduction, dtype, sizes, root, call number), so ranks making
//! different calls get [`CommError::MismatchedCalls`] naming every rank's call instead of
//! corrupt data or a hang. A timeout aborts the communicators (`ncclCommAbort`) and returns
//! [`CommError::Timeout`]; NCCL cannot say which peer is late, so `missing` lists every other
//! member of the group. NCCL failures are [`CommError::Device`] with `ncclGetErrorString` and
//! `ncclGetLastError`'s text. After a failure every later call fails at once.
//!
//! **Groups.** The world communicator comes from the unique id ([`NcclId`], shared through the
//! rendezvous, [`crate::rendezvous`]); the shard and replicate groups are `ncclCommSplit`s of it
//! (colour = the group's first world rank, key = group rank), so group rank i is NCCL rank i.
//!
//! Every call binds the device context to the calling thread first (`cuCtxSetCurrent`), as a
//! communicator is used from the thread that calls it.

mod launcher;
pub(crate) mod raw;
mod reduce;
mod tensor;

pub use crate::reduce_launch::{REDUCE_NVRTC_OPTIONS, REDUCE_SOURCE};
pub use launcher::{NcclLauncher, NCCL_HOSTID_PER_RANK};

use crate::agreement::{self, Transport};
use crate::buf::{Buf, BufMut, Element, OwnedBuf};
use crate::codec::{self, Descriptor};
use crate::comm::{
    check_call, check_in_place_call, eager_start_all_gather, eager_start_all_gather_in_place,
    eager_start_all_reduce, eager_start_broadcast, eager_start_reduce_scatter, CallRequest,
    Communicator, PendingOp,
};
use crate::error::{CallDesc, CommError, OpKind};
use crate::reduce_launch::RankOrderSteps;
use crate::rendezvous::{LaunchEnv, Rendezvous};
use crate::topology::{Group, ReduceOp, Topology};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr,
    ValidAsZeroBits,
};
use cudarc::nccl::sys;
use fsdp_types::DType;
use half::{bf16, f16};
use raw::{cuda_error, grouped, RawComm, Unsettled};
use reduce::{Fold, Reducer};
use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Number of CUDA devices the driver sees, or why none can be used (no driver, no device): the
/// NCCL tests' skip rule.
pub fn device_count() -> Result<usize, String> {
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(n as usize),
        Ok(_) => Err("the CUDA driver reports 0 devices".into()),
        Err(e) => Err(cuda_error(0, "cuInit / cuDeviceGetCount", e).to_string()),
    }
}

/// NCCL's unique id (`ncclUniqueId`, 128 opaque bytes): created by rank 0, given to every rank
/// (the rendezvous carries it), names one communicator world.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({:02x?}..)", &self.0[..8])
    }
}

impl NcclId {
    /// A fresh id (`ncclGetUniqueId`; NCCL picks a bootstrap address of this host).
    ///
    /// Errors: [`CommError::Device`] with NCCL's text (e.g. no usable network interface).
    pub fn new(rank: usize) -> Result<NcclId, CommError> {
        let mut id = std::mem::MaybeUninit::<sys::ncclUniqueId>::uninit();
        // SAFETY: valid out-pointer.
        let r = unsafe { sys::ncclGetUniqueId(id.as_mut_ptr()) };
        if r != sys::ncclResult_t::ncclSuccess {
            return Err(CommError::Device {
                rank,
                library: "nccl",
                call: "ncclGetUniqueId".into(),
                message: raw::nccl_text(r, None),
            });
        }
        // SAFETY: initialised by the successful call.
        let id = unsafe { id.assume_init() };
        let mut b = [0u8; 128];
        for (d, s) in b.iter_mut().zip(id.internal.iter()) {
            *d = *s as u8;
        }
        Ok(NcclId(b))
    }

    /// The id from 128 bytes received from rank 0.
    ///
    /// Errors: [`CommError::Unsupported`] when `b` is not 128 bytes.
    pub fn from_bytes(b: &[u8]) -> Result<NcclId, CommError> {
        let a: [u8; 128] = b.try_into().map_err(|_| CommError::Unsupported {
            backend: "nccl",
            what: format!("a unique id is 128 bytes, got {}", b.len()),
        })?;
        Ok(NcclId(a))
    }

    fn raw(&self) -> sys::ncclUniqueId {
        let mut internal = [0 as std::ffi::c_char; 128];
        for (d, s) in internal.iter_mut().zip(self.0.iter()) {
            *d = *s as std::ffi::c_char;
        }
        sys::ncclUniqueId { internal }
    }
}

/// How reductions are computed (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reduction {
    /// All-to-all of chunks + a rank-order kernel: bit-identical to the other backends, f32
    /// accumulation for bf16/f16. The default.
    #[default]
    RankOrder,
    /// NCCL's own `ncclReduceScatter` / `ncclAllReduce` (NCCL's order, 16-bit accumulation
    /// for 16-bit dtypes).
    Nccl,
}

/// Options of an [`NcclComm`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclOptions {
    /// How long a call waits for its peers (and communicator creation for every rank) before
    /// the communicators are aborted with [`CommError::Timeout`].
    pub timeout: Duration,
    /// Reduction algorithm.
    pub reduction: Reduction,
    /// Exchange call descriptions before every collective (mismatch detection). Host-buffer
    /// calls always pay one small all-gather for it; device-buffer calls wait on the host for
    /// it, which serialises them with earlier enqueued work, so the engine turns it off once
    /// every rank checked the plan fingerprint (all ranks then issue the same schedule).
    pub check_calls: bool,
    /// Bytes of device scratch per rank-order reduction step (`g x chunk` elements; larger
    /// buffers are reduced chunk after chunk). Default 64 MiB.
    pub chunk_bytes: usize,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            timeout: Duration::from_secs(60),
            reduction: Reduction::RankOrder,
            check_calls: true,
            chunk_bytes: 64 << 20,
        }
    }
}

/// Element types the NCCL backend moves on the device: f32, bf16, f16, f64.
pub trait DeviceElement: Element + DeviceRepr + ValidAsZeroBits + Default {
    /// NCCL's datatype.
    const NCCL: sys::ncclDataType_t;
}

impl DeviceElement for f32 {
    const NCCL: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat32;
}
impl DeviceElement for f64 {
    const NCCL: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat64;
}
impl DeviceElement for bf16 {
    const NCCL: sys::ncclDataType_t = sys::ncclDataType_t::ncclBfloat16;
}
impl DeviceElement for f16 {
    const NCCL: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat16;
}

fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

/// A group's index in per-group arrays (its wire code).
fn group_index(g: Group) -> usize {
    codec::group_code(g) as usize
}

/// A device collective in flight on the communicator's stream: its CUDA event completes with it.
#[derive(Debug)]
pub struct DeviceOp {
    call: CallDesc,
    group: Group,
    event: CudaEvent,
}

impl DeviceOp {
    /// The call.
    pub fn call(&self) -> &CallDesc {
        &self.call
    }

    /// Makes `stream` (the compute stream) wait for the collective on the GPU, without blocking
    /// the host: work enqueued on `stream` afterwards sees the collective's result.
    ///
    /// Errors: [`CommError::Device`] (cuStreamWaitEvent).
    pub fn then(&self, stream: &CudaStream) -> Result<(), CommError> {
        stream
            .wait(&self.event)
            .map_err(|e| cuda_error(0, "cuStreamWaitEvent", e))
    }

    /// True when the collective finished on this rank (cuEventQuery).
    pub fn is_complete(&self) -> bool {
        self.event.is_complete()
    }
}

/// One rank of an NCCL world; see the module docs.
pub struct NcclComm {
    rank: usize,
    topology: Topology,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// World, shard, replicate communicators (indexed by [`group_index`]).
    comms: Vec<RawComm>,
    reducer: Reducer,
    opts: NcclOptions,
    seqs: [Cell<u64>; 3],
    dead: RefCell<Option<String>>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("topology", &self.topology)
            .field("device", &self.ctx.ordinal())
            .finish()
    }
}

impl Drop for NcclComm {
    /// Aborts the communicators (`ncclCommAbort`: cancels anything still enqueued, frees NCCL's
    /// resources) before the stream and context go.
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        for c in &self.comms {
            c.abort();
        }
    }
}

impl NcclComm {
    /// Joins the NCCL world named by `id` as `rank` of `topology` on the device of `ctx`:
    /// creates the world communicator (every rank must call this with the same id and
    /// topology), splits the shard and replicate groups, compiles the reduction kernel and
    /// creates the communicator's stream. Waits at most `opts.timeout` for the other ranks.
    ///
    /// Errors: [`CommError::InvalidTopology`]; [`CommError::Unsupported`] for a rank outside the
    /// world; [`CommError::Device`] with NCCL's or CUDA's text (including a world that did not
    /// form within the timeout).
    pub fn new(
        ctx: Arc<CudaContext>,
        rank: usize,
        topology: Topology,
        id: &NcclId,
        opts: NcclOptions,
    ) -> Result<NcclComm, CommError> {
        topology.validate()?;
        let w = topology.world_size;
        if rank >= w {
            return Err(CommError::Unsupported {
                backend: "nccl",
                what: format!("rank {rank} is outside a world of {w} ranks"),
            });
        }
        ctx.bind_to_thread()
            .map_err(|e| cuda_error(rank, "cuCtxSetCurrent", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_error(rank, "cuStreamCreate", e))?;
        let deadline = Instant::now() + opts.timeout;
        let unsettled = |call: String, u: Option<Unsettled>| CommError::Device {
            rank,
            library: "nccl",
            call,
            message: match u {
                Some(Unsettled::Failed(t)) => t,
                Some(Unsettled::TimedOut) | None => format!(
                    "did not complete within {:.1} s: are all {w} ranks started, with the same \
                     unique id?",
                    opts.timeout.as_secs_f64()
                ),
            },
        };
        let world = RawComm::init(rank, w, id.raw(), deadline).map_err(|(c, u)| unsettled(c, u))?;
        let mut comms = vec![];
        let split = |g: Group| -> Result<RawComm, CommError> {
            let members = topology.group_members(g, rank);
            let key = members.iter().position(|&m| m == rank).unwrap_or(0);
            world
                .split(members[0] as i32, key as i32, deadline)
                .map_err(|(c, u)| unsettled(c, Some(u)))
        };
        let shard = split(Group::Shard)?;
        let replicate = split(Group::Replicate)?;
        comms.push(world);
        comms.push(shard);
        comms.push(replicate);
        let reducer = Reducer::new(rank, &ctx)?;
        Ok(NcclComm {
            rank,
            topology,
            ctx,
            stream,
            comms,
            reducer,
            opts,
            seqs: Default::default(),
            dead: RefCell::new(None),
        })
    }

    /// Bootstraps a process from torchrun's environment (`fsdp launch` sets it): the rendezvous
    /// on `MASTER_ADDR:MASTER_PORT` (rank 0 creates the unique id and sends it to every rank),
    /// the device `LOCAL_RANK`, then [`NcclComm::new`]. Returns the rendezvous too (a host
    /// side channel, e.g. for the conformance launcher's results).
    ///
    /// Errors: [`CommError::Env`], [`CommError::Rendezvous`], [`CommError::InvalidTopology`]
    /// when `topology.world_size != WORLD_SIZE`, and those of [`NcclComm::new`].
    pub fn from_env(
        topology: Topology,
        opts: NcclOptions,
    ) -> Result<(NcclComm, Rendezvous), CommError> {
        let env = LaunchEnv::from_env()?;
        if topology.world_size != env.world_size {
            return Err(CommError::InvalidTopology {
                world_size: env.world_size,
                shard_size: topology.shard_size,
                replicate_size: topology.replicate_size,
                reason: "world_size must equal shard_size x replicate_size",
            });
        }
        let mut rv = Rendezvous::connect(&env, opts.timeout)?;
        let id = if env.rank == 0 {
            let id = NcclId::new(0)?;
            rv.broadcast_bytes(Some(&id.0))?;
            id
        } else {
            NcclId::from_bytes(&rv.broadcast_bytes(None)?)?
        };
        let ctx = CudaContext::new(env.local_rank).map_err(|e| {
            cuda_error(
                env.rank,
                &format!("cuDevicePrimaryCtxRetain(device {})", env.local_rank),
                e,
            )
        })?;
        let comm = NcclComm::new(ctx, env.rank, topology, &id, opts)?;
        Ok((comm, rv))
    }

    /// The communicator's CUDA stream (every collective runs on it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The options.
    pub fn options(&self) -> NcclOptions {
        self.opts
    }

    /// Sets the reduction algorithm of later calls; every rank must make the same choice at
    /// the same point.
    pub fn set_reduction(&mut self, reduction: Reduction) {
        self.opts.reduction = reduction;
    }

    /// Sets the per-call timeout of later calls.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.opts.timeout = timeout;
    }

    /// Turns the call-description exchange on or off (see [`NcclOptions::check_calls`]); every
    /// rank must make the same choice at the same point.
    pub fn set_check_calls(&mut self, on: bool) {
        self.opts.check_calls = on;
    }

    fn comm(&self, g: Group) -> &RawComm {
        &self.comms[group_index(g)]
    }

    fn bind(&self) -> Result<(), CommError> {
        if let Some(why) = self.dead.borrow().as_ref() {
            return Err(CommError::PeerFailed {
                peer: self.rank,
                reason: format!("the NCCL communicator was aborted earlier: {why}"),
            });
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error(self.rank, "cuCtxSetCurrent", e))
    }

    /// Aborts every communicator and remembers why; returns `err`.
    fn fail(&self, err: CommError) -> CommError {
        for c in &self.comms {
            c.abort();
        }
        self.dead
            .borrow_mut()
            .get_or_insert_with(|| err.to_string());
        err
    }

    fn next_seq(&self, g: Group) -> u64 {
        let c = &self.seqs[group_index(g)];
        let s = c.get();
        c.set(s + 1);
        s
    }

    fn nccl_err(&self, call: &CallDesc, what: &str, text: String) -> CommError {
        self.fail(CommError::Device {
            rank: self.rank,
            library: "nccl",
            call: format!("{what} for {call}"),
            message: text,
        })
    }

    fn timeout_err(&self, call: &CallDesc, group: Group, waited: Duration) -> CommError {
        let missing = self
            .topology
            .group_members(group, self.rank)
            .into_iter()
            .filter(|&m| m != self.rank)
            .collect();
        self.fail(CommError::Timeout {
            rank: self.rank,
            call: *call,
            waited_ms: waited.as_millis() as u64,
            missing,
        })
    }

    /// Polls until the last NCCL call on `group` is enqueued.
    fn settle(
        &self,
        call: &CallDesc,
        group: Group,
        start: Instant,
        what: &str,
    ) -> Result<(), CommError> {
        match self.comm(group).settle(start + self.opts.timeout) {
            Ok(()) => Ok(()),
            Err(Unsettled::Failed(t)) => Err(self.nccl_err(call, what, t)),
            Err(Unsettled::TimedOut) => Err(self.timeout_err(call, group, start.elapsed())),
        }
    }

    /// Records an event after the enqueued work and waits for it on the host, polling NCCL's
    /// asynchronous error and the deadline.
    fn finish(&self, call: &CallDesc, group: Group, start: Instant) -> Result<(), CommError> {
        let ev = self
            .stream
            .record_event(None)
            .map_err(|e| self.fail(cuda_error(self.rank, "cuEventRecord", e)))?;
        let mut pause = Duration::from_micros(10);
        loop {
            match ev.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.fail(cuda_error(self.rank, "cuEventQuery", e))),
            }
            if let Err(t) = self.comm(group).async_state() {
                return Err(self.nccl_err(call, "ncclCommGetAsyncError", t));
            }
            if start.elapsed() >= self.opts.timeout {
                return Err(self.timeout_err(call, group, start.elapsed()));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// Runs the call agreement over `group` (when `check_calls`): the descriptors travel by an
    /// all-gather on the device (see [`Agreement`]).
    fn agree(&self, call: &CallDesc, group: Group, start: Instant) -> Result<(), CommError> {
        if !self.opts.check_calls {
            return Ok(());
        }
        debug_assert_eq!(call.group, group);
        let mut t = Agreement { comm: self, start };
        agreement::agree(&mut t, self.topology, self.rank, call)
    }

    // ------------------------------------------------------------ raw enqueues

    /// Enqueues `ncclAllGather` of `n` elements per rank from `send` into `recv`.
    fn enqueue_all_gather(
        &self,
        at: &Step<'_>,
        dtype: DType,
        send: u64,
        recv: u64,
        n: usize,
    ) -> Result<(), CommError> {
        let (call, group, start) = (at.call, at.call.group, at.start);
        if n == 0 {
            return Ok(());
        }
        let c = self.comm(group);
        // SAFETY: live device buffers of n and g x n elements (checked by the caller).
        let r = unsafe {
            sys::ncclAllGather(
                send as *const c_void,
                recv as *mut c_void,
                n,
                nccl_dtype(dtype),
                c.comm,
                self.stream.cu_stream() as _,
            )
        };
        c.check(r)
            .map_err(|t| self.nccl_err(call, "ncclAllGather", t))?;
        self.settle(call, group, start, "ncclAllGather")
    }

    /// Enqueues the reduce-scatter of `send` (g x n elements) into `recv` (n elements) with
    /// the backend's [`Reduction`].
    fn enqueue_reduce_scatter(
        &self,
        at: &Step<'_>,
        op: ReduceOp,
        dtype: DType,
        send: u64,
        recv: u64,
        n: usize,
    ) -> Result<(), CommError> {
        let (call, group, start) = (at.call, at.call.group, at.start);
        if n == 0 {
            return Ok(());
        }
        let c = self.comm(group);
        let g = self.topology.group_size(group);
        let dt = nccl_dtype(dtype);
        let es = dtype.size_bytes();
        if self.opts.reduction == Reduction::Nccl {
            // SAFETY: live device buffers of g x n and n elements.
            let r = unsafe {
                sys::ncclReduceScatter(
                    send as *const c_void,
                    recv as *mut c_void,
                    n,
                    dt,
                    nccl_op(op),
                    c.comm,
                    self.stream.cu_stream() as _,
                )
            };
            c.check(r)
                .map_err(|t| self.nccl_err(call, "ncclReduceScatter", t))?;
            return self.settle(call, group, start, "ncclReduceScatter");
        }
        let Some(steps) = RankOrderSteps::new(n, g, es as usize, self.opts.chunk_bytes) else {
            return Ok(());
        };
        let scratch_bytes = steps.scratch_bytes();
        let scratch = self.stream.alloc_zeros::<u8>(scratch_bytes).map_err(|e| {
            self.fail(cuda_error(
                self.rank,
                &format!("cuMemAllocAsync({scratch_bytes} bytes of reduction scratch)"),
                e,
            ))
        })?;
        let (sp, _guard) = scratch.device_ptr(&self.stream);
        for step in steps.iter() {
            let cnt = step.count;
            grouped(c, || {
                for j in 0..g {
                    let from = send + steps.send_offset(step, j);
                    let into = sp + steps.scratch_offset(step, j);
                    // SAFETY: `from` addresses cnt elements of block j of the send buffer,
                    // `into` slot j of the scratch (g x chunk elements).
                    let r = unsafe {
                        sys::ncclSend(
                            from as *const c_void,
                            cnt,
                            dt,
                            j as i32,
                            c.comm,
                            self.stream.cu_stream() as _,
                        )
                    };
                    c.check(r)?;
                    let r = unsafe {
                        sys::ncclRecv(
                            into as *mut c_void,
                            cnt,
                            dt,
                            j as i32,
                            c.comm,
                            self.stream.cu_stream() as _,
                        )
                    };
                    c.check(r)?;
                }
                Ok(())
            })
            .map_err(|t| self.nccl_err(call, "ncclSend/ncclRecv (rank-order reduce-scatter)", t))?;
            self.settle(call, group, start, "ncclGroupEnd")?;
            let fold = Fold {
                dtype,
                op,
                parts: sp,
                g,
                c: cnt,
                out: recv + steps.out_offset(step),
            };
            self.reducer
                .launch(self.rank, &self.stream, fold)
                .map_err(|e| self.fail(e))?;
        }
        Ok(())
    }

    /// Enqueues the in-place all-reduce of `buf` (n elements) with the backend's
    /// [`Reduction`].
    fn enqueue_all_reduce(
        &self,
        at: &Step<'_>,
        op: ReduceOp,
        dtype: DType,
        buf: u64,
        n: usize,
    ) -> Result<(), CommError> {
        let (call, group, start) = (at.call, at.call.group, at.start);
        if n == 0 {
            return Ok(());
        }
        let c = self.comm(group);
        let g = self.topology.group_size(group);
        let dt = nccl_dtype(dtype);
        let es = dtype.size_bytes();
        if self.opts.reduction == Reduction::Nccl {
            // SAFETY: live device buffer of n elements, in place.
            let r = unsafe {
                sys::ncclAllReduce(
                    buf as *const c_void,
                    buf as *mut c_void,
                    n,
                    dt,
                    nccl_op(op),
                    c.comm,
                    self.stream.cu_stream() as _,
                )
            };
            c.check(r)
                .map_err(|t| self.nccl_err(call, "ncclAllReduce", t))?;
            return self.settle(call, group, start, "ncclAllReduce");
        }
        let Some(steps) = RankOrderSteps::new(n, g, es as usize, self.opts.chunk_bytes) else {
            return Ok(());
        };
        let scratch_bytes = steps.scratch_bytes();
        let scratch = self.stream.alloc_zeros::<u8>(scratch_bytes).map_err(|e| {
            self.fail(cuda_error(
                self.rank,
                &format!("cuMemAllocAsync({scratch_bytes} bytes of reduction scratch)"),
                e,
            ))
        })?;
        let (sp, _guard) = scratch.device_ptr(&self.stream);
        for step in steps.iter() {
            let cnt = step.count;
            let piece = buf + steps.out_offset(step);
            // SAFETY: `piece` addresses cnt elements of buf; scratch holds g x cnt.
            let r = unsafe {
                sys::ncclAllGather(
                    piece as *const c_void,
                    sp as *mut c_void,
                    cnt,
                    dt,
                    c.comm,
                    self.stream.cu_stream() as _,
                )
            };
            c.check(r)
                .map_err(|t| self.nccl_err(call, "ncclAllGather (rank-order all-reduce)", t))?;
            self.settle(call, group, start, "ncclAllGather (rank-order all-reduce)")?;
            let fold = Fold {
                dtype,
                op,
                parts: sp,
                g,
                c: cnt,
                out: piece,
            };
            self.reducer
                .launch(self.rank, &self.stream, fold)
                .map_err(|e| self.fail(e))?;
        }
        Ok(())
    }

    /// Enqueues the in-place `ncclBroadcast` of `buf` (n elements) from group rank `root`.
    fn enqueue_broadcast(
        &self,
        at: &Step<'_>,
        root: usize,
        dtype: DType,
        buf: u64,
        n: usize,
    ) -> Result<(), CommError> {
        let (call, start) = (at.call, at.start);
        let group = call.group;
        if n == 0 {
            return Ok(());
        }
        let c = self.comm(group);
        // SAFETY: live device buffer of n elements, in place.
        let r = unsafe {
            sys::ncclBroadcast(
                buf as *const c_void,
                buf as *mut c_void,
                n,
                nccl_dtype(dtype),
                root as i32,
                c.comm,
                self.stream.cu_stream() as _,
            )
        };
        c.check(r)
            .map_err(|t| self.nccl_err(call, "ncclBroadcast", t))?;
        self.settle(call, group, start, "ncclBroadcast")
    }

    // ------------------------------------------------------------ host staging

    /// Copies `input` to the device, runs `run(in_ptr, out_ptr)` on the stream (out has
    /// `out_len` elements; `in_place` uses one buffer for both), waits, returns the output.
    fn staged<T: DeviceElement>(
        &self,
        at: &Step<'_>,
        input: &[T],
        out_len: usize,
        in_place: bool,
        run: impl FnOnce(u64, u64) -> Result<(), CommError>,
    ) -> Result<Vec<T>, CommError> {
        let (call, group, start) = (at.call, at.call.group, at.start);
        let up = |what: &str, e| self.fail(cuda_error(self.rank, what, e));
        let one = [T::default()];
        let din = self
            .stream
            .clone_htod(if input.is_empty() { &one[..] } else { input })
            .map_err(|e| up("cuMemcpyHtoDAsync(staging)", e))?;
        let mut out = if in_place {
            None
        } else {
            Some(
                self.stream
                    .alloc_zeros::<T>(out_len.max(1))
                    .map_err(|e| up("cuMemAllocAsync(staging)", e))?,
            )
        };
        {
            let (ip, _g1) = din.device_ptr(&self.stream);
            match out.as_mut() {
                Some(o) => {
                    let (op, _g2) = o.device_ptr_mut(&self.stream);
                    run(ip, op)?;
                }
                None => run(ip, ip)?,
            }
        }
        self.finish(call, group, start)?;
        let host = match &out {
            Some(o) => self.stream.clone_dtoh(o),
            None => self.stream.clone_dtoh(&din),
        }
        .map_err(|e| up("cuMemcpyDtoHAsync(staging)", e))?;
        self.stream
            .synchronize()
            .map_err(|e| up("cuStreamSynchronize", e))?;
        Ok(host.into_iter().take(out_len).collect())
    }

    fn start_call(
        &self,
        op: OpKind,
        group: Group,
        reduce: Option<ReduceOp>,
        send: (DType, usize),
        recv: (DType, usize),
        root: Option<usize>,
    ) -> Result<CallDesc, CommError> {
        self.bind()?;
        let seq = self.seqs[group_index(group)].get();
        let req = CallRequest {
            op,
            group,
            reduce,
            send,
            recv,
            root,
        };
        let call = check_call(self.rank, self.topology, req, seq)?;
        self.next_seq(group);
        Ok(call)
    }

    // ------------------------------------------------------------ device-buffer API

    /// In-place all-gather of an engine-owned device buffer: `buf` holds `g x n` elements and
    /// this rank's shard is already in block `group_rank` (NCCL's in-place form, send buffer
    /// `buf + group_rank x n`); afterwards block i holds group rank i's shard. Enqueued on the
    /// communicator's stream after the work already enqueued on `after` (the stream that wrote
    /// the own block); returns at once with the op's event.
    ///
    /// Errors: [`CommError::SizeMismatch`] when `buf.len()` is not a multiple of the group size;
    /// mismatch / timeout (only with `check_calls`); [`CommError::Device`].
    pub fn all_gather_device<T: DeviceElement>(
        &self,
        group: Group,
        buf: &mut CudaViewMut<'_, T>,
        after: Option<&CudaStream>,
    ) -> Result<DeviceOp, CommError> {
        self.bind()?;
        let seq = self.seqs[group_index(group)].get();
        let call = check_in_place_call(self.rank, self.topology, group, T::DTYPE, buf.len(), seq)?;
        self.next_seq(group);
        let start = Instant::now();
        self.agree(&call, group, start)?;
        self.after(after)?;
        let n = call.send_numel;
        let gr = self.topology.group_rank(group, self.rank);
        {
            let (p, _guard) = buf.device_ptr_mut(&self.stream);
            let es = T::DTYPE.size_bytes();
            self.enqueue_all_gather(
                &Step::new(&call, start),
                T::DTYPE,
                p + (gr * n) as u64 * es,
                p,
                n,
            )?;
        }
        self.device_op(call, group)
    }

    /// Reduce-scatter from a device buffer (`send`: `g x n` elements) into an engine-owned
    /// shard (`recv`: n elements), with the backend's [`Reduction`]. Enqueued after `after`'s
    /// work; returns at once.
    ///
    /// Errors: [`CommError::SizeMismatch`]; mismatch / timeout (with `check_calls`);
    /// [`CommError::Device`].
    pub fn reduce_scatter_device<T: DeviceElement>(
        &self,
        group: Group,
        op: ReduceOp,
        send: &CudaView<'_, T>,
        recv: &mut CudaViewMut<'_, T>,
        after: Option<&CudaStream>,
    ) -> Result<DeviceOp, CommError> {
        let call = self.start_call(
            OpKind::ReduceScatter,
            group,
            Some(op),
            (T::DTYPE, send.len()),
            (T::DTYPE, recv.len()),
            None,
        )?;
        let start = Instant::now();
        self.agree(&call, group, start)?;
        self.after(after)?;
        {
            let (sp, _g1) = send.device_ptr(&self.stream);
            let n = recv.len();
            let (rp, _g2) = recv.device_ptr_mut(&self.stream);
            self.enqueue_reduce_scatter(&Step::new(&call, start), op, T::DTYPE, sp, rp, n)?;
        }
        self.device_op(call, group)
    }

    /// In-place all-reduce of a device buffer (n elements), with the backend's [`Reduction`].
    /// Enqueued after `after`'s work; returns at once.
    ///
    /// Errors: mismatch / timeout (with `check_calls`); [`CommError::Device`].
    pub fn all_reduce_device<T: DeviceElement>(
        &self,
        group: Group,
        op: ReduceOp,
        buf: &mut CudaViewMut<'_, T>,
        after: Option<&CudaStream>,
    ) -> Result<DeviceOp, CommError> {
        let n = buf.len();
        let call = self.start_call(
            OpKind::AllReduce,
            group,
            Some(op),
            (T::DTYPE, n),
            (T::DTYPE, n),
            None,
        )?;
        let start = Instant::now();
        self.agree(&call, group, start)?;
        self.after(after)?;
        {
            let (p, _g) = buf.device_ptr_mut(&self.stream);
            self.enqueue_all_reduce(&Step::new(&call, start), op, T::DTYPE, p, n)?;
        }
        self.device_op(call, group)
    }

    /// Waits on the host for a device op (polling NCCL errors and the timeout).
    ///
    /// Errors: [`CommError::Timeout`] (communicators aborted), [`CommError::Device`].
    pub fn wait_device(&self, op: DeviceOp) -> Result<(), CommError> {
        self.bind()?;
        let start = Instant::now();
        let mut pause = Duration::from_micros(10);
        loop {
            match op.event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.fail(cuda_error(self.rank, "cuEventQuery", e))),
            }
            if let Err(t) = self.comm(op.group).async_state() {
                return Err(self.nccl_err(&op.call, "ncclCommGetAsyncError", t));
            }
            if start.elapsed() >= self.opts.timeout {
                return Err(self.timeout_err(&op.call, op.group, start.elapsed()));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    fn after(&self, after: Option<&CudaStream>) -> Result<(), CommError> {
        if let Some(s) = after {
            self.stream.join(s).map_err(|e| {
                self.fail(cuda_error(
                    self.rank,
                    "cuStreamWaitEvent(producer stream)",
                    e,
                ))
            })?;
        }
        Ok(())
    }

    fn device_op(&self, call: CallDesc, group: Group) -> Result<DeviceOp, CommError> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| self.fail(cuda_error(self.rank, "cuEventRecord", e)))?;
        Ok(DeviceOp { call, group, event })
    }
}

/// One NCCL step of a collective: the call it belongs to (its group, and the description its
/// errors quote) and when the call started (its deadline is `start` + the timeout).
pub(crate) struct Step<'a> {
    call: &'a CallDesc,
    start: Instant,
}

impl<'a> Step<'a> {
    /// A step of `call`, started at `start`.
    pub(crate) fn new(call: &'a CallDesc, start: Instant) -> Self {
        Step { call, start }
    }
}

/// The call agreement's transport on NCCL: the descriptors of a group's members are
/// all-gathered on the device (one small `ncclAllGather` of u64 words), waited for on the host
/// against the call's deadline. A timeout or NCCL error aborts the communicators; a
/// disagreement leaves them usable (no data moved).
struct Agreement<'a> {
    comm: &'a NcclComm,
    start: Instant,
}

impl Transport for Agreement<'_> {
    fn exchange(
        &mut self,
        call: &CallDesc,
        mine: &Descriptor,
    ) -> Result<Vec<Descriptor>, CommError> {
        let (me, group, start) = (self.comm, call.group, self.start);
        const WORDS: usize = codec::CALL_WORDS;
        let g = me.topology.group_size(group);
        let gr = me.topology.group_rank(group, me.rank);
        let mut dev = me
            .stream
            .alloc_zeros::<u64>(WORDS * g)
            .map_err(|e| me.fail(cuda_error(me.rank, "cuMemAllocAsync(call descriptions)", e)))?;
        me.stream
            .memcpy_htod(&mine[..], &mut dev.slice_mut(gr * WORDS..(gr + 1) * WORDS))
            .map_err(|e| {
                me.fail(cuda_error(
                    me.rank,
                    "cuMemcpyHtoDAsync(call description)",
                    e,
                ))
            })?;
        {
            let (p, _guard) = dev.device_ptr_mut(&me.stream);
            let send = p + (gr * WORDS * 8) as u64;
            // SAFETY: live device buffer of g x WORDS u64; in-place all-gather.
            let r = unsafe {
                sys::ncclAllGather(
                    send as *const c_void,
                    p as *mut c_void,
                    WORDS,
                    sys::ncclDataType_t::ncclUint64,
                    me.comm(group).comm,
                    me.stream.cu_stream() as _,
                )
            };
            me.comm(group)
                .check(r)
                .map_err(|t| me.nccl_err(call, "ncclAllGather(call descriptions)", t))?;
        }
        me.settle(call, group, start, "ncclAllGather(call descriptions)")?;
        me.finish(call, group, start)?;
        let all = me.stream.clone_dtoh(&dev).map_err(|e| {
            me.fail(cuda_error(
                me.rank,
                "cuMemcpyDtoHAsync(call descriptions)",
                e,
            ))
        })?;
        me.stream
            .synchronize()
            .map_err(|e| me.fail(cuda_error(me.rank, "cuStreamSynchronize", e)))?;
        Ok(all
            .chunks_exact(WORDS)
            .map(|w| {
                let mut d = [0u64; WORDS];
                d.copy_from_slice(w);
                d
            })
            .collect())
    }

    /// Every rank sees the same descriptors, so every rank reports the same mismatch; the
    /// world stays usable (no data moved).
    fn disagreed(&mut self, e: CommError) -> CommError {
        e
    }
}

macro_rules! typed_pair {
    ($rank:expr, $op:expr, $a:expr, $b:expr, |$x:ident, $y:ident| $e:expr) => {
        match ($a, $b) {
            (Buf::F32($x), BufMut::F32($y)) => $e,
            (Buf::BF16($x), BufMut::BF16($y)) => $e,
            (Buf::F16($x), BufMut::F16($y)) => $e,
            (Buf::F64($x), BufMut::F64($y)) => $e,
            (a, b) => Err(CommError::DTypeMismatch {
                rank: $rank,
                op: $op,
                send: a.dtype(),
                recv: b.dtype(),
            }),
        }
    };
}

macro_rules! typed_one {
    ($b:expr, |$y:ident| $e:expr) => {
        match $b {
            BufMut::F32($y) => $e,
            BufMut::BF16($y) => $e,
            BufMut::F16($y) => $e,
            BufMut::F64($y) => $e,
        }
    };
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn topology(&self) -> Topology {
        self.topology
    }

    fn backend_name(&self) -> &'static str {
        "nccl"
    }

    fn all_gather(&self, group: Group, send: Buf<'_>, recv: BufMut<'_>) -> Result<(), CommError> {
        let call = self.start_call(
            OpKind::AllGather,
            group,
            None,
            (send.dtype(), send.len()),
            (recv.dtype(), recv.len()),
            None,
        )?;
        let start = Instant::now();
        self.agree(&call, group, start)?;
        let n = send.len();
        if n == 0 {
            return Ok(());
        }
        let dtype = send.dtype();
        typed_pair!(self.rank, OpKind::AllGather, send, recv, |s, r| {
            let out = self.staged(&Step::new(&call, start), s, r.len(), false, |ip, op| {
                self.enqueue_all_gather(&Step::new(&call, start), dtype, ip, op, n)
            })?;
            r.copy_from_slice(&out);
            Ok(())
        })
    }

    fn all_gather_in_place(&self, group: Group, buf: BufMut<'_>) -> Result<(), CommError> {
        self.bind()?;
        let seq = self.seqs[group_index(group)].get();
        let call =
            check_in_place_call(self.rank, self.topology, group, buf.dtype(), buf.len(), seq)?;
        self.next_seq(group);
        let start = Instant::now();
        self.agree(&call, group, start)?;
        let n = call.send_numel;
        if n == 0 {
            return Ok(());
        }
        let dtype = buf.dtype();
        let es = dtype.size_bytes();
        let gr = self.topology.group_rank(group, self.rank);
        typed_one!(buf, |b| {
            let out = self.staged(&Step::new(&call, start), b, b.len(), true, |p, _| {
                self.enqueue_all_gather(
                    &Step::new(&call, start),
                    dtype,
                    p + (gr * n) as u64 * es,
                    p,
                    n,
                )
            })?;
            b.copy_from_slice(&out);
            Ok(())
        })
    }

    fn reduce_scatter(
        &self,
        group: Group,
        op: ReduceOp,
        send: Buf<'_>,
        recv: BufMut<'_>,
    ) -> Result<(), CommError> {
        let call = self.start_call(
            OpKind::ReduceScatter,
            group,
            Some(op),
            (send.dtype(), send.len()),
            (recv.dtype(), recv.len()),
            None,
        )?;
        let start = Instant::now();
        self.agree(&call, group, start)?;
        let n = recv.len();
        if n == 0 {
            return Ok(());
        }
        let dtype = send.dtype();
        typed_pair!(self.rank, OpKind::ReduceScatter, send, recv, |s, r| {
            let out = self.staged(&Step::new(&call, start), s, n, false, |ip, o| {
                self.enqueue_reduce_scatter(&Step::new(&call, start), op, dtype, ip, o, n)
            })?;
            r.copy_from_slice(&out);
            Ok(())
        })
    }

    fn all_reduce(&self, group: Group, op: ReduceOp, buf: BufMut<'_>) -> Result<(), CommError> {
        let n = buf.len();
        let dtype = buf.dtype();
        let call = self.start_call(
            OpKind::AllReduce,
            group,
            Some(op),
            (dtype, n),
            (dtype, n),
            None,
        )?;
        let start = Instant::now();
        self.agree(&call, group, start)?;
        if n == 0 {
            return Ok(());
        }
        typed_one!(buf, |b| {
            let out = self.staged(&Step::new(&call, start), b, n, true, |p, _| {
                self.enqueue_all_reduce(&Step::new(&call, start), op, dtype, p, n)
            })?;
            b.copy_from_slice(&out);
            Ok(())
        })
    }

    fn broadcast(&self, group: Group, root: usize, buf: BufMut<'_>) -> Result<(), CommError> {
        let n = buf.len();
        let dtype = buf.dtype();
        let call = self.start_call(
            OpKind::Broadcast,
            group,
            None,
            (dtype, n),
            (dtype, n),
            Some(root),
        )?;
        let start = Instant::now();
        self.agree(&call, group, start)?;
        if n == 0 {
            return Ok(());
        }
        typed_one!(buf, |b| {
            let out = self.staged(&Step::new(&call, start), b, n, true, |p, _| {
                self.enqueue_broadcast(&Step::new(&call, start), root, dtype, p, n)
            })?;
            b.copy_from_slice(&out);
            Ok(())
        })
    }

    /// CUDA tensors in place on the communicator's stream (see `tensor.rs`: `wait` orders
    /// candle's stream after the collective, it does not block the host); host buffers staged
    /// and run at once.
    fn start_all_gather(
        &self,
        group: Group,
        send: OwnedBuf,
        recv: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        if tensor::is_device(&send) || tensor::is_device(&recv) {
            return self.start_all_gather_tensor(group, send, recv);
        }
        eager_start_all_gather(self, group, send, recv)
    }

    /// A CUDA tensor in place (NCCL's in-place all-gather, see `tensor.rs`); host buffers
    /// staged and run at once.
    fn start_all_gather_in_place(
        &self,
        group: Group,
        buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        if tensor::is_device(&buf) {
            return self.start_all_gather_in_place_tensor(group, buf);
        }
        eager_start_all_gather_in_place(self, group, buf)
    }

    /// CUDA tensors in place (rank-order reduction by default); host buffers staged.
    fn start_reduce_scatter(
        &self,
        group: Group,
        op: ReduceOp,
        send: OwnedBuf,
        recv: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        if tensor::is_device(&send) || tensor::is_device(&recv) {
            return self.start_reduce_scatter_tensor(group, op, send, recv);
        }
        eager_start_reduce_scatter(self, group, op, send, recv)
    }

    /// A CUDA tensor in place (rank-order reduction by default); host buffers staged.
    fn start_all_reduce(
        &self,
        group: Group,
        op: ReduceOp,
        buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        if tensor::is_device(&buf) {
            return self.start_all_reduce_tensor(group, op, buf);
        }
        eager_start_all_reduce(self, group, op, buf)
    }

    /// A CUDA tensor in place; host buffers staged.
    fn start_broadcast(
        &self,
        group: Group,
        root: usize,
        buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        if tensor::is_device(&buf) {
            return self.start_broadcast_tensor(group, root, buf);
        }
        eager_start_broadcast(self, group, root, buf)
    }

    fn barrier(&self, group: Group) -> Result<(), CommError> {
        let call = self.start_call(
            OpKind::Barrier,
            group,
            None,
            (DType::F32, 0),
            (DType::F32, 0),
            None,
        )?;
        let start = Instant::now();
        if self.opts.check_calls {
            return self.agree(&call, group, start);
        }
        // Without the description exchange: a one-element all-gather is the barrier.
        let g = self.topology.group_size(group);
        let gr = self.topology.group_rank(group, self.rank);
        let mut dev = self
            .stream
            .alloc_zeros::<f32>(g)
            .map_err(|e| self.fail(cuda_error(self.rank, "cuMemAllocAsync(barrier)", e)))?;
        {
            let (p, _g) = dev.device_ptr_mut(&self.stream);
            self.enqueue_all_gather(
                &Step::new(&call, start),
                DType::F32,
                p + 4 * gr as u64,
                p,
                1,
            )?;
        }
        self.finish(&call, group, start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonblocking_config_matches_the_2_28_initializer() {
        let c = raw::nonblocking_config();
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!((c.magic, c.version, c.blocking), (0xcafe_beef, 22800, 0));
        assert_eq!(c.minCTAs, i32::MIN);
    }
}

//! Tensor buffers ([`OwnedBuf::Tensor`]) on the NCCL backend: the engine's flat buffers as
//! candle CUDA tensors, used in place.
//!
//! **Where the elements are.** A CUDA tensor's storage is candle's `CudaStorage`, whose
//! `CudaSlice` lives in the device's primary context: the same `CUcontext` as the
//! communicator's when both were opened on the same ordinal (`CudaContext::new` retains the
//! primary context, and so does candle's `Device::new_cuda`). The collective reads and writes
//! that allocation directly, from the layout's start offset (a `narrow` of a flat buffer is a
//! valid buffer); no copy, no staging.
//!
//! **Ordering (start).** Candle enqueues all work of a device on one stream (`CudaDevice::
//! cuda_stream()`; for `Device::new_cuda` it is CUDA's per-thread default stream of the calling
//! thread, so the engine issues compute and collectives from one thread). A `start_*` call
//! records an event on the stream of every tensor it is given and makes the communicator's own
//! stream wait for it (`cuStreamWaitEvent`): the collective sees everything candle queued
//! before the call (e.g. the cast of the master shard into the own block of an all-gather
//! buffer), without blocking the host. Then it enqueues the NCCL work (and, for rank-order
//! reductions, the reduction kernel) on the communicator's stream, records the completion
//! event and returns.
//!
//! **Ordering (wait).** [`crate::PendingOp::wait`] does not block the host: it makes each
//! tensor's candle stream wait for the completion event and hands the tensors back, so any
//! candle work enqueued afterwards sees the result while the host runs ahead (the overlap of
//! the next unit's all-gather runs while the current one computes). It fails at once
//! only when CUDA already reports an error for the work (`cuEventQuery`). NCCL's asynchronous
//! errors and a collective that never completes surface in the next host-synchronising call on
//! the communicator (every synchronous call, and [`NcclComm::wait_device`], polls
//! `ncclCommGetAsyncError` against the timeout; the stream is in order, so it covers every
//! earlier collective). [`crate::PendingOp::is_complete`] queries the event. A handle dropped
//! without `wait` still makes the candle streams wait before the tensors are released, so
//! candle's stream-ordered free never races the collective.

use super::raw::cuda_error;
use super::{NcclComm, Step};
use crate::buf::{check_tensor, device_name, OwnedBuf};
use crate::comm::{check_in_place_call, Completed, PendingOp, PendingWait};
use crate::error::{CallDesc, CommError, OpKind};
use crate::topology::{Group, ReduceOp};
use candle_core::{Storage, Tensor};
use cudarc::driver::{CudaEvent, CudaStream, DevicePtr, DevicePtrMut};
use fsdp_types::DType;
use std::sync::Arc;
use std::time::Instant;

/// A CUDA tensor's elements: device address of the first element, dtype, element count and
/// the candle stream that orders its producers and consumers.
struct DevBuf {
    ptr: u64,
    dtype: DType,
    len: usize,
    stream: Arc<CudaStream>,
}

impl DevBuf {
    fn bytes(&self) -> u64 {
        self.len as u64 * self.dtype.size_bytes()
    }
}

/// True when `b` is a tensor outside host memory (a CUDA tensor): the in-place device path.
pub(super) fn is_device(b: &OwnedBuf) -> bool {
    !b.is_host()
}

impl NcclComm {
    fn invalid(&self, op: OpKind, t: &Tensor, reason: String) -> CommError {
        CommError::InvalidTensor {
            rank: self.rank,
            op,
            dtype: t.dtype().as_str().to_string(),
            shape: t.dims().to_vec(),
            device: device_name(t),
            reason,
        }
    }

    /// Checks a CUDA tensor buffer (dtype, contiguity, this communicator's device) and returns
    /// where its elements are. `write`: the collective writes it (takes candle's write lock
    /// while the address is read; no lock is held afterwards, see the module docs).
    ///
    /// Errors: [`CommError::InvalidTensor`].
    fn dev_buf(&self, op: OpKind, b: &OwnedBuf, write: bool) -> Result<DevBuf, CommError> {
        let t = b.tensor().expect("a device buffer is a tensor");
        let (dtype, len, start) = check_tensor(self.rank, op, t)?;
        let mine = self.ctx.ordinal();
        match t.device().location() {
            candle_core::DeviceLocation::Cuda { gpu_id } if gpu_id == mine => {}
            _ => {
                return Err(self.invalid(
                    op,
                    t,
                    format!(
                        "the NCCL communicator of rank {} runs on cuda:{mine}; a tensor buffer \
                         must live on that device",
                        self.rank
                    ),
                ))
            }
        }
        use candle_core::cuda_backend::CudaStorageSlice as S;
        let (base, stream) = if write {
            let (mut st, _) = t.storage_mut_and_layout();
            let Storage::Cuda(cs) = &mut *st else {
                return Err(self.invalid(op, t, "not a CUDA storage".into()));
            };
            let stream = cs.device.cuda_stream();
            let p = match (&mut cs.slice, dtype) {
                (S::F32(s), DType::F32) => Some(s.device_ptr_mut(&self.stream).0),
                (S::BF16(s), DType::BF16) => Some(s.device_ptr_mut(&self.stream).0),
                (S::F16(s), DType::F16) => Some(s.device_ptr_mut(&self.stream).0),
                (S::F64(s), DType::F64) => Some(s.device_ptr_mut(&self.stream).0),
                _ => None,
            };
            (p, stream)
        } else {
            let (st, _) = t.storage_and_layout();
            let Storage::Cuda(cs) = &*st else {
                return Err(self.invalid(op, t, "not a CUDA storage".into()));
            };
            let stream = cs.device.cuda_stream();
            let p = match (&cs.slice, dtype) {
                (S::F32(s), DType::F32) => Some(s.device_ptr(&self.stream).0),
                (S::BF16(s), DType::BF16) => Some(s.device_ptr(&self.stream).0),
                (S::F16(s), DType::F16) => Some(s.device_ptr(&self.stream).0),
                (S::F64(s), DType::F64) => Some(s.device_ptr(&self.stream).0),
                _ => None,
            };
            (p, stream)
        };
        let Some(base) = base else {
            return Err(self.invalid(
                op,
                t,
                "the storage's dtype differs from the tensor's".into(),
            ));
        };
        Ok(DevBuf {
            ptr: base + start as u64 * dtype.size_bytes(),
            dtype,
            len,
            stream,
        })
    }

    /// The send and receive buffers of a plain all-gather or reduce-scatter on the device:
    /// both CUDA tensors of this device, not overlapping.
    ///
    /// Errors: [`CommError::InvalidTensor`] (also for a host buffer mixed with a device one).
    fn dev_pair(
        &self,
        op: OpKind,
        send: &OwnedBuf,
        recv: &OwnedBuf,
    ) -> Result<(DevBuf, DevBuf), CommError> {
        for b in [send, recv] {
            if !is_device(b) {
                let t = send
                    .tensor()
                    .or(recv.tensor())
                    .expect("one is a device tensor");
                return Err(self.invalid(
                    op,
                    t,
                    "one call mixes a device buffer with a host buffer; pass both on the \
                     communicator's device (or both on the host, staged)"
                        .into(),
                ));
            }
        }
        let s = self.dev_buf(op, send, false)?;
        let r = self.dev_buf(op, recv, true)?;
        if s.bytes() > 0 && r.bytes() > 0 && s.ptr < r.ptr + r.bytes() && r.ptr < s.ptr + s.bytes()
        {
            let t = send.tensor().expect("device buffers are tensors");
            return Err(self.invalid(
                op,
                t,
                format!(
                    "the send buffer (device bytes {:#x}..{:#x}) overlaps the receive buffer \
                     ({:#x}..{:#x}); an all-gather into a buffer holding its own block is \
                     all_gather_in_place",
                    s.ptr,
                    s.ptr + s.bytes(),
                    r.ptr,
                    r.ptr + r.bytes()
                ),
            ));
        }
        Ok((s, r))
    }

    /// Makes the communicator's stream wait for the work candle queued on `bufs`' streams.
    fn after_candle(&self, bufs: &[&DevBuf]) -> Result<Vec<Arc<CudaStream>>, CommError> {
        let mut streams: Vec<Arc<CudaStream>> = Vec::new();
        for b in bufs {
            if !streams
                .iter()
                .any(|s| s.cu_stream() == b.stream.cu_stream())
            {
                streams.push(b.stream.clone());
            }
        }
        for s in &streams {
            self.stream.join(s).map_err(|e| {
                self.fail(cuda_error(
                    self.rank,
                    "cuEventRecord + cuStreamWaitEvent (candle's stream -> communicator stream)",
                    e,
                ))
            })?;
        }
        Ok(streams)
    }

    /// Records the completion event and wraps the buffers in a handle (see the module docs).
    fn tensor_op(
        &self,
        call: CallDesc,
        consumers: Vec<Arc<CudaStream>>,
        done: Completed,
    ) -> Result<PendingOp, CommError> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| self.fail(cuda_error(self.rank, "cuEventRecord", e)))?;
        Ok(PendingOp::deferred(
            call,
            Box::new(TensorPending {
                rank: self.rank,
                event,
                consumers,
                done: Some(done),
            }),
        ))
    }

    /// Started all-gather of CUDA tensors (see the module docs).
    pub(super) fn start_all_gather_tensor(
        &self,
        group: Group,
        send: OwnedBuf,
        recv: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        let op = OpKind::AllGather;
        let (s, r) = self.dev_pair(op, &send, &recv)?;
        let call = self.start_call(op, group, None, (s.dtype, s.len), (r.dtype, r.len), None)?;
        let start = Instant::now();
        self.agree(&call, group, start)?;
        let consumers = self.after_candle(&[&s, &r])?;
        self.enqueue_all_gather(&Step::new(&call, start), s.dtype, s.ptr, r.ptr, s.len)?;
        let done = Completed {
            send: Some(send),
            buf: recv,
        };
        self.tensor_op(call, consumers, done)
    }

    /// Started in-place all-gather of a CUDA tensor (NCCL's in-place form: send buffer =
    /// `buf + group_rank x n`).
    pub(super) fn start_all_gather_in_place_tensor(
        &self,
        group: Group,
        buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        let op = OpKind::AllGather;
        let b = self.dev_buf(op, &buf, true)?;
        self.bind()?;
        let seq = self.seqs[super::group_index(group)].get();
        let call = check_in_place_call(self.rank, self.topology, group, b.dtype, b.len, seq)?;
        self.next_seq(group);
        let start = Instant::now();
        self.agree(&call, group, start)?;
        let consumers = self.after_candle(&[&b])?;
        let n = call.send_numel;
        let own =
            b.ptr + (self.topology.group_rank(group, self.rank) * n) as u64 * b.dtype.size_bytes();
        self.enqueue_all_gather(&Step::new(&call, start), b.dtype, own, b.ptr, n)?;
        self.tensor_op(call, consumers, Completed { send: None, buf })
    }

    /// Started reduce-scatter of CUDA tensors, with the backend's [`super::Reduction`] (rank order by
    /// default: bit-identical to the host backends).
    pub(super) fn start_reduce_scatter_tensor(
        &self,
        group: Group,
        rop: ReduceOp,
        send: OwnedBuf,
        recv: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        let op = OpKind::ReduceScatter;
        let (s, r) = self.dev_pair(op, &send, &recv)?;
        let call = self.start_call(
            op,
            group,
            Some(rop),
            (s.dtype, s.len),
            (r.dtype, r.len),
            None,
        )?;
        let start = Instant::now();
        self.agree(&call, group, start)?;
        let consumers = self.after_candle(&[&s, &r])?;
        self.enqueue_reduce_scatter(&Step::new(&call, start), rop, s.dtype, s.ptr, r.ptr, r.len)?;
        let done = Completed {
            send: Some(send),
            buf: recv,
        };
        self.tensor_op(call, consumers, done)
    }

    /// Started in-place all-reduce of a CUDA tensor, with the backend's [`super::Reduction`].
    pub(super) fn start_all_reduce_tensor(
        &self,
        group: Group,
        rop: ReduceOp,
        buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        let op = OpKind::AllReduce;
        let b = self.dev_buf(op, &buf, true)?;
        let d = (b.dtype, b.len);
        let call = self.start_call(op, group, Some(rop), d, d, None)?;
        let start = Instant::now();
        self.agree(&call, group, start)?;
        let consumers = self.after_candle(&[&b])?;
        self.enqueue_all_reduce(&Step::new(&call, start), rop, b.dtype, b.ptr, b.len)?;
        self.tensor_op(call, consumers, Completed { send: None, buf })
    }

    /// Started in-place broadcast of a CUDA tensor from group rank `root`.
    pub(super) fn start_broadcast_tensor(
        &self,
        group: Group,
        root: usize,
        buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        let op = OpKind::Broadcast;
        let b = self.dev_buf(op, &buf, true)?;
        let d = (b.dtype, b.len);
        let call = self.start_call(op, group, None, d, d, Some(root))?;
        let start = Instant::now();
        self.agree(&call, group, start)?;
        let consumers = self.after_candle(&[&b])?;
        self.enqueue_broadcast(&Step::new(&call, start), root, b.dtype, b.ptr, b.len)?;
        self.tensor_op(call, consumers, Completed { send: None, buf })
    }
}

/// The handle of a started collective on CUDA tensors (see the module docs).
struct TensorPending {
    rank: usize,
    /// Recorded on the communicator's stream after the collective's work.
    event: CudaEvent,
    /// The candle streams of the call's tensors (deduplicated).
    consumers: Vec<Arc<CudaStream>>,
    /// The buffers; `None` once handed back.
    done: Option<Completed>,
}

impl TensorPending {
    /// Makes every consumer stream wait for the collective (no host block).
    fn order_consumers(&self) -> Result<(), CommError> {
        for s in &self.consumers {
            s.wait(&self.event).map_err(|e| {
                cuda_error(
                    self.rank,
                    "cuStreamWaitEvent (communicator stream -> candle's stream)",
                    e,
                )
            })?;
        }
        Ok(())
    }
}

impl PendingWait for TensorPending {
    /// Orders candle's streams after the collective and hands the tensors back without
    /// blocking the host (see the module docs).
    fn wait(mut self: Box<Self>) -> Result<Completed, CommError> {
        self.order_consumers()?;
        if let Err(e) = self.event.try_is_complete() {
            return Err(cuda_error(
                self.rank,
                "cuEventQuery (collective on tensors)",
                e,
            ));
        }
        Ok(self.done.take().expect("a pending op is waited for once"))
    }

    fn is_complete(&self) -> bool {
        self.event.is_complete()
    }
}

impl Drop for TensorPending {
    fn drop(&mut self) {
        if self.done.is_some() {
            // Dropped without wait: candle must not reuse or free the tensors before the
            // collective is done with them.
            let _ = self.order_consumers();
        }
    }
}

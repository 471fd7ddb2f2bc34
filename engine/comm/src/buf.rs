//! dtype-tagged buffers that collectives read and write.
//!
//! A collective sees a flat run of elements of one [`DType`]: borrowed ([`Buf`], [`BufMut`]) for
//! the synchronous calls, owned ([`OwnedBuf`]) for the started ones, whose buffers must outlive
//! the call that issued them. An owned buffer is a host vector or a candle [`Tensor`] (the
//! engine's flat buffers on a compute device): a contiguous tensor whose elements, in
//! row-major order, are the buffer.

use crate::error::{CommError, OpKind};
use candle_core::{CpuStorage, Storage, Tensor};
use fsdp_types::{DType, Numel};
use half::{bf16, f16};

/// A borrowed, read-only run of elements of one dtype (the send side of a collective).
#[derive(Debug, Clone, Copy)]
pub enum Buf<'a> {
    /// IEEE binary32 elements.
    F32(&'a [f32]),
    /// bfloat16 elements.
    BF16(&'a [bf16]),
    /// IEEE binary16 elements.
    F16(&'a [f16]),
    /// IEEE binary64 elements.
    F64(&'a [f64]),
}

/// A borrowed, writable run of elements of one dtype (the receive side, or an in-place buffer).
#[derive(Debug)]
pub enum BufMut<'a> {
    /// IEEE binary32 elements.
    F32(&'a mut [f32]),
    /// bfloat16 elements.
    BF16(&'a mut [bf16]),
    /// IEEE binary16 elements.
    F16(&'a mut [f16]),
    /// IEEE binary64 elements.
    F64(&'a mut [f64]),
}

/// An owned run of elements of one dtype, moved into a started collective and handed back by
/// [`crate::PendingOp::wait`].
///
/// Equality ([`PartialEq`]) compares the dtype and the element values (IEEE `==`, so NaN never
/// equals NaN), wherever the elements live: a host vector equals a tensor holding the same
/// elements.
#[derive(Debug, Clone)]
pub enum OwnedBuf {
    /// IEEE binary32 elements.
    F32(Vec<f32>),
    /// bfloat16 elements.
    BF16(Vec<bf16>),
    /// IEEE binary16 elements.
    F16(Vec<f16>),
    /// IEEE binary64 elements.
    F64(Vec<f64>),
    /// A candle tensor of dtype f32, bf16, f16 or f64 with a contiguous layout (any shape,
    /// usually 1-D; a `narrow` of a 1-D buffer is valid, its start offset is honoured): its
    /// `elem_count()` elements in row-major order are the buffer. Collectives read and write
    /// the tensor's storage in place (every tensor sharing that storage sees the result), so
    /// the caller must not touch those elements between the start of a collective and its
    /// `wait`. Cloning the variant clones the handle, not the elements.
    ///
    /// Where it may live depends on the backend: host backends (threads, MPI) take CPU tensors
    /// and answer a CUDA tensor with [`CommError::DeviceBufferUnreachable`]; the NCCL backend
    /// (feature `cuda`) takes CUDA tensors in place and stages CPU tensors through the device.
    /// A tensor of another dtype or a strided layout is [`CommError::InvalidTensor`].
    Tensor(Tensor),
}

impl PartialEq for OwnedBuf {
    fn eq(&self, other: &OwnedBuf) -> bool {
        match (self, other) {
            (OwnedBuf::F32(a), OwnedBuf::F32(b)) => a == b,
            (OwnedBuf::BF16(a), OwnedBuf::BF16(b)) => a == b,
            (OwnedBuf::F16(a), OwnedBuf::F16(b)) => a == b,
            (OwnedBuf::F64(a), OwnedBuf::F64(b)) => a == b,
            (a, b) => {
                a.try_dtype().is_some()
                    && a.try_dtype() == b.try_dtype()
                    && a.len() == b.len()
                    && a.to_f64_vec() == b.to_f64_vec()
            }
        }
    }
}

macro_rules! dispatch {
    ($v:expr, $x:ident => $e:expr) => {
        match $v {
            Self::F32($x) => $e,
            Self::BF16($x) => $e,
            Self::F16($x) => $e,
            Self::F64($x) => $e,
        }
    };
}

/// The collective dtype of a candle dtype (`None` for the dtypes collectives do not carry).
pub(crate) fn dtype_of_candle(d: candle_core::DType) -> Option<DType> {
    match d {
        candle_core::DType::F32 => Some(DType::F32),
        candle_core::DType::BF16 => Some(DType::BF16),
        candle_core::DType::F16 => Some(DType::F16),
        candle_core::DType::F64 => Some(DType::F64),
        _ => None,
    }
}

/// `"cpu"`, `"cuda:0"`, `"metal:1"`: where a tensor lives, for messages.
pub(crate) fn device_name(t: &Tensor) -> String {
    match t.device().location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// Checks that `t` is a valid collective buffer (dtype f32/bf16/f16/f64, contiguous layout)
/// and returns its dtype, element count and start offset (elements) in its storage.
///
/// Errors: [`CommError::InvalidTensor`] with the tensor's dtype, shape and strides.
pub(crate) fn check_tensor(
    rank: usize,
    op: OpKind,
    t: &Tensor,
) -> Result<(DType, usize, usize), CommError> {
    let bad = |reason: String| CommError::InvalidTensor {
        rank,
        op,
        dtype: t.dtype().as_str().to_string(),
        shape: t.dims().to_vec(),
        device: device_name(t),
        reason,
    };
    let Some(d) = dtype_of_candle(t.dtype()) else {
        return Err(bad(
            "collectives carry f32, bf16, f16 or f64 elements".into()
        ));
    };
    let layout = t.layout();
    if !layout.is_contiguous() {
        return Err(bad(format!(
            "the layout is strided (strides {:?} elements); a collective buffer is contiguous, \
             call .contiguous() first",
            layout.stride()
        )));
    }
    Ok((d, layout.shape().elem_count(), layout.start_offset()))
}

/// The error of a host backend given a buffer outside host memory.
pub(crate) fn unreachable_device(
    rank: usize,
    op: OpKind,
    backend: &'static str,
    dtype: DType,
    numel: usize,
    device: String,
) -> CommError {
    CommError::DeviceBufferUnreachable {
        rank,
        op,
        backend,
        dtype,
        numel,
        device,
    }
}

impl Buf<'_> {
    /// The element dtype.
    pub fn dtype(&self) -> DType {
        match self {
            Buf::F32(_) => DType::F32,
            Buf::BF16(_) => DType::BF16,
            Buf::F16(_) => DType::F16,
            Buf::F64(_) => DType::F64,
        }
    }
    /// Number of elements (not bytes).
    pub fn len(&self) -> usize {
        dispatch!(self, x => x.len())
    }
    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Number of elements as a [`Numel`].
    pub fn numel(&self) -> Numel {
        Numel(self.len() as u64)
    }
    /// Address of the first element (dangling but aligned when empty).
    pub(crate) fn as_ptr(&self) -> *const u8 {
        dispatch!(self, x => x.as_ptr() as *const u8)
    }
    /// Element `i` widened to f64 (exact for every dtype), for tests and diagnostics.
    ///
    /// Panics if `i >= len()`.
    pub fn get_f64(&self, i: usize) -> f64 {
        match self {
            Buf::F32(x) => x[i] as f64,
            Buf::BF16(x) => x[i].to_f64(),
            Buf::F16(x) => x[i].to_f64(),
            Buf::F64(x) => x[i],
        }
    }
    /// All elements widened to f64 (exact for every dtype).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        (0..self.len()).map(|i| self.get_f64(i)).collect()
    }
}

impl BufMut<'_> {
    /// The element dtype.
    pub fn dtype(&self) -> DType {
        match self {
            BufMut::F32(_) => DType::F32,
            BufMut::BF16(_) => DType::BF16,
            BufMut::F16(_) => DType::F16,
            BufMut::F64(_) => DType::F64,
        }
    }
    /// Number of elements (not bytes).
    pub fn len(&self) -> usize {
        dispatch!(self, x => x.len())
    }
    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Number of elements as a [`Numel`].
    pub fn numel(&self) -> Numel {
        Numel(self.len() as u64)
    }
    /// A shorter-lived mutable view of the same elements.
    pub fn reborrow(&mut self) -> BufMut<'_> {
        match self {
            BufMut::F32(x) => BufMut::F32(x),
            BufMut::BF16(x) => BufMut::BF16(x),
            BufMut::F16(x) => BufMut::F16(x),
            BufMut::F64(x) => BufMut::F64(x),
        }
    }
    /// A read-only view of the same elements.
    pub fn as_buf(&self) -> Buf<'_> {
        match self {
            BufMut::F32(x) => Buf::F32(x),
            BufMut::BF16(x) => Buf::BF16(x),
            BufMut::F16(x) => Buf::F16(x),
            BufMut::F64(x) => Buf::F64(x),
        }
    }
    /// Address of the first element (dangling but aligned when empty).
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        dispatch!(self, x => x.as_mut_ptr() as *mut u8)
    }
}

impl OwnedBuf {
    /// `numel` zeros of `dtype`.
    pub fn zeros(dtype: DType, numel: usize) -> OwnedBuf {
        match dtype {
            DType::F32 => OwnedBuf::F32(vec![0.0; numel]),
            DType::BF16 => OwnedBuf::BF16(vec![bf16::ZERO; numel]),
            DType::F16 => OwnedBuf::F16(vec![f16::ZERO; numel]),
            DType::F64 => OwnedBuf::F64(vec![0.0; numel]),
        }
    }
    /// `numel` elements of `dtype` whose values are unspecified: the output of an in-place
    /// all-gather, where the caller writes its own chunk and the collective writes every other
    /// one, so a zero-fill (one extra pass over the buffer, ~2.4% of a `base` full-shard step on
    /// the CPU) would only be overwritten. Allocated like candle's own uninitialised CPU
    /// outputs (`CpuDevice::alloc_uninit`).
    ///
    /// # Safety
    /// Every element must be written before it is read. f32, bf16, f16 and f64 have no
    /// invalid bit patterns, but reading an unwritten element reads whatever the allocator
    /// left there.
    #[allow(clippy::uninit_vec)]
    pub unsafe fn uninit(dtype: DType, numel: usize) -> OwnedBuf {
        /// `Vec::with_capacity` + `set_len`: the caller's contract covers the contents.
        unsafe fn raw<T>(numel: usize) -> Vec<T> {
            let mut v = Vec::with_capacity(numel);
            // SAFETY: capacity is `numel`; the caller writes every element before reading.
            unsafe { v.set_len(numel) };
            v
        }
        // SAFETY: forwarded to the caller.
        unsafe {
            match dtype {
                DType::F32 => OwnedBuf::F32(raw(numel)),
                DType::BF16 => OwnedBuf::BF16(raw(numel)),
                DType::F16 => OwnedBuf::F16(raw(numel)),
                DType::F64 => OwnedBuf::F64(raw(numel)),
            }
        }
    }
    /// The buffer as a 1-D candle tensor (`[len]`, the buffer's dtype), without copying: a host
    /// vector becomes the storage of a CPU tensor (`Tensor::from_vec` on the CPU moves the
    /// vector), a tensor is returned flattened (a view: collective tensors are contiguous).
    ///
    /// Errors: candle's, when it refuses (not expected for a valid buffer).
    pub fn into_tensor(self) -> candle_core::Result<Tensor> {
        let n = self.len();
        let cpu = candle_core::Device::Cpu;
        match self {
            OwnedBuf::F32(v) => Tensor::from_vec(v, n, &cpu),
            OwnedBuf::BF16(v) => Tensor::from_vec(v, n, &cpu),
            OwnedBuf::F16(v) => Tensor::from_vec(v, n, &cpu),
            OwnedBuf::F64(v) => Tensor::from_vec(v, n, &cpu),
            OwnedBuf::Tensor(t) => t.flatten_all(),
        }
    }
    /// `values` rounded (round-to-nearest-even) into `dtype`.
    pub fn from_f64(dtype: DType, values: &[f64]) -> OwnedBuf {
        match dtype {
            DType::F32 => OwnedBuf::F32(values.iter().map(|&v| v as f32).collect()),
            DType::BF16 => OwnedBuf::BF16(values.iter().map(|&v| bf16::from_f64(v)).collect()),
            DType::F16 => OwnedBuf::F16(values.iter().map(|&v| f16::from_f64(v)).collect()),
            DType::F64 => OwnedBuf::F64(values.to_vec()),
        }
    }
    /// Wraps a tensor after checking it is a valid collective buffer (dtype f32, bf16, f16 or
    /// f64; contiguous layout, any start offset). `OwnedBuf::Tensor(t)` builds the same value
    /// unchecked; the communicators check it when the call is made.
    ///
    /// Errors: [`CommError::InvalidTensor`] (reported for rank 0 and `op` = all_gather, since no
    /// call is made yet).
    pub fn from_tensor(t: Tensor) -> Result<OwnedBuf, CommError> {
        check_tensor(0, OpKind::AllGather, &t)?;
        Ok(OwnedBuf::Tensor(t))
    }
    /// The element dtype.
    ///
    /// Panics for a [`OwnedBuf::Tensor`] of a dtype collectives do not carry (u8, u32, i64,
    /// f8, ...); [`OwnedBuf::try_dtype`] returns `None` instead, and every communicator call
    /// rejects such a tensor with [`CommError::InvalidTensor`] before asking.
    pub fn dtype(&self) -> DType {
        match self {
            OwnedBuf::F32(_) => DType::F32,
            OwnedBuf::BF16(_) => DType::BF16,
            OwnedBuf::F16(_) => DType::F16,
            OwnedBuf::F64(_) => DType::F64,
            OwnedBuf::Tensor(t) => dtype_of_candle(t.dtype()).unwrap_or_else(|| {
                panic!(
                    "OwnedBuf::Tensor of dtype {} is not a collective buffer \
                     (f32, bf16, f16, f64)",
                    t.dtype().as_str()
                )
            }),
        }
    }
    /// The element dtype, or `None` for a tensor of a dtype collectives do not carry.
    pub fn try_dtype(&self) -> Option<DType> {
        match self {
            OwnedBuf::Tensor(t) => dtype_of_candle(t.dtype()),
            b => Some(b.dtype()),
        }
    }
    /// Number of elements (not bytes); a tensor's `elem_count()`.
    pub fn len(&self) -> usize {
        match self {
            OwnedBuf::F32(x) => x.len(),
            OwnedBuf::BF16(x) => x.len(),
            OwnedBuf::F16(x) => x.len(),
            OwnedBuf::F64(x) => x.len(),
            OwnedBuf::Tensor(t) => t.elem_count(),
        }
    }
    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Number of elements as a [`Numel`].
    pub fn numel(&self) -> Numel {
        Numel(self.len() as u64)
    }
    /// True when the elements live in host memory: the vector variants and CPU tensors.
    pub fn is_host(&self) -> bool {
        match self {
            OwnedBuf::Tensor(t) => t.device().is_cpu(),
            _ => true,
        }
    }
    /// The tensor of an [`OwnedBuf::Tensor`]; `None` for the vector variants.
    pub fn tensor(&self) -> Option<&Tensor> {
        match self {
            OwnedBuf::Tensor(t) => Some(t),
            _ => None,
        }
    }
    /// Checks that a host backend (`backend`, e.g. `threads`) can use this buffer as `rank`'s
    /// buffer of `op` in place: a vector, or a contiguous CPU tensor of f32/bf16/f16/f64.
    ///
    /// Errors: [`CommError::InvalidTensor`] (dtype, strided layout);
    /// [`CommError::DeviceBufferUnreachable`] for a tensor outside host memory (CUDA).
    pub fn check_host(
        &self,
        rank: usize,
        op: OpKind,
        backend: &'static str,
    ) -> Result<(), CommError> {
        if let OwnedBuf::Tensor(t) = self {
            let (d, n, _) = check_tensor(rank, op, t)?;
            if !t.device().is_cpu() {
                return Err(unreachable_device(rank, op, backend, d, n, device_name(t)));
            }
        }
        Ok(())
    }
    /// A read-only borrowed view of a vector variant.
    ///
    /// Panics for [`OwnedBuf::Tensor`] (its elements sit behind the storage's lock): use
    /// [`OwnedBuf::with_host`].
    pub fn as_buf(&self) -> Buf<'_> {
        match self {
            OwnedBuf::F32(x) => Buf::F32(x),
            OwnedBuf::BF16(x) => Buf::BF16(x),
            OwnedBuf::F16(x) => Buf::F16(x),
            OwnedBuf::F64(x) => Buf::F64(x),
            OwnedBuf::Tensor(_) => {
                panic!("OwnedBuf::as_buf on a tensor buffer: use OwnedBuf::with_host")
            }
        }
    }
    /// A writable borrowed view of a vector variant.
    ///
    /// Panics for [`OwnedBuf::Tensor`]: use [`OwnedBuf::with_host_mut`].
    pub fn as_buf_mut(&mut self) -> BufMut<'_> {
        match self {
            OwnedBuf::F32(x) => BufMut::F32(x),
            OwnedBuf::BF16(x) => BufMut::BF16(x),
            OwnedBuf::F16(x) => BufMut::F16(x),
            OwnedBuf::F64(x) => BufMut::F64(x),
            OwnedBuf::Tensor(_) => {
                panic!("OwnedBuf::as_buf_mut on a tensor buffer: use OwnedBuf::with_host_mut")
            }
        }
    }
    /// Runs `f` on a read-only view of the elements: a vector directly, a CPU tensor under
    /// its storage's read lock (its `elem_count()` elements from the layout's start offset,
    /// no copy). This is how a host tensor goes through the synchronous calls
    /// (`b.with_host(|s| comm.all_gather(g, s, r))`).
    ///
    /// `None` when the elements are not host-accessible: a device tensor, or a tensor that is
    /// not a contiguous f32/bf16/f16/f64 one ([`OwnedBuf::check_host`] says which).
    pub fn with_host<R>(&self, f: impl FnOnce(Buf<'_>) -> R) -> Option<R> {
        let OwnedBuf::Tensor(t) = self else {
            return Some(f(self.as_buf()));
        };
        let (_, n, start) = check_tensor(0, OpKind::AllGather, t).ok()?;
        let (storage, _) = t.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            return None;
        };
        let r = start..start + n;
        let buf = match cpu {
            CpuStorage::F32(v) => Buf::F32(v.get(r)?),
            CpuStorage::BF16(v) => Buf::BF16(v.get(r)?),
            CpuStorage::F16(v) => Buf::F16(v.get(r)?),
            CpuStorage::F64(v) => Buf::F64(v.get(r)?),
            _ => return None,
        };
        Some(f(buf))
    }
    /// Runs `f` on a writable view of the elements: a vector directly, a CPU tensor under its
    /// storage's write lock (in place, no copy; every tensor sharing the storage sees the
    /// writes). This is how a host tensor goes through the synchronous calls
    /// (`b.with_host_mut(|x| comm.all_reduce(g, op, x))`).
    ///
    /// `None` as for [`OwnedBuf::with_host`].
    pub fn with_host_mut<R>(&mut self, f: impl FnOnce(BufMut<'_>) -> R) -> Option<R> {
        let OwnedBuf::Tensor(t) = self else {
            return Some(f(self.as_buf_mut()));
        };
        let (_, n, start) = check_tensor(0, OpKind::AllGather, t).ok()?;
        let (mut storage, _) = t.storage_mut_and_layout();
        let Storage::Cpu(cpu) = &mut *storage else {
            return None;
        };
        let r = start..start + n;
        let buf = match cpu {
            CpuStorage::F32(v) => BufMut::F32(v.get_mut(r)?),
            CpuStorage::BF16(v) => BufMut::BF16(v.get_mut(r)?),
            CpuStorage::F16(v) => BufMut::F16(v.get_mut(r)?),
            CpuStorage::F64(v) => BufMut::F64(v.get_mut(r)?),
            _ => return None,
        };
        Some(f(buf))
    }
    /// Address of the first element for reading, for backends that move data through host
    /// memory. A CPU tensor's storage lock is held only while the address is taken: the
    /// storage's allocation never moves while the tensor lives, and the caller's contract (no
    /// access between start and wait) stands in for the lock, so other tensors sharing the
    /// storage (other narrows of one flat buffer) stay usable during a collective.
    ///
    /// Errors: as [`OwnedBuf::check_host`].
    pub(crate) fn host_addr(
        &self,
        rank: usize,
        op: OpKind,
        backend: &'static str,
    ) -> Result<usize, CommError> {
        self.check_host(rank, op, backend)?;
        self.with_host(|b| b.as_ptr() as usize)
            .ok_or_else(|| self.not_host(rank, op, backend))
    }
    /// Address of the first element for reading and writing (see [`OwnedBuf::host_addr`]).
    ///
    /// Errors: as [`OwnedBuf::check_host`].
    pub(crate) fn host_addr_mut(
        &mut self,
        rank: usize,
        op: OpKind,
        backend: &'static str,
    ) -> Result<usize, CommError> {
        self.check_host(rank, op, backend)?;
        match self.with_host_mut(|mut b| b.as_mut_ptr() as usize) {
            Some(a) => Ok(a),
            None => Err(self.not_host(rank, op, backend)),
        }
    }
    fn not_host(&self, rank: usize, op: OpKind, backend: &'static str) -> CommError {
        match self {
            OwnedBuf::Tensor(t) => unreachable_device(
                rank,
                op,
                backend,
                self.try_dtype().unwrap_or(DType::F32),
                self.len(),
                device_name(t),
            ),
            _ => unreachable!("vector buffers are host memory"),
        }
    }
    /// All elements widened to f64 (exact for every dtype); a device tensor is copied to the
    /// host first (for tests and diagnostics).
    ///
    /// Panics for a tensor of a dtype collectives do not carry, or when candle cannot copy a
    /// device tensor to the host (the panic carries candle's error).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        if let Some(v) = self.with_host(|b| b.to_f64_vec()) {
            return v;
        }
        let OwnedBuf::Tensor(t) = self else {
            unreachable!("vector buffers are host memory")
        };
        t.flatten_all()
            .and_then(|x| x.to_dtype(candle_core::DType::F64))
            .and_then(|x| x.to_vec1::<f64>())
            .unwrap_or_else(|e| panic!("OwnedBuf::to_f64_vec: {e}"))
    }
    /// A host-vector copy of the elements (a vector is cloned, a tensor copied from wherever
    /// it lives into the vector variant of its dtype).
    ///
    /// Errors: [`CommError::InvalidTensor`] for a tensor that is not a collective buffer;
    /// [`CommError::Device`] when candle cannot copy it.
    pub fn to_host_vec(&self) -> Result<OwnedBuf, CommError> {
        let OwnedBuf::Tensor(t) = self else {
            return Ok(self.clone());
        };
        let (d, _, _) = check_tensor(0, OpKind::AllGather, t)?;
        if let Some(b) = self.with_host(|b| match b {
            Buf::F32(x) => OwnedBuf::F32(x.to_vec()),
            Buf::BF16(x) => OwnedBuf::BF16(x.to_vec()),
            Buf::F16(x) => OwnedBuf::F16(x.to_vec()),
            Buf::F64(x) => OwnedBuf::F64(x.to_vec()),
        }) {
            return Ok(b);
        }
        let flat = t.flatten_all();
        let err = |e: candle_core::Error| CommError::Device {
            rank: 0,
            library: "candle",
            call: format!(
                "copy of a {d} tensor of {} elements to the host",
                t.elem_count()
            ),
            message: e.to_string(),
        };
        let flat = flat.map_err(err)?;
        Ok(match d {
            DType::F32 => OwnedBuf::F32(flat.to_vec1().map_err(err)?),
            DType::BF16 => OwnedBuf::BF16(flat.to_vec1().map_err(err)?),
            DType::F16 => OwnedBuf::F16(flat.to_vec1().map_err(err)?),
            DType::F64 => OwnedBuf::F64(flat.to_vec1().map_err(err)?),
        })
    }
}

/// Element types a collective can carry: f32, bf16, f16, f64.
///
/// Gives the [`DType`] tag and the conversions that let generic code build [`Buf`] / [`BufMut`] /
/// [`OwnedBuf`] from typed slices and vectors.
pub trait Element: Copy + Send + Sync + 'static {
    /// The dtype tag of this element type.
    const DTYPE: DType;
    /// Wraps a slice as a [`Buf`].
    fn buf(s: &[Self]) -> Buf<'_>;
    /// Wraps a mutable slice as a [`BufMut`].
    fn buf_mut(s: &mut [Self]) -> BufMut<'_>;
    /// Wraps a vector as an [`OwnedBuf`].
    fn owned(v: Vec<Self>) -> OwnedBuf;
    /// Unwraps an [`OwnedBuf`] of this dtype; `None` for another dtype.
    fn from_owned(b: OwnedBuf) -> Option<Vec<Self>>;
}

macro_rules! element {
    ($t:ty, $v:ident, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn buf(s: &[Self]) -> Buf<'_> {
                Buf::$v(s)
            }
            fn buf_mut(s: &mut [Self]) -> BufMut<'_> {
                BufMut::$v(s)
            }
            fn owned(v: Vec<Self>) -> OwnedBuf {
                OwnedBuf::$v(v)
            }
            fn from_owned(b: OwnedBuf) -> Option<Vec<Self>> {
                match b {
                    OwnedBuf::$v(v) => Some(v),
                    _ => None,
                }
            }
        }
        impl<'a> From<&'a [$t]> for Buf<'a> {
            fn from(s: &'a [$t]) -> Buf<'a> {
                Buf::$v(s)
            }
        }
        impl<'a> From<&'a Vec<$t>> for Buf<'a> {
            fn from(s: &'a Vec<$t>) -> Buf<'a> {
                Buf::$v(s)
            }
        }
        impl<'a> From<&'a mut [$t]> for BufMut<'a> {
            fn from(s: &'a mut [$t]) -> BufMut<'a> {
                BufMut::$v(s)
            }
        }
        impl<'a> From<&'a mut Vec<$t>> for BufMut<'a> {
            fn from(s: &'a mut Vec<$t>) -> BufMut<'a> {
                BufMut::$v(s)
            }
        }
        impl From<Vec<$t>> for OwnedBuf {
            fn from(v: Vec<$t>) -> OwnedBuf {
                OwnedBuf::$v(v)
            }
        }
    };
}
element!(f32, F32, DType::F32);
element!(bf16, BF16, DType::BF16);
element!(f16, F16, DType::F16);
element!(f64, F64, DType::F64);

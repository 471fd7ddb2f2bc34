//! CUDA tensors (feature `cuda`): the locked storages as cudarc views of the `CudaSlice` inside
//! candle's `CudaStorage`, handed to [`CudaKernels`] on candle's stream.
//!
//! Interop: candle 0.11.1's `CudaDevice` keeps its `CudaContext` private but hands out its
//! stream (`CudaDevice::cuda_stream()`, an `Arc<cudarc::driver::CudaStream>`); the stream knows
//! its context (`CudaStream::context()`), which [`CudaKernels`] compiles and loads the NVRTC
//! module into. candle and this crate link the same cudarc (0.19.10, one crate in the lock
//! file), so candle's `CudaSlice<T>` is the type the kernels take. Every launch goes on candle's
//! stream, so it is ordered after the model's work that produced the buffers and before the
//! work that follows, with no synchronisation; cudarc's event tracking (on by default) makes
//! the stream wait for writes other streams recorded on a slice (e.g. an NCCL stream).

use super::lock::{self, Arg, Guard};
use crate::cast;
use crate::cuda::{CudaKernels, DeviceSpans};
use crate::error::KernelError;
use crate::optim::{AdamWConfig, SgdConfig};
use crate::span::Span;
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{CudaDevice, Storage};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
use half::{bf16, f16};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Span tables kept per `TensorKernels` before the cache is emptied (one per flat-parameter
/// shard and span list is typical: a few per FSDP unit).
const SPAN_CACHE_ENTRIES: usize = 4096;

fn internal(what: &'static str) -> KernelError {
    KernelError::UnsupportedDType {
        what,
        dtype: "a non-float or non-CUDA storage".into(),
        supported: "f32, bf16, f16, f64 CUDA storages",
    }
}

fn driver(call: &str, e: impl std::fmt::Display) -> KernelError {
    KernelError::Device {
        call: call.to_string(),
        message: e.to_string(),
    }
}

/// A read-only window of a CUDA storage.
pub(crate) enum DevRef<'a> {
    F32(CudaView<'a, f32>),
    BF16(CudaView<'a, bf16>),
    F16(CudaView<'a, f16>),
    F64(CudaView<'a, f64>),
}

/// A written window of a CUDA storage.
pub(crate) enum DevMut<'a> {
    F32(CudaViewMut<'a, f32>),
    BF16(CudaViewMut<'a, bf16>),
    F16(CudaViewMut<'a, f16>),
    F64(CudaViewMut<'a, f64>),
}

/// A device copy of a read window (the snapshot rule of `lock`).
enum DevOwned {
    F32(CudaSlice<f32>),
    BF16(CudaSlice<bf16>),
    F16(CudaSlice<f16>),
    F64(CudaSlice<f64>),
}

/// One argument's window on the device.
pub(crate) enum DevPiece<'a> {
    Ref(DevRef<'a>),
    Mut(DevMut<'a>),
}

impl<'a> DevPiece<'a> {
    /// The window, read-only (a written window reborrowed).
    fn view(&self) -> DevRef<'_> {
        match self {
            DevPiece::Ref(r) => match r {
                DevRef::F32(v) => DevRef::F32(v.slice(..)),
                DevRef::BF16(v) => DevRef::BF16(v.slice(..)),
                DevRef::F16(v) => DevRef::F16(v.slice(..)),
                DevRef::F64(v) => DevRef::F64(v.slice(..)),
            },
            DevPiece::Mut(m) => match m {
                DevMut::F32(v) => DevRef::F32(v.as_view()),
                DevMut::BF16(v) => DevRef::BF16(v.as_view()),
                DevMut::F16(v) => DevRef::F16(v.as_view()),
                DevMut::F64(v) => DevRef::F64(v.as_view()),
            },
        }
    }

    fn f32_view(&self, what: &'static str) -> Result<CudaView<'_, f32>, KernelError> {
        match self.view() {
            DevRef::F32(v) => Ok(v),
            _ => Err(internal(what)),
        }
    }

    fn writable(&mut self, what: &'static str) -> Result<&mut DevMut<'a>, KernelError> {
        match self {
            DevPiece::Mut(m) => Ok(m),
            DevPiece::Ref(_) => Err(internal(what)),
        }
    }
}

fn f32_mut<'p, 'a>(
    m: &'p mut DevMut<'a>,
    what: &'static str,
) -> Result<&'p mut CudaViewMut<'a, f32>, KernelError> {
    match m {
        DevMut::F32(v) => Ok(v),
        _ => Err(internal(what)),
    }
}

fn storage_slice(s: &Storage) -> Option<&CudaStorageSlice> {
    match s {
        Storage::Cuda(c) => Some(&c.slice),
        _ => None,
    }
}

fn sub_view(s: &CudaStorageSlice, r: Range<usize>) -> Option<DevRef<'_>> {
    Some(match s {
        CudaStorageSlice::F32(x) => DevRef::F32(x.slice(r)),
        CudaStorageSlice::BF16(x) => DevRef::BF16(x.slice(r)),
        CudaStorageSlice::F16(x) => DevRef::F16(x.slice(r)),
        CudaStorageSlice::F64(x) => DevRef::F64(x.slice(r)),
        _ => return None,
    })
}

fn whole_mut(s: &mut Storage) -> Option<DevMut<'_>> {
    let Storage::Cuda(c) = s else { return None };
    Some(match &mut c.slice {
        CudaStorageSlice::F32(x) => DevMut::F32(x.as_view_mut()),
        CudaStorageSlice::BF16(x) => DevMut::BF16(x.as_view_mut()),
        CudaStorageSlice::F16(x) => DevMut::F16(x.as_view_mut()),
        CudaStorageSlice::F64(x) => DevMut::F64(x.as_view_mut()),
        _ => return None,
    })
}

/// A written storage still to be cut: `whole` starts at storage element `at`; `cuts` are
/// (argument, storage range), sorted, disjoint, at or after `at`.
struct Todo<'a> {
    whole: DevMut<'a>,
    at: usize,
    cuts: Vec<(usize, Range<usize>)>,
}

type Pieces<'a> = Vec<Option<DevPiece<'a>>>;

/// Cuts the written storages into their argument windows, one cut per call level, then calls
/// `k` with every piece. cudarc's `split_at_mut` borrows the view it splits, so each level owns
/// the rest of the view it splits and the pieces found so far shrink to the shorter borrow
/// (every view type is covariant in its lifetime); the recursion depth is the number of
/// written-storage windows of one call (at most 4).
fn descend<'a, R, F>(mut todo: Vec<Todo<'a>>, pieces: Pieces<'a>, k: F) -> R
where
    F: for<'x> FnOnce(Pieces<'x>) -> R,
{
    let Some(mut t) = todo.pop() else {
        return k(pieces);
    };
    if t.cuts.is_empty() {
        return descend(todo, pieces, k);
    }
    let (arg, r) = t.cuts.remove(0);
    macro_rules! cut {
        ($variant:ident, $v:ident) => {{
            let (_, mut tail) = $v.split_at_mut(r.start - t.at);
            let (piece, rest) = tail.split_at_mut(r.len());
            let mut pieces: Pieces<'_> = pieces;
            pieces[arg] = Some(DevPiece::Mut(DevMut::$variant(piece)));
            let mut todo: Vec<Todo<'_>> = todo;
            todo.push(Todo {
                whole: DevMut::$variant(rest),
                at: r.end,
                cuts: t.cuts,
            });
            descend(todo, pieces, k)
        }};
    }
    match t.whole {
        DevMut::F32(mut v) => cut!(F32, v),
        DevMut::BF16(mut v) => cut!(BF16, v),
        DevMut::F16(mut v) => cut!(F16, v),
        DevMut::F64(mut v) => cut!(F64, v),
    }
}

/// Locks the storages of `args` (see `lock`) and calls `f` with one piece per argument in
/// argument order; read windows that overlap another window of a written storage are copied
/// on `stream` first. Every window must be non-empty (the callers return before for empty
/// work).
fn with_pieces<R, F>(stream: &Arc<CudaStream>, args: &[Arg<'_>], f: F) -> Result<R, KernelError>
where
    F: for<'x> FnOnce(Vec<DevPiece<'x>>) -> Result<R, KernelError>,
{
    let plan = lock::plan(args)?;
    let mut guards = lock::acquire(args, &plan);
    let mut snapshots: Vec<Option<DevOwned>> = (0..args.len()).map(|_| None).collect();
    for (i, p) in plan.placed.iter().enumerate() {
        if p.snapshot {
            let s = storage_slice(guards[p.group].storage()).ok_or(internal(args[i].what))?;
            let v = sub_view(s, p.range.clone()).ok_or(internal(args[i].what))?;
            let call = "cuMemcpyDtoDAsync(snapshot of an aliased source)";
            snapshots[i] = Some(match v {
                DevRef::F32(v) => {
                    DevOwned::F32(stream.clone_dtod(&v).map_err(|e| driver(call, e))?)
                }
                DevRef::BF16(v) => {
                    DevOwned::BF16(stream.clone_dtod(&v).map_err(|e| driver(call, e))?)
                }
                DevRef::F16(v) => {
                    DevOwned::F16(stream.clone_dtod(&v).map_err(|e| driver(call, e))?)
                }
                DevRef::F64(v) => {
                    DevOwned::F64(stream.clone_dtod(&v).map_err(|e| driver(call, e))?)
                }
            });
        }
    }
    let mut pieces: Pieces<'_> = (0..args.len()).map(|_| None).collect();
    let mut todo = Vec::new();
    for (g, guard) in guards.iter_mut().enumerate() {
        let first = args[plan.groups[g].members[0]].what;
        match guard {
            Guard::Read(s) => {
                let s = storage_slice(s).ok_or(internal(first))?;
                for &i in &plan.groups[g].members {
                    let v = sub_view(s, plan.placed[i].range.clone()).ok_or(internal(first))?;
                    pieces[i] = Some(DevPiece::Ref(v));
                }
            }
            Guard::Write(s) => {
                let whole = whole_mut(s).ok_or(internal(first))?;
                let cuts = lock::split_order(&plan, g)
                    .into_iter()
                    .map(|i| (i, plan.placed[i].range.clone()))
                    .collect();
                todo.push(Todo { whole, at: 0, cuts });
            }
        }
    }
    for (i, s) in snapshots.iter().enumerate() {
        if let Some(s) = s {
            pieces[i] = Some(DevPiece::Ref(match s {
                DevOwned::F32(x) => DevRef::F32(x.as_view()),
                DevOwned::BF16(x) => DevRef::BF16(x.as_view()),
                DevOwned::F16(x) => DevRef::F16(x.as_view()),
                DevOwned::F64(x) => DevRef::F64(x.as_view()),
            }));
        }
    }
    descend(todo, pieces, |pieces: Pieces<'_>| {
        let pieces = pieces
            .into_iter()
            .zip(args)
            .map(|(p, a)| p.ok_or(internal(a.what)))
            .collect::<Result<Vec<_>, _>>()?;
        f(pieces)
    })
}

/// Uploaded span tables by (span list, buffer length in elements).
type SpanCache = HashMap<(Vec<Span>, usize), Arc<DeviceSpans>>;

/// The CUDA side of a `TensorKernels`.
pub(crate) struct CudaState {
    stream: Arc<CudaStream>,
    kernels: CudaKernels,
    spans: Mutex<SpanCache>,
}

impl CudaState {
    /// Kernels on `dev`'s context and stream, compiled now.
    pub fn new(dev: &CudaDevice) -> Result<CudaState, KernelError> {
        let stream = dev.cuda_stream();
        let kernels = CudaKernels::new(stream.context().clone());
        kernels.compile()?;
        Ok(CudaState {
            stream,
            kernels,
            spans: Mutex::new(HashMap::new()),
        })
    }

    /// Waits until the stream has finished all queued work.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        self.stream
            .synchronize()
            .map_err(|e| driver("cuStreamSynchronize", e))
    }

    /// `(current, peak)` bytes allocated from the device's current memory pool (the pool
    /// `cuMemAllocAsync` serves, which candle's and this crate's allocations use).
    pub fn pool_memory(&self) -> Result<(u64, u64), KernelError> {
        use cudarc::driver::sys::CUmemPool_attribute as A;
        let pool = self.pool()?;
        let mut current = 0u64;
        let mut peak = 0u64;
        // SAFETY: `pool` is the device's valid current pool; both attributes are `cuuint64_t`.
        unsafe {
            cudarc::driver::result::mem_pool::get_attribute(
                pool,
                A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                &mut current as *mut u64 as *mut std::ffi::c_void,
            )
            .map_err(|e| driver("cuMemPoolGetAttribute(USED_MEM_CURRENT)", e))?;
            cudarc::driver::result::mem_pool::get_attribute(
                pool,
                A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                &mut peak as *mut u64 as *mut std::ffi::c_void,
            )
            .map_err(|e| driver("cuMemPoolGetAttribute(USED_MEM_HIGH)", e))?;
        }
        Ok((current, peak))
    }

    /// Resets the pool's peak to its current use.
    pub fn reset_pool_peak(&self) -> Result<(), KernelError> {
        use cudarc::driver::sys::CUmemPool_attribute as A;
        let pool = self.pool()?;
        let mut zero = 0u64;
        // SAFETY: as `pool_memory`; setting USED_MEM_HIGH to 0 resets it to the current use.
        unsafe {
            cudarc::driver::result::mem_pool::set_attribute(
                pool,
                A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                &mut zero as *mut u64 as *mut std::ffi::c_void,
            )
            .map_err(|e| driver("cuMemPoolSetAttribute(USED_MEM_HIGH)", e))
        }
    }

    fn pool(&self) -> Result<cudarc::driver::sys::CUmemoryPool, KernelError> {
        let ctx = self.stream.context();
        ctx.bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        // SAFETY: `cu_device` is the context's valid device handle.
        unsafe { cudarc::driver::result::device::get_mem_pool(ctx.cu_device()) }
            .map_err(|e| driver("cuDeviceGetMemPool", e))
    }

    /// The tile table of `spans` for a buffer of `n` elements, uploaded once and cached.
    fn spans(&self, spans: &[Span], n: usize) -> Result<Arc<DeviceSpans>, KernelError> {
        let key = (spans.to_vec(), n);
        let mut cache = self.spans.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = cache.get(&key) {
            return Ok(d.clone());
        }
        let d = Arc::new(self.kernels.upload_spans(&self.stream, spans, n)?);
        if cache.len() >= SPAN_CACHE_ENTRIES {
            cache.clear();
        }
        cache.insert(key, d.clone());
        Ok(d)
    }

    pub fn adamw_step(
        &self,
        args: &[Arg<'_>],
        spans: &[Span],
        cfg: &AdamWConfig,
        step: u64,
    ) -> Result<(), KernelError> {
        let ds = self.spans(spans, args[0].window.1)?;
        let s = &self.stream;
        with_pieces(s, args, |p| {
            let [mut p, g, mut m, mut v]: [DevPiece<'_>; 4] =
                p.try_into().map_err(|_| internal("param"))?;
            self.kernels.adamw_step(
                s,
                f32_mut(p.writable("param")?, "param")?,
                &g.f32_view("grad")?,
                f32_mut(m.writable("exp_avg")?, "exp_avg")?,
                f32_mut(v.writable("exp_avg_sq")?, "exp_avg_sq")?,
                &ds,
                cfg,
                step,
            )
        })
    }

    pub fn sgd_step(
        &self,
        args: &[Arg<'_>],
        spans: &[Span],
        cfg: &SgdConfig,
        step: u64,
    ) -> Result<(), KernelError> {
        let ds = self.spans(spans, args[0].window.1)?;
        let s = &self.stream;
        with_pieces(s, args, |p| {
            let mut it = p.into_iter();
            let (Some(mut p), Some(g)) = (it.next(), it.next()) else {
                return Err(internal("param"));
            };
            let mut b = it.next();
            let buf = match b.as_mut() {
                Some(b) => Some(f32_mut(b.writable("momentum_buf")?, "momentum_buf")?),
                None => None,
            };
            self.kernels.sgd_step(
                s,
                f32_mut(p.writable("param")?, "param")?,
                &g.f32_view("grad")?,
                buf,
                &ds,
                cfg,
                step,
            )
        })
    }

    pub fn sum_squares(&self, args: &[Arg<'_>], spans: &[Span]) -> Result<f64, KernelError> {
        let ds = self.spans(spans, args[0].window.1)?;
        let s = &self.stream;
        with_pieces(s, args, |p| {
            self.kernels.sum_squares(s, &p[0].f32_view("t")?, &ds)
        })
    }

    pub fn max_abs(&self, args: &[Arg<'_>], spans: &[Span]) -> Result<f32, KernelError> {
        let ds = self.spans(spans, args[0].window.1)?;
        let s = &self.stream;
        with_pieces(s, args, |p| {
            self.kernels.max_abs(s, &p[0].f32_view("t")?, &ds)
        })
    }

    pub fn scale(&self, args: &[Arg<'_>], a: f32) -> Result<(), KernelError> {
        let s = &self.stream;
        with_pieces(s, args, |mut p| {
            self.kernels.scale(s, f32_mut(p[0].writable("t")?, "t")?, a)
        })
    }

    pub fn div_scalar(&self, args: &[Arg<'_>], d: f32) -> Result<(), KernelError> {
        let s = &self.stream;
        with_pieces(s, args, |mut p| {
            self.kernels
                .div_scalar(s, f32_mut(p[0].writable("t")?, "t")?, d)
        })
    }

    pub fn zero(&self, args: &[Arg<'_>]) -> Result<(), KernelError> {
        let s = &self.stream;
        with_pieces(s, args, |mut p| {
            let call = "cuMemsetD8Async(zero)";
            match p[0].writable("t")? {
                DevMut::F32(v) => s.memset_zeros(v),
                DevMut::BF16(v) => s.memset_zeros(v),
                DevMut::F16(v) => s.memset_zeros(v),
                DevMut::F64(v) => s.memset_zeros(v),
            }
            .map_err(|e| driver(call, e))
        })
    }

    pub fn accumulate(&self, args: &[Arg<'_>]) -> Result<(), KernelError> {
        let s = &self.stream;
        with_pieces(s, args, |p| {
            let [mut d, src]: [DevPiece<'_>; 2] = p.try_into().map_err(|_| internal("dst"))?;
            let dst = f32_mut(d.writable("dst")?, "dst")?;
            match src.view() {
                DevRef::F32(x) => self.kernels.accumulate(s, dst, &x),
                DevRef::BF16(x) => self.kernels.accumulate_bf16(s, dst, &x),
                DevRef::F16(x) => self.kernels.accumulate_f16(s, dst, &x),
                DevRef::F64(x) => self.kernels.accumulate_f64(s, dst, &x),
            }
        })
    }

    pub fn cast_into(&self, args: &[Arg<'_>]) -> Result<(), KernelError> {
        let s = &self.stream;
        with_pieces(s, args, |p| {
            let [mut d, src]: [DevPiece<'_>; 2] = p.try_into().map_err(|_| internal("dst"))?;
            let x = src.f32_view("src")?;
            match d.writable("dst")? {
                DevMut::F32(y) => s
                    .memcpy_dtod(&x, y)
                    .map_err(|e| driver("cuMemcpyDtoDAsync(cast_into f32)", e)),
                DevMut::BF16(y) => self.kernels.cast_f32_to_bf16(s, &x, y),
                DevMut::F16(y) => self.kernels.cast_f32_to_f16(s, &x, y),
                DevMut::F64(_) => Err(internal("dst")),
            }
        })
    }

    pub fn copy_into(&self, args: &[Arg<'_>]) -> Result<(), KernelError> {
        let s = &self.stream;
        with_pieces(s, args, |p| {
            let [mut d, src]: [DevPiece<'_>; 2] = p.try_into().map_err(|_| internal("dst"))?;
            let call = "cuMemcpyDtoDAsync(copy_into)";
            match (d.writable("dst")?, src.view()) {
                (DevMut::F32(y), DevRef::F32(x)) => s.memcpy_dtod(&x, y),
                (DevMut::BF16(y), DevRef::BF16(x)) => s.memcpy_dtod(&x, y),
                (DevMut::F16(y), DevRef::F16(x)) => s.memcpy_dtod(&x, y),
                (DevMut::F64(y), DevRef::F64(x)) => s.memcpy_dtod(&x, y),
                _ => return Err(internal("src")),
            }
            .map_err(|e| driver(call, e))
        })
    }

    /// The buffer copied to the host (waits for the stream), widened on the host with the CPU
    /// cast kernels.
    pub fn to_f32(&self, args: &[Arg<'_>]) -> Result<Vec<f32>, KernelError> {
        let s = &self.stream;
        let call = "cuMemcpyDtoHAsync(to_f32)";
        let sync = || {
            s.synchronize()
                .map_err(|e| driver("cuStreamSynchronize", e))
        };
        with_pieces(s, args, |p| {
            let n = args[0].window.1;
            let mut out = vec![0.0f32; n];
            match p[0].view() {
                DevRef::F32(x) => {
                    s.memcpy_dtoh(&x, &mut out).map_err(|e| driver(call, e))?;
                    sync()?;
                }
                DevRef::BF16(x) => {
                    let h = s.clone_dtoh(&x).map_err(|e| driver(call, e))?;
                    sync()?;
                    cast::cast_bf16_to_f32(&h, &mut out)?;
                }
                DevRef::F16(x) => {
                    let h = s.clone_dtoh(&x).map_err(|e| driver(call, e))?;
                    sync()?;
                    cast::cast_f16_to_f32(&h, &mut out)?;
                }
                DevRef::F64(x) => {
                    let h = s.clone_dtoh(&x).map_err(|e| driver(call, e))?;
                    sync()?;
                    cast::cast_f64_to_f32(&h, &mut out)?;
                }
            }
            Ok(out)
        })
    }
}

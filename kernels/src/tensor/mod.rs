//! Flat-buffer kernels on candle tensors: the engine's flat buffers (fp32 master shards, fp32
//! gradient shards, optimizer state, all-gather buffers, flat gradients) living on a compute
//! device as candle [`Tensor`]s.
//!
//! A *buffer* here is any contiguous candle tensor: usually 1-D; a `narrow(0, start, len)` view
//! of a 1-D buffer is a buffer too (the layout's start offset is honoured), and so is a shaped
//! tensor such as a `[768, 768]` parameter (its elements in row-major order). Element counts are
//! elements (not bytes), spans ([`Span`]) are element ranges of the buffer as given.
//!
//! Every method runs in place: it writes the tensor's storage, so every tensor sharing that
//! storage sees the change (use it only on buffers no autograd graph holds). Each call takes
//! one lock per storage it touches, in a fixed (address) order, and never a read and a write
//! lock on one storage at once: arguments that share a storage (two narrows of one buffer, the
//! same tensor twice) are split disjointly out of one write lock; a read argument that overlaps
//! another window of a written storage is read from a copy taken first (so `accumulate(t, t)`
//! doubles `t`); two written arguments that overlap are an error
//! ([`KernelError::AliasedBuffers`]). Arguments are validated before anything is locked or
//! written: an error leaves every buffer unchanged.
//!
//! - On the CPU each method calls this crate's slice kernel on the locked storage, so results
//!   are bitwise those of [`crate::adamw_step`], [`crate::sgd_step`], [`crate::sum_squares`],
//!   [`crate::max_abs`], [`crate::scale`], [`crate::div_scalar`], [`crate::zero`],
//!   [`crate::accumulate`], [`crate::copy`] and the casts of [`crate::cast`].
//! - On CUDA (feature `cuda`) each method launches the NVRTC kernels of [`crate::cuda`]
//!   (`CudaKernels`, compiled once per `TensorKernels` in [`TensorKernels::new`]) on the
//!   `CudaSlice` inside candle's `CudaStorage`, on candle's own stream
//!   (`CudaDevice::cuda_stream()`), so they are ordered with the model's work on that device
//!   without any synchronisation; only the methods that return a host value ([`sum_squares`],
//!   [`max_abs`], [`to_f32`]) wait for the stream. Bounds against the CPU are those of the CUDA
//!   kernels' docstrings: bitwise equal except the f64 sum of squares (relative error at most
//!   gamma(n-1), n the number of span elements; deterministic).
//!
//! [`sum_squares`]: TensorKernels::sum_squares
//! [`max_abs`]: TensorKernels::max_abs
//! [`to_f32`]: TensorKernels::to_f32

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod lock;
mod seed;

use crate::buffer::FlatBuffer;
use crate::cast;
use crate::error::{check_len, KernelError};
use crate::optim::{AdamWConfig, SgdConfig};
use crate::span::{validate_spans, Span};
use candle_core::{DType as CandleDType, Device, Tensor};
use cpu::{Slice, SliceMut};
use fsdp_types::DType;
use half::{bf16, f16};
use lock::Arg;
pub use seed::backward_seed;

/// Elements converted per block when a 16-bit or f64 source is widened on the host (a stack
/// buffer: no allocation proportional to the buffer).
const WIDEN_BLOCK: usize = 4096;

/// candle's dtype for a `fsdp_types::DType` (f32, bf16, f16, f64 map one to one).
pub fn to_candle_dtype(d: DType) -> CandleDType {
    match d {
        DType::F32 => CandleDType::F32,
        DType::BF16 => CandleDType::BF16,
        DType::F16 => CandleDType::F16,
        DType::F64 => CandleDType::F64,
    }
}

/// The `fsdp_types::DType` of a candle dtype; `None` for dtypes flat buffers never have
/// (integers, 8-bit and smaller floats).
pub fn from_candle_dtype(d: CandleDType) -> Option<DType> {
    match d {
        CandleDType::F32 => Some(DType::F32),
        CandleDType::BF16 => Some(DType::BF16),
        CandleDType::F16 => Some(DType::F16),
        CandleDType::F64 => Some(DType::F64),
        _ => None,
    }
}

fn candle_err(call: String, e: candle_core::Error) -> KernelError {
    KernelError::Candle {
        call,
        message: e.to_string(),
    }
}

/// Device memory in use, in bytes (see [`TensorKernels::memory`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes allocated now.
    pub current: u64,
    /// Most bytes allocated at once since the last reset.
    pub peak: u64,
}

/// Flat-buffer kernels on candle tensors, per device. One per rank (no global state): on CPU
/// it holds nothing but the device; on CUDA it holds the compiled NVRTC module of this crate's
/// kernels for that device, candle's stream of the device, and a cache of uploaded span tables.
///
/// `Send + Sync`: the engine shares it (`Arc`) between a rank's threads. On CUDA, candle's
/// `Device::new_cuda(ordinal)` device computes on CUDA's *per-thread* default stream: a call
/// from another host thread than the model's runs on that thread's stream (unordered with the
/// model); `Device::new_cuda_with_stream(ordinal)` gives one explicit stream for every thread.
pub struct TensorKernels {
    device: Device,
    #[cfg(feature = "cuda")]
    cuda: Option<cuda::CudaState>,
}

impl std::fmt::Debug for TensorKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorKernels")
            .field("device", &self.device)
            .finish()
    }
}

/// The four f32 buffers of one AdamW step ([`TensorKernels::adamw_step`]), each N elements
/// on the kernels' device.
#[derive(Debug, Clone, Copy)]
pub struct AdamWTensors<'a> {
    /// The parameters, updated in place.
    pub param: &'a Tensor,
    /// The gradient, read.
    pub grad: &'a Tensor,
    /// The first moment, updated in place.
    pub exp_avg: &'a Tensor,
    /// The second moment, updated in place.
    pub exp_avg_sq: &'a Tensor,
}

/// What a validated argument is.
struct Checked {
    dtype: DType,
    numel: usize,
}

impl TensorKernels {
    /// Kernels for `device`: the CPU, or (feature `cuda`) a candle CUDA device, for which the
    /// CUDA kernels are compiled with NVRTC now (tens of milliseconds, once).
    ///
    /// Errors: [`KernelError::UnsupportedDevice`] for Metal, and for CUDA in a build without the
    /// `cuda` feature; [`KernelError::Device`] when NVRTC or the driver fails (its own text).
    pub fn new(device: &Device) -> Result<TensorKernels, KernelError> {
        match device {
            Device::Cpu => Ok(TensorKernels {
                device: device.clone(),
                #[cfg(feature = "cuda")]
                cuda: None,
            }),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => Ok(TensorKernels {
                device: device.clone(),
                cuda: Some(cuda::CudaState::new(d)?),
            }),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(KernelError::UnsupportedDevice {
                device: format!("{device:?}"),
                reason: "fsdp-kernels was built without the `cuda` feature",
            }),
            Device::Metal(_) => Err(KernelError::UnsupportedDevice {
                device: format!("{device:?}"),
                reason: "only CPU and CUDA devices have flat-buffer kernels",
            }),
        }
    }

    /// The device whose tensors these kernels take.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Blocks the host until the device has finished the work queued so far (kernels of this
    /// crate and candle's model work on the same stream); a no-op on the CPU, where every call
    /// has finished when it returns. Step timings read the clock after it.
    ///
    /// Errors: [`KernelError::Device`] with the driver's text (e.g. a failed kernel).
    pub fn synchronize(&self) -> Result<(), KernelError> {
        #[cfg(feature = "cuda")]
        if let Some(c) = &self.cuda {
            return c.synchronize();
        }
        Ok(())
    }

    /// Bytes allocated on the device now and at the peak since the last
    /// [`TensorKernels::reset_memory_peak`]: the device's current memory pool, which serves
    /// every stream-ordered allocation (`cuMemAllocAsync`: candle's tensors, these kernels'
    /// buffers); NCCL's and cuBLAS's own allocations and the CUDA context are not in it.
    /// `None` on the CPU.
    ///
    /// Errors: [`KernelError::Device`] with the driver's text.
    pub fn memory(&self) -> Result<Option<DeviceMemory>, KernelError> {
        #[cfg(feature = "cuda")]
        if let Some(c) = &self.cuda {
            let (current, peak) = c.pool_memory()?;
            return Ok(Some(DeviceMemory { current, peak }));
        }
        Ok(None)
    }

    /// Starts a new peak for [`TensorKernels::memory`] at the current use (no-op on the CPU).
    ///
    /// Errors: [`KernelError::Device`] with the driver's text.
    pub fn reset_memory_peak(&self) -> Result<(), KernelError> {
        #[cfg(feature = "cuda")]
        if let Some(c) = &self.cuda {
            return c.reset_pool_peak();
        }
        Ok(())
    }

    /// A new 1-D buffer of `numel` zeros of `dtype` on the device.
    ///
    /// Errors: [`KernelError::Candle`] (e.g. out of device memory).
    pub fn zeros(&self, dtype: DType, numel: usize) -> Result<Tensor, KernelError> {
        Tensor::zeros(numel, to_candle_dtype(dtype), &self.device)
            .map_err(|e| candle_err(format!("Tensor::zeros({numel}, {dtype})"), e))
    }

    /// A new 1-D buffer of `values.len()` elements of `dtype` on the device: each value rounded
    /// once to `dtype` on the host with the cast kernels' rounding (to nearest, ties to even;
    /// f64 exact), then copied to the device.
    ///
    /// Errors: [`KernelError::Candle`].
    pub fn from_f32(&self, values: &[f32], dtype: DType) -> Result<Tensor, KernelError> {
        let n = values.len();
        let call = || format!("Tensor::from_vec({n}, {dtype})");
        let t = match dtype {
            DType::F32 => Tensor::from_slice(values, n, &self.device),
            DType::BF16 => {
                let mut v = vec![bf16::ZERO; n];
                cast::cast_f32_to_bf16(values, &mut v)?;
                Tensor::from_vec(v, n, &self.device)
            }
            DType::F16 => {
                let mut v = vec![f16::ZERO; n];
                cast::cast_f32_to_f16(values, &mut v)?;
                Tensor::from_vec(v, n, &self.device)
            }
            DType::F64 => {
                let mut v = vec![0.0f64; n];
                cast::cast_f32_to_f64(values, &mut v)?;
                Tensor::from_vec(v, n, &self.device)
            }
        };
        t.map_err(|e| candle_err(call(), e))
    }

    /// The buffer's elements copied to the host as f32, in row-major order: f32 as is, bf16 and
    /// f16 widened exactly, f64 rounded to nearest even (`as f32`). On CUDA it waits for the
    /// device's stream.
    ///
    /// Errors: [`KernelError::NotContiguous`], [`KernelError::DeviceMismatch`],
    /// [`KernelError::UnsupportedDType`]; [`KernelError::Device`] (CUDA).
    pub fn to_f32(&self, t: &Tensor) -> Result<Vec<f32>, KernelError> {
        let c = self.check(t, "t", None)?;
        if c.numel == 0 {
            return Ok(Vec::new());
        }
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.cuda {
            return k.to_f32(&[Arg::read(t, "t")]);
        }
        cpu::with_pieces(&[Arg::read(t, "t")], |p| {
            let mut out = vec![0.0f32; c.numel];
            match p[0].slice() {
                Slice::F32(s) => out.copy_from_slice(s),
                Slice::BF16(s) => cast::cast_bf16_to_f32(s, &mut out)?,
                Slice::F16(s) => cast::cast_f16_to_f32(s, &mut out)?,
                Slice::F64(s) => cast::cast_f64_to_f32(s, &mut out)?,
            }
            Ok(out)
        })
    }

    /// One AdamW step in place, the tensor form of [`crate::adamw_step`] (same semantics, same
    /// operation order; Loshchilov & Hutter 2019, Algorithm 2): `param`, `grad`, `exp_avg`,
    /// `exp_avg_sq` are f32 buffers of N elements each; only elements inside `spans` are read or
    /// written. CPU: bitwise [`crate::adamw_step`]; CUDA: bitwise equal to it.
    ///
    /// Errors (nothing written): [`KernelError::NotContiguous`], [`KernelError::DeviceMismatch`],
    /// [`KernelError::DTypeMismatch`] (not f32), [`KernelError::LengthMismatch`],
    /// [`KernelError::SpanOutOfBounds`], [`KernelError::SpansOverlap`],
    /// [`KernelError::InvalidHyperparameter`], [`KernelError::ZeroStep`],
    /// [`KernelError::AliasedBuffers`]; [`KernelError::Device`] (CUDA).
    pub fn adamw_step(
        &self,
        t: AdamWTensors<'_>,
        spans: &[Span],
        cfg: &AdamWConfig,
        step: u64,
    ) -> Result<(), KernelError> {
        let AdamWTensors {
            param,
            grad,
            exp_avg,
            exp_avg_sq,
        } = t;
        let n = self.check_f32(param, "param")?;
        check_len("grad", n, self.check_f32(grad, "grad")?)?;
        check_len("exp_avg", n, self.check_f32(exp_avg, "exp_avg")?)?;
        check_len("exp_avg_sq", n, self.check_f32(exp_avg_sq, "exp_avg_sq")?)?;
        validate_spans(spans, n)?;
        cfg.scalars(step)?;
        if spans.iter().all(|s| s.len == 0) {
            return Ok(());
        }
        let args = [
            Arg::write(param, "param"),
            Arg::read(grad, "grad"),
            Arg::write(exp_avg, "exp_avg"),
            Arg::write(exp_avg_sq, "exp_avg_sq"),
        ];
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.cuda {
            return k.adamw_step(&args, spans, cfg, step);
        }
        cpu::with_pieces(&args, |p| {
            let [p, g, m, v] = four(p)?;
            crate::adamw_step(
                p.f32_mut("param")?,
                g.f32("grad")?,
                m.f32_mut("exp_avg")?,
                v.f32_mut("exp_avg_sq")?,
                spans,
                cfg,
                step,
            )
        })
    }

    /// One SGD step in place, the tensor form of [`crate::sgd_step`] (PyTorch SGD semantics,
    /// dampening 0, no Nesterov): `param`, `grad` and `momentum` (the momentum buffer) are f32
    /// buffers of N elements; `momentum` may be `None` only when `cfg.momentum == 0` (a given
    /// buffer is then neither read nor written). Only elements inside `spans` change. CPU:
    /// bitwise [`crate::sgd_step`]; CUDA: bitwise equal to it.
    ///
    /// Errors (nothing written): as [`TensorKernels::adamw_step`]; a missing momentum buffer
    /// with `cfg.momentum > 0` is [`KernelError::LengthMismatch`] (`momentum_buf`, N expected,
    /// 0 given), as the slice kernel reports it.
    pub fn sgd_step(
        &self,
        param: &Tensor,
        grad: &Tensor,
        momentum: Option<&Tensor>,
        spans: &[Span],
        cfg: &SgdConfig,
        step: u64,
    ) -> Result<(), KernelError> {
        let n = self.check_f32(param, "param")?;
        check_len("grad", n, self.check_f32(grad, "grad")?)?;
        cfg.validate()?;
        let use_momentum = cfg.momentum > 0.0;
        let buf_len = match momentum {
            Some(b) => self.check_f32(b, "momentum_buf")?,
            None => 0,
        };
        if use_momentum || buf_len != 0 {
            check_len("momentum_buf", n, buf_len)?;
        }
        validate_spans(spans, n)?;
        if step == 0 {
            return Err(KernelError::ZeroStep { step });
        }
        if spans.iter().all(|s| s.len == 0) {
            return Ok(());
        }
        let mut args = vec![Arg::write(param, "param"), Arg::read(grad, "grad")];
        if let (true, Some(b)) = (use_momentum, momentum) {
            args.push(Arg::write(b, "momentum_buf"));
        }
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.cuda {
            return k.sgd_step(&args, spans, cfg, step);
        }
        cpu::with_pieces(&args, |p| {
            let mut it = p.into_iter();
            let (Some(p), Some(g)) = (it.next(), it.next()) else {
                return Err(missing("param"));
            };
            let b: &mut [f32] = match it.next() {
                Some(b) => b.f32_mut("momentum_buf")?,
                None => &mut [],
            };
            crate::sgd_step(p.f32_mut("param")?, g.f32("grad")?, b, spans, cfg, step)
        })
    }

    /// Sum of squares of the f32 buffer's elements inside `spans`, in f64 (the local part of the
    /// global L2 gradient norm; Pascanu et al. 2013, section 3.2). CPU: bitwise
    /// [`crate::sum_squares`] (sequential); CUDA: a fixed tree order, deterministic, relative
    /// error vs the CPU at most gamma(n-1) = (n-1)u/(1-(n-1)u), u = 2^-53, n = span elements.
    ///
    /// Errors: [`KernelError::NotContiguous`], [`KernelError::DeviceMismatch`],
    /// [`KernelError::DTypeMismatch`], [`KernelError::SpanOutOfBounds`],
    /// [`KernelError::SpansOverlap`]; [`KernelError::Device`] (CUDA).
    pub fn sum_squares(&self, t: &Tensor, spans: &[Span]) -> Result<f64, KernelError> {
        let n = self.check_f32(t, "t")?;
        validate_spans(spans, n)?;
        if spans.iter().all(|s| s.len == 0) {
            return Ok(0.0);
        }
        let args = [Arg::read(t, "t")];
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.cuda {
            return k.sum_squares(&args, spans);
        }
        cpu::with_pieces(&args, |p| crate::sum_squares(p[0].f32("t")?, spans))
    }

    /// Largest absolute value of the f32 buffer's elements inside `spans` (NaN if any is NaN,
    /// 0.0 when the spans are empty): bitwise [`crate::max_abs`] on CPU and CUDA.
    ///
    /// Errors: as [`TensorKernels::sum_squares`].
    pub fn max_abs(&self, t: &Tensor, spans: &[Span]) -> Result<f32, KernelError> {
        let n = self.check_f32(t, "t")?;
        validate_spans(spans, n)?;
        if spans.iter().all(|s| s.len == 0) {
            return Ok(0.0);
        }
        let args = [Arg::read(t, "t")];
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.cuda {
            return k.max_abs(&args, spans);
        }
        cpu::with_pieces(&args, |p| crate::max_abs(p[0].f32("t")?, spans))
    }

    /// `t[i] *= a` on every element of the f32 buffer (padding included; padding stays 0):
    /// bitwise [`crate::scale`] on CPU and CUDA.
    ///
    /// Errors: [`KernelError::NotContiguous`], [`KernelError::DeviceMismatch`],
    /// [`KernelError::DTypeMismatch`]; [`KernelError::Device`] (CUDA).
    pub fn scale(&self, t: &Tensor, a: f32) -> Result<(), KernelError> {
        if self.check_f32(t, "t")? == 0 {
            return Ok(());
        }
        let args = [Arg::write(t, "t")];
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.cuda {
            return k.scale(&args, a);
        }
        cpu::with_pieces(&args, |p| {
            crate::scale(one(p)?.f32_mut("t")?, a);
            Ok(())
        })
    }

    /// `t[i] /= d` on every element of the f32 buffer (one rounding; the engine's division of
    /// the gradient by the token count): bitwise [`crate::div_scalar`] on CPU and CUDA.
    ///
    /// Errors: as [`TensorKernels::scale`].
    pub fn div_scalar(&self, t: &Tensor, d: f32) -> Result<(), KernelError> {
        if self.check_f32(t, "t")? == 0 {
            return Ok(());
        }
        let args = [Arg::write(t, "t")];
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.cuda {
            return k.div_scalar(&args, d);
        }
        cpu::with_pieces(&args, |p| {
            crate::div_scalar(one(p)?.f32_mut("t")?, d);
            Ok(())
        })
    }

    /// Sets every element of the buffer to +0 (any of f32, bf16, f16, f64: all bits zero).
    ///
    /// Errors: [`KernelError::NotContiguous`], [`KernelError::DeviceMismatch`],
    /// [`KernelError::UnsupportedDType`]; [`KernelError::Device`] (CUDA).
    pub fn zero(&self, t: &Tensor) -> Result<(), KernelError> {
        if self.check(t, "t", None)?.numel == 0 {
            return Ok(());
        }
        let args = [Arg::write(t, "t")];
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.cuda {
            return k.zero(&args);
        }
        cpu::with_pieces(&args, |p| {
            match one(p)?.into_mut("t")? {
                SliceMut::F32(s) => crate::zero(s),
                SliceMut::BF16(s) => s.fill(bf16::ZERO),
                SliceMut::F16(s) => s.fill(f16::ZERO),
                SliceMut::F64(s) => s.fill(0.0),
            }
            Ok(())
        })
    }

    /// Gradient accumulation `dst[i] += widen(src[i])`: `dst` an f32 buffer of N elements, `src`
    /// N elements of f32, bf16, f16 (widened exactly) or f64 (rounded to f32 first, `as f32`),
    /// then one f32 addition per element. CPU: bitwise [`crate::accumulate`] of the widened
    /// source; CUDA: bitwise equal. `src` may share `dst`'s storage (`accumulate(t, t)` doubles
    /// `t`): an overlapping source is read as it was before the call.
    ///
    /// Errors (nothing written): [`KernelError::NotContiguous`], [`KernelError::DeviceMismatch`],
    /// [`KernelError::DTypeMismatch`] (`dst` not f32), [`KernelError::UnsupportedDType`] (`src`),
    /// [`KernelError::LengthMismatch`]; [`KernelError::Device`] (CUDA).
    pub fn accumulate(&self, dst: &Tensor, src: &Tensor) -> Result<(), KernelError> {
        let n = self.check_f32(dst, "dst")?;
        check_len("src", n, self.check(src, "src", None)?.numel)?;
        if n == 0 {
            return Ok(());
        }
        let args = [Arg::write(dst, "dst"), Arg::read(src, "src")];
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.cuda {
            return k.accumulate(&args);
        }
        cpu::with_pieces(&args, |p| {
            let [d, s] = two(p)?;
            let s = s.slice();
            let d = d.f32_mut("dst")?;
            match s {
                Slice::F32(s) => crate::accumulate(d, s),
                Slice::BF16(s) => widen_accumulate(d, s, cast::cast_bf16_to_f32),
                Slice::F16(s) => widen_accumulate(d, s, cast::cast_f16_to_f32),
                Slice::F64(s) => widen_accumulate(d, s, cast::cast_f64_to_f32),
            }
        })
    }

    /// `dst[dst_offset + i] = round(src[i])` for the N elements of the f32 buffer `src`: `dst`
    /// is f32 (a copy), bf16 or f16 (rounded to nearest, ties to even: the cast kernels,
    /// [`crate::cast::cast_f32_to_bf16`] / [`crate::cast::cast_f32_to_f16`]; CUDA bitwise equal,
    /// NaN stays NaN). Elements of `dst` outside the window are not touched. `src` may share
    /// `dst`'s storage; an overlapping source is read as it was before the call.
    ///
    /// Errors (nothing written): [`KernelError::NotContiguous`], [`KernelError::DeviceMismatch`],
    /// [`KernelError::DTypeMismatch`] (`src` not f32), [`KernelError::UnsupportedDType`] (`dst`
    /// f64), [`KernelError::OffsetOutOfRange`]; [`KernelError::Device`] (CUDA).
    pub fn cast_into(
        &self,
        dst: &Tensor,
        dst_offset: usize,
        src: &Tensor,
    ) -> Result<(), KernelError> {
        let n = self.check_f32(src, "src")?;
        let d = self.check(dst, "dst", Some(&[DType::F32, DType::BF16, DType::F16]))?;
        check_window("dst", dst_offset, n, d.numel)?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            Arg::write_window(dst, "dst", dst_offset, n),
            Arg::read(src, "src"),
        ];
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.cuda {
            return k.cast_into(&args);
        }
        cpu::with_pieces(&args, |p| {
            let [d, s] = two(p)?;
            let s = s.slice();
            let Slice::F32(s) = s else {
                return Err(missing("src"));
            };
            match d.into_mut("dst")? {
                SliceMut::F32(d) => crate::copy(d, s),
                SliceMut::BF16(d) => cast::cast_f32_to_bf16(s, d),
                SliceMut::F16(d) => cast::cast_f32_to_f16(s, d),
                SliceMut::F64(_) => Err(missing("dst")),
            }
        })
    }

    /// `dst[dst_offset + i] = src[i]`, bit for bit, for the N elements of `src` (any contiguous
    /// shape, row-major order) into the window of `dst` (same dtype: f32, bf16, f16 or f64).
    /// `src` may share `dst`'s storage (a move within one buffer); an overlapping source is read
    /// as it was before the call (like `memmove`).
    ///
    /// Errors (nothing written): [`KernelError::NotContiguous`], [`KernelError::DeviceMismatch`],
    /// [`KernelError::DTypeMismatch`], [`KernelError::UnsupportedDType`],
    /// [`KernelError::OffsetOutOfRange`]; [`KernelError::Device`] (CUDA).
    pub fn copy_into(
        &self,
        dst: &Tensor,
        dst_offset: usize,
        src: &Tensor,
    ) -> Result<(), KernelError> {
        let d = self.check(dst, "dst", None)?;
        let s = self.check(src, "src", Some(&[d.dtype]))?;
        check_window("dst", dst_offset, s.numel, d.numel)?;
        if s.numel == 0 {
            return Ok(());
        }
        let args = [
            Arg::write_window(dst, "dst", dst_offset, s.numel),
            Arg::read(src, "src"),
        ];
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.cuda {
            return k.copy_into(&args);
        }
        cpu::with_pieces(&args, |p| {
            let [d, s] = two(p)?;
            let s = s.slice();
            match (d.into_mut("dst")?, s) {
                (SliceMut::F32(d), Slice::F32(s)) => crate::copy(d, s),
                (SliceMut::BF16(d), Slice::BF16(s)) => crate::copy(d, s),
                (SliceMut::F16(d), Slice::F16(s)) => crate::copy(d, s),
                (SliceMut::F64(d), Slice::F64(s)) => crate::copy(d, s),
                _ => Err(missing("src")),
            }
        })
    }

    /// Host-to-device copy: `dst[dst_offset + i] = src[i]` for `i < n`, bit for bit, from the
    /// first `n` elements of the host buffer `src` (same dtype as `dst`) into the window of the
    /// device buffer `dst`. On the CPU the window is written in place; on CUDA the elements go
    /// through a device tensor of `n` elements and [`TensorKernels::copy_into`] (see
    /// [`TensorKernels::upload_via_tensor`]).
    ///
    /// Errors (nothing written): [`KernelError::LengthMismatch`] (`n` beyond `src`),
    /// [`KernelError::NotContiguous`], [`KernelError::DeviceMismatch`],
    /// [`KernelError::DTypeMismatch`], [`KernelError::OffsetOutOfRange`];
    /// [`KernelError::Device`] (CUDA).
    pub fn upload(
        &self,
        dst: &Tensor,
        dst_offset: usize,
        src: &FlatBuffer,
        n: usize,
    ) -> Result<(), KernelError> {
        if n > src.len() {
            return Err(KernelError::LengthMismatch {
                what: "src",
                expected: n,
                actual: src.len(),
            });
        }
        let d = self.check(dst, "dst", Some(&[src.dtype()]))?;
        check_window("dst", dst_offset, n, d.numel)?;
        if n == 0 {
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        if self.cuda.is_some() {
            return self.upload_via_tensor(dst, dst_offset, src, n);
        }
        let args = [Arg::write_window(dst, "dst", dst_offset, n)];
        cpu::with_pieces(&args, |p| {
            let [d] = <[_; 1]>::try_from(p).map_err(|_| missing("dst"))?;
            match (d.into_mut("dst")?, src) {
                (SliceMut::F32(d), FlatBuffer::F32(s)) => crate::copy(d, &s[..n]),
                (SliceMut::BF16(d), FlatBuffer::BF16(s)) => crate::copy(d, &s[..n]),
                (SliceMut::F16(d), FlatBuffer::F16(s)) => crate::copy(d, &s[..n]),
                (SliceMut::F64(d), FlatBuffer::F64(s)) => crate::copy(d, &s[..n]),
                _ => Err(missing("src")),
            }
        })
    }

    /// [`TensorKernels::upload`] through a device tensor: the first `n` elements of `src`
    /// become a new device tensor (candle's host-to-device copy), which
    /// [`TensorKernels::copy_into`] writes into the window. The path a device without direct
    /// host writes takes; on the CPU it gives the same bits with one more buffer.
    ///
    /// Errors: as [`TensorKernels::upload`]; [`KernelError::Candle`].
    pub fn upload_via_tensor(
        &self,
        dst: &Tensor,
        dst_offset: usize,
        src: &FlatBuffer,
        n: usize,
    ) -> Result<(), KernelError> {
        let call = || format!("Tensor::from_slice({n})");
        let t = match src {
            FlatBuffer::F32(s) => Tensor::from_slice(&s[..n], n, &self.device),
            FlatBuffer::BF16(s) => Tensor::from_slice(&s[..n], n, &self.device),
            FlatBuffer::F16(s) => Tensor::from_slice(&s[..n], n, &self.device),
            FlatBuffer::F64(s) => Tensor::from_slice(&s[..n], n, &self.device),
        }
        .map_err(|e| candle_err(call(), e))?;
        self.copy_into(dst, dst_offset, &t)
    }

    /// Device-to-host copy: the elements of the device buffer `src` into the first
    /// `src.elem_count()` elements of the host buffer `dst` (same dtype), bit for bit. On CUDA
    /// it waits for the device's stream.
    ///
    /// Errors (nothing written): [`KernelError::LengthMismatch`] (`dst` too short),
    /// [`KernelError::NotContiguous`], [`KernelError::DeviceMismatch`],
    /// [`KernelError::DTypeMismatch`]; [`KernelError::Device`] (CUDA), [`KernelError::Candle`].
    pub fn download(&self, src: &Tensor, dst: &mut FlatBuffer) -> Result<(), KernelError> {
        let c = self.check(src, "src", Some(&[dst.dtype()]))?;
        let n = c.numel;
        if n > dst.len() {
            return Err(KernelError::LengthMismatch {
                what: "dst",
                expected: n,
                actual: dst.len(),
            });
        }
        if n == 0 {
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        if self.cuda.is_some() {
            let call = || format!("Tensor::to_vec1({n})");
            let flat = src.flatten_all().map_err(|e| candle_err(call(), e))?;
            return match dst {
                FlatBuffer::F32(d) => flat.to_vec1::<f32>().map(|v| d[..n].copy_from_slice(&v)),
                FlatBuffer::BF16(d) => flat.to_vec1::<bf16>().map(|v| d[..n].copy_from_slice(&v)),
                FlatBuffer::F16(d) => flat.to_vec1::<f16>().map(|v| d[..n].copy_from_slice(&v)),
                FlatBuffer::F64(d) => flat.to_vec1::<f64>().map(|v| d[..n].copy_from_slice(&v)),
            }
            .map_err(|e| candle_err(call(), e));
        }
        cpu::with_pieces(&[Arg::read(src, "src")], |p| match (p[0].slice(), dst) {
            (Slice::F32(s), FlatBuffer::F32(d)) => crate::copy(&mut d[..n], s),
            (Slice::BF16(s), FlatBuffer::BF16(d)) => crate::copy(&mut d[..n], s),
            (Slice::F16(s), FlatBuffer::F16(d)) => crate::copy(&mut d[..n], s),
            (Slice::F64(s), FlatBuffer::F64(d)) => crate::copy(&mut d[..n], s),
            _ => Err(missing("dst")),
        })
    }

    /// Checks that `t` is a buffer these kernels can take: on this device, contiguous, of a
    /// float dtype (one of `allowed` when given: else [`KernelError::DTypeMismatch`] when one
    /// dtype is allowed, [`KernelError::UnsupportedDType`] otherwise).
    fn check(
        &self,
        t: &Tensor,
        what: &'static str,
        allowed: Option<&[DType]>,
    ) -> Result<Checked, KernelError> {
        if !t.device().same_device(&self.device) {
            return Err(KernelError::DeviceMismatch {
                what,
                expected: format!("{:?}", self.device),
                actual: format!("{:?}", t.device()),
            });
        }
        let Some(dtype) = from_candle_dtype(t.dtype()) else {
            return Err(KernelError::UnsupportedDType {
                what,
                dtype: t.dtype().as_str().to_string(),
                supported: "f32, bf16, f16, f64",
            });
        };
        match allowed {
            Some([one]) if *one != dtype => {
                return Err(KernelError::DTypeMismatch {
                    what,
                    expected: *one,
                    actual: dtype,
                })
            }
            Some(list) if !list.contains(&dtype) => {
                return Err(KernelError::UnsupportedDType {
                    what,
                    dtype: dtype.name().to_string(),
                    supported: "f32, bf16, f16",
                })
            }
            _ => {}
        }
        if !t.is_contiguous() {
            return Err(KernelError::NotContiguous {
                what,
                shape: t.dims().to_vec(),
                stride: t.stride().to_vec(),
            });
        }
        Ok(Checked {
            dtype,
            numel: t.elem_count(),
        })
    }

    /// [`TensorKernels::check`] for an f32 buffer; its element count.
    fn check_f32(&self, t: &Tensor, what: &'static str) -> Result<usize, KernelError> {
        Ok(self.check(t, what, Some(&[DType::F32]))?.numel)
    }
}

/// [`KernelError::OffsetOutOfRange`] unless `[offset, offset + len)` lies inside `buffer_len`.
fn check_window(
    what: &'static str,
    offset: usize,
    len: usize,
    buffer_len: usize,
) -> Result<(), KernelError> {
    if offset.checked_add(len).is_some_and(|e| e <= buffer_len) {
        Ok(())
    } else {
        Err(KernelError::OffsetOutOfRange {
            what,
            offset,
            len,
            buffer_len,
        })
    }
}

/// An argument the locking did not hand back as expected (cannot happen after validation;
/// reported, never a panic).
fn missing(what: &'static str) -> KernelError {
    KernelError::UnsupportedDType {
        what,
        dtype: "an unexpected storage".into(),
        supported: "the validated dtype",
    }
}

fn one<T>(v: Vec<T>) -> Result<T, KernelError> {
    v.into_iter().next().ok_or(missing("t"))
}

fn two<T>(v: Vec<T>) -> Result<[T; 2], KernelError> {
    v.try_into().map_err(|_| missing("dst/src"))
}

fn four<T>(v: Vec<T>) -> Result<[T; 4], KernelError> {
    v.try_into()
        .map_err(|_| missing("param/grad/exp_avg/exp_avg_sq"))
}

/// `dst[i] += widen(src[i])` through a stack block of [`WIDEN_BLOCK`] f32: the widening cast
/// kernel, then [`crate::accumulate`] (so bitwise the host path `accumulate(dst, widened)`).
fn widen_accumulate<S>(
    dst: &mut [f32],
    src: &[S],
    widen: fn(&[S], &mut [f32]) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    check_len("src", dst.len(), src.len())?;
    let mut block = [0.0f32; WIDEN_BLOCK];
    for (d, s) in dst.chunks_mut(WIDEN_BLOCK).zip(src.chunks(WIDEN_BLOCK)) {
        let b = &mut block[..s.len()];
        widen(s, b)?;
        crate::accumulate(d, b)?;
    }
    Ok(())
}

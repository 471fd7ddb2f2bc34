//! The device side (feature `cuda`): [`CudaKernels`] compiles [`super::SOURCE`] with NVRTC at
//! first use on its context and launches the kernels on caller-given streams.

use super::{
    grid_1d, tile_grid, tile_words, tiles_for_spans, Probe, BLOCK, KERNEL_NAMES, NVRTC_OPTIONS,
    SOURCE,
};
use crate::error::{check_len, KernelError};
use crate::optim::{AdamWConfig, SgdConfig};
use crate::span::Span;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DriverError,
    LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions};
use half::{bf16, f16};
use std::sync::{Arc, Mutex};

/// A CUDA driver error as [`KernelError::Device`], with the driver's own text.
pub(crate) fn driver_error(call: &str, e: DriverError) -> KernelError {
    let text = match e.error_string() {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => format!("CUresult {:?}", e.0),
    };
    KernelError::Device {
        call: call.to_string(),
        message: text,
    }
}

fn nvrtc_error(e: CompileError) -> KernelError {
    let message = match &e {
        CompileError::CompileError { nvrtc, log, .. } => {
            format!("{nvrtc:?}: {}", log.to_string_lossy())
        }
        other => format!("{other:?}"),
    };
    KernelError::Device {
        call: "nvrtcCompileProgram(fsdp kernels)".into(),
        message,
    }
}

/// The driver's device count, or why there is none (see [`super::probe`]).
pub(crate) fn probe() -> Probe {
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Probe::Available(n as usize),
        Ok(_) => Probe::Unavailable("the CUDA driver reports 0 devices".into()),
        Err(e) => Probe::Unavailable(driver_error("cuInit / cuDeviceGetCount", e).to_string()),
    }
}

/// The driver's name of device `ordinal` (`cuDeviceGetName` through its primary context).
pub(crate) fn device_name(ordinal: usize) -> Option<String> {
    CudaContext::new(ordinal).ok()?.name().ok()
}

/// The loaded module's functions, in [`KERNEL_NAMES`] order.
struct Loaded {
    f: Vec<CudaFunction>,
}

impl Loaded {
    fn get(&self, name: &str) -> &CudaFunction {
        let i = KERNEL_NAMES
            .iter()
            .position(|n| *n == name)
            .expect("a kernel of KERNEL_NAMES");
        &self.f[i]
    }
}

/// The CUDA kernels of this crate on one device context.
///
/// Created cheaply with [`CudaKernels::new`]; the first kernel call compiles [`super::SOURCE`]
/// with NVRTC for the device's compute capability (`--gpu-architecture=compute_XY`, options
/// [`super::NVRTC_OPTIONS`]) and loads it into the context (tens of milliseconds, once). Every
/// kernel is enqueued on the `stream` argument and returns without waiting, except
/// [`CudaKernels::sum_squares`], which returns the value (it synchronizes the stream). Buffers
/// are cudarc views of `f32` (or `bf16` / `f16`) device memory; with cudarc's event tracking a
/// view used on another stream is waited for automatically.
pub struct CudaKernels {
    ctx: Arc<CudaContext>,
    loaded: Mutex<Option<Arc<Loaded>>>,
}

impl std::fmt::Debug for CudaKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKernels")
            .field("ordinal", &self.ctx.ordinal())
            .finish()
    }
}

/// A span list uploaded as a tile table (see [`super::tiles_for_spans`]), for a buffer of
/// `buffer_len` elements. Upload once per flat-parameter shard, reuse every step.
#[derive(Debug)]
pub struct DeviceSpans {
    tiles: CudaSlice<u64>,
    n_tiles: u32,
    buffer_len: usize,
    numel: usize,
}

impl DeviceSpans {
    /// Number of tiles.
    pub fn n_tiles(&self) -> usize {
        self.n_tiles as usize
    }
    /// Elements of the buffer the spans describe (padding included).
    pub fn buffer_len(&self) -> usize {
        self.buffer_len
    }
    /// Real (non-padding) elements: the sum of the span lengths.
    pub fn numel(&self) -> usize {
        self.numel
    }
}

fn cfg(blocks: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaKernels {
    /// Kernels for the device of `ctx` (nothing is compiled yet).
    pub fn new(ctx: Arc<CudaContext>) -> CudaKernels {
        CudaKernels {
            ctx,
            loaded: Mutex::new(None),
        }
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Compiles and loads the module on first use.
    fn loaded(&self) -> Result<Arc<Loaded>, KernelError> {
        let mut slot = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = slot.as_ref() {
            return Ok(l.clone());
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        let (major, minor) = self
            .ctx
            .compute_capability()
            .map_err(|e| driver_error("cuDeviceGetAttribute(compute capability)", e))?;
        let mut options: Vec<String> = NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect();
        options.push(format!("--gpu-architecture=compute_{major}{minor}"));
        let ptx = compile_ptx_with_opts(
            SOURCE,
            CompileOptions {
                options,
                name: Some("fsdp_kernels.cu".into()),
                ..Default::default()
            },
        )
        .map_err(nvrtc_error)?;
        let module = self
            .ctx
            .load_module(ptx)
            .map_err(|e| driver_error("cuModuleLoadData(fsdp kernels)", e))?;
        let f = KERNEL_NAMES
            .iter()
            .map(|n| {
                module
                    .load_function(n)
                    .map_err(|e| driver_error(&format!("cuModuleGetFunction({n})"), e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let l = Arc::new(Loaded { f });
        *slot = Some(l.clone());
        Ok(l)
    }

    /// Uploads `spans` (sorted, disjoint, inside `buffer_len` elements) as a tile table on
    /// `stream`.
    ///
    /// Errors: [`KernelError::SpanOutOfBounds`], [`KernelError::SpansOverlap`],
    /// [`KernelError::Device`] (allocation / copy, or more than 2^32 - 1 tiles).
    pub fn upload_spans(
        &self,
        stream: &Arc<CudaStream>,
        spans: &[Span],
        buffer_len: usize,
    ) -> Result<DeviceSpans, KernelError> {
        let tiles = tiles_for_spans(spans, buffer_len)?;
        let n_tiles = u32::try_from(tiles.len()).map_err(|_| KernelError::Device {
            call: "upload_spans".into(),
            message: format!("{} tiles exceed 2^32 - 1", tiles.len()),
        })?;
        let mut words = tile_words(&tiles);
        if words.is_empty() {
            words.extend([0, 0]); // a valid pointer for an empty table (never read: 0 tiles)
        }
        let dev = stream
            .clone_htod(&words)
            .map_err(|e| driver_error("cuMemcpyHtoDAsync(tile table)", e))?;
        Ok(DeviceSpans {
            tiles: dev,
            n_tiles,
            buffer_len,
            numel: spans.iter().map(|s| s.len).sum(),
        })
    }

    /// One AdamW step on the device, the CUDA twin of [`crate::adamw_step`]: same scalars
    /// ([`AdamWConfig::scalars`], computed once in f64 on the host), same per-element operation
    /// order, elements outside `spans` (padding) neither read nor written.
    ///
    /// Shapes: `param`, `grad`, `exp_avg`, `exp_avg_sq`: N = `spans.buffer_len()` fp32 elements.
    /// Enqueued on `stream`. Bound vs the CPU: bitwise equal.
    ///
    /// Errors: [`KernelError::LengthMismatch`], [`KernelError::InvalidHyperparameter`],
    /// [`KernelError::ZeroStep`] (nothing enqueued); [`KernelError::Device`].
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_step(
        &self,
        stream: &Arc<CudaStream>,
        param: &mut CudaViewMut<'_, f32>,
        grad: &CudaView<'_, f32>,
        exp_avg: &mut CudaViewMut<'_, f32>,
        exp_avg_sq: &mut CudaViewMut<'_, f32>,
        spans: &DeviceSpans,
        cfg_: &AdamWConfig,
        step: u64,
    ) -> Result<(), KernelError> {
        let n = spans.buffer_len;
        check_len("param", n, param.len())?;
        check_len("grad", n, grad.len())?;
        check_len("exp_avg", n, exp_avg.len())?;
        check_len("exp_avg_sq", n, exp_avg_sq.len())?;
        let s = cfg_.scalars(step)?;
        if spans.n_tiles == 0 {
            return Ok(());
        }
        let l = self.loaded()?;
        let f = l.get("fsdp_adamw_tiles");
        let mut b = stream.launch_builder(f);
        b.arg(param)
            .arg(grad)
            .arg(exp_avg)
            .arg(exp_avg_sq)
            .arg(&spans.tiles)
            .arg(&spans.n_tiles)
            .arg(&s.decay_factor)
            .arg(&s.one_minus_beta1)
            .arg(&s.beta2)
            .arg(&s.one_minus_beta2)
            .arg(&s.step_size)
            .arg(&s.bias_correction2_sqrt)
            .arg(&s.eps);
        // SAFETY: argument list matches fsdp_adamw_tiles; every tile lies inside the buffers
        // (validated by tiles_for_spans against buffer_len, which all four lengths equal).
        unsafe { b.launch(cfg(tile_grid(spans.n_tiles as usize))) }
            .map_err(|e| driver_error("cuLaunchKernel(fsdp_adamw_tiles)", e))?;
        Ok(())
    }

    /// Sum of squares of the elements of `x` inside `spans`, accumulated in f64, the CUDA twin
    /// of [`crate::sum_squares`]: per tile a strided per-thread sum and a fixed binary tree, then
    /// the tile sums in one block the same way. Deterministic; relative error vs the CPU's
    /// sequential sum at most gamma(n-1) = (n-1)u/(1-(n-1)u), u = 2^-53, n = `spans.numel()`.
    /// Enqueued on `stream`, which is then synchronized to read the value back.
    ///
    /// Errors: [`KernelError::LengthMismatch`]; [`KernelError::Device`].
    pub fn sum_squares(
        &self,
        stream: &Arc<CudaStream>,
        x: &CudaView<'_, f32>,
        spans: &DeviceSpans,
    ) -> Result<f64, KernelError> {
        let mut out = stream
            .alloc_zeros::<f64>(1)
            .map_err(|e| driver_error("cuMemAllocAsync(1 x f64)", e))?;
        self.sum_squares_into(stream, x, spans, &mut out.slice_mut(..))?;
        let v = stream
            .clone_dtoh(&out)
            .map_err(|e| driver_error("cuMemcpyDtoHAsync(1 x f64)", e))?;
        stream
            .synchronize()
            .map_err(|e| driver_error("cuStreamSynchronize", e))?;
        Ok(v[0])
    }

    /// Like [`CudaKernels::sum_squares`], writing the f64 result into `out[0]` on the device
    /// without synchronizing (the engine adds the units' sums on the device, one read per step).
    ///
    /// Errors: [`KernelError::LengthMismatch`] (`x` vs the spans' buffer, `out` not 1 element);
    /// [`KernelError::Device`].
    pub fn sum_squares_into(
        &self,
        stream: &Arc<CudaStream>,
        x: &CudaView<'_, f32>,
        spans: &DeviceSpans,
        out: &mut CudaViewMut<'_, f64>,
    ) -> Result<(), KernelError> {
        check_len("x", spans.buffer_len, x.len())?;
        check_len("out", 1, out.len())?;
        let l = self.loaded()?;
        let tiles = spans.n_tiles.max(1) as usize;
        let mut partials = stream
            .alloc_zeros::<f64>(tiles)
            .map_err(|e| driver_error(&format!("cuMemAllocAsync({tiles} x f64)"), e))?;
        if spans.n_tiles > 0 {
            let mut b = stream.launch_builder(l.get("fsdp_sumsq_tiles"));
            b.arg(x)
                .arg(&spans.tiles)
                .arg(&spans.n_tiles)
                .arg(&mut partials);
            // SAFETY: argument list matches fsdp_sumsq_tiles; partials has n_tiles elements.
            unsafe { b.launch(cfg(tile_grid(spans.n_tiles as usize))) }
                .map_err(|e| driver_error("cuLaunchKernel(fsdp_sumsq_tiles)", e))?;
        }
        let n = spans.n_tiles;
        let mut b = stream.launch_builder(l.get("fsdp_sum_f64"));
        b.arg(&partials).arg(&n).arg(out);
        // SAFETY: one block sums n partials into out[0].
        unsafe { b.launch(cfg(1)) }.map_err(|e| driver_error("cuLaunchKernel(fsdp_sum_f64)", e))?;
        Ok(())
    }

    /// `x[i] *= a` for every element (padding included, as [`crate::scale`]); bitwise equal to
    /// the CPU. Enqueued on `stream`.
    ///
    /// Errors: [`KernelError::Device`].
    pub fn scale(
        &self,
        stream: &Arc<CudaStream>,
        x: &mut CudaViewMut<'_, f32>,
        a: f32,
    ) -> Result<(), KernelError> {
        let n = x.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let l = self.loaded()?;
        let mut b = stream.launch_builder(l.get("fsdp_scale"));
        b.arg(x).arg(&a).arg(&n);
        // SAFETY: argument list matches fsdp_scale; n is the view's length.
        unsafe { b.launch(cfg(grid_1d(n as usize))) }
            .map_err(|e| driver_error("cuLaunchKernel(fsdp_scale)", e))?;
        Ok(())
    }

    /// `dst[i] += src[i]` (gradient accumulation), bitwise equal to [`crate::accumulate`].
    /// Enqueued on `stream`.
    ///
    /// Errors: [`KernelError::LengthMismatch`] (nothing enqueued); [`KernelError::Device`].
    pub fn accumulate(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut CudaViewMut<'_, f32>,
        src: &CudaView<'_, f32>,
    ) -> Result<(), KernelError> {
        check_len("src", dst.len(), src.len())?;
        let n = dst.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let l = self.loaded()?;
        let mut b = stream.launch_builder(l.get("fsdp_accumulate"));
        b.arg(dst).arg(src).arg(&n);
        // SAFETY: argument list matches fsdp_accumulate; both views hold n elements.
        unsafe { b.launch(cfg(grid_1d(n as usize))) }
            .map_err(|e| driver_error("cuLaunchKernel(fsdp_accumulate)", e))?;
        Ok(())
    }

    fn cast<S, D>(
        &self,
        name: &str,
        stream: &Arc<CudaStream>,
        src: &CudaView<'_, S>,
        dst: &mut CudaViewMut<'_, D>,
    ) -> Result<(), KernelError> {
        check_len("dst", src.len(), dst.len())?;
        let n = src.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let l = self.loaded()?;
        let mut b = stream.launch_builder(l.get(name));
        b.arg(src).arg(dst).arg(&n);
        // SAFETY: every cast kernel takes (src, dst, n) with n elements in both views.
        unsafe { b.launch(cfg(grid_1d(n as usize))) }
            .map_err(|e| driver_error(&format!("cuLaunchKernel({name})"), e))?;
        Ok(())
    }

    /// fp32 -> bf16, round to nearest even; bitwise equal to [`crate::cast::cast_f32_to_bf16`]
    /// (NaN included). Enqueued on `stream`.
    ///
    /// Errors: [`KernelError::LengthMismatch`]; [`KernelError::Device`].
    pub fn cast_f32_to_bf16(
        &self,
        stream: &Arc<CudaStream>,
        src: &CudaView<'_, f32>,
        dst: &mut CudaViewMut<'_, bf16>,
    ) -> Result<(), KernelError> {
        self.cast("fsdp_f32_to_bf16", stream, src, dst)
    }

    /// bf16 -> fp32, exact. Enqueued on `stream`.
    ///
    /// Errors: [`KernelError::LengthMismatch`]; [`KernelError::Device`].
    pub fn cast_bf16_to_f32(
        &self,
        stream: &Arc<CudaStream>,
        src: &CudaView<'_, bf16>,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), KernelError> {
        self.cast("fsdp_bf16_to_f32", stream, src, dst)
    }

    /// fp32 -> f16, round to nearest even (overflow to infinity, correctly rounded
    /// subnormals); bitwise equal to [`crate::cast::cast_f32_to_f16`] except that a NaN becomes
    /// the canonical quiet NaN. Enqueued on `stream`.
    ///
    /// Errors: [`KernelError::LengthMismatch`]; [`KernelError::Device`].
    pub fn cast_f32_to_f16(
        &self,
        stream: &Arc<CudaStream>,
        src: &CudaView<'_, f32>,
        dst: &mut CudaViewMut<'_, f16>,
    ) -> Result<(), KernelError> {
        self.cast("fsdp_f32_to_f16", stream, src, dst)
    }

    /// f16 -> fp32, exact. Enqueued on `stream`.
    ///
    /// Errors: [`KernelError::LengthMismatch`]; [`KernelError::Device`].
    pub fn cast_f16_to_f32(
        &self,
        stream: &Arc<CudaStream>,
        src: &CudaView<'_, f16>,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), KernelError> {
        self.cast("fsdp_f16_to_f32", stream, src, dst)
    }

    /// One SGD step on the device, the CUDA twin of [`crate::sgd_step`] (PyTorch SGD, dampening
    /// 0, no Nesterov): same f32 scalars (`lr`, `weight_decay`, `momentum` rounded once from
    /// f64), same per-element operations, padding neither read nor written.
    ///
    /// Shapes: `param`, `grad`: N = `spans.buffer_len()` f32 elements; `momentum_buf`: N
    /// elements, or `None` when `cfg.momentum == 0` (a given buffer is then not touched). `step`
    /// is 1-based. Enqueued on `stream`. Bound vs the CPU: bitwise equal.
    ///
    /// Errors (nothing enqueued): [`KernelError::LengthMismatch`] (also a missing momentum buffer
    /// with `cfg.momentum > 0`), [`KernelError::InvalidHyperparameter`],
    /// [`KernelError::ZeroStep`]; [`KernelError::Device`].
    #[allow(clippy::too_many_arguments)]
    pub fn sgd_step(
        &self,
        stream: &Arc<CudaStream>,
        param: &mut CudaViewMut<'_, f32>,
        grad: &CudaView<'_, f32>,
        momentum_buf: Option<&mut CudaViewMut<'_, f32>>,
        spans: &DeviceSpans,
        cfg_: &SgdConfig,
        step: u64,
    ) -> Result<(), KernelError> {
        let n = spans.buffer_len;
        check_len("param", n, param.len())?;
        check_len("grad", n, grad.len())?;
        cfg_.validate()?;
        let use_momentum = cfg_.momentum > 0.0;
        if use_momentum {
            check_len(
                "momentum_buf",
                n,
                momentum_buf.as_ref().map_or(0, |b| b.len()),
            )?;
        }
        if step == 0 {
            return Err(KernelError::ZeroStep { step });
        }
        if spans.n_tiles == 0 {
            return Ok(());
        }
        let flags: u32 = u32::from(use_momentum)
            | (u32::from(step == 1) << 1)
            | (u32::from(cfg_.weight_decay != 0.0) << 2);
        let (lr, wd, mu) = (
            cfg_.lr as f32,
            cfg_.weight_decay as f32,
            cfg_.momentum as f32,
        );
        let l = self.loaded()?;
        let mut b = stream.launch_builder(l.get("fsdp_sgd_tiles"));
        b.arg(param).arg(grad);
        match momentum_buf {
            Some(buf) if use_momentum => {
                b.arg(buf);
            }
            // Never read or written without momentum: any valid pointer (the gradient's).
            _ => {
                b.arg(grad);
            }
        }
        b.arg(&spans.tiles)
            .arg(&spans.n_tiles)
            .arg(&lr)
            .arg(&wd)
            .arg(&mu)
            .arg(&flags);
        // SAFETY: argument list matches fsdp_sgd_tiles; every tile lies inside the buffers
        // (validated against buffer_len, which param, grad and a used momentum buffer equal).
        unsafe { b.launch(cfg(tile_grid(spans.n_tiles as usize))) }
            .map_err(|e| driver_error("cuLaunchKernel(fsdp_sgd_tiles)", e))?;
        Ok(())
    }

    /// Largest absolute value of the elements of `x` inside `spans`, the CUDA twin of
    /// [`crate::max_abs`]: per tile a strided per-thread maximum and a fixed tree, then the tile
    /// maxima in one block; NaN-propagating (a NaN result is returned as `f32::NAN`, as the
    /// CPU's). Bound vs the CPU: bitwise equal (the maximum does not depend on order). 0.0 for
    /// empty spans. Enqueued on `stream`, which is then synchronized to read the value back.
    ///
    /// Errors: [`KernelError::LengthMismatch`]; [`KernelError::Device`].
    pub fn max_abs(
        &self,
        stream: &Arc<CudaStream>,
        x: &CudaView<'_, f32>,
        spans: &DeviceSpans,
    ) -> Result<f32, KernelError> {
        check_len("x", spans.buffer_len, x.len())?;
        if spans.n_tiles == 0 {
            return Ok(0.0);
        }
        let l = self.loaded()?;
        let tiles = spans.n_tiles as usize;
        let mut partials = stream
            .alloc_zeros::<f32>(tiles)
            .map_err(|e| driver_error(&format!("cuMemAllocAsync({tiles} x f32)"), e))?;
        let mut out = stream
            .alloc_zeros::<f32>(1)
            .map_err(|e| driver_error("cuMemAllocAsync(1 x f32)", e))?;
        let mut b = stream.launch_builder(l.get("fsdp_maxabs_tiles"));
        b.arg(x)
            .arg(&spans.tiles)
            .arg(&spans.n_tiles)
            .arg(&mut partials);
        // SAFETY: argument list matches fsdp_maxabs_tiles; partials has n_tiles elements.
        unsafe { b.launch(cfg(tile_grid(tiles))) }
            .map_err(|e| driver_error("cuLaunchKernel(fsdp_maxabs_tiles)", e))?;
        let n = spans.n_tiles;
        let mut b = stream.launch_builder(l.get("fsdp_max_f32"));
        b.arg(&partials).arg(&n).arg(&mut out);
        // SAFETY: one block reduces n partials into out[0].
        unsafe { b.launch(cfg(1)) }.map_err(|e| driver_error("cuLaunchKernel(fsdp_max_f32)", e))?;
        let v = stream
            .clone_dtoh(&out)
            .map_err(|e| driver_error("cuMemcpyDtoHAsync(1 x f32)", e))?;
        stream
            .synchronize()
            .map_err(|e| driver_error("cuStreamSynchronize", e))?;
        Ok(if v[0].is_nan() { f32::NAN } else { v[0] })
    }

    /// `x[i] /= d` for every element (one correctly rounded division, as
    /// [`crate::div_scalar`]); bitwise equal to the CPU. Enqueued on `stream`.
    ///
    /// Errors: [`KernelError::Device`].
    pub fn div_scalar(
        &self,
        stream: &Arc<CudaStream>,
        x: &mut CudaViewMut<'_, f32>,
        d: f32,
    ) -> Result<(), KernelError> {
        let n = x.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let l = self.loaded()?;
        let mut b = stream.launch_builder(l.get("fsdp_div_scalar"));
        b.arg(x).arg(&d).arg(&n);
        // SAFETY: argument list matches fsdp_div_scalar; n is the view's length.
        unsafe { b.launch(cfg(grid_1d(n as usize))) }
            .map_err(|e| driver_error("cuLaunchKernel(fsdp_div_scalar)", e))?;
        Ok(())
    }

    fn accumulate_widened<S>(
        &self,
        name: &str,
        stream: &Arc<CudaStream>,
        dst: &mut CudaViewMut<'_, f32>,
        src: &CudaView<'_, S>,
    ) -> Result<(), KernelError> {
        check_len("src", dst.len(), src.len())?;
        let n = dst.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let l = self.loaded()?;
        let mut b = stream.launch_builder(l.get(name));
        b.arg(dst).arg(src).arg(&n);
        // SAFETY: every fsdp_accumulate_* kernel takes (dst, src, n), n elements in both views.
        unsafe { b.launch(cfg(grid_1d(n as usize))) }
            .map_err(|e| driver_error(&format!("cuLaunchKernel({name})"), e))?;
        Ok(())
    }

    /// `dst[i] += (f32)src[i]` for a bf16 source (exact widening, one f32 addition): bitwise
    /// equal to [`crate::cast::cast_bf16_to_f32`] then [`crate::accumulate`]. Enqueued on
    /// `stream`.
    ///
    /// Errors: [`KernelError::LengthMismatch`]; [`KernelError::Device`].
    pub fn accumulate_bf16(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut CudaViewMut<'_, f32>,
        src: &CudaView<'_, bf16>,
    ) -> Result<(), KernelError> {
        self.accumulate_widened("fsdp_accumulate_bf16", stream, dst, src)
    }

    /// `dst[i] += (f32)src[i]` for an f16 source (exact widening): bitwise equal to
    /// [`crate::cast::cast_f16_to_f32`] then [`crate::accumulate`]. Enqueued on `stream`.
    ///
    /// Errors: [`KernelError::LengthMismatch`]; [`KernelError::Device`].
    pub fn accumulate_f16(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut CudaViewMut<'_, f32>,
        src: &CudaView<'_, f16>,
    ) -> Result<(), KernelError> {
        self.accumulate_widened("fsdp_accumulate_f16", stream, dst, src)
    }

    /// `dst[i] += (f32)src[i]` for an f64 source, rounded to nearest even first (`as f32`):
    /// bitwise equal to [`crate::cast::cast_f64_to_f32`] then [`crate::accumulate`]. Enqueued on
    /// `stream`.
    ///
    /// Errors: [`KernelError::LengthMismatch`]; [`KernelError::Device`].
    pub fn accumulate_f64(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut CudaViewMut<'_, f32>,
        src: &CudaView<'_, f64>,
    ) -> Result<(), KernelError> {
        self.accumulate_widened("fsdp_accumulate_f64", stream, dst, src)
    }

    /// Compiles the kernels now (they are compiled at first use otherwise), e.g. to time the
    /// NVRTC step or to fail early.
    ///
    /// Errors: [`KernelError::Device`] with NVRTC's log or the driver's text.
    pub fn compile(&self) -> Result<(), KernelError> {
        self.loaded().map(|_| ())
    }
}

/// Compiles [`super::SOURCE`] to PTX with NVRTC for `compute_{arch}` (e.g. `90`) without a
/// device (NVRTC needs none): a check that the source compiles with this build's NVRTC.
///
/// Errors: [`KernelError::Device`] with NVRTC's log.
pub fn compile_ptx_for(arch: u32) -> Result<String, KernelError> {
    let mut options: Vec<String> = NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture=compute_{arch}"));
    let ptx = compile_ptx_with_opts(
        SOURCE,
        CompileOptions {
            options,
            name: Some("fsdp_kernels.cu".into()),
            ..Default::default()
        },
    )
    .map_err(nvrtc_error)?;
    Ok(ptx.to_src())
}

//! `fsdp calibrate --device cuda`: measures one CUDA GPU through candle (the path the model's
//! ops take on `--device cuda`) and builds an `fsdp-hardware/1` profile. One process, one
//! device: world size 1.
//!
//! - **GEMM** per dtype (f32, bf16, f16) over square sizes `n` = 64..8192 (8192 reaches the
//!   plateau of an H100/H200 in bf16: 1.1 TFLOPs per call, about 1.4 ms): candle's CUDA
//!   matmul (cuBLAS) of standard normal matrices, `2 n^3` FLOPs per call. One untimed call,
//!   then batches of calls (1, 2, 4, ... up to 4096) each ended by a device synchronize,
//!   until at least [`MIN_SECONDS`] have passed since the first timed launch. The dtype's
//!   peak is the highest measured point, as on the CPU. No shape grid is measured: every
//!   shape runs at the square curve's rate for its FLOPs (cuBLAS chooses a kernel per shape
//!   and layout; the grid is what the CPU's single kernel family needs).
//! - **Memory bandwidth**: a device-to-device copy of a 256 MiB f32 tensor
//!   (`Tensor::copy`, a `cuMemcpyDtoD`), bytes read plus written per second.
//! - **Elementwise FLOP/s**: candle's `affine` (`y = 0.999 x + 0.5`, 2 FLOPs per element) over
//!   4 Mi f32 elements (16 MiB in, 16 MiB out: both fit the 50 MB L2 of an H100/H200): the
//!   rate candle's elementwise kernels reach, launch included, not the FP32 peak.
//! - **Host link**: 256 MiB of f32 copied host to device and device to host with
//!   `Tensor::to_device`. candle offers no pinned (page-locked) host buffers, so these are
//!   pageable copies, the kind the engine's own host <-> device copies are; the profile keeps
//!   the slower direction (offload moves both ways every step) and the source names both.
//! - **Host optimizer**: one host thread's copy of a 64 MiB f32 buffer (bytes read plus
//!   written), the host memory traffic of an offloaded optimizer step.
//! - **Collectives and the overlap slowdown are not measured**: with one device in one process
//!   there is no peer. (The NCCL backend can run 2 processes on one GPU under `fsdp launch`,
//!   but their traffic then crosses loopback sockets, not NVLink: a figure no multi-GPU run
//!   would see.) They are taken from the built-in profile of the same GPU ([`fallback`]:
//!   NCCL's own latency model, `src/graph/tuning.cc`, and the vendor's link bandwidths), and
//!   every such source starts with `not measured: one device`.
//! - `ranks_per_node` is the CUDA driver's device count on this host (one rank per GPU).

use super::{hostname, utc_date, MIN_SECONDS};
use candle_core::{DType, Device, Tensor};
use fsdp_planner::time::{
    builtin_profile, CurvePoint, GemmCurve, GemmRates, HardwareProfile, HostLink, PROFILE_SCHEMA,
};
use std::collections::BTreeMap;
use std::time::Instant;

/// GEMM sizes (square `n`) on a GPU.
pub const CUDA_GEMM_SIZES: [usize; 8] = [64, 128, 256, 512, 1024, 2048, 4096, 8192];

/// Bytes of the device-to-device copy.
const COPY_BYTES: usize = 256 << 20;

/// Elements of the elementwise measurement (f32).
const ELEMENTWISE_NUMEL: usize = 4 << 20;

/// Bytes of each host <-> device copy.
const LINK_BYTES: usize = 256 << 20;

/// Bytes of the host copy (the host optimizer's memory traffic).
const HOST_COPY_BYTES: usize = 64 << 20;

/// What `fsdp calibrate --device cuda` measures.
#[derive(Debug, Clone)]
pub struct CudaCalibrateOptions {
    /// The CUDA device ordinal measured.
    pub ordinal: usize,
    /// CUDA devices on this host (the driver's count): the profile's `ranks_per_node`.
    pub devices: usize,
    /// The device's name as the driver reports it (`NVIDIA H200`), if known.
    pub device_name: Option<String>,
    /// The command line, recorded in every source.
    pub command: String,
    /// The profile's name.
    pub name: String,
}

/// Runs `f` once untimed, then in doubling batches each ended by a device synchronize, until
/// at least [`MIN_SECONDS`] have passed; returns (timed calls, seconds). `what` names the
/// measurement in errors.
fn timed(
    dev: &Device,
    what: &str,
    mut f: impl FnMut() -> candle_core::Result<()>,
) -> Result<(u64, f64), String> {
    let err = |e: candle_core::Error| format!("{what}: {e}");
    f().map_err(err)?;
    dev.synchronize().map_err(err)?;
    let t = Instant::now();
    let (mut calls, mut batch) = (0u64, 1u64);
    loop {
        for _ in 0..batch {
            f().map_err(err)?;
        }
        dev.synchronize().map_err(err)?;
        calls += batch;
        let s = t.elapsed().as_secs_f64();
        if s >= MIN_SECONDS {
            return Ok((calls, s));
        }
        batch = (batch * 2).min(4096);
    }
}

/// FLOP/s of candle's matmul of two `n x n` matrices of `dtype` on `dev`.
fn gemm_rate(dev: &Device, dtype: DType, n: usize) -> Result<f64, String> {
    let what = format!("{dtype:?} matmul {n}x{n} on the GPU");
    let a = Tensor::randn(0f32, 1f32, (n, n), dev)
        .and_then(|t| t.to_dtype(dtype))
        .map_err(|e| format!("{what}: {e}"))?;
    let b = Tensor::randn(0f32, 1f32, (n, n), dev)
        .and_then(|t| t.to_dtype(dtype))
        .map_err(|e| format!("{what}: {e}"))?;
    let (calls, s) = timed(dev, &what, || a.matmul(&b).map(drop))?;
    Ok(2.0 * (n as f64).powi(3) * calls as f64 / s)
}

/// Device memory bandwidth: bytes read plus written per second by a device-to-device copy.
fn copy_rate(dev: &Device) -> Result<f64, String> {
    let what = "device-to-device copy of 256 MiB";
    let x = Tensor::ones(COPY_BYTES / 4, DType::F32, dev).map_err(|e| format!("{what}: {e}"))?;
    let (calls, s) = timed(dev, what, || x.copy().map(drop))?;
    Ok(2.0 * COPY_BYTES as f64 * calls as f64 / s)
}

/// FLOP/s of candle's elementwise `affine` (2 FLOPs per element).
fn elementwise_rate(dev: &Device) -> Result<f64, String> {
    let what = "elementwise affine over 4 Mi f32 elements";
    let x = Tensor::ones(ELEMENTWISE_NUMEL, DType::F32, dev).map_err(|e| format!("{what}: {e}"))?;
    let (calls, s) = timed(dev, what, || x.affine(0.999, 0.5).map(drop))?;
    Ok(2.0 * ELEMENTWISE_NUMEL as f64 * calls as f64 / s)
}

/// Bytes per second of pageable host -> device and device -> host copies of 256 MiB.
fn link_rates(dev: &Device) -> Result<(f64, f64), String> {
    let n = LINK_BYTES / 4;
    let host = Tensor::ones(n, DType::F32, &Device::Cpu).map_err(|e| e.to_string())?;
    let (calls, s) = timed(dev, "host-to-device copy of 256 MiB", || {
        host.to_device(dev).map(drop)
    })?;
    let h2d = LINK_BYTES as f64 * calls as f64 / s;
    let on_dev = Tensor::ones(n, DType::F32, dev).map_err(|e| e.to_string())?;
    let (calls, s) = timed(dev, "device-to-host copy of 256 MiB", || {
        on_dev.to_device(&Device::Cpu).map(drop)
    })?;
    let d2h = LINK_BYTES as f64 * calls as f64 / s;
    Ok((h2d, d2h))
}

/// One host thread's copy bandwidth, bytes read plus written per second.
fn host_copy_rate() -> Result<f64, String> {
    let src = vec![1.0f32; HOST_COPY_BYTES / 4];
    let mut dst = vec![0.0f32; HOST_COPY_BYTES / 4];
    let (calls, s) = timed(&Device::Cpu, "host copy of 64 MiB", || {
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        Ok(())
    })?;
    Ok(2.0 * HOST_COPY_BYTES as f64 * calls as f64 / s)
}

/// The built-in profile whose collectives and overlap slowdown stand in for the ones one
/// device cannot measure: the same GPU's (`H200` -> `h200`, `H100` -> `h100-sxm`, `A100` ->
/// `a100-80gb`, by the driver's device name), else `h200`, the test machine's. Returns its
/// name and whether it matched the device.
pub fn fallback(device_name: Option<&str>) -> (&'static str, bool) {
    let name = device_name.unwrap_or("").to_ascii_lowercase();
    for (key, profile) in [
        ("h200", "h200"),
        ("h100", "h100-sxm"),
        ("a100", "a100-80gb"),
    ] {
        if name.contains(key) {
            return (profile, true);
        }
    }
    ("h200", false)
}

/// Measures GPU `o.ordinal` (`dev`, opened by the caller) and returns its profile (see the
/// module doc).
///
/// Errors: a failed matmul, copy or allocation (with candle's words), or a profile that does
/// not validate (a measurement outside the plausible ranges).
pub fn calibrate_cuda(dev: &Device, o: &CudaCalibrateOptions) -> Result<HardwareProfile, String> {
    let dtypes = [
        ("f32", DType::F32),
        ("bf16", DType::BF16),
        ("f16", DType::F16),
    ];
    let mut curves = Vec::new();
    for (_, dt) in dtypes {
        let mut points = Vec::new();
        for n in CUDA_GEMM_SIZES {
            points.push(CurvePoint {
                flops: 2.0 * (n as f64).powi(3),
                flops_per_s: gemm_rate(dev, dt, n)?,
            });
        }
        let peak = points.iter().map(|p| p.flops_per_s).fold(0.0, f64::max);
        // cuBLAS picks its kernel by shape; the square curve stands for every shape.
        curves.push(GemmCurve {
            peak_flops_per_s: peak,
            points,
            shapes: Vec::new(),
        });
    }
    let copy = copy_rate(dev)?;
    let elementwise = elementwise_rate(dev)?;
    let (h2d, d2h) = link_rates(dev)?;
    let host_copy = host_copy_rate()?;

    let (fb_name, matched) = fallback(o.device_name.as_deref());
    let fb = builtin_profile(fb_name).map_err(|e| e.to_string())?;
    let gpu = o
        .device_name
        .clone()
        .unwrap_or_else(|| "an unnamed GPU".into());
    let host = hostname();
    let date = utc_date();
    let measured = |what: &str| {
        format!(
            "measured {date} on {host} ({gpu}, CUDA device {}) by `{}`: {what}",
            o.ordinal, o.command
        )
    };
    let not_measured = |path: &str| {
        let why = if matched {
            format!("the built-in `{fb_name}` profile of the same GPU")
        } else {
            format!("the built-in `{fb_name}` profile ({gpu} has no built-in profile of its own)")
        };
        format!(
            "not measured: one device (`{}` runs one process on one GPU, world size 1: no peer \
             to measure against); the number of {why}: {}",
            o.command,
            fb.sources
                .get(path)
                .map_or("(no source recorded)", String::as_str)
        )
    };
    let gb = |b: f64| format!("{:.1} GB/s", b / 1e9);
    let mut sources = BTreeMap::new();
    sources.insert(
        "ranks_per_node".into(),
        measured(&format!(
            "the CUDA driver's device count on this host ({}), one rank per GPU",
            o.devices
        )),
    );
    for (dt, _) in dtypes {
        sources.insert(
            format!("gemm.{dt}.peak_flops_per_s"),
            measured("the highest point of the curve (a measured maximum, not a vendor peak)"),
        );
        sources.insert(
            format!("gemm.{dt}.points"),
            measured(&format!(
                "candle CUDA matmul (cuBLAS) of n x n {dt} matrices of standard normal values, \
                 n = 64..8192 (2 n^3 FLOPs per call), calls repeated for at least {MIN_SECONDS} \
                 s between device synchronizes after one untimed call"
            )),
        );
    }
    sources.insert(
        "memory_bandwidth_bytes_per_s".into(),
        measured(
            "device-to-device copy of a 256 MiB f32 tensor (candle Tensor::copy), bytes read \
             plus written, between device synchronizes",
        ),
    );
    sources.insert(
        "elementwise_flops_per_s".into(),
        measured(
            "candle affine y = 0.999 x + 0.5 over 4 Mi f32 elements (16 MiB in, 16 MiB out), 2 \
             FLOPs per element: the rate of candle's elementwise kernels, launch included, not \
             the FP32 peak",
        ),
    );
    sources.insert(
        "host.link_bytes_per_s".into(),
        measured(&format!(
            "256 MiB of f32 copied with candle Tensor::to_device from and into pageable host \
             memory (candle has no pinned host buffers), the slower direction: host to device \
             {}, device to host {}",
            gb(h2d),
            gb(d2h)
        )),
    );
    sources.insert(
        "host.optimizer_bytes_per_s".into(),
        measured("one host thread's copy of a 64 MiB f32 buffer, bytes read plus written"),
    );
    for level in ["intra_node", "inter_node"] {
        for kind in ["all_gather", "reduce_scatter", "all_reduce"] {
            for f in ["latency_s", "step_latency_s", "bus_bandwidth_bytes_per_s"] {
                let path = format!("collectives.{level}.{kind}.{f}");
                sources.insert(path.clone(), not_measured(&path));
            }
        }
    }
    sources.insert("overlap_slowdown".into(), not_measured("overlap_slowdown"));
    let mut curves = curves.into_iter();
    let p = HardwareProfile {
        schema: PROFILE_SCHEMA.to_string(),
        name: o.name.clone(),
        description: format!(
            "{gpu} (CUDA device {} of {}) on {host}, measured by fsdp calibrate --device cuda on \
             {date}; collectives and the overlap slowdown not measured (one device): from the \
             built-in {fb_name} profile",
            o.ordinal, o.devices
        ),
        ranks_per_node: o.devices as u64,
        gemm: GemmRates {
            f32: curves.next(),
            bf16: curves.next(),
            f16: curves.next(),
            f64: None,
        },
        memory_bandwidth_bytes_per_s: copy,
        elementwise_flops_per_s: elementwise,
        collectives: fb.collectives,
        host: HostLink {
            link_bytes_per_s: h2d.min(d2h),
            optimizer_bytes_per_s: host_copy,
        },
        overlap_slowdown: fb.overlap_slowdown,
        rank_skew: 0.0,
        // One device-to-device copy size and no compute fit: the analytical model as is on
        // the GPU (the fit's reference jobs run the CPU's fused ops).
        memory_bandwidth_curve: Vec::new(),
        // The device's norm and optimizer kernels are parallel and memory-bound: the copy
        // bandwidth prices them.
        norm_elements_per_s: None,
        optimizer_bytes_per_s: None,
        compute_fit: Default::default(),
        sources,
        origin: String::new(),
    };
    p.validate("fsdp calibrate --device cuda")
        .map_err(|e| format!("the measured profile is not valid: {e}"))?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fallback_is_the_same_gpus_built_in_profile() {
        assert_eq!(fallback(Some("NVIDIA H200")), ("h200", true));
        assert_eq!(fallback(Some("NVIDIA H100 80GB HBM3")), ("h100-sxm", true));
        assert_eq!(fallback(Some("NVIDIA A100-SXM4-80GB")), ("a100-80gb", true));
        assert_eq!(fallback(Some("NVIDIA L4")), ("h200", false));
        assert_eq!(fallback(None), ("h200", false));
    }

    #[test]
    fn timed_runs_for_at_least_the_minimum() {
        let mut n = 0u64;
        let (calls, s) = timed(&Device::Cpu, "count", || {
            n += 1;
            Ok(())
        })
        .unwrap();
        assert!(s >= MIN_SECONDS, "{s}");
        // One untimed call before the timed ones.
        assert_eq!(n, calls + 1);
    }
}

//! The rank-order reduction kernel of the NCCL backend: after the grouped send/receive has put
//! every group rank's chunk side by side in a scratch buffer (`parts[j * c + i]` = group rank
//! j's element i), one thread per element folds them in rank order
//! `((x_0 + x_1) + x_2) + ...` — the arithmetic of [`crate::reduce_in_rank_order`]: f32 and
//! f64 added in their own type, bf16 and f16 widened to f32, added in f32 and rounded once to
//! the wire type at the end, `Avg` divided once by the group size, `Max` NaN-propagating.
//! Compiled by NVRTC at first use with the same IEEE options as fsdp-kernels (no FMA, explicit
//! `_rn` intrinsics), so the result is bit-identical to the thread backend.
//!
//! The source, the dtype and op codes and the grid are in [`crate::reduce_launch`] (built and
//! tested without the feature too).

use super::raw::cuda_error;
use crate::error::CommError;
use crate::reduce_launch::{
    kernel_index, op_code, reduce_grid, REDUCE_BLOCK, REDUCE_KERNEL_NAMES, REDUCE_NVRTC_OPTIONS,
    REDUCE_SOURCE,
};
use crate::topology::ReduceOp;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};
use fsdp_types::DType;
use std::sync::Arc;

/// The compiled kernels on one context.
pub(crate) struct Reducer {
    f: Vec<CudaFunction>,
}

/// One rank-order reduction: `out[i] = fold over j < g of parts[j * c + i]` (raw device
/// addresses; `parts` holds `g x c`, `out` `c` elements of `dtype`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fold {
    /// Element type.
    pub(crate) dtype: DType,
    /// The reduction.
    pub(crate) op: ReduceOp,
    /// Device address of the `g` contributions, `c` elements each, in rank order.
    pub(crate) parts: u64,
    /// Number of contributions (the group size).
    pub(crate) g: usize,
    /// Elements per contribution.
    pub(crate) c: usize,
    /// Device address of the `c` output elements.
    pub(crate) out: u64,
}

/// Compiles [`REDUCE_SOURCE`] to PTX for `compute_{arch}` (e.g. `90`) with
/// [`REDUCE_NVRTC_OPTIONS`]. NVRTC needs no device.
pub(crate) fn compile_reduce_ptx(arch: u32) -> Result<Ptx, CompileError> {
    let mut options: Vec<String> = REDUCE_NVRTC_OPTIONS.iter().map(|o| o.to_string()).collect();
    options.push(format!("--gpu-architecture=compute_{arch}"));
    compile_ptx_with_opts(
        REDUCE_SOURCE,
        CompileOptions {
            options,
            name: Some("fsdp_nccl_reduce.cu".into()),
            ..Default::default()
        },
    )
}

impl Reducer {
    /// Compiles [`REDUCE_SOURCE`] for the context's compute capability and loads it.
    pub(crate) fn new(rank: usize, ctx: &Arc<CudaContext>) -> Result<Reducer, CommError> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| cuda_error(rank, "cuDeviceGetAttribute(compute capability)", e))?;
        let arch = u32::try_from(major * 10 + minor).unwrap_or(0);
        let ptx = compile_reduce_ptx(arch).map_err(|e| CommError::Device {
            rank,
            library: "nvrtc",
            call: "nvrtcCompileProgram(rank-order reduction)".into(),
            message: match &e {
                CompileError::CompileError { nvrtc, log, .. } => {
                    format!("{nvrtc:?}: {}", log.to_string_lossy())
                }
                other => format!("{other:?}"),
            },
        })?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| cuda_error(rank, "cuModuleLoadData(rank-order reduction)", e))?;
        let f = REDUCE_KERNEL_NAMES
            .iter()
            .map(|n| {
                module
                    .load_function(n)
                    .map_err(|e| cuda_error(rank, &format!("cuModuleGetFunction({n})"), e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Reducer { f })
    }

    /// Enqueues `fold` on `stream` for `rank` (whose errors name it).
    pub(crate) fn launch(
        &self,
        rank: usize,
        stream: &Arc<CudaStream>,
        fold: Fold,
    ) -> Result<(), CommError> {
        let Fold {
            dtype,
            op,
            parts,
            g,
            c,
            out,
        } = fold;
        if c == 0 {
            return Ok(());
        }
        let k = kernel_index(dtype);
        let (g32, c64, code) = (g as u32, c as u64, op_code(op));
        let mut b = stream.launch_builder(&self.f[k]);
        b.arg(&parts).arg(&g32).arg(&c64).arg(&out).arg(&code);
        let cfg = LaunchConfig {
            grid_dim: (reduce_grid(c), 1, 1),
            block_dim: (REDUCE_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the pointer arguments are 64-bit device addresses of live buffers holding
        // g x c and c elements of `dtype` (checked by the caller); the kernels take
        // (const T*, u32, u64, T*, u32).
        unsafe { b.launch(cfg) }.map_err(|e| {
            cuda_error(
                rank,
                &format!("cuLaunchKernel({})", REDUCE_KERNEL_NAMES[k]),
                e,
            )
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduction_kernels_compile_with_nvrtc() {
        // NVRTC needs no device: this runs wherever a `cuda` build can start (the CUDA CI step
        // runs it against the toolkit's NVRTC), for the GPU test machine's sm_90.
        let ptx = compile_reduce_ptx(90)
            .map_err(|e| format!("{e:?}"))
            .expect("the reduction source compiles for compute_90");
        let src = ptx.to_src();
        for n in REDUCE_KERNEL_NAMES {
            assert!(src.contains(&format!(".entry {n}(")), "{n}");
        }
        assert!(!src.contains("fma.rn"), "no fused multiply-add");
    }
}

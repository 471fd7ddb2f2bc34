//! The rank-order reduction kernel of the NCCL backend: after the grouped send/receive has put
//! every group rank's chunk side by side in a scratch buffer (`parts[j * c + i]` = group rank
//! j's element i), one thread per element folds them in rank order
//! `((x_0 + x_1) + x_2) + ...` — the arithmetic of [`crate::reduce_in_rank_order`]: f32 and
//! f64 added in their own type, bf16 and f16 widened to f32, added in f32 and rounded once to
//! the wire type at the end, `Avg` divided once by the group size, `Max` NaN-propagating.
//! Compiled by NVRTC at first use with the same IEEE options as fsdp-kernels (no FMA, explicit
//! `_rn` intrinsics), so the result is bit-identical to the thread backend.

use super::raw::cuda_error;
use crate::error::CommError;
use crate::topology::ReduceOp;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions};
use fsdp_types::DType;
use std::sync::Arc;

/// CUDA C source of the reduction kernels (one per dtype).
pub const REDUCE_SOURCE: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (u64)gridDim.x * blockDim.x)
__device__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ u16 f32_to_bf16(float x) {
    const u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x0040u);
    return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ float f16_to_f32(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ u16 f32_to_f16(float x) { u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x)); return h; }
__device__ float fold_f(float a, float x, u32 op) {
    if (op == 2) { return (x > a || x != x) ? x : a; }
    return __fadd_rn(a, x);
}
__device__ double fold_d(double a, double x, u32 op) {
    if (op == 2) { return (x > a || x != x) ? x : a; }
    return __dadd_rn(a, x);
}
// op: 0 sum, 1 avg (sum, then one division by g), 2 max.
extern "C" __global__ void fsdp_rank_order_f32(const float* parts, u32 g, u64 c, float* out, u32 op) {
    GRID_STRIDE(i, c) {
        float a = parts[i];
        for (u32 j = 1; j < g; ++j) a = fold_f(a, parts[(u64)j * c + i], op);
        if (op == 1) a = __fdiv_rn(a, (float)g);
        out[i] = a;
    }
}
extern "C" __global__ void fsdp_rank_order_f64(const double* parts, u32 g, u64 c, double* out, u32 op) {
    GRID_STRIDE(i, c) {
        double a = parts[i];
        for (u32 j = 1; j < g; ++j) a = fold_d(a, parts[(u64)j * c + i], op);
        if (op == 1) a = __ddiv_rn(a, (double)g);
        out[i] = a;
    }
}
extern "C" __global__ void fsdp_rank_order_bf16(const u16* parts, u32 g, u64 c, u16* out, u32 op) {
    GRID_STRIDE(i, c) {
        float a = bf16_to_f32(parts[i]);
        for (u32 j = 1; j < g; ++j) a = fold_f(a, bf16_to_f32(parts[(u64)j * c + i]), op);
        if (op == 1) a = __fdiv_rn(a, (float)g);
        out[i] = f32_to_bf16(a);
    }
}
extern "C" __global__ void fsdp_rank_order_f16(const u16* parts, u32 g, u64 c, u16* out, u32 op) {
    GRID_STRIDE(i, c) {
        float a = f16_to_f32(parts[i]);
        for (u32 j = 1; j < g; ++j) a = fold_f(a, f16_to_f32(parts[(u64)j * c + i]), op);
        if (op == 1) a = __fdiv_rn(a, (float)g);
        out[i] = f32_to_f16(a);
    }
}
"#;

/// Kernel names, indexed like [`dtype_index`].
const NAMES: [&str; 4] = [
    "fsdp_rank_order_f32",
    "fsdp_rank_order_bf16",
    "fsdp_rank_order_f16",
    "fsdp_rank_order_f64",
];

fn dtype_index(d: DType) -> usize {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
        DType::F64 => 3,
    }
}

/// The op code the kernels take.
pub(crate) fn op_code(op: ReduceOp) -> u32 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
    }
}

/// Threads per block.
const BLOCK: u32 = 256;

/// Blocks for `n` elements: `ceil(n / 256)` in `1..=2^20` (grid-stride loop beyond).
pub(crate) fn grid(n: usize) -> u32 {
    n.div_ceil(BLOCK as usize).clamp(1, 1 << 20) as u32
}

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

impl Reducer {
    /// Compiles [`REDUCE_SOURCE`] for the context's compute capability and loads it.
    pub(crate) fn new(rank: usize, ctx: &Arc<CudaContext>) -> Result<Reducer, CommError> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| cuda_error(rank, "cuDeviceGetAttribute(compute capability)", e))?;
        let options = vec![
            "--fmad=false".to_string(),
            "--prec-div=true".to_string(),
            "--ftz=false".to_string(),
            format!("--gpu-architecture=compute_{major}{minor}"),
        ];
        let ptx = compile_ptx_with_opts(
            REDUCE_SOURCE,
            CompileOptions {
                options,
                name: Some("fsdp_nccl_reduce.cu".into()),
                ..Default::default()
            },
        )
        .map_err(|e| CommError::Device {
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
        let f = NAMES
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
        let f = &self.f[dtype_index(dtype)];
        let (g32, c64, code) = (g as u32, c as u64, op_code(op));
        let mut b = stream.launch_builder(f);
        b.arg(&parts).arg(&g32).arg(&c64).arg(&out).arg(&code);
        let cfg = LaunchConfig {
            grid_dim: (grid(c), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the pointer arguments are 64-bit device addresses of live buffers holding
        // g x c and c elements of `dtype` (checked by the caller); the kernels take
        // (const T*, u32, u64, T*, u32).
        unsafe { b.launch(cfg) }.map_err(|e| {
            cuda_error(
                rank,
                &format!("cuLaunchKernel({})", NAMES[dtype_index(dtype)]),
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
        // NVRTC needs no device: this runs wherever a `cuda` build can start.
        let ptx = compile_ptx_with_opts(
            REDUCE_SOURCE,
            CompileOptions {
                options: vec![
                    "--fmad=false".into(),
                    "--prec-div=true".into(),
                    "--gpu-architecture=compute_90".into(),
                ],
                ..Default::default()
            },
        )
        .map_err(|e| format!("{e:?}"))
        .expect("the reduction source compiles");
        let src = ptx.to_src();
        for n in NAMES {
            assert!(src.contains(&format!(".entry {n}(")), "{n}");
        }
        assert!(!src.contains("fma.rn"), "no fused multiply-add");
    }

    #[test]
    fn grid_and_op_codes() {
        assert_eq!(grid(0), 1);
        assert_eq!(grid(257), 2);
        assert_eq!(grid(usize::MAX / 4), 1 << 20);
        assert_eq!(
            [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max].map(op_code),
            [0, 1, 2]
        );
        assert_eq!(NAMES[dtype_index(DType::BF16)], "fsdp_rank_order_bf16");
    }
}

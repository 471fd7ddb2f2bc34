// fsdp-kernels: the CUDA kernels of the flat-buffer work, compiled at first use by NVRTC
// (fsdp_kernels::cuda::CudaKernels) with --fmad=false --prec-div=true --prec-sqrt=true
// --ftz=false. Every float operation below is written with an explicit round-to-nearest
// intrinsic (__fadd_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn, __dadd_rn, __dmul_rn), which the
// compiler never contracts into a fused multiply-add, so each element is computed with exactly
// the operations, in exactly the order, of the CPU reference in kernels/src (Rust f32/f64
// arithmetic is IEEE-754 round-to-nearest-even and never fused either).
//
// Span-taking kernels read a tile table built on the host (fsdp_kernels::cuda::tiles_for_spans):
// tile t covers elements [tiles[2t], tiles[2t] + (tiles[2t+1] & 0xffffffff)) of the buffer and
// bit 32 of tiles[2t+1] is the span's weight-decay flag. Elements in no tile (padding) are never
// read or written. Blocks loop over tiles (tile = blockIdx.x, blockIdx.x + gridDim.x, ...), so
// the grid size never changes which element a thread computes or how sums are grouped.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

// Threads per block of every kernel here; must equal fsdp_kernels::cuda::BLOCK (a power of 2).
#define FSDP_BLOCK 256

// One AdamW step (Loshchilov & Hutter 2019, Algorithm 2) in PyTorch's single-tensor operation
// order, as fsdp_kernels::adamw_step: decay, lerp of m, update of v, denominator, update of p.
extern "C" __global__ void fsdp_adamw_tiles(
    float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
    float* __restrict__ v, const u64* __restrict__ tiles, u32 n_tiles, float decay_factor,
    float w1, float beta2, float w2, float step_size, float bc2, float eps)
{
    for (u32 t = blockIdx.x; t < n_tiles; t += gridDim.x) {
        const u64 start = tiles[2 * (u64)t];
        const u64 meta = tiles[2 * (u64)t + 1];
        const u32 len = (u32)(meta & 0xffffffffull);
        const bool decay = (meta >> 32) != 0;
        for (u32 j = threadIdx.x; j < len; j += blockDim.x) {
            const u64 i = start + j;
            const float gi = g[i];
            float pi = p[i];
            if (decay) {
                pi = __fmul_rn(pi, decay_factor);
            }
            const float mo = m[i];
            const float mi = __fadd_rn(mo, __fmul_rn(__fadd_rn(gi, -mo), w1));
            const float vi = __fadd_rn(__fmul_rn(v[i], beta2), __fmul_rn(__fmul_rn(w2, gi), gi));
            const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2), eps);
            p[i] = __fadd_rn(pi, -__fdiv_rn(__fmul_rn(step_size, mi), denom));
            m[i] = mi;
            v[i] = vi;
        }
    }
}

// Per-tile sums of squares in f64: thread j adds x^2 of elements j, j + FSDP_BLOCK, ... of the
// tile in order, then a fixed binary tree over the block's threads; partials[t] = tile t's sum.
extern "C" __global__ void fsdp_sumsq_tiles(
    const float* __restrict__ x, const u64* __restrict__ tiles, u32 n_tiles,
    double* __restrict__ partials)
{
    __shared__ double sh[FSDP_BLOCK];
    for (u32 t = blockIdx.x; t < n_tiles; t += gridDim.x) {
        const u64 start = tiles[2 * (u64)t];
        const u32 len = (u32)(tiles[2 * (u64)t + 1] & 0xffffffffull);
        double acc = 0.0;
        for (u32 j = threadIdx.x; j < len; j += blockDim.x) {
            const double d = (double)x[start + j];
            acc = __dadd_rn(acc, __dmul_rn(d, d));
        }
        sh[threadIdx.x] = acc;
        __syncthreads();
        for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) {
                sh[threadIdx.x] = __dadd_rn(sh[threadIdx.x], sh[threadIdx.x + s]);
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            partials[t] = sh[0];
        }
        __syncthreads();
    }
}

// Sum of n f64 values in one block: thread j adds values j, j + FSDP_BLOCK, ... in order, then
// the same fixed tree; out[0] = the sum. Launched with exactly one block.
extern "C" __global__ void fsdp_sum_f64(const double* __restrict__ values, u32 n,
                                        double* __restrict__ out)
{
    __shared__ double sh[FSDP_BLOCK];
    double acc = 0.0;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) {
        acc = __dadd_rn(acc, values[j]);
    }
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            sh[threadIdx.x] = __dadd_rn(sh[threadIdx.x], sh[threadIdx.x + s]);
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[0] = sh[0];
    }
}

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (u64)gridDim.x * blockDim.x)

// x[i] *= a.
extern "C" __global__ void fsdp_scale(float* __restrict__ x, float a, u64 n)
{
    GRID_STRIDE(i, n) { x[i] = __fmul_rn(x[i], a); }
}

// dst[i] += src[i].
extern "C" __global__ void fsdp_accumulate(float* __restrict__ dst, const float* __restrict__ src,
                                           u64 n)
{
    GRID_STRIDE(i, n) { dst[i] = __fadd_rn(dst[i], src[i]); }
}

// f32 -> bf16, round to nearest even (the bits of the `half` crate's bf16::from_f32: NaN keeps
// its sign and top payload bits and becomes quiet; overflow rounds to infinity).
extern "C" __global__ void fsdp_f32_to_bf16(const float* __restrict__ src, u16* __restrict__ dst,
                                            u64 n)
{
    GRID_STRIDE(i, n) {
        const u32 u = __float_as_uint(src[i]);
        u16 r;
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            r = (u16)((u >> 16) | 0x0040u);
        } else {
            r = (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
        dst[i] = r;
    }
}

// bf16 -> f32, exact.
extern "C" __global__ void fsdp_bf16_to_f32(const u16* __restrict__ src, float* __restrict__ dst,
                                            u64 n)
{
    GRID_STRIDE(i, n) { dst[i] = __uint_as_float(((u32)src[i]) << 16); }
}

// f32 -> f16, round to nearest even (PTX cvt.rn.f16.f32: overflow to infinity, subnormals
// rounded correctly; a NaN becomes the canonical quiet NaN 0x7fff).
extern "C" __global__ void fsdp_f32_to_f16(const float* __restrict__ src, u16* __restrict__ dst,
                                           u64 n)
{
    GRID_STRIDE(i, n) {
        u16 h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(src[i]));
        dst[i] = h;
    }
}

// f16 -> f32, exact.
extern "C" __global__ void fsdp_f16_to_f32(const u16* __restrict__ src, float* __restrict__ dst,
                                           u64 n)
{
    GRID_STRIDE(i, n) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(src[i]));
        dst[i] = f;
    }
}

// One SGD step (PyTorch torch.optim.SGD, dampening 0, no Nesterov) as fsdp_kernels::sgd_step:
// d = g + wd * p (decayed spans, when flags bit 2 is set), buf = d on the first step (flags bit
// 1) else buf * mu + d, then p = p - lr * buf; without momentum (flags bit 0 clear) p = p - lr
// * d and buf is never read or written.
extern "C" __global__ void fsdp_sgd_tiles(
    float* __restrict__ p, const float* __restrict__ g, float* __restrict__ buf,
    const u64* __restrict__ tiles, u32 n_tiles, float lr, float wd, float mu, u32 flags)
{
    const bool use_momentum = (flags & 1u) != 0;
    const bool first_step = (flags & 2u) != 0;
    const bool wd_enabled = (flags & 4u) != 0;
    for (u32 t = blockIdx.x; t < n_tiles; t += gridDim.x) {
        const u64 start = tiles[2 * (u64)t];
        const u64 meta = tiles[2 * (u64)t + 1];
        const u32 len = (u32)(meta & 0xffffffffull);
        const bool decay = wd_enabled && (meta >> 32) != 0;
        for (u32 j = threadIdx.x; j < len; j += blockDim.x) {
            const u64 i = start + j;
            const float pi = p[i];
            float d = g[i];
            if (decay) {
                d = __fadd_rn(d, __fmul_rn(wd, pi));
            }
            if (use_momentum) {
                const float bi = first_step ? d : __fadd_rn(__fmul_rn(buf[i], mu), d);
                buf[i] = bi;
                d = bi;
            }
            p[i] = __fsub_rn(pi, __fmul_rn(lr, d));
        }
    }
}

// The NaN-propagating maximum of fsdp_kernels::max_abs: y replaces x when it is larger or NaN,
// and a NaN x is never replaced by a number (comparisons with NaN are false).
__device__ __forceinline__ float fsdp_max_nan(float x, float y)
{
    return (y > x || y != y) ? y : x;
}

// Per-tile maxima of |x| (NaN if any element is NaN): thread j takes elements j, j +
// FSDP_BLOCK, ... of the tile, then a fixed binary tree; partials[t] = tile t's maximum.
extern "C" __global__ void fsdp_maxabs_tiles(
    const float* __restrict__ x, const u64* __restrict__ tiles, u32 n_tiles,
    float* __restrict__ partials)
{
    __shared__ float sh[FSDP_BLOCK];
    for (u32 t = blockIdx.x; t < n_tiles; t += gridDim.x) {
        const u64 start = tiles[2 * (u64)t];
        const u32 len = (u32)(tiles[2 * (u64)t + 1] & 0xffffffffull);
        float best = 0.0f;
        for (u32 j = threadIdx.x; j < len; j += blockDim.x) {
            best = fsdp_max_nan(best, fabsf(x[start + j]));
        }
        sh[threadIdx.x] = best;
        __syncthreads();
        for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) {
                sh[threadIdx.x] = fsdp_max_nan(sh[threadIdx.x], sh[threadIdx.x + s]);
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            partials[t] = sh[0];
        }
        __syncthreads();
    }
}

// Maximum of n non-negative (or NaN) f32 values in one block, NaN-propagating; out[0] = 0 for
// n = 0. Launched with exactly one block.
extern "C" __global__ void fsdp_max_f32(const float* __restrict__ values, u32 n,
                                        float* __restrict__ out)
{
    __shared__ float sh[FSDP_BLOCK];
    float best = 0.0f;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) {
        best = fsdp_max_nan(best, values[j]);
    }
    sh[threadIdx.x] = best;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            sh[threadIdx.x] = fsdp_max_nan(sh[threadIdx.x], sh[threadIdx.x + s]);
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[0] = sh[0];
    }
}

// x[i] /= d (one correctly rounded division, as fsdp_kernels::div_scalar).
extern "C" __global__ void fsdp_div_scalar(float* __restrict__ x, float d, u64 n)
{
    GRID_STRIDE(i, n) { x[i] = __fdiv_rn(x[i], d); }
}

// dst[i] += (float)src[i] for a bf16 source (widening is exact).
extern "C" __global__ void fsdp_accumulate_bf16(float* __restrict__ dst,
                                                const u16* __restrict__ src, u64 n)
{
    GRID_STRIDE(i, n) { dst[i] = __fadd_rn(dst[i], __uint_as_float(((u32)src[i]) << 16)); }
}

// dst[i] += (float)src[i] for an f16 source (widening is exact).
extern "C" __global__ void fsdp_accumulate_f16(float* __restrict__ dst,
                                               const u16* __restrict__ src, u64 n)
{
    GRID_STRIDE(i, n) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(src[i]));
        dst[i] = __fadd_rn(dst[i], f);
    }
}

// dst[i] += (float)src[i] for an f64 source: rounded to nearest even first (Rust's `as f32`).
extern "C" __global__ void fsdp_accumulate_f64(float* __restrict__ dst,
                                               const double* __restrict__ src, u64 n)
{
    GRID_STRIDE(i, n) { dst[i] = __fadd_rn(dst[i], __double2float_rn(src[i])); }
}

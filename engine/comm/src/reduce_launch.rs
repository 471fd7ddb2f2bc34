//! The host arithmetic and kernel source of the NCCL backend's rank-order reduction, built
//! without the `cuda` feature too so the default `cargo test` checks it: the CUDA C source and
//! its NVRTC options, which kernel serves which dtype, the op codes, the launch grid, and how a
//! reduction larger than the scratch buffer is cut into steps (which elements of the send
//! buffer, of the scratch and of the output each step addresses). `nccl::reduce` launches
//! exactly this; its NVRTC compile is tested in the `cuda` build (`comm_unit`), which needs
//! NVRTC but no device.

use crate::topology::ReduceOp;
use fsdp_types::DType;

/// CUDA C source of the reduction kernels (one per dtype): `out[i]` = the fold over the group
/// ranks j, in rank order, of `parts[j * c + i]`.
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

/// NVRTC options besides the architecture: no fused multiply-add, IEEE division, no flush to
/// zero (the arithmetic of [`crate::reduce_in_rank_order`]).
pub const REDUCE_NVRTC_OPTIONS: [&str; 3] = ["--fmad=false", "--prec-div=true", "--ftz=false"];

/// Kernel names in [`REDUCE_SOURCE`], indexed like [`kernel_index`].
pub(crate) const REDUCE_KERNEL_NAMES: [&str; 4] = [
    "fsdp_rank_order_f32",
    "fsdp_rank_order_bf16",
    "fsdp_rank_order_f16",
    "fsdp_rank_order_f64",
];

/// The kernel of [`REDUCE_KERNEL_NAMES`] for elements of `d`.
pub(crate) fn kernel_index(d: DType) -> usize {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
        DType::F64 => 3,
    }
}

/// The op code the kernels take (`op` in [`REDUCE_SOURCE`]).
pub(crate) fn op_code(op: ReduceOp) -> u32 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
    }
}

/// Threads per block of the reduction kernels.
pub(crate) const REDUCE_BLOCK: u32 = 256;

/// Most blocks of one launch (the kernels' grid-stride loop covers the rest).
pub(crate) const REDUCE_MAX_BLOCKS: u32 = 1 << 20;

/// Blocks for `n` elements: `ceil(n / REDUCE_BLOCK)` in `1..=REDUCE_MAX_BLOCKS`.
pub(crate) fn reduce_grid(n: usize) -> u32 {
    n.div_ceil(REDUCE_BLOCK as usize)
        .clamp(1, REDUCE_MAX_BLOCKS as usize) as u32
}

/// How a rank-order reduction of `n` elements per rank over a group of `g` ranks is cut into
/// steps that fit a scratch buffer of about `chunk_bytes` (`g x chunk` elements; a step moves
/// `chunk` elements of every rank, the last step the tail).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RankOrderSteps {
    /// Elements per rank (the reduce-scatter's output count, the all-reduce's buffer length).
    pub(crate) n: usize,
    /// Ranks in the group.
    pub(crate) g: usize,
    /// Bytes per element.
    pub(crate) elem_bytes: usize,
    /// Elements per rank per step: `chunk_bytes / (g x elem_bytes)`, in `1..=n`.
    pub(crate) chunk: usize,
}

/// One step: elements `start .. start + count` of every rank's part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RankOrderStep {
    /// First element (of each rank's `n`).
    pub(crate) start: usize,
    /// Elements in this step, `1..=chunk`.
    pub(crate) count: usize,
}

impl RankOrderSteps {
    /// The steps for `n >= 1` elements per rank; `None` for `n == 0` (nothing to do).
    pub(crate) fn new(
        n: usize,
        g: usize,
        elem_bytes: usize,
        chunk_bytes: usize,
    ) -> Option<RankOrderSteps> {
        if n == 0 {
            return None;
        }
        let chunk = (chunk_bytes / (g * elem_bytes).max(1)).clamp(1, n);
        Some(RankOrderSteps {
            n,
            g,
            elem_bytes,
            chunk,
        })
    }

    /// Bytes of the scratch buffer: `g x chunk` elements.
    pub(crate) fn scratch_bytes(&self) -> usize {
        self.g * self.chunk * self.elem_bytes
    }

    /// The steps in order; together they cover `0..n` once.
    pub(crate) fn iter(&self) -> impl Iterator<Item = RankOrderStep> + '_ {
        (0..self.n).step_by(self.chunk).map(|start| RankOrderStep {
            start,
            count: self.chunk.min(self.n - start),
        })
    }

    /// Byte offset, in a reduce-scatter's send buffer (`g` blocks of `n` elements), of the
    /// step's piece of block `j` (the part group rank `j` reduces).
    pub(crate) fn send_offset(&self, step: RankOrderStep, j: usize) -> u64 {
        ((j * self.n + step.start) * self.elem_bytes) as u64
    }

    /// Byte offset, in the scratch buffer, of slot `j` of a step (where rank `j`'s `count`
    /// elements land: the kernels read `parts[j * count + i]`).
    pub(crate) fn scratch_offset(&self, step: RankOrderStep, j: usize) -> u64 {
        ((j * step.count) * self.elem_bytes) as u64
    }

    /// Byte offset, in the output (the reduce-scatter's receive buffer, the all-reduce's
    /// buffer), of the step's `count` results.
    pub(crate) fn out_offset(&self, step: RankOrderStep) -> u64 {
        (step.start * self.elem_bytes) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_covers_the_elements_within_limits() {
        assert_eq!(reduce_grid(0), 1);
        assert_eq!(reduce_grid(1), 1);
        assert_eq!(reduce_grid(256), 1);
        assert_eq!(reduce_grid(257), 2);
        assert_eq!(reduce_grid(usize::MAX / 4), REDUCE_MAX_BLOCKS);
        for n in [1usize, 255, 256, 257, 1 << 20, (1 << 28) + 3] {
            let blocks = reduce_grid(n) as usize;
            // One thread per element, or the grid-stride loop at the block limit.
            assert!(blocks * REDUCE_BLOCK as usize >= n || blocks == REDUCE_MAX_BLOCKS as usize);
            assert!(
                (blocks - 1) * (REDUCE_BLOCK as usize) < n,
                "no idle block for n = {n}"
            );
        }
    }

    #[test]
    fn kernels_op_codes_and_dtypes_match_the_source() {
        assert_eq!(
            [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max].map(op_code),
            [0, 1, 2]
        );
        assert!(REDUCE_SOURCE.contains("// op: 0 sum, 1 avg (sum, then one division by g), 2 max."));
        for (d, ty) in [
            (DType::F32, "float"),
            (DType::BF16, "u16"),
            (DType::F16, "u16"),
            (DType::F64, "double"),
        ] {
            let name = REDUCE_KERNEL_NAMES[kernel_index(d)];
            assert!(name.ends_with(d.name()), "{name} for {d:?}");
            let sig = format!(
                "extern \"C\" __global__ void {name}(const {ty}* parts, u32 g, u64 c, {ty}* out, u32 op)"
            );
            assert!(REDUCE_SOURCE.contains(&sig), "{sig}");
        }
    }

    /// Every (rank, element) of the input is read by exactly one step, into a scratch slot
    /// inside the scratch buffer, and every output element is written by exactly one step.
    fn check_cover(n: usize, g: usize, es: usize, chunk_bytes: usize) {
        let s = RankOrderSteps::new(n, g, es, chunk_bytes).unwrap();
        assert!(s.chunk >= 1 && s.chunk <= n);
        assert!(
            s.scratch_bytes() <= chunk_bytes.max(g * es),
            "scratch within the budget (or one element per rank)"
        );
        let mut read = vec![0u8; g * n];
        let mut written = vec![0u8; n];
        let mut steps = 0;
        for step in s.iter() {
            steps += 1;
            assert!(step.count >= 1 && step.count <= s.chunk);
            for j in 0..g {
                let from = s.send_offset(step, j) as usize;
                let into = s.scratch_offset(step, j) as usize;
                assert_eq!(from % es, 0);
                assert!(
                    into + step.count * es <= s.scratch_bytes(),
                    "slot {j} inside"
                );
                for e in &mut read[from / es..from / es + step.count] {
                    *e += 1;
                }
            }
            let out = s.out_offset(step) as usize / es;
            for e in &mut written[out..out + step.count] {
                *e += 1;
            }
        }
        assert_eq!(steps, n.div_ceil(s.chunk));
        assert!(read.iter().all(|&c| c == 1), "n={n} g={g} es={es}");
        assert!(written.iter().all(|&c| c == 1), "n={n} g={g} es={es}");
    }

    #[test]
    fn steps_cover_every_element_once_with_a_tail() {
        assert_eq!(RankOrderSteps::new(0, 4, 4, 1 << 20), None);
        // Default budget: one step.
        let one = RankOrderSteps::new(1000, 8, 4, 64 << 20).unwrap();
        assert_eq!((one.chunk, one.iter().count()), (1000, 1));
        // 10 elements of 4 bytes, 2 ranks, 24 bytes of scratch: 3 per step, tail of 1.
        let s = RankOrderSteps::new(10, 2, 4, 24).unwrap();
        let steps: Vec<_> = s.iter().map(|t| (t.start, t.count)).collect();
        assert_eq!(steps, vec![(0, 3), (3, 3), (6, 3), (9, 1)]);
        assert_eq!(s.send_offset(steps_at(&s, 3), 1), ((10 + 9) * 4) as u64);
        assert_eq!(s.scratch_offset(steps_at(&s, 3), 1), 4);
        assert_eq!(s.out_offset(steps_at(&s, 3)), 36);
        // A budget smaller than one element per rank still makes progress.
        assert_eq!(RankOrderSteps::new(5, 8, 8, 1).unwrap().chunk, 1);
        for (n, g, es, budget) in [
            (1, 1, 4, 64 << 20),
            (7, 3, 2, 12),
            (1000, 4, 2, 100),
            (4097, 8, 8, 1 << 12),
            (33, 5, 4, 5 * 4 * 33),
            (34, 5, 4, 5 * 4 * 33),
        ] {
            check_cover(n, g, es, budget);
        }
    }

    fn steps_at(s: &RankOrderSteps, i: usize) -> RankOrderStep {
        s.iter().nth(i).unwrap()
    }
}

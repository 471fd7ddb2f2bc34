//! Hardware profiles (`fsdp-hardware/1` JSON): what one rank's device and links can do, the
//! numbers the time model turns FLOPs and bytes into seconds.
//!
//! ```text
//! {
//!   "schema": "fsdp-hardware/1",
//!   "name": string, "description": string,
//!   "ranks_per_node": int,                      // ranks sharing a node's fast links (>= 1)
//!   "gemm": {                                   // per dtype the plan computes in; each optional
//!     "bf16" | "f16" | "f32" | "f64": {
//!       "peak_flops_per_s": float,              // the MFU denominator (vendor dense peak, or
//!                                               // the measured maximum of a calibrated profile)
//!       "points": [{"flops": float, "flops_per_s": float}, ...],
//!                                               // rate of one GEMM call by its FLOPs: linear
//!                                               // in log10(flops), clamped at both ends
//!       "shapes": [{"m": int, "k": int, "n": int, // optional: measured rates by shape and
//!                   "layout": "nn" | "nt" | "tn", // operand layout, a full grid per layout
//!                   "flops_per_s": float}, ...]  // (see `GemmCurve::rate_of`)
//!     }
//!   },
//!   "memory_bandwidth_bytes_per_s": float,      // elementwise ops, the optimizer step
//!   "elementwise_flops_per_s": float,           // the compute roof of elementwise ops
//!   "collectives": {
//!     "intra_node" | "inter_node": {
//!       "all_gather" | "reduce_scatter" | "all_reduce": {
//!         "latency_s": float,                   // fixed cost of one call
//!         "step_latency_s": float,              // per ring step (n-1, all-reduce 2(n-1))
//!         "bus_bandwidth_bytes_per_s": float    // nccl-tests' busbw; inter_node: per rank
//!       }
//!     }
//!   },
//!   "host": {
//!     "link_bytes_per_s": float,                // device <-> host copies (offload)
//!     "optimizer_bytes_per_s": float            // host optimizer threads' memory traffic
//!   },
//!   "overlap_slowdown": float,                  // compute runs 1 + this slower while a
//!                                               // collective is in flight (0 = free overlap)
//!   "rank_skew": float,                         // optional (0): the slowest rank's compute
//!                                               // exceeds the mean rank's by this fraction
//!   "memory_bandwidth_curve": [                 // optional: bandwidth by bytes one pass
//!     {"bytes": float, "bytes_per_s": float}    // moves (caches); linear in log10(bytes)
//!   ],
//!   "norm_elements_per_s": float,               // optional: the gradient norm's sum of
//!                                               // squares, elements/s (else memory-bound)
//!   "optimizer_bytes_per_s": float,             // optional: the optimizer step on the
//!                                               // rank's compute threads (else the curve)
//!   "compute_fit": {                            // optional: fitted by `fsdp calibrate`,
//!     "bf16" | "f16" | "f32" | "f64": {         // per param_dtype, each optional
//!       "gemm_scale": float, "elementwise_scale": float, "op_overhead_s": float,
//!                                               // (gemm_scale 0.01..100,
//!                                               // elementwise_scale 0..100,
//!                                               // op_overhead_s 0..0.01)
//!       "rms_relative_error": float, "samples": int,
//!       "gemm_pricing": "shape" | "size"        // optional: what the fit was made with;
//!     }                                         // must agree with gemm.<dtype>.shapes
//!   },
//!   "sources": {"json.path": "where the number comes from", ...}
//! }
//! ```
//!
//! Every number must be present, finite and inside the plausible range of its kind (below);
//! curve points must have increasing `flops`, and no point may exceed its dtype's peak (else
//! MFU could pass 100%). A violation is [`PlanError::BadProfile`] naming the field by its
//! JSON path, its value and the range. `sources` is free text per path; the built-in profiles
//! cite a public document for every number.
//!
//! The plausible ranges (inclusive) are wide enough for any machine a rank runs on, from one
//! laptop CPU core to accelerators several generations past today's, and narrow enough that a
//! unit mistake (milliseconds written as seconds, bits as bytes times a million) or a broken
//! measurement is refused instead of giving an absurd prediction:
//!
//! | kind | fields | range | why |
//! |---|---|---|---|
//! | [`FLOP_RATE`] | `gemm.*.peak_flops_per_s`, `gemm.*.points[i].flops_per_s`, `gemm.*.shapes[i].flops_per_s`, `elementwise_flops_per_s` | 1e6..1e18 FLOP/s | one core of a 1990s CPU does 1e7-1e8; an H200 does 9.9e14 dense BF16, so 1e18 (an exaFLOP/s per rank) leaves three orders of magnitude of headroom |
//! | [`GEMM_DIM`] | `gemm.*.shapes[i].m`, `.k`, `.n` | 1..1e7 | a dimension of one GEMM call: the rows of a micro-batch of a million tokens, or a vocabulary, stay under 1e7 |
//! | [`CALL_FLOPS`] | `gemm.*.points[i].flops` | 1..1e20 FLOPs | a call is at least one multiply-add pair; 1e20 FLOPs would be one GEMM running for over a day on an H200 |
//! | [`BANDWIDTH`] | `memory_bandwidth_bytes_per_s`, `memory_bandwidth_curve[*].bytes_per_s`, `collectives.*.*.bus_bandwidth_bytes_per_s`, `host.*`, `optimizer_bytes_per_s` | 1e6..1e15 bytes/s | 10 Mb/s Ethernet is 1.25e6; HBM3e of an H200 is 4.8e12, NVLink 4.5e11 per direction, so 1 PB/s leaves 200x |
//! | [`ELEMENT_RATE`] | `norm_elements_per_s` | 1e5..1e15 elements/s | one dependent f64 addition per element runs at 1e8-1e9 on a CPU core; an H200's HBM streams 1.2e12 f32 elements a second |
//! | [`LATENCY`] | `collectives.*.*.latency_s`, `collectives.*.*.step_latency_s` | 0..1 s | NCCL's model is microseconds and a TCP round trip across a data center milliseconds; a second per call is a unit mistake |
//! | [`SLOWDOWN`] | `overlap_slowdown` | 0..10 | compute 11x slower while a collective runs is a broken measurement (NCCL's channels take about 1/8 of an H200's SMs: 0.12) |
//! | [`SKEW`] | `rank_skew` | 0..1 | the slowest rank twice as slow as the mean rank is a broken machine or measurement, not a skew to plan with |
//! | [`RANKS_PER_NODE`] | `ranks_per_node` | 1..1024 | `fsdp launch` starts at most 1024 processes per node; 8 GPUs, or one rank per core of the largest hosts, is the rule |
//!
//! Built in: `h100-sxm`, `h200`, `a100-80gb` (`planner/profiles/*.json`), from NVIDIA's
//! datasheets, the measured maximum achievable matmul FLOPS (MAMF) of Bekman's
//! "Machine Learning Engineering", and NCCL's own latency model (`src/graph/tuning.cc`).

use crate::error::PlanError;
use fsdp_types::DType;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The schema tag every profile carries.
pub const PROFILE_SCHEMA: &str = "fsdp-hardware/1";

/// The built-in profiles, by name, with their JSON text.
const BUILTIN: [(&str, &str); 3] = [
    ("h100-sxm", include_str!("../../profiles/h100-sxm.json")),
    ("h200", include_str!("../../profiles/h200.json")),
    ("a100-80gb", include_str!("../../profiles/a100-80gb.json")),
];

/// The names of the built-in hardware profiles.
pub const BUILTIN_PROFILE_NAMES: [&str; 3] = ["h100-sxm", "h200", "a100-80gb"];

/// One point of a GEMM rate curve.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CurvePoint {
    /// FLOPs of one GEMM call (`2 m n k`; a batched call counts its whole batch).
    pub flops: f64,
    /// FLOPs per second a call of that size achieves.
    pub flops_per_s: f64,
}

/// How the two operands of a GEMM `C[m, n] = op(A)[m, k] op(B)[k, n]` lie in memory, BLAS's
/// transpose flags: `n`, the operand is a row-major matrix used as stored (`A` stored
/// `[m, k]`, `B` stored `[k, n]`); `t`, it is the transposed view of a row-major matrix (`A`
/// stored `[k, m]`, `B` stored `[n, k]`), multiplied without a copy. A kernel packs the two
/// cases with different memory strides, so one shape runs at different rates in each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GemmLayout {
    /// `A B`: a linear layer's forward with a weight stored `[in, out]` (GPT-2's Conv1D), or
    /// the input gradient `dY W` of a weight stored `[out, in]`.
    Nn,
    /// `A B^T`: a linear layer's forward with a weight stored `[out, in]` (torch's layout, the
    /// Llama projections and every LM head), the input gradient `dY W^T` of a weight stored
    /// `[in, out]`, attention's scores `Q K^T`.
    Nt,
    /// `A^T B`: a weight gradient `X^T dY`.
    Tn,
}

impl GemmLayout {
    /// Every layout, in the order profiles list them.
    pub const ALL: [GemmLayout; 3] = [GemmLayout::Nn, GemmLayout::Nt, GemmLayout::Tn];

    /// The JSON name (`nn`).
    pub fn name(self) -> &'static str {
        match self {
            GemmLayout::Nn => "nn",
            GemmLayout::Nt => "nt",
            GemmLayout::Tn => "tn",
        }
    }
}

/// The shape of one GEMM call, `C[m, n] = op(A)[m, k] op(B)[k, n]`, `2 m k n` FLOPs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GemmShape {
    /// Rows of `C` (a linear layer's forward: the micro-batch's tokens).
    pub m: u64,
    /// The reduced dimension.
    pub k: u64,
    /// Columns of `C`.
    pub n: u64,
    /// How the operands lie in memory.
    pub layout: GemmLayout,
}

impl GemmShape {
    /// FLOPs of one call: `2 m k n`.
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.k as f64 * self.n as f64
    }
}

/// One measured GEMM rate by shape and layout.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShapePoint {
    /// Rows of `C`.
    pub m: u64,
    /// The reduced dimension.
    pub k: u64,
    /// Columns of `C`.
    pub n: u64,
    /// The operands' layout.
    pub layout: GemmLayout,
    /// FLOPs per second a call of this shape achieves.
    pub flops_per_s: f64,
}

/// The GEMM rate of one dtype.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GemmCurve {
    /// The dense peak (FLOP/s) MFU divides by.
    pub peak_flops_per_s: f64,
    /// The achieved rate by call size, `flops` increasing.
    pub points: Vec<CurvePoint>,
    /// Measured rates by shape and layout (optional; `fsdp calibrate` measures them on the
    /// CPU): for each layout present, one point per `(m, k, n)` of a grid, every dimension
    /// taking each of the grid's values (the values of `m`, `k` and `n` together). Empty, or a
    /// layout absent: calls of that layout run at the rate of their FLOPs ([`Self::rate`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shapes: Vec<ShapePoint>,
}

impl GemmCurve {
    /// The rate (FLOP/s) of a call of `flops` FLOPs: linear in `log10(flops)` between the two
    /// points around it, the first point's rate below the first, the last's above the last.
    pub fn rate(&self, flops: f64) -> f64 {
        let p = &self.points;
        let first = p[0];
        if flops <= first.flops {
            return first.flops_per_s;
        }
        for w in p.windows(2) {
            let (a, b) = (w[0], w[1]);
            if flops <= b.flops {
                let x = (flops.log10() - a.flops.log10()) / (b.flops.log10() - a.flops.log10());
                return a.flops_per_s + x * (b.flops_per_s - a.flops_per_s);
            }
        }
        p[p.len() - 1].flops_per_s
    }

    /// Seconds for one GEMM call of `flops` FLOPs.
    pub fn seconds(&self, flops: f64) -> f64 {
        if flops <= 0.0 {
            0.0
        } else {
            flops / self.rate(flops)
        }
    }

    /// The rate (FLOP/s) of one call of `shape`: the rate of its FLOPs ([`Self::rate`]) times
    /// the shape's factor, at most the peak. The factor of a grid point is its measured rate
    /// over the rate of its FLOPs; between grid points, `ln(factor)` is interpolated linearly
    /// in `ln m`, `ln k` and `ln n` (trilinear over the eight grid points around the shape),
    /// and each dimension is clamped to the grid's range, so outside it the factor of the
    /// nearest edge scales the size curve. Without grid points of the shape's layout the
    /// factor is 1.
    ///
    /// The factor carries what the FLOPs alone miss: a thin matrix (few rows against many
    /// columns) or a transposed operand packs at another rate than a square one of the same
    /// FLOPs.
    pub fn rate_of(&self, shape: &GemmShape) -> f64 {
        let base = self.rate(shape.flops());
        let grid: Vec<&ShapePoint> = self
            .shapes
            .iter()
            .filter(|p| p.layout == shape.layout)
            .collect();
        if grid.is_empty() {
            return base;
        }
        let dims = grid_dims(grid.iter().copied());
        // (lower index, upper index, weight of the upper) per dimension.
        let locate = |v: u64| -> (usize, usize, f64) {
            let x = (v.max(1) as f64).ln();
            let last = dims.len() - 1;
            if v <= dims[0] {
                return (0, 0, 0.0);
            }
            if v >= dims[last] {
                return (last, last, 0.0);
            }
            let i = dims.iter().rposition(|&d| d <= v).unwrap_or(0);
            let (a, b) = ((dims[i] as f64).ln(), (dims[i + 1] as f64).ln());
            (i, i + 1, (x - a) / (b - a))
        };
        let axes = [locate(shape.m), locate(shape.k), locate(shape.n)];
        let mut ln_factor = 0.0;
        for corner in 0..8u32 {
            let mut w = 1.0;
            let mut at = [0u64; 3];
            for (axis, &(lo, hi, t)) in axes.iter().enumerate() {
                let upper = corner & (1 << axis) != 0;
                w *= if upper { t } else { 1.0 - t };
                at[axis] = dims[if upper { hi } else { lo }];
            }
            if w == 0.0 {
                continue;
            }
            let Some(p) = grid.iter().find(|p| [p.m, p.k, p.n] == at) else {
                // A validated profile holds the whole grid.
                return base;
            };
            let flops = 2.0 * (p.m as f64) * (p.k as f64) * (p.n as f64);
            ln_factor += w * (p.flops_per_s / self.rate(flops)).ln();
        }
        (base * ln_factor.exp()).min(self.peak_flops_per_s)
    }

    /// Seconds for one GEMM call of `shape` at [`Self::rate_of`].
    pub fn seconds_of(&self, shape: &GemmShape) -> f64 {
        let flops = shape.flops();
        if flops <= 0.0 {
            0.0
        } else {
            flops / self.rate_of(shape)
        }
    }
}

/// The sorted distinct values `m`, `k` and `n` take over `points`: one layout's grid.
fn grid_dims<'a>(points: impl Iterator<Item = &'a ShapePoint>) -> Vec<u64> {
    let mut dims: Vec<u64> = points.flat_map(|p| [p.m, p.k, p.n]).collect();
    dims.sort_unstable();
    dims.dedup();
    dims
}

/// GEMM curves per dtype (each optional: a plan computing in a dtype the profile lacks is an
/// error naming the field).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GemmRates {
    /// bf16 operands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16: Option<GemmCurve>,
    /// f16 operands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub f16: Option<GemmCurve>,
    /// f32 operands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub f32: Option<GemmCurve>,
    /// f64 operands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub f64: Option<GemmCurve>,
}

impl GemmRates {
    /// The curve of `dtype`, if the profile has one.
    pub fn get(&self, dtype: DType) -> Option<&GemmCurve> {
        match dtype {
            DType::BF16 => self.bf16.as_ref(),
            DType::F16 => self.f16.as_ref(),
            DType::F32 => self.f32.as_ref(),
            DType::F64 => self.f64.as_ref(),
        }
    }
}

/// One point of a memory bandwidth curve.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BandwidthPoint {
    /// Bytes one pass reads plus writes.
    pub bytes: f64,
    /// Bytes per second such a pass achieves.
    pub bytes_per_s: f64,
}

/// How measured unit compute times relate to the analytical model on a machine: a unit use's
/// compute time is `gemm_scale x` its GEMM seconds (the GEMM curve) `+ elementwise_scale x`
/// its elementwise seconds (the roofline of bandwidth and elementwise rate) `+ op_overhead_s
/// x` its op count. The analytical model leaves out what a framework adds around the math
/// (output allocation and first touch, dispatch, layout copies, transcendental functions
/// slower than a multiply-add), so `fsdp calibrate` fits these three numbers by least
/// squares to the forward and backward times of every unit of reference training steps it
/// runs on the machine, each job weighted alike (GPT-2 and Llama-family models, not the one predicted). Absent from a
/// profile: 1, 1 and 0.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeFit {
    /// Factor on GEMM seconds (> 0).
    pub gemm_scale: f64,
    /// Factor on elementwise seconds (>= 0).
    pub elementwise_scale: f64,
    /// Seconds added per op (>= 0).
    pub op_overhead_s: f64,
    /// The root-mean-square relative error of the fitted total compute of the reference jobs
    /// it was fitted to (informative).
    pub rms_relative_error: f64,
    /// How many unit times it was fitted to (informative).
    pub samples: u64,
    /// How the GEMM seconds it scales were priced when it was fitted (optional; `fsdp
    /// calibrate` records it): by the dtype's shape grid, or by the size curve alone. A
    /// profile whose grid disagrees with it (a grid removed after a fit by shape, or added
    /// after a fit by size) is refused: the scale belongs to the pricing it was fitted with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_pricing: Option<GemmPricing>,
}

/// How GEMM seconds are priced: at the rate of each call's shape and layout (the profile's
/// grid, [`GemmCurve::rate_of`]) or at the rate of its FLOPs ([`GemmCurve::rate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GemmPricing {
    /// By shape and layout.
    Shape,
    /// By size alone.
    Size,
}

/// [`ComputeFit`]s by the dtype the model computes in (`param_dtype`), each optional.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeFits {
    /// bf16 compute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16: Option<ComputeFit>,
    /// f16 compute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub f16: Option<ComputeFit>,
    /// f32 compute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub f32: Option<ComputeFit>,
    /// f64 compute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub f64: Option<ComputeFit>,
}

impl ComputeFits {
    /// Whether no dtype has a fit.
    pub fn is_empty(&self) -> bool {
        self.entries().iter().all(|(_, f)| f.is_none())
    }

    /// The fit of `dtype`, if any.
    pub fn get(&self, dtype: DType) -> Option<ComputeFit> {
        match dtype {
            DType::BF16 => self.bf16,
            DType::F16 => self.f16,
            DType::F32 => self.f32,
            DType::F64 => self.f64,
        }
    }

    /// Sets the fit of `dtype`.
    pub fn set(&mut self, dtype: DType, fit: ComputeFit) {
        let slot = match dtype {
            DType::BF16 => &mut self.bf16,
            DType::F16 => &mut self.f16,
            DType::F32 => &mut self.f32,
            DType::F64 => &mut self.f64,
        };
        *slot = Some(fit);
    }

    /// (JSON key, fit) per dtype.
    fn entries(&self) -> [(&'static str, Option<ComputeFit>); 4] {
        [
            ("bf16", self.bf16),
            ("f16", self.f16),
            ("f32", self.f32),
            ("f64", self.f64),
        ]
    }
}

impl ComputeFit {
    /// No correction: the analytical model as is.
    pub const IDENTITY: ComputeFit = ComputeFit {
        gemm_scale: 1.0,
        elementwise_scale: 1.0,
        op_overhead_s: 0.0,
        rms_relative_error: 0.0,
        samples: 0,
        gemm_pricing: None,
    };
}

/// The cost of one collective kind on one level of links (NCCL's ring model, `tuning.cc`:
/// latency = base + steps x per-step latency; time = latency + bytes / algorithm bandwidth).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectiveCost {
    /// Fixed seconds per call.
    pub latency_s: f64,
    /// Seconds per ring step (`n - 1` steps for all-gather and reduce-scatter, `2(n - 1)` for
    /// all-reduce; on `inter_node`, the steps that cross nodes).
    pub step_latency_s: f64,
    /// Bus bandwidth in bytes/s, nccl-tests' convention (`doc/PERFORMANCE.md`: busbw = algbw x
    /// (n-1)/n for all-gather and reduce-scatter, x 2(n-1)/n for all-reduce). On `inter_node`,
    /// the bandwidth of one rank's network port: a group with `k` members per node crosses
    /// nodes on `k` ports at once.
    pub bus_bandwidth_bytes_per_s: f64,
}

/// The three collectives FSDP issues, on one level of links.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkCollectives {
    /// All-gather (parameters).
    pub all_gather: CollectiveCost,
    /// Reduce-scatter (gradients).
    pub reduce_scatter: CollectiveCost,
    /// All-reduce (gradients without sharding, hybrid's replicate level, scalars).
    pub all_reduce: CollectiveCost,
}

/// Collective costs within one node and across nodes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Collectives {
    /// Groups whose ranks all sit in one node (NVLink, or threads of one host).
    pub intra_node: LinkCollectives,
    /// Groups spanning nodes (the network).
    pub inter_node: LinkCollectives,
}

/// The host side of offload.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostLink {
    /// Device <-> host copy bandwidth, bytes/s (one direction).
    pub link_bytes_per_s: f64,
    /// Bytes/s the host optimizer threads read plus write (the offloaded optimizer step and
    /// gradient post-processing).
    pub optimizer_bytes_per_s: f64,
}

/// A hardware profile (see the module doc for the JSON and its rules). Every rate is one
/// rank's: one device, or the cores one rank gets on a shared CPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareProfile {
    /// Always [`PROFILE_SCHEMA`].
    pub schema: String,
    /// Short name (`h100-sxm`).
    pub name: String,
    /// What machine this describes and how the numbers were obtained.
    pub description: String,
    /// Ranks per node (decides which groups cross nodes).
    pub ranks_per_node: u64,
    /// GEMM rates per dtype.
    pub gemm: GemmRates,
    /// Memory bandwidth (bytes/s) of elementwise ops and the optimizer step.
    pub memory_bandwidth_bytes_per_s: f64,
    /// FLOP/s of elementwise (non-GEMM) arithmetic.
    pub elementwise_flops_per_s: f64,
    /// Collective costs.
    pub collectives: Collectives,
    /// Host link and host optimizer.
    pub host: HostLink,
    /// Fraction by which compute slows while a collective is in flight (>= 0).
    pub overlap_slowdown: f64,
    /// Fraction by which the slowest rank's compute exceeds the mean rank's (optional; 0 when
    /// absent, and on a world of one rank). Every collective waits for its last rank, so a
    /// synchronous step runs at the slowest rank's pace: the other ranks wait for it at their
    /// collectives (what the engine measures as exposed communication). On a shared CPU host
    /// the ranks' threads do not run equally fast (another tenant, the kernel, time slices
    /// when ranks outnumber cores); `fsdp calibrate` measures it from its reference jobs'
    /// waits at its world size.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rank_skew: f64,
    /// Memory bandwidth by bytes moved in one pass (optional; `fsdp calibrate` measures it):
    /// a pass whose bytes fit a cache runs faster than `memory_bandwidth_bytes_per_s`. Empty:
    /// every pass runs at `memory_bandwidth_bytes_per_s`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory_bandwidth_curve: Vec<BandwidthPoint>,
    /// Elements per second of the gradient norm's sum of squares over the gradient shards
    /// (optional; `fsdp calibrate` measures the engine's kernel). On a CPU device the sum is
    /// one f64 accumulator added to in element order (bitwise reproducible), so it runs at the
    /// latency of a dependent addition, not at the memory bandwidth. Absent: a memory-bound
    /// pass reading 4 bytes per element.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_elements_per_s: Option<f64>,
    /// Bytes moved per second by the optimizer step of a shard on the device (optional;
    /// `fsdp calibrate` measures the engine's AdamW on the rank's compute threads, which a
    /// CPU device splits the shard over), counting the update's bytes read plus written: AdamW
    /// 28 per element (parameter, gradient and both moments read; parameter and moments
    /// written), SGD 20 with momentum, 12 without. Zeroing the gradient after it stays a
    /// memory-bound pass. Absent: the memory bandwidth curve. An offloaded step runs at
    /// `host.optimizer_bytes_per_s` either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_bytes_per_s: Option<f64>,
    /// The compute model's correction per `param_dtype`, fitted to measured training steps
    /// (optional; `fsdp calibrate` fits it on the CPU). Absent for a dtype: the analytical
    /// model as is.
    #[serde(default, skip_serializing_if = "ComputeFits::is_empty")]
    pub compute_fit: ComputeFits,
    /// The source of each number, by JSON path.
    #[serde(default)]
    pub sources: BTreeMap<String, String>,
    /// Where the profile was read from (the `origin` given to [`HardwareProfile::from_json`]:
    /// a file name, or `built-in NAME`), so that a later error names the file the user gave;
    /// empty for a profile built in memory. Not part of the JSON.
    #[serde(skip)]
    pub origin: String,
}

/// The plausible range of one kind of profile number (inclusive bounds), what the module
/// doc's table lists; a value outside it is [`PlanError::BadProfile`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlausibleRange {
    /// The smallest plausible value.
    pub min: f64,
    /// The largest plausible value.
    pub max: f64,
    /// The unit the bounds are in (`FLOP/s`, `bytes/s`, `s`; empty for a pure number).
    pub unit: &'static str,
    /// What kind of number this is, for the message (`a FLOP rate`).
    pub kind: &'static str,
}

impl PlausibleRange {
    /// Whether `v` lies inside the range (a NaN does not).
    pub fn contains(&self, v: f64) -> bool {
        v >= self.min && v <= self.max
    }

    /// The range as the messages print it: `1e6..1e18 FLOP/s`.
    pub fn describe(&self) -> String {
        let unit = if self.unit.is_empty() {
            String::new()
        } else {
            format!(" {}", self.unit)
        };
        format!("{}..{}{unit}", num(self.min), num(self.max))
    }
}

/// FLOP/s of a GEMM curve point or peak, or of elementwise arithmetic: 1e6..1e18.
pub const FLOP_RATE: PlausibleRange = PlausibleRange {
    min: 1e6,
    max: 1e18,
    unit: "FLOP/s",
    kind: "a FLOP rate",
};

/// One dimension of a GEMM call (a shape point's `m`, `k` or `n`): 1..1e7.
pub const GEMM_DIM: PlausibleRange = PlausibleRange {
    min: 1.0,
    max: 1e7,
    unit: "",
    kind: "a GEMM dimension",
};

/// FLOPs of one GEMM call (a curve point's `flops`): 1..1e20.
pub const CALL_FLOPS: PlausibleRange = PlausibleRange {
    min: 1.0,
    max: 1e20,
    unit: "FLOPs",
    kind: "the FLOPs of one GEMM call",
};

/// Bytes/s of memory, a collective's bus, the host link or the host optimizer: 1e6..1e15.
pub const BANDWIDTH: PlausibleRange = PlausibleRange {
    min: 1e6,
    max: 1e15,
    unit: "bytes/s",
    kind: "a bandwidth",
};

/// Elements per second of a pass over a buffer: 1e5..1e15.
pub const ELEMENT_RATE: PlausibleRange = PlausibleRange {
    min: 1e5,
    max: 1e15,
    unit: "elements/s",
    kind: "an element rate",
};

/// Seconds of a collective's fixed or per-step latency: 0..1.
pub const LATENCY: PlausibleRange = PlausibleRange {
    min: 0.0,
    max: 1.0,
    unit: "s",
    kind: "a latency",
};

/// The overlap slowdown (a fraction): 0..10.
pub const SLOWDOWN: PlausibleRange = PlausibleRange {
    min: 0.0,
    max: 10.0,
    unit: "",
    kind: "a slowdown",
};

/// Whether a number is 0 (an optional field left out of the JSON).
fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

/// The rank skew (a fraction of the mean rank's compute): 0..1.
pub const SKEW: PlausibleRange = PlausibleRange {
    min: 0.0,
    max: 1.0,
    unit: "",
    kind: "a rank skew",
};

/// Ranks per node: 1..1024 (`fsdp launch`'s limit of processes per node).
pub const RANKS_PER_NODE: PlausibleRange = PlausibleRange {
    min: 1.0,
    max: 1024.0,
    unit: "",
    kind: "a rank count",
};

/// `v` as a message prints it: plain between 1e-3 and 1e6 (`-1`, `0.12`), else in exponent
/// form (`1e-300`, `3.35e12`), never 300 digits.
fn num(v: f64) -> String {
    if v == 0.0 || (v.abs() >= 1e-3 && v.abs() < 1e6) {
        format!("{v}")
    } else {
        format!("{v:e}")
    }
}

/// Checks `v` of `field` against `range`: finite, then inside the range (a value of the
/// wrong sign is named as such).
fn check_range(origin: &str, field: &str, v: f64, range: &PlausibleRange) -> Result<(), PlanError> {
    if !v.is_finite() {
        return Err(bad(origin, field, format!("is not a finite number ({v})")));
    }
    if range.contains(v) {
        return Ok(());
    }
    let problem = if range.min > 0.0 && v <= 0.0 {
        format!(
            "must be positive, got {}; {} is plausible in {}",
            num(v),
            range.kind,
            range.describe()
        )
    } else if range.min == 0.0 && v < 0.0 {
        format!(
            "must not be negative, got {}; {} is plausible in {}",
            num(v),
            range.kind,
            range.describe()
        )
    } else {
        format!(
            "is {}, outside the plausible range of {}, {} (a unit mistake or a broken \
             measurement?)",
            num(v),
            range.kind,
            range.describe()
        )
    };
    Err(bad(origin, field, problem))
}

fn bad(origin: &str, field: impl Into<String>, problem: impl Into<String>) -> PlanError {
    PlanError::BadProfile {
        origin: origin.to_string(),
        field: field.into(),
        problem: problem.into(),
    }
}

impl HardwareProfile {
    /// Parses and validates a profile. `origin` names it in errors (a file name).
    ///
    /// Errors: [`PlanError::BadProfile`] naming the JSON path of a missing, unknown,
    /// mistyped or non-finite value, one outside its plausible range (value and range
    /// named), a curve out of order or above its peak, or a wrong `schema`.
    pub fn from_json(text: &str, origin: &str) -> Result<Self, PlanError> {
        // A byte-order mark (some Windows editors write one) is not JSON; read past it.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        // Valid JSON that is not an object (serde would read an array as the fields in
        // order): named as the wrong shape, not by a field.
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(text) {
            if !v.is_object() {
                let kind = match v {
                    serde_json::Value::Array(_) => "an array",
                    serde_json::Value::String(_) => "a string",
                    serde_json::Value::Number(_) => "a number",
                    serde_json::Value::Bool(_) => "a boolean",
                    _ => "null",
                };
                return Err(bad(
                    origin,
                    "(document)",
                    format!("must be one JSON object with the profile's fields, got {kind}"),
                ));
            }
        }
        let de = &mut serde_json::Deserializer::from_str(text);
        let p: HardwareProfile = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.inner();
            let msg = inner.to_string();
            let at = format!("(line {}, column {})", inner.line(), inner.column());
            if let Some(name) = between(&msg, "missing field `", "`") {
                let field = if path == "." || path.is_empty() {
                    name.to_string()
                } else {
                    format!("{path}.{name}")
                };
                bad(origin, field, format!("is missing {at}"))
            } else if msg.starts_with("unknown field") {
                let known = msg
                    .split_once(", expected ")
                    .map(|(_, k)| format!("; expected {}", strip_position(k)))
                    .unwrap_or_default();
                bad(origin, path, format!("is not a profile field {at}{known}"))
            } else if msg.starts_with("number out of range") {
                bad(origin, path, format!("is not a finite number {at}"))
            } else if inner.is_syntax() || inner.is_eof() {
                // JSON has no NaN or infinity (Python's json.dump writes them unless told not
                // to): name the word instead of serde's position alone.
                let word = ["NaN", "-Infinity", "Infinity"]
                    .into_iter()
                    .find(|w| as_value(text, w))
                    .map(|w| {
                        format!(
                            " (`{w}` is not a JSON number: every profile number must be finite)"
                        )
                    })
                    .unwrap_or_default();
                bad(
                    origin,
                    "(document)",
                    format!("is not valid JSON: {msg}{word}"),
                )
            } else if path == "." || path.is_empty() {
                bad(origin, "(document)", format!("is not a profile: {msg}"))
            } else {
                bad(origin, path, format!("has the wrong type: {msg}"))
            }
        })?;
        // One profile per file: anything after its closing brace (a second profile pasted
        // below, stray text) would otherwise be ignored without a word.
        de.end().map_err(|e| {
            bad(
                origin,
                "(document)",
                format!(
                    "has text after the profile's closing brace (line {}, column {}): one file \
                     holds one profile",
                    e.line(),
                    e.column()
                ),
            )
        })?;
        p.validate(origin)?;
        Ok(HardwareProfile {
            origin: origin.to_string(),
            ..p
        })
    }

    /// Checks every number against its plausible range (see the module doc). `origin` names
    /// the profile in errors.
    ///
    /// Errors: [`PlanError::BadProfile`] naming the field, its value and the range.
    pub fn validate(&self, origin: &str) -> Result<(), PlanError> {
        if self.schema != PROFILE_SCHEMA {
            return Err(bad(
                origin,
                "schema",
                format!("is `{}`, expected `{PROFILE_SCHEMA}`", self.schema),
            ));
        }
        if self.name.trim().is_empty() || self.name.chars().any(char::is_control) {
            return Err(bad(
                origin,
                "name",
                format!(
                    "is {:?}: a profile's name needs a visible character and no control \
                     characters (it heads every prediction's report)",
                    self.name
                ),
            ));
        }
        if self.ranks_per_node == 0 {
            return Err(bad(origin, "ranks_per_node", "must be at least 1, got 0"));
        }
        check_range(
            origin,
            "ranks_per_node",
            self.ranks_per_node as f64,
            &RANKS_PER_NODE,
        )?;
        let check =
            |field: &str, v: f64, range: &PlausibleRange| check_range(origin, field, v, range);
        let mut any_curve = false;
        for (dt, curve) in [
            ("bf16", &self.gemm.bf16),
            ("f16", &self.gemm.f16),
            ("f32", &self.gemm.f32),
            ("f64", &self.gemm.f64),
        ] {
            let Some(c) = curve else { continue };
            any_curve = true;
            let base = format!("gemm.{dt}");
            check(
                &format!("{base}.peak_flops_per_s"),
                c.peak_flops_per_s,
                &FLOP_RATE,
            )?;
            if c.points.is_empty() {
                return Err(bad(
                    origin,
                    format!("{base}.points"),
                    "needs at least one point",
                ));
            }
            for (i, pt) in c.points.iter().enumerate() {
                let at = format!("{base}.points[{i}]");
                check(&format!("{at}.flops"), pt.flops, &CALL_FLOPS)?;
                check(&format!("{at}.flops_per_s"), pt.flops_per_s, &FLOP_RATE)?;
                if i > 0 && pt.flops <= c.points[i - 1].flops {
                    return Err(bad(
                        origin,
                        format!("{at}.flops"),
                        format!(
                            "must exceed the previous point's ({} <= {})",
                            pt.flops,
                            c.points[i - 1].flops
                        ),
                    ));
                }
                under_peak(origin, &at, base.as_str(), pt.flops_per_s, c)?;
            }
            validate_shapes(origin, &base, c)?;
        }
        if !any_curve {
            return Err(bad(origin, "gemm", "needs a curve for at least one dtype"));
        }
        check(
            "memory_bandwidth_bytes_per_s",
            self.memory_bandwidth_bytes_per_s,
            &BANDWIDTH,
        )?;
        check(
            "elementwise_flops_per_s",
            self.elementwise_flops_per_s,
            &FLOP_RATE,
        )?;
        for (level, l) in [
            ("intra_node", &self.collectives.intra_node),
            ("inter_node", &self.collectives.inter_node),
        ] {
            for (kind, c) in [
                ("all_gather", &l.all_gather),
                ("reduce_scatter", &l.reduce_scatter),
                ("all_reduce", &l.all_reduce),
            ] {
                let base = format!("collectives.{level}.{kind}");
                check(&format!("{base}.latency_s"), c.latency_s, &LATENCY)?;
                check(
                    &format!("{base}.step_latency_s"),
                    c.step_latency_s,
                    &LATENCY,
                )?;
                check(
                    &format!("{base}.bus_bandwidth_bytes_per_s"),
                    c.bus_bandwidth_bytes_per_s,
                    &BANDWIDTH,
                )?;
            }
        }
        check(
            "host.link_bytes_per_s",
            self.host.link_bytes_per_s,
            &BANDWIDTH,
        )?;
        check(
            "host.optimizer_bytes_per_s",
            self.host.optimizer_bytes_per_s,
            &BANDWIDTH,
        )?;
        check("overlap_slowdown", self.overlap_slowdown, &SLOWDOWN)?;
        check("rank_skew", self.rank_skew, &SKEW)?;
        if let Some(v) = self.norm_elements_per_s {
            check("norm_elements_per_s", v, &ELEMENT_RATE)?;
        }
        if let Some(v) = self.optimizer_bytes_per_s {
            check("optimizer_bytes_per_s", v, &BANDWIDTH)?;
        }
        self.validate_calibration(origin)
    }

    /// Checks the optional calibrated parts: the bandwidth curve's points (positive, `bytes`
    /// increasing, rates in the plausible range of a bandwidth) and the compute fit (a GEMM
    /// scale in 0.01..100, a non-negative elementwise scale of at most 100, an op overhead of
    /// at most 10 ms; for a dtype with a GEMM curve, a `gemm_pricing` that agrees with its
    /// shape grid).
    fn validate_calibration(&self, origin: &str) -> Result<(), PlanError> {
        let finite = |field: String, v: f64, lo: f64, lo_open: bool, hi: f64| {
            let below = if lo_open { v <= lo } else { v < lo };
            if !v.is_finite() {
                Err(bad(origin, field, format!("is not a finite number ({v})")))
            } else if below || v > hi {
                let open = if lo_open { "(" } else { "[" };
                Err(bad(
                    origin,
                    field,
                    format!("is {v:e}, outside the plausible range {open}{lo}, {hi}]"),
                ))
            } else {
                Ok(())
            }
        };
        for (i, pt) in self.memory_bandwidth_curve.iter().enumerate() {
            let at = format!("memory_bandwidth_curve[{i}]");
            finite(format!("{at}.bytes"), pt.bytes, 0.0, true, 1e18)?;
            check_range(
                origin,
                &format!("{at}.bytes_per_s"),
                pt.bytes_per_s,
                &BANDWIDTH,
            )?;
            if i > 0 && pt.bytes <= self.memory_bandwidth_curve[i - 1].bytes {
                return Err(bad(
                    origin,
                    format!("{at}.bytes"),
                    format!(
                        "must exceed the previous point's ({} <= {})",
                        pt.bytes,
                        self.memory_bandwidth_curve[i - 1].bytes
                    ),
                ));
            }
        }
        for (dt, f) in self.compute_fit.entries() {
            let Some(f) = f else { continue };
            let at = format!("compute_fit.{dt}");
            finite(format!("{at}.gemm_scale"), f.gemm_scale, 0.01, false, 100.0)?;
            finite(
                format!("{at}.elementwise_scale"),
                f.elementwise_scale,
                0.0,
                false,
                100.0,
            )?;
            finite(
                format!("{at}.op_overhead_s"),
                f.op_overhead_s,
                0.0,
                false,
                0.01,
            )?;
            finite(
                format!("{at}.rms_relative_error"),
                f.rms_relative_error,
                0.0,
                false,
                1e3,
            )?;
            let curve = match dt {
                "bf16" => self.gemm.bf16.as_ref(),
                "f16" => self.gemm.f16.as_ref(),
                "f32" => self.gemm.f32.as_ref(),
                _ => self.gemm.f64.as_ref(),
            };
            // A fit of a dtype without a curve is unused: a plan in that dtype is refused
            // for the missing curve (`gemm_curve`), the error that names what to add.
            let Some(curve) = curve else { continue };
            let grid = !curve.shapes.is_empty();
            match f.gemm_pricing {
                Some(GemmPricing::Shape) if !grid => {
                    return Err(bad(
                        origin,
                        format!("{at}.gemm_pricing"),
                        format!(
                            "is \"shape\" but `gemm.{dt}.shapes` is empty: the fit's GEMM scale \
                             was fitted to GEMMs priced by the grid; restore the grid, or \
                             calibrate again"
                        ),
                    ))
                }
                Some(GemmPricing::Size) if grid => {
                    return Err(bad(
                        origin,
                        format!("{at}.gemm_pricing"),
                        format!(
                            "is \"size\" but `gemm.{dt}.shapes` holds a grid: the fit's GEMM \
                             scale was fitted to GEMMs priced by size alone; remove the grid, or \
                             calibrate again"
                        ),
                    ))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Seconds of one memory-bound pass moving `bytes` (read plus written): the bandwidth
    /// curve's rate for that size (linear in `log10(bytes)` between points, clamped at both
    /// ends) when the profile has one, else `memory_bandwidth_bytes_per_s`.
    pub fn memory_seconds(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        let p = &self.memory_bandwidth_curve;
        let rate = match (p.first(), p.last()) {
            (Some(first), Some(last)) => {
                if bytes <= first.bytes {
                    first.bytes_per_s
                } else if bytes >= last.bytes {
                    last.bytes_per_s
                } else {
                    let w = p
                        .windows(2)
                        .find(|w| bytes <= w[1].bytes)
                        .unwrap_or(&p[p.len() - 2..]);
                    let (a, b) = (w[0], w[1]);
                    let x = (bytes.log10() - a.bytes.log10()) / (b.bytes.log10() - a.bytes.log10());
                    a.bytes_per_s + x * (b.bytes_per_s - a.bytes_per_s)
                }
            }
            _ => self.memory_bandwidth_bytes_per_s,
        };
        bytes / rate
    }

    /// The compute fit for a model computing in `dtype`: the profile's, or
    /// [`ComputeFit::IDENTITY`] when it has none for that dtype.
    pub fn fit(&self, dtype: DType) -> ComputeFit {
        self.compute_fit.get(dtype).unwrap_or(ComputeFit::IDENTITY)
    }

    /// The profile's GEMM curve for `dtype`.
    ///
    /// Errors: [`PlanError::BadProfile`] naming `gemm.<dtype>` when it has none, and the
    /// profile by where it was read from ([`HardwareProfile::origin`]), else by its name.
    pub fn gemm_curve(&self, dtype: DType) -> Result<&GemmCurve, PlanError> {
        self.gemm.get(dtype).ok_or_else(|| {
            let who = if self.origin.is_empty() {
                self.name.clone()
            } else {
                self.origin.clone()
            };
            bad(
                &who,
                format!("gemm.{}", dtype.name()),
                format!(
                    "is missing: the plan computes in {}; add a curve for it (fsdp calibrate measures one)",
                    dtype.name()
                ),
            )
        })
    }

    /// Every numeric field's JSON path (curve points by index), in document order: what a
    /// complete `sources` map covers.
    pub fn numeric_paths(&self) -> Vec<String> {
        let mut v = vec!["ranks_per_node".to_string()];
        for (dt, curve) in [
            ("bf16", &self.gemm.bf16),
            ("f16", &self.gemm.f16),
            ("f32", &self.gemm.f32),
            ("f64", &self.gemm.f64),
        ] {
            if let Some(c) = curve {
                v.push(format!("gemm.{dt}.peak_flops_per_s"));
                v.push(format!("gemm.{dt}.points"));
                if !c.shapes.is_empty() {
                    v.push(format!("gemm.{dt}.shapes"));
                }
            }
        }
        v.push("memory_bandwidth_bytes_per_s".into());
        v.push("elementwise_flops_per_s".into());
        for level in ["intra_node", "inter_node"] {
            for kind in ["all_gather", "reduce_scatter", "all_reduce"] {
                for f in ["latency_s", "step_latency_s", "bus_bandwidth_bytes_per_s"] {
                    v.push(format!("collectives.{level}.{kind}.{f}"));
                }
            }
        }
        v.push("host.link_bytes_per_s".into());
        v.push("host.optimizer_bytes_per_s".into());
        v.push("overlap_slowdown".into());
        if self.rank_skew != 0.0 {
            v.push("rank_skew".into());
        }
        if !self.memory_bandwidth_curve.is_empty() {
            v.push("memory_bandwidth_curve".into());
        }
        if self.norm_elements_per_s.is_some() {
            v.push("norm_elements_per_s".into());
        }
        if self.optimizer_bytes_per_s.is_some() {
            v.push("optimizer_bytes_per_s".into());
        }
        for (dt, f) in self.compute_fit.entries() {
            if f.is_some() {
                v.push(format!("compute_fit.{dt}"));
            }
        }
        v
    }
}

/// Refuses the rate `flops_per_s` of the point at `at` (a curve or shape point of the curve
/// `base`, `c`) when it exceeds the curve's peak: MFU could pass 100%.
fn under_peak(
    origin: &str,
    at: &str,
    base: &str,
    flops_per_s: f64,
    c: &GemmCurve,
) -> Result<(), PlanError> {
    if flops_per_s > c.peak_flops_per_s {
        return Err(bad(
            origin,
            format!("{at}.flops_per_s"),
            format!(
                "{flops_per_s} exceeds the peak {} of {base}.peak_flops_per_s (MFU would pass 100%)",
                c.peak_flops_per_s
            ),
        ));
    }
    Ok(())
}

/// Checks a curve's shape points: each dimension in [`GEMM_DIM`], each rate in [`FLOP_RATE`]
/// and at most the peak, and per layout present a complete grid without repeats.
fn validate_shapes(origin: &str, base: &str, c: &GemmCurve) -> Result<(), PlanError> {
    for (i, pt) in c.shapes.iter().enumerate() {
        let at = format!("{base}.shapes[{i}]");
        for (f, v) in [("m", pt.m), ("k", pt.k), ("n", pt.n)] {
            check_range(origin, &format!("{at}.{f}"), v as f64, &GEMM_DIM)?;
        }
        check_range(
            origin,
            &format!("{at}.flops_per_s"),
            pt.flops_per_s,
            &FLOP_RATE,
        )?;
        under_peak(origin, &at, base, pt.flops_per_s, c)?;
        if let Some(j) = c.shapes[..i]
            .iter()
            .position(|q| (q.m, q.k, q.n, q.layout) == (pt.m, pt.k, pt.n, pt.layout))
        {
            return Err(bad(
                origin,
                at,
                format!(
                    "repeats shapes[{j}] ({} x {} x {}, {})",
                    pt.m,
                    pt.k,
                    pt.n,
                    pt.layout.name()
                ),
            ));
        }
    }
    for layout in GemmLayout::ALL {
        let grid: Vec<&ShapePoint> = c.shapes.iter().filter(|p| p.layout == layout).collect();
        if grid.is_empty() {
            continue;
        }
        let dims = grid_dims(grid.iter().copied());
        let need = dims.len().pow(3);
        if grid.len() != need {
            let mut missing = String::new();
            'find: for &m in &dims {
                for &k in &dims {
                    for &n in &dims {
                        if !grid.iter().any(|p| (p.m, p.k, p.n) == (m, k, n)) {
                            missing = format!("; {m} x {k} x {n} is missing");
                            break 'find;
                        }
                    }
                }
            }
            let list: Vec<String> = dims.iter().map(u64::to_string).collect();
            return Err(bad(
                origin,
                format!("{base}.shapes"),
                format!(
                    "the {} points must cover every (m, k, n) of the grid {} ({need} points), got {}{missing}",
                    layout.name(),
                    list.join(", "),
                    grid.len()
                ),
            ));
        }
    }
    Ok(())
}

/// Whether `word` stands in `text` where a JSON value would (after `:`, `,` or `[`, spaces
/// aside), not inside a string such as a source's text.
fn as_value(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(i, _)| {
        text[..i]
            .trim_end()
            .chars()
            .next_back()
            .is_some_and(|c| matches!(c, ':' | ',' | '['))
    })
}

/// The text between `start` and the next `end` in `s`.
fn between<'a>(s: &'a str, start: &str, end: &str) -> Option<&'a str> {
    let i = s.find(start)? + start.len();
    let j = s[i..].find(end)? + i;
    Some(&s[i..j])
}

/// `s` without serde_json's trailing ` at line L column C`.
fn strip_position(s: &str) -> &str {
    s.rfind(" at line ").map_or(s, |i| &s[..i])
}

/// A built-in profile by name (`h100-sxm`, `h200`, `a100-80gb`).
///
/// Errors: [`PlanError::UnknownHardware`] listing the built-in names.
pub fn builtin_profile(name: &str) -> Result<HardwareProfile, PlanError> {
    let (n, text) =
        BUILTIN
            .iter()
            .find(|(n, _)| *n == name)
            .ok_or_else(|| PlanError::UnknownHardware {
                name: name.to_string(),
                known: BUILTIN_PROFILE_NAMES.join(", "),
            })?;
    HardwareProfile::from_json(text, &format!("built-in {n}"))
}

//! `fsdp calibrate`: measures the machine it runs on and builds an `fsdp-hardware/1` profile
//! ([`fsdp_planner::time::HardwareProfile`]) for the step-time model, every rate one rank's
//! while all `W` rank threads run at once, as in training.
//!
//! - **GEMM** per dtype (f32, bf16, f16) over square sizes `n` = 64..1024: candle's CPU matmul
//!   (the path the model's matmuls take), `2 n^3` FLOPs per call, repeated for at least
//!   [`MIN_SECONDS`] per size on every rank at once; the rate is the mean over ranks. The
//!   dtype's peak is the highest measured point (a measured maximum, not a vendor figure).
//! - **GEMM by shape** per dtype: the same matmul over the grid [`SHAPE_DIMS`]`^3` of
//!   `(m, k, n)` in each operand layout the model's linear layers run (`A B`, `A B^T` and
//!   `A^T B`, the transposed operand a strided view as the engine passes it): the median of
//!   [`SHAPE_ROUNDS`] rounds over the whole grid, each timing a shape for at least
//!   [`SHAPE_MIN_SECONDS`] (rounds, not one long timing per shape, so that a slow spell of a
//!   shared machine lands on different shapes each round and the median drops it). The
//!   step-time model scales the size curve by each shape's measured factor
//!   ([`fsdp_planner::time::GemmCurve::rate_of`]). With the compute fit, the grid stays in
//!   the profile only if it explains the reference jobs' unit times better than the size
//!   curve alone ([`fit::fit_by_shape_or_size`]); the fit's source says which was kept.
//! - **Memory bandwidth**: a copy of a 64 MiB f32 buffer per rank (bytes read plus written
//!   per second). **Elementwise FLOP/s**: `y = a x + y` over an L2-sized f32 buffer, 2 FLOPs
//!   per element.
//! - **Collectives** on the thread backend over the `W` rank threads (`W >= 2`): all-gather,
//!   reduce-scatter and all-reduce of whole arrays of 64 KiB..16 MiB, the median of several
//!   calls each; latency and bus bandwidth by least squares on `t = latency + S f / busbw`
//!   (`f` = `(n-1)/n`, all-reduce `2(n-1)/n`: nccl-tests' convention), the latency clamped at
//!   0. One host has no network: the `inter_node` costs are the `intra_node` ones (the source
//!   says so).
//! - **Gradient norm and optimizer step**: the engine's own kernels on a shard of
//!   [`STEP_ELEMENTS`] elements per rank: the sum of squares (one dependent f64 chain,
//!   elements per second) and AdamW on the rank's compute threads (28 bytes moved per element:
//!   parameter, gradient and both moments read, parameter and moments written).
//! - **Host link**: on the CPU the "device" is host memory: the copy bandwidth.
//! - **Overlap slowdown**: rank 0's f32 GEMM rate alone against its rate while an all-reduce
//!   of 16 MiB runs on its progress thread (`alone / with - 1`, at least 0).
//!
//! - **Compute fit** (optional): [`fit`], on reference training jobs run [`fit::PASSES`]
//!   times, each unit's faster pass kept; passes whose totals differ by more than
//!   [`fit::PASS_SPREAD_WARNING`] are reported in [`Calibration::warnings`].
//!
//! `fsdp calibrate --device cuda` measures one GPU instead: [`cuda`].

pub mod cuda;
pub mod fit;

use fsdp_comm::{run_threads, BufMut, Communicator, Group, OwnedBuf, ReduceOp, Topology};
use fsdp_planner::time::{
    BandwidthPoint, CollectiveCost, Collectives, CurvePoint, GemmCurve, GemmLayout, GemmRates,
    HardwareProfile, HostLink, LinkCollectives, ShapePoint, PROFILE_SCHEMA,
};
use fsdp_types::DType;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Minimum seconds each GEMM size and bandwidth measurement runs.
pub const MIN_SECONDS: f64 = 0.15;

/// GEMM sizes (square `n`).
const GEMM_SIZES: [usize; 5] = [64, 128, 256, 512, 1024];

/// The values each of `m`, `k` and `n` takes in the GEMM shape grid: a head's width, a small
/// model's width, a micro-batch's rows (larger dimensions take the factor of the grid's edge;
/// a 2048 edge would make the grid 6x slower to measure in half precision on a CPU).
pub const SHAPE_DIMS: [usize; 3] = [64, 256, 1024];

/// Minimum seconds of timed calls per shape and round (after one untimed call, unless that
/// call alone took this long).
pub const SHAPE_MIN_SECONDS: f64 = 0.01;

/// Rounds over the shape grid; each shape's rate is the median of its rounds.
pub const SHAPE_ROUNDS: usize = 5;

/// Every `(layout, m, k, n)` of the shape grid, in the order the profile lists them.
fn shape_grid() -> Vec<(GemmLayout, usize, usize, usize)> {
    let mut v = Vec::new();
    for layout in GemmLayout::ALL {
        for m in SHAPE_DIMS {
            for k in SHAPE_DIMS {
                for n in SHAPE_DIMS {
                    v.push((layout, m, k, n));
                }
            }
        }
    }
    v
}

/// The rate (FLOP/s) of candle's CPU matmul `op(A)[m, k] op(B)[k, n]` in `dtype` with the
/// operands laid out as `layout`: a transposed operand is the `.t()` view of a row-major
/// matrix, as the model's linear layers pass it.
fn shape_rate(
    dtype: candle_core::DType,
    layout: GemmLayout,
    m: usize,
    k: usize,
    n: usize,
) -> Result<f64, String> {
    let dev = candle_core::Device::Cpu;
    let mat = |r: usize, c: usize, t: bool| -> candle_core::Result<candle_core::Tensor> {
        let x =
            candle_core::Tensor::ones((r, c), candle_core::DType::F32, &dev)?.to_dtype(dtype)?;
        if t {
            x.t()
        } else {
            Ok(x)
        }
    };
    let err =
        |e: candle_core::Error| format!("{dtype:?} matmul {m}x{k}x{n} ({}): {e}", layout.name());
    let a = match layout {
        GemmLayout::Tn => mat(k, m, true),
        _ => mat(m, k, false),
    }
    .map_err(err)?;
    let b = match layout {
        GemmLayout::Nt => mat(n, k, true),
        _ => mat(k, n, false),
    }
    .map_err(err)?;
    let t = Instant::now();
    a.matmul(&b).map_err(err)?;
    let first = t.elapsed().as_secs_f64();
    let (calls, secs) = if first >= SHAPE_MIN_SECONDS {
        (1u64, first)
    } else {
        let t = Instant::now();
        let mut calls = 0u64;
        loop {
            a.matmul(&b).map_err(err)?;
            calls += 1;
            let s = t.elapsed().as_secs_f64();
            if s >= SHAPE_MIN_SECONDS {
                break (calls, s);
            }
        }
    };
    Ok(2.0 * (m * k * n) as f64 * calls as f64 / secs)
}

/// Bytes one copy pass moves (read plus written) for the memory bandwidth curve: from
/// within a core's L2 cache to well past the last-level cache.
const COPY_MOVED_BYTES: [usize; 7] = [
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
    128 << 20,
];

/// Elements of the gradient and optimizer shard the norm and the optimizer step are timed on
/// (32 MiB of f32, past the last-level cache, as a training shard is).
pub const STEP_ELEMENTS: usize = 8 << 20;

/// Collective sizes, bytes of the whole array.
const COLLECTIVE_BYTES: [usize; 5] = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20];

/// What [`calibrate`] measured.
#[derive(Debug, Clone)]
pub struct Calibration {
    /// The machine's profile.
    pub profile: HardwareProfile,
    /// What the user should know of the measurement (a machine whose speed changed while it
    /// was measured), one sentence each, for standard error.
    pub warnings: Vec<String>,
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct CalibrateOptions {
    /// Rank threads `W` (1: no collectives are measured).
    pub world_size: usize,
    /// Compute threads per rank (recorded; the process's pools are sized before the call).
    pub threads_per_rank: usize,
    /// The command line, recorded in every source.
    pub command: String,
    /// The profile's name.
    pub name: String,
    /// Fit the compute model to reference training steps ([`fit`]).
    pub compute_fit: bool,
}

/// Runs `f` repeatedly for at least [`MIN_SECONDS`]; returns (calls, seconds).
fn repeat(mut f: impl FnMut()) -> (u64, f64) {
    f();
    let t = Instant::now();
    let mut n = 0u64;
    loop {
        f();
        n += 1;
        let s = t.elapsed().as_secs_f64();
        if s >= MIN_SECONDS {
            return (n, s);
        }
    }
}

fn gemm_rate(dtype: candle_core::DType, n: usize) -> Result<f64, String> {
    let dev = candle_core::Device::Cpu;
    let a = candle_core::Tensor::ones((n, n), candle_core::DType::F32, &dev)
        .and_then(|t| t.to_dtype(dtype))
        .map_err(|e| e.to_string())?;
    let b = a.clone();
    let mut err = None;
    let (calls, s) = repeat(|| {
        if let Err(e) = a.matmul(&b) {
            err = Some(e.to_string());
        }
    });
    if let Some(e) = err {
        return Err(format!("{dtype:?} matmul {n}x{n}: {e}"));
    }
    Ok(2.0 * (n as f64).powi(3) * calls as f64 / s)
}

/// Per-rank measurements taken with every rank busy at once.
struct RankRates {
    gemm: Vec<(candle_core::DType, Vec<f64>)>,
    /// Per dtype of `gemm`, the rate of each shape of [`shape_grid`], in its order.
    shapes: Vec<Vec<f64>>,
    copy_bytes_per_s: f64,
    /// Bytes per second of a copy pass per [`COPY_MOVED_BYTES`] size.
    copy_curve: Vec<f64>,
    elementwise_flops_per_s: f64,
    /// Elements per second of the gradient norm's sum of squares.
    norm_elements_per_s: f64,
    /// Bytes moved per second by AdamW on the rank's compute threads.
    optimizer_bytes_per_s: f64,
    /// (kind, bytes, seconds) of each collective size.
    collectives: Vec<(&'static str, usize, f64)>,
    overlap_slowdown: f64,
}

fn measure_rank(comm: &dyn Communicator, threads: usize) -> Result<RankRates, String> {
    let e = |x: fsdp_comm::CommError| x.to_string();
    let w = comm.world_size();
    comm.barrier(Group::World).map_err(e)?;
    let mut gemm = Vec::new();
    let mut shapes = Vec::new();
    for dt in [
        candle_core::DType::F32,
        candle_core::DType::BF16,
        candle_core::DType::F16,
    ] {
        let mut v = Vec::new();
        for n in GEMM_SIZES {
            v.push(gemm_rate(dt, n)?);
        }
        gemm.push((dt, v));
        let grid = shape_grid();
        let mut rounds = vec![Vec::with_capacity(SHAPE_ROUNDS); grid.len()];
        for _ in 0..SHAPE_ROUNDS {
            for (j, &(layout, m, k, n)) in grid.iter().enumerate() {
                rounds[j].push(shape_rate(dt, layout, m, k, n)?);
            }
        }
        shapes.push(
            rounds
                .into_iter()
                .map(|mut r| {
                    r.sort_by(f64::total_cmp);
                    r[r.len() / 2]
                })
                .collect(),
        );
    }
    comm.barrier(Group::World).map_err(e)?;
    let src = vec![1.0f32; 16 << 20];
    let mut dst = vec![0.0f32; 16 << 20];
    let (calls, s) = repeat(|| {
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
    });
    let copy_bytes_per_s = 2.0 * (src.len() * 4) as f64 * calls as f64 / s;
    drop((src, dst));
    let mut copy_curve = Vec::new();
    for moved in COPY_MOVED_BYTES {
        let n = moved / 8;
        let src = vec![1.0f32; n];
        let mut dst = vec![0.0f32; n];
        comm.barrier(Group::World).map_err(e)?;
        let (calls, s) = repeat(|| {
            dst.copy_from_slice(&src);
            std::hint::black_box(&dst);
        });
        copy_curve.push((8 * n) as f64 * calls as f64 / s);
    }
    let x = vec![1.0001f32; 64 << 10];
    let mut y = vec![0.5f32; 64 << 10];
    let (calls, s) = repeat(|| {
        for (yi, xi) in y.iter_mut().zip(&x) {
            *yi += 0.999 * *xi;
        }
        std::hint::black_box(&y);
    });
    let elementwise_flops_per_s = 2.0 * x.len() as f64 * calls as f64 / s;
    comm.barrier(Group::World).map_err(e)?;
    let (norm_elements_per_s, optimizer_bytes_per_s) = measure_step_passes(threads)?;
    comm.barrier(Group::World).map_err(e)?;
    let mut collectives = Vec::new();
    if w < 2 {
        // One rank: no peer to measure a collective or its overlap with.
        return Ok(RankRates {
            gemm,
            shapes,
            copy_bytes_per_s,
            copy_curve,
            elementwise_flops_per_s,
            norm_elements_per_s,
            optimizer_bytes_per_s,
            collectives,
            overlap_slowdown: 0.0,
        });
    }
    for bytes in COLLECTIVE_BYTES {
        let numel = bytes / 4 / w * w;
        for kind in ["all_gather", "reduce_scatter", "all_reduce"] {
            let mut times = Vec::new();
            for _ in 0..7 {
                comm.barrier(Group::World).map_err(e)?;
                let t = Instant::now();
                match kind {
                    "all_gather" => {
                        let send = vec![1.0f32; numel / w];
                        let mut recv = vec![0.0f32; numel];
                        comm.all_gather(
                            Group::World,
                            fsdp_comm::Buf::F32(&send),
                            BufMut::F32(&mut recv),
                        )
                        .map_err(e)?;
                    }
                    "reduce_scatter" => {
                        let send = vec![1.0f32; numel];
                        let mut recv = vec![0.0f32; numel / w];
                        comm.reduce_scatter(
                            Group::World,
                            ReduceOp::Sum,
                            fsdp_comm::Buf::F32(&send),
                            BufMut::F32(&mut recv),
                        )
                        .map_err(e)?;
                    }
                    _ => {
                        let mut buf = vec![1.0f32; numel];
                        comm.all_reduce(Group::World, ReduceOp::Sum, BufMut::F32(&mut buf))
                            .map_err(e)?;
                    }
                }
                times.push(t.elapsed().as_secs_f64());
            }
            times.sort_by(f64::total_cmp);
            collectives.push((kind, numel * 4, times[times.len() / 2]));
        }
    }
    // Overlap: GEMMs while one all-reduce of 16 MiB runs on the progress thread, against
    // the same GEMMs alone.
    comm.barrier(Group::World).map_err(e)?;
    let alone = gemm_rate(candle_core::DType::F32, 256)?;
    comm.barrier(Group::World).map_err(e)?;
    let dev = candle_core::Device::Cpu;
    let a = candle_core::Tensor::ones((256, 256), candle_core::DType::F32, &dev)
        .map_err(|x| x.to_string())?;
    let mut with_flops = 0.0;
    let mut with_s = 0.0;
    for _ in 0..5 {
        let op = comm
            .start_all_reduce(
                Group::World,
                ReduceOp::Sum,
                OwnedBuf::F32(vec![1.0f32; 4 << 20]),
            )
            .map_err(e)?;
        let t = Instant::now();
        while !op.is_complete() {
            a.matmul(&a).map_err(|x| x.to_string())?;
            with_flops += 2.0 * 256f64.powi(3);
        }
        with_s += t.elapsed().as_secs_f64();
        op.wait().map_err(e)?;
    }
    let overlap_slowdown = if with_flops > 0.0 {
        (alone / (with_flops / with_s) - 1.0).max(0.0)
    } else {
        0.0
    };
    Ok(RankRates {
        gemm,
        shapes,
        copy_bytes_per_s,
        copy_curve,
        elementwise_flops_per_s,
        norm_elements_per_s,
        optimizer_bytes_per_s,
        collectives,
        overlap_slowdown,
    })
}

/// The rates of the engine's passes after the backward, on one rank's shard of
/// [`STEP_ELEMENTS`] elements: (elements per second of [`fsdp_kernels::sum_squares`], the
/// gradient norm's kernel; bytes per second of AdamW's step on a pool of `threads` threads,
/// as the engine steps a shard on the rank's compute pool, 28 bytes moved per element).
fn measure_step_passes(threads: usize) -> Result<(f64, f64), String> {
    let n = STEP_ELEMENTS;
    let grad = vec![1e-3f32; n];
    let spans = [fsdp_kernels::Span::new(0, n, true)];
    let mut err = None;
    let (calls, s) = repeat(|| {
        if let Err(x) = fsdp_kernels::sum_squares(std::hint::black_box(&grad), &spans) {
            err = Some(x.to_string());
        }
    });
    let norm = n as f64 * calls as f64 / s;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .map_err(|x| format!("thread pool: {x}"))?;
    let opt = crate::optim::Optimizer::AdamW(crate::optim::AdamWConfig::default());
    let (mut param, mut m, mut v) = (vec![0.5f32; n], vec![0f32; n], vec![0f32; n]);
    let mut step = 0u64;
    let (calls, s) = pool.install(|| {
        repeat(|| {
            step += 1;
            if let Err(x) = opt.step_shard_threads(
                &mut param,
                &grad,
                &mut [m.as_mut_slice(), v.as_mut_slice()],
                &spans,
                step,
                rayon::current_num_threads(),
            ) {
                err = Some(x.to_string());
            }
        })
    });
    if let Some(x) = err {
        return Err(format!("the gradient norm or optimizer step: {x}"));
    }
    Ok((norm, 28.0 * n as f64 * calls as f64 / s))
}

/// Least squares of `t = a + x / bw` over `(x, t)`: (latency `a` clamped at 0, `bw`).
fn fit(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    let (sx, st) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, t)| (a + x, b + t));
    let (mx, mt) = (sx / n, st / n);
    let (mut sxx, mut sxt) = (0.0, 0.0);
    for (x, t) in points {
        sxx += (x - mx) * (x - mx);
        sxt += (x - mx) * (t - mt);
    }
    let slope = (sxt / sxx).max(f64::MIN_POSITIVE);
    let a = (mt - slope * mx).max(0.0);
    (a, 1.0 / slope)
}

/// One process of a multi-process calibrate job (`mpirun -n W fsdp calibrate --backend
/// mpi`): its communicator over the job's world, its rank, and the factory the reference
/// jobs build their communicators with.
pub struct ProcessRank<'a> {
    /// The job's world (W processes).
    pub comm: &'a dyn Communicator,
    /// This process's rank.
    pub rank: usize,
    /// Builds a communicator for a reference job's topology.
    pub factory: crate::train::CommFactory<'a>,
    /// The backend's words in the profile's sources (`MPI over the job's processes`).
    pub backend: &'static str,
}

/// The numbers of a [`RankRates`] in a fixed order (the collectives' seconds only: their
/// kinds and sizes are the same on every rank).
fn encode(r: &RankRates) -> Vec<f64> {
    let mut v: Vec<f64> = r.gemm.iter().flat_map(|(_, x)| x.iter().copied()).collect();
    v.extend(r.shapes.iter().flatten());
    v.push(r.copy_bytes_per_s);
    v.extend(&r.copy_curve);
    v.push(r.elementwise_flops_per_s);
    v.push(r.norm_elements_per_s);
    v.push(r.optimizer_bytes_per_s);
    v.extend(r.collectives.iter().map(|c| c.2));
    v.push(r.overlap_slowdown);
    v
}

/// `r` with its numbers replaced by `v` (the order of [`encode`]).
fn decode(r: &RankRates, v: &[f64]) -> RankRates {
    let mut it = v.iter().copied();
    let mut next = || it.next().unwrap_or(f64::NAN);
    RankRates {
        gemm: r
            .gemm
            .iter()
            .map(|(dt, x)| (*dt, x.iter().map(|_| next()).collect()))
            .collect(),
        shapes: r
            .shapes
            .iter()
            .map(|x| x.iter().map(|_| next()).collect())
            .collect(),
        copy_bytes_per_s: next(),
        copy_curve: r.copy_curve.iter().map(|_| next()).collect(),
        elementwise_flops_per_s: next(),
        norm_elements_per_s: next(),
        optimizer_bytes_per_s: next(),
        collectives: r.collectives.iter().map(|c| (c.0, c.1, next())).collect(),
        overlap_slowdown: next(),
    }
}

/// Measures this machine (see the module doc) and returns its profile: on `o.world_size`
/// rank threads of this process, or with `process` as one of the processes of a
/// multi-process job (every process calls this at once; each gets the same rates, the means
/// over the processes, and its own compute fit).
///
/// Errors: a world size of 0, a failed collective, matmul or reference job (with its words).
pub fn calibrate(
    o: &CalibrateOptions,
    process: Option<&ProcessRank<'_>>,
) -> Result<Calibration, String> {
    if o.world_size < 1 {
        return Err("--world-size 0: calibrate needs at least 1 rank thread".into());
    }
    let w = o.world_size;
    let ranks: Vec<RankRates> = match process {
        None => {
            let topo = Topology::new(w, 1).map_err(|e| e.to_string())?;
            run_threads(topo, Duration::from_secs(120), |c| {
                measure_rank(&c, o.threads_per_rank)
            })
            .into_iter()
            .map(|r| r.map_err(|e| e.to_string()).and_then(|x| x))
            .collect::<Result<_, _>>()?
        }
        Some(p) => {
            // The mean over the processes: one all-reduce of every rank's numbers.
            let mine = measure_rank(p.comm, o.threads_per_rank)?;
            let mut v = encode(&mine);
            p.comm
                .all_reduce(Group::World, ReduceOp::Sum, (&mut v[..]).into())
                .map_err(|e| e.to_string())?;
            v.iter_mut().for_each(|x| *x /= w as f64);
            vec![decode(&mine, &v)]
        }
    };
    let backend = process.map_or("thread backend over the rank threads", |p| p.backend);
    let ranks_word = if process.is_some() {
        "processes"
    } else {
        "rank threads"
    };
    let mean =
        |f: &dyn Fn(&RankRates) -> f64| ranks.iter().map(f).sum::<f64>() / ranks.len() as f64;
    let curve = |i: usize| -> GemmCurve {
        let points: Vec<CurvePoint> = GEMM_SIZES
            .iter()
            .enumerate()
            .map(|(k, &n)| CurvePoint {
                flops: 2.0 * (n as f64).powi(3),
                flops_per_s: mean(&|r: &RankRates| r.gemm[i].1[k]),
            })
            .collect();
        let shapes: Vec<ShapePoint> = shape_grid()
            .into_iter()
            .enumerate()
            .map(|(j, (layout, m, k, n))| ShapePoint {
                m: m as u64,
                k: k as u64,
                n: n as u64,
                layout,
                flops_per_s: mean(&|r: &RankRates| r.shapes[i][j]),
            })
            .collect();
        let peak = points
            .iter()
            .map(|p| p.flops_per_s)
            .chain(shapes.iter().map(|p| p.flops_per_s))
            .fold(0.0, f64::max);
        GemmCurve {
            peak_flops_per_s: peak,
            points,
            shapes,
        }
    };
    let nw = w as f64;
    let cost = |kind: &str| -> CollectiveCost {
        let factor = if kind == "all_reduce" {
            2.0 * (nw - 1.0) / nw
        } else {
            (nw - 1.0) / nw
        };
        // Every rank's time of a size, averaged, against S * factor.
        let pts: Vec<(f64, f64)> = COLLECTIVE_BYTES
            .iter()
            .take(if w < 2 { 0 } else { COLLECTIVE_BYTES.len() })
            .enumerate()
            .map(|(k, _)| {
                let idx = k * 3
                    + match kind {
                        "all_gather" => 0,
                        "reduce_scatter" => 1,
                        _ => 2,
                    };
                let bytes = ranks[0].collectives[idx].1 as f64;
                (bytes * factor, mean(&|r: &RankRates| r.collectives[idx].2))
            })
            .collect();
        if w < 2 {
            // Never used by a one-rank plan; the copy bandwidth keeps the profile whole.
            return CollectiveCost {
                latency_s: 0.0,
                step_latency_s: 0.0,
                bus_bandwidth_bytes_per_s: mean(&|r: &RankRates| r.copy_bytes_per_s),
            };
        }
        let (latency, bw) = fit(&pts);
        CollectiveCost {
            latency_s: latency,
            step_latency_s: 0.0,
            bus_bandwidth_bytes_per_s: bw,
        }
    };
    let link = LinkCollectives {
        all_gather: cost("all_gather"),
        reduce_scatter: cost("reduce_scatter"),
        all_reduce: cost("all_reduce"),
    };
    let copy = mean(&|r: &RankRates| r.copy_bytes_per_s);
    let host = hostname();
    let date = utc_date();
    let threads_word = if o.threads_per_rank == 1 {
        "compute thread"
    } else {
        "compute threads"
    };
    let measured = |what: &str| {
        format!(
            "measured {date} on {host} by `{}` ({w} {ranks_word}, {} {threads_word} each): {what}",
            o.command, o.threads_per_rank
        )
    };
    let mut sources = BTreeMap::new();
    sources.insert(
        "ranks_per_node".into(),
        measured("the rank threads of this host"),
    );
    for dt in ["f32", "bf16", "f16"] {
        sources.insert(
            format!("gemm.{dt}.peak_flops_per_s"),
            measured("the highest rate of the curve and the shape grid (a measured maximum, not a vendor peak)"),
        );
        sources.insert(
            format!("gemm.{dt}.points"),
            measured(&format!(
                "candle CPU matmul of n x n {dt} matrices, n = 64..1024, every rank at once, mean over ranks"
            )),
        );
        let dims: Vec<String> = SHAPE_DIMS.iter().map(usize::to_string).collect();
        sources.insert(
            format!("gemm.{dt}.shapes"),
            measured(&format!(
                "candle CPU matmul of {dt} [m, k] x [k, n] for m, k, n in {{{}}}, operands as stored (nn), B a transposed view (nt), A a transposed view (tn), the median of {SHAPE_ROUNDS} rounds over the grid timing each shape for at least {SHAPE_MIN_SECONDS} s, every rank at once, mean over ranks",
                dims.join(", ")
            )),
        );
    }
    sources.insert(
        "memory_bandwidth_bytes_per_s".into(),
        measured("copy of a 64 MiB f32 buffer per rank, bytes read plus written"),
    );
    sources.insert(
        "elementwise_flops_per_s".into(),
        measured("y = a x + y over 256 KiB of f32 per rank, 2 FLOPs per element"),
    );
    sources.insert(
        "memory_bandwidth_curve".into(),
        measured("copy passes moving 64 KiB..128 MiB (read plus written) per rank, every rank at once, mean over ranks"),
    );
    for kind in ["all_gather", "reduce_scatter", "all_reduce"] {
        for f in ["latency_s", "step_latency_s", "bus_bandwidth_bytes_per_s"] {
            sources.insert(
                format!("collectives.intra_node.{kind}.{f}"),
                if w < 2 {
                    measured("not measured: one rank has no peer (a one-rank plan issues no collective); the copy bandwidth, latency 0")
                } else {
                    measured(&format!("{backend}, 64 KiB..16 MiB, median of 7 calls, least squares of t = latency + S f / busbw, the latency clamped at 0 (step latency folded into latency)"))
                },
            );
            sources.insert(
                format!("collectives.inter_node.{kind}.{f}"),
                measured("one host has no network: a copy of intra_node"),
            );
        }
    }
    sources.insert(
        "norm_elements_per_s".into(),
        measured(&format!(
            "the engine's gradient-norm kernel (sum of squares in one f64 accumulator, element order) over {STEP_ELEMENTS} f32 elements per rank, every rank at once, mean over ranks"
        )),
    );
    sources.insert(
        "optimizer_bytes_per_s".into(),
        measured(&format!(
            "the engine's AdamW step of {STEP_ELEMENTS} f32 elements per rank on the rank's {} compute thread(s), 28 bytes moved per element, every rank at once, mean over ranks",
            o.threads_per_rank.max(1)
        )),
    );
    sources.insert(
        "host.link_bytes_per_s".into(),
        measured("the CPU's device is host memory: the copy bandwidth"),
    );
    sources.insert(
        "host.optimizer_bytes_per_s".into(),
        measured("the copy bandwidth"),
    );
    sources.insert(
        "overlap_slowdown".into(),
        if w < 2 {
            measured("not measured: one rank has no collective to overlap; 0")
        } else {
            measured("rank 0's 256 x 256 f32 matmul rate alone / while a 16 MiB all-reduce runs on its progress thread, minus 1")
        },
    );
    let memory_bandwidth_curve = COPY_MOVED_BYTES
        .iter()
        .enumerate()
        .map(|(k, &b)| BandwidthPoint {
            bytes: b as f64,
            bytes_per_s: mean(&|r: &RankRates| r.copy_curve[k]),
        })
        .collect();
    let mut p = HardwareProfile {
        schema: PROFILE_SCHEMA.to_string(),
        name: o.name.clone(),
        description: format!(
            "{host}: {w} {ranks_word} of {} {threads_word}, measured by fsdp calibrate on {date}",
            o.threads_per_rank
        ),
        ranks_per_node: w as u64,
        gemm: GemmRates {
            f32: Some(curve(0)),
            bf16: Some(curve(1)),
            f16: Some(curve(2)),
            f64: None,
        },
        memory_bandwidth_bytes_per_s: copy,
        elementwise_flops_per_s: mean(&|r: &RankRates| r.elementwise_flops_per_s),
        collectives: Collectives {
            intra_node: link,
            inter_node: link,
        },
        host: HostLink {
            link_bytes_per_s: copy,
            optimizer_bytes_per_s: copy,
        },
        overlap_slowdown: ranks[0].overlap_slowdown,
        rank_skew: 0.0,
        memory_bandwidth_curve,
        norm_elements_per_s: Some(mean(&|r: &RankRates| r.norm_elements_per_s)),
        optimizer_bytes_per_s: Some(mean(&|r: &RankRates| r.optimizer_bytes_per_s)),
        compute_fit: Default::default(),
        sources,
        origin: String::new(),
    };
    p.validate("fsdp calibrate")
        .map_err(|e| format!("the measured profile is not valid: {e}"))?;
    let mut warnings = Vec::new();
    if o.compute_fit {
        let names: Vec<String> = fit::REFERENCES
            .iter()
            .map(|r| {
                format!(
                    "{} (micro-batch {}, seq {})",
                    r.model, r.micro_batch, r.seq_len
                )
            })
            .collect();
        let dtypes = [DType::F32, DType::BF16, DType::F16];
        // Every dtype's jobs once per pass, so a pass's jobs and the next pass's of the same
        // dtype are the other dtypes' jobs apart (see `fit::PASSES`).
        let mut passes: Vec<Vec<_>> = dtypes.iter().map(|_| Vec::new()).collect();
        for _ in 0..fit::PASSES {
            for (dt, v) in dtypes.iter().zip(passes.iter_mut()) {
                v.push(fit::measure_references(
                    &p,
                    w,
                    o.threads_per_rank.max(1),
                    *dt,
                    process.map(|x| (x.rank, x.factory)),
                )?);
            }
        }
        let mut f32_waits = Vec::new();
        for (dt, v) in dtypes.into_iter().zip(&passes) {
            let merged = fit::faster_pass(v)?;
            let totals = merged.totals_text();
            warnings.extend(merged.spread_warning(dt));
            if dt == DType::F32 {
                f32_waits = merged.waits;
            }
            let samples = merged.samples;
            let c = fit::fit_by_shape_or_size(&samples)?;
            let choice = if c.by_shape {
                format!(
                    "GEMMs priced by shape: the fit with the shape grid left an rms residual per unit (a share of its job's compute) of {:.4}, against {:.4} by size alone (size replaces shape only when over {}% smaller)",
                    c.shape_residual, c.size_residual, 100.0 * fit::SIZE_MARGIN
                )
            } else {
                // The grid stays out of the profile: the model priced by size explains this
                // machine's training steps better.
                if let Some(g) = match dt {
                    DType::F32 => p.gemm.f32.as_mut(),
                    DType::BF16 => p.gemm.bf16.as_mut(),
                    DType::F16 => p.gemm.f16.as_mut(),
                    DType::F64 => p.gemm.f64.as_mut(),
                } {
                    g.shapes.clear();
                }
                p.sources.remove(&format!("gemm.{}.shapes", dt.name()));
                format!(
                    "GEMMs priced by size alone: the measured shape grid was dropped, its fit left an rms residual per unit (a share of its job's compute) of {:.4}, against {:.4} by size",
                    c.shape_residual, c.size_residual
                )
            };
            p.sources.insert(
                format!("compute_fit.{}", dt.name()),
                measured(&format!(
                    "least squares over the forward and backward time of every unit of {} full-shard training steps computing in {} of {}, the first {} not counted, median over steps and ranks, the lower of {} passes' medians (the passes' totals {totals}); each job weighted alike; {choice}",
                    fit::STEPS,
                    dt.name(),
                    names.join(", "),
                    fit::SKIPPED_STEPS,
                    fit::PASSES
                )),
            );
            p.compute_fit.set(dt, c.fit);
        }
        if w > 1 {
            p.rank_skew = fit::fit_skew(&p, &f32_waits)?;
            p.sources.insert(
                "rank_skew".into(),
                measured(&format!(
                    "the value in 0..{} for which the time model's exposed communication of the f32 reference jobs above comes closest to their measured waits (median over ranks and counted steps{}), least squares relative to each job's step",
                    fit::MAX_SKEW,
                    if process.is_some() { ", this process's rank" } else { ", every rank" }
                )),
            );
        }
        p.validate("fsdp calibrate")
            .map_err(|e| format!("the fitted profile is not valid: {e}"))?;
    }
    Ok(Calibration {
        profile: p,
        warnings,
    })
}

/// This host's name (`uname -n`), or `unknown host`.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown host".into())
}

/// Today's UTC date, `YYYY-MM-DD` (civil-from-days, Howard Hinnant's algorithm).
fn utc_date() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let z = secs.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    format!("{:04}-{:02}-{:02}", if m <= 2 { y + 1 } else { y }, m, d)
}

//! The compute fit of `fsdp calibrate` ([`fsdp_planner::time::ComputeFit`]): how the
//! machine's measured unit compute times relate to the analytical model.
//!
//! The analytical model prices a unit use from its GEMM FLOPs (the profile's GEMM curve) and
//! its elementwise bytes and FLOPs (the roofline). On a CPU a framework adds what that leaves
//! out: allocating and first touching every output, dispatch per op, layout copies, the
//! transcendental functions of GELU, softmax and the loss. So calibrate runs short training
//! jobs of [`REFERENCES`] on the machine (the engine itself: `W` rank threads, full shard,
//! the embedded corpus, a Chrome trace of every unit's forward and backward), takes the
//! median time of each forward position's forward and backward over the counted steps and
//! all ranks, and fits `t = gemm_scale g + elementwise_scale e + op_overhead_s n` (`g`, `e`,
//! `n`: the use's GEMM seconds, elementwise seconds and op count,
//! [`fsdp_planner::time::use_compute_parts`]) by least squares, every sample divided by its
//! job's total measured compute (each job counts alike; within a job a unit counts by its
//! share of the step). Coefficients are kept non-negative (the subset of terms with
//! the smallest residual whose solution is non-negative; `gemm_scale` always included).
//!
//! The GEMM seconds come in two versions: at the rate of each GEMM's shape and layout (the
//! profile's measured grid) and at the rate of its FLOPs alone (the size curve).
//! [`fit_by_shape_or_size`] fits both and keeps the one whose fitted unit times are closer
//! to the measured ones: a grid timed on isolated GEMMs can misjudge what a layout costs
//! inside a training step (operands from other ops' cache lines, the dispatch around the
//! call), and then the size curve is the better model on this machine.
//!
//! The same jobs' waits give the profile's `rank_skew` ([`fit_skew`]): at `W >= 2` the ranks
//! do not compute equally fast, and every collective waits for the slowest.
//!
//! The references are small models at shapes unlike `fsdp train`'s defaults, so a
//! prediction for another model or shape is out of sample; the sweep in
//! `benches/time_sweep.rs` measures that error.

use crate::train::{train, NoHooks, TrainOptions};
use fsdp_planner::time::{
    use_compute_parts, ComputeFit, ComputeParts, GemmPricing, HardwareProfile,
};
use fsdp_planner::Strategy;
use std::collections::BTreeMap;

/// One reference job: a model preset, micro-batch and sequence length.
#[derive(Debug, Clone, Copy)]
pub struct Reference {
    /// A GPT or Llama-family preset (`fsdp train --model`).
    pub model: &'static str,
    /// Sequences per micro-batch per rank.
    pub micro_batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
}

/// The reference jobs: GPT-2 blocks at width 128, 384 and 256 and a Llama block (RMSNorm,
/// GQA, SwiGLU, rotary) at width 128, at shapes unlike the defaults of `fsdp train`. The
/// widths differ so the fit can tell the GEMM time (growing with the width squared per token)
/// from the rest (growing with the width); with the three narrow jobs alone, the GEMM scale
/// took up all of it and over-predicted wider models.
pub const REFERENCES: [Reference; 4] = [
    Reference {
        model: "tiny",
        micro_batch: 6,
        seq_len: 96,
    },
    Reference {
        model: "llama-tiny",
        micro_batch: 6,
        seq_len: 96,
    },
    Reference {
        model: "small",
        micro_batch: 2,
        seq_len: 64,
    },
    Reference {
        model: "mini",
        micro_batch: 5,
        seq_len: 112,
    },
];

/// Steps each reference job trains; the first [`SKIPPED_STEPS`] are not counted (first touch
/// of the buffers, the allocator's growth).
pub const STEPS: u64 = 7;
/// Steps not counted.
pub const SKIPPED_STEPS: u64 = 2;

/// One fitted sample: a unit use's forward or backward, measured and modelled.
#[derive(Debug, Clone, PartialEq)]
pub struct FitSample {
    /// `tiny forward h.1`.
    pub name: String,
    /// The median measured seconds.
    pub measured_s: f64,
    /// The analytical parts, each GEMM at the rate of its shape (the profile's grid; the
    /// same as `size_parts` without one).
    pub parts: ComputeParts,
    /// The analytical parts with every GEMM at the rate of its FLOPs (the size curve alone).
    pub size_parts: ComputeParts,
}

/// What one reference job's trace says of its ranks' waits, for the rank skew fit
/// ([`fit_skew`]).
#[derive(Debug, Clone)]
pub struct JobWaits {
    /// The job's plan (what the time model predicts from).
    pub plan: fsdp_planner::ShardPlan,
    /// The job's time-model inputs.
    pub inputs: fsdp_planner::time::TimeInputs,
    /// Median seconds per counted step a rank's compute thread waited (wait spans).
    pub wait_s: f64,
    /// Median seconds per counted step of a rank's compute-thread spans other than waits.
    pub busy_s: f64,
}

/// Trains every reference on `world_size` rank threads of `threads_per_rank` compute threads,
/// computing in `dtype` (`param_dtype`; gradients reduced in f32), reads its trace and
/// returns the samples (see the module doc) and each job's waits. With `process =
/// Some((rank, factory))` this process is one rank of a multi-process job (MPI): every process calls this at once, each
/// trains as its rank and fits to its own rank's spans.
///
/// Errors: a message when a reference job fails or its trace cannot be read or does not
/// match the plan's schedule.
pub fn measure_references(
    profile: &HardwareProfile,
    world_size: usize,
    threads_per_rank: usize,
    dtype: fsdp_types::DType,
    process: Option<(usize, crate::train::CommFactory<'_>)>,
) -> Result<(Vec<FitSample>, Vec<JobWaits>), String> {
    let dir = tempfile_dir()?;
    let mut samples = Vec::new();
    let mut waits = Vec::new();
    for r in REFERENCES {
        let trace = dir.join(format!("{}.json", r.model));
        let o = TrainOptions {
            model: r.model.into(),
            world_size,
            strategy: Strategy::FullShard,
            micro_batch: r.micro_batch,
            seq_len: r.seq_len,
            steps: STEPS,
            warmup: 1,
            eval_every: 0,
            threads_per_rank: Some(threads_per_rank),
            param_dtype: dtype,
            trace: Some(trace.clone()),
            ..TrainOptions::default()
        };
        let model = crate::train::model_of(&o).map_err(|e| e.to_string())?;
        let plan = fsdp_planner::plan(
            crate::runtime::StagedModel::spec(&model),
            &crate::train::plan_config(&o),
        )
        .map_err(|e| e.to_string())?;
        let parts = use_compute_parts(&plan, profile).map_err(|e| e.to_string())?;
        let size_parts =
            use_compute_parts(&plan, &without_shapes(profile)).map_err(|e| e.to_string())?;
        match process {
            None => train(&o, None, &NoHooks, &|_| {}).map(|_| ()),
            Some((_, factory)) => {
                crate::train::train_with(&o, None, &NoHooks, &|_| {}, Some(factory)).map(|_| ())
            }
        }
        .map_err(|e| format!("reference job {}: {e}", r.model))?;
        // One process of a multi-process job writes only its rank, rank R > 0 to PATH.rankR.
        let trace = match process {
            Some((rank, _)) if rank > 0 => {
                let mut p = trace.into_os_string();
                p.push(format!(".rank{rank}"));
                std::path::PathBuf::from(p)
            }
            _ => trace,
        };
        let text = std::fs::read_to_string(&trace)
            .map_err(|e| format!("reading {}: {e}", trace.display()))?;
        let _ = std::fs::remove_file(&trace);
        let doc: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", trace.display()))?;
        let (fwd, bwd) = unit_times(&doc, parts.len())?;
        let (wait_s, busy_s) = rank_waits(&doc)?;
        waits.push(JobWaits {
            inputs: crate::options::time_inputs(&o),
            plan,
            wait_s,
            busy_s,
        });
        for (k, p) in parts.iter().enumerate() {
            samples.push(FitSample {
                name: format!("{} forward {}", r.model, p.label),
                measured_s: fwd[k],
                parts: p.forward,
                size_parts: size_parts[k].forward,
            });
            if p.backward.ops > 0.0 {
                let Some(b) = bwd[k] else {
                    return Err(format!(
                        "reference job {}: no backward of position {k} ({}) in its trace",
                        r.model, p.label
                    ));
                };
                samples.push(FitSample {
                    name: format!("{} backward {}", r.model, p.label),
                    measured_s: b,
                    parts: p.backward,
                    size_parts: size_parts[k].backward,
                });
            }
        }
    }
    let _ = std::fs::remove_dir(&dir);
    Ok((samples, waits))
}

/// Passes of the reference jobs per dtype: [`measure_references`] runs this many times, the
/// passes apart (every dtype's pass in between), and [`faster_pass`] keeps each unit's
/// faster median. A neighbour on a shared machine only ever slows a job, and a median over
/// steps does not remove a slowdown that lasts the whole job: one calibration on this VM
/// fitted a GEMM scale of 3.1 against 0.8-1.1 of the calibrations before and after it.
pub const PASSES: usize = 2;

/// The passes of one dtype's reference jobs merged: each unit's time the lowest of its
/// passes' medians, each job's waits from its pass with the shortest step.
#[derive(Debug, Clone)]
pub struct MergedPasses {
    /// The samples, in the passes' order, with the lowest measured time of each.
    pub samples: Vec<FitSample>,
    /// Per job the waits of its pass with the smallest `busy_s + wait_s`.
    pub waits: Vec<JobWaits>,
    /// Each pass's total measured unit seconds (the sum over its samples), in pass order.
    pub pass_totals_s: Vec<f64>,
}

/// When the slowest pass's total exceeds the fastest's by more than this share, calibrate
/// warns that the machine's speed changed while it measured.
pub const PASS_SPREAD_WARNING: f64 = 0.2;

impl MergedPasses {
    /// The passes' totals, `0.412 s, 0.418 s`.
    pub fn totals_text(&self) -> String {
        self.pass_totals_s
            .iter()
            .map(|t| format!("{t:.3} s"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// A warning for the user when the slowest pass took over [`PASS_SPREAD_WARNING`] longer
    /// than the fastest (the jobs computed in `dtype`).
    pub fn spread_warning(&self, dtype: fsdp_types::DType) -> Option<String> {
        let lo = self
            .pass_totals_s
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min);
        let hi = self.pass_totals_s.iter().copied().fold(0.0, f64::max);
        (hi > (1.0 + PASS_SPREAD_WARNING) * lo).then(|| {
            format!(
                "the {} reference jobs took {} in their {} passes: the machine's speed changed while calibrate measured (another process or the hypervisor took CPU time); each unit's faster pass is kept, but calibrate again on a quiet machine if predictions are off",
                dtype.name(),
                self.totals_text(),
                self.pass_totals_s.len()
            )
        })
    }
}

/// Merges passes of [`measure_references`] (see [`MergedPasses`]).
///
/// Errors: a message when there is no pass, or the passes do not hold the same samples and
/// jobs in the same order (they come from the same jobs' plans, so this is a bug).
pub fn faster_pass(passes: &[(Vec<FitSample>, Vec<JobWaits>)]) -> Result<MergedPasses, String> {
    let (first, rest) = passes
        .split_first()
        .ok_or("no pass of the reference jobs")?;
    let mut samples = first.0.clone();
    let mut waits = first.1.clone();
    for (s, w) in rest {
        if s.len() != samples.len()
            || w.len() != waits.len()
            || s.iter().zip(&samples).any(|(a, b)| a.name != b.name)
        {
            return Err("the passes of the reference jobs measured different units".into());
        }
        for (m, x) in samples.iter_mut().zip(s) {
            m.measured_s = m.measured_s.min(x.measured_s);
        }
        for (m, x) in waits.iter_mut().zip(w) {
            if x.busy_s + x.wait_s < m.busy_s + m.wait_s {
                *m = x.clone();
            }
        }
    }
    Ok(MergedPasses {
        samples,
        waits,
        pass_totals_s: passes
            .iter()
            .map(|(s, _)| s.iter().map(|x| x.measured_s).sum())
            .collect(),
    })
}

/// The median over counted (rank, step) pairs of the compute thread's seconds in wait spans,
/// and of its seconds in its other spans, over the ranks the trace holds (medians, as the
/// median step `fsdp train` measures: one step slowed by the machine does not move it).
fn rank_waits(doc: &serde_json::Value) -> Result<(f64, f64), String> {
    let events = doc["traceEvents"]
        .as_array()
        .ok_or("the trace has no traceEvents")?;
    let mut per: BTreeMap<(u64, u64), (f64, f64)> = BTreeMap::new();
    for e in events {
        let step = e["args"]["step"].as_u64().unwrap_or(0);
        if e["ph"] != "X" || e["tid"].as_u64() != Some(0) || step <= SKIPPED_STEPS {
            continue;
        }
        let key = (e["pid"].as_u64().unwrap_or(0), step);
        let dur = e["dur"].as_f64().unwrap_or(0.0) * 1e-6;
        let w = per.entry(key).or_default();
        if e["cat"] == "wait" {
            w.0 += dur;
        } else {
            w.1 += dur;
        }
    }
    if per.is_empty() {
        return Err("the trace has no counted compute-thread spans".into());
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok((
        median(per.values().map(|x| x.0).collect()),
        median(per.values().map(|x| x.1).collect()),
    ))
}

/// The largest rank skew [`fit_skew`] considers: the slowest rank half again as slow as the
/// mean one.
pub const MAX_SKEW: f64 = 0.5;

/// Fits the profile's `rank_skew` (see [`fsdp_planner::time::HardwareProfile::rank_skew`]):
/// the value in `0..=MAX_SKEW` for which the time model's exposed communication of each
/// reference job (with `profile`'s compute fit) comes closest to the job's measured median
/// wait per rank and step, each job's error relative to its measured step (compute plus
/// waits), least squares. A grid of 0.0025, then 0.0001 around the best point; the
/// prediction is deterministic and grows with the skew, so the grid finds the minimum.
///
/// Errors: a message when a job cannot be predicted on `profile`.
pub fn fit_skew(profile: &HardwareProfile, jobs: &[JobWaits]) -> Result<f64, String> {
    let mut p = profile.clone();
    let mut cost = |k: f64| -> Result<f64, String> {
        p.rank_skew = k;
        let mut c = 0.0;
        for j in jobs {
            let pred =
                fsdp_planner::time::predict(&j.plan, &p, &j.inputs).map_err(|e| e.to_string())?;
            let step = (j.busy_s + j.wait_s).max(f64::MIN_POSITIVE);
            c += ((pred.exposed_comm_s - j.wait_s) / step).powi(2);
        }
        Ok(c)
    };
    let mut best = (0.0, cost(0.0)?);
    let coarse = 0.0025;
    for i in 1..=(MAX_SKEW / coarse).round() as usize {
        let k = i as f64 * coarse;
        let c = cost(k)?;
        if c < best.1 {
            best = (k, c);
        }
    }
    let centre = best.0;
    for i in -25i32..=25 {
        let k = centre + f64::from(i) * 1e-4;
        if !(0.0..=MAX_SKEW).contains(&k) {
            continue;
        }
        let c = cost(k)?;
        if c < best.1 {
            best = (k, c);
        }
    }
    Ok(best.0)
}

fn tempfile_dir() -> Result<std::path::PathBuf, String> {
    let d = std::env::temp_dir().join(format!("fsdp-calibrate-{}", std::process::id()));
    std::fs::create_dir_all(&d).map_err(|e| format!("creating {}: {e}", d.display()))?;
    Ok(d)
}

/// The median forward seconds per forward position, and backward seconds per position
/// (`None` where the position runs no backward), over the counted steps of every rank of a
/// measured trace with `positions` forward positions. Within one (rank, step, micro-batch)
/// the k-th forward span is position k and the backward spans run in reverse position order
/// over the positions that have one.
fn unit_times(
    doc: &serde_json::Value,
    positions: usize,
) -> Result<(Vec<f64>, Vec<Option<f64>>), String> {
    let events = doc["traceEvents"]
        .as_array()
        .ok_or("the trace has no traceEvents")?;
    // (rank, step, micro-batch) -> (forward spans, backward spans) as (start, seconds).
    type Spans = (Vec<(f64, f64)>, Vec<(f64, f64)>);
    let mut groups: BTreeMap<(u64, u64, u64), Spans> = BTreeMap::new();
    for e in events {
        if e["ph"] != "X" {
            continue;
        }
        let cat = e["cat"].as_str().unwrap_or("");
        if cat != "forward" && cat != "backward" {
            continue;
        }
        let step = e["args"]["step"].as_u64().unwrap_or(0);
        if step <= SKIPPED_STEPS {
            continue;
        }
        let key = (
            e["pid"].as_u64().unwrap_or(0),
            step,
            e["args"]["micro_batch"].as_u64().unwrap_or(0),
        );
        let span = (
            e["ts"].as_f64().unwrap_or(0.0),
            e["dur"].as_f64().unwrap_or(0.0) * 1e-6,
        );
        let g = groups.entry(key).or_default();
        if cat == "forward" {
            g.0.push(span);
        } else {
            g.1.push(span);
        }
    }
    if groups.is_empty() {
        return Err("the trace has no counted forward or backward spans".into());
    }
    let mut fwd: Vec<Vec<f64>> = vec![Vec::new(); positions];
    let mut bwd: Vec<Vec<f64>> = vec![Vec::new(); positions];
    for ((rank, step, mb), (mut f, mut b)) in groups {
        if f.len() != positions || b.len() > positions {
            return Err(format!(
                "rank {rank} step {step} micro-batch {mb}: {} forward and {} backward spans for {positions} positions",
                f.len(),
                b.len()
            ));
        }
        f.sort_by(|x, y| x.0.total_cmp(&y.0));
        b.sort_by(|x, y| x.0.total_cmp(&y.0));
        for (k, s) in f.iter().enumerate() {
            fwd[k].push(s.1);
        }
        // The last positions run backward first; the first b.len() positions from the end.
        for (j, s) in b.iter().enumerate() {
            bwd[positions - 1 - j].push(s.1);
        }
    }
    let median = |v: &mut Vec<f64>| -> Option<f64> {
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(v[v.len() / 2])
    };
    let f = fwd
        .iter_mut()
        .map(|v| median(v).ok_or("a forward position has no span"))
        .collect::<Result<Vec<_>, _>>()?;
    let b = bwd.iter_mut().map(median).collect();
    Ok((f, b))
}

/// Fits the [`ComputeFit`] to `samples` (see the module doc).
///
/// Errors: a message when there are fewer than 3 samples or no subset has a positive GEMM
/// scale.
pub fn fit(samples: &[FitSample]) -> Result<ComputeFit, String> {
    if samples.len() < 3 {
        return Err(format!(
            "{} unit times are too few to fit 3 numbers",
            samples.len()
        ));
    }
    // Each sample weighted by 1 / its reference job's total measured compute: every job
    // counts alike, and within a job a unit counts by its share of the step (a 50 us
    // embedding does not pull the fit as much as a 5 ms block).
    let mut totals: BTreeMap<&str, f64> = BTreeMap::new();
    for s in samples {
        *totals.entry(job_of(&s.name)).or_default() += s.measured_s;
    }
    let rows: Vec<([f64; 3], f64)> = samples
        .iter()
        .filter(|s| s.measured_s > 0.0)
        .map(|s| {
            let w = 1.0 / totals[job_of(&s.name)];
            (
                [
                    s.parts.gemm_s * w,
                    s.parts.elementwise_s * w,
                    s.parts.ops * w,
                ],
                s.measured_s * w,
            )
        })
        .collect();
    let mut best: Option<([f64; 3], f64)> = None;
    // Term subsets, GEMM always in: {g, e, n}, {g, e}, {g, n}, {g}.
    for mask in [
        [true, true, true],
        [true, true, false],
        [true, false, true],
        [true, false, false],
    ] {
        let Some(x) = least_squares(&rows, mask) else {
            continue;
        };
        if x[0] <= 0.0 || x.iter().any(|v| *v < 0.0) {
            continue;
        }
        let r: f64 = rows
            .iter()
            .map(|(a, b)| (a[0] * x[0] + a[1] * x[1] + a[2] * x[2] - b).powi(2))
            .sum();
        if best.is_none_or(|(_, br)| r < br) {
            best = Some((x, r));
        }
    }
    let (x, _) = best.ok_or("no non-negative fit with a positive GEMM scale")?;
    let mut f = ComputeFit {
        gemm_scale: x[0],
        elementwise_scale: x[1],
        op_overhead_s: x[2],
        rms_relative_error: 0.0,
        samples: rows.len() as u64,
        gemm_pricing: None,
    };
    // The error of each reference job's total compute (what a step's prediction sees).
    let mut job: BTreeMap<&str, (f64, f64)> = BTreeMap::new();
    for s in samples {
        let e = job.entry(job_of(&s.name)).or_default();
        e.0 += s.parts.seconds(&f);
        e.1 += s.measured_s;
    }
    let sq: f64 = job.values().map(|(p, m)| (p / m - 1.0).powi(2)).sum();
    f.rms_relative_error = (sq / job.len() as f64).sqrt();
    Ok(f)
}

/// `profile` without GEMM shape grids: every GEMM at the rate of its FLOPs. Its compute fits
/// go too (a fit records the pricing it was made with, which this copy no longer has; the
/// analytical parts the fits are made from do not use them).
pub fn without_shapes(profile: &HardwareProfile) -> HardwareProfile {
    let mut p = profile.clone();
    p.compute_fit = Default::default();
    for c in [
        &mut p.gemm.bf16,
        &mut p.gemm.f16,
        &mut p.gemm.f32,
        &mut p.gemm.f64,
    ]
    .into_iter()
    .flatten()
    {
        c.shapes.clear();
    }
    p
}

/// The root of the mean squared residual of `f` over `samples`, each residual divided by its
/// reference job's total measured compute (the weighting [`fit`] minimises).
pub fn weighted_rms_residual(samples: &[FitSample], f: &ComputeFit) -> f64 {
    let mut totals: BTreeMap<&str, f64> = BTreeMap::new();
    for s in samples {
        *totals.entry(job_of(&s.name)).or_default() += s.measured_s;
    }
    let kept: Vec<&FitSample> = samples.iter().filter(|s| s.measured_s > 0.0).collect();
    if kept.is_empty() {
        return 0.0;
    }
    let sq: f64 = kept
        .iter()
        .map(|s| ((s.parts.seconds(f) - s.measured_s) / totals[job_of(&s.name)]).powi(2))
        .sum();
    (sq / kept.len() as f64).sqrt()
}

/// The fit by shape and the fit by size of the same samples, and which is kept.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShapeOrSize {
    /// The fit kept.
    pub fit: ComputeFit,
    /// Whether it prices GEMMs by shape (the profile keeps its grid) or by size alone.
    pub by_shape: bool,
    /// [`weighted_rms_residual`] of the fit by shape.
    pub shape_residual: f64,
    /// [`weighted_rms_residual`] of the fit by size.
    pub size_residual: f64,
}

/// How much smaller the residual by size must be for the fit by size to replace the fit by
/// shape (a fraction of the shape's residual): on a shared machine two calibrations minutes
/// apart give residuals a few percent apart either way, and a choice that flips with that
/// noise would move predictions with it.
pub const SIZE_MARGIN: f64 = 0.05;

/// Fits the samples' parts by shape and by size ([`fit`] each) and keeps the fit by shape
/// unless the fit by size's [`weighted_rms_residual`] is smaller by more than
/// [`SIZE_MARGIN`]; the kept fit records its [`GemmPricing`].
///
/// Errors: as [`fit`], when either fit fails.
pub fn fit_by_shape_or_size(samples: &[FitSample]) -> Result<ShapeOrSize, String> {
    let by_shape = fit(samples)?;
    let size: Vec<FitSample> = samples
        .iter()
        .map(|s| FitSample {
            parts: s.size_parts,
            ..s.clone()
        })
        .collect();
    let by_size = fit(&size)?;
    let shape_residual = weighted_rms_residual(samples, &by_shape);
    let size_residual = weighted_rms_residual(&size, &by_size);
    let keep_shape = size_residual >= (1.0 - SIZE_MARGIN) * shape_residual;
    let (fit, pricing) = if keep_shape {
        (by_shape, GemmPricing::Shape)
    } else {
        (by_size, GemmPricing::Size)
    };
    Ok(ShapeOrSize {
        fit: ComputeFit {
            gemm_pricing: Some(pricing),
            ..fit
        },
        by_shape: keep_shape,
        shape_residual,
        size_residual,
    })
}

/// The reference job a sample name starts with (`tiny` of `tiny forward h.1`).
fn job_of(name: &str) -> &str {
    name.split(' ').next().unwrap_or("")
}

/// Least squares of `a x = b` over the columns in `mask` (others 0), by the normal
/// equations and Gaussian elimination with partial pivoting; `None` when singular.
fn least_squares(rows: &[([f64; 3], f64)], mask: [bool; 3]) -> Option<[f64; 3]> {
    let cols: Vec<usize> = (0..3).filter(|&c| mask[c]).collect();
    let k = cols.len();
    let mut m = vec![vec![0.0f64; k + 1]; k];
    for (a, b) in rows {
        for (i, &ci) in cols.iter().enumerate() {
            for (j, &cj) in cols.iter().enumerate() {
                m[i][j] += a[ci] * a[cj];
            }
            m[i][k] += a[ci] * b;
        }
    }
    for i in 0..k {
        let p = (i..k).max_by(|&x, &y| m[x][i].abs().total_cmp(&m[y][i].abs()))?;
        if m[p][i].abs() < 1e-300 {
            return None;
        }
        m.swap(i, p);
        let pivot = m[i].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != i {
                let f = row[i] / pivot[i];
                for (x, p) in row.iter_mut().zip(&pivot).skip(i) {
                    *x -= f * p;
                }
            }
        }
    }
    let mut x = [0.0; 3];
    for (i, &ci) in cols.iter().enumerate() {
        x[ci] = m[i][k] / m[i][i];
    }
    Some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(g: f64, e: f64, n: f64) -> ComputeParts {
        ComputeParts {
            gemm_s: g,
            elementwise_s: e,
            ops: n,
            gemm_peak_s: 0.0,
        }
    }

    fn sample(g: f64, e: f64, n: f64, t: f64) -> FitSample {
        FitSample {
            name: String::new(),
            measured_s: t,
            parts: parts(g, e, n),
            size_parts: parts(g, e, n),
        }
    }

    /// Samples of two jobs whose measured times are `1.2 x` the GEMM seconds of `truth` plus
    /// `2 x` the elementwise seconds; the other GEMM seconds differ from `truth`'s by a
    /// factor that is not the same for every unit (a layout the other model misprices).
    fn two_models(shape_is_true: bool) -> Vec<FitSample> {
        let units = [
            ("gpt forward", 4e-3, 1e-3, 1.0),
            ("gpt backward", 8e-3, 2e-3, 1.6),
            ("llama forward", 5e-3, 1e-3, 0.55),
            ("llama backward", 9e-3, 2e-3, 1.0),
            ("gpt forward", 2e-3, 0.5e-3, 1.0),
            ("llama forward", 3e-3, 0.4e-3, 0.6),
        ];
        units
            .iter()
            .map(|&(name, g, e, other)| {
                let truth = parts(g, e, 10.0);
                let wrong = parts(g * other, e, 10.0);
                let (p, s) = if shape_is_true {
                    (truth, wrong)
                } else {
                    (wrong, truth)
                };
                FitSample {
                    name: name.into(),
                    measured_s: 1.2 * g + 2.0 * e,
                    parts: p,
                    size_parts: s,
                }
            })
            .collect()
    }

    #[test]
    fn the_model_that_explains_the_units_is_kept() {
        for shape_is_true in [true, false] {
            let c = fit_by_shape_or_size(&two_models(shape_is_true)).unwrap();
            assert_eq!(c.by_shape, shape_is_true, "{c:?}");
            let (kept, other) = if shape_is_true {
                (c.shape_residual, c.size_residual)
            } else {
                (c.size_residual, c.shape_residual)
            };
            assert!(kept < 1e-9 && other > 1e-3, "{c:?}");
            assert!((c.fit.gemm_scale - 1.2).abs() < 1e-9, "{c:?}");
            assert!((c.fit.elementwise_scale - 2.0).abs() < 1e-9, "{c:?}");
            let want = if shape_is_true {
                GemmPricing::Shape
            } else {
                GemmPricing::Size
            };
            assert_eq!(c.fit.gemm_pricing, Some(want));
        }
    }

    #[test]
    fn a_size_fit_only_slightly_better_does_not_replace_the_shape_fit() {
        // Residuals 1.00 by shape against 0.97 by size: within the margin, shape stays;
        // against 0.90: size replaces it.
        let mk = |size_err: f64| -> Vec<FitSample> {
            // Two jobs of two units; the shape parts give measured + 1%, -1%; the size
            // parts give measured + size_err %, -size_err % (in units of 1%).
            let units = [
                ("a u1", 1e-3, 1.0),
                ("a u2", 1e-3, -1.0),
                ("b u1", 2e-3, 1.0),
                ("b u2", 2e-3, -1.0),
            ];
            units
                .iter()
                .map(|&(name, t, sign)| FitSample {
                    name: name.into(),
                    measured_s: t,
                    parts: parts(t * (1.0 + 0.01 * sign), 0.0, 0.0),
                    size_parts: parts(t * (1.0 + 0.01 * size_err * sign), 0.0, 0.0),
                })
                .collect()
        };
        let c = fit_by_shape_or_size(&mk(0.97)).unwrap();
        assert!(c.by_shape, "{c:?}");
        assert!(c.size_residual < c.shape_residual, "{c:?}");
        let c = fit_by_shape_or_size(&mk(0.90)).unwrap();
        assert!(!c.by_shape, "{c:?}");
    }

    #[test]
    fn recovers_the_coefficients_of_exact_data() {
        let (a, b, c) = (1.3, 2.5, 4e-6);
        let s: Vec<FitSample> = [
            (1e-3, 2e-4, 20.0),
            (5e-3, 1e-4, 20.0),
            (2e-4, 8e-4, 12.0),
            (3e-3, 3e-3, 40.0),
            (1e-4, 1e-5, 3.0),
        ]
        .iter()
        .map(|&(g, e, n)| sample(g, e, n, a * g + b * e + c * n))
        .collect();
        let f = fit(&s).unwrap();
        assert!((f.gemm_scale - a).abs() < 1e-9 * a, "{f:?}");
        assert!((f.elementwise_scale - b).abs() < 1e-9 * b, "{f:?}");
        assert!(
            (f.op_overhead_s - c).abs() < 1e-9 * c.max(1e-12) * 1e3,
            "{f:?}"
        );
        assert!(f.rms_relative_error < 1e-9);
        assert_eq!(f.samples, 5);
    }

    #[test]
    fn a_negative_term_is_dropped_not_kept() {
        // Times that a negative elementwise coefficient would fit best: the fit must stay
        // non-negative.
        let s: Vec<FitSample> = [
            (1e-3, 1e-3, 10.0, 0.5e-3),
            (2e-3, 0.1e-3, 10.0, 2.2e-3),
            (1e-3, 2e-3, 10.0, 0.2e-3),
            (4e-3, 0.1e-3, 10.0, 4.1e-3),
        ]
        .iter()
        .map(|&(g, e, n, t)| sample(g, e, n, t))
        .collect();
        let f = fit(&s).unwrap();
        assert!(f.gemm_scale > 0.0);
        assert!(
            f.elementwise_scale >= 0.0 && f.op_overhead_s >= 0.0,
            "{f:?}"
        );
    }

    #[test]
    fn the_trace_positions_map_forward_in_order_and_backward_reversed() {
        // 3 positions; position 0 runs no backward. Two counted steps, one rank.
        let mut ev = Vec::new();
        for step in [3u64, 4] {
            let base = step as f64 * 1e6;
            for (k, d) in [10.0, 20.0, 30.0].iter().enumerate() {
                ev.push(serde_json::json!({"ph": "X", "cat": "forward", "pid": 0,
                    "ts": base + k as f64 * 100.0, "dur": d * step as f64,
                    "args": {"step": step, "micro_batch": 0}}));
            }
            // backward of position 2 then 1.
            for (j, d) in [300.0, 200.0].iter().enumerate() {
                ev.push(serde_json::json!({"ph": "X", "cat": "backward", "pid": 0,
                    "ts": base + 1000.0 + j as f64 * 1000.0, "dur": *d,
                    "args": {"step": step, "micro_batch": 0}}));
            }
        }
        // A skipped step that would change the medians.
        ev.push(
            serde_json::json!({"ph": "X", "cat": "forward", "pid": 0, "ts": 0.0,
            "dur": 1e9, "args": {"step": 1, "micro_batch": 0}}),
        );
        let doc = serde_json::json!({ "traceEvents": ev });
        let (f, b) = unit_times(&doc, 3).unwrap();
        // Medians of two values take the upper one (index len/2).
        let close = |a: f64, b: f64| (a - b).abs() < 1e-15;
        assert!(
            f.iter()
                .zip([40e-6, 80e-6, 120e-6])
                .all(|(a, b)| close(*a, b))
                && f.len() == 3,
            "{f:?}"
        );
        assert_eq!(b[0], None, "{b:?}");
        assert!(
            close(b[1].unwrap(), 200e-6) && close(b[2].unwrap(), 300e-6),
            "{b:?}"
        );
    }

    /// A reference-like job on the built-in H200 profile: `tiny` at W = 2, full shard.
    fn job(k_true: f64, profile: &HardwareProfile) -> JobWaits {
        let o = TrainOptions {
            model: "tiny".into(),
            world_size: 2,
            strategy: Strategy::FullShard,
            micro_batch: 6,
            seq_len: 96,
            ..TrainOptions::default()
        };
        let model = crate::train::model_of(&o).unwrap();
        let plan = fsdp_planner::plan(
            crate::runtime::StagedModel::spec(&model),
            &crate::train::plan_config(&o),
        )
        .unwrap();
        let inputs = crate::options::time_inputs(&o);
        let mut p = profile.clone();
        p.rank_skew = k_true;
        let t = fsdp_planner::time::predict(&plan, &p, &inputs).unwrap();
        JobWaits {
            plan,
            inputs,
            wait_s: t.exposed_comm_s,
            busy_s: t.step_s - t.exposed_comm_s,
        }
    }

    #[test]
    fn the_skew_fit_recovers_the_skew_that_made_the_waits() {
        let h200 = fsdp_planner::time::builtin_profile("h200").unwrap();
        for k in [0.0, 0.0437, 0.18] {
            let got = fit_skew(&h200, &[job(k, &h200)]).unwrap();
            assert!((got - k).abs() <= 1e-4, "planted {k}, fitted {got}");
        }
        // Waits longer than any skew up to the bound explains: the bound, not more.
        let mut j = job(0.0, &h200);
        j.wait_s = 10.0 * j.busy_s;
        assert_eq!(fit_skew(&h200, &[j]).unwrap(), MAX_SKEW);
    }

    #[test]
    fn the_faster_pass_of_each_unit_and_job_is_kept() {
        let named = |n: &str, t: f64| FitSample {
            name: n.into(),
            ..sample(1e-3, 1e-4, 3.0, t)
        };
        let h200 = fsdp_planner::time::builtin_profile("h200").unwrap();
        let waits = |wait: f64, busy: f64| JobWaits {
            wait_s: wait,
            busy_s: busy,
            ..job(0.0, &h200)
        };
        // Pass 2 slowed down the first unit (a neighbour), pass 1 the second; the job's
        // shorter step is pass 2's (0.2 + 0.5 < 0.1 + 0.7).
        let a = (
            vec![
                named("tiny forward h.0", 2e-3),
                named("tiny backward h.0", 9e-3),
            ],
            vec![waits(0.1, 0.7)],
        );
        let b = (
            vec![
                named("tiny forward h.0", 5e-3),
                named("tiny backward h.0", 4e-3),
            ],
            vec![waits(0.2, 0.5)],
        );
        let m = faster_pass(&[a.clone(), b.clone()]).unwrap();
        let kept: Vec<f64> = m.samples.iter().map(|s| s.measured_s).collect();
        assert_eq!(kept, vec![2e-3, 4e-3]);
        assert_eq!((m.waits[0].wait_s, m.waits[0].busy_s), (0.2, 0.5));
        assert!((m.pass_totals_s[0] - 11e-3).abs() < 1e-15, "{m:?}");
        assert!((m.pass_totals_s[1] - 9e-3).abs() < 1e-15, "{m:?}");
        // 11 ms against 9 ms is 22% apart: over the warning's 20%.
        assert_eq!(m.totals_text(), "0.011 s, 0.009 s");
        let w = m.spread_warning(fsdp_types::DType::BF16).unwrap();
        assert!(
            w.starts_with("the bf16 reference jobs took 0.011 s, 0.009 s in their 2 passes"),
            "{w}"
        );
        let mut close = m.clone();
        close.pass_totals_s = vec![10.5e-3, 9e-3];
        assert_eq!(close.spread_warning(fsdp_types::DType::F32), None);
        // One pass is itself.
        let one = faster_pass(std::slice::from_ref(&a)).unwrap();
        assert_eq!(one.samples, a.0);
        // Passes of different units are refused, as is no pass.
        let mut c = b.clone();
        c.0[1].name = "tiny backward h.1".into();
        assert!(faster_pass(&[a, c]).is_err());
        assert!(faster_pass(&[]).is_err());
    }

    #[test]
    fn rank_waits_takes_the_median_over_every_rank_and_counted_step() {
        let span = |pid: u64, tid: u64, cat: &str, step: u64, us: f64| {
            serde_json::json!({"ph": "X", "pid": pid, "tid": tid, "cat": cat, "ts": 0.0,
                "dur": us, "args": {"step": step}})
        };
        let doc = serde_json::json!({"traceEvents": [
            // Not counted: a skipped step, the communication thread, a metadata event.
            span(0, 0, "wait", SKIPPED_STEPS, 9e6),
            span(0, 1, "all_gather", SKIPPED_STEPS + 1, 9e6),
            {"ph": "M", "pid": 0, "tid": 0, "name": "thread_name"},
            // Rank 0 step 3: 10 ms waits (two spans), 100 ms other; rank 1 step 3: 30 ms
            // waits, 80 ms other; rank 1 step 4: 200 ms waits (a slow moment), 90 ms other.
            span(0, 0, "wait", SKIPPED_STEPS + 1, 4e3),
            span(0, 0, "wait", SKIPPED_STEPS + 1, 6e3),
            span(0, 0, "forward", SKIPPED_STEPS + 1, 1e5),
            span(1, 0, "wait", SKIPPED_STEPS + 1, 3e4),
            span(1, 0, "backward", SKIPPED_STEPS + 1, 8e4),
            span(1, 0, "wait", SKIPPED_STEPS + 2, 2e5),
            span(1, 0, "backward", SKIPPED_STEPS + 2, 9e4),
        ]});
        let (w, b) = rank_waits(&doc).unwrap();
        assert!((w - 0.030).abs() < 1e-12, "{w}");
        assert!((b - 0.090).abs() < 1e-12, "{b}");
        assert!(rank_waits(&serde_json::json!({"traceEvents": []})).is_err());
    }
}

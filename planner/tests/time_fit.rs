//! The calibrated parts of a hardware profile: the compute fit (`t = gemm_scale g +
//! elementwise_scale e + op_overhead_s n` per unit use) and the memory bandwidth curve, each
//! expectation computed by hand from the FLOP count and the profile's numbers.

use fsdp_planner::presets::preset;
use fsdp_planner::time::flops::{self, Grads, OpKind, OpShape};
use fsdp_planner::time::{
    predict, use_compute_parts, ComputeFit, HardwareProfile, StepPrediction, TimeInputs,
};
use fsdp_planner::{plan, ActivationModel, PlanConfig, ShardPlan};
use fsdp_types::DType;

/// GEMM rate of the synthetic profile (flat), FLOP/s.
const RATE: f64 = 2e9;

/// A profile with a flat GEMM rate, elementwise work at `bw` bytes/s (and a huge FLOP rate),
/// and `extra` JSON members appended.
fn profile(bw: f64, extra: &str) -> Result<HardwareProfile, fsdp_planner::PlanError> {
    profile_with_curve(
        &format!(r#"{{"flops": 1, "flops_per_s": {RATE:e}}}"#),
        RATE,
        bw,
        extra,
    )
}

/// As [`profile`], with the f32 GEMM curve's `points` (JSON objects) and peak.
fn profile_with_curve(
    points: &str,
    peak: f64,
    bw: f64,
    extra: &str,
) -> Result<HardwareProfile, fsdp_planner::PlanError> {
    let c = r#"{"latency_s": 0, "step_latency_s": 0, "bus_bandwidth_bytes_per_s": 1e10}"#;
    let level = format!(r#"{{"all_gather": {c}, "reduce_scatter": {c}, "all_reduce": {c}}}"#);
    let text = format!(
        r#"{{
  "schema": "fsdp-hardware/1", "name": "synthetic", "description": "constructed",
  "ranks_per_node": 8,
  "gemm": {{"f32": {{"peak_flops_per_s": {peak:e}, "points": [{points}]}}}},
  "memory_bandwidth_bytes_per_s": {bw:e}, "elementwise_flops_per_s": 1e14,
  "collectives": {{"intra_node": {level}, "inter_node": {level}}},
  "host": {{"link_bytes_per_s": 1e10, "optimizer_bytes_per_s": 1e10}},
  "overlap_slowdown": 0{extra}
}}"#
    );
    HardwareProfile::from_json(&text, "synthetic")
}

fn tiny_plan() -> ShardPlan {
    let mut c = PlanConfig::new(2);
    c.micro_batch = 4;
    c.seq_len = 64;
    plan(&preset("tiny").unwrap(), &c).unwrap()
}

/// GEMM FLOPs, elementwise bytes and op count of position `k`'s forward, from the FLOP count.
fn forward_by_hand(p: &ShardPlan, k: usize) -> (f64, f64, f64) {
    let st = &p.schedule.forward[k];
    let shape = OpShape {
        micro_batch: p.config.micro_batch,
        seq_len: p.config.seq_len,
        dtype: DType::F32,
        attention: flops::AttentionCount::of(ActivationModel::Fused),
    };
    let ops = flops::forward_ops(&p.arch, st.role, &shape).unwrap();
    let g = ops
        .iter()
        .filter(|o| o.kind == OpKind::Gemm)
        .map(|o| o.flops)
        .sum::<f64>();
    let e = ops
        .iter()
        .filter(|o| o.kind == OpKind::Elementwise)
        .map(|o| o.bytes)
        .sum::<f64>();
    (g, e, ops.len() as f64)
}

#[test]
fn a_compute_fit_scales_gemm_and_elementwise_time_and_adds_a_cost_per_op() {
    let p = tiny_plan();
    let bw = 1e10;
    let (a, b, c) = (1.7, 2.5, 3e-6);
    let fitted = profile(
        bw,
        &format!(
            r#", "compute_fit": {{"bf16": {{"gemm_scale": 9, "elementwise_scale": 9, "op_overhead_s": 0, "rms_relative_error": 0.01, "samples": 9}}, "f32": {{"gemm_scale": {a}, "elementwise_scale": {b}, "op_overhead_s": {c:e}, "rms_relative_error": 0.01, "samples": 9}}}}"#
        ),
    )
    .unwrap();
    let plain = profile(bw, "").unwrap();
    let with = predict(&p, &fitted, &TimeInputs::default()).unwrap();
    let without = predict(&p, &plain, &TimeInputs::default()).unwrap();
    let mut checked = 0;
    for (k, (u1, u0)) in with.uses.iter().zip(&without.uses).enumerate() {
        let (g, e, n) = forward_by_hand(&p, k);
        let raw = g / RATE + e / bw;
        let want = a * g / RATE + b * e / bw + c * n;
        assert!(
            (u0.forward_s - raw).abs() <= 1e-12 * raw.max(1e-9),
            "{k}: {} vs {raw}",
            u0.forward_s
        );
        assert!(
            (u1.forward_s - want).abs() <= 1e-12 * want,
            "{k}: {} vs {want}",
            u1.forward_s
        );
        checked += 1;
    }
    assert_eq!(checked, p.schedule.forward.len());
    // The parts calibrate fits to are the unfitted ones.
    let parts = use_compute_parts(&p, &fitted).unwrap();
    for (k, u) in parts.iter().enumerate() {
        let (g, e, n) = forward_by_hand(&p, k);
        assert!((u.forward.gemm_s - g / RATE).abs() <= 1e-15 + 1e-12 * g / RATE);
        assert!((u.forward.elementwise_s - e / bw).abs() <= 1e-15 + 1e-12 * e / bw);
        assert_eq!(u.forward.ops, n);
        assert!(
            (u.forward.seconds(&fitted.fit(DType::F32)) - with.uses[k].forward_s).abs() < 1e-15
        );
        assert_eq!(
            u.forward.seconds(&ComputeFit::IDENTITY),
            without.uses[k].forward_s
        );
    }
    // The backward of a block has weight and input gradients: more GEMM time than forward.
    let block = parts.iter().find(|u| u.label == "h.1").unwrap();
    let grads = Grads {
        input: true,
        weights: true,
    };
    let bo = flops::backward_ops(
        &p.arch,
        p.schedule.forward[block.position].role,
        &OpShape {
            micro_batch: 4,
            seq_len: 64,
            dtype: DType::F32,
            attention: flops::AttentionCount::of(ActivationModel::Fused),
        },
        grads,
    )
    .unwrap();
    assert_eq!(block.backward.ops, bo.len() as f64);
}

#[test]
fn a_gemm_scale_under_one_never_prices_a_gemm_above_the_peak() {
    // The flat curve runs at the peak, so a GEMM scale of 0.5 would halve GEMM time below
    // what the peak allows (MFU over 100%); the time is the peak's instead.
    let p = tiny_plan();
    let bw = 1e10;
    let c = 3e-6;
    let fitted = profile(
        bw,
        &format!(
            r#", "compute_fit": {{"f32": {{"gemm_scale": 0.5, "elementwise_scale": 1, "op_overhead_s": {c:e}, "rms_relative_error": 0.01, "samples": 9}}}}"#
        ),
    )
    .unwrap();
    let t = predict(&p, &fitted, &TimeInputs::default()).unwrap();
    for (k, u) in t.uses.iter().enumerate() {
        let (g, e, n) = forward_by_hand(&p, k);
        let want = g / RATE + e / bw + c * n;
        assert!(
            (u.forward_s - want).abs() <= 1e-12 * want,
            "{k}: {} vs {want}",
            u.forward_s
        );
    }
    // (HFU also counts the elementwise FLOPs, which this profile runs at 1e14 FLOP/s, above
    // its GEMM peak, so only MFU is bounded here.)
    assert!(t.mfu < 1.0, "MFU {}", t.mfu);
}

#[test]
fn memory_time_follows_the_bandwidth_curve_linear_in_log_bytes() {
    let curve = r#", "memory_bandwidth_curve": [{"bytes": 1e3, "bytes_per_s": 1e9}, {"bytes": 1e5, "bytes_per_s": 1e8}]"#;
    let p = profile(5e7, curve).unwrap();
    // Halfway in log10 between 1e3 and 1e5: the mean of the two rates.
    let want = 1e4 / 5.5e8;
    assert!(
        (p.memory_seconds(1e4) - want).abs() < 1e-15,
        "{}",
        p.memory_seconds(1e4)
    );
    // Clamped at both ends.
    assert_eq!(p.memory_seconds(10.0), 10.0 / 1e9);
    assert_eq!(p.memory_seconds(1e7), 1e7 / 1e8);
    assert_eq!(p.memory_seconds(0.0), 0.0);
    // Without a curve: the single bandwidth.
    let flat = profile(5e7, "").unwrap();
    assert_eq!(flat.memory_seconds(1e4), 1e4 / 5e7);
    // The optimizer step (memory-bound) is faster with a cache-fast curve than at 5e7.
    let pl = tiny_plan();
    let fast = predict(&pl, &p, &TimeInputs::default()).unwrap();
    let slow = predict(&pl, &flat, &TimeInputs::default()).unwrap();
    assert!(
        fast.optimizer_s < slow.optimizer_s,
        "{} {}",
        fast.optimizer_s,
        slow.optimizer_s
    );
}

#[test]
fn implausible_calibrated_numbers_are_refused_by_their_path() {
    let cases = [
        (
            r#", "compute_fit": {"f32": {"gemm_scale": 0, "elementwise_scale": 1, "op_overhead_s": 0, "rms_relative_error": 0, "samples": 1}}"#,
            "compute_fit.f32.gemm_scale",
        ),
        (
            r#", "compute_fit": {"f16": {"gemm_scale": 1, "elementwise_scale": -1, "op_overhead_s": 0, "rms_relative_error": 0, "samples": 1}}"#,
            "compute_fit.f16.elementwise_scale",
        ),
        (
            r#", "compute_fit": {"f32": {"gemm_scale": 1, "elementwise_scale": 1, "op_overhead_s": 5, "rms_relative_error": 0, "samples": 1}}"#,
            "compute_fit.f32.op_overhead_s",
        ),
        (
            r#", "memory_bandwidth_curve": [{"bytes": 1e5, "bytes_per_s": 1e9}, {"bytes": 1e3, "bytes_per_s": 1e8}]"#,
            "memory_bandwidth_curve[1].bytes",
        ),
        (
            r#", "memory_bandwidth_curve": [{"bytes": 1e5, "bytes_per_s": 0}]"#,
            "memory_bandwidth_curve[0].bytes_per_s",
        ),
        (
            r#", "compute_fit": {"f32": {"gemm_scale": 1, "elementwise_scale": 1, "op_overhead_s": 0, "rms_relative_error": 0, "samples": 1, "extra": 2}}"#,
            "compute_fit.f32",
        ),
        // A curve written in GB/s, not bytes/s: the bandwidth range of the single figure.
        (
            r#", "memory_bandwidth_curve": [{"bytes": 1e5, "bytes_per_s": 58.9}]"#,
            "`memory_bandwidth_curve[0].bytes_per_s` is 58.9, outside the plausible range of a bandwidth, 1e6..1e15 bytes/s (a unit mistake",
        ),
        // A GEMM scale that prices every GEMM at nothing.
        (
            r#", "compute_fit": {"f32": {"gemm_scale": 1e-300, "elementwise_scale": 1, "op_overhead_s": 0, "rms_relative_error": 0, "samples": 1}}"#,
            "`compute_fit.f32.gemm_scale` is 1e-300, outside the plausible range [0.01, 100]",
        ),
        (r#", "norm_elements_per_s": 0"#, "norm_elements_per_s"),
        (r#", "norm_elements_per_s": 1e16"#, "norm_elements_per_s"),
        (r#", "optimizer_bytes_per_s": -1"#, "optimizer_bytes_per_s"),
        (
            r#", "optimizer_bytes_per_s": "fast""#,
            "optimizer_bytes_per_s",
        ),
    ];
    for (extra, field) in cases {
        let e = profile(1e10, extra).unwrap_err().to_string();
        assert!(e.contains(field), "{field}: {e}");
    }
}

#[test]
fn fused_attention_gemms_are_priced_per_pair_and_row_block() {
    // A curve of two points: calls of 1e5 FLOPs run at 1 GFLOP/s, calls of 1e9 at 100,
    // linear in log FLOPs between.
    let (lo, hi): ((f64, f64), (f64, f64)) = ((1e5, 1e9), (1e9, 1e11));
    let prof = profile_with_curve(
        &format!(
            r#"{{"flops": {:e}, "flops_per_s": {:e}}}, {{"flops": {:e}, "flops_per_s": {:e}}}"#,
            lo.0, lo.1, hi.0, hi.1
        ),
        hi.1,
        1e10,
        "",
    )
    .unwrap();
    let rate = |f: f64| {
        let x = ((f.log10() - lo.0.log10()) / (hi.0.log10() - lo.0.log10())).clamp(0.0, 1.0);
        lo.1 + x * (hi.1 - lo.1)
    };
    // tiny: d 128, 4 heads of 32; micro-batch 3, T = 130: row blocks of 64, 64 and 2 rows.
    let mut c = PlanConfig::new(1);
    c.micro_batch = 3;
    c.seq_len = 130;
    let p = plan(&preset("tiny").unwrap(), &c).unwrap();
    let k = p
        .schedule
        .forward
        .iter()
        .position(|s| s.role == fsdp_planner::schedule::UseRole::Block)
        .unwrap();
    let shape = |attention| OpShape {
        micro_batch: 3,
        seq_len: 130,
        dtype: DType::F32,
        attention,
    };
    let fused = flops::AttentionCount::of(ActivationModel::Fused);
    let ops = flops::forward_ops(&p.arch, p.schedule.forward[k].role, &shape(fused)).unwrap();
    let calls = 3.0 * 4.0 * 3.0; // sequences x heads x row blocks
    let mut want = 0.0;
    for o in ops.iter().filter(|o| o.kind == OpKind::Gemm) {
        let c = if o.name.starts_with("attn.scores") || o.name.starts_with("attn.context") {
            calls
        } else {
            1.0
        };
        assert_eq!(o.calls, c, "{}", o.name);
        want += c * (o.flops / c) / rate(o.flops / c);
    }
    let parts = use_compute_parts(&p, &prof).unwrap();
    let got = parts[k].forward.gemm_s;
    assert!((got - want).abs() <= 1e-12 * want, "{got} vs {want}");
    // Priced as one call of the summed FLOPs, the attention would cost far less.
    let one_call: f64 = ops
        .iter()
        .filter(|o| o.kind == OpKind::Gemm)
        .map(|o| o.flops / rate(o.flops))
        .sum();
    assert!(got > 1.2 * one_call, "{got} vs {one_call}");
    // The composite path's attention is one batched matmul.
    let full = flops::forward_ops(
        &p.arch,
        p.schedule.forward[k].role,
        &shape(flops::AttentionCount::Full),
    )
    .unwrap();
    assert!(full
        .iter()
        .filter(|o| o.kind == OpKind::Gemm)
        .all(|o| o.calls == 1.0));
}

/// Seconds of the predicted spans named `name` (summed), and how many there are.
fn spans_named(t: &StepPrediction, name: &str) -> (f64, usize) {
    t.spans
        .iter()
        .filter(|s| s.name == name)
        .fold((0.0, 0), |(sum, n), s| (sum + s.end_s - s.start_s, n + 1))
}

/// The passes after the backward at the profile's measured rates. On a CPU the gradient
/// norm's sum of squares is one dependent f64 chain (slower than the bandwidth) and AdamW
/// runs on the rank's compute threads (faster than one thread's copy); without the rates both
/// are memory-bound passes. The divide before the norm, the zeroing after the update, and
/// the finite check of every unit's contribution before its reduction stay memory-bound.
#[test]
fn norm_and_optimizer_run_at_the_profiles_measured_rates() {
    let p = tiny_plan();
    let bw = 1e10;
    let n: f64 = p
        .units
        .iter()
        .flat_map(|u| &u.flat_params)
        .filter(|f| f.trainable)
        .map(|f| f.shard_numel().0 as f64)
        .sum();
    // Span lengths are differences of times since the step's start: 1e-9, not 1e-12.
    let close = |got: f64, want: f64, what: &str| {
        assert!((got - want).abs() <= 1e-9 * want, "{what}: {got} vs {want}")
    };
    let flat = predict(&p, &profile(bw, "").unwrap(), &TimeInputs::default()).unwrap();
    close(
        spans_named(&flat, "gradient scale and norm").0,
        12.0 * n / bw,
        "norm, memory-bound",
    );
    close(
        spans_named(&flat, "optimizer step").0,
        32.0 * n / bw,
        "AdamW, memory-bound",
    );
    let rated = profile(
        bw,
        r#", "norm_elements_per_s": 1e8, "optimizer_bytes_per_s": 4e10"#,
    )
    .unwrap();
    let t = predict(&p, &rated, &TimeInputs::default()).unwrap();
    close(
        spans_named(&t, "gradient scale and norm").0,
        8.0 * n / bw + n / 1e8,
        "norm at its rate",
    );
    close(
        spans_named(&t, "optimizer step").0,
        28.0 * n / 4e10 + 4.0 * n / bw,
        "AdamW at its rate",
    );
    // A norm rate above the bandwidth's: the read still takes the bandwidth's time.
    let fast = profile(bw, r#", "norm_elements_per_s": 1e14"#).unwrap();
    let t = predict(&p, &fast, &TimeInputs::default()).unwrap();
    close(
        spans_named(&t, "gradient scale and norm").0,
        12.0 * n / bw,
        "norm above the bandwidth",
    );
    // Offloaded, the step runs at the host optimizer threads' rate, not the device's.
    let mut c = p.config.clone();
    c.offload = Some(fsdp_planner::Offload::Optimizer);
    let off = plan(&preset("tiny").unwrap(), &c).unwrap();
    let t = predict(&off, &rated, &TimeInputs::default()).unwrap();
    close(
        spans_named(&t, "optimizer step").0,
        32.0 * n / 1e10,
        "offloaded AdamW at host.optimizer_bytes_per_s",
    );
    // One finite check per unit with a trainable flat parameter: its padded elements read
    // once in reduce_dtype (f32 here).
    for u in &p.units {
        let padded: f64 = u
            .flat_params
            .iter()
            .filter(|f| f.trainable)
            .map(|f| f.padded_numel.0 as f64)
            .sum();
        let (s, count) = spans_named(&flat, &format!("finite check {}", u.name));
        assert_eq!(count, 1, "{}", u.name);
        close(s, 4.0 * padded / bw, &u.name);
    }
}

/// The model replays every micro-batch: a step of more than `MAX_MICRO_BATCHES` is refused by
/// name (a million would take minutes and gigabytes), the limit itself is predicted.
#[test]
fn more_micro_batches_than_the_model_simulates_are_refused_by_name() {
    let prof = profile(1e10, "").unwrap();
    let mut c = tiny_plan().config.clone();
    c.grad_accum = fsdp_planner::time::MAX_MICRO_BATCHES;
    let at = plan(&preset("tiny").unwrap(), &c).unwrap();
    let t = predict(&at, &prof, &TimeInputs::default()).unwrap();
    assert!(t.step_s.is_finite() && t.step_s > 0.0);
    c.grad_accum += 1;
    let over = plan(&preset("tiny").unwrap(), &c).unwrap();
    let e = predict(&over, &prof, &TimeInputs::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--grad-accum 4097") && e.contains("at most 4096"),
        "{e}"
    );
}

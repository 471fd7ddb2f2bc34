//! GEMM rates by shape and operand layout: every linear layer's GEMM carries the shape and
//! layout the engine runs it in; a profile's grid of measured rates scales the size curve by
//! a factor interpolated in log dimensions; the step model prices each GEMM at it; a broken
//! grid is refused by its path. Every expectation is computed by hand from the profile's
//! numbers and the models' dimensions.

use fsdp_planner::presets::preset;
use fsdp_planner::schedule::UseRole;
use fsdp_planner::time::flops::{self, Grads, OpCost, OpKind, OpShape};
use fsdp_planner::time::{use_compute_parts, GemmLayout, GemmShape, HardwareProfile};
use fsdp_planner::{plan, ActivationModel, PlanConfig, PlanError};
use fsdp_types::DType;

/// A profile whose f32 GEMM curve has `points` (JSON objects), `peak` and `shapes` (JSON
/// objects, may be empty).
fn profile(points: &str, peak: f64, shapes: &str) -> Result<HardwareProfile, PlanError> {
    profile_with(points, peak, shapes, "")
}

/// As [`profile`], with `extra` JSON members appended (each preceded by a comma).
fn profile_with(
    points: &str,
    peak: f64,
    shapes: &str,
    extra: &str,
) -> Result<HardwareProfile, PlanError> {
    let c = r#"{"latency_s": 0, "step_latency_s": 0, "bus_bandwidth_bytes_per_s": 1e10}"#;
    let level = format!(r#"{{"all_gather": {c}, "reduce_scatter": {c}, "all_reduce": {c}}}"#);
    let text = format!(
        r#"{{
  "schema": "fsdp-hardware/1", "name": "synthetic", "description": "constructed",
  "ranks_per_node": 8,
  "gemm": {{"f32": {{"peak_flops_per_s": {peak:e}, "points": [{points}], "shapes": [{shapes}]}}}},
  "memory_bandwidth_bytes_per_s": 1e10, "elementwise_flops_per_s": 1e14,
  "collectives": {{"intra_node": {level}, "inter_node": {level}}},
  "host": {{"link_bytes_per_s": 1e10, "optimizer_bytes_per_s": 1e10}},
  "overlap_slowdown": 0{extra}
}}"#
    );
    HardwareProfile::from_json(&text, "synthetic.json")
}

/// The JSON of one grid point.
fn point(layout: &str, m: u64, k: u64, n: u64, rate: f64) -> String {
    format!(r#"{{"m": {m}, "k": {k}, "n": {n}, "layout": "{layout}", "flops_per_s": {rate:e}}}"#)
}

/// A full grid over `dims` for `layout`, each point's rate `rate(m, k, n)`.
fn grid(layout: &str, dims: &[u64], rate: impl Fn(u64, u64, u64) -> f64) -> Vec<String> {
    let mut v = Vec::new();
    for &m in dims {
        for &k in dims {
            for &n in dims {
                v.push(point(layout, m, k, n, rate(m, k, n)));
            }
        }
    }
    v
}

fn shape(m: u64, k: u64, n: u64, layout: GemmLayout) -> GemmShape {
    GemmShape { m, k, n, layout }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs()
}

/// The two-point curve of [`the_shape_factor_is_interpolated_in_log_dimensions`]: 1 GFLOP/s
/// at 1e5 FLOPs, 100 at 1e9, linear in log10(FLOPs) between, clamped outside.
fn curve_rate(f: f64) -> f64 {
    let x = ((f.log10() - 5.0) / 4.0).clamp(0.0, 1.0);
    1e9 + x * (1e11 - 1e9)
}

#[test]
fn the_shape_factor_is_interpolated_in_log_dimensions() {
    // Grid 64 and 1024 per dimension, nn only. The factor of a grid point over the curve:
    // (1 + [m = 1024]) (1 + 2 [k = 1024]) / (1 + [n = 1024]).
    let factor = |m: u64, k: u64, n: u64| {
        let i = |d: u64| if d == 1024 { 1.0 } else { 0.0 };
        (1.0 + i(m)) * (1.0 + 2.0 * i(k)) / (1.0 + i(n))
    };
    let flops = |m: u64, k: u64, n: u64| 2.0 * (m * k * n) as f64;
    let pts = grid("nn", &[64, 1024], |m, k, n| {
        curve_rate(flops(m, k, n)) * factor(m, k, n)
    });
    let p = profile(
        r#"{"flops": 1e5, "flops_per_s": 1e9}, {"flops": 1e9, "flops_per_s": 1e11}"#,
        1e12,
        &pts.join(", "),
    )
    .unwrap();
    let c = p.gemm.f32.as_ref().unwrap();
    // Every grid point runs at its measured rate.
    for m in [64, 1024] {
        for k in [64, 1024] {
            for n in [64, 1024] {
                let want = curve_rate(flops(m, k, n)) * factor(m, k, n);
                let got = c.rate_of(&shape(m, k, n, GemmLayout::Nn));
                assert!(close(got, want), "{m} {k} {n}: {got} vs {want}");
            }
        }
    }
    // m = 256 lies halfway between 64 and 1024 in ln m: the factor is sqrt(1 x 2).
    let got = c.rate_of(&shape(256, 64, 64, GemmLayout::Nn));
    let want = curve_rate(flops(256, 64, 64)) * 2f64.sqrt();
    assert!(close(got, want), "{got} vs {want}");
    // The centre of the cube: the geometric mean of the eight corners, sqrt(2 x 3 / 2).
    let got = c.rate_of(&shape(256, 256, 256, GemmLayout::Nn));
    let want = curve_rate(flops(256, 256, 256)) * 3f64.sqrt();
    assert!(close(got, want), "{got} vs {want}");
    // A quarter of the way in ln k (k = 128): 3^(1/4).
    let got = c.rate_of(&shape(64, 128, 64, GemmLayout::Nn));
    let want = curve_rate(flops(64, 128, 64)) * 3f64.powf(0.25);
    assert!(close(got, want), "{got} vs {want}");
    // Outside the grid each dimension takes its edge's factor, on the curve's rate of the
    // call's own FLOPs: (4096, 1024, 16) -> corner (1024, 1024, 64), factor 6.
    let got = c.rate_of(&shape(4096, 1024, 16, GemmLayout::Nn));
    let want = curve_rate(flops(4096, 1024, 16)) * 6.0;
    assert!(close(got, want), "{got} vs {want}");
    // A layout without grid points runs at the curve's rate.
    for l in [GemmLayout::Nt, GemmLayout::Tn] {
        let got = c.rate_of(&shape(256, 256, 256, l));
        assert!(close(got, curve_rate(flops(256, 256, 256))), "{l:?}: {got}");
    }
    // Seconds are FLOPs over that rate.
    let s = shape(256, 64, 64, GemmLayout::Nn);
    assert!(close(c.seconds_of(&s), s.flops() / c.rate_of(&s)));
}

#[test]
fn the_rate_by_shape_never_passes_the_peak() {
    // nn at 64..1024 runs at 3x the flat curve; the peak is the grid's highest rate. A call
    // whose curve rate is already the highest would pass it with the factor 3.
    let pts = grid("nn", &[64, 1024], |_, _, _| 3e9);
    let p = profile(
        r#"{"flops": 1e5, "flops_per_s": 1e9}, {"flops": 1e12, "flops_per_s": 1.5e9}"#,
        3e9,
        &pts.join(", "),
    )
    .unwrap();
    let c = p.gemm.f32.as_ref().unwrap();
    // 64^3: 5.2e5 FLOPs, curve about 1.02e9; the grid's rate, 3e9, is its own.
    assert!(close(c.rate_of(&shape(64, 64, 64, GemmLayout::Nn)), 3e9));
    // 1e4^3 x 2 = 2e12 FLOPs: curve 1.5e9, factor of the (1024, 1024, 1024) edge 3e9 /
    // curve(2.1e9): 1.5e9 x that is over 3e9, so the peak.
    let big = c.rate_of(&shape(10_000, 10_000, 10_000, GemmLayout::Nn));
    assert_eq!(big, 3e9);
}

/// The ops of one block use, forward and backward (both gradients).
fn block_ops(model: &str, micro_batch: u64, seq_len: u64) -> (Vec<OpCost>, Vec<OpCost>) {
    let spec = preset(model).unwrap();
    let mut c = PlanConfig::new(1);
    c.micro_batch = micro_batch;
    c.seq_len = seq_len;
    let p = plan(&spec, &c).unwrap();
    let s = OpShape {
        micro_batch,
        seq_len,
        dtype: DType::F32,
        attention: flops::AttentionCount::of(ActivationModel::Fused),
    };
    let both = Grads {
        input: true,
        weights: true,
    };
    (
        flops::forward_ops(&p.arch, UseRole::Block, &s).unwrap(),
        flops::backward_ops(&p.arch, UseRole::Block, &s, both).unwrap(),
    )
}

fn shape_of(ops: &[OpCost], name: &str) -> Option<GemmShape> {
    ops.iter()
        .find(|o| o.name == name)
        .unwrap_or_else(|| panic!("no op {name}"))
        .shape
}

#[test]
fn linear_gemms_carry_the_layout_the_engine_runs_them_in() {
    use GemmLayout::{Nn, Nt, Tn};
    // llama-tiny: d 128, 4 heads of 32, 2 KV heads (64 wide), ffn 352; N = 2 x 64 rows.
    // Weights stored [out, in]: forward x W^T (nt), dX = dY W (nn), dW = X^T dY (tn).
    let (f, b) = block_ops("llama-tiny", 2, 64);
    assert_eq!(shape_of(&f, "attn.q_proj"), Some(shape(128, 128, 128, Nt)));
    assert_eq!(shape_of(&f, "attn.k_proj"), Some(shape(128, 128, 64, Nt)));
    assert_eq!(shape_of(&f, "attn.o_proj"), Some(shape(128, 128, 128, Nt)));
    assert_eq!(
        shape_of(&f, "mlp.gate_proj"),
        Some(shape(128, 128, 352, Nt))
    );
    assert_eq!(
        shape_of(&f, "mlp.down_proj"),
        Some(shape(128, 352, 128, Nt))
    );
    assert_eq!(
        shape_of(&b, "mlp.down_proj.dX"),
        Some(shape(128, 128, 352, Nn))
    );
    assert_eq!(
        shape_of(&b, "mlp.down_proj.dW"),
        Some(shape(352, 128, 128, Tn))
    );
    assert_eq!(
        shape_of(&b, "attn.v_proj.dX"),
        Some(shape(128, 64, 128, Nn))
    );
    assert_eq!(
        shape_of(&b, "attn.v_proj.dW"),
        Some(shape(128, 128, 64, Tn))
    );
    // GPT-2 tiny: d 128, Conv1D weights stored [in, out]: forward x W (nn), dX = dY W^T
    // (nt), dW = X^T dY (tn).
    let (f, b) = block_ops("tiny", 2, 64);
    assert_eq!(shape_of(&f, "attn.qkv"), Some(shape(128, 128, 384, Nn)));
    assert_eq!(shape_of(&f, "mlp.proj"), Some(shape(128, 512, 128, Nn)));
    assert_eq!(shape_of(&b, "mlp.fc.dX"), Some(shape(128, 512, 128, Nt)));
    assert_eq!(shape_of(&b, "mlp.fc.dW"), Some(shape(128, 128, 512, Tn)));
    // Every GEMM carries a shape except the attention products; the shape's FLOPs are the
    // op's.
    for o in f.iter().chain(&b).filter(|o| o.kind == OpKind::Gemm) {
        let attention = o.name.starts_with("attn.scores") || o.name.starts_with("attn.context");
        match o.shape {
            Some(s) => {
                assert!(!attention, "{}", o.name);
                assert_eq!(s.flops(), o.flops, "{}", o.name);
            }
            None => assert!(attention, "{}", o.name),
        }
    }
    // The LM head (stored [vocab, d]) of both families: nt forward, nn dX, tn dW.
    for model in ["tiny", "llama-tiny"] {
        let mut c = PlanConfig::new(1);
        c.micro_batch = 1;
        c.seq_len = 64;
        let p = plan(&preset(model).unwrap(), &c).unwrap();
        let s = OpShape {
            micro_batch: 1,
            seq_len: 64,
            dtype: DType::F32,
            attention: flops::AttentionCount::Full,
        };
        let both = Grads {
            input: true,
            weights: true,
        };
        let f = flops::forward_ops(&p.arch, UseRole::Head, &s).unwrap();
        let b = flops::backward_ops(&p.arch, UseRole::Head, &s, both).unwrap();
        assert_eq!(
            shape_of(&f, "lm_head"),
            Some(shape(64, 128, 256, Nt)),
            "{model}"
        );
        assert_eq!(
            shape_of(&b, "lm_head.dX"),
            Some(shape(64, 256, 128, Nn)),
            "{model}"
        );
        assert_eq!(
            shape_of(&b, "lm_head.dW"),
            Some(shape(128, 64, 256, Tn)),
            "{model}"
        );
    }
}

#[test]
fn the_step_model_prices_each_linear_gemm_at_its_layouts_rate() {
    // A flat curve of 2 GFLOP/s; the grid says nn runs at it, nt at half, tn at twice.
    const RATE: f64 = 2e9;
    let dims = [64, 1024];
    let mut pts = grid("nn", &dims, |_, _, _| RATE);
    pts.extend(grid("nt", &dims, |_, _, _| RATE / 2.0));
    pts.extend(grid("tn", &dims, |_, _, _| 2.0 * RATE));
    let prof = profile(
        &format!(r#"{{"flops": 1, "flops_per_s": {RATE:e}}}"#),
        2.0 * RATE,
        &pts.join(", "),
    )
    .unwrap();
    // llama-tiny, W = 1, micro-batch 2 x 64 tokens: N = 128 rows, d 128, q 128, kv 64,
    // ffn 352.
    let mut c = PlanConfig::new(1);
    c.micro_batch = 2;
    c.seq_len = 64;
    let p = plan(&preset("llama-tiny").unwrap(), &c).unwrap();
    let k = p
        .schedule
        .forward
        .iter()
        .position(|s| s.role == UseRole::Block)
        .unwrap();
    let (n, d, q, kv, f) = (128.0, 128.0, 128.0, 64.0, 352.0);
    // The seven projections' FLOPs, one pass.
    let linear = 2.0 * n * (d * q + 2.0 * d * kv + q * d + 3.0 * d * f);
    // The attention products: 2 x 2 hd E per (sequence, head) pair forward, 4 x backward;
    // E = T^2/2 + 32 T = 4096 entries at T = 64 (one row block); 2 sequences x 4 heads.
    let pairs = 2.0 * 4.0;
    let attn_fwd = 2.0 * (2.0 * 32.0 * 4096.0) * pairs;
    let parts = use_compute_parts(&p, &prof).unwrap();
    // Forward: every projection is nt (half rate); the attention runs at the curve.
    let want = linear / (RATE / 2.0) + attn_fwd / RATE;
    let got = parts[k].forward.gemm_s;
    assert!(close(got, want), "forward {got} vs {want}");
    // Backward: dX nn (the rate), dW tn (twice), the attention's four products at the curve.
    let want = linear / RATE + linear / (2.0 * RATE) + 2.0 * attn_fwd / RATE;
    let got = parts[k].backward.gemm_s;
    assert!(close(got, want), "backward {got} vs {want}");
    // The peak bound is the FLOPs at the peak, shape or not.
    let peak_s = (linear + attn_fwd) / (2.0 * RATE);
    assert!(close(parts[k].forward.gemm_peak_s, peak_s));
}

fn refused(points: &[String]) -> String {
    let e = profile(
        r#"{"flops": 1, "flops_per_s": 2e9}"#,
        4e9,
        &points.join(", "),
    )
    .unwrap_err();
    assert!(matches!(e, PlanError::BadProfile { .. }), "{e:?}");
    e.to_string()
}

#[test]
fn a_broken_shape_grid_is_refused_by_its_path() {
    let full = || grid("nt", &[64, 256], |_, _, _| 1e9);
    // One point missing.
    let mut v = full();
    v.remove(3);
    let e = refused(&v);
    assert!(
        e.contains("`gemm.f32.shapes`")
            && e.contains(
                "nt points must cover every (m, k, n) of the grid 64, 256 (8 points), got 7"
            )
            && e.contains("64 x 256 x 256 is missing"),
        "{e}"
    );
    // A point repeated.
    let mut v = full();
    v.push(point("nt", 64, 64, 64, 2e9));
    let e = refused(&v);
    assert!(
        e.contains("`gemm.f32.shapes[8]` repeats shapes[0] (64 x 64 x 64, nt)"),
        "{e}"
    );
    // A dimension of 0, a rate above the peak, a negative rate, an unknown layout.
    let mut v = full();
    v[5] = point("nt", 0, 64, 64, 1e9);
    let e = refused(&v);
    assert!(
        e.contains("`gemm.f32.shapes[5].m` must be positive, got 0"),
        "{e}"
    );
    let mut v = full();
    v[2] = point("nt", 64, 256, 64, 5e9);
    let e = refused(&v);
    assert!(
        e.contains("`gemm.f32.shapes[2].flops_per_s`") && e.contains("exceeds the peak 4000000000"),
        "{e}"
    );
    let mut v = full();
    v[1] = point("nt", 64, 64, 256, -1e9);
    assert!(refused(&v).contains("`gemm.f32.shapes[1].flops_per_s` must be positive"));
    let mut v = full();
    v[0] = point("ntt", 64, 64, 64, 1e9);
    let e = refused(&v);
    assert!(
        e.contains("gemm.f32.shapes[0].layout") && e.contains("nn") && e.contains("tn"),
        "{e}"
    );
    // The full grid loads.
    profile(
        r#"{"flops": 1, "flops_per_s": 2e9}"#,
        4e9,
        &full().join(", "),
    )
    .unwrap();
}

#[test]
fn a_dtype_the_profile_lacks_is_named_with_the_file_it_was_read_from() {
    // The synthetic profile has an f32 curve only; the plan computes in bf16.
    let prof = profile(r#"{"flops": 1, "flops_per_s": 2e9}"#, 2e9, "").unwrap();
    assert_eq!(prof.origin, "synthetic.json");
    let mut c = PlanConfig::new(1);
    c.micro_batch = 1;
    c.seq_len = 64;
    c.param_dtype = DType::BF16;
    let p = plan(&preset("tiny").unwrap(), &c).unwrap();
    let e = use_compute_parts(&p, &prof).unwrap_err().to_string();
    assert!(
        e.contains(
            "hardware profile synthetic.json: `gemm.bf16` is missing: the plan computes in bf16"
        ),
        "{e}"
    );
    // A profile built in memory is named by its name.
    let mut mem = prof.clone();
    mem.origin.clear();
    let e = use_compute_parts(&p, &mem).unwrap_err().to_string();
    assert!(e.contains("hardware profile synthetic: `gemm.bf16`"), "{e}");
}

#[test]
fn a_grid_that_disagrees_with_the_fits_pricing_is_refused() {
    let grid = grid("nt", &[64, 256], |_, _, _| 1e9).join(", ");
    let fit = |pricing: &str| {
        format!(
            r#""compute_fit": {{"f32": {{"gemm_scale": 1.2, "elementwise_scale": 1, "op_overhead_s": 0, "rms_relative_error": 0.01, "samples": 9, "gemm_pricing": "{pricing}"}}}}"#
        )
    };
    let with = |shapes: &str, pricing: &str| {
        profile_with(
            r#"{"flops": 1, "flops_per_s": 2e9}"#,
            4e9,
            shapes,
            &format!(", {}", fit(pricing)),
        )
    };
    // Agreeing: a grid with a fit by shape, none with a fit by size.
    with(&grid, "shape").unwrap();
    with("", "size").unwrap();
    // The grid removed after a fit by shape: its scale would price GEMMs by size.
    let e = with("", "shape").unwrap_err().to_string();
    assert!(
        e.contains("`compute_fit.f32.gemm_pricing` is \"shape\" but `gemm.f32.shapes` is empty"),
        "{e}"
    );
    // A grid added after a fit by size.
    let e = with(&grid, "size").unwrap_err().to_string();
    assert!(
        e.contains("`compute_fit.f32.gemm_pricing` is \"size\" but `gemm.f32.shapes` holds a grid"),
        "{e}"
    );
}

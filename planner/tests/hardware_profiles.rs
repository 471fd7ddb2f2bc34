//! Hardware profiles: the built-in ones parse, validate and cite a source for every number;
//! a bad profile is refused with the JSON path of the field; a number outside the plausible
//! range of its kind is refused naming the path, the value and the range, while the bounds
//! themselves load; an unknown name lists the built-in ones; the GEMM curve interpolates in
//! log FLOPs.

use fsdp_planner::time::{builtin_profile, HardwareProfile, BUILTIN_PROFILE_NAMES};
use fsdp_planner::PlanError;
use serde_json::Value;

const H100: &str = include_str!("../profiles/h100-sxm.json");

fn refused(v: &Value) -> String {
    let e = HardwareProfile::from_json(&v.to_string(), "test.json").unwrap_err();
    assert!(matches!(e, PlanError::BadProfile { .. }), "{e:?}");
    let e = e.to_string();
    // Every refusal says how to get a good profile.
    assert!(e.ends_with("with `fsdp calibrate -o FILE`"), "{e}");
    e
}

fn h100() -> Value {
    serde_json::from_str(H100).unwrap()
}

#[test]
fn built_in_profiles_parse_and_cite_every_number() {
    for name in BUILTIN_PROFILE_NAMES {
        let p = builtin_profile(name).unwrap();
        assert_eq!(p.name, name);
        for path in p.numeric_paths() {
            let src = p
                .sources
                .get(&path)
                .unwrap_or_else(|| panic!("{name}: no source for {path}"));
            assert!(src.contains("https://"), "{name}: {path}: {src}");
        }
        // Every curve stays under its peak and rises with size.
        for c in [&p.gemm.bf16, &p.gemm.f16, &p.gemm.f32, &p.gemm.f64]
            .into_iter()
            .flatten()
        {
            assert!(c
                .points
                .windows(2)
                .all(|w| w[1].flops_per_s > w[0].flops_per_s));
        }
    }
    // Vendor dense BF16 peaks: 989.4 TFLOP/s (H100, H200), 312 (A100).
    assert_eq!(
        builtin_profile("h100-sxm")
            .unwrap()
            .gemm
            .bf16
            .unwrap()
            .peak_flops_per_s,
        989.4e12
    );
    assert_eq!(
        builtin_profile("a100-80gb")
            .unwrap()
            .gemm
            .bf16
            .unwrap()
            .peak_flops_per_s,
        312e12
    );
}

#[test]
fn unknown_hardware_lists_the_built_in_names() {
    let e = builtin_profile("h300").unwrap_err().to_string();
    for n in ["h300", "h100-sxm", "h200", "a100-80gb", "path"] {
        assert!(e.contains(n), "{e}");
    }
}

#[test]
fn a_missing_number_is_named_by_its_path() {
    let mut v = h100();
    v["collectives"]["intra_node"]["all_gather"]
        .as_object_mut()
        .unwrap()
        .remove("latency_s");
    let e = refused(&v);
    assert!(
        e.contains("`collectives.intra_node.all_gather.latency_s` is missing"),
        "{e}"
    );
    let mut v = h100();
    v.as_object_mut().unwrap().remove("overlap_slowdown");
    let e = refused(&v);
    assert!(e.contains("`overlap_slowdown` is missing"), "{e}");
    assert!(e.contains("test.json"), "{e}");
}

#[test]
fn negative_and_zero_numbers_are_named() {
    let mut v = h100();
    v["host"]["link_bytes_per_s"] = (-1.0).into();
    let e = refused(&v);
    assert!(
        e.contains("`host.link_bytes_per_s` must be positive, got -1"),
        "{e}"
    );
    let mut v = h100();
    v["collectives"]["inter_node"]["reduce_scatter"]["step_latency_s"] = (-0.5).into();
    let e = refused(&v);
    assert!(
        e.contains("`collectives.inter_node.reduce_scatter.step_latency_s` must not be negative"),
        "{e}"
    );
    let mut v = h100();
    v["gemm"]["bf16"]["points"][3]["flops_per_s"] = 0.0.into();
    let e = refused(&v);
    assert!(
        e.contains("`gemm.bf16.points[3].flops_per_s` must be positive"),
        "{e}"
    );
    let mut v = h100();
    v["ranks_per_node"] = 0.into();
    assert!(refused(&v).contains("`ranks_per_node` must be at least 1"));
}

#[test]
fn a_non_finite_number_is_named() {
    // JSON has no infinity: a number too large for f64 is the way one arrives.
    let text = h100().to_string().replace(
        "\"memory_bandwidth_bytes_per_s\":3350000000000.0",
        "\"memory_bandwidth_bytes_per_s\":1e400",
    );
    assert!(text.contains("1e400"));
    let e = HardwareProfile::from_json(&text, "test.json")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`memory_bandwidth_bytes_per_s` is not a finite number"),
        "{e}"
    );
    // A profile built in code (as a calibration would) is checked the same way.
    let mut p = builtin_profile("h200").unwrap();
    p.overlap_slowdown = f64::NAN;
    let e = p.validate("calibrated").unwrap_err().to_string();
    assert!(
        e.contains("`overlap_slowdown` is not a finite number"),
        "{e}"
    );
}

/// A copy of the H100 profile with one edit.
fn edited(edit: impl Fn(&mut Value)) -> Value {
    let mut v = h100();
    edit(&mut v);
    v
}

#[test]
fn implausible_numbers_are_refused_naming_path_value_and_range() {
    let cases: Vec<(Value, &str)> = vec![
        (
            edited(|v| v["elementwise_flops_per_s"] = 1e-300.into()),
            "`elementwise_flops_per_s` is 1e-300, outside the plausible range of a FLOP rate, \
             1e6..1e18 FLOP/s",
        ),
        (
            edited(|v| v["overlap_slowdown"] = 1e9.into()),
            "`overlap_slowdown` is 1e9, outside the plausible range of a slowdown, 0..10 ",
        ),
        (
            edited(|v| v["overlap_slowdown"] = 10.5.into()),
            "`overlap_slowdown` is 10.5, outside the plausible range of a slowdown, 0..10 ",
        ),
        (
            edited(|v| v["gemm"]["bf16"]["peak_flops_per_s"] = 2e18.into()),
            "`gemm.bf16.peak_flops_per_s` is 2e18, outside the plausible range of a FLOP rate, \
             1e6..1e18 FLOP/s",
        ),
        (
            edited(|v| v["gemm"]["f32"]["points"][0]["flops_per_s"] = 5e5.into()),
            "`gemm.f32.points[0].flops_per_s` is 500000, outside the plausible range of a FLOP \
             rate, 1e6..1e18 FLOP/s",
        ),
        (
            edited(|v| v["gemm"]["bf16"]["points"][7]["flops"] = 1e21.into()),
            "`gemm.bf16.points[7].flops` is 1e21, outside the plausible range of the FLOPs of \
             one GEMM call, 1..1e20 FLOPs",
        ),
        (
            edited(|v| v["gemm"]["bf16"]["points"][0]["flops"] = 0.5.into()),
            "`gemm.bf16.points[0].flops` is 0.5, outside the plausible range of the FLOPs of \
             one GEMM call, 1..1e20 FLOPs",
        ),
        (
            edited(|v| v["memory_bandwidth_bytes_per_s"] = 2e15.into()),
            "`memory_bandwidth_bytes_per_s` is 2e15, outside the plausible range of a \
             bandwidth, 1e6..1e15 bytes/s",
        ),
        (
            edited(|v| {
                v["collectives"]["inter_node"]["all_gather"]["bus_bandwidth_bytes_per_s"] =
                    999_999.0.into()
            }),
            "`collectives.inter_node.all_gather.bus_bandwidth_bytes_per_s` is 999999, outside \
             the plausible range of a bandwidth, 1e6..1e15 bytes/s",
        ),
        (
            edited(|v| v["host"]["optimizer_bytes_per_s"] = 1e300.into()),
            "`host.optimizer_bytes_per_s` is 1e300, outside the plausible range of a \
             bandwidth, 1e6..1e15 bytes/s",
        ),
        (
            // Ten milliseconds written as seconds x 1000.
            edited(|v| v["collectives"]["intra_node"]["all_reduce"]["latency_s"] = 10.0.into()),
            "`collectives.intra_node.all_reduce.latency_s` is 10, outside the plausible range \
             of a latency, 0..1 s",
        ),
        (
            edited(|v| {
                v["collectives"]["inter_node"]["reduce_scatter"]["step_latency_s"] = 1.5.into()
            }),
            "`collectives.inter_node.reduce_scatter.step_latency_s` is 1.5, outside the \
             plausible range of a latency, 0..1 s",
        ),
        (
            edited(|v| v["rank_skew"] = (-0.1).into()),
            "`rank_skew` must not be negative, got -0.1; a rank skew is plausible in 0..1",
        ),
        (
            edited(|v| v["rank_skew"] = 1.5.into()),
            "`rank_skew` is 1.5, outside the plausible range of a rank skew, 0..1",
        ),
        (
            edited(|v| v["ranks_per_node"] = 1025.into()),
            "`ranks_per_node` is 1025, outside the plausible range of a rank count, 1..1024",
        ),
    ];
    for (v, needle) in cases {
        let e = refused(&v);
        assert!(e.contains(needle), "expected `{needle}` in: {e}");
        assert!(e.contains("test.json"), "{e}");
    }
}

#[test]
fn numbers_on_the_plausible_bounds_load() {
    let v = edited(|v| {
        v["elementwise_flops_per_s"] = 1e6.into();
        v["overlap_slowdown"] = 10.0.into();
        v["rank_skew"] = 1.0.into();
        v["ranks_per_node"] = 1024.into();
        v["memory_bandwidth_bytes_per_s"] = 1e15.into();
        v["host"]["link_bytes_per_s"] = 1e6.into();
        v["collectives"]["intra_node"]["all_gather"]["latency_s"] = 1.0.into();
        v["collectives"]["intra_node"]["all_gather"]["step_latency_s"] = 0.0.into();
        v["gemm"]["bf16"]["peak_flops_per_s"] = 1e18.into();
        v["gemm"]["bf16"]["points"][0]["flops"] = 1.0.into();
        v["gemm"]["bf16"]["points"][7]["flops"] = 1e20.into();
    });
    let p = HardwareProfile::from_json(&v.to_string(), "bounds.json").unwrap();
    assert_eq!(p.overlap_slowdown, 10.0);
    assert_eq!(p.rank_skew, 1.0);
    assert_eq!(p.ranks_per_node, 1024);
    assert_eq!(p.gemm.bf16.unwrap().points[7].flops, 1e20);
}

#[test]
fn curves_must_rise_in_size_and_stay_under_the_peak() {
    let mut v = h100();
    // One percent above the f32 peak (66.9 TFLOP/s).
    v["gemm"]["f32"]["points"][7]["flops_per_s"] = (66.9e12 * 1.01).into();
    let e = refused(&v);
    assert!(
        e.contains("`gemm.f32.points[7].flops_per_s`") && e.contains("exceeds the peak"),
        "{e}"
    );
    let mut v = h100();
    v["gemm"]["bf16"]["points"][2]["flops"] = 1.0.into();
    let e = refused(&v);
    assert!(e.contains("`gemm.bf16.points[2].flops` must exceed"), "{e}");
    let mut v = h100();
    v["gemm"]["bf16"]["points"] = Value::Array(vec![]);
    assert!(refused(&v).contains("`gemm.bf16.points` needs at least one point"));
}

#[test]
fn unknown_fields_wrong_types_and_schemas_are_named() {
    let mut v = h100();
    v["host"]["link_bytes_per_sec"] = 1.0.into();
    let e = refused(&v);
    assert!(
        e.contains("`host.link_bytes_per_sec` is not a profile field")
            && e.contains("link_bytes_per_s"),
        "{e}"
    );
    let mut v = h100();
    v["elementwise_flops_per_s"] = "fast".into();
    let e = refused(&v);
    assert!(
        e.contains("`elementwise_flops_per_s` has the wrong type"),
        "{e}"
    );
    let mut v = h100();
    v["schema"] = "fsdp-hardware/2".into();
    assert!(refused(&v).contains("`schema` is `fsdp-hardware/2`, expected `fsdp-hardware/1`"));
    let e = HardwareProfile::from_json("{\"schema\": ", "cut.json")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cut.json") && e.contains("not valid JSON"),
        "{e}"
    );
    // Valid JSON of the wrong shape is named as such, not as invalid JSON.
    let e = HardwareProfile::from_json("[1, 2]", "list.json")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("list.json")
            && e.contains("must be one JSON object with the profile's fields, got an array")
            && !e.contains("not valid JSON"),
        "{e}"
    );
    // Text after the profile (a second profile pasted below it) is refused, not ignored.
    for tail in ["\n{\"name\": \"OTHER\"}", " xyz", "[1]"] {
        let e = HardwareProfile::from_json(&format!("{H100}{tail}"), "two.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("two.json") && e.contains("has text after the profile's closing brace"),
            "{tail:?}: {e}"
        );
    }
    // A byte-order mark before the profile is read past; trailing white space is fine.
    let p = HardwareProfile::from_json(&format!("\u{feff}{H100}\n\n"), "bom.json").unwrap();
    assert_eq!(p.name, "h100-sxm");
    // A blank name, or one with a control character (a terminal escape), is refused.
    for name in ["", "  ", "a\nb", "x\u{1b}[31m"] {
        let mut v = h100();
        v["name"] = name.into();
        let e = refused(&v);
        assert!(
            e.contains("`name` is") && e.contains("visible character"),
            "{e}"
        );
    }
    // A NaN (Python's json.dump writes one) is named.
    let text = H100.replacen("\"overlap_slowdown\": 0.12", "\"overlap_slowdown\": NaN", 1);
    assert_ne!(text, H100);
    let e = HardwareProfile::from_json(&text, "nan.json")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("not valid JSON") && e.contains("`NaN` is not a JSON number"),
        "{e}"
    );
}

#[test]
fn the_gemm_rate_is_linear_in_log_flops() {
    let p = HardwareProfile::from_json(
        &H100.replace("\"name\": \"h100-sxm\"", "\"name\": \"x\""),
        "x",
    )
    .unwrap();
    let c = p.gemm.bf16.unwrap();
    let (a, b) = (c.points[3], c.points[4]);
    // Halfway in log10 between 1e9 and 1e10 is 10^9.5.
    let mid = 10f64.powf(9.5);
    let expected = (a.flops_per_s + b.flops_per_s) / 2.0;
    assert!((c.rate(mid) - expected).abs() <= 1e-6 * expected);
    // Clamped at both ends.
    assert_eq!(c.rate(1.0), c.points[0].flops_per_s);
    assert_eq!(c.rate(1e20), c.points[7].flops_per_s);
    assert_eq!(c.seconds(0.0), 0.0);
}

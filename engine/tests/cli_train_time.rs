//! `fsdp train --hardware`: the summary's predicted and measured step time with the error, the
//! measured tokens/s and MFU (only with a profile: never a guessed peak).

use fsdp_planner::time::{builtin_profile, predict, TimeInputs};
use fsdp_planner::{preset, PlanConfig};
use serde_json::Value;
use std::process::{Command, Output};

fn fsdp_train(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .arg("train")
        .args(args)
        .output()
        .expect("run fsdp")
}

const RUN: [&str; 12] = [
    "--model",
    "tiny",
    "--world-size",
    "2",
    "--steps",
    "4",
    "--micro-batch",
    "2",
    "--seq-len",
    "32",
    "--eval-batches",
    "1",
];

#[test]
fn train_hardware_summary_compares_median_step_with_the_prediction() {
    let mut args = RUN.to_vec();
    args.extend(["--hardware", "a100-80gb", "--json"]);
    let o = fsdp_train(&args);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let lines: Vec<Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let steps: Vec<f64> = lines
        .iter()
        .filter(|v| v.get("step_seconds").is_some() && v.get("summary").is_none())
        .map(|v| v["step_seconds"].as_f64().unwrap())
        .collect();
    assert_eq!(steps.len(), 4);
    let summary = lines.iter().find(|v| v["summary"] == true).unwrap();
    let t = &summary["step_time"];
    // The median of steps 2..4 (3 values: the middle one).
    let mut rest = steps[1..].to_vec();
    rest.sort_by(f64::total_cmp);
    let measured = rest[1];
    assert_eq!(t["measured_step_s"].as_f64(), Some(measured));
    assert_eq!(t["measured_steps"], 3);
    assert_eq!(t["first_step_excluded"], true);
    // The prediction of the same plan: tiny, W = 2, full shard, 2 x 32 tokens, f32, clip on.
    let cfg = PlanConfig {
        micro_batch: 2,
        seq_len: 32,
        ..PlanConfig::new(2)
    };
    let p = fsdp_planner::plan(&preset("tiny").unwrap(), &cfg).unwrap();
    let want = predict(
        &p,
        &builtin_profile("a100-80gb").unwrap(),
        &TimeInputs::default(),
    )
    .unwrap();
    let predicted = t["predicted_step_s"].as_f64().unwrap();
    assert!((predicted - want.step_s).abs() <= 1e-14 * want.step_s);
    let err = t["step_time_error"].as_f64().unwrap();
    assert!((err - (measured / want.step_s - 1.0)).abs() <= 1e-12 * err.abs().max(1.0));
    // MFU against the A100's dense f32 peak from the profile.
    let peak = t["peak_flops_per_s"].as_f64().unwrap();
    assert_eq!(peak, want.peak_flops_per_s);
    let mfu = t["mfu"].as_f64().unwrap();
    let expect = want.model_flops_per_step / (measured * 2.0 * peak);
    assert!((mfu - expect).abs() <= 1e-12 * expect, "{mfu} vs {expect}");
    // Tokens per step: W * B * T = 2 * 2 * 32.
    let tps = t["measured_tokens_per_s"].as_f64().unwrap();
    assert!((tps - 128.0 / measured).abs() <= 1e-9 * tps);
}

#[test]
fn train_summary_prints_mfu_only_with_a_profile() {
    let o = fsdp_train(&RUN);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!out.contains("MFU"), "{out}");
    let mut args = RUN.to_vec();
    args.extend(["--hardware", "h100-sxm"]);
    let o = fsdp_train(&args);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("step time on h100-sxm: predicted "), "{out}");
    assert!(
        out.contains("median of 3 steps, the first excluded"),
        "{out}"
    );
    assert!(out.contains("MFU "), "{out}");
    assert!(out.contains("PaLM"), "{out}");
}

#[test]
fn train_refuses_an_unknown_hardware_before_training() {
    let mut args = RUN.to_vec();
    args.extend(["--hardware", "tpu-v9"]);
    let o = fsdp_train(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("unknown hardware `tpu-v9`"), "{err}");
    assert!(err.contains("h100-sxm, h200, a100-80gb"), "{err}");
}

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
    // The A100's numbers in a profile that says it was calibrated on this kind of host (a
    // GPU profile against a CPU run gives no error or MFU).
    let d = tempfile::tempdir().unwrap();
    let mut prof = builtin_profile("a100-80gb").unwrap();
    prof.name = "calibrated-here".into();
    prof.description = "here: 2 rank threads of 1 compute threads, measured by fsdp calibrate \
                        on 2026-01-01"
        .into();
    prof.ranks_per_node = 2;
    let file = d.path().join("here.json");
    std::fs::write(&file, serde_json::to_string(&prof).unwrap()).unwrap();
    let mut args = RUN.to_vec();
    args.extend(["--hardware", file.to_str().unwrap(), "--json"]);
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
    let want = predict(&p, &prof, &TimeInputs::default()).unwrap();
    assert_eq!(t["profile_of_another_device"], false);
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
    // HFU: the FLOPs the step computes (the prediction's count) over the same time and peak.
    let hfu = t["hfu"].as_f64().unwrap();
    let expect = want.hardware_flops_per_step / (measured * 2.0 * peak);
    assert!((hfu - expect).abs() <= 1e-12 * expect, "{hfu} vs {expect}");
    // Tokens per step: W * B * T = 2 * 2 * 32.
    let tps = t["measured_tokens_per_s"].as_f64().unwrap();
    assert!((tps - 128.0 / measured).abs() <= 1e-9 * tps);
}

#[test]
fn train_summary_states_the_predicted_wait_for_the_slowest_rank() {
    // The A100 profile with a rank skew of 0.25, as a file.
    let d = tempfile::tempdir().unwrap();
    let mut prof = builtin_profile("a100-80gb").unwrap();
    prof.rank_skew = 0.25;
    let path = d.path().join("skewed.json");
    std::fs::write(&path, serde_json::to_string(&prof).unwrap()).unwrap();
    let cfg = PlanConfig {
        micro_batch: 2,
        seq_len: 32,
        ..PlanConfig::new(2)
    };
    let p = fsdp_planner::plan(&preset("tiny").unwrap(), &cfg).unwrap();
    let want = predict(&p, &prof, &TimeInputs::default()).unwrap();
    assert!(want.skew_wait_s > 0.0);
    let mut args = RUN.to_vec();
    args.extend(["--hardware", path.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&fsdp_train(&args).stdout).to_string();
    assert!(
        text.contains(&format!(
            "({} of it waiting for the slowest rank)",
            fsdp_planner::time::format_seconds(want.skew_wait_s)
        )),
        "{text}"
    );
    args.push("--json");
    let o = fsdp_train(&args);
    let summary: Value = String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["summary"] == true)
        .unwrap();
    let t = &summary["step_time"];
    // The profile went through JSON: equal to the last bits that text keeps.
    let near = |v: &Value, want: f64| (v.as_f64().unwrap() - want).abs() <= 1e-12 * want;
    assert!(near(&t["predicted_skew_wait_s"], want.skew_wait_s), "{t}");
    assert!(
        near(&t["predicted_exposed_comm_s"], want.exposed_comm_s),
        "{t}"
    );
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
    // A profile of this kind of device (one `fsdp calibrate` wrote: a CPU's).
    let d = tempfile::tempdir().unwrap();
    let mut p = builtin_profile("h100-sxm").unwrap();
    p.name = "calibrated-here".into();
    p.description = "here: 2 rank threads of 1 compute threads, measured by fsdp calibrate on \
                     2026-01-01"
        .into();
    let file = d.path().join("cpu.json");
    std::fs::write(&file, serde_json::to_string(&p).unwrap()).unwrap();
    let mut args = RUN.to_vec();
    args.extend(["--hardware", file.to_str().unwrap()]);
    let o = fsdp_train(&args);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        out.contains("step time on calibrated-here: predicted "),
        "{out}"
    );
    assert!(
        out.contains("median of 3 steps, the first excluded"),
        "{out}"
    );
    assert!(out.contains("MFU "), "{out}");
    assert!(out.contains("PaLM"), "{out}");
    assert!(
        out.contains("| HFU ") && out.contains("(the FLOPs computed: recompute included"),
        "{out}"
    );
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

/// A100 figures with collectives 10^5 times slower (100 ms per call, 3 MB/s): communication
/// dominates every step, so a plan that communicates less wins even when it recomputes.
fn slow_network_profile(dir: &std::path::Path) -> (fsdp_planner::time::HardwareProfile, String) {
    let mut p = builtin_profile("a100-80gb").unwrap();
    p.name = "slow-network".into();
    p.description = "A100 compute, collectives 10^5 times slower than NVLink".into();
    for link in [&mut p.collectives.intra_node, &mut p.collectives.inter_node] {
        for c in [
            &mut link.all_gather,
            &mut link.reduce_scatter,
            &mut link.all_reduce,
        ] {
            c.latency_s = 0.1;
            c.bus_bandwidth_bytes_per_s = 3e6;
        }
    }
    let path = dir.join("slow-network.json");
    std::fs::write(&path, serde_json::to_string_pretty(&p).unwrap()).unwrap();
    (p, path.to_str().unwrap().to_string())
}

#[test]
fn train_auto_with_hardware_runs_the_plan_with_the_shortest_predicted_step() {
    use fsdp_planner::{Offload, Strategy};
    let d = tempfile::tempdir().unwrap();
    let (profile, file) = slow_network_profile(d.path());
    let spec = preset("tiny").unwrap();
    // The run's plan configuration: tiny, W = 2, 2 x 32 tokens; on the CPU auto never
    // offloads (the device is host memory).
    let cfg = |s: Strategy, ckpt: Option<bool>| PlanConfig {
        strategy: s,
        micro_batch: 2,
        seq_len: 32,
        activation_checkpointing: ckpt,
        offload: Some(Offload::None),
        ..PlanConfig::new(2)
    };
    // The budget: full shard's peak without recompute, the least of the four strategies
    // without it; with recompute every strategy fits.
    let budget = fsdp_planner::plan(&spec, &cfg(Strategy::FullShard, None))
        .unwrap()
        .memory
        .peak;
    // Every candidate auto considers at W = 2, planned and predicted one by one.
    let mut fitting = Vec::new();
    for ckpt in [None, Some(true)] {
        for s in [
            Strategy::NoShard,
            Strategy::ShardOptimizer,
            Strategy::ShardGradOp,
            Strategy::FullShard,
        ] {
            let p = fsdp_planner::plan(&spec, &cfg(s, ckpt)).unwrap();
            if p.memory.peak <= budget {
                let t = predict(&p, &profile, &TimeInputs::default())
                    .unwrap()
                    .step_s;
                fitting.push((t, s, ckpt == Some(true)));
            }
        }
    }
    // The first of equal predictions is the fixed order's.
    let best = fitting
        .iter()
        .fold(None::<&(f64, Strategy, bool)>, |b, c| match b {
            Some(b) if b.0 <= c.0 => Some(b),
            _ => Some(c),
        })
        .unwrap();
    // Without a profile auto takes the first that fits in the fixed order: another plan.
    let mut fixed_cfg = cfg(Strategy::Auto, None);
    fixed_cfg.device_memory = Some(budget);
    let fixed = fsdp_planner::plan(&spec, &fixed_cfg).unwrap();
    assert!(
        (fixed.strategy, fixed.schedule.activation_checkpointing) != (best.1, best.2),
        "the case must tell the orders apart: fixed {} vs fastest {} ({fitting:?})",
        fixed.strategy,
        best.1
    );
    let budget_flag = budget.0.to_string();
    let mut args = RUN.to_vec();
    args.extend([
        "--strategy",
        "auto",
        "--device-memory",
        &budget_flag,
        "--hardware",
        &file,
        "--json",
    ]);
    let o = fsdp_train(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let summary: Value = String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["summary"] == true)
        .unwrap();
    assert_eq!(summary["strategy"], best.1.to_string(), "{summary}");
    assert_eq!(summary["activation_checkpointing"], best.2, "{summary}");
    let ranking = &summary["auto_ranking"];
    assert_eq!(ranking["hardware"], "slow-network");
    assert_eq!(ranking["fitting"], fitting.len());
    let chosen = ranking["chosen"]["predicted_step_s"].as_f64().unwrap();
    assert!(
        (chosen - best.0).abs() <= 1e-12 * best.0,
        "{chosen} vs {}",
        best.0
    );
    // The runner-up: the second shortest prediction.
    let mut times: Vec<f64> = fitting.iter().map(|f| f.0).collect();
    times.sort_by(f64::total_cmp);
    let second = ranking["runner_up"]["predicted_step_s"].as_f64().unwrap();
    assert!((second - times[1]).abs() <= 1e-12 * times[1], "{ranking}");
    let reason = summary["auto_reason"].as_str().unwrap();
    assert!(
        reason.contains("shortest predicted step on slow-network"),
        "{reason}"
    );
    // `fsdp plan --strategy auto --hardware` picks the same for the same flags.
    let plan = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args([
            "plan",
            "--model",
            "tiny",
            "--world-size",
            "2",
            "--micro-batch",
            "2",
            "--seq-len",
            "32",
            "--offload",
            "none",
            "--strategy",
            "auto",
            "--device-memory",
            &budget_flag,
            "--hardware",
            &file,
            "--format",
            "json",
        ])
        .output()
        .unwrap();
    assert_eq!(
        plan.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&plan.stderr)
    );
    let doc: Value = serde_json::from_slice(&plan.stdout).unwrap();
    assert_eq!(
        doc["strategy"]["name"],
        best.1.cli_name(),
        "{}",
        doc["strategy"]
    );
    assert_eq!(doc["strategy"]["activation_checkpointing"], best.2);
}

#[test]
fn train_hardware_of_a_gpu_on_the_cpu_says_what_it_compares() {
    let d = tempfile::tempdir().unwrap();
    let mut short = RUN.to_vec();
    short[5] = "2";
    let note = "note: the h100-sxm profile describes a GPU; this run computes on the CPU: the \
                prediction is of that hardware, not of this run";
    let mut args = short.clone();
    args.extend(["--hardware", "h100-sxm"]);
    let o = fsdp_train(&args);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_eq!(err.matches(note).count(), 1, "{err}");
    // Both step times are printed, but no error or MFU against another machine.
    assert!(
        out.contains("step time: predicted ")
            && out.contains(
                "on h100-sxm (another kind of device: no error or MFU against this run), measured "
            ),
        "{out}"
    );
    assert!(!out.contains("| MFU") && !out.contains("%; "), "{out}");
    // Nor in the JSON summary: both step times, the error and MFU null.
    args.push("--json");
    let o = fsdp_train(&args);
    assert_eq!(o.status.code(), Some(0));
    let line = String::from_utf8_lossy(&o.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .to_string();
    let st = &serde_json::from_str::<serde_json::Value>(&line).expect("JSON summary")["step_time"];
    assert_eq!(st["profile_of_another_device"], true, "{st}");
    assert!(st["predicted_step_s"].as_f64().unwrap() > 0.0, "{st}");
    assert!(st["measured_step_s"].as_f64().unwrap() > 0.0, "{st}");
    assert!(
        st["step_time_error"].is_null() && st["mfu"].is_null() && st["hfu"].is_null(),
        "{st}"
    );
    // A profile calibrated on a CPU at the run's world size describes this run: no note.
    let mut p = builtin_profile("a100-80gb").unwrap();
    p.name = "calibrated-here".into();
    p.description = "here: 2 rank threads of 1 compute threads, measured by fsdp calibrate on \
                     2026-01-01"
        .into();
    p.ranks_per_node = 2;
    let file = d.path().join("cpu.json");
    std::fs::write(&file, serde_json::to_string(&p).unwrap()).unwrap();
    let mut args = short.clone();
    args.extend(["--hardware", file.to_str().unwrap()]);
    let o = fsdp_train(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(!err.contains("note: the"), "{err}");
    // Calibrated with 4 rank threads, used by 2: one note saying how to calibrate for 2.
    p.ranks_per_node = 4;
    std::fs::write(&file, serde_json::to_string(&p).unwrap()).unwrap();
    let o = fsdp_train(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_eq!(
        err.matches("note: the calibrated-here profile was calibrated with 4 rank thread(s)")
            .count(),
        1,
        "{err}"
    );
    assert!(err.contains("`fsdp calibrate --world-size 2`"), "{err}");
}

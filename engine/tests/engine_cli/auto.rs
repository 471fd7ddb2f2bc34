//! `fsdp train --strategy auto --device-memory B` against `fsdp plan --strategy auto
//! --device-memory B` on the same flags: the same strategy, activation checkpointing, per-rank
//! peak and reason, shard-optimizer included; a run's losses equal the explicit strategy's bit
//! for bit; resuming a checkpoint with auto continues exactly; a budget
//! nothing fits is refused with exit 2 and the numbers.
//!
//! Budgets: each candidate's own plan peak (tiny, W = 2, seq 32, micro-batch 2), read from
//! `fsdp plan`, so the test follows the planner's memory model as it changes.

use super::{data, fsdp};
use serde_json::Value;

const FLAGS: [&str; 8] = [
    "--model",
    "tiny",
    "--world-size",
    "2",
    "--seq-len",
    "32",
    "--micro-batch",
    "2",
];

fn plan_json(extra: &[&str]) -> Value {
    let out = fsdp()
        .arg("plan")
        .args(FLAGS)
        .args(["--format", "json"])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Runs `fsdp train` with `--json`; returns (exit code, step lines, summary, stderr).
fn train(steps: u64, extra: &[&str]) -> (i32, Vec<Value>, Option<Value>, String) {
    let out = fsdp()
        .arg("train")
        .args(FLAGS)
        .args(["--data", &data(), "--steps", &steps.to_string()])
        .args(["--warmup", "1", "--eval-batches", "1", "--json"])
        .args(extra)
        .output()
        .unwrap();
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        // Checkpoint saves are reported as `{"event": "checkpoint", ...}` lines.
        .filter(|v| v.get("event").is_none())
        .collect();
    let (summary, steps): (Vec<Value>, Vec<Value>) =
        lines.into_iter().partition(|l| l["summary"] == true);
    (
        out.status.code().unwrap_or(-1),
        steps,
        summary.into_iter().next(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn losses(steps: &[Value]) -> Vec<u64> {
    steps
        .iter()
        .map(|s| s["loss"].as_f64().unwrap().to_bits())
        .collect()
}

fn peak(strategy: &str, ckpt: &str) -> u64 {
    plan_json(&["--strategy", strategy, "--activation-checkpointing", ckpt])["memory"]["peak"]
        ["bytes"]
        .as_u64()
        .unwrap()
}

/// The candidates of auto at W = 2 in the planner's order: every strategy without activation
/// checkpointing, then every one with it.
const ORDER: [(&str, bool); 8] = [
    ("no-shard", false),
    ("shard-optimizer", false),
    ("shard-grad-op", false),
    ("full-shard", false),
    ("no-shard", true),
    ("shard-optimizer", true),
    ("shard-grad-op", true),
    ("full-shard", true),
];

/// The last resort of auto at W = 2, in the planner's order: `(offload, activation
/// checkpointing, strategy)`, the optimizer offloaded before the parameters, each without
/// checkpointing first, then with it.
const OFFLOAD_ORDER: [(&str, bool, &str); 10] = [
    ("optimizer", false, "shard-optimizer"),
    ("optimizer", false, "shard-grad-op"),
    ("optimizer", false, "full-shard"),
    ("optimizer", true, "shard-optimizer"),
    ("optimizer", true, "shard-grad-op"),
    ("optimizer", true, "full-shard"),
    ("params", false, "shard-grad-op"),
    ("params", false, "full-shard"),
    ("params", true, "shard-grad-op"),
    ("params", true, "full-shard"),
];

fn peaks() -> Vec<u64> {
    ORDER
        .iter()
        .map(|(s, ac)| peak(s, if *ac { "on" } else { "off" }))
        .collect()
}

#[test]
fn auto_picks_what_plan_auto_picks_and_reports_it() {
    let peaks = peaks();
    let mut saw_shard_optimizer = false;
    let mut picked = std::collections::BTreeSet::new();
    // Every candidate's own peak as the budget: that candidate or a faster one fits exactly.
    for &budget in &peaks {
        let b = budget.to_string();
        let ((want, want_ac), want_peak) = ORDER
            .iter()
            .zip(&peaks)
            .find(|(_, p)| **p <= budget)
            .map(|(c, p)| (*c, *p))
            .unwrap();
        let p = plan_json(&["--strategy", "auto", "--device-memory", &b]);
        assert_eq!(p["strategy"]["name"], want, "the planner's search: {b}");
        assert_eq!(p["strategy"]["activation_checkpointing"], want_ac, "{b}");
        let (code, steps, summary, err) = train(1, &["--strategy", "auto", "--device-memory", &b]);
        assert_eq!(code, 0, "budget {b}: {err}");
        assert_eq!(steps.len(), 1, "budget {b}");
        let s = summary.expect("a summary line");
        assert_eq!(s["strategy"], want, "budget {b}: {s}");
        assert_eq!(s["strategy_requested"], "auto", "{s}");
        assert_eq!(s["activation_checkpointing"], want_ac, "budget {b}: {s}");
        assert_eq!(s["plan_peak_per_rank"], want_peak, "budget {b}: {s}");
        assert_eq!(s["memory_budget_per_rank"], budget, "{s}");
        assert_eq!(
            s["memory_budget_source"],
            format!("--device-memory {b}").as_str(),
            "{s}"
        );
        picked.insert((want, want_ac));
        let reason = s["auto_reason"].as_str().unwrap();
        let plan_reason = p["strategy"]["auto_reason"].as_str().unwrap();
        saw_shard_optimizer |= want == "shard-optimizer";
        assert_eq!(reason, plan_reason, "budget {b}: the planner's own words");
        assert_eq!(s["plan_peak_per_rank"], p["memory"]["peak"]["bytes"], "{b}");
    }
    assert!(
        saw_shard_optimizer,
        "the shard-optimizer budget was exercised"
    );
    assert!(
        picked.len() >= 3,
        "several different choices were exercised: {picked:?}"
    );
    // An explicit strategy has no auto reason.
    let (code, _, summary, err) = train(1, &["--strategy", "full-shard"]);
    assert_eq!(code, 0, "{err}");
    let s = summary.unwrap();
    assert_eq!(s["strategy_requested"], "full-shard");
    assert!(s["auto_reason"].is_null(), "{s}");
}

#[test]
fn auto_losses_equal_the_explicit_strategy_bit_for_bit() {
    // The budget of shard-grad-op with checkpointing: a sharded choice on this model.
    let b = peaks()[6].to_string();
    let (code, auto, summary, err) = train(3, &["--strategy", "auto", "--device-memory", &b]);
    assert_eq!(code, 0, "{err}");
    let s = summary.unwrap();
    let strategy = s["strategy"].as_str().unwrap().to_string();
    assert_ne!(strategy, "no-shard", "{s}");
    let ac = if s["activation_checkpointing"] == true {
        "on"
    } else {
        "off"
    };
    let (code, explicit, summary_e, err) = train(
        3,
        &["--strategy", &strategy, "--activation-checkpointing", ac],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(losses(&auto).len(), 3);
    assert_eq!(
        losses(&auto),
        losses(&explicit),
        "every step's loss, bit for bit ({strategy}, checkpointing {ac})"
    );
    let e = summary_e.unwrap();
    assert_eq!(s["final_val_loss"], e["final_val_loss"]);
    assert_eq!(s["plan_peak_per_rank"], e["plan_peak_per_rank"]);
}

#[test]
fn resume_with_auto_continues_the_run_exactly() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let ck = root.to_str().unwrap();
    // Full shard, 3 steps, checkpoints at steps 2 and 3; then put back to the state of a run
    // stopped right after step 2 (only step-2 left, `latest` -> step 2).
    let (code, full, _, err) = train(
        3,
        &[
            "--strategy",
            "full-shard",
            "--ckpt-dir",
            ck,
            "--ckpt-every",
            "2",
            "--keep-last",
            "0",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(full.len(), 3);
    for (step, dir) in fsdp_checkpoints::list_checkpoints(&root).unwrap() {
        if step != 2 {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
    std::fs::write(root.join("latest"), "step-00000002\n").unwrap();
    // Resumed under auto, which picks no-shard for this budget: the checkpoint reshards.
    let b = peak("no-shard", "off").to_string();
    let (code, rest, summary, err) = train(
        3,
        &[
            "--strategy",
            "auto",
            "--device-memory",
            &b,
            "--ckpt-dir",
            ck,
            "--resume",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("resuming from") && err.contains("step 2"),
        "{err}"
    );
    assert_eq!(summary.unwrap()["strategy"], "no-shard");
    assert_eq!(rest.len(), 1, "one step left after resuming at step 2");
    assert_eq!(rest[0]["step"], 3);
    assert_eq!(
        losses(&rest),
        losses(&full[2..]),
        "step 3 resumed under auto = step 3 of the uninterrupted run, bit for bit"
    );
}

#[test]
fn auto_offloads_as_the_last_resort_and_refuses_what_nothing_fits() {
    let peaks = peaks();
    let least = *peaks.iter().min().unwrap();
    // Without offload the least memory is full shard with checkpointing.
    let fs_ac = peaks[7];
    assert_eq!(fs_ac, least);
    let offloaded = |s: &str, ac: &str, o: &str| -> u64 {
        plan_json(&[
            "--strategy",
            s,
            "--activation-checkpointing",
            ac,
            "--offload",
            o,
        ])["memory"]["peak"]["bytes"]
            .as_u64()
            .unwrap()
    };
    // The least memory there is: full shard with checkpointing and the parameters offloaded.
    let params = offloaded("full-shard", "on", "params");
    assert!(params < offloaded("full-shard", "on", "optimizer") && params < least);
    // One byte below the least without offload: the planner's auto offloads and says so; a
    // run on a device offloads the same way (the library's search, on the CPU device); a run
    // on the host placement, whose device is host memory, does not: nothing fits there.
    let budget = least - 1;
    let b = budget.to_string();
    // Each offloaded candidate planned on its own, in the documented order of the last resort:
    // the optimizer offloaded before the parameters, each without checkpointing first, then
    // with it, the strategies fastest first. At W = 2 no-shard keeps one shard per group and
    // refuses both offloads; no-shard and shard-optimizer keep the parameters on the device
    // and refuse `--offload params`.
    let (want, want_ac, want_offload, want_peak) = OFFLOAD_ORDER
        .iter()
        .map(|&(o, ac, s)| (s, ac, o, offloaded(s, if ac { "on" } else { "off" }, o)))
        .find(|c| c.3 <= budget)
        .expect("an offloaded candidate fits one byte below the least without offload");
    let p = plan_json(&["--strategy", "auto", "--device-memory", &b]);
    assert_eq!(p["strategy"]["name"], want, "{p}");
    assert_eq!(p["strategy"]["activation_checkpointing"], want_ac, "{p}");
    assert_eq!(p["config"]["offload"], want_offload, "{p}");
    assert_eq!(p["memory"]["peak"]["bytes"], want_peak, "{p}");
    let with_ac = if want_ac {
        " with activation checkpointing"
    } else {
        ""
    };
    let reason = p["strategy"]["auto_reason"].as_str().unwrap();
    assert!(
        reason.starts_with(&format!(
            "{want}{with_ac} with --offload {want_offload} is the fastest way it fits, with offload"
        )),
        "{reason}"
    );
    // Every candidate without offload was tried first and named with its peak.
    for ((s, ac), peak) in ORDER.iter().zip(&peaks) {
        let name = if *ac {
            format!("{s} with activation checkpointing")
        } else {
            s.to_string()
        };
        let needs = format!("{name} needs {}", fsdp_types::Bytes(*peak));
        assert!(reason.contains(&needs), "{needs}: {reason}");
    }
    let opts = fsdp::train::TrainOptions {
        model: "tiny".into(),
        world_size: 2,
        seq_len: 32,
        micro_batch: 2,
        placement: fsdp::runtime::Placement::Device(candle_core::Device::Cpu),
        ..Default::default()
    };
    let choice = fsdp::train::resolve_auto(&opts, fsdp_types::Bytes(budget)).unwrap();
    assert!(choice.fits, "{choice:?}");
    assert_eq!(choice.strategy.to_string(), want, "{choice:?}");
    assert_eq!(
        choice.activation_checkpointing.unwrap_or(false),
        want_ac,
        "{choice:?}"
    );
    assert_eq!(
        choice.offload.map(|o| o.to_string()).as_deref(),
        Some(want_offload),
        "{choice:?}"
    );
    assert_eq!(choice.peak.0, want_peak);
    let (code, steps, _, err) = train(1, &["--strategy", "auto", "--device-memory", &b]);
    assert_eq!(code, 2, "{err}");
    assert!(steps.is_empty(), "no step ran");
    // The host placement's search does not offload; the refusal only suggests it.
    assert!(!err.contains("with --offload"), "{err}");
    assert!(
        err.contains("the least memory is full-shard with activation checkpointing, peak"),
        "{err}"
    );
    // Offloaded explicitly, the same budget trains on the host's CPU device.
    let (code, steps, summary, err) = train(
        1,
        &[
            "--strategy",
            "auto",
            "--device-memory",
            &b,
            "--offload",
            "params",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(steps.len(), 1);
    assert!(
        summary.unwrap()["plan_host_peak_per_rank"]
            .as_u64()
            .unwrap()
            > 0
    );
    // One byte below the least with offload: refused before training, with the numbers.
    let b = (params - 1).to_string();
    let (code, steps, summary, err) = train(
        1,
        &[
            "--strategy",
            "auto",
            "--device-memory",
            &b,
            "--offload",
            "params",
        ],
    );
    assert_eq!(code, 2, "{err}");
    assert!(steps.is_empty() && summary.is_none(), "no step ran");
    let budget = fsdp_types::group_thousands(params - 1);
    let peak = fsdp_types::group_thousands(params);
    assert!(
        err.contains(&format!(
            "--strategy auto: nothing fits the memory budget of {budget} B"
        )) && err.contains(&format!("(--device-memory {b})"))
            && err.contains(&format!(
                "the least memory is full-shard with activation checkpointing and --offload params, peak {peak} B"
            ))
            && err.contains("(the least memory), over by 1 B"),
        "{err}"
    );
    // The planner agrees that nothing fits.
    let p = plan_json(&["--strategy", "auto", "--device-memory", &b]);
    assert!(
        p["strategy"]["auto_reason"]
            .as_str()
            .unwrap()
            .starts_with("nothing fits"),
        "{p}"
    );
}

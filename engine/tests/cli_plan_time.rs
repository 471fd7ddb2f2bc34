//! `fsdp plan --time --hardware`: the predicted step in the table, in JSON (`fsdp-plan/2`'s
//! `time` object) and as a Chrome trace; auto ranked by predicted step time; bad profiles,
//! names and trace paths refused with exit 2 before any work.

use fsdp_planner::config::{PlanConfig, Strategy};
use fsdp_planner::time::{predict, HardwareProfile, TimeInputs};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

fn fsdp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .arg("plan")
        .args(args)
        .output()
        .expect("run fsdp")
}

fn ok_json(args: &[&str]) -> Value {
    let o = fsdp(args);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("JSON")
}

fn bad(args: &[&str], needle: &str) -> String {
    let o = fsdp(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert!(
        err.contains(needle),
        "{args:?}: expected `{needle}` in: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// A change to a profile document.
type Edit = Box<dyn Fn(&mut Value)>;

/// Equal up to the last bit or two a JSON round trip may change (serde_json's default parser
/// is not correctly rounded).
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-14 * b.abs()
}

/// The built-in H100 profile read straight from its file (not through the CLI).
fn h100() -> HardwareProfile {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../planner/profiles/h100-sxm.json");
    HardwareProfile::from_json(&std::fs::read_to_string(path).unwrap(), "h100").unwrap()
}

const BASE: [&str; 10] = [
    "--model",
    "tiny",
    "--world-size",
    "4",
    "--micro-batch",
    "2",
    "--grad-accum",
    "2",
    "--param-dtype",
    "bf16",
];

#[test]
fn plan_time_json_is_the_prediction_of_the_same_plan() {
    let mut args = BASE.to_vec();
    args.extend(["--device", "cuda", "--format", "json"]);
    let plain = ok_json(&args);
    args.extend(["--time", "--hardware", "h100-sxm"]);
    let timed = ok_json(&args);
    assert_eq!(timed["schema"], "fsdp-plan/2");
    assert!(plain.get("time").is_none(), "no time object without --time");
    // The prediction does not change the plan.
    assert_eq!(plain["fingerprint"], timed["fingerprint"]);
    let t = &timed["time"];
    // Tokens per step from the flags: W * A * B * T, T = tiny's 256 positions.
    assert_eq!(t["tokens_per_step"], 4 * 2 * 2 * 256);
    let step = t["step_s"].as_f64().unwrap();
    assert!(step > 0.0 && step.is_finite());
    let tps = t["tokens_per_s"].as_f64().unwrap();
    assert!((tps - (4 * 2 * 2 * 256) as f64 / step).abs() <= 1e-9 * tps);
    // The peak is the profile's dense bf16 figure (989.4 TFLOP/s, NVIDIA's datasheet).
    assert_eq!(t["peak_flops_per_s"].as_f64(), Some(989.4e12));
    let mfu = t["mfu"].as_f64().unwrap();
    let model_flops = t["model_flops_per_step"].as_f64().unwrap();
    assert!((mfu - model_flops / (step * 4.0 * 989.4e12)).abs() <= 1e-12);
    assert!(t["flop_formula"].as_str().unwrap().contains("PaLM"));
    assert!(t.get("spans").is_none(), "spans go to --trace");
    // The same numbers as the library's prediction for the same configuration (clipping on,
    // as `fsdp train`'s default).
    let cfg = PlanConfig {
        micro_batch: 2,
        grad_accum: 2,
        seq_len: 256,
        param_dtype: fsdp_types::DType::BF16,
        // A GPU profile plans the GPU's step: the composite ops.
        activations: fsdp_planner::ActivationModel::Composite,
        ..PlanConfig::new(4)
    };
    let p = fsdp_planner::plan(&fsdp_planner::preset("tiny").unwrap(), &cfg).unwrap();
    let want = predict(&p, &h100(), &TimeInputs::default()).unwrap();
    assert!(close(t["step_s"].as_f64().unwrap(), want.step_s));
    assert!(close(
        t["exposed_comm_s"].as_f64().unwrap(),
        want.exposed_comm_s
    ));
    assert_eq!(t["bottleneck"], want.bottleneck);
}

#[test]
fn plan_time_table_names_step_mfu_formula_and_bottleneck() {
    let mut args = BASE.to_vec();
    args.extend(["--time", "--hardware", "a100-80gb"]);
    let o = fsdp(&args);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("predicted step on a100-80gb (W=4"), "{out}");
    for needle in [
        "step time",
        "tokens/s",
        "exposed comm",
        "MFU",
        "PaLM",
        "bottleneck: ",
    ] {
        assert!(out.contains(needle), "`{needle}` missing: {out}");
    }
    // The A100's dense bf16 peak, 312 TFLOP/s.
    assert!(out.contains("peak 312.0 TFLOP/s"), "{out}");
}

#[test]
fn plan_time_trace_has_one_event_per_predicted_span_and_is_deterministic() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (d.path().join("a.json"), d.path().join("b.json"));
    for f in [&a, &b] {
        let mut args = BASE.to_vec();
        args.extend([
            "--time",
            "--hardware",
            "h200",
            "--trace",
            f.to_str().unwrap(),
        ]);
        let o = fsdp(&args);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let text = std::fs::read(&a).unwrap();
    assert_eq!(
        text,
        std::fs::read(&b).unwrap(),
        "a prediction is deterministic"
    );
    let doc: Value = serde_json::from_slice(&text).unwrap();
    let ev = doc["traceEvents"].as_array().unwrap();
    let cfg = PlanConfig {
        micro_batch: 2,
        grad_accum: 2,
        seq_len: 256,
        param_dtype: fsdp_types::DType::BF16,
        // A GPU profile plans the GPU's step: the composite ops.
        activations: fsdp_planner::ActivationModel::Composite,
        ..PlanConfig::new(4)
    };
    let p = fsdp_planner::plan(&fsdp_planner::preset("tiny").unwrap(), &cfg).unwrap();
    let h200 = fsdp_planner::time::builtin_profile("h200").unwrap();
    let want = predict(&p, &h200, &TimeInputs::default()).unwrap();
    let spans: Vec<&Value> = ev.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(spans.len(), want.spans.len());
    // Every unit's forward and backward of each of the 2 micro-batches, and one all-gather
    // per flat parameter in forward and again in backward (full shard, units' params all
    // trainable: one flat parameter per unit), counted from the plan.
    let uses = p.schedule.forward.len();
    let count = |cat: &str| spans.iter().filter(|e| e["cat"] == cat).count();
    assert_eq!(count("forward"), 2 * uses);
    assert_eq!(count("backward"), 2 * uses);
    for e in &spans {
        assert!(e["ts"].as_f64().unwrap() >= 0.0 && e["dur"].as_f64().unwrap() >= 0.0);
        assert_eq!(e["pid"], 0);
        let tid = e["tid"].as_u64().unwrap();
        let comm =
            ["all_gather", "reduce_scatter", "all_reduce"].contains(&e["cat"].as_str().unwrap());
        assert_eq!(tid, u64::from(comm), "{e}");
    }
    let names: Vec<&str> = ev
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["compute", "communication"]);
    // The last span ends at the predicted step time.
    let end = spans
        .iter()
        .map(|e| e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!(
        (end - want.step_s * 1e6).abs() < 1e-3 * want.step_s * 1e6,
        "{end}"
    );
}

#[test]
fn plan_auto_with_hardware_keeps_the_fastest_plan_that_fits() {
    let args = [
        "--model",
        "mini",
        "--world-size",
        "4",
        "--seq-len",
        "256",
        "--strategy",
        "auto",
        "--device-memory",
        "80GiB",
        "--activation-checkpointing",
        "off",
        "--offload",
        "none",
        "--format",
        "json",
    ];
    let fixed = ok_json(&args);
    assert!(
        fixed["strategy"]["auto_reason"]
            .as_str()
            .unwrap()
            .contains("is the fastest strategy"),
        "{}",
        fixed["strategy"]["auto_reason"]
    );
    let mut timed_args = args.to_vec();
    timed_args.extend(["--hardware", "h100-sxm", "--time"]);
    let timed = ok_json(&timed_args);
    let reason = timed["strategy"]["auto_reason"].as_str().unwrap();
    assert!(
        reason.contains("has the shortest predicted step on h100-sxm of the"),
        "{reason}"
    );
    let chosen = timed["time"]["step_s"].as_f64().unwrap();
    // Every concrete strategy at W = 4, planned and predicted one by one: all fit 80 GiB.
    let spec = fsdp_planner::preset("mini").unwrap();
    let mut best = f64::INFINITY;
    for s in [
        Strategy::NoShard,
        Strategy::ShardOptimizer,
        Strategy::ShardGradOp,
        Strategy::Hybrid { shard_size: 2 },
        Strategy::FullShard,
    ] {
        let cfg = PlanConfig {
            strategy: s,
            seq_len: 256,
            activation_checkpointing: Some(false),
            offload: Some(fsdp_planner::Offload::None),
            // A GPU profile plans the GPU's step: the composite ops.
            activations: fsdp_planner::ActivationModel::Composite,
            ..PlanConfig::new(4)
        };
        let p = fsdp_planner::plan(&spec, &cfg).unwrap();
        assert!(p.memory.peak.0 <= 80 << 30);
        best = best.min(predict(&p, &h100(), &TimeInputs::default()).unwrap().step_s);
    }
    assert!(close(chosen, best), "{chosen} vs {best}: {reason}");
}

#[test]
fn plan_time_refuses_bad_hardware_and_trace_paths() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("out.json");
    let o = out.to_str().unwrap();
    fn with<'a>(o: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
        let mut v = vec!["--model", "tiny", "-o", o];
        v.extend_from_slice(extra);
        v
    }
    let err = bad(
        &with(o, &["--time", "--hardware", "b200"]),
        "unknown hardware `b200`",
    );
    assert!(err.contains("h100-sxm, h200, a100-80gb"), "{err}");
    bad(&with(o, &["--time"]), "--time needs --hardware");
    bad(
        &with(o, &["--trace", "t.json"]),
        "--trace writes the predicted step",
    );
    let missing = d.path().join("no/such/dir/t.json");
    bad(
        &with(
            o,
            &[
                "--time",
                "--hardware",
                "h100-sxm",
                "--trace",
                missing.to_str().unwrap(),
            ],
        ),
        "does not exist; create it first",
    );
    // A profile file with one field broken at a time: named by its JSON path.
    let good: Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../planner/profiles/h100-sxm.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let file = d.path().join("hw.json");
    let f = file.to_str().unwrap();
    let cases: [(&str, Edit, &str); 4] = [
        (
            "implausible",
            Box::new(|v| v["overlap_slowdown"] = 1e9.into()),
            "`overlap_slowdown` is 1e9, outside the plausible range of a slowdown, 0..10",
        ),
        (
            "negative",
            Box::new(|v| v["collectives"]["intra_node"]["all_gather"]["latency_s"] = (-1.0).into()),
            "`collectives.intra_node.all_gather.latency_s` must not be negative",
        ),
        (
            "missing",
            Box::new(|v| {
                v["host"]
                    .as_object_mut()
                    .unwrap()
                    .remove("link_bytes_per_s");
            }),
            "`host.link_bytes_per_s` is missing",
        ),
        (
            "non-finite",
            Box::new(|_| {}),
            "`memory_bandwidth_bytes_per_s` is not a finite number",
        ),
    ];
    for (what, edit, needle) in cases {
        let mut v = good.clone();
        edit(&mut v);
        let mut text = serde_json::to_string_pretty(&v).unwrap();
        if what == "non-finite" {
            let at = text.find("\"memory_bandwidth_bytes_per_s\": ").unwrap();
            let end = at + text[at..].find(',').unwrap();
            text.replace_range(at..end, "\"memory_bandwidth_bytes_per_s\": 1e999");
        }
        std::fs::write(&file, text).unwrap();
        let err = bad(&with(o, &["--time", "--hardware", f]), needle);
        assert!(
            err.contains(&format!("hardware profile {f}:")),
            "the file is named: {err}"
        );
    }
    // A profile without a curve for the plan's dtype: named with the flag, as `train` does.
    let mut v = good.clone();
    v["gemm"].as_object_mut().unwrap().remove("f32");
    v["sources"]
        .as_object_mut()
        .unwrap()
        .retain(|k, _| !k.starts_with("gemm.f32"));
    std::fs::write(&file, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    let missing = format!(
        "--hardware: hardware profile {f}: `gemm.f32` is missing: the plan computes in f32"
    );
    bad(&with(o, &["--time", "--hardware", f]), &missing);
    // The same with the f32 fit of a calibrated profile left in: still the missing curve
    // (not its fit's pricing against an absent grid).
    v["compute_fit"] = serde_json::json!({"f32": {"gemm_scale": 1.1, "elementwise_scale": 1,
        "op_overhead_s": 0, "rms_relative_error": 0.01, "samples": 9, "gemm_pricing": "shape"}});
    std::fs::write(&file, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    bad(&with(o, &["--time", "--hardware", f]), &missing);
    // An output named as the profile it reads: refused, the profile kept.
    let before = std::fs::read(&file).unwrap();
    for flag in ["-o", "--trace"] {
        let err = bad(
            &["--model", "tiny", "--hardware", f, flag, f],
            &format!("{flag} {f} names the same file as --hardware {f}"),
        );
        assert!(err.contains(&format!("give {flag} another path")), "{err}");
    }
    assert_eq!(std::fs::read(&file).unwrap(), before);
    // Refused before any work: no output written.
    assert!(!out.exists());
}

#[test]
fn plan_hardware_alone_implies_time_in_the_table_and_in_json() {
    // The same plan, planned and predicted here: tiny, W = 4, 2 x 2 micro-batches, bf16.
    let cfg = PlanConfig {
        micro_batch: 2,
        grad_accum: 2,
        seq_len: 256,
        param_dtype: fsdp_types::DType::BF16,
        // A GPU profile plans the GPU's step: the composite ops.
        activations: fsdp_planner::ActivationModel::Composite,
        ..PlanConfig::new(4)
    };
    let p = fsdp_planner::plan(&fsdp_planner::preset("tiny").unwrap(), &cfg).unwrap();
    let want = predict(&p, &h100(), &TimeInputs::default()).unwrap();
    let mut args = BASE.to_vec();
    args.extend(["--hardware", "h100-sxm", "--format", "json"]);
    let doc = ok_json(&args);
    assert_eq!(doc["fingerprint"], p.fingerprint);
    let step = doc["time"]["step_s"].as_f64().expect("a time object");
    assert!(close(step, want.step_s), "{step} vs {}", want.step_s);
    let mut args = BASE.to_vec();
    args.extend(["--hardware", "h100-sxm"]);
    let o = fsdp(&args);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("predicted step on h100-sxm (W=4"), "{out}");
    assert!(
        out.contains(&format!(
            "step time        {:>10}",
            fsdp_planner::time::format_seconds(want.step_s)
        )),
        "{out}"
    );
}

#[test]
fn a_missing_profile_file_is_named_as_a_file_and_an_unwritable_trace_before_work() {
    let e = bad(
        &["--model", "tiny", "--hardware", "/nonexistent/here.json"],
        "--hardware /nonexistent/here.json: no such file",
    );
    assert!(e.contains("fsdp calibrate -o FILE"), "{e}");
    // A bare word that is no file stays an unknown name, with the list.
    bad(
        &["--model", "tiny", "--hardware", "h900"],
        "h100-sxm, h200, a100-80gb",
    );
    let e = bad(
        &[
            "--model",
            "tiny",
            "--hardware",
            "h100-sxm",
            "--trace",
            "/proc/p.json",
        ],
        "--trace /proc/p.json: cannot create a file in /proc",
    );
    assert!(!e.contains(".tmp-"), "{e}");
}

/// HFU below MFU reads as a contradiction unless the table says why: the PaLM count takes
/// every one of the T x T attention scores, the engine computes only the causal blocks.
/// Recompute under activation checkpointing lifts HFU above MFU, and then no reason is given.
#[test]
fn plan_time_explains_hfu_below_mfu_by_the_causal_attention() {
    let base = [
        "--model",
        "mini",
        "--world-size",
        "2",
        "--seq-len",
        "128",
        "--micro-batch",
        "4",
        "--time",
        "--hardware",
        "h100-sxm",
        // The CPU engine's step: its fused attention computes only the causal blocks.
        "--device",
        "cpu",
    ];
    let why = "below MFU because the model FLOPs count every one of the T x T attention scores";
    for (ckpt, hfu_below) in [("off", true), ("on", false)] {
        let mut args = base.to_vec();
        args.extend(["--activation-checkpointing", ckpt]);
        let mut json = args.clone();
        json.extend(["--format", "json"]);
        let t = &ok_json(&json)["time"];
        let (mfu, hfu) = (t["mfu"].as_f64().unwrap(), t["hfu"].as_f64().unwrap());
        assert_eq!(
            hfu < mfu,
            hfu_below,
            "checkpointing {ckpt}: MFU {mfu}, HFU {hfu}"
        );
        let o = fsdp(&args);
        assert_eq!(o.status.code(), Some(0));
        let out = String::from_utf8_lossy(&o.stdout);
        let line = out
            .lines()
            .find(|l| l.trim_start().starts_with("HFU"))
            .unwrap_or_else(|| panic!("no HFU line: {out}"));
        assert_eq!(
            line.contains(why),
            hfu_below,
            "checkpointing {ckpt}: {line}"
        );
    }
}

/// A GPU profile without `--device` plans the GPU's step (the composite ops), and says so: the
/// CPU engine's fused attention, one small GEMM per (sequence, head) pair and row block,
/// priced at an H100's per-call cost, predicted a step several times too slow. `--device
/// cpu` keeps the CPU's step, with a note that the prediction is of another device.
#[test]
fn a_gpu_profile_plans_the_gpu_step_unless_the_device_is_given() {
    let base = [
        "--model",
        "llama-mini",
        "--world-size",
        "8",
        "--micro-batch",
        "1",
        "--seq-len",
        "512",
        "--param-dtype",
        "bf16",
        "--hardware",
        "h100-sxm",
        "--format",
        "json",
    ];
    let run = |extra: &[&'static str]| {
        let mut args = base.to_vec();
        args.extend(extra);
        let o = fsdp(&args);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let v: Value = serde_json::from_slice(&o.stdout).expect("JSON");
        (v, String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let (inferred, note) = run(&[]);
    let (cuda, cuda_note) = run(&["--device", "cuda"]);
    let (cpu, cpu_note) = run(&["--device", "cpu"]);
    assert!(
        note.contains("the h100-sxm profile describes a GPU: planning the step of --device cuda"),
        "{note}"
    );
    assert!(!cuda_note.contains("note:"), "{cuda_note}");
    assert!(
        cpu_note.contains("describes a GPU; this plan computes on the CPU"),
        "{cpu_note}"
    );
    // Inferred is --device cuda, bit for bit; the CPU's step is another plan.
    assert_eq!(inferred["fingerprint"], cuda["fingerprint"]);
    assert_eq!(inferred["time"]["step_s"], cuda["time"]["step_s"]);
    assert_ne!(inferred["fingerprint"], cpu["fingerprint"]);
    let (g, c) = (
        cuda["time"]["step_s"].as_f64().unwrap(),
        cpu["time"]["step_s"].as_f64().unwrap(),
    );
    assert!(
        c > 1.5 * g,
        "the CPU ops' step {c} s against the GPU's {g} s"
    );
}

/// `--trace` through a symbolic link writes the link's target and keeps the link, as a shell's
/// `>` does. Renaming a finished temporary file over the path, right for a regular file,
/// would replace the link itself (and, run as root with `--trace /dev/null`, the device node).
#[cfg(unix)]
#[test]
fn trace_through_a_symlink_writes_its_target_and_keeps_the_link() {
    let d = tempfile::tempdir().unwrap();
    let target = d.path().join("real.json");
    let link = d.path().join("link.json");
    std::fs::write(&target, "old").unwrap();
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let o = fsdp(&[
        "--model",
        "tiny",
        "--hardware",
        "h100-sxm",
        "--trace",
        link.to_str().unwrap(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let meta = std::fs::symlink_metadata(&link).unwrap();
    assert!(meta.file_type().is_symlink(), "the link was replaced");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&target).unwrap()).unwrap();
    assert!(!doc["traceEvents"].as_array().unwrap().is_empty());
}

/// `-o` and `--trace` naming one file would leave only the one written last: refused before
/// any work, also when the two paths differ only by a link or `./`.
#[test]
fn plan_refuses_one_file_for_the_plan_and_the_trace() {
    let d = tempfile::tempdir().unwrap();
    let a = d.path().join("out.json");
    let b = d.path().join(".").join("out.json");
    let err = bad(
        &[
            "--model",
            "tiny",
            "--hardware",
            "h100-sxm",
            "-o",
            a.to_str().unwrap(),
            "--trace",
            b.to_str().unwrap(),
        ],
        "name the same file",
    );
    assert!(err.contains("give the trace another path"), "{err}");
    assert!(!a.exists(), "nothing written");
}

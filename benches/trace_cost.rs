//! What `fsdp train --trace` costs: the median step time of the same run with tracing off and
//! on, interleaved over rounds, as a ratio. Tracing off is one `Option` branch per recording
//! point (see `engine/src/trace.rs`); on, every unit phase, wait and collective is recorded in
//! memory and written after the last step. If tracing on is within the rounds' spread of off,
//! the branches that remain when it is off cost less than that.
//!
//! Run: `cargo build --release -p fsdp`, then `cargo bench -p fsdp-suite --bench trace_cost`.
//! Environment: `FSDP_BIN` (default `target/release/fsdp`), `FSDP_TRACE_ROUNDS` (default 5).

use std::path::PathBuf;
use std::process::Command;

/// Steps per run; the first [`SKIPPED`] are not counted.
const STEPS: u64 = 12;
/// Steps not counted at the start.
const SKIPPED: u64 = 2;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The median counted step time of one run of `args` (with `--trace FILE` when `trace`).
fn run(fsdp: &PathBuf, args: &[&str], trace: Option<&PathBuf>) -> f64 {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut c = Command::new(fsdp);
    c.current_dir(&root)
        .arg("train")
        .args(args)
        .args([
            "--steps",
            &STEPS.to_string(),
            "--warmup",
            "1",
            "--eval-every",
            "0",
        ])
        .arg("--json");
    if let Some(t) = trace {
        c.arg("--trace").arg(t);
    }
    let out = c.output().expect("fsdp train");
    assert!(
        out.status.success(),
        "fsdp train failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let steps: Vec<f64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["step"].as_u64().is_some_and(|s| s > SKIPPED))
        .filter_map(|v| v["step_seconds"].as_f64())
        .collect();
    assert!(!steps.is_empty(), "no counted step");
    median(steps)
}

fn main() {
    let fsdp = std::env::var_os("FSDP_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/release/fsdp"));
    assert!(
        fsdp.exists(),
        "{} is missing: build it first with `cargo build --release -p fsdp` (or set FSDP_BIN)",
        fsdp.display()
    );
    let rounds: usize = std::env::var("FSDP_TRACE_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let trace = std::env::temp_dir().join(format!("fsdp-trace-cost-{}.json", std::process::id()));
    let data = "testdata/tinyshakespeare.txt";
    let workloads: [(&str, Vec<&str>); 2] = [
        (
            "mini W2 full-shard",
            vec![
                "--data",
                data,
                "--model",
                "mini",
                "--world-size",
                "2",
                "--seq-len",
                "128",
                "--micro-batch",
                "4",
            ],
        ),
        (
            "tiny W2 full-shard (many short units)",
            vec![
                "--data",
                data,
                "--model",
                "tiny",
                "--world-size",
                "2",
                "--seq-len",
                "64",
                "--micro-batch",
                "2",
            ],
        ),
    ];
    println!(
        "{:<40} {:>12} {:>12} {:>9} {:>18}",
        "workload", "off (ms)", "on (ms)", "on/off", "off spread"
    );
    for (name, args) in &workloads {
        let (mut off, mut on) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            off.push(run(&fsdp, args, None));
            on.push(run(&fsdp, args, Some(&trace)));
        }
        let lo = off.iter().cloned().fold(f64::INFINITY, f64::min);
        let hi = off.iter().cloned().fold(0.0, f64::max);
        let (m_off, m_on) = (median(off.clone()), median(on.clone()));
        println!(
            "{:<40} {:>12.2} {:>12.2} {:>9.3} {:>+8.1}%..{:>+5.1}%",
            name,
            m_off * 1e3,
            m_on * 1e3,
            m_on / m_off,
            100.0 * (lo / m_off - 1.0),
            100.0 * (hi / m_off - 1.0)
        );
        println!(
            "{}",
            serde_json::json!({"workload": name, "off_step_s": off, "on_step_s": on,
                "on_over_off": m_on / m_off})
        );
    }
    let _ = std::fs::remove_file(&trace);
}

//! Running the `fsdp` binary in the checkpoint tests: its exit code and output, the losses of
//! its `--json` step lines, and putting a checkpoint root back to an earlier step.

use std::path::Path;
use std::process::Command;

/// Runs `fsdp args`: (exit code, stdout, stderr).
pub fn fsdp(args: &[String]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `(step, loss bits)` of every JSON step line.
pub fn losses(stdout: &str) -> Vec<(u64, u64)> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("step").is_some() && v.get("event").is_none())
        .map(|v| {
            (
                v["step"].as_u64().unwrap(),
                v["loss"].as_f64().unwrap().to_bits(),
            )
        })
        .collect()
}

/// Keeps only the checkpoint of `step` under `root` and points `latest` at it: the state of a
/// run stopped right after saving step `step`.
pub fn rewind(root: &Path, step: u64) {
    for (s, dir) in fsdp_checkpoints::list_checkpoints(root).unwrap() {
        if s != step {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
    std::fs::write(root.join("latest"), format!("step-{step:08}\n")).unwrap();
}

/// `fsdp train` arguments of a tiny, fast run into `root`: tiny GPT, `world` rank threads,
/// 1 x 16 tokens per micro-batch, `--warmup warmup`, one validation batch, one thread per
/// rank, `--json` lines, a save every `every` steps, the newest `keep` kept (0: all).
#[allow(dead_code)] // not every test crate that includes this module trains a tiny run
pub fn tiny_train_args(
    root: &Path,
    steps: u64,
    world: &str,
    warmup: u64,
    every: u64,
    keep: u64,
) -> Vec<String> {
    let mut v: Vec<String> = [
        "train",
        "--model",
        "tiny",
        "--micro-batch",
        "1",
        "--seq-len",
        "16",
        "--eval-batches",
        "1",
        "--threads-per-rank",
        "1",
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for (flag, value) in [
        ("--world-size", world.to_string()),
        ("--warmup", warmup.to_string()),
        ("--ckpt-every", every.to_string()),
        ("--keep-last", keep.to_string()),
        ("--ckpt-dir", root.display().to_string()),
        ("--steps", steps.to_string()),
    ] {
        v.push(flag.into());
        v.push(value);
    }
    v
}

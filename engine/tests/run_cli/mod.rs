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

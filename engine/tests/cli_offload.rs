//! `fsdp train --offload optimizer|params` and `--strategy shard-optimizer` end to end through
//! the binary: the losses equal the run without offload bit for bit, checkpoints move between
//! offloaded and device runs (same world size: the uninterrupted run's losses; another world
//! size: resharded on load, the same losses with and without offload), and the summary states
//! the host bytes against the plan.

use std::path::Path;

mod run_cli;
use run_cli::{fsdp, losses, rewind};

fn args(root: &Path, steps: u64, world: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "train",
        "--model",
        "tiny",
        "--world-size",
        world,
        "--micro-batch",
        "1",
        "--seq-len",
        "16",
        "--warmup",
        "2",
        "--eval-batches",
        "1",
        "--threads-per-rank",
        "1",
        "--json",
        "--ckpt-every",
        "3",
        "--keep-last",
        "0",
        "--ckpt-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.push(root.display().to_string());
    a.extend(["--steps".into(), steps.to_string()]);
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn summary(stdout: &str) -> serde_json::Value {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["summary"] == true)
        .expect("a summary line")
}

#[test]
fn offloaded_runs_equal_device_runs_and_share_checkpoints() {
    let t = tempfile::tempdir().unwrap();
    let base = t.path().join("base");
    let (code, out, err) = fsdp(&args(&base, 6, "2", &[]));
    assert_eq!(code, 0, "{err}");
    let want = losses(&out);
    assert_eq!(want.len(), 6);
    for (name, extra) in [
        ("opt", &["--offload", "optimizer"][..]),
        ("params", &["--offload", "params"][..]),
        (
            "zero1",
            &["--strategy", "shard-optimizer", "--offload", "optimizer"][..],
        ),
    ] {
        let root = t.path().join(name);
        let (code, out, err) = fsdp(&args(&root, 6, "2", extra));
        assert_eq!(code, 0, "{name}: {err}");
        assert_eq!(
            losses(&out),
            want,
            "{name}: losses equal the run without offload"
        );
        let s = summary(&out);
        let plan_host = s["plan_host_peak_per_rank"].as_u64().unwrap();
        assert!(plan_host > 0, "{name}: {s}");
        assert_eq!(s["host_peak_per_rank"][0], plan_host, "{name}: {s}");
        // Back to step 3, resumed without offload: the uninterrupted run's steps 4..6.
        rewind(&root, 3);
        let mut a = args(&root, 6, "2", &[]);
        a.push("--resume".into());
        let (code, out, err) = fsdp(&a);
        assert_eq!(code, 0, "{name}: {err}");
        assert_eq!(
            losses(&out),
            want[3..].to_vec(),
            "{name}: resumed on the device"
        );
    }
    // The device run's checkpoint resumed with offload at the same world size, and both
    // resharded to one rank with and without offload.
    rewind(&base, 3);
    let mut a = args(&base, 6, "2", &["--offload", "optimizer"]);
    a.push("--resume".into());
    let (code, out, err) = fsdp(&a);
    assert_eq!(code, 0, "{err}");
    assert_eq!(losses(&out), want[3..].to_vec(), "resumed offloaded");
    let one = |extra: &[&str], name: &str| {
        let root = t.path().join(name);
        std::fs::create_dir_all(&root).unwrap();
        let src = base.join("step-00000003");
        let dst = root.join("step-00000003");
        copy_dir(&src, &dst);
        std::fs::write(root.join("latest"), "step-00000003\n").unwrap();
        let mut a = args(&root, 5, "1", extra);
        a.push("--resume".into());
        let (code, out, err) = fsdp(&a);
        assert_eq!(code, 0, "{name}: {err}");
        assert!(err.contains("saved at world size 2"), "{name}: {err}");
        losses(&out)
    };
    let plain = one(&[], "w1");
    assert_eq!(plain.len(), 2);
    assert_eq!(
        one(&["--offload", "params"], "w1p"),
        plain,
        "resharded and offloaded"
    );
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let to = dst.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to);
        } else {
            std::fs::copy(e.path(), to).unwrap();
        }
    }
}

#[test]
fn offload_refusals_exit_2_with_the_fix() {
    let t = tempfile::tempdir().unwrap();
    for (extra, want) in [
        (
            &["--strategy", "no-shard", "--offload", "params"][..],
            "--offload params with no-shard at 2 ranks makes no sense",
        ),
        (
            &[
                "--strategy",
                "hybrid",
                "--shard-size",
                "1",
                "--offload",
                "bogus",
            ][..],
            "invalid value 'bogus' for '--offload",
        ),
    ] {
        let (code, _, err) = fsdp(&args(&t.path().join("x"), 2, "2", extra));
        assert_eq!(code, 2, "{err}");
        assert!(err.contains(want), "{want}: {err}");
    }
}

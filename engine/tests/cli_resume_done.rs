//! `fsdp train --resume` from a checkpoint already at or past `--steps`: a clear "nothing to
//! train" line and exit 0, never a summary of zero steps (NaN / -0 losses).

use std::process::Command;

fn fsdp(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args)
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn resume_past_steps_says_nothing_to_train() {
    let t = tempfile::tempdir().unwrap();
    let ck = t.path().join("ck");
    let ck = ck.to_str().unwrap();
    let small = [
        "--model",
        "tiny",
        "--micro-batch",
        "2",
        "--seq-len",
        "16",
        "--eval-batches",
        "1",
    ];
    let mut first = vec!["train", "--steps", "3", "--ckpt-dir", ck, "--json"];
    first.extend(small);
    let (code, _, err) = fsdp(&first);
    assert_eq!(code, 0, "{err}");
    for json in [false, true] {
        let mut again = vec!["train", "--steps", "2", "--ckpt-dir", ck, "--resume"];
        again.extend(small);
        if json {
            again.push("--json");
        }
        let (code, out, err) = fsdp(&again);
        assert_eq!(code, 0, "{err}");
        let all = format!("{out}{err}");
        assert!(
            all.contains("is at step 3 >= --steps 2: nothing to train"),
            "{all}"
        );
        assert!(all.contains("step-00000003"), "{all}");
        assert!(!all.contains("NaN") && !all.contains("-0.0000"), "{all}");
        assert!(!all.contains("train loss"), "{all}");
        if json {
            assert!(out.is_empty(), "--json keeps stdout for JSON lines: {out}");
        }
    }
}

//! `fsdp plan` without `--seq-len`: 1024 tokens, capped at the model's positions.

use std::process::Command;

fn plan(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .arg("plan")
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
fn plan_seq_len_defaults_to_min_of_1024_and_model_positions() {
    // tiny has 256 positions: the default plans 256 tokens instead of failing.
    let (code, out, err) = plan(&["--model", "tiny"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("micro-batch 1 x 256 tokens"), "{out}");
    // gpt2 has 1024 positions: the default stays 1024.
    let (code, out, err) = plan(&["--model", "gpt2", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"seq_len\": 1024"), "{out}");
    // An explicit --seq-len past the table is still an error, exit 2.
    let (code, _, err) = plan(&["--model", "tiny", "--seq-len", "1024"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("sequence length 1024 exceeds the model's 256 positions"),
        "{err}"
    );
}

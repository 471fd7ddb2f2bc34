//! `fsdp train` messages for bad files, and plain progress lines when not on a terminal.

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
fn init_from_a_short_file_says_truncated_with_sizes() {
    let t = tempfile::tempdir().unwrap();
    let ten = t.path().join("ten.txt");
    std::fs::write(&ten, b"0123456789").unwrap();
    let (code, _, err) = fsdp(&[
        "train",
        "--steps",
        "1",
        "--init-from",
        ten.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("ten.txt: is 10 bytes but declares a"), "{err}");
    assert!(err.contains("truncated or not a safetensors file"), "{err}");
    assert!(!err.contains("header too large"), "{err}");
    let two = t.path().join("two.txt");
    std::fs::write(&two, b"ab").unwrap();
    let (code, _, err) = fsdp(&[
        "train",
        "--steps",
        "1",
        "--init-from",
        two.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("two.txt: is 2 bytes: truncated or not a safetensors file"),
        "{err}"
    );
}

#[test]
fn data_directory_is_named_as_a_directory() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().to_str().unwrap();
    let (code, _, err) = fsdp(&["train", "--steps", "1", "--data", d]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!("{d} is a directory, not a text file")),
        "{err}"
    );
    assert!(!err.contains("os error"), "{err}");
}

#[test]
fn piped_run_prints_a_line_per_evaluation_and_at_the_end() {
    let args = [
        "train",
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--micro-batch",
        "2",
        "--seq-len",
        "32",
        "--eval-batches",
        "1",
        "--warmup",
        "1",
    ];
    let (code, out, err) = fsdp(&args);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(lines[0].starts_with("step 2/4 | loss "), "{out}");
    assert!(lines[1].starts_with("step 4/4 | loss "), "{out}");
    let loss = |l: &str, key: &str| -> f64 {
        let rest = &l[l.find(key).unwrap() + key.len()..];
        rest.split_whitespace().next().unwrap().parse().unwrap()
    };
    for l in &lines {
        assert!(
            l.contains(" val ")
                && l.contains(" | lr ")
                && l.contains(" tok/s | comm ")
                && l.contains(" ms | mem "),
            "{l}"
        );
        assert!(l.len() < 100, "{l}");
        let (t, v) = (loss(l, "| loss "), loss(l, " val "));
        // Byte-level model from scratch: near ln(256) = 5.55, finite and positive.
        assert!(t > 3.0 && t < 6.5 && v > 3.0 && v < 6.5, "{l}");
    }
    // With --json only JSON lines are printed.
    let mut json = args.to_vec();
    json.push("--json");
    let (code, out, err) = fsdp(&json);
    assert_eq!(code, 0, "{err}");
    assert!(out.lines().all(|l| l.starts_with('{')), "{out}");
}

/// A closed stdout or stderr ends no command (`fsdp train | head -1` trains on and saves), in
/// this binary to keep the number of test executables down.
#[path = "cli_train_messages/closed_output.rs"]
mod closed_output;

/// `--log-file`: every line, appended as it happens, also without a terminal.
#[path = "cli_train_messages/log_file.rs"]
mod log_file;

/// A process read line by line while it runs.
#[path = "cli_train_messages/running.rs"]
mod running;

/// SIGTERM / SIGINT: every rank stops after one step, saves it and exits 143 / 130.
#[path = "cli_train_messages/stop.rs"]
mod stop;

/// Training text from pipes, FIFOs and standard input; a data file changed during training.
#[path = "cli_train_messages/data_sources.rs"]
mod data_sources;

/// `--log-every` lines and checkpoint save reports without a terminal.
#[path = "cli_train_messages/progress.rs"]
mod progress;

/// A negative value after a flag is a value, refused by its rule (not "unexpected argument").
#[test]
fn a_negative_value_is_refused_by_its_rule() {
    let (code, _, err) = fsdp(&["train", "--steps", "1", "--lr", "-1"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--lr") && err.contains("-1"), "{err}");
    assert!(!err.contains("unexpected argument"), "{err}");
}

/// Consolidating into a file while stdout is a closed pipe (`| head -0`) writes the file and
/// exits 0 without a panic.
#[test]
fn consolidate_to_a_closed_pipe_does_not_panic() {
    let t = tempfile::tempdir().unwrap();
    let ck = t.path().join("ck");
    let (code, _, err) = fsdp(&[
        "train",
        "--steps",
        "1",
        "--seq-len",
        "16",
        "--micro-batch",
        "1",
        "--eval-batches",
        "1",
        "--warmup",
        "0",
        "--ckpt-dir",
        ck.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let out = t.path().join("m.safetensors");
    let mut child = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args([
            "ckpt",
            "consolidate",
            ck.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(fsdp_checkpoints::read_full(&out).is_ok());
}

//! A closed standard output or error (`fsdp train | head -1`, a reader gone) ends no command:
//! training runs every step and saves, `plan`, `ckpt` and `data` do their work and exit 0,
//! and nothing panics.

use super::running::Running;
use fsdp_checkpoints::{Checkpoint, Verify};
use std::path::Path;
use std::process::{Command, Output, Stdio};

/// A pipe whose reader is already closed: every write to it fails with EPIPE.
fn closed_pipe() -> Stdio {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    writer.into()
}

/// Runs `fsdp args` with stdout (`out`) and/or stderr (`!out`) on a closed pipe.
fn with_closed(args: &[&str], stdout: bool, stderr: bool) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_fsdp"));
    c.args(args);
    c.stdout(if stdout {
        closed_pipe()
    } else {
        Stdio::piped()
    });
    c.stderr(if stderr {
        closed_pipe()
    } else {
        Stdio::piped()
    });
    c.output().expect("run fsdp")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn train(ckpt: &Path, steps: &str) -> Vec<String> {
    [
        "train",
        "--micro-batch",
        "1",
        "--seq-len",
        "16",
        "--eval-batches",
        "1",
        "--threads-per-rank",
        "1",
        "--world-size",
        "2",
        "--steps",
        steps,
        "--ckpt-dir",
        ckpt.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn newest_step(root: &Path) -> u64 {
    let ck = Checkpoint::open(root, Verify::Checksums).unwrap();
    ck.verify_all().unwrap();
    ck.manifest().train.step
}

#[test]
fn train_goes_on_and_saves_after_its_stdout_closes() {
    let t = tempfile::tempdir().unwrap();
    let ck = t.path().join("ck");
    let mut args = train(&ck, "30");
    args.push("--json".into());
    let mut run = Running::start(&args);
    let first = run.until(|_| true);
    assert_eq!(first["step"], 1, "{first}");
    // `| head -1`: the reader goes away after one line.
    let (code, err) = run.close_stdout_and_wait();
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(newest_step(&ck), 30, "the run finished and saved step 30");
}

#[test]
fn train_goes_on_and_saves_with_its_stderr_closed() {
    let t = tempfile::tempdir().unwrap();
    let ck = t.path().join("ck");
    // Notes on stderr: the warmup beyond --steps, no checkpoint to resume yet.
    let mut args = train(&ck, "3");
    args.extend(["--warmup", "20", "--resume"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = with_closed(&args, false, true);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stdout));
    assert!(
        text(&o.stdout).contains("train loss"),
        "{}",
        text(&o.stdout)
    );
    assert_eq!(newest_step(&ck), 3);
}

#[test]
fn plan_with_its_stdout_closed_exits_0() {
    for format in ["table", "json"] {
        let o = with_closed(
            &[
                "plan",
                "--model",
                "tiny",
                "--world-size",
                "2",
                "--format",
                format,
            ],
            true,
            false,
        );
        assert_eq!(o.status.code(), Some(0), "{format}: {}", text(&o.stderr));
        assert!(text(&o.stderr).is_empty(), "{}", text(&o.stderr));
    }
}

/// A standard output that cannot be written for another reason than a reader that went away
/// (a full disk: `/dev/full` answers every write with ENOSPC) leaves the output incomplete:
/// `plan` exits 1 saying so, not 0. Training is not affected (its work is the checkpoints).
#[test]
fn plan_into_a_full_disk_exits_1() {
    let full = std::fs::File::options().write(true).open("/dev/full");
    let Ok(full) = full else {
        println!("SKIPPED: no /dev/full on this system");
        return;
    };
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args([
            "plan",
            "--model",
            "tiny",
            "--world-size",
            "2",
            "--format",
            "json",
        ])
        .stdout(Stdio::from(full))
        .output()
        .unwrap();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot write standard output: No space left on device"),
        "{err}"
    );
}

#[test]
fn ckpt_and_data_with_their_stdout_closed_do_their_work_and_exit_0() {
    let t = tempfile::tempdir().unwrap();
    let ck = t.path().join("ck");
    let o = with_closed(
        &train(&ck, "1")
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        false,
        false,
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let o = with_closed(&["ckpt", "inspect", ck.to_str().unwrap()], true, false);
    assert_eq!(o.status.code(), Some(0), "inspect: {}", text(&o.stderr));
    let out = t.path().join("w3");
    let o = with_closed(
        &[
            "ckpt",
            "reshard",
            ck.to_str().unwrap(),
            "--world-size",
            "3",
            "-o",
            out.to_str().unwrap(),
        ],
        true,
        false,
    );
    assert_eq!(o.status.code(), Some(0), "reshard: {}", text(&o.stderr));
    let r = Checkpoint::open(&out, Verify::Checksums).unwrap();
    assert_eq!(
        r.manifest().world_size,
        3,
        "the resharded checkpoint is written"
    );
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/tokenizers");
    let bin = t.path().join("tokens.bin");
    let o = with_closed(
        &[
            "data",
            "tokenize",
            "--tokenizer",
            &format!("{data}/gpt2_bytelevel.json"),
            &format!("{data}/text.txt"),
            "-o",
            bin.to_str().unwrap(),
        ],
        true,
        false,
    );
    assert_eq!(o.status.code(), Some(0), "tokenize: {}", text(&o.stderr));
    assert_eq!(
        std::fs::read(&bin).unwrap(),
        std::fs::read(format!("{data}/gpt2_bytelevel.text.bin")).unwrap(),
        "the token file is written"
    );
}

//! `fsdp train | head -1`: when the reader of standard output goes away, the run ends quietly
//! with exit status 141 (128 + SIGPIPE, as a shell reports a process killed by a broken pipe)
//! instead of panicking with a backtrace.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

#[test]
fn closed_stdout_ends_the_run_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args([
            "train",
            "--steps",
            "200",
            "--micro-batch",
            "2",
            "--seq-len",
            "32",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start fsdp train");
    let stdout = child.stdout.take().expect("stdout");
    let mut first = String::new();
    BufReader::new(stdout)
        .read_line(&mut first)
        .expect("first line");
    assert!(first.starts_with('{'), "first line: {first}");
    // The reader is dropped here: every later write sees a broken pipe.
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "stderr: {stderr}");
    assert!(!stderr.contains("Broken pipe"), "stderr: {stderr}");
}

//! `fsdp train --log-file PATH`: every line the run prints is appended to PATH as it happens,
//! also after the terminal (stdout and stderr) is gone; a directory that does not exist is
//! refused (exit 2) before training.

use std::process::{Command, Stdio};

fn args(log: &std::path::Path, steps: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "train",
        "--micro-batch",
        "1",
        "--seq-len",
        "16",
        "--warmup",
        "1",
        "--eval-batches",
        "1",
        "--threads-per-rank",
        "1",
        "--steps",
        steps,
        "--log-every",
        "2",
        "--log-file",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.push(log.display().to_string());
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

#[test]
fn the_log_file_holds_every_line_printed() {
    let t = tempfile::tempdir().unwrap();
    let log = t.path().join("train.log");
    let ck = t.path().join("ck");
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args(
            &log,
            "5",
            &["--ckpt-dir", ck.to_str().unwrap(), "--ckpt-every", "4"],
        ))
        .output()
        .unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(o.status.code(), Some(0), "{err}");
    let logged = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = logged.lines().collect();
    // Every line of both streams, in the order each stream printed them.
    for stream in [&out, &err] {
        let mut at = 0;
        for l in stream.lines() {
            let found = lines[at..].iter().position(|x| *x == l);
            assert!(
                found.is_some(),
                "{l:?} is not in the log (after line {at}):\n{logged}"
            );
            at += found.unwrap() + 1;
        }
    }
    let steps: Vec<&str> = lines
        .iter()
        .filter(|l| l.starts_with("step "))
        .map(|l| l.split(" | ").next().unwrap())
        .collect();
    assert_eq!(steps, ["step 2/5", "step 4/5", "step 5/5"], "{logged}");
    assert!(logged.contains("saved step 4 to "), "{logged}");
    assert!(logged.contains("trained tiny ("), "{logged}");
    assert!(
        lines[0].starts_with("== ") && lines[0].contains("--log-file"),
        "{logged}"
    );
    // A second run appends.
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args(&log, "5", &[]))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0));
    let again = std::fs::read_to_string(&log).unwrap();
    assert!(again.starts_with(&logged), "the first run's lines are kept");
    assert_eq!(again.matches("trained tiny (").count(), 2, "{again}");
}

#[test]
fn the_log_file_keeps_the_run_after_its_terminal_is_gone() {
    let t = tempfile::tempdir().unwrap();
    let log = t.path().join("train.log");
    let ck = t.path().join("ck");
    let closed = || {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        Stdio::from(writer)
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args(&log, "40", &["--ckpt-dir", ck.to_str().unwrap()]))
        .stdout(closed())
        .stderr(closed())
        .spawn()
        .unwrap();
    // The terminal closing hangs the process up (once it trains).
    let t0 = std::time::Instant::now();
    while !std::fs::read_to_string(&log).is_ok_and(|s| s.contains("step 2/40 |")) {
        assert!(t0.elapsed().as_secs() < 120, "no step 2 in the log");
        if let Some(s) = child.try_wait().unwrap() {
            panic!("ended ({s}) before step 2");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY: a plain syscall on the pid of a child this test started.
    assert_eq!(
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGHUP) },
        0
    );
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{status}");
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(logged.contains("step 40/40 |"), "{logged}");
    assert!(logged.contains("saved step 40 to "), "{logged}");
    assert!(logged.contains("trained tiny ("), "{logged}");
}

#[test]
fn a_log_file_in_a_missing_directory_is_refused_before_training() {
    let t = tempfile::tempdir().unwrap();
    let log = t.path().join("no-such-dir").join("train.log");
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args(&log, "5", &[]))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!(
            "--log-file {}: the directory {} does not exist",
            log.display(),
            log.parent().unwrap().display()
        )),
        "{err}"
    );
    assert!(o.stdout.is_empty(), "nothing trained");
}

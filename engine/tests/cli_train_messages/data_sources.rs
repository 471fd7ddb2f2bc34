//! Training text from anywhere: standard input, a FIFO, an empty pipe, and a data file
//! truncated while training (read whole at the start: a warning naming the file and the step,
//! never a signal).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

/// A short, fast run on `--data DATA`.
fn args(data: &str, steps: &str) -> Vec<String> {
    [
        "train",
        "--data",
        data,
        "--steps",
        steps,
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
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// 20 KiB of real text.
fn text() -> Vec<u8> {
    let line =
        b"From fairest creatures we desire increase, that thereby beauty's rose might never die.\n";
    line.iter().copied().cycle().take(20 << 10).collect()
}

#[test]
fn stdin_is_read_whole_with_a_progress_line() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args("/dev/stdin", "2"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&text()).unwrap();
    drop(stdin);
    let o = child.wait_with_output().unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(
        err.contains("read 20,480 bytes from /dev/stdin (a pipe or FIFO) into memory"),
        "{err}"
    );
    assert!(
        out.contains("trained tiny") && out.contains("on /dev/stdin"),
        "{out}"
    );
}

#[test]
fn an_empty_pipe_is_refused_with_the_reason() {
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args("/dev/stdin", "2"))
        .stdin(Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("/dev/stdin (a pipe or FIFO) ended without giving a byte"),
        "{err}"
    );
}

#[test]
fn a_fifo_is_read_whole() {
    let t = tempfile::tempdir().unwrap();
    let fifo = t.path().join("corpus.fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let writer = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::write(fifo, text()).unwrap())
    };
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args(fifo.to_str().unwrap(), "2"))
        .output()
        .unwrap();
    writer.join().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(err.contains("read 20,480 bytes from"), "{err}");
}

#[test]
fn truncating_the_data_file_while_training_warns_and_finishes() {
    let t = tempfile::tempdir().unwrap();
    let data = t.path().join("corpus.txt");
    std::fs::write(&data, text()).unwrap();
    let mut a = args(data.to_str().unwrap(), "400");
    a.push("--json".into());
    let mut child = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(&a)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // 400 JSON lines do not fit a pipe's buffer: the run cannot finish before the test reads
    // on, so the file is truncated mid-run.
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    assert!(first.starts_with("{\"step\":1,"), "{first}");
    std::fs::write(&data, b"").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "no signal, no error: {err}");
    assert!(
        err.contains(&format!(
            "warning: --data {} changed on disk by step ",
            data.display()
        )) && err.contains("(was 20,480 bytes, now 0 bytes); training continues on the copy"),
        "{err}"
    );
    assert!(rest.contains("\"summary\":true"), "{rest}");
}

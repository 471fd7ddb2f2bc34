//! `fsdp launch` end to end on the CPU: N real child processes with torchrun's environment,
//! every output line prefixed with its rank, a failing rank's exit code returned and the other
//! ranks stopped at once (but given time to finish a stop on a signal), Ctrl-C forwarded, bad
//! input exiting 2.

use std::collections::BTreeSet;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn fsdp() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fsdp"))
}

fn launch(args: &[&str]) -> (Output, Duration) {
    let t0 = Instant::now();
    let o = fsdp()
        .arg("launch")
        .args(args)
        .output()
        .expect("run fsdp launch");
    (o, t0.elapsed())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The lines of `out` that rank `r` wrote, prefix removed.
fn rank_lines(out: &str, r: usize) -> Vec<String> {
    let p = format!("[rank {r}] ");
    out.lines()
        .filter_map(|l| l.strip_prefix(&p).map(str::to_string))
        .collect()
}

#[test]
fn cli_launch_two_ranks_of_plan_print_prefixed_outputs() {
    let plain = fsdp()
        .args(["plan", "--model", "tiny", "--world-size", "2"])
        .output()
        .unwrap();
    assert!(plain.status.success(), "{}", text(&plain.stderr));
    let want: Vec<String> = text(&plain.stdout).lines().map(str::to_string).collect();
    assert!(want.len() > 3);
    let (o, _) = launch(&[
        "--nproc",
        "2",
        "--master-port",
        "29611",
        "--",
        "plan",
        "--model",
        "tiny",
        "--world-size",
        "2",
    ]);
    let out = text(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}\n{}", text(&o.stderr));
    for r in 0..2 {
        assert_eq!(rank_lines(&out, r), want, "rank {r}'s lines");
    }
    // Every stdout line is some rank's.
    assert!(out
        .lines()
        .all(|l| l.starts_with("[rank 0] ") || l.starts_with("[rank 1] ")));
}

#[test]
fn cli_launch_sets_torchruns_environment() {
    let (o, _) = launch(&[
        "--nproc",
        "3",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        "29612",
        "--program",
        "sh",
        "--",
        "-c",
        "echo $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT; echo to-stderr >&2; printf no-newline",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    let err = text(&o.stderr);
    for r in 0..3 {
        assert_eq!(
            rank_lines(&out, r),
            vec![
                format!("{r} {r} 3 3 127.0.0.1 29612"),
                "no-newline".to_string()
            ],
            "{out}"
        );
        assert_eq!(rank_lines(&err, r), vec!["to-stderr".to_string()], "{err}");
    }
}

#[test]
fn cli_launch_returns_the_failing_ranks_code_and_stops_the_others_promptly() {
    let (o, took) = launch(&[
        "--nproc",
        "3",
        "--master-port",
        "29613",
        "--program",
        "sh",
        "--",
        "-c",
        "if [ \"$RANK\" = 1 ]; then sleep 0.3; echo giving up >&2; exit 3; fi; exec sleep 60",
    ]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        took < Duration::from_secs(20),
        "took {took:?}: the sleeping ranks were not stopped"
    );
    assert!(err.contains("[rank 1] giving up"), "{err}");
    assert!(
        err.contains("fsdp launch: rank 1 exited with code 3; stopped ranks [0, 2]"),
        "{err}"
    );
}

/// A rank that exits 143 (`fsdp train` stopped by SIGTERM after the step every rank agreed
/// on) is not a failure of the others: they finish their own stop (here rank 0 prints after
/// 0.5 s) before the launcher exits with 143.
#[test]
fn cli_launch_lets_the_ranks_finish_a_stop_on_a_signal() {
    let (o, took) = launch(&[
        "--nproc",
        "2",
        "--master-port",
        "29616",
        "--program",
        "sh",
        "--",
        "-c",
        "if [ \"$RANK\" = 1 ]; then exit 143; fi; sleep 0.5; echo saved; exit 143",
    ]);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(143), "{err}");
    assert_eq!(
        rank_lines(&out, 0),
        ["saved"],
        "rank 0 finished:\n{out}\n{err}"
    );
    assert!(took < Duration::from_secs(20), "{took:?}");
    assert!(
        err.contains("fsdp launch: rank 1 stopped by SIGTERM (exit 143); waited up to 30 s for ranks [0] to finish; stopped ranks []"),
        "{err}"
    );
}

#[test]
fn cli_launch_of_a_failing_fsdp_command_exits_with_its_code() {
    // Every rank gets bad input: `train` exits 2 and says why, prefixed by its rank.
    let (o, _) = launch(&[
        "--nproc",
        "2",
        "--master-port",
        "29614",
        "--",
        "train",
        "--world-size",
        "0",
    ]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    let first_failed: BTreeSet<usize> = (0..2)
        .filter(|&r| rank_lines(&err, r).iter().any(|l| l.starts_with("error:")))
        .collect();
    assert!(!first_failed.is_empty(), "{err}");
    assert!(err.contains("exited with code 2"), "{err}");
}

#[test]
fn cli_launch_forwards_ctrl_c_to_every_rank() {
    let child = fsdp()
        .args([
            "launch",
            "--nproc",
            "2",
            "--master-port",
            "29615",
            "--program",
            "sh",
            "--",
            "-c",
            "trap 'echo got INT; exit 7' INT; echo ready; sleep 30 & wait",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Let both ranks install their trap.
    std::thread::sleep(Duration::from_millis(700));
    let t0 = Instant::now();
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let o = child.wait_with_output().unwrap();
    let out = text(&o.stdout);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(130), "{out}\n{err}");
    assert!(t0.elapsed() < Duration::from_secs(9), "{:?}", t0.elapsed());
    for r in 0..2 {
        assert_eq!(rank_lines(&out, r), vec!["ready", "got INT"], "{out}");
    }
    assert!(
        err.contains("received SIGINT; forwarding it to ranks [0, 1]"),
        "{err}"
    );
}

#[test]
fn cli_launch_bad_input_exits_2() {
    let (o, _) = launch(&["--nproc", "0", "--", "plan"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("--nproc must be at least 1"));
    let (o, _) = launch(&["--nproc", "2"]);
    assert_eq!(o.status.code(), Some(2), "no command after --");
    assert!(
        text(&o.stderr).contains("no command for the ranks"),
        "{}",
        text(&o.stderr)
    );
    // A --program may run without arguments.
    let (o, _) = launch(&[
        "--nproc",
        "2",
        "--master-port",
        "29616",
        "--program",
        "true",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let (o, _) = launch(&[
        "--nproc",
        "2",
        "--program",
        "/nonexistent/fsdp-rank",
        "--",
        "x",
    ]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("cannot start rank 0 (/nonexistent/fsdp-rank)"),
        "{err}"
    );
}

/// A process count past the per-node limit is bad input, refused before any process starts.
#[test]
fn cli_launch_refuses_more_processes_than_a_node_runs() {
    let started = Instant::now();
    let o = fsdp()
        .args(["launch", "--nproc", "100000", "--program", "/bin/true"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--nproc 100000 exceeds the limit of 1024 processes per node"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
}

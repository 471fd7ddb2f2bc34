//! `fsdp launch --max-restarts` / `--min-nproc` end to end on the CPU: failed attempts
//! restarted with the cause on stderr and `TORCHELASTIC_RESTART_COUNT` counting them, the
//! failing code once the restarts are spent, the elastic drop of a lost device slot, a user's
//! SIGTERM never restarted, peers of a rank stopped by SIGTERM given the grace to finish, a
//! closed launcher output, and a real `fsdp train` killed mid-run that resumes from its newest
//! checkpoint and ends bitwise equal to an uninterrupted run.
//!
//! The ranks are `sh -c` scripts (`--program sh`) reading the launcher's environment, except
//! the training test, which runs this `fsdp` executable's `train` as the only rank (the rank
//! threads of the in-process backend: `fsdp launch` has no CPU process-per-rank backend).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn fsdp() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_fsdp"));
    // The elastic test maps LOCAL_RANK to devices through CUDA_VISIBLE_DEVICES.
    c.env_remove("CUDA_VISIBLE_DEVICES");
    c
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `fsdp launch ARGS --program sh -- -c SCRIPT`.
fn launch_sh(args: &[&str], script: &str) -> (Output, Duration) {
    let t0 = Instant::now();
    let o = fsdp()
        .arg("launch")
        .args(args)
        .args(["--program", "sh", "--", "-c", script])
        .output()
        .expect("run fsdp launch");
    (o, t0.elapsed())
}

/// The lines of `out` that rank `r` wrote, prefix removed.
fn rank_lines(out: &str, r: usize) -> Vec<String> {
    let p = format!("[rank {r}] ");
    out.lines()
        .filter_map(|l| l.strip_prefix(&p).map(str::to_string))
        .collect()
}

/// The launcher's own lines (`fsdp launch: ...`), prefix removed.
fn launcher_lines(err: &str) -> Vec<String> {
    err.lines()
        .filter_map(|l| l.strip_prefix("fsdp launch: ").map(str::to_string))
        .collect()
}

#[test]
fn a_failing_rank_restarts_the_job_with_its_cause_and_the_restart_count() {
    // Rank 1 exits 5 in the first attempt and is killed by SIGKILL in the second; the third
    // succeeds. Rank 0 waits to be stopped in the failing attempts.
    let script = r#"echo "attempt $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS"
if [ "$TORCHELASTIC_RESTART_COUNT" -lt 2 ]; then
  if [ "$RANK" = 1 ]; then
    sleep 0.5
    if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then exit 5; else kill -9 $$; fi
  fi
  exec sleep 60
fi
echo done"#;
    let (o, took) = launch_sh(
        &[
            "--nproc",
            "2",
            "--master-port",
            "29631",
            "--max-restarts",
            "3",
        ],
        script,
    );
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    assert!(took < Duration::from_secs(30), "took {took:?}");
    for r in 0..2 {
        assert_eq!(
            rank_lines(&out, r),
            vec!["attempt 0 of 3", "attempt 1 of 3", "attempt 2 of 3", "done"],
            "{out}"
        );
    }
    assert_eq!(
        launcher_lines(&err),
        vec![
            "rank 1 exited with code 5; stopped ranks [0]",
            "restart 1/3: rank 1 exited with code 5; rerunning the command",
            "rank 1 killed by SIGKILL; stopped ranks [0]",
            "restart 2/3: rank 1 killed by SIGKILL; rerunning the command",
        ],
        "{err}"
    );
}

#[test]
fn spent_restarts_exit_with_the_failing_code() {
    let (o, _) = launch_sh(
        &[
            "--nproc",
            "2",
            "--master-port",
            "29632",
            "--max-restarts",
            "2",
        ],
        r#"echo "attempt $TORCHELASTIC_RESTART_COUNT"; if [ "$RANK" = 0 ]; then exit 7; fi; exec sleep 60"#,
    );
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(7), "{out}\n{err}");
    assert_eq!(
        rank_lines(&out, 0),
        vec!["attempt 0", "attempt 1", "attempt 2"],
        "three attempts: the first and two restarts\n{out}"
    );
    assert_eq!(
        launcher_lines(&err),
        vec![
            "rank 0 exited with code 7; stopped ranks [1]",
            "restart 1/2: rank 0 exited with code 7; rerunning the command",
            "rank 0 exited with code 7; stopped ranks [1]",
            "restart 2/2: rank 0 exited with code 7; rerunning the command",
            "rank 0 exited with code 7; stopped ranks [1]",
            "rank 0 exited with code 7; no restart left (--max-restarts 2): exiting with code 7",
        ],
        "{err}"
    );
}

#[test]
fn a_slot_that_fails_at_start_up_twice_is_dropped_for_a_smaller_world() {
    // Device 1 of 3 is broken: two attempts fail at its rank, then the job runs on devices
    // 0 and 2 at world size 2.
    let (o, _) = launch_sh(
        &[
            "--nproc",
            "3",
            "--min-nproc",
            "2",
            "--max-restarts",
            "3",
            "--master-port",
            "29633",
        ],
        // The device of LOCAL_RANK: its CUDA_VISIBLE_DEVICES entry, or LOCAL_RANK itself.
        r#"d=$(echo "${CUDA_VISIBLE_DEVICES:-0,1,2,3}" | cut -d, -f$((LOCAL_RANK + 1)))
if [ "$d" = 1 ]; then echo "device $d unavailable" >&2; exit 4; fi
if [ "$WORLD_SIZE" = 3 ]; then exec sleep 60; fi
echo "rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK device=$d restart=$TORCHELASTIC_RESTART_COUNT""#,
    );
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    assert_eq!(
        rank_lines(&out, 0),
        vec!["rank=0 world=2 local=0 device=0 restart=2"],
        "{out}"
    );
    assert_eq!(
        rank_lines(&out, 1),
        vec!["rank=1 world=2 local=1 device=2 restart=2"],
        "{out}"
    );
    assert!(rank_lines(&out, 2).is_empty(), "{out}");
    let lines = launcher_lines(&err);
    assert_eq!(
        lines[1], "restart 1/3: rank 1 exited with code 4; rerunning the command",
        "{err}"
    );
    assert_eq!(
        lines[3],
        "restart 2/3: rank 1 exited with code 4; device slot 1 is lost (its rank failed first \
         within 60 s of the start in 2 consecutive attempts): continuing at world size 2 on \
         slots [0, 2]; rerunning the command",
        "{err}"
    );
    assert_eq!(lines.len(), 4, "{err}");

    // Device 1 broken, and device 2 as soon as the world is 2, at least 2 ranks: after slot 1,
    // slot 2 (now rank 1) is lost too and one slot is left.
    let (o, _) = launch_sh(
        &[
            "--nproc",
            "3",
            "--min-nproc",
            "2",
            "--max-restarts",
            "9",
            "--master-port",
            "29634",
        ],
        r#"d=$(echo "${CUDA_VISIBLE_DEVICES:-0,1,2,3}" | cut -d, -f$((LOCAL_RANK + 1)))
if [ "$d" = 1 ] || { [ "$d" = 2 ] && [ "$WORLD_SIZE" = 2 ]; }; then exit 4; fi
exec sleep 60"#,
    );
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let last = launcher_lines(&err).pop().unwrap();
    assert_eq!(
        last,
        "rank 1 exited with code 4; device slot 2 is lost (its rank failed first within 60 s \
         of the start in 2 consecutive attempts), and only 1 device slots can run a rank, \
         fewer than --min-nproc 2: exiting with code 1",
        "{err}"
    );
    assert!(
        err.contains("restart 3/9: rank 1 exited with code 4; rerunning the command"),
        "{err}"
    );
}

#[test]
fn a_failure_after_the_start_up_window_keeps_the_slot() {
    // Rank 1 fails every attempt, but after the (zero) start-up window: the world stays 2.
    let (o, _) = launch_sh(
        &[
            "--nproc",
            "2",
            "--min-nproc",
            "1",
            "--max-restarts",
            "2",
            "--startup-window",
            "0",
            "--master-port",
            "29635",
        ],
        r#"echo "world $WORLD_SIZE"; if [ "$RANK" = 1 ]; then sleep 0.5; exit 6; fi; exec sleep 60"#,
    );
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(6), "{out}\n{err}");
    assert_eq!(rank_lines(&out, 0), vec!["world 2"; 3], "{out}");
    assert!(!err.contains("lost"), "{err}");
}

#[test]
fn a_users_sigterm_to_the_launcher_is_forwarded_and_never_restarted() {
    let child = fsdp()
        .args([
            "launch",
            "--nproc",
            "2",
            "--max-restarts",
            "3",
            "--master-port",
            "29636",
            "--program",
            "sh",
            "--",
            "-c",
            "trap 'echo got TERM; exit 143' TERM; echo ready $TORCHELASTIC_RESTART_COUNT; sleep 30 & wait",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    let t0 = Instant::now();
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let o = child.wait_with_output().unwrap();
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(143), "{out}\n{err}");
    assert!(t0.elapsed() < Duration::from_secs(9), "{:?}", t0.elapsed());
    for r in 0..2 {
        assert_eq!(rank_lines(&out, r), vec!["ready 0", "got TERM"], "{out}");
    }
    assert!(!err.contains("restart"), "{err}");
    assert!(
        err.contains("received SIGTERM; forwarding it to ranks [0, 1]"),
        "{err}"
    );
}

#[test]
fn peers_of_a_rank_stopped_by_sigterm_get_the_grace_to_finish() {
    // Rank 1 stops by itself with 143 (it was signalled); rank 0 needs 1.5 s more to finish
    // (as a final checkpoint would) and is not killed before.
    let (o, _) = launch_sh(
        &["--nproc", "2", "--master-port", "29637", "--grace", "20"],
        r#"if [ "$RANK" = 1 ]; then exit 143; fi; sleep 1.5; echo "rank 0 finished its save"; exit 143"#,
    );
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(143), "{out}\n{err}");
    assert_eq!(
        rank_lines(&out, 0),
        vec!["rank 0 finished its save"],
        "{out}"
    );
    assert_eq!(
        launcher_lines(&err),
        vec![
            "rank 1 stopped by SIGTERM (exit 143); waited up to 20 s for ranks [0] to finish; \
             stopped ranks []"
        ],
        "{err}"
    );
}

#[test]
fn a_closed_launcher_output_neither_kills_the_launcher_nor_blocks_the_ranks() {
    let t = tempfile::tempdir().unwrap();
    // 4000 lines per rank on each stream (~100 KiB): more than a pipe holds, so a launcher
    // that stopped reading would block the ranks.
    let script = format!(
        r#"i=0; while [ $i -lt 4000 ]; do echo "line $i of rank $RANK"; echo "diagnostic $i" >&2; i=$((i+1)); done; touch "{}/done-$RANK""#,
        t.path().display()
    );
    let mut child = fsdp()
        .args([
            "launch",
            "--nproc",
            "2",
            "--master-port",
            "29638",
            "--program",
            "sh",
            "--",
            "-c",
            &script,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read one line (as `| head -1`), then close both ends.
    let mut first = String::new();
    {
        use std::io::BufRead;
        let mut r = std::io::BufReader::new(child.stdout.take().unwrap());
        r.read_line(&mut first).unwrap();
    }
    drop(child.stderr.take());
    assert!(first.starts_with("[rank "), "{first}");
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the launcher did not finish after its output closed"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0), "{status:?}");
    for r in 0..2 {
        assert!(t.path().join(format!("done-{r}")).exists(), "rank {r}");
    }
}

/// Processes whose parent is `pid` (from `/proc`).
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let ppid = rest.split_whitespace().nth(1).and_then(|s| s.parse().ok());
        if ppid == Some(pid) {
            out.push(p);
        }
    }
    out
}

fn train_args(ckpt: &Path) -> Vec<String> {
    [
        "train",
        "--model",
        "tiny",
        "--world-size",
        "2",
        "--steps",
        "40",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--eval-batches",
        "1",
        "--eval-every",
        "0",
        "--threads-per-rank",
        "1",
        "--ckpt-every",
        "4",
        "--keep-last",
        "2",
        "--ckpt-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([ckpt.display().to_string()])
    .collect()
}

/// Every file of the newest checkpoint under `root`, by name.
fn newest_files(root: &Path) -> Vec<(String, Vec<u8>)> {
    let name = std::fs::read_to_string(root.join("latest")).unwrap();
    let dir: PathBuf = root.join(name.trim());
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

#[test]
fn a_killed_training_rank_resumes_from_the_newest_checkpoint_bitwise() {
    let t = tempfile::tempdir().unwrap();
    let ck = t.path().join("ck");
    let mut launcher = fsdp()
        .args([
            "launch",
            "--nproc",
            "1",
            "--max-restarts",
            "2",
            "--master-port",
            "29639",
            "--",
        ])
        .args(train_args(&ck))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Kill the rank once its first checkpoint is in place.
    let t0 = Instant::now();
    while !ck.join("latest").exists() {
        assert!(t0.elapsed() < Duration::from_secs(120), "no checkpoint");
        std::thread::sleep(Duration::from_millis(10));
    }
    let rank = children_of(launcher.id());
    assert_eq!(rank.len(), 1, "one rank process: {rank:?}");
    assert!(Command::new("kill")
        .args(["-KILL", &rank[0].to_string()])
        .status()
        .unwrap()
        .success());
    let err_pipe = launcher.stderr.take().unwrap();
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::BufReader::new(err_pipe), &mut s).unwrap();
        s
    });
    let out = launcher.wait_with_output().unwrap();
    let err = err_reader.join().unwrap();
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains(
            "fsdp launch: restart 1/2: rank 0 killed by SIGKILL; resuming from the newest \
             intact checkpoint (--resume-from latest-valid)"
        ),
        "{err}"
    );
    assert!(err.contains("[rank 0] resuming from"), "{err}");
    // The uninterrupted run, without the launcher.
    let reference = t.path().join("reference");
    let o = fsdp().args(train_args(&reference)).output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let (got, want) = (newest_files(&ck), newest_files(&reference));
    assert_eq!(
        got.iter().map(|f| &f.0).collect::<Vec<_>>(),
        want.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    for ((name, a), (_, b)) in got.iter().zip(&want) {
        assert!(a == b, "{name} differs from the uninterrupted run's");
    }
    assert_eq!(
        std::fs::read_to_string(ck.join("latest")).unwrap().trim(),
        "step-00000040"
    );
}

#[test]
fn restart_flags_are_checked_before_anything_starts() {
    let run = |args: &[&str]| {
        let o = fsdp().arg("launch").args(args).output().unwrap();
        (o.status.code(), text(&o.stderr))
    };
    let (code, err) = run(&["--nproc", "2", "--min-nproc", "3", "--", "plan"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--min-nproc 3 must be from 1 to --nproc 2"),
        "{err}"
    );
    let (code, err) = run(&["--nproc", "2", "--min-nproc", "1", "--", "plan"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("add --max-restarts N"), "{err}");
    let (code, err) = run(&["--nproc", "2", "--startup-window", "-1", "--", "plan"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--startup-window must be"), "{err}");
    // MPI ranks come from mpirun: N launched processes would be N one-rank jobs.
    let (code, err) = run(&["--nproc", "2", "--", "train", "--backend", "mpi"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("mpirun -n 2 fsdp train --backend mpi"),
        "{err}"
    );
    // Bad input of an fsdp subcommand is not restarted.
    let (code, err) = run(&[
        "--nproc",
        "1",
        "--max-restarts",
        "3",
        "--master-port",
        "29640",
        "--",
        "train",
        "--world-size",
        "0",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(
            "fsdp launch: rank 0 exited with code 2 (bad input): not restarting, the same \
             command would be refused again"
        ),
        "{err}"
    );
    assert!(!err.contains("restart 1/"), "{err}");
    // Restarts of a train command that saves nothing begin from step 0: said at the start.
    let (code, err) = run(&[
        "--nproc",
        "1",
        "--max-restarts",
        "1",
        "--master-port",
        "29641",
        "--",
        "train",
        "--model",
        "tiny",
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
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        err.starts_with(
            "fsdp launch: warning: --max-restarts 1 with a train command without --ckpt-dir: \
             nothing is saved, so a restart trains again from step 0"
        ),
        "{err}"
    );
}

#[test]
fn a_training_rank_stopped_under_the_launcher_prints_the_launch_command_to_resume() {
    let t = tempfile::tempdir().unwrap();
    let ck = t.path().join("ck");
    let launcher_args = [
        "launch",
        "--nproc",
        "1",
        "--max-restarts",
        "2",
        "--master-port",
        "29642",
        "--",
    ];
    let mut train = train_args(&ck);
    // Long enough to be stopped in the middle.
    train[6] = "400".into();
    let launcher = fsdp()
        .args(launcher_args)
        .args(&train)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Stop the job once it saved a checkpoint: the launcher forwards SIGTERM to the rank.
    let t0 = Instant::now();
    while !ck.join("latest").exists() {
        assert!(t0.elapsed() < Duration::from_secs(120), "no checkpoint");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(Command::new("kill")
        .args(["-TERM", &launcher.id().to_string()])
        .status()
        .unwrap()
        .success());
    let o = launcher.wait_with_output().unwrap();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(143), "{err}");
    // The launcher's own command line with --resume: rerunning it resumes the job under
    // the launcher (the rank's own `fsdp train ...` would run without it).
    let mut want: Vec<String> = std::iter::once(env!("CARGO_BIN_EXE_fsdp").to_string())
        .chain(launcher_args.iter().map(|s| s.to_string()))
        .chain(train.iter().cloned())
        .collect();
    want.push("--resume".into());
    let want = shlex::try_join(want.iter().map(String::as_str)).unwrap();
    let lines = rank_lines(&err, 0);
    let at = lines
        .iter()
        .position(|l| l.ends_with("resume with:"))
        .unwrap_or_else(|| panic!("no resume command: {err}"));
    assert_eq!(lines[at + 1].trim(), want, "{err}");
}

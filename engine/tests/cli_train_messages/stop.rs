//! SIGTERM / SIGINT on `fsdp train`: every rank stops after the same step, saves it, says
//! where and how to resume, and exits 128 + signal; the resumed run equals an uninterrupted
//! one bit for bit; a second signal (a second or more after the first) exits at once, a copy
//! within a second is the same stop; without `--ckpt-dir` nothing is saved and the run says
//! so.

use super::running::{step_losses, Running};
use fsdp_checkpoints::{list_checkpoints, Checkpoint, StateKind, Verify};
use std::path::Path;

const STEPS: u64 = 40;

/// A tiny run on 2 rank threads, JSON lines, checkpoints (only the last step's unless a
/// signal stops it earlier) under `ckpt`.
fn args(ckpt: Option<&Path>, model: &str, steps: u64, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "train",
        "--model",
        model,
        "--world-size",
        "2",
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
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(["--steps".to_string(), steps.to_string()]);
    if let Some(c) = ckpt {
        a.extend(["--ckpt-dir".to_string(), c.display().to_string()]);
    }
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// Every state buffer of the newest checkpoint under `root`, consolidated, as bits, and the
/// bytes of its rank files.
fn state(root: &Path) -> (u64, Vec<u32>, Vec<Vec<u8>>) {
    let ck = Checkpoint::open(root, Verify::Checksums).unwrap();
    ck.verify_all().unwrap();
    let mut bits = Vec::new();
    for kind in StateKind::ALL {
        for t in ck.consolidate(kind).unwrap() {
            bits.extend(t.data.iter().map(|x| x.to_bits()));
        }
    }
    let mut files: Vec<_> = std::fs::read_dir(ck.dir())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    assert_eq!(files.len(), 2, "{files:?}");
    let bytes = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    (ck.manifest().train.step, bits, bytes)
}

fn stopped_event(lines: &[String]) -> serde_json::Value {
    lines
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"] == "stopped")
        .unwrap_or_else(|| panic!("no stopped event in {lines:?}"))
}

#[test]
fn sigterm_saves_the_step_it_stops_after_and_the_resume_equals_an_uninterrupted_run() {
    let t = tempfile::tempdir().unwrap();
    // Uninterrupted.
    let a = t.path().join("a");
    let (code, la_lines, err) = {
        let r = Running::start(&args(Some(&a), "tiny", STEPS, &[]));
        r.finish()
    };
    assert_eq!(code, 0, "{err}");
    let la = step_losses(&la_lines);
    assert_eq!(la.len(), STEPS as usize);
    // SIGTERM once step 3 is reported.
    let b = t.path().join("b");
    let mut run = Running::start(&args(Some(&b), "tiny", STEPS, &[]));
    run.until(|v| v["step"].as_u64().is_some_and(|s| s >= 3) && v.get("event").is_none());
    run.signal(libc::SIGTERM);
    let (code, lines, err) = run.finish();
    assert_eq!(code, 143, "a run stopped by SIGTERM exits 143:\n{err}");
    // The signal is acknowledged when it arrives, before the stop's own report.
    let ack = err
        .find(
            "fsdp train: SIGTERM received: stopping every rank after the current step (saved \
             when --ckpt-dir is set); signal again to exit at once\n",
        )
        .unwrap_or_else(|| panic!("no acknowledgement of the signal:\n{err}"));
    assert!(
        err.find("stopped by SIGTERM after step")
            .is_some_and(|at| ack < at),
        "{err}"
    );
    let stop = stopped_event(&lines);
    let k = stop["step"].as_u64().unwrap();
    let lb = step_losses(&lines);
    assert!((3..STEPS).contains(&k), "stopped after step {k}: {lines:?}");
    assert_eq!(
        lb.last().map(|s| s.0),
        Some(k),
        "the last step reported is the step stopped after"
    );
    assert_eq!(
        lb,
        la[..k as usize],
        "steps 1..={k} equal the uninterrupted run"
    );
    let want = b.join(format!("step-{k:08}"));
    assert_eq!(stop["checkpoint"], want.display().to_string(), "{stop}");
    let saved: Vec<u64> = list_checkpoints(&b)
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(saved, [k], "only the stop's checkpoint (no --ckpt-every)");
    assert_eq!(state(&b).0, k, "latest is the stop's checkpoint");
    assert!(
        err.contains(&format!(
            "stopped by SIGTERM after step {k} of {STEPS}: saved the checkpoint of step {k} to {}",
            want.display()
        )),
        "{err}"
    );
    // The command printed resumes the run; it ends where the uninterrupted run ended.
    let resume = stop["resume"].as_str().unwrap();
    assert!(err.contains(resume), "{err}");
    let words = shlex::split(resume).unwrap();
    assert_eq!(words[0], env!("CARGO_BIN_EXE_fsdp"));
    assert_eq!(words.last().map(String::as_str), Some("--resume"));
    let (code, lc_lines, err) = Running::start(&words[1..]).finish();
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(&format!("resuming from {}", want.display())),
        "{err}"
    );
    assert_eq!(
        step_losses(&lc_lines),
        la[k as usize..],
        "steps {}..={STEPS} after the resume equal the uninterrupted run, bit for bit",
        k + 1
    );
    let (sa, sb) = (state(&a), state(&b));
    assert_eq!(sb.0, STEPS);
    assert!(
        sa.1 == sb.1,
        "parameters and both moments at step {STEPS}, bit for bit"
    );
    assert!(sa.2 == sb.2, "rank files of step {STEPS}, byte for byte");
}

#[test]
fn a_second_signal_exits_at_once_and_the_newest_checkpoint_stays_intact() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join("ck");
    // A save after every step (mini: 40 MiB a checkpoint), so the signals land in saves too.
    let mut run = Running::start(&args(
        Some(&d),
        "mini",
        100_000,
        &["--ckpt-every", "1", "--keep-last", "3"],
    ));
    run.until(|v| v["event"] == "checkpoint" && v["step"].as_u64().is_some_and(|s| s >= 2));
    run.signal(libc::SIGTERM);
    run.wait_delivered();
    // The second signal comes more than a second later (a copy within a second is the same
    // request), with the run frozen meanwhile so that it cannot finish its stop first.
    run.signal(libc::SIGSTOP);
    std::thread::sleep(std::time::Duration::from_millis(1200));
    run.signal(libc::SIGTERM);
    run.signal(libc::SIGCONT);
    let (code, lines, err) = run.finish();
    assert_eq!(code, 143, "{err}");
    assert!(
        err.contains("second signal: exiting now without a final checkpoint"),
        "{err}"
    );
    assert!(
        !err.contains("stopped by") && !lines.iter().any(|l| l.contains("\"stopped\"")),
        "the second signal did not wait for the stop: {err}"
    );
    // The newest checkpoint `latest` names opens and verifies; it is the newest reported.
    let newest_reported = lines
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "checkpoint")
        .filter_map(|v| v["step"].as_u64())
        .max()
        .unwrap();
    let ck = Checkpoint::open(&d, Verify::Checksums).unwrap();
    ck.verify_all().unwrap();
    let latest = ck.manifest().train.step;
    assert!(
        latest == newest_reported || latest == newest_reported + 1,
        "latest is step {latest}, the newest save reported step {newest_reported}"
    );
}

/// A launcher forwarding the SIGTERM a scheduler also sent to every process of the job: two
/// signals within a second are one stop, saved.
#[test]
fn a_copy_of_the_signal_within_a_second_is_the_same_stop() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join("ck");
    let mut run = Running::start(&args(Some(&d), "tiny", 100_000, &[]));
    run.until(|v| v["step"].as_u64().is_some_and(|s| s >= 2));
    run.signal(libc::SIGTERM);
    run.wait_delivered();
    run.signal(libc::SIGTERM);
    let (code, lines, err) = run.finish();
    assert_eq!(code, 143, "{err}");
    let k = stopped_event(&lines)["step"].as_u64().unwrap();
    assert!(!err.contains("second signal"), "{err}");
    assert_eq!(state(&d).0, k, "the stop saved step {k}");
}

#[test]
fn sigint_without_a_checkpoint_directory_says_nothing_is_saved() {
    let t = tempfile::tempdir().unwrap();
    let log = t.path().join("train.log");
    let mut run = Running::start(&args(
        None,
        "tiny",
        100_000,
        &["--log-file", log.to_str().unwrap()],
    ));
    run.until(|v| v["step"].as_u64().is_some_and(|s| s >= 2));
    run.signal(libc::SIGINT);
    let (code, lines, err) = run.finish();
    assert_eq!(code, 130, "a run stopped by SIGINT exits 130:\n{err}");
    let stop = stopped_event(&lines);
    let k = stop["step"].as_u64().unwrap();
    assert_eq!(stop["signal"], "SIGINT");
    assert!(
        stop["checkpoint"].is_null() && stop["resume"].is_null(),
        "{stop}"
    );
    let msg =
        format!("stopped by SIGINT after step {k} of 100000: nothing was saved (no --ckpt-dir)");
    assert!(err.contains(&msg), "{err}");
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains(&msg),
        "the log file has the stop message:\n{logged}"
    );
    // The acknowledgement names the signal, on standard error and in the log.
    let ack = "fsdp train: SIGINT received: stopping every rank after the current step";
    assert!(err.contains(ack), "{err}");
    assert!(logged.contains(ack), "{logged}");
}

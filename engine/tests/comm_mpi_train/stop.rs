//! `fsdp train --backend mpi` stopped by a SIGTERM to ONE of its processes: both agree on
//! the step to stop after, save it, exit 143, and the resumed job ends with the losses and
//! rank files of an uninterrupted run, bit for bit (the MPI backend equals the thread backend
//! bit for bit, so the uninterrupted run is the rank threads').

use super::{children, mpi_command, mpirun, train_args, wait_bounded, JOBS};
use fsdp_checkpoints::{list_checkpoints, Checkpoint, Verify};
use std::io::Read;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const STEPS: u64 = 60;

fn args(extra: &[&str]) -> Vec<String> {
    let mut a = train_args(extra);
    let i = a.iter().position(|x| x == "--steps").unwrap();
    a[i + 1] = STEPS.to_string();
    a
}

/// `(step, loss bits)` of the step lines of `--json` output.
fn losses(stdout: &str) -> Vec<(u64, u64)> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("step").is_some() && v.get("event").is_none())
        .map(|v| {
            (
                v["step"].as_u64().unwrap(),
                v["loss"].as_f64().unwrap().to_bits(),
            )
        })
        .collect()
}

/// The step of the newest checkpoint under `root` (verified) and its rank files' bytes.
fn rank_files(root: &Path) -> (u64, Vec<Vec<u8>>) {
    let ck = Checkpoint::open(root, Verify::Checksums).unwrap();
    ck.verify_all().unwrap();
    let mut files: Vec<_> = std::fs::read_dir(ck.dir())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    assert_eq!(files.len(), 2, "{files:?}");
    (
        ck.manifest().train.step,
        files.iter().map(|f| std::fs::read(f).unwrap()).collect(),
    )
}

#[test]
fn mpi_train_sigterm_to_one_process_stops_both_after_one_step_and_resumes_exactly() {
    let Some(mpirun) = mpirun() else {
        println!("SKIPPED: mpirun not found (install openmpi-bin)");
        return;
    };
    let _one = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let t = tempfile::tempdir().unwrap();
    // Uninterrupted, on 2 rank threads.
    let a = t.path().join("a");
    let out = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args(&[
            "--world-size",
            "2",
            "--ckpt-dir",
            a.to_str().unwrap(),
        ]))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let la = losses(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(la.len(), STEPS as usize);
    // Under MPI: SIGTERM to rank 1's process once rank 0 reported step 2.
    let b = t.path().join("b");
    let b_args = args(&["--backend", "mpi", "--ckpt-dir", b.to_str().unwrap()]);
    let mut child = mpi_command(&mpirun, 2, &b_args).spawn().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let (mut buf, mut all) = ([0u8; 4096], Vec::new());
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            all.extend_from_slice(&buf[..n]);
            let _ = tx.send(String::from_utf8_lossy(&all).to_string());
        }
        String::from_utf8_lossy(&all).to_string()
    });
    let started = Instant::now();
    let mut seen = String::new();
    while !seen.contains("\"step\":2,") {
        assert!(started.elapsed() < Duration::from_secs(120), "{seen}");
        if let Ok(s) = rx.recv_timeout(Duration::from_millis(200)) {
            seen = s;
        }
    }
    let procs = children(child.id());
    assert_eq!(procs.len(), 2, "two MPI processes under mpirun: {procs:?}");
    assert!(Command::new("kill")
        .args(["-TERM", &procs[1].to_string()])
        .status()
        .unwrap()
        .success());
    let (out, _) = wait_bounded(child, Duration::from_secs(120), "the job after a SIGTERM");
    let stdout = reader.join().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{stdout}\n{stderr}");
    let stop = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"] == "stopped")
        .unwrap_or_else(|| panic!("no stopped event:\n{stdout}\n{stderr}"));
    let k = stop["step"].as_u64().unwrap();
    assert!((2..STEPS).contains(&k), "stopped after step {k}");
    assert_eq!(stop["signal"], "SIGTERM", "rank 0 names rank 1's signal");
    assert_eq!(losses(&stdout), la[..k as usize], "steps 1..={k}");
    let saved: Vec<u64> = list_checkpoints(&b)
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(saved, [k], "both ranks saved step {k}, and only it");
    assert_eq!(rank_files(&b).0, k);
    let resume = stop["resume"].as_str().unwrap();
    assert!(
        resume.starts_with("mpirun -n 2 ") && resume.ends_with(" --resume"),
        "{resume}"
    );
    // The resumed job (the same command line with --resume) ends where the threads ended.
    let mut resumed = b_args.clone();
    resumed.push("--resume".into());
    let child = mpi_command(&mpirun, 2, &resumed).spawn().unwrap();
    let (out, _) = wait_bounded(child, Duration::from_secs(180), "the resumed job");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        losses(&stdout),
        la[k as usize..],
        "steps {}..={STEPS}",
        k + 1
    );
    let (sa, sb) = (rank_files(&a), rank_files(&b));
    assert_eq!(sb.0, STEPS);
    assert!(sa.1 == sb.1, "rank files of step {STEPS}, byte for byte");
    println!("stopped after step {k} of {STEPS} by a SIGTERM to one process; resumed exactly");
}

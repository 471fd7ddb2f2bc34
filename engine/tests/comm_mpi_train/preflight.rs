//! `fsdp train --backend mpi`: the memory pre-flight and `--strategy auto` under `mpirun`.
//! Every rank gathers every rank's (available memory, node) once and decides on that same
//! table, so a run that does not fit is refused by every rank with exit code 2 and the same
//! message before training (no rank waits for a peer that quit), and auto resolves to the
//! same strategy on every rank (their plan fingerprints agree, so the run trains).

use super::{mpi_command, mpirun, train_args, wait_bounded, JOBS, STEPS};
use std::process::Command;
use std::time::Duration;

fn set(args: &mut [String], flag: &str, value: &str) {
    let i = args.iter().position(|a| a == flag).unwrap();
    args[i + 1] = value.into();
}

#[test]
fn mpi_preflight_refuses_a_run_that_does_not_fit_on_every_rank_with_exit_2() {
    let Some(mpirun) = mpirun() else {
        println!("SKIPPED: mpirun not found (install openmpi-bin)");
        return;
    };
    if fsdp::preflight::available_memory().is_none() {
        println!("SKIPPED: no /proc/meminfo (the pre-flight is skipped by design)");
        return;
    }
    let _one = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    // A million sequences per micro-batch: far more than this node holds for 2 ranks.
    let mut args = train_args(&["--backend", "mpi"]);
    set(&mut args, "--micro-batch", "1000000");
    let child = mpi_command(&mpirun, 2, &args)
        .spawn()
        .expect("start mpirun");
    let (out, took) = wait_bounded(child, Duration::from_secs(60), "a refused MPI job");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let msg = "not enough memory on the node of MPI rank 0 (2 of 2 ranks are short): 2 rank(s) \
               on the node x peak";
    assert_eq!(
        stderr.matches(msg).count(),
        2,
        "both ranks refuse with the same message:\n{stderr}"
    );
    assert!(stderr.contains("--micro-batch 1000000"), "{stderr}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("\"step\""));
    println!("refused on both ranks in {:.2} s", took.as_secs_f64());
}

#[test]
fn mpi_auto_resolves_the_same_strategy_on_every_rank_and_trains_like_threads() {
    let Some(mpirun) = mpirun() else {
        println!("SKIPPED: mpirun not found (install openmpi-bin)");
        return;
    };
    if fsdp::preflight::available_memory().is_none() {
        println!("SKIPPED: no /proc/meminfo (auto needs --device-memory)");
        return;
    }
    let _one = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let child = mpi_command(
        &mpirun,
        2,
        &train_args(&["--backend", "mpi", "--strategy", "auto"]),
    )
    .spawn()
    .expect("start mpirun");
    let (out, _) = wait_bounded(child, Duration::from_secs(180), "mpirun -n 2 auto");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let summary = lines.iter().find(|l| l["summary"] == true).unwrap();
    assert_eq!(summary["strategy_requested"], "auto");
    // tiny fits without sharding on any machine that can run this test.
    assert_eq!(summary["strategy"], "no-shard", "{summary}");
    let source = summary["memory_budget_source"].as_str().unwrap();
    assert!(
        source.starts_with("the smallest share of the MPI ranks' nodes: MemAvailable")
            && source.contains("/ 2 rank(s) there"),
        "{source}"
    );
    assert!(summary["auto_reason"]
        .as_str()
        .unwrap()
        .starts_with("no-shard is the fastest strategy and fits"));
    let mpi: Vec<u64> = lines
        .iter()
        .filter(|l| l.get("step").is_some())
        .map(|l| l["loss"].as_f64().unwrap().to_bits())
        .collect();
    assert_eq!(mpi.len(), STEPS as usize);
    let out = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(train_args(&["--world-size", "2", "--strategy", "no-shard"]))
        .output()
        .unwrap();
    assert!(out.status.success());
    let threads: Vec<u64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|l| l.get("step").is_some())
        .map(|l| l["loss"].as_f64().unwrap().to_bits())
        .collect();
    assert_eq!(
        mpi, threads,
        "auto under MPI = no-shard on threads, bit for bit"
    );
}

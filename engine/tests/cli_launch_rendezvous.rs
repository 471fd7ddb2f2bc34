//! `fsdp launch` + the comm rendezvous across real processes: the bootstrap path of the NCCL
//! backend without a GPU. The test starts `fsdp launch --nproc 3 --program <this test binary>`;
//! each child (marked by `FSDP_TEST_RENDEZVOUS_CHILD`) reads torchrun's environment, joins the
//! rendezvous on MASTER_ADDR:MASTER_PORT, receives rank 0's 128-byte id (as the NCCL unique id
//! travels) and all-gathers one message per rank; the parent checks every rank's prefixed output.
//! A second test restarts the job after rank 1 fails past the rendezvous: the new attempt's
//! rank 0 binds the same master port again.

use fsdp_comm::rendezvous::{LaunchEnv, Rendezvous};
use std::process::Command;
use std::time::Duration;

const CHILD: &str = "FSDP_TEST_RENDEZVOUS_CHILD";
/// Set for the restart test: rank 1 of the first attempt exits 3 after the rendezvous.
const FAIL_FIRST: &str = "FSDP_TEST_RENDEZVOUS_FAIL_FIRST";

fn child() {
    let env = LaunchEnv::from_env().expect("torchrun environment from fsdp launch");
    let mut rv = Rendezvous::connect(&env, Duration::from_secs(30)).expect("rendezvous");
    let id: Vec<u8> = (0..128u8).map(|i| i ^ 0x5a).collect();
    let got = if env.rank == 0 {
        rv.broadcast_bytes(Some(&id))
    } else {
        rv.broadcast_bytes(None)
    }
    .expect("id");
    assert_eq!(got, id);
    let all = rv
        .all_gather_bytes(format!("hello from {}", env.rank).as_bytes())
        .expect("all-gather");
    let all: Vec<String> = all
        .iter()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .collect();
    let restart = std::env::var("TORCHELASTIC_RESTART_COUNT").unwrap_or_default();
    println!(
        "RDV rank={} world={} local_rank={} id_ok={} all={} restart={restart}",
        env.rank,
        env.world_size,
        env.local_rank,
        got == id,
        all.join("|")
    );
    if std::env::var_os(FAIL_FIRST).is_some() && restart == "0" && env.rank == 1 {
        std::process::exit(3);
    }
}

#[test]
fn cli_launch_rendezvous_across_processes() {
    if std::env::var_os(CHILD).is_some() {
        child();
        return;
    }
    let me = std::env::current_exe().expect("this test binary");
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .env(CHILD, "1")
        .args([
            "launch",
            "--nproc",
            "3",
            "--master-port",
            "29621",
            "--program",
        ])
        .arg(&me)
        .args([
            "--",
            "--exact",
            "cli_launch_rendezvous_across_processes",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .expect("run fsdp launch");
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    for r in 0..3 {
        // The test harness may print `test NAME ... ` before the child's line.
        let prefix = format!("[rank {r}] ");
        let want = format!(
            "RDV rank={r} world=3 local_rank={r} id_ok=true \
             all=hello from 0|hello from 1|hello from 2 restart=0"
        );
        assert!(
            out.lines()
                .any(|l| l.starts_with(&prefix) && l.ends_with(&want)),
            "missing `{prefix}...{want}` in:\n{out}"
        );
    }
}

#[test]
fn cli_launch_rendezvous_binds_the_same_port_after_a_restart() {
    if std::env::var_os(CHILD).is_some() {
        child();
        return;
    }
    let me = std::env::current_exe().expect("this test binary");
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .env(CHILD, "1")
        .env(FAIL_FIRST, "1")
        .args([
            "launch",
            "--nproc",
            "2",
            "--max-restarts",
            "1",
            "--master-port",
            "29622",
            "--program",
        ])
        .arg(&me)
        .args([
            "--",
            "--exact",
            "cli_launch_rendezvous_binds_the_same_port_after_a_restart",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .expect("run fsdp launch");
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    assert!(
        err.contains("fsdp launch: restart 1/1: rank 1 exited with code 3; rerunning the command"),
        "{err}"
    );
    // Both attempts met on port 29622.
    for restart in 0..2 {
        for r in 0..2 {
            let want = format!(
                "RDV rank={r} world=2 local_rank={r} id_ok=true \
                 all=hello from 0|hello from 1 restart={restart}"
            );
            assert!(
                out.lines()
                    .any(|l| l.starts_with(&format!("[rank {r}] ")) && l.ends_with(&want)),
                "missing `{want}` in:\n{out}"
            );
        }
    }
}

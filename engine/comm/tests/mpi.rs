//! The conformance suite on the MPI backend with 2 and 4 processes: each test starts
//! `mpirun --oversubscribe -n N` on the `mpi_conformance` example (built by `cargo test
//! --features mpi`) and requires every check to pass. Without Open MPI's launcher each test
//! prints "SKIPPED: mpirun not found" (shown with `--nocapture`) and passes, unless
//! `FSDP_REQUIRE_MPI=1` is set: then it fails (`.ci/mpi-tests` sets it).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One MPI job at a time: the machine has few cores.
static JOBS: Mutex<()> = Mutex::new(());

/// `mpirun` on `PATH`; `None` (the caller skips) when there is none, unless
/// `FSDP_REQUIRE_MPI=1` is set: then a missing launcher fails the test.
fn mpirun() -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("mpirun"))
            .find(|f| f.is_file())
    });
    assert!(
        found.is_some() || !std::env::var("FSDP_REQUIRE_MPI").is_ok_and(|v| v == "1"),
        "FSDP_REQUIRE_MPI=1 but mpirun is not on PATH"
    );
    found
}

fn example() -> PathBuf {
    // target/<profile>/deps/<this test> -> target/<profile>/examples/mpi_conformance
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    dir.join("examples").join("mpi_conformance")
}

fn run_conformance(n: usize) {
    let Some(mpirun) = mpirun() else {
        println!(
            "SKIPPED: mpirun not found (install openmpi-bin to run the MPI conformance suite)"
        );
        return;
    };
    let _one = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let exe = example();
    assert!(
        exe.is_file(),
        "{} is missing: run `cargo test -p fsdp-comm --features mpi` (it builds the example)",
        exe.display()
    );
    let start = Instant::now();
    let mut child = Command::new(mpirun)
        .args(["--oversubscribe", "-n", &n.to_string()])
        .arg(&exe)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start mpirun");
    // Bound the job: a hang is a failure, not a stuck CI.
    let limit = Duration::from_secs(240);
    loop {
        if child.try_wait().expect("poll mpirun").is_some() {
            break;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("MPI conformance with {n} processes did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().expect("mpirun output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "mpirun -n {n} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let want = format!("checks passed on {n} processes");
    assert!(stdout.contains(&want), "no `{want}` in:\n{stdout}");
    assert!(!stdout.contains("FAILED"), "{stdout}");
}

#[test]
fn mpi_conformance_2_processes() {
    run_conformance(2);
}

#[test]
fn mpi_conformance_4_processes() {
    run_conformance(4);
}

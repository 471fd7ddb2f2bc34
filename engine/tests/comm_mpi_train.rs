//! `fsdp train --backend mpi` under `mpirun` (feature `mpi`): parity with the thread backend and
//! the single-process reference, and a killed process ending the job instead of hanging.
//!
//! Parity is bitwise: the MPI backend moves raw contributions (`MPI_Alltoall`) and adds them
//! in rank order with the same f32 arithmetic as the thread backend, so the tiny GPT's losses
//! and global gradient norms over 5 steps are the same f64 bits on 2 MPI processes, on 2 rank
//! threads and in the single-process reference (`fsdp_testing::reference::Reference`, which
//! sums per-rank gradients in rank order). Clipping is off (`--clip 0`) because the reference
//! computes the clip norm in a different order (that case is tolerance-checked by the thread
//! backend's own parity tests).
//!
//! Module `preflight`: the MPI memory pre-flight (a run that does not fit refused by every
//! rank with exit 2) and `--strategy auto` resolved alike on every rank. Module `stop`: a
//! SIGTERM to one process stops both after the same step, saved, and the resume is exact.
//!
//! Without Open MPI's launcher each test prints "SKIPPED: mpirun not found" (shown with
//! `--nocapture`) and passes, unless `FSDP_REQUIRE_MPI=1` is set: then it fails
//! (`.ci/mpi-tests`, which installs Open MPI, sets it).

use candle_core::Device;
use fsdp::data::{Sampler, SamplerConfig, TextData};
use fsdp::model::Gpt;
use fsdp::optim::{AdamWConfig, LrSchedule, Optimizer};
use fsdp::runtime::MicroBatch;
use fsdp_planner::GradSync;
use fsdp_testing::reference::Reference;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[path = "comm_mpi_train/preflight.rs"]
mod preflight;

#[path = "comm_mpi_train/stop.rs"]
mod stop;

static JOBS: Mutex<()> = Mutex::new(());

const STEPS: u64 = 5;
const SEED: u64 = 1337;
const LR: f64 = 3e-3;
const MIN_LR: f64 = 3e-4;
const WARMUP: u64 = 2;
const B: usize = 2;
const T: usize = 32;

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

fn data_path() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/tinyshakespeare.txt"
    )
    .to_string()
}

fn train_args(extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "train",
        "--model",
        "tiny",
        "--data",
        &data_path(),
        "--steps",
        &STEPS.to_string(),
        "--seq-len",
        &T.to_string(),
        "--micro-batch",
        &B.to_string(),
        "--lr",
        &LR.to_string(),
        "--min-lr",
        &MIN_LR.to_string(),
        "--warmup",
        &WARMUP.to_string(),
        "--clip",
        "0",
        "--seed",
        &SEED.to_string(),
        "--eval-batches",
        "1",
        "--threads-per-rank",
        "1",
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn mpi_command(mpirun: &PathBuf, n: usize, args: &[String]) -> Command {
    let mut c = Command::new(mpirun);
    c.args(["--oversubscribe", "-n", &n.to_string()])
        .arg(env!("CARGO_BIN_EXE_fsdp"))
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Waits for `child` at most `limit`; kills it and panics past that.
fn wait_bounded(mut child: Child, limit: Duration, what: &str) -> (Output, Duration) {
    let start = Instant::now();
    loop {
        if child.try_wait().expect("poll child").is_some() {
            let out = child.wait_with_output().expect("child output");
            return (out, start.elapsed());
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("child output");
            panic!(
                "{what} still running after {limit:?} (a hang):\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `(loss, grad_norm)` of every step line of `fsdp train --json` output (the norm is `None`
/// when clipping is off and the engine does not compute it), `STEPS` of them.
fn steps(out: &Output, what: &str) -> Vec<(f64, Option<f64>)> {
    let v = step_lines(out, what);
    assert_eq!(
        v.len(),
        STEPS as usize,
        "{what}: step lines in\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    v
}

/// As [`steps`], however many steps ran.
fn step_lines(out: &Output, what: &str) -> Vec<(f64, Option<f64>)> {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Vec<(f64, Option<f64>)> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        // Step lines; a checkpoint's line also names its step, under an "event".
        .filter(|j| j.get("step").is_some() && j.get("event").is_none())
        .map(|j| (j["loss"].as_f64().unwrap(), j["grad_norm"].as_f64()))
        .collect();
    v
}

/// The single-process reference on the sampler's micro-batches of a world of `w` ranks.
fn reference_losses(w: usize) -> Vec<f64> {
    let model = Gpt::from_preset("tiny").unwrap();
    let text = TextData::open(data_path()).unwrap();
    let sampler = Sampler::new(
        text,
        SamplerConfig {
            seq_len: T,
            micro_batch: B,
            grad_accum: 1,
            world_size: w,
            seed: SEED,
        },
    )
    .unwrap();
    let opt = Optimizer::AdamW(AdamWConfig {
        lr: LR,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    });
    let sched = LrSchedule {
        peak: LR,
        min: MIN_LR,
        warmup: WARMUP,
        total: STEPS,
    };
    let mut r = Reference::new(&model, model.init_params(SEED), opt);
    (0..STEPS)
        .map(|step| {
            let row: Vec<MicroBatch> = (0..w)
                .map(|rank| {
                    let b = sampler.micro_batch(step, 0, rank);
                    let (input, target) = b.to_tensors(&Device::Cpu).unwrap();
                    MicroBatch {
                        input,
                        target,
                        count: b.tokens() as u64,
                    }
                })
                .collect();
            r.step(
                &[row],
                w,
                GradSync::EveryMicroBatch,
                None,
                sched.lr(step + 1),
            )
            .unwrap()
        })
        .collect()
}

#[test]
fn mpi_train_2_processes_bitwise_equals_threads_and_reference() {
    let Some(mpirun) = mpirun() else {
        println!("SKIPPED: mpirun not found (install openmpi-bin)");
        return;
    };
    let _one = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let child = mpi_command(&mpirun, 2, &train_args(&["--backend", "mpi"]))
        .spawn()
        .expect("start mpirun");
    let (out, _) = wait_bounded(child, Duration::from_secs(180), "mpirun -n 2 fsdp train");
    let mpi = steps(&out, "mpirun -n 2 fsdp train --backend mpi");
    let out = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(train_args(&["--world-size", "2"]))
        .output()
        .expect("run fsdp");
    let threads = steps(&out, "fsdp train --world-size 2");
    let reference = reference_losses(2);
    for s in 0..STEPS as usize {
        assert_eq!(
            mpi[s].0.to_bits(),
            threads[s].0.to_bits(),
            "step {}: loss on MPI {} vs threads {}",
            s + 1,
            mpi[s].0,
            threads[s].0
        );
        assert_eq!(
            mpi[s].1.map(f64::to_bits),
            threads[s].1.map(f64::to_bits),
            "step {}: grad norm on MPI {:?} vs threads {:?}",
            s + 1,
            mpi[s].1,
            threads[s].1
        );
        assert_eq!(
            mpi[s].0.to_bits(),
            reference[s].to_bits(),
            "step {}: loss on MPI {} vs single-process reference {}",
            s + 1,
            mpi[s].0,
            reference[s]
        );
    }
    assert!(mpi[4].0 < mpi[0].0, "loss falls: {mpi:?}");
    println!("MPI == threads == reference over {STEPS} steps: losses {mpi:?}");
}

/// A Llama started from a Hugging Face model directory under MPI: 2 MPI processes start from
/// exactly the directory's weights (a step with a negligible learning rate saves them bitwise)
/// and give the same losses, bit for bit, as 2 rank threads starting from the same directory.
#[test]
fn mpi_train_llama_from_a_model_directory_equals_threads() {
    let Some(mpirun) = mpirun() else {
        println!("SKIPPED: mpirun not found (install openmpi-bin)");
        return;
    };
    let _one = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = std::env::temp_dir().join(format!("fsdp-mpi-llama-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let llama = |extra: &[&str]| -> Vec<String> {
        let mut a = train_args(extra);
        let i = a.iter().position(|x| x == "tiny").unwrap();
        a[i] = "llama-tiny".into();
        a
    };
    // Weights to start from: a short run's checkpoint, exported as a model directory.
    let ck = tmp.join("ck");
    let out = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(llama(&[
            "--ckpt-dir",
            ck.to_str().unwrap(),
            "--ckpt-every",
            "5",
        ]))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "fsdp train --model llama-tiny --ckpt-dir: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = tmp.join("hf");
    let st = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args([
            "ckpt",
            "consolidate",
            ck.to_str().unwrap(),
            "-o",
            dir.to_str().unwrap(),
        ])
        .status()
        .unwrap();
    assert!(st.success());
    let from = ["--init-from", dir.to_str().unwrap()];
    let child = mpi_command(
        &mpirun,
        2,
        &llama(&[&["--backend", "mpi"], &from[..]].concat()),
    )
    .spawn()
    .expect("start mpirun");
    let (out, _) = wait_bounded(child, Duration::from_secs(180), "mpirun -n 2 fsdp train");
    let mpi = steps(&out, "mpirun -n 2 fsdp train --backend mpi --init-from");
    let out = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(llama(&[&["--world-size", "2"], &from[..]].concat()))
        .output()
        .unwrap();
    let threads = steps(&out, "fsdp train --world-size 2 --init-from");
    let bits = |v: &[(f64, Option<f64>)]| v.iter().map(|x| x.0.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&mpi),
        bits(&threads),
        "MPI {mpi:?} vs threads {threads:?}"
    );
    // The MPI processes used the directory's weights: one step with a negligible learning
    // rate saves every parameter bitwise as the directory holds it.
    let saved_ck = tmp.join("again");
    let mut again = llama(&[&["--backend", "mpi"], &from[..]].concat());
    for (flag, value) in [("--lr", "1e-30"), ("--min-lr", "1e-30"), ("--steps", "1")] {
        let i = again.iter().position(|x| x == flag).unwrap();
        again[i + 1] = value.into();
    }
    again.push("--ckpt-dir".to_string());
    again.push(saved_ck.to_str().unwrap().to_string());
    let child = mpi_command(&mpirun, 2, &again)
        .spawn()
        .expect("start mpirun");
    let (out, _) = wait_bounded(child, Duration::from_secs(180), "mpirun -n 2 fsdp train");
    assert_eq!(
        step_lines(
            &out,
            "mpirun -n 2 fsdp train --backend mpi --init-from --lr 1e-30"
        )
        .len(),
        1
    );
    let source = fsdp_checkpoints::read_full(&dir.join("model.safetensors"))
        .unwrap()
        .tensors;
    let saved = fsdp_checkpoints::Checkpoint::open(&saved_ck, fsdp_checkpoints::Verify::Checksums)
        .unwrap()
        .consolidate(fsdp_checkpoints::StateKind::Param)
        .unwrap();
    assert_eq!(saved.len(), source.len());
    for t in &saved {
        let want: Vec<u32> = source[&t.name].data.iter().map(|x| x.to_bits()).collect();
        let found: Vec<u32> = t.data.iter().map(|x| x.to_bits()).collect();
        assert!(
            found == want,
            "{}: saved under MPI differs from the directory",
            t.name
        );
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

/// PIDs of the direct children of `pid` (the MPI processes of a single-node `mpirun`).
fn children(pid: u32) -> Vec<u32> {
    let mut v = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                v.extend(s.split_whitespace().filter_map(|x| x.parse::<u32>().ok()));
            }
        }
    }
    v
}

#[test]
fn mpi_train_killed_process_ends_the_job_with_an_error() {
    let Some(mpirun) = mpirun() else {
        println!("SKIPPED: mpirun not found (install openmpi-bin)");
        return;
    };
    let _one = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let (child, procs) = start_long_run(&mpirun, &[]);
    let victim = procs[1];
    let status = Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let killed_at = Instant::now();
    // The survivor must end, with an error, well within the collective timeout (60 s).
    let (out, _) = wait_bounded(child, Duration::from_secs(60), "the job after a kill");
    let took = killed_at.elapsed();
    assert!(
        !out.status.success(),
        "mpirun exited successfully after a process was killed"
    );
    // Open MPI ends the survivors with SIGTERM, then SIGKILL: a rank now handles SIGTERM (it
    // asks its peers to stop after the step), so it may outlive mpirun by the moment until
    // that SIGKILL lands; none may live on.
    let gone = |p: &u32| {
        !std::path::Path::new(&format!("/proc/{p}/status")).exists()
            || std::fs::read_to_string(format!("/proc/{p}/status"))
                .map(|s| s.contains("State:\tZ"))
                .unwrap_or(true)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !procs.iter().all(gone) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    for p in &procs {
        assert!(gone(p), "process {p} still alive 10 s after the job ended");
    }
    println!(
        "killed pid {victim}; job ended with {} after {:.2} s",
        out.status,
        took.as_secs_f64()
    );
}

/// Starts a long `mpirun -n 2 fsdp train --backend mpi` run with `extra` flags and returns it
/// once rank 0 printed step 2, with the PIDs of its two MPI processes.
fn start_long_run(mpirun: &PathBuf, extra: &[&str]) -> (Child, Vec<u32>) {
    let mut all = vec!["--backend", "mpi"];
    all.extend_from_slice(extra);
    let mut args = train_args(&all);
    let i = args.iter().position(|a| a == "--steps").unwrap();
    args[i + 1] = "100000".into();
    let mut child = mpi_command(mpirun, 2, &args).spawn().expect("start mpirun");
    let mut stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::Read;
        let mut buf = [0u8; 4096];
        let mut all = Vec::new();
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            all.extend_from_slice(&buf[..n]);
            let _ = tx.send(String::from_utf8_lossy(&all).to_string());
        }
    });
    let started = Instant::now();
    let mut seen = String::new();
    while !seen.contains("\"step\":2,") {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "training did not start: {seen}"
        );
        if let Ok(s) = rx.recv_timeout(Duration::from_millis(200)) {
            seen = s;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "mpirun ended early: {seen}"
        );
    }
    let procs = children(child.id());
    assert_eq!(procs.len(), 2, "two MPI processes under mpirun: {procs:?}");
    (child, procs)
}

/// A rank that stops (SIGSTOP: alive, so Open MPI sees no failure) makes the other rank fail
/// with the collective timeout (`--comm-timeout 4`) and end the job non-zero: the backend's own
/// watchdog, not the launcher, prevents the hang.
#[test]
fn mpi_train_stopped_process_times_out_and_ends_the_job() {
    let Some(mpirun) = mpirun() else {
        println!("SKIPPED: mpirun not found (install openmpi-bin)");
        return;
    };
    let _one = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let (child, procs) = start_long_run(&mpirun, &["--comm-timeout", "4"]);
    let victim = procs[1];
    assert!(Command::new("kill")
        .args(["-STOP", &victim.to_string()])
        .status()
        .expect("kill -STOP")
        .success());
    let stopped_at = Instant::now();
    let (out, _) = wait_bounded(child, Duration::from_secs(60), "the job after a SIGSTOP");
    let took = stopped_at.elapsed();
    // Never leave a stopped process behind, whatever happened.
    let _ = Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "job succeeded with a stopped rank");
    assert!(
        took >= Duration::from_secs(3) && took < Duration::from_secs(30),
        "job ended {took:?} after the stop (timeout 4 s):\n{stderr}"
    );
    assert!(
        stderr.contains("timed out") || stderr.contains("did not complete within"),
        "rank 0's error names the timeout:\n{stderr}"
    );
    println!(
        "stopped pid {victim}; job ended with {} after {:.2} s",
        out.status,
        took.as_secs_f64()
    );
}

#[test]
fn mpi_calibrate_measures_the_mpi_collectives_and_rank_0_writes_one_profile() {
    let Some(mpirun) = mpirun() else {
        println!("SKIPPED: mpirun not found (install openmpi-bin)");
        return;
    };
    let _one = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("mpi.json");
    let args: Vec<String> = [
        "calibrate",
        "--backend",
        "mpi",
        "--compute-fit",
        "off",
        "-o",
        path.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let child = mpi_command(&mpirun, 2, &args)
        .spawn()
        .expect("start mpirun");
    let (out, _) = wait_bounded(
        child,
        Duration::from_secs(180),
        "mpirun -n 2 fsdp calibrate",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&path).unwrap();
    let p = fsdp_planner::time::HardwareProfile::from_json(&text, "mpi.json").unwrap();
    // Two processes on this host; every collective's source names MPI, not the threads.
    assert_eq!(p.ranks_per_node, 2);
    for kind in ["all_gather", "reduce_scatter", "all_reduce"] {
        let s = &p.sources[&format!("collectives.intra_node.{kind}.bus_bandwidth_bytes_per_s")];
        assert!(
            s.contains("MPI over the job's processes") && s.contains("2 processes"),
            "{s}"
        );
        assert!(!s.contains("thread backend"), "{s}");
    }
    // Only rank 0 wrote: the directory holds the one profile.
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
}

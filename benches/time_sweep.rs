//! The step-time model's error on this machine: predicted against measured step time over a
//! sweep of configurations, with the mean absolute percentage error (MAPE).
//!
//! 1. At the start of every round, `fsdp calibrate --world-size W` for W = 1, 2, 4: one
//!    profile per world size and round (on a CPU every rank's rates are its share of the
//!    cores; a VM's speed drifts by tens of percent over minutes, so a round predicts from
//!    its own calibration, and the summary also gives every round's error against the first
//!    round's profiles), each with its compute fit and rank skew from reference jobs
//!    (`tiny`, `llama-tiny`, `small`, `mini` at their own shapes: see `engine/src/calibrate/fit.rs`;
//!    `mini` also runs in the sweep, at other shapes; the other sweep models are not references); for the MPI rows `mpirun -n W fsdp
//!    calibrate --backend mpi` (MPI's collectives, reference jobs as MPI processes).
//! 2. Every configuration of [`configs`] (GPT-2 presets `mini`, `small`, `base` and the Llama
//!    of `benches/llama-bench/config.json` and `llama-mini`; W = 1, 2, 4; full shard,
//!    shard-grad-op, shard-optimizer, no shard, hybrid; prefetch 0/1/2; activation
//!    checkpointing; gradient accumulation with sync every micro-batch and last; optimizer
//!    and parameter offload; bf16; the thread backend and, with an MPI build, MPI) runs
//!    `fsdp train ... --hardware <profile of its W> --json` for [`STEPS`] steps, in
//!    [`ROUNDS`] interleaved rounds. Measured: per run the median step time and exposed
//!    communication over the steps after the first [`SKIPPED`], then the median over the
//!    rounds (the spread is the lowest and highest run against that median); predicted: the
//!    summary's `step_time` (the plan's prediction on the round's profile); the error is the
//!    median over rounds of each run's measured step against its round's prediction.
//! 3. Prints one row per configuration (predicted and measured step time and exposed
//!    communication, the error, the spread over rounds, and the share of CPU time the
//!    hypervisor stole from this VM during its runs, `steal` of `/proc/stat`: a measurement
//!    taken while another tenant held the host's cores is slower than the calibration
//!    predicts, and this says when), then MAPE, the largest error and how many
//!    configurations are within 25%; one JSON line per configuration.
//!
//! Run: `cargo build --release -p fsdp` (and, for the MPI rows,
//! `CARGO_TARGET_DIR=target-mpi cargo build --release -p fsdp --features mpi`), then
//! `cargo bench -p fsdp-suite --bench time_sweep`. Environment: `FSDP_BIN` (default
//! `target/release/fsdp`), `FSDP_MPI_BIN` (default `target-mpi/release/fsdp`; MPI rows are
//! left out, with a line saying so, when it or `mpirun` is missing), `FSDP_SWEEP_STEPS`, `FSDP_SWEEP_ROUNDS`,
//! `FSDP_SWEEP_ONLY` (a substring of configuration names), `FSDP_SWEEP_PROFILES` (a
//! directory of `w1.json`, `w2.json`, `w4.json`, `mpi-w2.json`: calibrated into once when
//! missing, then used by every round instead of calibrating per round).

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Steps per configuration and round.
const STEPS: u64 = 8;
/// Rounds: the whole sweep runs this many times, configurations interleaved, so a slow
/// moment of the machine hits one run of a configuration, not all of them.
const ROUNDS: usize = 3;
/// Steps not counted at the start (first touch of buffers, allocator growth).
const SKIPPED: u64 = 2;

/// One configuration of the sweep.
struct Config {
    name: String,
    world_size: u64,
    mpi: bool,
    args: Vec<String>,
}

fn cfg(name: &str, world_size: u64, args: &str) -> Config {
    Config {
        name: name.into(),
        world_size,
        mpi: false,
        args: args.split_whitespace().map(String::from).collect(),
    }
}

fn mpi(mut c: Config) -> Config {
    c.mpi = true;
    c.name = format!("{} mpi", c.name);
    c
}

/// The sweep (see the module doc).
fn configs() -> Vec<Config> {
    let mini = "--model mini --seq-len 128 --micro-batch 4";
    let small = "--model small --seq-len 128 --micro-batch 4";
    let base = "--model base --seq-len 128 --micro-batch 2";
    let llama = "--hf-config benches/llama-bench/config.json --seq-len 128 --micro-batch 2";
    let lmini = "--model llama-mini --seq-len 128 --micro-batch 4";
    let fs = "--strategy full-shard";
    vec![
        cfg(
            "mini W1",
            1,
            "--model mini --seq-len 128 --micro-batch 8 --strategy no-shard",
        ),
        cfg("mini W2 full-shard p1", 2, &format!("{mini} {fs}")),
        cfg(
            "mini W2 full-shard p0",
            2,
            &format!("{mini} {fs} --prefetch 0"),
        ),
        cfg(
            "mini W2 full-shard p2",
            2,
            &format!("{mini} {fs} --prefetch 2"),
        ),
        cfg(
            "mini W2 shard-grad-op",
            2,
            &format!("{mini} --strategy shard-grad-op"),
        ),
        cfg(
            "mini W2 shard-optimizer",
            2,
            &format!("{mini} --strategy shard-optimizer"),
        ),
        cfg(
            "mini W2 no-shard",
            2,
            &format!("{mini} --strategy no-shard"),
        ),
        cfg(
            "mini W2 full-shard AC",
            2,
            &format!("{mini} {fs} --activation-checkpointing on"),
        ),
        cfg(
            "mini W2 accum 2 sync every",
            2,
            &format!("{mini} {fs} --grad-accum 2"),
        ),
        cfg(
            "mini W2 accum 4 sync last",
            2,
            &format!("{mini} {fs} --grad-accum 4 --grad-sync last"),
        ),
        cfg(
            "mini W2 offload optimizer",
            2,
            &format!("{mini} {fs} --offload optimizer"),
        ),
        cfg(
            "mini W2 offload params",
            2,
            &format!("{mini} {fs} --offload params"),
        ),
        cfg(
            "mini W2 bf16",
            2,
            &format!("{mini} {fs} --param-dtype bf16"),
        ),
        cfg("mini W4 full-shard", 4, &format!("{mini} {fs}")),
        cfg(
            "mini W4 hybrid 2x2",
            4,
            &format!("{mini} --strategy hybrid --shard-size 2"),
        ),
        cfg("small W1", 1, &format!("{small} --strategy no-shard")),
        cfg("small W2 full-shard", 2, &format!("{small} {fs}")),
        cfg("small W4 full-shard", 4, &format!("{small} {fs}")),
        cfg("base W2 full-shard", 2, &format!("{base} {fs}")),
        cfg(
            "base W2 full-shard AC",
            2,
            &format!("{base} {fs} --activation-checkpointing on"),
        ),
        cfg("llama W1", 1, &format!("{llama} --strategy no-shard")),
        cfg("llama W2 full-shard", 2, &format!("{llama} {fs}")),
        cfg(
            "llama W2 shard-grad-op AC",
            2,
            &format!("{llama} --strategy shard-grad-op --activation-checkpointing on"),
        ),
        cfg("llama-mini W2 full-shard", 2, &format!("{lmini} {fs}")),
        cfg(
            "llama-mini W4 hybrid 2x2",
            4,
            &format!("{lmini} --strategy hybrid --shard-size 2"),
        ),
        mpi(cfg("mini W2 full-shard", 2, &format!("{mini} {fs}"))),
        mpi(cfg(
            "llama-mini W2 shard-grad-op",
            2,
            &format!("{lmini} --strategy shard-grad-op"),
        )),
    ]
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn bin(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(default))
}

/// `fsdp calibrate --world-size w -o dir/w{w}.json`, or for the MPI rows `mpirun -n w fsdp
/// calibrate --backend mpi -o dir/mpi-w{w}.json` (or the existing file under
/// `FSDP_SWEEP_PROFILES`).
fn profile(fsdp: &Path, mpi_bin: &Path, dir: &Path, w: u64, mpi: bool) -> PathBuf {
    let path = dir.join(format!("{}w{w}.json", if mpi { "mpi-" } else { "" }));
    if path.exists() {
        println!("profile W={w}: reusing {}", path.display());
        return path;
    }
    let st = if mpi {
        Command::new("mpirun")
            .args(["-n", &w.to_string(), "--oversubscribe"])
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .arg(mpi_bin)
            .args(["calibrate", "--backend", "mpi", "-o"])
            .arg(&path)
            .status()
    } else {
        Command::new(fsdp)
            .args(["calibrate", "--world-size", &w.to_string(), "-o"])
            .arg(&path)
            .status()
    }
    .expect("fsdp calibrate");
    assert!(st.success(), "fsdp calibrate at W={w} (MPI: {mpi}) failed");
    let p: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    println!(
        "profile W={w}: {} (compute fit {}, rank skew {})",
        path.display(),
        p["compute_fit"],
        p["rank_skew"].as_f64().unwrap_or(0.0)
    );
    path
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Predicted and measured (step seconds, exposed communication seconds) of one run, and the
/// share of CPU time stolen from the VM while it ran.
struct Row {
    predicted_s: f64,
    measured_s: f64,
    predicted_comm_s: f64,
    measured_comm_s: f64,
    steal: f64,
}

/// (steal, total) CPU time in clock ticks since boot, from the `cpu` line of `/proc/stat`
/// (user nice system idle iowait irq softirq steal ...); `None` off Linux.
fn cpu_ticks() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total = v.iter().take(8).sum();
    Some((*v.get(7)?, total))
}

/// The stolen share of CPU time between two [`cpu_ticks`] readings (NaN when unknown).
fn steal_between(a: Option<(u64, u64)>, b: Option<(u64, u64)>) -> f64 {
    match (a, b) {
        (Some((s0, t0)), Some((s1, t1))) if t1 > t0 => (s1 - s0) as f64 / (t1 - t0) as f64,
        _ => f64::NAN,
    }
}

fn run(c: &Config, fsdp: &Path, mpi_bin: &Path, profile: &Path, steps: u64) -> Result<Row, String> {
    let data = root().join("testdata/tinyshakespeare.txt");
    let mut cmd = if c.mpi {
        let mut m = Command::new("mpirun");
        m.args(["-n", &c.world_size.to_string(), "--oversubscribe"])
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .arg(mpi_bin)
            .args(["train", "--backend", "mpi"]);
        m
    } else {
        let mut m = Command::new(fsdp);
        m.arg("train");
        m
    };
    cmd.current_dir(root())
        .arg("--data")
        .arg(&data)
        .args(["--world-size", &c.world_size.to_string()])
        .args([
            "--steps",
            &steps.to_string(),
            "--warmup",
            "1",
            "--eval-every",
            "0",
        ])
        .arg("--hardware")
        .arg(profile)
        .arg("--json")
        .args(&c.args);
    let before = cpu_ticks();
    let out = cmd.output().map_err(|e| format!("cannot start: {e}"))?;
    let steal = steal_between(before, cpu_ticks());
    if !out.status.success() {
        return Err(format!(
            "exit {:?}: {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        ));
    }
    let mut step_s = Vec::new();
    let mut comm_s = Vec::new();
    let mut summary = None;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if v["summary"] == true {
            summary = Some(v);
        } else if let Some(step) = v["step"].as_u64() {
            if step > SKIPPED {
                step_s.push(v["step_seconds"].as_f64().unwrap_or(f64::NAN));
                comm_s.push(v["comm_exposed_seconds"].as_f64().unwrap_or(f64::NAN));
            }
        }
    }
    let s = summary.ok_or("no summary line")?;
    let t = &s["step_time"];
    if step_s.is_empty() {
        return Err("no counted step".into());
    }
    Ok(Row {
        predicted_s: t["predicted_step_s"].as_f64().ok_or("no prediction")?,
        measured_s: median(step_s),
        predicted_comm_s: t["predicted_exposed_comm_s"].as_f64().unwrap_or(f64::NAN),
        measured_comm_s: median(comm_s),
        steal,
    })
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is taken from the command line.
    let fsdp = bin("FSDP_BIN", "target/release/fsdp");
    assert!(
        fsdp.exists(),
        "{} is missing: build it first with `cargo build --release -p fsdp` (or set FSDP_BIN)",
        fsdp.display()
    );
    let mpi_bin = bin("FSDP_MPI_BIN", "target-mpi/release/fsdp");
    let have_mpi = mpi_bin.exists()
        && Command::new("mpirun")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
    let steps = std::env::var("FSDP_SWEEP_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(STEPS);
    let only = std::env::var("FSDP_SWEEP_ONLY").ok();
    let dir = std::env::var_os("FSDP_SWEEP_PROFILES")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join(format!("fsdp-sweep-{}", std::process::id())));
    std::fs::create_dir_all(&dir).expect("profile directory");
    let configs: Vec<Config> = configs()
        .into_iter()
        .filter(|c| only.as_deref().is_none_or(|o| c.name.contains(o)))
        .collect();
    let reuse = std::env::var_os("FSDP_SWEEP_PROFILES").is_some();
    let rounds = std::env::var("FSDP_SWEEP_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(ROUNDS)
        .max(1);
    // Runs per configuration, rounds interleaved; each round calibrates first (unless the
    // profiles are given), so a prediction and its measurement are minutes apart.
    let mut runs: Vec<Vec<Row>> = configs.iter().map(|_| Vec::new()).collect();
    for round in 1..=rounds {
        println!("round {round} of {rounds}");
        let round_dir = if reuse {
            dir.clone()
        } else {
            dir.join(format!("round{round}"))
        };
        std::fs::create_dir_all(&round_dir).expect("profile directory");
        let mut profiles = std::collections::BTreeMap::new();
        for c in &configs {
            if c.mpi && !have_mpi {
                continue;
            }
            profiles
                .entry((c.world_size, c.mpi))
                .or_insert_with(|| profile(&fsdp, &mpi_bin, &round_dir, c.world_size, c.mpi));
        }
        for (c, r) in configs.iter().zip(runs.iter_mut()) {
            if c.mpi && !have_mpi {
                continue;
            }
            match run(c, &fsdp, &mpi_bin, &profiles[&(c.world_size, c.mpi)], steps) {
                Ok(row) => r.push(row),
                Err(e) => println!("{:<34} FAILED: {e}", c.name),
            }
        }
    }
    println!(
        "\n{:<34} {:>11} {:>11} {:>8} {:>8} {:>15} {:>11} {:>11} {:>6}",
        "configuration",
        "predicted",
        "measured",
        "error",
        "1st cal",
        "spread",
        "pred comm",
        "meas comm",
        "steal"
    );
    let mut errors = Vec::new();
    let mut first_errors = Vec::new();
    let mut steals = Vec::new();
    for (c, r) in configs.iter().zip(&runs) {
        if c.mpi && !have_mpi {
            println!(
                "{:<34} left out: no MPI build at {} or no mpirun",
                c.name,
                mpi_bin.display()
            );
            continue;
        }
        if r.is_empty() {
            println!("{:<34} no run succeeded", c.name);
            continue;
        }
        // Each round's measurement against the prediction from that round's profile; the
        // error is the median over rounds. `1st cal`: every round against the first
        // round's profile (what a calibration minutes to a quarter of an hour old predicts).
        let predicted = median(r.iter().map(|x| x.predicted_s).collect());
        let measured = median(r.iter().map(|x| x.measured_s).collect());
        let lo = r.iter().map(|x| x.measured_s).fold(f64::INFINITY, f64::min);
        let hi = r.iter().map(|x| x.measured_s).fold(0.0, f64::max);
        let comm = median(r.iter().map(|x| x.measured_comm_s).collect());
        let pred_comm = median(r.iter().map(|x| x.predicted_comm_s).collect());
        let err = median(
            r.iter()
                .map(|x| x.measured_s / x.predicted_s - 1.0)
                .collect(),
        );
        let first = measured / r[0].predicted_s - 1.0;
        let steal = median(r.iter().map(|x| x.steal).collect());
        steals.push(steal);
        errors.push((c.name.clone(), err));
        first_errors.push(first);
        println!(
            "{:<34} {:>9.1}ms {:>9.1}ms {:>+7.1}% {:>+7.1}% {:>+6.1}%..{:>+5.1}% {:>9.2}ms {:>9.2}ms {:>5.1}%",
            c.name,
            predicted * 1e3,
            measured * 1e3,
            100.0 * err,
            100.0 * first,
            100.0 * (lo / measured - 1.0),
            100.0 * (hi / measured - 1.0),
            pred_comm * 1e3,
            comm * 1e3,
            100.0 * steal
        );
        println!(
            "{}",
            serde_json::json!({"config": c.name, "world_size": c.world_size,
                "mpi": c.mpi, "args": c.args.join(" "), "rounds": r.len(),
                "predicted_step_s": predicted, "measured_step_s": measured,
                "predicted_step_s_per_round": r.iter().map(|x| x.predicted_s).collect::<Vec<_>>(),
                "measured_step_s_per_round": r.iter().map(|x| x.measured_s).collect::<Vec<_>>(),
                "error": err, "error_first_calibration": first,
                "predicted_exposed_comm_s": pred_comm,
                "measured_exposed_comm_s": comm,
                "cpu_steal_share": steal})
        );
    }
    if errors.is_empty() {
        println!("no configuration ran");
        return;
    }
    let n = errors.len() as f64;
    let mape = errors.iter().map(|(_, e)| e.abs()).sum::<f64>() / n;
    let worst = errors
        .iter()
        .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
        .unwrap();
    let within = errors.iter().filter(|(_, e)| e.abs() <= 0.25).count();
    let first_mape = first_errors.iter().map(|e| e.abs()).sum::<f64>() / n;
    let first_within = first_errors.iter().filter(|e| e.abs() <= 0.25).count();
    println!(
        "\n{} configurations: MAPE {:.1}% | largest {:+.1}% ({}) | {within} of {} within 25%",
        errors.len(),
        100.0 * mape,
        100.0 * worst.1,
        worst.0,
        errors.len()
    );
    println!(
        "against the first round's profiles only: MAPE {:.1}% | {first_within} of {} within 25%",
        100.0 * first_mape,
        errors.len()
    );
    println!(
        "CPU time stolen by the hypervisor during the runs: median {:.1}% (0 on a machine of \
         its own)",
        100.0 * median(steals)
    );
}

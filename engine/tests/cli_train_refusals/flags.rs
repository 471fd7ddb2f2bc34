//! Every bad flag refused before any work (exit 2 with the value, the rule and the fix), notes
//! for flags that run but surprise, and one vocabulary of strategies, dtypes and presets across
//! `fsdp train`, `fsdp plan` and `fsdp ckpt`.

use super::{fsdp, SMALL};

/// `SMALL` without `--steps` and `--micro-batch`, for tests that set them.
const BASE: [&str; 6] = ["train", "--model", "tiny", "--seq-len", "16", "--json"];

fn out(args: &[&str]) -> (i32, String, String) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args)
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn hyperparameters_are_refused_at_parse_time() {
    for (flag, value, rule) in [
        ("--weight-decay", "-5", "must be a finite number >= 0"),
        (
            "--lr",
            "0",
            "must be a finite number > 0, got 0; e.g. 1e-3 (to measure a model's loss without \
             training, use `fsdp eval`)",
        ),
        ("--clip", "nan", "must be a finite number >= 0"),
        ("--min-lr", "-1e-4", "must be a finite number >= 0"),
        ("--steps", "0", "must be at least 1"),
        ("--micro-batch", "0", "must be at least 1"),
        ("--threads-per-rank", "0", "must be at least 1"),
        ("--log-every", "0", "must be at least 1"),
        (
            "--comm-timeout",
            "-1",
            "must be a number of seconds in (0, 1e6]",
        ),
    ] {
        let mut a = BASE.to_vec();
        let arg = format!("{flag}={value}");
        a.push(&arg);
        for (f, v) in [("--steps", "1"), ("--micro-batch", "1")] {
            if f != flag {
                a.extend([f, v]);
            }
        }
        let (code, err) = fsdp(&a, &[]);
        assert_eq!(code, 2, "{flag}: {err}");
        assert!(
            err.contains(&format!("invalid value '{value}' for '{flag}")) && err.contains(rule),
            "{flag}: {err}"
        );
    }
}

#[test]
fn zero_device_memory_is_refused_by_train_and_plan() {
    let mut a = SMALL.to_vec();
    a.extend(["--device-memory", "0"]);
    let (code, err) = fsdp(&a, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--device-memory 0: a device of 0 bytes holds nothing"),
        "{err}"
    );
    let (code, _, err) = out(&["plan", "--model", "tiny", "--device-memory", "0GiB"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--device-memory 0GiB: a device of 0 bytes"),
        "{err}"
    );
}

#[test]
fn warmup_past_the_last_step_is_noted() {
    let mut a = BASE.to_vec();
    a.extend(["--warmup", "1000", "--steps", "3", "--micro-batch", "1"]);
    let (code, err) = fsdp(&a, &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("note: --warmup 1000 is beyond --steps 3: the learning rate rises"),
        "{err}"
    );
}

#[test]
fn oversubscribed_threads_are_capped_with_a_warning() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut a = SMALL.to_vec();
    a.extend(["--world-size", "2", "--threads-per-rank", "1000"]);
    let started = std::time::Instant::now();
    let (code, err) = fsdp(&a, &[]);
    assert_eq!(code, 0, "{err}");
    if cores < 2000 {
        let fair = (cores / 2).max(1);
        assert!(
            err.contains("warning: --threads-per-rank 1000 x 2 rank(s) = 2,000 compute threads")
                && err.contains(&format!("using {fair} per rank")),
            "{err}"
        );
    }
    assert!(started.elapsed().as_secs() < 60, "one step must not crawl");
}

/// Every pool of a training process obeys the capped `--threads-per-rank`, and the summary
/// states their sizes: asked for 1000 threads per rank at W = 2, the process holds at most
/// the main thread, 2 rank threads, 2 compute pools of `fair` threads, 2 communication
/// progress threads and candle's element-wise workers on the cores the compute pools leave
/// free, counted from outside while it runs; the JSON summary's own count agrees. A pool sized
/// from the request (candle's element-wise pool once was: 1,006 threads) fails both counts.
#[test]
fn every_thread_pool_obeys_the_cap_and_the_summary_states_the_sizes() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let fair = (cores / 2).max(1);
    // Three steps: rank 0 counts after each step, and after the last one rank 1 may already
    // have ended (its threads gone); after the first two it waits in the next step's
    // collectives, alive.
    let mut a = SMALL.to_vec();
    let at = a.iter().position(|&x| x == "--steps").unwrap();
    a[at + 1] = "3";
    a.extend(["--world-size", "2", "--threads-per-rank", "1000"]);
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(&a)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let peak = peak_threads(&mut child);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary: serde_json::Value =
        serde_json::from_str(stdout.lines().last().expect("a summary line")).unwrap();
    let t = &summary["threads"];
    assert_eq!(t["ranks"], 2, "{t}");
    assert_eq!(t["compute_per_rank"], fair, "{t}");
    assert_eq!(t["gemm"], fair, "{t}");
    let elementwise = cores - 2 * fair + 1;
    assert_eq!(t["elementwise"], elementwise, "{t}");
    let bound = 1 + 2 + 2 * fair + 2 + (elementwise - 1);
    assert_eq!(t["live_by_name"]["rankN-computeN"], 2 * fair, "{t}");
    let live = t["live_peak"].as_u64().expect("a live count on Linux") as usize;
    assert!(
        live <= bound,
        "summary counted {live} threads, at most {bound}: {t}"
    );
    assert!(
        peak <= bound,
        "{peak} threads seen from outside, at most {bound}: {t}"
    );
    assert!(peak > 2 * fair, "the poll saw the pools: {peak}");
}

/// Thread settings a user already put in the environment stand, and the run says so when they
/// differ from its own sizes or are not a positive number (candle falls back to its own
/// default then), and the summary counts what they made.
#[test]
fn environment_thread_settings_are_named_when_they_differ() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut a = SMALL.to_vec();
    a.extend(["--world-size", "2"]);
    let (code, err) = fsdp(&a, &[("CANDLE_NUM_THREADS", "8")]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(
            "note: CANDLE_NUM_THREADS=8 from the environment sets the threads of the \
                      element-wise pool"
        ),
        "{err}"
    );
    let (code, err) = fsdp(&a, &[("RAYON_NUM_THREADS", "abc")]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("note: RAYON_NUM_THREADS=abc from the environment is not a positive number"),
        "{err}"
    );
    // A setting equal to the run's own size says nothing.
    let fair = (cores / 2).max(1).to_string();
    let (code, err) = fsdp(&a, &[("RAYON_NUM_THREADS", fair.as_str())]);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("RAYON_NUM_THREADS"), "{err}");
}

/// The most threads the process `pid` holds until it exits (`/proc/PID/status`, polled).
fn peak_threads(child: &mut std::process::Child) -> usize {
    let status = format!("/proc/{}/status", child.id());
    let mut peak = 0;
    while child.try_wait().unwrap().is_none() {
        if let Ok(s) = std::fs::read_to_string(&status) {
            if let Some(n) = s
                .lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
            {
                peak = peak.max(n);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    peak
}

/// `fsdp eval --threads-per-rank` is capped as `train`'s (at most cores / ranks per rank, with
/// the same warning): a request of 1000 once built two rank pools of 1000 threads each. The
/// process holds the rank pools (2 x fair) plus at most 16 other threads (main, rank,
/// communicator progress threads).
#[test]
fn eval_caps_an_oversubscribed_thread_request() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let fair = (cores / 2).max(1);
    let t = tempfile::tempdir().unwrap();
    let ck = t.path().join("ck");
    let text = t.path().join("text.txt");
    std::fs::write(
        &text,
        "All the world's a stage, and all the men and women merely players.\n".repeat(300),
    )
    .unwrap();
    let (code, err) = fsdp(
        &[
            "train",
            "--model",
            "tiny",
            "--seq-len",
            "16",
            "--steps",
            "1",
            "--data",
            text.to_str().unwrap(),
            "--ckpt-dir",
            ck.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args([
            "eval",
            "--ckpt",
            ck.to_str().unwrap(),
            "--data",
            text.to_str().unwrap(),
            "--world-size",
            "2",
            "--threads-per-rank",
            "1000",
            "--eval-batches",
            "all",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let peak = peak_threads(&mut child);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        peak <= 2 * fair + 16,
        "{peak} threads on {cores} cores (fair share {fair} per rank)"
    );
    if cores < 2000 {
        assert!(
            err.contains("warning: --threads-per-rank 1000 x 2 rank(s) = 2,000 compute threads")
                && err.contains(&format!("using {fair} per rank")),
            "{err}"
        );
    }
}

/// `train` knows every preset `plan` knows: a Llama preset too large for this machine is
/// refused by the memory pre-flight (before any allocation), not as an unknown name; an
/// unknown name lists every preset.
#[test]
fn every_plan_preset_is_a_train_preset() {
    let (code, err) = fsdp(&["train", "--model", "llama3-8b", "--steps", "1"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("not enough memory") && !err.contains("unknown model preset"),
        "{err}"
    );
    let (code, _, err) = out(&["plan", "--model", "gpt5"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("gpt5") && err.contains("llama-tiny") && err.contains("llama3-70b"),
        "{err}"
    );
    let (code, err) = fsdp(&["train", "--model", "gpt5", "--steps", "1"], &[]);
    assert_eq!(code, 2);
    assert!(
        err.contains("unknown model preset") && err.contains("llama-mini"),
        "{err}"
    );
}

#[test]
fn strategy_aliases_and_dtypes_are_the_same_everywhere() {
    for s in ["ddp", "zero3", "zero2"] {
        let mut a = SMALL.to_vec();
        a.extend(["--strategy", s]);
        let (code, err) = fsdp(&a, &[]);
        assert_eq!(code, 0, "train --strategy {s}: {err}");
        let (code, _, err) = out(&["plan", "--model", "tiny", "--strategy", s]);
        assert_eq!(code, 0, "plan --strategy {s}: {err}");
    }
    for cmd in [&["plan", "--model", "tiny"][..], &SMALL[..]] {
        let mut a = cmd.to_vec();
        a.extend(["--param-dtype", "f64"]);
        let (code, _, err) = out(&a);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("[possible values: f32, bf16, f16]"), "{err}");
    }
    let mut a = SMALL.to_vec();
    a.extend(["--param-dtype", "bfloat16"]);
    assert_eq!(fsdp(&a, &[]).0, 0);
    // ZeRO-1 has one name everywhere: planned by plan, trained by train.
    let (code, _, err) = out(&["plan", "--model", "tiny", "--strategy", "zero1"]);
    assert_eq!(code, 0, "{err}");
    let mut a = SMALL.to_vec();
    a.extend(["--strategy", "zero1"]);
    let (code, err) = fsdp(&a, &[]);
    assert_eq!(code, 0, "{err}");
    // Offload that makes no sense is refused with the reason and the fix.
    let mut a = SMALL.to_vec();
    a.extend([
        "--strategy",
        "no-shard",
        "--world-size",
        "2",
        "--offload",
        "optimizer",
    ]);
    let (code, err) = fsdp(&a, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--offload optimizer with no-shard at 2 ranks makes no sense"),
        "{err}"
    );
    let mut a = SMALL.to_vec();
    a.extend(["--strategy", "zero1", "--offload", "params"]);
    let (code, err) = fsdp(&a, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--offload params with shard-optimizer makes no sense"),
        "{err}"
    );
    let mut a = SMALL.to_vec();
    a.extend(["--offload", "disk"]);
    let (code, err) = fsdp(&a, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("[possible values: none, optimizer, params]"),
        "{err}"
    );
}

#[test]
fn absurd_layer_counts_are_refused_before_allocating() {
    let t = tempfile::tempdir().unwrap();
    let cfg = t.path().join("config.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 1000000000000,
            "num_attention_heads": 32, "intermediate_size": 11008, "vocab_size": 32000}"#,
    )
    .unwrap();
    let (code, _, err) = out(&["plan", "--hf-config", cfg.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("field `num_hidden_layers` is 1000000000000, above the limit of 10000"),
        "{err}"
    );
}

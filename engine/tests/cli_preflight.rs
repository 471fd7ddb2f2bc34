//! `fsdp train` pre-flight checks on the thread backend: the world-size cap and the memory check
//! (W x plan peak + margin against MemAvailable), both exit 2 before any rank starts; the MPI
//! backend's pre-flight decision and auto's default budget as plain functions (module `mpi`).

use std::process::Command;

#[path = "cli_preflight/mpi.rs"]
mod mpi;

fn fsdp(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args)
        .output()
        .expect("run fsdp");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn huge_world_size_is_refused_with_the_thread_limit() {
    for w in ["100000", "2000"] {
        let (code, err) = fsdp(&["train", "--world-size", w, "--steps", "1"]);
        assert_eq!(code, 2, "{err}");
        assert!(
            err.contains(&format!(
                "--world-size {w} exceeds the thread backend's limit of 1024"
            )),
            "{err}"
        );
    }
}

#[test]
fn huge_micro_batch_is_refused_by_the_memory_check() {
    let (code, err) = fsdp(&[
        "train",
        "--model",
        "tiny",
        "--steps",
        "1",
        "--micro-batch",
        "1000000",
    ]);
    if fsdp::preflight::available_memory().is_none() {
        return; // no /proc/meminfo: the check is skipped by design
    }
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("not enough memory: 1 rank thread(s) x peak"),
        "{err}"
    );
    assert!(err.contains("--micro-batch 1000000"), "{err}");
    assert!(
        err.contains("use a smaller --world-size, --micro-batch, --seq-len or"),
        "{err}"
    );
}

#[test]
fn absurd_batch_values_do_not_overflow() {
    let max = u64::MAX.to_string();
    for flag in ["--micro-batch", "--grad-accum"] {
        let (code, err) = fsdp(&["train", "--model", "tiny", "--steps", "1", flag, &max]);
        assert_eq!(code, 2, "{flag}: {err}");
        assert!(!err.contains("panicked"), "{flag}: {err}");
        if flag == "--grad-accum" && fsdp::preflight::available_memory().is_some() {
            assert!(err.contains("not enough memory"), "{err}");
        }
    }
}

#[test]
fn preflight_numbers_against_a_given_budget() {
    let opts = fsdp::train::TrainOptions {
        model: "tiny".into(),
        world_size: 4,
        ..Default::default()
    };
    // 1 MiB cannot hold 4 tiny ranks; unknown memory skips the check; 64 GiB holds them.
    let peak = fsdp::preflight::plan_peak(&opts).unwrap();
    let e = fsdp::preflight::preflight_threads(&opts, peak, Some(1 << 20)).unwrap_err();
    assert_eq!(e.exit_code(), 2);
    let m = e.to_string();
    assert!(m.contains("4 rank thread(s) x peak"), "{m}");
    assert!(m.contains("> 1.0 MiB available"), "{m}");
    assert!(fsdp::preflight::preflight_threads(&opts, peak, None).is_ok());
    assert!(fsdp::preflight::preflight_threads(&opts, peak, Some(64 << 30)).is_ok());
}

#[test]
fn prepare_executes_the_plan_auto_chose() {
    use fsdp::preflight::{Budget, RankMemory};
    use fsdp::runtime::StagedModel;
    let opts = fsdp::train::TrainOptions {
        model: "tiny".into(),
        world_size: 2,
        micro_batch: 1,
        seq_len: 16,
        strategy: fsdp_planner::Strategy::Auto,
        ..Default::default()
    };
    let run = fsdp::run::prepare(fsdp::run::RunRequest {
        options: opts,
        budget: Some(Budget {
            bytes: 64 << 30,
            given: "64GiB".into(),
        }),
        ranks: RankMemory::Device,
    })
    .unwrap();
    assert_eq!(run.options.strategy, fsdp_planner::Strategy::NoShard);
    assert!(run.auto.as_ref().is_some_and(|a| a.choice.fits));
    // The chosen candidate's plan is the plan of the resolved options: nothing is re-planned.
    let again =
        fsdp_planner::plan(run.model.spec(), &fsdp::train::plan_config(&run.options)).unwrap();
    assert_eq!(again.fingerprint(), run.plan.fingerprint());
}

/// Offloaded state counts against the host: on the CPU the rank threads hold the plan's peak
/// and its host bytes in the one memory; beside a GPU the node's ranks hold the host bytes.
/// A budget that does not hold them is refused with the numbers; an offloading run on the CPU
/// computes on the CPU device.
#[test]
fn offloaded_host_bytes_are_checked_against_the_host() {
    use fsdp::preflight::RankMemory;
    let opts = fsdp::train::TrainOptions {
        model: "tiny".into(),
        world_size: 2,
        micro_batch: 1,
        seq_len: 16,
        offload: Some(fsdp_planner::Offload::Optimizer),
        ..Default::default()
    };
    let prepare = |available: u64| {
        fsdp::run::prepare(fsdp::run::RunRequest {
            options: opts.clone(),
            budget: None,
            ranks: RankMemory::Threads {
                available: Some(available),
            },
        })
    };
    let run = prepare(64 << 30).unwrap();
    let (peak, host) = (run.plan.memory.peak.0, run.plan.memory.host_peak.0);
    assert!(host > 0 && peak > 0);
    assert!(matches!(
        run.options.placement,
        fsdp::runtime::Placement::Device(_)
    ));
    // Room for two device peaks but not for the host bytes beside them.
    let e = prepare(2 * peak + host / 2).unwrap_err();
    assert_eq!(e.exit_code(), 2);
    assert!(
        e.to_string()
            .contains("not enough memory: 2 rank thread(s)"),
        "{e}"
    );
    // Beside a GPU: the node's ranks' host bytes against MemAvailable.
    let e = fsdp::preflight::preflight_offload_host(&opts, host, Some(host), 4).unwrap_err();
    assert_eq!(e.exit_code(), 2);
    let m = e.to_string();
    assert!(
        m.contains("not enough host memory for --offload optimizer: 4 rank(s)"),
        "{m}"
    );
    // The figures: the rank's host bytes, four of them, the margin on top, what is available.
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64);
    let (four, needed) = (4 * host, 4 * host + 4 * host / 100 * 25);
    for figure in [
        format!("x {} of offloaded state per rank", mib(host)),
        format!("= {} + 25% margin", mib(four)),
        format!("= {} > {} available", mib(needed), mib(host)),
    ] {
        assert!(m.contains(&figure), "`{figure}` missing from: {m}");
    }
    assert!(!m.contains("  "), "a run of spaces in: {m}");
    let e = prepare(2 * peak + host / 2).unwrap_err().to_string();
    assert!(!e.contains("  "), "a run of spaces in: {e}");
    // Exactly room for both memories of both ranks (and a micro-batch's 16 u32 ids and 16
    // targets, 128 bytes) with the margin: no refusal; a byte less is refused.
    let both = 2 * (peak + host + 128);
    assert!(prepare(both + both / 100 * 25).is_ok());
    assert!(prepare(both + both / 100 * 25 - 1).is_err());
    assert!(fsdp::preflight::preflight_offload_host(&opts, host, Some(64 << 30), 4).is_ok());
    assert!(fsdp::preflight::preflight_offload_host(&opts, host, None, 4).is_ok());
}

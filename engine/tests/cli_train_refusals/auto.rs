//! `--strategy auto` and `--device-memory` refusals (exit 2, before any rank starts): a
//! shard-group size with auto, a budget the explicit strategy does not fit, a malformed
//! budget, auto on a GPU without a budget, auto where the host's memory is unknown, and the
//! default budget (available memory per rank) that nothing fits.

use super::{fsdp, SMALL};
use fsdp::preflight::{resolve_strategy, Budget, RankMemory};
use fsdp::train::TrainOptions;

#[test]
fn auto_with_a_shard_size_is_a_usage_error() {
    let mut a = SMALL.to_vec();
    a.extend([
        "--world-size",
        "4",
        "--strategy",
        "auto",
        "--shard-size",
        "2",
    ]);
    let (code, err) = fsdp(&a, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--shard-size 2 does not apply to --strategy auto")
            && err.contains("--strategy hybrid --shard-size 2"),
        "{err}"
    );
}

#[test]
fn an_explicit_strategy_over_its_budget_is_refused_with_the_numbers() {
    let opts = TrainOptions {
        model: "tiny".into(),
        world_size: 2,
        micro_batch: 1,
        seq_len: 16,
        strategy: fsdp_planner::Strategy::NoShard,
        ..Default::default()
    };
    let peak = fsdp::preflight::plan_peak(&opts).unwrap();
    let mut a = SMALL.to_vec();
    let budget = (peak - 1).to_string();
    a.extend([
        "--world-size",
        "2",
        "--strategy",
        "no-shard",
        "--device-memory",
        &budget,
    ]);
    let (code, err) = fsdp(&a, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!(
            "--strategy no-shard: the plan's peak {} B",
            fsdp_types::group_thousands(peak)
        )) && err.contains(&format!(
            "exceeds --device-memory {budget} = {} B",
            fsdp_types::group_thousands(peak - 1)
        )),
        "{err}"
    );
    // The exact peak fits: the run trains.
    let exact = peak.to_string();
    let i = a.len() - 1;
    a[i] = &exact;
    let (code, err) = fsdp(&a, &[]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn a_malformed_budget_is_a_usage_error() {
    let mut a = SMALL.to_vec();
    a.extend(["--strategy", "auto", "--device-memory", "12 parsecs"]);
    let (code, err) = fsdp(&a, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--device-memory:") && err.contains("12 parsecs"),
        "{err}"
    );
    // A negative size after a space is the flag's value, named as negative.
    let mut a = SMALL.to_vec();
    a.extend(["--strategy", "auto", "--device-memory", "-5GiB"]);
    let (code, err) = fsdp(&a, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--device-memory: byte size `-5GiB` is negative"),
        "{err}"
    );
}

#[test]
fn auto_needs_a_budget_where_none_can_be_measured() {
    let auto = TrainOptions {
        model: "tiny".into(),
        world_size: 2,
        micro_batch: 1,
        seq_len: 16,
        strategy: fsdp_planner::Strategy::Auto,
        ..Default::default()
    };
    // NCCL runs on GPUs: no device query here.
    let mut o = auto.clone();
    let e = resolve_strategy(&mut o, None, &RankMemory::Device).unwrap_err();
    assert_eq!(e.exit_code(), 2);
    assert!(
        e.to_string()
            .contains("--strategy auto on a GPU needs --device-memory BYTES"),
        "{e}"
    );
    assert_eq!(o.strategy, fsdp_planner::Strategy::Auto, "left unresolved");
    // No MemAvailable (threads) and no node table (MPI).
    for ranks in [
        RankMemory::Threads { available: None },
        RankMemory::Mpi { hosts: None },
    ] {
        let mut o = auto.clone();
        let e = resolve_strategy(&mut o, None, &ranks).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(
            e.to_string()
                .contains("give the budget with --device-memory"),
            "{e}"
        );
    }
    // With a budget the GPU case resolves (64 GiB: the fastest, no-shard).
    let mut o = auto.clone();
    let budget = Budget {
        bytes: 64 << 30,
        given: "64GiB".into(),
    };
    let r = resolve_strategy(&mut o, Some(&budget), &RankMemory::Device)
        .unwrap()
        .expect("auto resolved");
    assert_eq!(o.strategy, fsdp_planner::Strategy::NoShard);
    assert_eq!(o.activation_checkpointing, None);
    assert_eq!(r.choice.budget.0, 64 << 30);
    assert!(r.choice.fits);
    assert_eq!(r.source, "--device-memory 64GiB");
    // A thread-backend default budget: 8 GiB over 2 ranks less 25% and the token ids.
    let mut o = auto.clone();
    let ranks = RankMemory::Threads {
        available: Some(8 << 30),
    };
    let r = resolve_strategy(&mut o, None, &ranks).unwrap().unwrap();
    assert_eq!(r.choice.budget.0, (4u64 << 30) * 100 / 125 - 16 * 8);
    assert_eq!(
        r.source,
        "MemAvailable 8.00 GiB / 2 rank thread(s), less the 25% margin and 128 B of token ids"
    );
}

#[test]
fn the_default_budget_nothing_fits_is_refused_with_the_numbers() {
    if fsdp::preflight::available_memory().is_none() {
        return; // no /proc/meminfo: auto asks for --device-memory (tested above)
    }
    // A million sequences per micro-batch: no strategy fits this host's memory.
    let (code, err) = fsdp(
        &[
            "train",
            "--model",
            "tiny",
            "--steps",
            "1",
            "--seq-len",
            "32",
            "--micro-batch",
            "1000000",
            "--world-size",
            "2",
            "--strategy",
            "auto",
        ],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--strategy auto: nothing fits the memory budget of")
            && err.contains("(MemAvailable ")
            && err.contains("/ 2 rank thread(s), less the 25% margin")
            && err.contains("the least memory is full-shard with activation checkpointing, peak"),
        "{err}"
    );
}

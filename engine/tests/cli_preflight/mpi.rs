//! The MPI pre-flight decision as plain functions (no MPI needed): every rank evaluates the
//! same gathered table of (available memory, node, launcher's local size), so the decision and
//! its message are the same on every rank; the default `--strategy auto` budget of a host
//! share passes the pre-flight check it is derived from.

use fsdp::preflight::{
    host_budget_per_rank, launcher_local_ranks, local_ranks, mpi_auto_budget, node_id,
    preflight_mpi, preflight_threads, token_id_bytes, with_margin, RankHost, MEMORY_MARGIN_PERCENT,
};
use fsdp::train::TrainOptions;

const GIB: u64 = 1 << 30;

fn host(available: u64, name: &str) -> RankHost {
    RankHost {
        available: Some(available),
        node: Some(node_id(name)),
        launcher_local_ranks: None,
    }
}

fn opts() -> TrainOptions {
    TrainOptions {
        model: "tiny".into(),
        world_size: 4,
        micro_batch: 2,
        seq_len: 32,
        ..Default::default()
    }
}

#[test]
fn local_ranks_count_the_ranks_of_a_node() {
    let t = [
        host(8 * GIB, "a"),
        host(8 * GIB, "a"),
        host(8 * GIB, "a"),
        host(2 * GIB, "b"),
    ];
    assert_eq!(local_ranks(&t, 0), Some(3));
    assert_eq!(local_ranks(&t, 2), Some(3));
    assert_eq!(local_ranks(&t, 3), Some(1));
    assert_eq!(local_ranks(&t, 4), None, "no such rank");
    // The launcher's count wins over the host names (containers may share one).
    let mut u = t;
    u[3].launcher_local_ranks = Some(2);
    assert_eq!(local_ranks(&u, 3), Some(2));
    // Unknown host and no launcher count: unknown.
    u[1].node = None;
    assert_eq!(local_ranks(&u, 1), None);
    assert_eq!(
        local_ranks(&u, 0),
        Some(2),
        "rank 1 no longer counted on node a"
    );
}

#[test]
fn launcher_local_size_from_open_mpi_then_mpich() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    assert_eq!(
        launcher_local_ranks(env(&[("OMPI_COMM_WORLD_LOCAL_SIZE", "4")])),
        Some(4)
    );
    assert_eq!(
        launcher_local_ranks(env(&[("MPI_LOCALNRANKS", "3")])),
        Some(3)
    );
    assert_eq!(
        launcher_local_ranks(env(&[
            ("MPI_LOCALNRANKS", "3"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
        ])),
        Some(2)
    );
    assert_eq!(
        launcher_local_ranks(env(&[("OMPI_COMM_WORLD_LOCAL_SIZE", "0")])),
        None
    );
    assert_eq!(
        launcher_local_ranks(env(&[("OMPI_COMM_WORLD_LOCAL_SIZE", "x")])),
        None
    );
    assert_eq!(launcher_local_ranks(env(&[])), None);
}

#[test]
fn the_gathered_row_round_trips_exactly() {
    let h = RankHost {
        available: Some(23 * GIB + 12345),
        node: Some(node_id("node-017.cluster")),
        launcher_local_ranks: Some(8),
    };
    assert_eq!(RankHost::decode(h.encode()), h);
    let unknown = RankHost {
        available: None,
        node: None,
        launcher_local_ranks: None,
    };
    assert_eq!(unknown.encode(), [-1.0; 3]);
    assert_eq!(RankHost::decode(unknown.encode()), unknown);
    // Rows are all-reduced as sums of zeros and one rank's row: still exact.
    let sum: Vec<f64> = h.encode().iter().map(|v| 0.0 + v + 0.0).collect();
    assert_eq!(RankHost::decode([sum[0], sum[1], sum[2]]), h);
    assert!(node_id("node-017.cluster") < 1 << 53);
    assert_ne!(node_id("a"), node_id("b"));
}

#[test]
fn mpi_preflight_refuses_when_any_node_is_short_with_the_same_message_everywhere() {
    let o = opts();
    let peak = 1_000_000_000; // 1 GB per rank (plus 4 KiB of token ids)
    let per_rank = peak + token_id_bytes(&o);
    assert_eq!(token_id_bytes(&o), 2 * 32 * 8);
    // Node a: 3 ranks need with_margin(3 x per_rank) = 3.75 GB; node b: 1 rank.
    let need_a = with_margin(3 * per_rank);
    let ok = [
        host(need_a, "a"),
        host(need_a, "a"),
        host(need_a, "a"),
        host(with_margin(per_rank), "b"),
    ];
    assert!(
        preflight_mpi(&o, peak, &ok).is_ok(),
        "exactly enough on both nodes"
    );
    // One byte short on node b (rank 3) only.
    let mut short = ok;
    short[3].available = Some(with_margin(per_rank) - 1);
    let e = preflight_mpi(&o, peak, &short).unwrap_err();
    assert_eq!(e.exit_code(), 2);
    let m = e.to_string();
    assert!(
        m.contains("not enough memory on the node of MPI rank 3 (1 of 4 ranks are short): 1 rank(s) on the node x peak"),
        "{m}"
    );
    assert!(
        m.contains("--micro-batch 2") && m.contains(&format!("{MEMORY_MARGIN_PERCENT}% margin")),
        "{m}"
    );
    // Every rank holds the same table: the same message whatever rank evaluates it.
    assert_eq!(preflight_mpi(&o, peak, &short).unwrap_err().to_string(), m);
    // Node a short: the first short rank is named, all three counted.
    let mut a_short = ok;
    for h in &mut a_short[..3] {
        h.available = Some(need_a - 1);
    }
    let m = preflight_mpi(&o, peak, &a_short).unwrap_err().to_string();
    assert!(
        m.contains("MPI rank 0 (3 of 4 ranks are short): 3 rank(s)"),
        "{m}"
    );
    // A rank whose memory is unknown is not checked.
    let mut unknown = short;
    unknown[3].available = None;
    assert!(preflight_mpi(&o, peak, &unknown).is_ok());
}

#[test]
fn the_default_auto_budget_passes_the_preflight_it_comes_from() {
    let o = opts();
    let ids = token_id_bytes(&o);
    for available in [GIB, 3 * GIB + 7, 24 * GIB - 1, 1_000_003] {
        for ranks in 1..=5u64 {
            let b = host_budget_per_rank(available, ranks, ids);
            // A plan peak of exactly the budget passes the pre-flight's arithmetic ...
            let needed = with_margin((b + ids) * ranks);
            assert!(needed <= available, "{available} {ranks}: {needed}");
            // ... and the budget is the real-valued share available / ranks / 1.25 - ids,
            // rounded down by at most 2 bytes.
            let exact = available as f64 / ranks as f64 / 1.25 - ids as f64;
            assert!(
                b as f64 <= exact && exact - (b as f64) < 2.0,
                "{available} {ranks}: {b} vs {exact}"
            );
        }
    }
    assert_eq!(
        host_budget_per_rank(100, 1, 1000),
        0,
        "ids alone do not fit"
    );
    // The thread pre-flight on the real plan: a budget from 4 GiB for 4 ranks holds tiny.
    let peak = fsdp::preflight::plan_peak(&o).unwrap();
    assert!(peak <= host_budget_per_rank(4 * GIB, 4, ids));
    assert!(preflight_threads(&o, peak, Some(4 * GIB)).is_ok());
    // MPI default budget: the smallest share over the nodes, naming it.
    let t = [
        host(8 * GIB, "a"),
        host(8 * GIB, "a"),
        host(3 * GIB, "b"),
        host(8 * GIB, "c"),
    ];
    let (b, why) = mpi_auto_budget(&o, &t).unwrap();
    assert_eq!(
        b,
        host_budget_per_rank(3 * GIB, 1, ids).min(host_budget_per_rank(8 * GIB, 2, ids))
    );
    assert_eq!(
        b,
        host_budget_per_rank(3 * GIB, 1, ids),
        "2.4 GiB < 3.2 GiB"
    );
    assert!(why.contains("rank 2's node / 1 rank(s) there"), "{why}");
    // Any unknown rank: no default budget.
    let mut u = t;
    u[1].node = None;
    assert!(mpi_auto_budget(&o, &u).is_none());
}

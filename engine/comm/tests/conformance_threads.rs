//! The conformance suite (fsdp_comm::conformance) run against the thread backend, one test per
//! check so failures are named.

use fsdp_comm::conformance::{self, ThreadLauncher};

macro_rules! checks {
    ($($name:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            if let Err(e) = conformance::$name(&ThreadLauncher) {
                panic!("{e}");
            }
        }
    )*};
}

checks!(
    all_gather_matches_reference,
    reduce_scatter_matches_reference,
    all_reduce_matches_reference,
    all_gather_in_place_matches_reference,
    all_gather_in_place_mixes_with_plain_all_gather,
    all_gather_in_place_size_not_multiple_is_error,
    broadcast_from_every_root,
    large_buffers_match_reference,
    barrier_waits_for_every_rank,
    started_calls_complete_in_issue_order,
    bad_buffers_are_local_errors,
    mismatched_calls_are_errors,
    mismatched_groups_are_errors_not_hangs,
    panicking_rank_fails_its_peers,
    late_rank_times_out,
    bc_05_bf16_wire_fp32_accumulation,
    bc_06_average_by_rank_count,
    bc_10_rank_with_fewer_batches_does_not_hang,
);

#[test]
fn every_check_has_a_test() {
    // Keeps this file in step with conformance::CHECKS.
    assert_eq!(conformance::CHECKS.len(), 18);
}

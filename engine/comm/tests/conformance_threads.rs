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
    bf16_wire_fp32_accumulation,
    average_by_rank_count,
    rank_with_fewer_batches_does_not_hang,
    tensor_buffers_match_reference,
    tensor_bad_buffers_are_local_errors,
);

/// CUDA tensors on the thread backend are `DeviceBufferUnreachable` errors (with a CUDA device);
/// without one the check prints `SKIPPED (no CUDA device): ...` and the error's text is checked
/// on a constructed value (the numbers, the backend, `--backend nccl`).
#[test]
fn device_tensors_are_errors_on_host_backends() {
    match conformance::device_tensors_are_errors_on_host_backends(&ThreadLauncher) {
        Ok(conformance::DeviceCheck::Passed) => {}
        Ok(conformance::DeviceCheck::Skipped(_)) => {
            let e = fsdp_comm::CommError::DeviceBufferUnreachable {
                rank: 1,
                op: fsdp_comm::OpKind::ReduceScatter,
                backend: "threads",
                dtype: fsdp_comm::DType::BF16,
                numel: 4096,
                device: "cuda:0".into(),
            };
            assert_eq!(
                e.to_string(),
                "rank 1: reduce_scatter got a bf16 buffer of 4096 elements on cuda:0, but the \
                 threads backend cannot reach device memory: use the NCCL backend \
                 (`--backend nccl`, a build with the `cuda` feature) for device buffers, or \
                 pass host buffers"
            );
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn every_check_has_a_test() {
    // Keeps this file in step with conformance::CHECKS.
    assert_eq!(conformance::CHECKS.len(), 20);
}

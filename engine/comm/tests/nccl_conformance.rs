//! The NCCL backend (feature `cuda`, a CUDA device) against the conformance suite and its
//! device-buffer API.
//!
//! - `nccl_conformance_world_size_1`: every check at world size 1, one rank in this process.
//! - `nccl_conformance_processes`: this process is one rank of a job started by
//!   `fsdp launch --nproc P --program <this test binary> -- --exact nccl_conformance_processes
//!   --nocapture` (with `FSDP_NCCL_HOSTID_PER_RANK=fsdp NCCL_SOCKET_IFNAME=lo
//!   NCCL_IB_DISABLE=1` for P processes on one GPU); checks run at world sizes up to P.
//!   `gpu/check.sh` runs it with P = 2. Started by plain `cargo test` it reports the skip.
//! - `nccl_device_buffers_in_place`: the engine-facing device calls (in-place all-gather,
//!   reduce-scatter, all-reduce on device buffers, completion by event on a compute stream).
//!
//! Without a device (or without the feature) each test prints
//! `SKIPPED (no CUDA device): <test> (<why>)` to stderr and returns.

#[cfg(feature = "cuda")]
fn device_or_skip(test: &str) -> bool {
    match fsdp_comm::nccl::device_count() {
        Ok(_) => true,
        Err(why) => {
            eprintln!("SKIPPED (no CUDA device): {test} ({why})");
            false
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn device_or_skip(test: &str) -> bool {
    eprintln!("SKIPPED (no CUDA device): {test} (built without the `cuda` feature)");
    false
}

#[cfg(feature = "cuda")]
mod gpu {
    use cudarc::driver::CudaContext;
    use fsdp_comm::conformance::{self, Launcher};
    use fsdp_comm::nccl::{NcclComm, NcclId, NcclLauncher, NcclOptions, Reduction};
    use fsdp_comm::{Group, ReduceOp, Topology};
    use std::time::Instant;

    /// Runs `checks` on `l`, printing one line per check (on the process of rank 0 only when
    /// `print`), and returns the failures.
    fn run(l: &dyn Launcher, print: bool, skip: &[&str]) -> Vec<String> {
        let mut failed = Vec::new();
        for (name, check) in conformance::CHECKS {
            if skip.contains(name) {
                continue;
            }
            let t0 = Instant::now();
            let r = check(l);
            if print {
                match &r {
                    Ok(()) => println!("ok      {name} ({:.2} s)", t0.elapsed().as_secs_f64()),
                    Err(e) => println!("FAILED  {name}: {e}"),
                }
            }
            if let Err(e) = r {
                failed.push(e.to_string());
            }
        }
        failed
    }

    pub fn world_size_1() {
        for reduction in [Reduction::RankOrder, Reduction::Nccl] {
            let l = NcclLauncher::single(
                0,
                NcclOptions {
                    reduction,
                    ..NcclOptions::default()
                },
            );
            println!("NCCL conformance, world size 1, {reduction:?}");
            let failed = run(&l, true, &[]);
            assert!(failed.is_empty(), "{reduction:?}: {failed:#?}");
        }
    }

    pub fn processes() {
        let l = NcclLauncher::from_env(NcclOptions::default()).expect("join the job");
        let me = l.process_rank();
        let p = l.max_world_size();
        if me == 0 {
            println!("NCCL conformance on {p} processes (topologies above {p} ranks skipped)");
        }
        // The shared-memory barrier check counts arrivals in one address space; processes
        // cannot (the MPI suite replaces it the same way).
        let failed = run(&l, me == 0, &["barrier_waits_for_every_rank"]);
        if me == 0 {
            println!(
                "NCCL conformance: {} failed of {} checks on {p} processes",
                failed.len(),
                conformance::CHECKS.len() - 1
            );
        }
        assert!(failed.is_empty(), "{failed:#?}");
    }

    pub fn device_buffers() {
        let ctx = CudaContext::new(0).unwrap();
        let id = NcclId::new(0).unwrap();
        let comm = NcclComm::new(
            ctx.clone(),
            0,
            Topology::fully_sharded(1).unwrap(),
            &id,
            NcclOptions::default(),
        )
        .unwrap();
        let compute = ctx.new_stream().unwrap();
        // In-place all-gather at W = 1: the buffer is its own shard, unchanged.
        let host: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        let mut buf = compute.clone_htod(&host).unwrap();
        let op = comm
            .all_gather_device(Group::World, &mut buf.slice_mut(..), Some(&compute))
            .unwrap();
        op.then(&compute).unwrap();
        let back = compute.clone_dtoh(&buf).unwrap();
        compute.synchronize().unwrap();
        assert_eq!(back, host);
        assert!(op.is_complete());
        // Reduce-scatter Avg at W = 1 divides by 1: bits unchanged; into a separate shard.
        let mut shard = compute.alloc_zeros::<f32>(1000).unwrap();
        let op = comm
            .reduce_scatter_device(
                Group::World,
                ReduceOp::Avg,
                &buf.slice(..),
                &mut shard.slice_mut(..),
                Some(&compute),
            )
            .unwrap();
        comm.wait_device(op).unwrap();
        let got = compute.clone_dtoh(&shard).unwrap();
        compute.synchronize().unwrap();
        assert_eq!(got, host);
        // All-reduce Max in place at W = 1: unchanged.
        let op = comm
            .all_reduce_device(Group::World, ReduceOp::Max, &mut buf.slice_mut(..), None)
            .unwrap();
        comm.wait_device(op).unwrap();
        let got = compute.clone_dtoh(&buf).unwrap();
        compute.synchronize().unwrap();
        assert_eq!(got, host);
        // A buffer that is not a multiple of the group size is refused for an in-place
        // all-gather only when the group is larger than 1: at W = 1 every length is fine.
        let mut odd = compute.alloc_zeros::<f32>(3).unwrap();
        let op = comm
            .all_gather_device(Group::Shard, &mut odd.slice_mut(..), None)
            .unwrap();
        comm.wait_device(op).unwrap();
    }
}

#[test]
fn nccl_conformance_world_size_1() {
    if device_or_skip("nccl_conformance_world_size_1") {
        #[cfg(feature = "cuda")]
        gpu::world_size_1();
    }
}

#[test]
fn nccl_conformance_processes() {
    if std::env::var_os("RANK").is_none() || std::env::var_os("WORLD_SIZE").is_none() {
        eprintln!(
            "SKIPPED (not started by `fsdp launch`): nccl_conformance_processes (RANK / \
             WORLD_SIZE unset; see gpu/check.sh)"
        );
        return;
    }
    if device_or_skip("nccl_conformance_processes") {
        #[cfg(feature = "cuda")]
        gpu::processes();
    }
}

#[test]
fn nccl_device_buffers_in_place() {
    if device_or_skip("nccl_device_buffers_in_place") {
        #[cfg(feature = "cuda")]
        gpu::device_buffers();
    }
}

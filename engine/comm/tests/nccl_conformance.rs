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
//! - `nccl_tensor_buffers_in_place`: `OwnedBuf::Tensor` (candle CUDA tensors) through the
//!   started calls, ordered against candle's stream; CPU tensors staged; refusals. The
//!   conformance runs above include the tensor checks (`tensor_buffers_match_reference`,
//!   `tensor_bad_buffers_are_local_errors`) on CUDA tensors.
//!
//! Without the `cuda` feature every test is ignored (`cargo test` lists it as such). With the
//! feature but without a device a test prints `SKIPPED (no CUDA device): <test> (<why>)` to
//! stderr (shown with `--nocapture`) and passes, unless `FSDP_REQUIRE_CUDA=1` is set: then it
//! fails (`gpu/check.sh` sets it on a machine that lists a GPU).

/// Whether the environment requires a CUDA device (`FSDP_REQUIRE_CUDA=1`).
fn required() -> bool {
    std::env::var("FSDP_REQUIRE_CUDA").is_ok_and(|v| v == "1")
}

fn skip(test: &str, why: &str) -> bool {
    assert!(
        !required(),
        "{test}: FSDP_REQUIRE_CUDA=1 but no CUDA device: {why}"
    );
    eprintln!("SKIPPED (no CUDA device): {test} ({why})");
    false
}

#[cfg(feature = "cuda")]
fn device_or_skip(test: &str) -> bool {
    match fsdp_comm::nccl::device_count() {
        Ok(_) => true,
        Err(why) => skip(test, &why),
    }
}

#[cfg(not(feature = "cuda"))]
fn device_or_skip(test: &str) -> bool {
    skip(test, "built without the `cuda` feature")
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

    /// `OwnedBuf::Tensor` on NCCL at W = 1: CUDA tensors in place on the communicator's stream,
    /// ordered after candle's work (the own block is written by a candle op right before the
    /// call) and before candle's next op (the result is read through candle after `wait`);
    /// CPU tensors staged; mixed host/device buffers and strided tensors refused.
    pub fn tensor_buffers() {
        use candle_core::{DType as CDType, Device, Tensor};
        use fsdp_comm::{CommError, Communicator, OwnedBuf};
        let ctx = CudaContext::new(0).unwrap();
        let id = NcclId::new(0).unwrap();
        let comm = NcclComm::new(
            ctx,
            0,
            Topology::fully_sharded(1).unwrap(),
            &id,
            NcclOptions::default(),
        )
        .unwrap();
        let dev = Device::new_cuda(0).unwrap();
        let host: Vec<f32> = (0..4096).map(|i| i as f32 * 0.25 - 100.0).collect();
        // A flat buffer of 4096 + 8 elements; the unit's view starts 5 elements in. The own
        // block is written by candle (x * 2 - x == x, queued on candle's stream) right before
        // the in-place all-gather is started.
        let flat = Tensor::zeros(4096 + 8, CDType::F32, &dev).unwrap();
        let view = flat.narrow(0, 5, 4096).unwrap();
        let src = Tensor::from_slice(&host, 4096, &dev).unwrap();
        let src = ((&src * 2.0).unwrap() - &src).unwrap();
        view.slice_set(&src, 0, 0).unwrap();
        let done = comm
            .start_all_gather_in_place(Group::World, OwnedBuf::Tensor(view.clone()))
            .unwrap()
            .wait_all()
            .unwrap();
        assert!(done.send.is_none());
        assert!(done.buf.tensor().is_some());
        let back: Vec<f32> = view.to_vec1().unwrap();
        assert_eq!(back, host);
        let pad: Vec<f32> = flat.narrow(0, 0, 5).unwrap().to_vec1().unwrap();
        assert_eq!(pad, vec![0.0; 5]);
        // Reduce-scatter (avg, W = 1: unchanged) into a separate tensor, all-reduce (sum) and
        // broadcast in place, all started before the first wait.
        let shard = Tensor::zeros(4096, CDType::F32, &dev).unwrap();
        let bf = Tensor::from_slice(&host, 4096, &dev)
            .unwrap()
            .to_dtype(CDType::BF16)
            .unwrap();
        let p1 = comm
            .start_reduce_scatter(
                Group::World,
                fsdp_comm::ReduceOp::Avg,
                OwnedBuf::Tensor(view.clone()),
                OwnedBuf::Tensor(shard.clone()),
            )
            .unwrap();
        let p2 = comm
            .start_all_reduce(Group::Shard, ReduceOp::Sum, OwnedBuf::Tensor(bf.clone()))
            .unwrap();
        let p3 = comm
            .start_broadcast(Group::Replicate, 0, OwnedBuf::Tensor(bf.clone()))
            .unwrap();
        for p in [p1, p2, p3] {
            p.wait().unwrap();
        }
        assert_eq!(shard.to_vec1::<f32>().unwrap(), host);
        let want: Vec<half::bf16> = host.iter().map(|&x| half::bf16::from_f32(x)).collect();
        assert_eq!(bf.to_vec1::<half::bf16>().unwrap(), want);
        // CPU tensors go the staged way.
        let cpu = Tensor::from_slice(&host, 4096, &Device::Cpu).unwrap();
        let got = comm
            .start_all_reduce(Group::World, ReduceOp::Max, OwnedBuf::Tensor(cpu.clone()))
            .unwrap()
            .wait()
            .unwrap();
        assert!(got.is_host());
        assert_eq!(cpu.to_vec1::<f32>().unwrap(), host);
        // A device send with a host receive buffer, and a strided tensor, are refused.
        let e = comm
            .start_all_gather(
                Group::World,
                OwnedBuf::Tensor(shard.clone()),
                OwnedBuf::zeros(fsdp_comm::DType::F32, 4096),
            )
            .unwrap_err();
        assert!(
            matches!(e, CommError::InvalidTensor { ref reason, .. } if reason.contains("mixes")),
            "{e}"
        );
        let strided = Tensor::zeros((4, 3), CDType::F32, &dev)
            .unwrap()
            .t()
            .unwrap();
        let e = comm
            .start_all_reduce(Group::World, ReduceOp::Sum, OwnedBuf::Tensor(strided))
            .unwrap_err();
        assert!(matches!(e, CommError::InvalidTensor { .. }), "{e}");
        // A handle dropped without wait leaves the tensor usable (candle waits for it).
        let x = Tensor::from_slice(&host, 4096, &dev).unwrap();
        drop(
            comm.start_all_reduce(Group::World, ReduceOp::Sum, OwnedBuf::Tensor(x.clone()))
                .unwrap(),
        );
        assert_eq!(x.to_vec1::<f32>().unwrap(), host);
    }
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs the cuda feature and a CUDA device"
)]
fn nccl_tensor_buffers_in_place() {
    if device_or_skip("nccl_tensor_buffers_in_place") {
        #[cfg(feature = "cuda")]
        gpu::tensor_buffers();
    }
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs the cuda feature and a CUDA device"
)]
fn nccl_conformance_world_size_1() {
    if device_or_skip("nccl_conformance_world_size_1") {
        #[cfg(feature = "cuda")]
        gpu::world_size_1();
    }
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs the cuda feature and a CUDA device"
)]
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
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs the cuda feature and a CUDA device"
)]
fn nccl_device_buffers_in_place() {
    if device_or_skip("nccl_device_buffers_in_place") {
        #[cfg(feature = "cuda")]
        gpu::device_buffers();
    }
}

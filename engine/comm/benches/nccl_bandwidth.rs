//! NCCL all-gather / reduce-scatter / all-reduce bandwidth on device buffers (feature `cuda`).
//!
//! Run alone (world size 1, device 0) or as every rank of `fsdp launch --nproc P --program
//! <this binary>` (torchrun's environment; `FSDP_NCCL_HOSTID_PER_RANK=fsdp` for P processes
//! on one GPU). Rank 0 prints a table and one JSON line per measurement: collective,
//! reduction algorithm, dtype, bytes of the full (unsharded) buffer, median time of 10 runs
//! after 3 warm-ups, algorithm bandwidth (full bytes / time) and bus bandwidth (NCCL's
//! convention, `algbw x (W-1)/W` for all-gather and reduce-scatter, `x 2(W-1)/W` for
//! all-reduce; at W = 1 the bus moves nothing and the figure is the device copy rate).
//! `FSDP_BENCH_MAX_MB` caps the buffer size (default 1024). Without a device it prints why and
//! exits 0.

#[cfg(feature = "cuda")]
fn main() {
    use cudarc::driver::{CudaContext, CudaSlice};
    use fsdp_comm::nccl::{device_count, NcclComm, NcclId, NcclOptions, Reduction};
    use fsdp_comm::{Communicator, Group, ReduceOp, Topology};
    use half::bf16;
    use std::time::Instant;

    if let Err(why) = device_count() {
        println!("nccl_bandwidth: SKIPPED (no CUDA device): {why}");
        return;
    }
    let launched = std::env::var_os("RANK").is_some();
    let mut comm = if launched {
        if let Ok(prefix) = std::env::var(fsdp_comm::nccl::NCCL_HOSTID_PER_RANK) {
            let rank = std::env::var("RANK").unwrap_or_default();
            std::env::set_var("NCCL_HOSTID", format!("{prefix}-{rank}"));
            std::env::set_var("LOCAL_RANK", "0");
        }
        let w: usize = std::env::var("WORLD_SIZE")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1);
        NcclComm::from_env(
            Topology::fully_sharded(w).expect("world size"),
            NcclOptions::default(),
        )
        .expect("join the job")
        .0
    } else {
        let ctx = CudaContext::new(0).expect("device 0");
        let id = NcclId::new(0).expect("unique id");
        NcclComm::new(
            ctx,
            0,
            Topology::fully_sharded(1).unwrap(),
            &id,
            NcclOptions::default(),
        )
        .expect("NCCL world of 1")
    };
    comm.set_check_calls(false);
    let w = comm.world_size();
    let me = comm.rank();
    let stream = comm.stream().clone();
    if me == 0 {
        println!("NCCL bandwidth, world size {w}, device buffers, median of 10");
        println!(
            "{:<15} {:<9} {:<5} {:>12} {:>10} {:>12} {:>12}",
            "collective", "reduction", "dtype", "bytes", "time_ms", "algbw_GB/s", "busbw_GB/s"
        );
    }
    let time = |f: &mut dyn FnMut()| -> f64 {
        for _ in 0..3 {
            f();
        }
        let mut t: Vec<f64> = (0..10)
            .map(|_| {
                let t0 = Instant::now();
                f();
                t0.elapsed().as_secs_f64()
            })
            .collect();
        t.sort_by(f64::total_cmp);
        t[5]
    };
    // FSDP_BENCH_MAX_MB caps the buffer size (2 processes on one GPU talk over loopback
    // sockets at ~2 GB/s: gpu/check.sh caps them at 16 MiB).
    let max_mb: usize = std::env::var("FSDP_BENCH_MAX_MB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1024);
    for mb in [1usize, 16, 256, 1024].into_iter().filter(|&m| m <= max_mb) {
        let bytes = mb << 20;
        for (dtype, es) in [("f32", 4usize), ("bf16", 2)] {
            let n = bytes / es / w * w; // divisible by W
            let report = |name: &str, red: &str, bytes: usize, secs: f64, bus: f64| {
                let alg = bytes as f64 / secs / 1e9;
                if me == 0 {
                    println!(
                        "{name:<15} {red:<9} {dtype:<5} {bytes:>12} {:>10.3} {alg:>12.1} {:>12.1}",
                        secs * 1e3,
                        alg * bus
                    );
                    println!(
                        "{{\"bench\":\"nccl_bandwidth\",\"collective\":\"{name}\",\"reduction\":\"{red}\",\"dtype\":\"{dtype}\",\"world_size\":{w},\"bytes\":{bytes},\"time_s\":{secs:e},\"algbw_gbs\":{alg:.3},\"busbw_gbs\":{:.3}}}",
                        alg * bus
                    );
                }
            };
            let ag_bus = (w as f64 - 1.0).max(1.0) / w as f64;
            let ar_bus = 2.0 * (w as f64 - 1.0).max(0.5) / w as f64;
            macro_rules! bench_dtype {
                ($t:ty, $one:expr) => {{
                    let mut full: CudaSlice<$t> = stream.clone_htod(&vec![$one; n]).unwrap();
                    let mut shard: CudaSlice<$t> = stream.alloc_zeros(n / w).unwrap();
                    let s = time(&mut || {
                        let op = comm
                            .all_gather_device(Group::World, &mut full.slice_mut(..), None)
                            .unwrap();
                        comm.wait_device(op).unwrap();
                    });
                    report("all_gather", "-", n * es, s, ag_bus);
                    for red in [Reduction::RankOrder, Reduction::Nccl] {
                        comm.set_reduction(red);
                        let name = if red == Reduction::RankOrder {
                            "rank_order"
                        } else {
                            "nccl"
                        };
                        let s = time(&mut || {
                            let op = comm
                                .reduce_scatter_device(
                                    Group::World,
                                    ReduceOp::Sum,
                                    &full.slice(..),
                                    &mut shard.slice_mut(..),
                                    None,
                                )
                                .unwrap();
                            comm.wait_device(op).unwrap();
                        });
                        report("reduce_scatter", name, n * es, s, ag_bus);
                        let s = time(&mut || {
                            let op = comm
                                .all_reduce_device(
                                    Group::World,
                                    ReduceOp::Sum,
                                    &mut shard.slice_mut(..),
                                    None,
                                )
                                .unwrap();
                            comm.wait_device(op).unwrap();
                        });
                        report("all_reduce", name, n / w * es, s, ar_bus);
                    }
                }};
            }
            if dtype == "f32" {
                bench_dtype!(f32, 1.0f32);
            } else {
                bench_dtype!(bf16, bf16::ONE);
            }
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn main() {
    println!("nccl_bandwidth: SKIPPED (no CUDA device): built without the `cuda` feature");
}

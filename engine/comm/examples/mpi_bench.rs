//! All-gather and reduce-scatter bus bandwidth of the MPI backend against the thread backend,
//! same world size, sizes and dtype, in the same run.
//!
//! Start with `mpirun -n W target/release/examples/mpi_bench [MAX_MIB]` (W = 2 or 4; sizes
//! 1 MiB .. MAX_MIB, default 64, of f32). Each MPI rank runs the MPI collectives; then rank 0
//! runs the same collectives on a thread world of W ranks while the other processes wait in a
//! (sleeping) barrier. Size = the full buffer (all-gather output, reduce-scatter input);
//! time = the slowest rank's, median of the repetitions; bus bandwidth = size / time x
//! (W - 1) / W (the bytes each rank must receive, as nccl-tests defines it). Prints a table
//! and one JSON line per (op, size).

use fsdp_comm::mpi::{MpiComm, MpiUniverse};
use fsdp_comm::{run_threads, Communicator, Group, ReduceOp, Topology, DEFAULT_TIMEOUT};
use std::time::Instant;

const OPS: [&str; 2] = ["all_gather", "reduce_scatter"];

/// Seconds of one collective on this rank.
fn time_op(c: &dyn Communicator, op: &str, send: &[f32], recv: &mut [f32]) -> f64 {
    let t = Instant::now();
    match op {
        "all_gather" => c
            .all_gather(Group::World, send.into(), recv.into())
            .expect("all_gather"),
        _ => c
            .reduce_scatter(Group::World, ReduceOp::Sum, send.into(), recv.into())
            .expect("reduce_scatter"),
    }
    t.elapsed().as_secs_f64()
}

/// Median over `reps` of the slowest rank's time (one warm-up first).
fn bench(c: &dyn Communicator, op: &str, bytes: usize, reps: usize) -> f64 {
    let w = c.world_size();
    let total = bytes / 4;
    let shard = total / w;
    let (send_n, recv_n) = if op == "all_gather" {
        (shard, shard * w)
    } else {
        (shard * w, shard)
    };
    let send: Vec<f32> = (0..send_n).map(|i| (i % 251) as f32).collect();
    let mut recv = vec![0f32; recv_n];
    let mut times = Vec::new();
    for r in 0..=reps {
        c.barrier(Group::World).expect("barrier");
        let mut t = [time_op(c, op, &send, &mut recv)];
        c.all_reduce(Group::World, ReduceOp::Max, (&mut t[..]).into())
            .expect("max");
        if r > 0 {
            times.push(t[0]);
        }
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    let max_mib: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(64);
    let universe = MpiUniverse::init().expect("MPI init");
    let w = universe.size();
    let topo = Topology::fully_sharded(w).expect("world");
    let comm = MpiComm::world(&universe, topo, DEFAULT_TIMEOUT).expect("MPI world");
    let me = universe.rank();
    let sizes: Vec<usize> = std::iter::successors(Some(1usize), |m| Some(m * 4))
        .take_while(|&m| m <= max_mib)
        .collect();
    let reps = |mib: usize| if mib >= 64 { 3 } else { 7 };
    let mut mpi = Vec::new();
    for op in OPS {
        for &mib in &sizes {
            mpi.push(bench(&comm, op, mib << 20, reps(mib)));
        }
    }
    let mut threads = Vec::new();
    if me == 0 {
        for op in OPS {
            for &mib in &sizes {
                let r = run_threads(topo, DEFAULT_TIMEOUT, |c| {
                    bench(&c, op, mib << 20, reps(mib))
                });
                threads.push(*r[0].as_ref().expect("thread rank 0"));
            }
        }
    }
    comm.barrier(Group::World).expect("final barrier");
    if me != 0 {
        return;
    }
    let bus = |mib: usize, t: f64| (mib << 20) as f64 / t * (w as f64 - 1.0) / w as f64 / 1e9;
    println!(
        "MPI vs thread backend, W={w}, f32, bus bandwidth GB/s ({})",
        universe.library_version().lines().next().unwrap_or("")
    );
    println!(
        "{:<15} {:>9} {:>12} {:>12} {:>10} {:>10} {:>9}",
        "op", "size MiB", "mpi ms", "threads ms", "mpi GB/s", "thr GB/s", "mpi/thr"
    );
    let mut i = 0;
    for op in OPS {
        for &mib in &sizes {
            let (m, t) = (mpi[i], threads[i]);
            println!(
                "{:<15} {:>9} {:>12.3} {:>12.3} {:>10.2} {:>10.2} {:>9.2}",
                op,
                mib,
                m * 1e3,
                t * 1e3,
                bus(mib, m),
                bus(mib, t),
                bus(mib, m) / bus(mib, t)
            );
            i += 1;
        }
    }
    let mut i = 0;
    for op in OPS {
        for &mib in &sizes {
            let (m, t) = (mpi[i], threads[i]);
            println!(
                "{{\"bench\":\"comm_mpi\",\"op\":\"{op}\",\"world_size\":{w},\"dtype\":\"f32\",\"bytes\":{},\"mpi_seconds\":{m:e},\"threads_seconds\":{t:e},\"mpi_busbw_gbps\":{:.4},\"threads_busbw_gbps\":{:.4},\"ratio\":{:.4}}}",
                mib << 20,
                bus(mib, m),
                bus(mib, t),
                bus(mib, m) / bus(mib, t)
            );
            i += 1;
        }
    }
}

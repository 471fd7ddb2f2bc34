//! The conformance suite on the MPI backend. Start it with `mpirun -n N` (N = 2 and 4 in the
//! tests): every process runs every check through [`MpiLauncher`]; topologies with more than N
//! ranks are skipped by the suite. The shared-memory barrier check (`barrier_waits_for_every_rank`
//! counts arrivals in one address space) is replaced by `barrier_orders_arrivals_by_clock`, which
//! compares arrival and departure times on the host clock (valid for processes of one host).
//!
//! Usage: `mpirun -n 4 target/debug/examples/mpi_conformance [CHECK_NAME_SUBSTRING...]`
//! Prints one line per check on rank 0 and `MPI conformance: all N checks passed on P
//! processes`; exits 1 when a check fails.

use fsdp_comm::conformance::{self, CheckFailure, Launcher, RankResult};
use fsdp_comm::mpi::{MpiLauncher, MpiUniverse};
use fsdp_comm::{Communicator, Group, Topology};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const GROUPS: [Group; 3] = [Group::World, Group::Shard, Group::Replicate];

fn now_us() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1e6)
        .unwrap_or(0.0)
}

/// Barrier: in 12 rounds over the world, shard and replicate groups of hybrid topologies, ranks
/// arrive at staggered times; every member must leave after the last member arrived.
fn barrier_orders_arrivals_by_clock(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "barrier_orders_arrivals_by_clock";
    let fail = |detail: String| CheckFailure { check: C, detail };
    for (s, r) in [(1, 1), (2, 1), (4, 1), (2, 2), (1, 2)] {
        let t = Topology::new(s, r).expect("valid");
        if t.world_size > l.max_world_size() {
            continue;
        }
        let body = |c: &dyn Communicator| -> RankResult {
            let mut out = Vec::new();
            for round in 0..12 {
                let group = GROUPS[round % 3];
                std::thread::sleep(Duration::from_millis(
                    ((c.rank() * 7 + round * 3) % 13) as u64,
                ));
                let arrive = now_us();
                c.barrier(group)?;
                out.extend([arrive, now_us()]);
            }
            Ok(out)
        };
        let res = l.launch(t, Duration::from_secs(30), &body);
        let times: Vec<Vec<f64>> = res
            .into_iter()
            .enumerate()
            .map(|(r, x)| x.map_err(|e| fail(format!("{t}, rank {r}: {e}"))))
            .collect::<Result<_, _>>()?;
        for round in 0..12 {
            let group = GROUPS[round % 3];
            for rank in 0..t.world_size {
                let members = t.group_members(group, rank);
                let last_arrival = members
                    .iter()
                    .map(|&m| times[m][2 * round])
                    .fold(f64::MIN, f64::max);
                let left = times[rank][2 * round + 1];
                if left < last_arrival {
                    return Err(fail(format!(
                        "{t}, round {round} ({group} group): rank {rank} left at {left:.0} us, \
                         before the last member arrived at {last_arrival:.0} us"
                    )));
                }
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let universe = match MpiUniverse::init() {
        Ok(u) => u,
        Err(e) => {
            eprintln!("mpi_conformance: {e}");
            return ExitCode::FAILURE;
        }
    };
    let me = universe.rank();
    let n = universe.size();
    // The suite panics one rank on purpose: print one line, not a backtrace.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("rank panicked (expected by the suite): {info}")
    }));
    let filters: Vec<String> = std::env::args().skip(1).collect();
    let launcher = MpiLauncher::new(universe.clone());
    if me == 0 {
        println!(
            "MPI conformance on {n} processes ({})",
            universe.library_version().lines().next().unwrap_or("")
        );
        println!("topologies with more than {n} ranks are skipped");
    }
    let mut checks: Vec<(&str, conformance::Check)> = conformance::CHECKS
        .iter()
        .filter(|(name, _)| *name != "barrier_waits_for_every_rank")
        .copied()
        .collect();
    checks.push((
        "barrier_orders_arrivals_by_clock",
        barrier_orders_arrivals_by_clock,
    ));
    checks.push((
        "device_tensors_are_errors_on_host_backends",
        device_tensors_are_errors,
    ));
    let mut failed = 0;
    let mut ran = 0;
    for (name, check) in checks {
        if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        ran += 1;
        let t0 = Instant::now();
        let r = check(&launcher);
        if me == 0 {
            match &r {
                Ok(()) => println!("ok      {name} ({:.2} s)", t0.elapsed().as_secs_f64()),
                Err(e) => println!("FAILED  {name}: {e}"),
            }
        }
        failed += usize::from(r.is_err());
    }
    if me == 0 {
        if failed == 0 {
            println!("MPI conformance: all {ran} checks passed on {n} processes");
        } else {
            println!("MPI conformance: {failed} of {ran} checks FAILED on {n} processes");
        }
    }
    drop(launcher);
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// [`conformance::device_tensors_are_errors_on_host_backends`] as a plain check: CUDA tensors
/// are `DeviceBufferUnreachable` on MPI; without a CUDA device it prints `SKIPPED (no CUDA
/// device): ...` (on stderr, every rank) and passes.
fn device_tensors_are_errors(
    l: &dyn conformance::Launcher,
) -> Result<(), conformance::CheckFailure> {
    conformance::device_tensors_are_errors_on_host_backends(l).map(|_| ())
}

//! The `fsdp` command line: `plan`, `train`, `ckpt`, `data`, `launch`.
//!
//! The binary installs [`CountingAllocator`] as its global allocator so that `fsdp train` can
//! report the process heap peak next to the plan.

use clap::Parser;
use fsdp::cli::{Cli, Command};
use fsdp::memory::CountingAllocator;
use std::process::ExitCode;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

/// Sizes candle's process-wide CPU thread pools for `world_size` rank threads before any tensor
/// operation runs: gemm threads (`RAYON_NUM_THREADS`) get `--threads-per-rank`, default
/// `cores / W`, so W ranks on a few cores do not oversubscribe them. Candle's spinning barrier
/// pool for element-wise ops (`CANDLE_NUM_THREADS`, created once on first use, one pool for
/// the whole process) gets only the cores the ranks' compute threads leave free, plus the
/// calling thread: 1 when W x threads per rank fill the cores. Its workers spin between the
/// many small element-wise ops and take cycles from the GEMMs of the compute threads (mini,
/// W = 1 on 2 busy cores: whole-process wall time 0.88-0.98x with 1; the Llama of
/// `benches/llama-bench`, one process with `--threads-per-rank 2`: step time about 0.95x with 1
/// instead of 2). A request is first capped as the run caps it
/// ([`fsdp::preflight::cap_threads`]: at most cores / ranks), so no pool is sized from a
/// request the run then lowers. Variables the user already set are left alone, with a note
/// on standard error when they differ from these sizes or are not a positive number.
fn size_compute_threads(world_size: usize, threads_per_rank: Option<usize>) {
    let cores = fsdp::preflight::cores();
    let threads_per_rank = fsdp::preflight::cap_threads(threads_per_rank, world_size, cores).0;
    let gemm = threads_per_rank.unwrap_or((cores / world_size.max(1)).max(1));
    let elementwise = fsdp::preflight::elementwise_threads(world_size, gemm, cores);
    let per_core = format!("one way per core ({cores})");
    for (var, n, what, fallback) in [
        (
            "RAYON_NUM_THREADS",
            gemm,
            "ways each GEMM is split",
            per_core.as_str(),
        ),
        (
            "CANDLE_NUM_THREADS",
            elementwise,
            "threads of the element-wise pool",
            "as many as the GEMM's split",
        ),
    ] {
        match std::env::var_os(var) {
            None => std::env::set_var(var, n.to_string()),
            // The user's setting stands; say when it is not what this run would choose.
            Some(v) => match v.to_str().and_then(|t| t.trim().parse::<usize>().ok()) {
                Some(u) if u > 0 && u == n => {}
                Some(u) if u > 0 => fsdp::output::print_err(&format!(
                    "note: {var}={u} from the environment sets the {what} (this run would use \
                     {n} on {cores} core(s)); unset it to let fsdp size it\n"
                )),
                _ => fsdp::output::print_err(&format!(
                    "note: {var}={} from the environment is not a positive number: candle then \
                     uses {fallback} for the {what}; unset it or give a positive number\n",
                    v.to_string_lossy()
                )),
            },
        }
    }
}

fn main() -> ExitCode {
    fsdp::memory::tune_allocator();
    let cli = Cli::parse();
    // Training's work is the model and its checkpoints; every other command's is its output.
    let output_is_the_work = !matches!(cli.command, Command::Train(_) | Command::Launch(_));
    let result = match cli.command {
        Command::Train(a) => {
            // Ranks on this node: the rank threads, or the launcher's processes here.
            let ranks = match a.backend {
                fsdp::cli::args::BackendArg::Threads => a.world_size,
                _ => fsdp::preflight::launcher_local_ranks(|k| std::env::var(k).ok())
                    .map_or(1, |n| n as usize),
            };
            size_compute_threads(ranks, a.threads_per_rank);
            fsdp::cli::train::run(a, Some(&ALLOC))
        }
        Command::Eval(a) => {
            size_compute_threads(a.world_size, a.threads_per_rank);
            fsdp::cli::eval::run(a)
        }
        Command::Calibrate(a) => {
            // Ranks on this node: the rank threads, or mpirun's processes here.
            let ranks = match a.backend {
                fsdp::cli::calibrate::CalibrateBackendArg::Threads => a.ranks(),
                fsdp::cli::calibrate::CalibrateBackendArg::Mpi => {
                    fsdp::preflight::launcher_local_ranks(|k| std::env::var(k).ok())
                        .map_or(1, |n| n as usize)
                }
            };
            size_compute_threads(ranks, a.threads_per_rank);
            fsdp::cli::calibrate::run(a)
        }
        // The launcher exits with the failing rank's own code.
        Command::Launch(a) => match fsdp::cli::launch::run(a) {
            Ok(code) => return ExitCode::from(code),
            Err(e) => Err(e),
        },
        command => fsdp::cli::run(Cli { command }),
    };
    let result = result.and_then(|()| match fsdp::output::stdout_failure() {
        Some(e) if output_is_the_work => Err(fsdp::cli::CliError::Failed(format!(
            "cannot write standard output: {e}; the output is incomplete"
        ))),
        _ => Ok(()),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The run said where it saved and how to resume.
        Err(e @ fsdp::cli::CliError::Stopped(_)) => ExitCode::from(e.exit_code()),
        Err(e) => {
            fsdp::output::print_err(&format!("error: {e}\n"));
            ExitCode::from(e.exit_code())
        }
    }
}

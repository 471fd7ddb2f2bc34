//! `fsdp calibrate`: measure this machine into an `fsdp-hardware/1` profile for `fsdp plan
//! --time --hardware FILE` and `fsdp train --hardware FILE` (see [`crate::calibrate`]).

use super::CliError;
use std::path::PathBuf;

/// The device `fsdp calibrate --device` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CalibrateDeviceArg {
    /// The host CPU: rank threads, candle's CPU matmul, the thread backend.
    Cpu,
    /// A CUDA GPU.
    Cuda,
}

/// A switch given as `on` or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnOff {
    /// On.
    On,
    /// Off.
    Off,
}

/// The collectives `fsdp calibrate` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CalibrateBackendArg {
    /// `--world-size` rank threads in this process (the thread backend).
    Threads,
    /// This process is one rank of an MPI job (`mpirun -n W fsdp calibrate --backend mpi -o
    /// FILE`; rank 0 writes the profile). Needs a binary built with `--features mpi`.
    Mpi,
}

/// Arguments of `fsdp calibrate`.
#[derive(Debug, clap::Args)]
#[command(allow_negative_numbers = true)]
pub struct CalibrateArgs {
    /// Whose collectives to measure: rank threads (`threads`) or MPI processes (`mpi`, under
    /// `mpirun -n W`; the world size is mpirun's). The compute fit's reference jobs run on the
    /// same backend.
    #[arg(long, value_enum, default_value_t = CalibrateBackendArg::Threads)]
    pub backend: CalibrateBackendArg,
    /// Rank threads measured at once, as the `fsdp train --world-size` the profile is for
    /// (default 2; 1: no collectives are measured, a one-rank plan issues none). On a CPU
    /// every rank's rates are its share of the cores, so calibrate at the world size you will
    /// train at. `--device cuda` measures one GPU: 1.
    #[arg(long, value_parser = super::checks::at_least_one)]
    pub world_size: Option<usize>,
    /// Compute threads per rank (default: cores / world size, as `fsdp train`; CPU only). More
    /// than cores / ranks are lowered to that, with a warning, as in `fsdp train`.
    #[arg(long, value_parser = super::checks::at_least_one)]
    pub threads_per_rank: Option<usize>,
    /// The device to measure: `cpu` (rank threads and the thread backend), or `cuda` (GPU 0
    /// of `CUDA_VISIBLE_DEVICES` through candle's CUDA ops; needs a binary built with
    /// `--features cuda`; collectives are not measured with one device, they come from the
    /// same GPU's built-in profile and their sources say so).
    #[arg(long, value_enum, default_value_t = CalibrateDeviceArg::Cpu)]
    pub device: CalibrateDeviceArg,
    /// The profile's name (default: `calibrated-<host>`; not empty, no control characters).
    #[arg(long, value_parser = super::checks::profile_name)]
    pub name: Option<String>,
    /// Fit the compute model to reference training steps run on this machine (`on`, about a
    /// minute on 2 cores: the profile's `compute_fit`), or leave the analytical model as is
    /// (`off`).
    #[arg(long, value_enum, value_name = "on|off", default_value_t = OnOff::On)]
    pub compute_fit: OnOff,
    /// Write the profile here (default: standard output).
    #[arg(short = 'o', long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

impl CalibrateArgs {
    /// The world size measured: `--world-size`, else 2 rank threads on the CPU and 1 process
    /// on a GPU.
    pub fn ranks(&self) -> usize {
        self.world_size.unwrap_or(match self.device {
            CalibrateDeviceArg::Cpu => 2,
            CalibrateDeviceArg::Cuda => 1,
        })
    }
}

/// Runs `fsdp calibrate`.
///
/// Errors: [`CliError::Usage`] (exit 2) for more than 4 rank threads per core, a world size
/// other than 1 with `--device cuda`, an unwritable output path or a CUDA request this build
/// or machine cannot serve (a world size under 1 is refused by its parser);
/// [`CliError::Failed`] (exit 1) when a measurement fails.
pub fn run(a: CalibrateArgs) -> Result<(), CliError> {
    if let Some(o) = &a.output {
        crate::output::check_output_path("-o", o, "profile.json").map_err(CliError::Usage)?;
    }
    if a.device == CalibrateDeviceArg::Cuda {
        return run_cuda(&a);
    }
    if a.backend == CalibrateBackendArg::Mpi {
        return run_mpi(&a);
    }
    let world_size = a.ranks();
    let cores = crate::preflight::cores();
    // Oversubscribed ranks share cores as they do in training at that world size; far beyond
    // the cores, calibrate would measure the scheduler, not the hardware.
    let most = 4 * cores.max(1);
    if world_size > most {
        return Err(CliError::Usage(format!(
            "--world-size {world_size}: more than 4 rank threads per core of this host's {cores} \
             cores measure the scheduler, not the hardware; give at most {most}"
        )));
    }
    let threads = capped_threads(a.threads_per_rank, world_size, cores);
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let name = a
        .name
        .clone()
        .unwrap_or_else(|| format!("calibrated-{}", host_name()));
    let opts = crate::calibrate::CalibrateOptions {
        world_size,
        threads_per_rank: threads,
        command,
        name,
        compute_fit: a.compute_fit == OnOff::On,
    };
    announce(
        &format!("this host with {world_size} rank thread(s) of {threads} compute thread(s)"),
        opts.compute_fit,
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| CliError::Failed(format!("thread pool: {e}")))?;
    let c = pool
        .install(|| crate::calibrate::calibrate(&opts, None))
        .map_err(CliError::Failed)?;
    warn(&c.warnings);
    write_profile(&a, &c.profile)
}

/// Prints each of calibrate's warnings on standard error.
fn warn(warnings: &[String]) {
    for w in warnings {
        crate::output::print_err(&format!("warning: {w}\n"));
    }
}

/// The compute threads per rank for `ranks` ranks on this node, capped as `fsdp train` caps
/// them ([`crate::preflight::cap_threads`]: at most cores / ranks, with its warning on
/// standard error): the sizes candle's pools were given before this runs
/// (`size_compute_threads` in `main.rs`) and the rank pools measured here agree.
fn capped_threads(requested: Option<usize>, ranks: usize, cores: usize) -> usize {
    let (threads, warning) = crate::preflight::cap_threads(requested, ranks, cores);
    if let Some(w) = warning {
        crate::output::print_err(&format!("{w}\n"));
    }
    threads.unwrap_or((cores / ranks.max(1)).max(1))
}

/// Runs `fsdp calibrate --backend mpi` as one process of an MPI job: every process measures
/// at once, the rates are averaged over them, and rank 0 writes the profile.
fn run_mpi(a: &CalibrateArgs) -> Result<(), CliError> {
    let mut o = crate::options::TrainOptions::default();
    let mpi = crate::process::mpi::MpiProcess::init(a.world_size.unwrap_or(1), 60.0, &mut o)?;
    let world_size = o.world_size;
    let local =
        crate::preflight::launcher_local_ranks(|k| std::env::var(k).ok()).map_or(1, |n| n as usize);
    let threads = capped_threads(a.threads_per_rank, local, crate::preflight::cores());
    let opts = crate::calibrate::CalibrateOptions {
        world_size,
        threads_per_rank: threads,
        command: std::env::args().collect::<Vec<_>>().join(" "),
        name: a
            .name
            .clone()
            .unwrap_or_else(|| format!("calibrated-{}", host_name())),
        compute_fit: a.compute_fit == OnOff::On,
    };
    if mpi.rank() == 0 {
        announce(
            &format!("{world_size} MPI processes of {threads} compute thread(s)"),
            opts.compute_fit,
        );
    }
    let profile = mpi.with_world(|comm, factory| {
        let p = crate::calibrate::ProcessRank {
            comm,
            rank: mpi.rank(),
            factory,
            backend: "MPI over the job's processes",
        };
        crate::calibrate::calibrate(&opts, Some(&p))
    })?;
    let c = profile.map_err(|e| CliError::Failed(format!("rank {}: {e}", mpi.rank())))?;
    if mpi.rank() == 0 {
        warn(&c.warnings);
        write_profile(a, &c.profile)?;
    }
    Ok(())
}

/// Runs `fsdp calibrate --device cuda`: one GPU, world size 1.
fn run_cuda(a: &CalibrateArgs) -> Result<(), CliError> {
    if let Some(w) = a.world_size.filter(|&w| w != 1) {
        return Err(CliError::Usage(format!(
            "--world-size {w}: --device cuda measures one GPU in one process (world size 1); \
             collectives between GPUs are not measured (omit --world-size)"
        )));
    }
    if a.threads_per_rank.is_some() {
        return Err(CliError::Usage(
            "--threads-per-rank sizes the CPU's compute threads: it does not apply to --device \
             cuda (omit it)"
                .into(),
        ));
    }
    let ordinal = 0;
    let (dev, devices) = super::open_cuda(ordinal)?;
    let opts = crate::calibrate::cuda::CudaCalibrateOptions {
        ordinal,
        devices,
        device_name: fsdp_kernels::cuda::device_name(ordinal),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        name: a
            .name
            .clone()
            .unwrap_or_else(|| format!("calibrated-{}-gpu", host_name())),
    };
    announce("CUDA device 0", false);
    let profile = crate::calibrate::cuda::calibrate_cuda(&dev, &opts).map_err(CliError::Failed)?;
    write_profile(a, &profile)
}

/// Writes `profile` as pretty JSON to `-o FILE`, else standard output. With `-o`, one line
/// on standard error says what was written and how to use it (standard output stays empty).
fn write_profile(
    a: &CalibrateArgs,
    profile: &fsdp_planner::time::HardwareProfile,
) -> Result<(), CliError> {
    let mut text = serde_json::to_string_pretty(profile)
        .map_err(|e| CliError::Failed(format!("serializing the profile: {e}")))?;
    text.push('\n');
    match &a.output {
        Some(p) => {
            std::fs::write(p, text)
                .map_err(|e| CliError::Failed(format!("cannot write {}: {e}", p.display())))?;
            crate::output::print_err(&format!(
                "wrote profile {} to {} ({}): `fsdp plan --time --hardware {}` predicts a step \
                 on it, `fsdp train --hardware {}` compares a run with it\n",
                profile.name,
                p.display(),
                profile.description,
                p.display(),
                p.display()
            ));
            Ok(())
        }
        None => {
            crate::output::print_out(&text);
            Ok(())
        }
    }
}

/// The line `fsdp calibrate` prints on standard error before it measures, so the half
/// minute of silence that follows is explained.
fn announce(what: &str, reference_jobs: bool) {
    let jobs = if reference_jobs {
        ", short reference training jobs"
    } else {
        ""
    };
    crate::output::print_err(&format!(
        "calibrating {what} (GEMM rates, copy bandwidth, collectives{jobs}); this takes a \
         minute or so\n"
    ));
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "host".into())
}

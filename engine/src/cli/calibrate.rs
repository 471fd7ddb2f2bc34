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

/// Arguments of `fsdp calibrate`.
#[derive(Debug, clap::Args)]
pub struct CalibrateArgs {
    /// Rank threads measured at once, as the `fsdp train --world-size` the profile is for
    /// (1: no collectives are measured; a one-rank plan issues none). On a CPU every rank's
    /// rates are its share of the cores, so calibrate at the world size you will train at.
    #[arg(long, default_value_t = 2)]
    pub world_size: usize,
    /// Compute threads per rank (default: cores / world size, as `fsdp train`).
    #[arg(long, value_parser = super::checks::at_least_one)]
    pub threads_per_rank: Option<usize>,
    /// The device to measure.
    #[arg(long, value_enum, default_value_t = CalibrateDeviceArg::Cpu)]
    pub device: CalibrateDeviceArg,
    /// The profile's name (default: `calibrated-<host>`).
    #[arg(long)]
    pub name: Option<String>,
    /// Fit the compute model to reference training steps run on this machine (`on`, about 10
    /// seconds: the profile's `compute_fit`), or leave the analytical model as is (`off`).
    #[arg(long, value_enum, value_name = "on|off", default_value_t = OnOff::On)]
    pub compute_fit: OnOff,
    /// Write the profile here (default: standard output).
    #[arg(short = 'o', long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

/// Runs `fsdp calibrate`.
///
/// Errors: [`CliError::Usage`] (exit 2) for a world size under 2, an unwritable output path
/// or a CUDA request this build or machine cannot serve; [`CliError::Failed`] (exit 1) when a
/// measurement fails.
pub fn run(a: CalibrateArgs) -> Result<(), CliError> {
    if let Some(o) = &a.output {
        crate::checkpoint::offline::check_output_file("-o", o)?;
    }
    if a.world_size < 1 {
        return Err(CliError::Usage(
            "--world-size 0: give at least 1 rank thread".into(),
        ));
    }
    let cores = crate::preflight::cores();
    // Oversubscribed ranks share cores as they do in training at that world size; far beyond
    // the cores, calibrate would measure the scheduler, not the hardware.
    let most = 4 * cores.max(1);
    if a.world_size > most {
        return Err(CliError::Usage(format!(
            "--world-size {}: more than 4 rank threads per core of this host's {cores} cores \
             measure the scheduler, not the hardware; give at most {most}",
            a.world_size
        )));
    }
    if a.device == CalibrateDeviceArg::Cuda {
        return Err(CliError::Usage(if cfg!(feature = "cuda") {
            "--device cuda: this version of fsdp calibrate measures the CPU (rank threads and the \
             thread backend) only; use a built-in GPU profile (--hardware h100-sxm, h200, \
             a100-80gb)"
                .into()
        } else {
            "--device cuda: this binary is built without CUDA: rebuild with `cargo build \
             --release --features cuda` (see gpu/README.md)"
                .into()
        }));
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = a.threads_per_rank.unwrap_or((cores / a.world_size).max(1));
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let name = a
        .name
        .clone()
        .unwrap_or_else(|| format!("calibrated-{}", host_name()));
    let opts = crate::calibrate::CalibrateOptions {
        world_size: a.world_size,
        threads_per_rank: threads,
        command,
        name,
        compute_fit: a.compute_fit == OnOff::On,
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| CliError::Failed(format!("thread pool: {e}")))?;
    let profile = pool
        .install(|| crate::calibrate::calibrate(&opts))
        .map_err(CliError::Failed)?;
    let mut text = serde_json::to_string_pretty(&profile)
        .map_err(|e| CliError::Failed(format!("serializing the profile: {e}")))?;
    text.push('\n');
    match &a.output {
        Some(p) => std::fs::write(p, text)
            .map_err(|e| CliError::Failed(format!("cannot write {}: {e}", p.display()))),
        None => {
            crate::output::print_out(&text);
            Ok(())
        }
    }
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "host".into())
}

//! The `fsdp` CLI (clap): one module per subcommand. Bad input exits with code 2 and a message,
//! never a panic; a failed run (NaN loss, memory over plan, a dead rank) exits with code 1; a
//! training run stopped by SIGINT or SIGTERM exits with 130 or 143 ([`stop`]). Everything is
//! printed through [`crate::output`], which never panics on a closed stream.

use clap::{Parser, Subcommand};

pub mod args;
pub mod calibrate;
pub mod checks;
pub mod ckpt;
pub mod data;
pub mod eval;
pub mod launch;
pub mod plan;
pub mod progress;
pub mod stop;
pub mod timing;
pub mod train;

/// Errors surfaced by the CLI, with the exit code each maps to.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad input: a flag, a file, a model description (exit code 2).
    #[error("{0}")]
    Usage(String),
    /// A run that started and failed (exit code 1).
    #[error("{0}")]
    Failed(String),
    /// A training run stopped early by this signal (SIGINT, SIGTERM) after saving what it
    /// could and saying so: exit code 128 + signal ([`stop::exit_code`]), no further message.
    #[error("stopped by {}", stop::signal_name(*.0))]
    Stopped(i32),
}

impl From<crate::error::RunError> for CliError {
    /// Bad input stays bad input (exit code 2); a failure stays a failure (exit code 1).
    fn from(e: crate::error::RunError) -> Self {
        match e {
            crate::error::RunError::Refused(m) => CliError::Usage(m),
            crate::error::RunError::Failed(m) => CliError::Failed(m),
        }
    }
}

/// Maps an engine error to the CLI's exit codes: bad input 2, failed run 1 (as
/// [`crate::error::RunError`] sorts them).
pub fn cli_error(e: crate::error::EngineError) -> CliError {
    crate::error::RunError::from(e).into()
}

impl CliError {
    /// 2 for bad input, 1 for a failed run, 128 + signal for a run stopped by a signal.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) => 2,
            CliError::Failed(_) => 1,
            CliError::Stopped(sig) => stop::exit_code(*sig),
        }
    }
}

/// fsdp-rs: fully sharded data-parallel training with an exact memory plan.
#[derive(Debug, Parser)]
#[command(name = "fsdp", version, about)]
pub struct Cli {
    /// The subcommand.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Plan the sharding and memory of a model: "will it fit on N devices, and how?"
    Plan(plan::PlanArgs),
    /// Inspect, consolidate or reshard a sharded checkpoint (offline).
    Ckpt(ckpt::CkptArgs),
    /// Train a GPT or Llama on text (bytes as tokens) or a token file with W rank threads under
    /// a sharding strategy.
    Train(train::TrainArgs),
    /// The loss and perplexity of a model directory's or a checkpoint's weights on a data
    /// split (the held-out split `fsdp train` evaluates), sharded over rank threads.
    Eval(eval::EvalArgs),
    /// Prepare training data: `fsdp data tokenize` encodes texts with a Hugging Face
    /// tokenizer into a token file for `fsdp train --data`.
    Data(data::DataArgs),
    /// Start N processes of one job on this node (torchrun's environment), prefix their output
    /// with their rank, stop all when one fails, and restart the job (`--max-restarts`; at a
    /// smaller world size when a device is lost, `--min-nproc`).
    Launch(launch::LaunchArgs),
    /// Measure this machine (GEMM per dtype by size and by shape, memory and elementwise
    /// rates, collectives over rank threads, the overlap slowdown; or one GPU with `--device
    /// cuda`) into a hardware profile for `--hardware FILE`.
    Calibrate(calibrate::CalibrateArgs),
}

/// Runs one parsed command line.
pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Plan(a) => plan::run(a),
        Command::Ckpt(a) => ckpt::run(a),
        Command::Train(a) => train::run(a, None),
        Command::Data(a) => data::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Calibrate(a) => calibrate::run(a),
        Command::Launch(a) => match launch::run(a)? {
            0 => Ok(()),
            code => Err(CliError::Failed(format!("a rank exited with code {code}"))),
        },
    }
}

/// Opens GPU `ordinal` for `--device cuda`. The driver is asked first (`cuInit`, device count)
/// so that a build without the feature, a missing or stub driver library (`libcuda.so.1`) or a
/// missing device is a usage error (exit 2) saying which, not a failure deep inside candle.
/// Returns the device and the driver's device count (`fsdp train` and `fsdp calibrate`).
pub(crate) fn open_cuda(ordinal: usize) -> Result<(candle_core::Device, usize), CliError> {
    use fsdp_kernels::cuda::{probe, Probe};
    let n = match probe() {
        Probe::Unavailable(why) if cfg!(not(feature = "cuda")) => {
            return Err(CliError::Usage(format!(
                "--device cuda: cannot open GPU {ordinal}: this binary is {why}: rebuild with \
                 `cargo build --release --features cuda` (see gpu/README.md)"
            )))
        }
        Probe::Unavailable(why) => {
            return Err(CliError::Usage(format!(
                "--device cuda: cannot open GPU {ordinal}: no usable CUDA device: {why}. The \
                 CUDA driver library libcuda.so.1 found on the library path must be the NVIDIA \
                 driver's (not the toolkit's link stub) and see a GPU (on the GPU test machine: \
                 `. target-gpu/device-env.sh` first)"
            )))
        }
        Probe::Available(n) if ordinal >= n => {
            return Err(CliError::Usage(format!(
                "--device cuda: cannot open GPU {ordinal}: the CUDA driver (libcuda.so.1) sees \
                 {n} device(s), numbered from 0 (LOCAL_RANK picks the GPU; CUDA_VISIBLE_DEVICES \
                 limits them)"
            )))
        }
        Probe::Available(n) => n,
    };
    // One explicit stream for every thread of the rank (candle's plain `new_cuda` computes on
    // CUDA's per-thread default stream).
    let dev = candle_core::Device::new_cuda_with_stream(ordinal).map_err(|e| {
        CliError::Usage(format!(
            "--device cuda: cannot open GPU {ordinal} (CUDA driver library libcuda.so.1): {e}"
        ))
    })?;
    Ok((dev, n))
}

//! `fsdp plan`.

use super::CliError;

/// Arguments of `fsdp plan`.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// World size (number of ranks).
    #[arg(long, default_value_t = 1)]
    pub world_size: u64,
}

/// Runs `fsdp plan`.
pub fn run(args: PlanArgs) -> Result<(), CliError> {
    if args.world_size == 0 {
        return Err(CliError::Usage("world size must be at least 1".into()));
    }
    Ok(())
}

//! The `fsdp` command line: `plan`, `train`, `ckpt`.

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = fsdp::cli::Cli::parse();
    match fsdp::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

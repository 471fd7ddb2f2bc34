//! `fsdp launch`: start one process per rank on this node, torchrun-style, and restart the job
//! when a rank fails (elastically, at a smaller world size, when a device slot is lost).
//!
//! `fsdp launch --nproc N [--max-restarts R] [--min-nproc M] [--master-addr A] [--master-port
//! P] [--program PATH] -- ARGS...` starts N copies of the current `fsdp` executable (or
//! `--program`) with `ARGS`, each with torchrun's environment — `RANK = LOCAL_RANK = r`,
//! `WORLD_SIZE = LOCAL_WORLD_SIZE = N`, `MASTER_ADDR`, `MASTER_PORT`, and torchrun's
//! `TORCHELASTIC_RESTART_COUNT` (0, then 1, 2, ... on restarts) and
//! `TORCHELASTIC_MAX_RESTARTS` — which [`fsdp_comm::rendezvous::LaunchEnv`] reads (LOCAL_RANK
//! selects the CUDA device, rank 0 serves the rendezvous on the master port; every attempt
//! binds the same port again, as the listener sets `SO_REUSEADDR`) — and
//! [`super::stop::LAUNCH_COMMAND_ENV`], the launcher's own command line, from which a rank of `fsdp train`
//! stopped by a signal prints the `fsdp launch ... --resume` command to rerun.
//!
//! Every line a rank writes to stdout or stderr is copied to the launcher's stdout or stderr
//! with the prefix `[rank r] ` (a final line without a newline gets one). When the launcher's
//! stdout or stderr is closed (`fsdp launch ... | head -1`), the launcher neither panics nor
//! dies: it drops those lines, keeps reading the ranks' pipes (a rank never blocks on a full
//! pipe) and supervises the job to its end.
//!
//! # What counts as a failure
//! A rank that exits with a non-zero code, or is killed by a signal (code 128 + signal), fails
//! the attempt. A rank that hangs is ended by its own communicator: a collective that waits
//! longer than `fsdp train --comm-timeout` (60 s; the rendezvous 60 s too) fails with an error
//! naming the missing ranks and the process exits 1, which the launcher sees. The launcher
//! does not watch progress itself. A rank that exits 0 while another fails does not save the
//! attempt: a job succeeds only when every rank of one attempt exits 0.
//!
//! On the first failure the launcher stops the other ranks at once (SIGKILL to each rank's
//! process group: a sharded checkpoint needs every rank, so the survivors could not save one
//! and a SIGTERM would only let them wait for the dead peer until the timeout), except when
//! the failed rank exited with 130 or 143 by itself — it was sent SIGINT or SIGTERM and
//! stopped with its peers after writing a final checkpoint: then the others get `--grace`
//! seconds to finish that checkpoint before they are killed. A line on stderr names the
//! rank, what happened ("exited with code 3", "killed by SIGKILL", "stopped by SIGTERM (exit
//! 143)") and the ranks stopped.
//!
//! # Restarts
//! With `--max-restarts R` (default 0: the first failure ends the job with the failing rank's
//! code), a failed attempt is followed by a new one, at most R times, with a line on stderr:
//! `restart 2/3: rank 1 killed by SIGKILL; resuming from the newest intact checkpoint
//! (--resume-from latest-valid)`. After R restarts the launcher exits with the last failing
//! rank's code. A rank of an `fsdp` subcommand exiting 2 (bad input) ends the job without a
//! restart: the same command would be refused again.
//!
//! Restarts rerun the same command line. For `fsdp train --ckpt-dir DIR`, once the job has
//! saved a checkpoint (DIR's `latest` pointer changed since the launch), a restart replaces
//! `--resume` / `--resume-from` by `--resume-from latest-valid`: it continues from the newest
//! checkpoint that opens and verifies, so a damaged newest one falls back to the previous one,
//! and a resume is bitwise the uninterrupted run. Before the job's first save a restart runs
//! the command as given (a fresh run starts again from step 0, a resume from the same
//! checkpoint). `fsdp train` without `--ckpt-dir` saves nothing: restarts train from step 0
//! (the launcher warns at start).
//!
//! # Elastic restarts
//! `--min-nproc M` (default N) lets a restart run fewer ranks when a device slot is lost: a
//! slot (LOCAL_RANK of the first attempt, the device ordinal) is lost when its rank is the
//! first to fail in 2 consecutive attempts, each time within `--startup-window` seconds (60)
//! of the attempt's start — a device or node that cannot run a rank fails it while it
//! initialises; a failure later in training is not the slot's — or when its process cannot
//! be started at all. The next attempt runs at the largest world size W' with M <= W' <=
//! the slots left that the command can use (`fsdp train --strategy hybrid --shard-size S`:
//! a multiple of S), on the first W' healthy slots: `WORLD_SIZE = W'`, `LOCAL_RANK = 0..W'`
//! and `CUDA_VISIBLE_DEVICES` listing those slots' devices (entries of the launcher's own
//! `CUDA_VISIBLE_DEVICES` when set), so LOCAL_RANK i is the i-th healthy device. An
//! `fsdp train --backend nccl --world-size N` gets `--world-size W'`; the trainer reshards
//! the checkpoint on load and continues the data stream. Lost slots are not tried again in
//! the job. When fewer than M slots are left, or no world size from M up fits, the launcher
//! exits 1 naming why. Like torchrun's elastic agent, the global batch (W' x micro-batch x
//! accumulation) shrinks with the world.
//!
//! # Stopping the launcher
//! Ctrl-C (SIGINT) or SIGTERM to the launcher is a user stop: it is forwarded to every rank's
//! process group (`fsdp train` then stops after the current step and writes a final
//! checkpoint); ranks still running after `--grace` seconds (30) are killed; a second signal
//! kills them at once; there is no restart, and the launcher exits with 130 (SIGINT) or 143
//! (SIGTERM). Each rank runs in its own process group (so it and its children can be
//! signalled together) and, on Linux, dies with the launcher (`PR_SET_PDEATHSIG`).
//!
//! # Under Slurm
//! One task runs the launcher on the node; the resume flag in the command makes a requeued job
//! continue where it stopped:
//!
//! ```text
//! #SBATCH --nodes=1 --ntasks=1 --requeue --signal=TERM@120
//! srun --kill-on-bad-exit=1 fsdp launch --nproc 8 --max-restarts 3 --grace 90 -- \
//!     train --device cuda --backend nccl --ckpt-dir /shared/run1 --ckpt-every 500 --resume ...
//! ```
//!
//! 120 s before the time limit (`--signal=TERM@120`), and when the job is preempted, Slurm
//! sends SIGTERM to the processes of the job step: with the usual process tracking
//! (proctrack/cgroup) to the ranks as well as to the launcher, which forwards it too, so a
//! rank may see it twice within a moment. `fsdp train` stops after the current step, writes a
//! final checkpoint and exits 143, and so does the launcher. Slurm kills what is left at the
//! time limit, or `KillWait` seconds (30 by default) after a cancel, or after the partition's
//! preemption `GraceTime`: the step in flight and the save must fit in that time, and
//! `--grace` too. `--kill-on-bad-exit=1` ends the step when a task exits non-zero (here the
//! launcher, once its restarts are spent); `--requeue` queues a preempted or failed job again
//! with the same script, and `--resume` continues from the newest checkpoint (starting fresh
//! when there is none). `fsdp train --backend mpi` is started by `srun` or `mpirun`
//! directly, not by `fsdp launch`; there Slurm's requeue is the restart.
//!
//! Bad input (N = 0, `--min-nproc` outside 1..=N or without `--max-restarts`, no command
//! after `--` without `--program`, a program that cannot be executed, `train --backend mpi`
//! with N > 1) exits 2.

use super::CliError;
use clap::Args;
use std::path::PathBuf;
use std::time::Duration;

mod ranks;
mod restart;

pub use ranks::{signal_name, AttemptEnd, Cause, Failure};
pub use restart::{RankCommand, Resume, TrainCommand, LOST_AFTER};

use ranks::{run_attempt, say, take_signal, Attempt};
use restart::{command_for, elastic_world, visible_devices, LatestMark, SlotHealth};

/// This process's command line, shell-quoted (POSIX `sh`): the value of
/// [`super::stop::LAUNCH_COMMAND_ENV`].
fn own_command_line() -> String {
    let args: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    shlex::try_join(args.iter().map(String::as_str)).unwrap_or_else(|_| args.join(" "))
}

/// Arguments of `fsdp launch`.
#[derive(Debug, Args)]
#[command(trailing_var_arg = true)]
pub struct LaunchArgs {
    /// Number of processes (ranks) to start on this node; rank r gets `RANK = LOCAL_RANK = r`
    /// (LOCAL_RANK is the CUDA device ordinal).
    #[arg(long)]
    pub nproc: usize,
    /// Address rank 0's rendezvous listens on (`MASTER_ADDR`).
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// TCP port of rank 0's rendezvous (`MASTER_PORT`); torchrun's default.
    #[arg(long, default_value_t = 29500)]
    pub master_port: u16,
    /// Program to start instead of this `fsdp` executable (e.g. a conformance test binary).
    #[arg(long)]
    pub program: Option<PathBuf>,
    /// Seconds ranks get to exit after a forwarded Ctrl-C / SIGTERM (and to finish their final
    /// checkpoint after a peer stopped by one) before they are killed: enough for `fsdp
    /// train` to finish its step and write its final checkpoint (torchrun's default, 30 s).
    #[arg(long, default_value_t = 30.0)]
    pub grace: f64,
    /// Restart the whole job up to N times when a rank fails (exits non-zero, is killed or
    /// times out); `fsdp train --ckpt-dir` restarts resume from the newest intact checkpoint.
    /// 0: the first failure ends the job.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: u32,
    /// Elastic restarts: the fewest ranks a restart may run when device slots are lost (a
    /// slot whose rank fails first at start-up in 2 consecutive attempts). Default: --nproc
    /// (never fewer). Needs --max-restarts.
    #[arg(long)]
    pub min_nproc: Option<usize>,
    /// Seconds from an attempt's start within which a failure counts as a failure at start-up
    /// (the elastic rule of --min-nproc).
    #[arg(long, default_value_t = 60.0)]
    pub startup_window: f64,
    /// The command line every rank runs (after `--`), e.g. `train --model tiny`: arguments of
    /// this `fsdp` executable, or of `--program` (which may take none).
    #[arg(allow_hyphen_values = true, num_args = 0..)]
    pub command: Vec<String>,
}

/// A non-negative number of seconds up to [`crate::process::MAX_WAIT_SECONDS`].
fn seconds(flag: &str, v: f64) -> Result<Duration, CliError> {
    let max = crate::process::MAX_WAIT_SECONDS;
    if !(v.is_finite() && v >= 0.0 && v <= max) {
        return Err(CliError::Usage(format!(
            "{flag} must be a non-negative number of seconds up to {max:e}, got {v}"
        )));
    }
    Ok(Duration::from_secs_f64(v))
}

/// Starts the ranks, relays their output, restarts failed attempts, and returns the
/// launcher's exit code: 0 when every rank of one attempt exited 0; else the last failing
/// rank's code, 128 + signal for a user stop, 1 when an elastic restart finds too few slots
/// (see the module docs).
///
/// Errors: [`CliError::Usage`] for `--nproc 0`, a bad `--min-nproc`, a non-finite or negative
/// `--grace` / `--startup-window`, no command, `train --backend mpi` with N > 1, or a program
/// that cannot be executed (ranks already started are killed first).
pub fn run(args: LaunchArgs) -> Result<u8, CliError> {
    if args.nproc == 0 {
        return Err(CliError::Usage("--nproc must be at least 1".into()));
    }
    if args.nproc > crate::preflight::MAX_THREAD_WORLD_SIZE {
        return Err(CliError::Usage(format!(
            "--nproc {} exceeds the limit of {} processes per node (one per device or core); \
             start one launcher per node",
            args.nproc,
            crate::preflight::MAX_THREAD_WORLD_SIZE
        )));
    }
    let grace = seconds("--grace", args.grace)?;
    let window = seconds("--startup-window", args.startup_window)?;
    let min = args.min_nproc.unwrap_or(args.nproc);
    if min == 0 || min > args.nproc {
        return Err(CliError::Usage(format!(
            "--min-nproc {min} must be from 1 to --nproc {}",
            args.nproc
        )));
    }
    if min < args.nproc && args.max_restarts == 0 {
        return Err(CliError::Usage(format!(
            "--min-nproc {min} restarts the job with fewer ranks, but --max-restarts is 0 (no \
             restart): add --max-restarts N"
        )));
    }
    if args.program.is_none() && args.command.is_empty() {
        return Err(CliError::Usage(
            "no command for the ranks: give an fsdp subcommand after `--`, e.g. \
             `fsdp launch --nproc 2 -- train --model tiny`"
                .into(),
        ));
    }
    let cmd = RankCommand::read(args.program.is_some(), &args.command);
    if let RankCommand::Train(t) = &cmd {
        if t.backend == super::args::BackendArg::Mpi && args.nproc > 1 {
            let n = args.nproc;
            return Err(CliError::Usage(format!(
                "--backend mpi ranks are started by mpirun (or srun), not by fsdp launch: \
                 these {n} processes would each be a separate one-rank MPI job. Run \
                 `mpirun -n {n} fsdp train --backend mpi ...`, or restart it on failures with \
                 `fsdp launch --nproc 1 --max-restarts R --program mpirun -- -n {n} fsdp train \
                 --backend mpi ... --ckpt-dir DIR --resume`"
            )));
        }
        if t.ckpt_dir.is_none() && args.max_restarts > 0 {
            say(&format!(
                "warning: --max-restarts {} with a train command without --ckpt-dir: nothing \
                 is saved, so a restart trains again from step 0 (add --ckpt-dir DIR to \
                 resume where it stopped)",
                args.max_restarts
            ));
        }
    }
    let program = match &args.program {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(|e| {
            CliError::Usage(format!(
                "cannot find this executable to start the ranks: {e}"
            ))
        })?,
    };
    let ckpt_root = match &cmd {
        RankCommand::Train(t) => t.ckpt_dir.clone(),
        _ => None,
    };
    // Whether the job saved a checkpoint since the launch: the `latest` pointer changed.
    let mark = ckpt_root.as_deref().map(LatestMark::read);
    let saved = || match (&ckpt_root, &mark) {
        (Some(root), Some(m)) => LatestMark::read(root) != *m,
        _ => false,
    };
    ranks::install_signal_handlers();
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    // Healthy device slots, in the order ranks use them; the world is a prefix of them.
    let mut slots: Vec<usize> = (0..args.nproc).collect();
    let mut world = args.nproc;
    let mut health = SlotHealth::new(window);
    let mut restart: u32 = 0;
    let own_command = own_command_line();
    loop {
        if let Some(sig) = take_signal() {
            say(&format!("received {}; not restarting", signal_name(sig)));
            return Ok((128 + sig).clamp(0, 255) as u8);
        }
        let (argv, _) = command_for(&cmd, &args.command, restart, world, saved());
        let mut env = vec![
            (
                "TORCHELASTIC_RESTART_COUNT".to_string(),
                restart.to_string(),
            ),
            (
                "TORCHELASTIC_MAX_RESTARTS".to_string(),
                args.max_restarts.to_string(),
            ),
            (
                super::stop::LAUNCH_COMMAND_ENV.to_string(),
                own_command.clone(),
            ),
        ];
        if slots[..world] != (0..world).collect::<Vec<_>>()[..] {
            env.push((
                "CUDA_VISIBLE_DEVICES".to_string(),
                visible_devices(visible.as_deref(), &slots[..world]),
            ));
        }
        let attempt = Attempt {
            program: &program,
            args: &argv,
            world,
            master_addr: &args.master_addr,
            master_port: args.master_port,
            env,
            grace,
        };
        let failure = match run_attempt(&attempt).map_err(|e| CliError::Usage(e.0))? {
            AttemptEnd::Success => return Ok(0),
            AttemptEnd::Signalled(sig) => return Ok((128 + sig).clamp(0, 255) as u8),
            AttemptEnd::Failed(f) => f,
        };
        let code = failure.cause.code().clamp(0, 255) as u8;
        let what = failure.cause.describe(failure.rank);
        if args.max_restarts == 0 {
            return Ok(code);
        }
        if cmd.exit_2_is_bad_input() && failure.cause == Cause::Exited(2) {
            say(&format!(
                "{what} (bad input): not restarting, the same command would be refused again"
            ));
            return Ok(code);
        }
        if restart >= args.max_restarts {
            say(&format!(
                "{what}; no restart left (--max-restarts {}): exiting with code {code}",
                args.max_restarts
            ));
            return Ok(code);
        }
        let mut elastic = String::new();
        if min < args.nproc {
            if let Some(slot) = health.record(&failure, slots[failure.rank]) {
                slots.retain(|&s| s != slot);
                let why = match failure.cause {
                    Cause::NotStarted(_) => "its process could not be started".to_string(),
                    _ => format!(
                        "its rank failed first within {:.0} s of the start in {LOST_AFTER} \
                         consecutive attempts",
                        window.as_secs_f64()
                    ),
                };
                match elastic_world(&cmd, slots.len(), min) {
                    Ok(w) => {
                        world = w;
                        elastic = format!(
                            "; device slot {slot} is lost ({why}): continuing at world size \
                             {w} on slots {:?}",
                            &slots[..w]
                        );
                    }
                    Err(e) => {
                        say(&format!(
                            "{what}; device slot {slot} is lost ({why}), and {e}: exiting \
                             with code 1"
                        ));
                        return Ok(1);
                    }
                }
            }
        }
        restart += 1;
        let (_, resume) = command_for(&cmd, &args.command, restart, world, saved());
        say(&format!(
            "restart {restart}/{}: {what}{elastic}; {}",
            args.max_restarts,
            resume.describe()
        ));
    }
}

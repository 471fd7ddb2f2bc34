//! Stopping `fsdp train` on SIGTERM or SIGINT without losing the work done.
//!
//! Schedulers (Slurm, cloud preemption, `fsdp launch`, `mpirun`) send SIGTERM some seconds
//! before they kill a job, and Ctrl-C sends SIGINT. `fsdp train` installs a handler for both
//! ([`install`]) that records the first signal in an atomic and says at once, on standard
//! error and in the `--log-file`, that the run will stop after the current step (one
//! `write(2)`: async-signal-safe; a step can take minutes, and silence would read as a
//! hang). At every
//! step boundary all ranks agree on one flag ([`crate::train::TrainHooks::stop_requested`],
//! all-gathered over the world by the training loop), so a signal to any one rank — a thread
//! of this process, or one process of an MPI or NCCL job — stops every rank after the same
//! step. That step is then saved as a checkpoint when `--ckpt-dir` is set (whether or not it
//! was due), rank 0 prints where it went and the command that resumes it, and every rank
//! exits with the shell's code for the signal, [`exit_code`]: 130 after SIGINT, 143 after
//! SIGTERM, also after a successful save, so a scheduler sees that the job did not finish.
//! A signal during the last step lets the run finish as usual (exit 0).
//!
//! A second signal exits at once with the same code (`_exit` from the handler): a checkpoint
//! being written at that moment is left as the atomic save protocol leaves a killed save
//! (not published; the newest complete checkpoint and `latest` unchanged). Signals within
//! [`REPEAT_WINDOW`] of the first count as the first: a scheduler that signals every process
//! of a job (Slurm) while `fsdp launch` or `mpirun` forwards its own copy delivers two within
//! milliseconds, and that must not cost the final checkpoint.

use crate::model::decoder::Decoder;
use crate::runtime::RankEngine;
use crate::train::TrainHooks;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

/// The first SIGINT or SIGTERM received (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);
/// When the first one arrived: `CLOCK_MONOTONIC` nanoseconds (0: not yet recorded).
static FIRST_AT_NS: AtomicU64 = AtomicU64::new(0);

/// How long after the first stop signal another one is the same request (a copy forwarded
/// by a launcher) rather than a second one that exits at once.
pub const REPEAT_WINDOW: std::time::Duration = std::time::Duration::from_secs(1);

/// The exit code of a run stopped by signal `sig`: 128 + `sig`, the shell's convention (130
/// for SIGINT, 143 for SIGTERM).
pub fn exit_code(sig: i32) -> u8 {
    (128 + sig).clamp(0, 255) as u8
}

/// The name of a stop signal (`SIGINT`, `SIGTERM`; another number as `signal N`).
pub fn signal_name(sig: i32) -> String {
    match sig {
        2 => "SIGINT".into(),
        15 => "SIGTERM".into(),
        n => format!("signal {n}"),
    }
}

/// The first stop signal this process received, if any.
pub fn received() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds (async-signal-safe: `clock_gettime`).
#[cfg(target_env = "gnu")]
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec; clock_gettime is async-signal-safe.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1_000_000_000) + ts.tv_nsec as u64
}

#[cfg(target_env = "gnu")]
extern "C" fn on_stop_signal(sig: libc::c_int) {
    let now = monotonic_ns().max(1);
    if RECEIVED
        .compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst)
        .is_ok()
    {
        FIRST_AT_NS.store(now, Ordering::SeqCst);
        const INT: &[u8] = b"fsdp train: SIGINT received: stopping every rank after the current \
            step (saved when --ckpt-dir is set); signal again to exit at once\n";
        const TERM: &[u8] = b"fsdp train: SIGTERM received: stopping every rank after the current \
            step (saved when --ckpt-dir is set); signal again to exit at once\n";
        let msg = if sig == libc::SIGINT { INT } else { TERM };
        // SAFETY: write(2) is async-signal-safe; the buffers are static.
        unsafe {
            libc::write(2, msg.as_ptr().cast(), msg.len());
            let fd = crate::output::log_fd();
            if fd >= 0 {
                libc::write(fd, msg.as_ptr().cast(), msg.len());
            }
        }
        return;
    }
    // A copy of the first (its time not even stored yet, or within the window).
    let first = FIRST_AT_NS.load(Ordering::SeqCst);
    if first == 0 || now.saturating_sub(first) < REPEAT_WINDOW.as_nanos() as u64 {
        return;
    }
    const MSG: &[u8] = b"fsdp train: second signal: exiting now without a final checkpoint \
        (the newest complete checkpoint is unchanged)\n";
    // SAFETY: write(2) and _exit(2) are async-signal-safe; the buffers are static.
    unsafe {
        libc::write(2, MSG.as_ptr().cast(), MSG.len());
        let fd = crate::output::log_fd();
        if fd >= 0 {
            libc::write(fd, MSG.as_ptr().cast(), MSG.len());
        }
        libc::_exit(128 + sig);
    }
}

/// Installs the SIGINT and SIGTERM handlers of `fsdp train` (see the module docs), with
/// `SA_RESTART` so that no read or write of the run fails with EINTR. With `ignore_hangup`
/// also ignores SIGHUP, so that the run outlives its terminal (as under `nohup`; `fsdp train
/// --log-file` keeps its lines). On targets without glibc the default dispositions stay.
///
/// Errors: the operating system's reason when `sigaction` fails.
pub fn install(ignore_hangup: bool) -> Result<(), String> {
    #[cfg(target_env = "gnu")]
    // SAFETY: `sa` is fully initialised (zeroed, then the handler, flags and an empty mask);
    // the handler only touches atomics and async-signal-safe calls.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_stop_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        sa.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        for sig in [libc::SIGINT, libc::SIGTERM] {
            if libc::sigaction(sig, &sa, std::ptr::null_mut()) != 0 {
                return Err(format!(
                    "cannot install the {} handler: {}",
                    signal_name(sig),
                    std::io::Error::last_os_error()
                ));
            }
        }
        if ignore_hangup {
            libc::signal(libc::SIGHUP, libc::SIG_IGN);
        }
    }
    #[cfg(not(target_env = "gnu"))]
    let _ = ignore_hangup;
    Ok(())
}

/// The hooks of a run that stops on a signal: `inner`'s resume and saves, and a stop
/// request once [`received`] holds a signal.
pub struct StopOnSignal<'a> {
    /// The hooks that resume and save (the checkpoint hooks).
    pub inner: &'a dyn TrainHooks,
}

impl TrainHooks for StopOnSignal<'_> {
    fn resume(
        &self,
        rank: usize,
        engine: &mut crate::runtime::RankEngine<'_, crate::model::decoder::Decoder>,
    ) -> crate::error::Result<Option<u64>> {
        self.inner.resume(rank, engine)
    }

    fn stream_origin(&self) -> crate::data::StreamOrigin {
        self.inner.stream_origin()
    }

    fn after_step(
        &self,
        rank: usize,
        step: u64,
        engine: &mut RankEngine<'_, Decoder>,
        stop: bool,
    ) -> crate::error::Result<()> {
        self.inner.after_step(rank, step, engine, stop)
    }

    fn stop_requested(&self) -> u32 {
        received().map_or(0, |s| s as u32)
    }
}

/// The variable `fsdp launch` sets in every rank's environment to its own command line
/// (shell-quoted, POSIX `sh`): a stopped `fsdp train` rank prints that command with
/// `--resume` ([`resume_command_of`]), which restarts the job under the launcher, rather than
/// its own command line, which would run one rank without it.
pub const LAUNCH_COMMAND_ENV: &str = "FSDP_LAUNCH_COMMAND";

/// The command line that resumes this run: this process's own arguments with `--resume`
/// ([`resume_command_of`]).
pub fn resume_command() -> String {
    resume_command_of(std::env::args_os().map(|a| a.to_string_lossy().into_owned()))
}

/// The command line `args` (program first) with `--resume-from VALUE` (which would resume the
/// same older step again) replaced by `--resume`, or `--resume` added when absent,
/// shell-quoted (POSIX `sh`) so that it can be pasted.
pub fn resume_command_of(args: impl IntoIterator<Item = String>) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut args = args.into_iter();
    while let Some(a) = args.next() {
        if a == "--resume-from" {
            args.next();
        } else if !a.starts_with("--resume-from=") && a != "--resume" {
            out.push(a);
        }
    }
    out.push("--resume".into());
    shlex::try_join(out.iter().map(String::as_str)).unwrap_or_else(|_| out.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn resume_command_resumes_the_newest_checkpoint_once() {
        assert_eq!(
            resume_command_of(v(&[
                "fsdp",
                "train",
                "--ckpt-dir",
                "my ckpts",
                "--steps",
                "9"
            ])),
            "fsdp train --ckpt-dir 'my ckpts' --steps 9 --resume"
        );
        // A resume from a given step would go back to it: the newest checkpoint is the stop's.
        assert_eq!(
            resume_command_of(v(&[
                "fsdp",
                "train",
                "--resume-from",
                "5",
                "--ckpt-dir",
                "d"
            ])),
            "fsdp train --ckpt-dir d --resume"
        );
        assert_eq!(
            resume_command_of(v(&[
                "fsdp",
                "train",
                "--resume-from=latest-valid",
                "--json"
            ])),
            "fsdp train --json --resume"
        );
        assert_eq!(
            resume_command_of(v(&["fsdp", "train", "--resume", "--json"])),
            "fsdp train --json --resume"
        );
        assert_eq!(exit_code(2), 130);
        assert_eq!(exit_code(15), 143);
    }
}

//! `fsdp launch`: start one process per rank on this node, torchrun-style.
//!
//! `fsdp launch --nproc N [--master-addr A] [--master-port P] [--program PATH] -- ARGS...`
//! starts N copies of the current `fsdp` executable (or `--program`) with `ARGS`, each with
//! torchrun's environment — `RANK = LOCAL_RANK = r`, `WORLD_SIZE = LOCAL_WORLD_SIZE = N`,
//! `MASTER_ADDR`, `MASTER_PORT` — which [`fsdp_comm::rendezvous::LaunchEnv`] reads (LOCAL_RANK
//! selects the CUDA device, rank 0 serves the rendezvous on the master port).
//!
//! Every line a rank writes to stdout or stderr is copied to the launcher's stdout or stderr
//! with the prefix `[rank r] ` (a final line without a newline gets one). When a rank exits with
//! a non-zero code (or is killed by a signal, code 128 + signal), the launcher stops the other
//! ranks at once (SIGKILL to each rank's process group) and exits with that rank's code, after
//! a line on stderr naming the rank, its code and the ranks it stopped. Ctrl-C (SIGINT) or
//! SIGTERM to the launcher is forwarded to every rank's process group; ranks still running
//! after `--grace` (30 s, torchrun's) are killed; the launcher then exits with 130 (SIGINT)
//! or 143 (SIGTERM). A rank that exits with 130 or 143 itself (`fsdp train` stopped by a
//! signal, after all ranks agreed on the step and saved it) is not a failure of the others:
//! they get `--grace` to finish the same stop before they are killed. Each
//! rank runs in its own process group (so it and its children can be signalled together) and,
//! on Linux, dies with the launcher (`PR_SET_PDEATHSIG`). All ranks exiting 0 exits 0.
//!
//! Bad input (N = 0, no command after `--` without `--program`, a program that cannot be
//! started) exits 2.

use super::CliError;
use clap::Args;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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
    /// Seconds ranks get to exit after a forwarded Ctrl-C / SIGTERM (or after one rank
    /// stopped on such a signal) before they are killed: enough for `fsdp train` to finish its
    /// step and write its final checkpoint.
    #[arg(long, default_value_t = 30.0)]
    pub grace: f64,
    /// The command line every rank runs (after `--`), e.g. `train --model tiny`: arguments of
    /// this `fsdp` executable, or of `--program` (which may take none).
    #[arg(allow_hyphen_values = true, num_args = 0..)]
    pub command: Vec<String>,
}

/// Signal number received by the launcher (0 = none), set by the handler.
static SIGNAL: AtomicI32 = AtomicI32::new(0);

#[cfg(target_env = "gnu")]
extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, Ordering::SeqCst);
}

/// Installs the SIGINT / SIGTERM handler that records the signal for the monitor loop.
fn install_signal_handlers() {
    #[cfg(target_env = "gnu")]
    // SAFETY: the handler only stores into an atomic (async-signal-safe).
    unsafe {
        let h = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGINT, h);
        libc::signal(libc::SIGTERM, h);
    }
}

/// Sends `sig` to the process group of `child` (each rank leads its own group).
fn signal_group(child: &Child, sig: i32) {
    #[cfg(target_env = "gnu")]
    // SAFETY: plain syscall on a pid we started; errors (already gone) are ignored.
    unsafe {
        libc::kill(-(child.id() as libc::pid_t), sig);
    }
    #[cfg(not(target_env = "gnu"))]
    {
        let _ = (child, sig);
    }
}

fn kill_rank(child: &mut Child) {
    #[cfg(target_env = "gnu")]
    signal_group(child, libc::SIGKILL);
    let _ = child.kill();
}

/// The shell-style exit code of a finished process: its code, or 128 + the signal that
/// killed it.
pub fn exit_code(status: ExitStatus) -> i32 {
    if let Some(c) = status.code() {
        return c;
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(s) = status.signal() {
            return 128 + s;
        }
    }
    1
}

/// Copies `from` line by line to the launcher's stdout (`to_stderr` false) or stderr, each line
/// prefixed with `prefix`; a last line without a newline gets one.
fn pump(from: impl Read + Send + 'static, prefix: String, to_stderr: bool) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let mut out = Vec::with_capacity(prefix.len() + line.len() + 1);
                    out.extend_from_slice(prefix.as_bytes());
                    out.extend_from_slice(&line);
                    if !line.ends_with(b"\n") {
                        out.push(b'\n');
                    }
                    // One write per line under the stream's lock: lines never interleave.
                    let _ = if to_stderr {
                        std::io::stderr().lock().write_all(&out)
                    } else {
                        std::io::stdout().lock().write_all(&out)
                    };
                }
            }
        }
    })
}

/// Starts the ranks, relays their output, and returns the launcher's exit code: 0 when every
/// rank exited 0, else the first failing rank's code (see the module docs).
///
/// Errors: [`CliError::Usage`] for `--nproc 0`, a non-finite or negative `--grace`, or a
/// program that cannot be started (ranks already started are killed first).
pub fn run(args: LaunchArgs) -> Result<u8, CliError> {
    if args.nproc == 0 {
        return Err(CliError::Usage("--nproc must be at least 1".into()));
    }
    let max = crate::process::MAX_WAIT_SECONDS;
    if !(args.grace.is_finite() && args.grace >= 0.0 && args.grace <= max) {
        return Err(CliError::Usage(format!(
            "--grace must be a non-negative number of seconds up to {max:e}, got {}",
            args.grace
        )));
    }
    if args.program.is_none() && args.command.is_empty() {
        return Err(CliError::Usage(
            "no command for the ranks: give an fsdp subcommand after `--`, e.g. \
             `fsdp launch --nproc 2 -- train --model tiny`"
                .into(),
        ));
    }
    let program = match &args.program {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(|e| {
            CliError::Usage(format!(
                "cannot find this executable to start the ranks: {e}"
            ))
        })?,
    };
    let n = args.nproc;
    install_signal_handlers();
    let mut children: Vec<Option<Child>> = Vec::with_capacity(n);
    let mut pumps = Vec::new();
    for rank in 0..n {
        let mut cmd = Command::new(&program);
        cmd.args(&args.command)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", args.master_port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        #[cfg(unix)]
        {
            use std::os::unix::process::CommandExt;
            cmd.process_group(0);
            #[cfg(all(target_os = "linux", target_env = "gnu"))]
            // SAFETY: prctl is async-signal-safe; runs in the child between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
        }
        match cmd.spawn() {
            Ok(mut c) => {
                let prefix = format!("[rank {rank}] ");
                if let Some(o) = c.stdout.take() {
                    pumps.push(pump(o, prefix.clone(), false));
                }
                if let Some(e) = c.stderr.take() {
                    pumps.push(pump(e, prefix, true));
                }
                children.push(Some(c));
            }
            Err(e) => {
                for c in children.iter_mut().flatten() {
                    kill_rank(c);
                    let _ = c.wait();
                }
                return Err(CliError::Usage(format!(
                    "cannot start rank {rank} ({}): {e}",
                    program.display()
                )));
            }
        }
    }
    let code = monitor(&mut children, Duration::from_secs_f64(args.grace));
    // Ranks are gone; their output pipes close unless a grandchild still holds them: wait a
    // moment for the last lines, never for a stray grandchild.
    let until = Instant::now() + Duration::from_secs(2);
    for p in pumps {
        while !p.is_finished() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        if p.is_finished() {
            let _ = p.join();
        }
    }
    let _ = std::io::stdout().flush();
    Ok(code.clamp(0, 255) as u8)
}

/// Polls the ranks until all exited 0 (returns 0), one failed (stops the rest, returns its
/// code) or a signal arrived (forwards it, waits up to `grace`, returns 128 + signal).
fn monitor(children: &mut [Option<Child>], grace: Duration) -> i32 {
    loop {
        let sig = SIGNAL.swap(0, Ordering::SeqCst);
        if sig != 0 {
            let running: Vec<usize> = (0..children.len())
                .filter(|&r| children[r].is_some())
                .collect();
            crate::output::errln!(
                "fsdp launch: received signal {sig}; forwarding it to ranks {running:?} \
                 ({:.0} s to exit)",
                grace.as_secs_f64()
            );
            for c in children.iter().flatten() {
                signal_group(c, sig);
            }
            let deadline = Instant::now() + grace;
            while children.iter().any(Option::is_some) && Instant::now() < deadline {
                reap(children);
                std::thread::sleep(Duration::from_millis(10));
            }
            for c in children.iter_mut().flatten() {
                kill_rank(c);
                let _ = c.wait();
            }
            return 128 + sig;
        }
        if let Some((rank, failed)) = reap(children) {
            // 130 / 143: the rank stopped on SIGINT / SIGTERM after its checkpoint; the
            // others agreed on the same step and are finishing (saving, printing).
            let stop = failed == 128 + 2 || failed == 128 + 15;
            if stop {
                let deadline = Instant::now() + grace;
                while children.iter().any(Option::is_some) && Instant::now() < deadline {
                    reap(children);
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            let others: Vec<usize> = (0..children.len())
                .filter(|&r| children[r].is_some())
                .collect();
            for c in children.iter_mut().flatten() {
                kill_rank(c);
            }
            for c in children.iter_mut().flatten() {
                let _ = c.wait();
            }
            if stop && others.is_empty() {
                crate::output::errln!(
                    "fsdp launch: rank {rank} stopped on signal {} (exit {failed}); every rank \
                     has exited",
                    failed - 128
                );
            } else {
                crate::output::errln!(
                    "fsdp launch: rank {rank} exited with code {failed}; stopped ranks {others:?}"
                );
            }
            return failed;
        }
        if children.iter().all(Option::is_none) {
            return 0;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Collects finished ranks; returns the first one that failed (rank, code), if any.
fn reap(children: &mut [Option<Child>]) -> Option<(usize, i32)> {
    for (rank, slot) in children.iter_mut().enumerate() {
        if let Some(c) = slot {
            match c.try_wait() {
                Ok(Some(status)) => {
                    *slot = None;
                    let code = exit_code(status);
                    if code != 0 {
                        return Some((rank, code));
                    }
                }
                Ok(None) => {}
                Err(_) => {
                    *slot = None;
                    return Some((rank, 1));
                }
            }
        }
    }
    None
}

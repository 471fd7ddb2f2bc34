//! One attempt of a launched job: start one process per rank, relay their output, watch them
//! until all exit 0, one fails, or the launcher is signalled; then stop the rest.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Signal number received by the launcher (0 = none), set by the handler.
static SIGNAL: AtomicI32 = AtomicI32::new(0);

#[cfg(target_env = "gnu")]
extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, Ordering::SeqCst);
}

/// Installs the SIGINT / SIGTERM handler that records the signal for the monitor loop, and
/// ignores SIGPIPE, so that a closed stdout or stderr is a write error the launcher ignores,
/// never its death (ranks are started with the default SIGPIPE action).
pub fn install_signal_handlers() {
    #[cfg(target_env = "gnu")]
    // SAFETY: the handler only stores into an atomic (async-signal-safe); SIG_IGN is a valid
    // disposition.
    unsafe {
        let h = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGINT, h);
        libc::signal(libc::SIGTERM, h);
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
}

/// The signal the launcher received since the last call (taken), if any.
pub fn take_signal() -> Option<i32> {
    match SIGNAL.swap(0, Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// Writes `fsdp launch: {msg}` and a newline to stderr; a closed or failing stderr is ignored
/// (the launcher goes on supervising its ranks).
pub fn say(msg: &str) {
    let line = format!("fsdp launch: {msg}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// The conventional name of signal `sig` (`SIGKILL`), or `signal N` for one without a name
/// here.
pub fn signal_name(sig: i32) -> String {
    #[cfg(target_env = "gnu")]
    {
        let name = match sig {
            libc::SIGHUP => "SIGHUP",
            libc::SIGINT => "SIGINT",
            libc::SIGQUIT => "SIGQUIT",
            libc::SIGILL => "SIGILL",
            libc::SIGTRAP => "SIGTRAP",
            libc::SIGABRT => "SIGABRT",
            libc::SIGBUS => "SIGBUS",
            libc::SIGFPE => "SIGFPE",
            libc::SIGKILL => "SIGKILL",
            libc::SIGUSR1 => "SIGUSR1",
            libc::SIGSEGV => "SIGSEGV",
            libc::SIGUSR2 => "SIGUSR2",
            libc::SIGPIPE => "SIGPIPE",
            libc::SIGALRM => "SIGALRM",
            libc::SIGTERM => "SIGTERM",
            libc::SIGXCPU => "SIGXCPU",
            libc::SIGXFSZ => "SIGXFSZ",
            _ => "",
        };
        if !name.is_empty() {
            return name.to_string();
        }
    }
    format!("signal {sig}")
}

/// How a rank ended an attempt badly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cause {
    /// It exited with this non-zero code (other than a stop by SIGINT or SIGTERM).
    Exited(i32),
    /// It exited by itself with code 128 + this signal (SIGINT or SIGTERM): it was signalled
    /// and stopped, after writing its final checkpoint when it could.
    Stopped(i32),
    /// A signal (this number) killed it.
    Killed(i32),
    /// Its process could not be started (the system's error).
    NotStarted(String),
}

impl Cause {
    /// The cause of a finished process's non-zero `status`; `None` for success.
    pub fn of(status: ExitStatus) -> Option<Cause> {
        if let Some(c) = status.code() {
            return match c {
                0 => None,
                #[cfg(target_env = "gnu")]
                c if c == 128 + libc::SIGINT || c == 128 + libc::SIGTERM => {
                    Some(Cause::Stopped(c - 128))
                }
                c => Some(Cause::Exited(c)),
            };
        }
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            if let Some(s) = status.signal() {
                return Some(Cause::Killed(s));
            }
        }
        Some(Cause::Exited(1))
    }

    /// The shell-style exit code: the code, or 128 + the signal; 1 for a rank never started.
    pub fn code(&self) -> i32 {
        match self {
            Cause::Exited(c) => *c,
            Cause::Stopped(s) | Cause::Killed(s) => 128 + s,
            Cause::NotStarted(_) => 1,
        }
    }

    /// `rank {rank} <what happened>`, e.g. `rank 1 killed by SIGKILL`.
    pub fn describe(&self, rank: usize) -> String {
        match self {
            Cause::Exited(c) => format!("rank {rank} exited with code {c}"),
            Cause::Stopped(s) => format!(
                "rank {rank} stopped by {} (exit {})",
                signal_name(*s),
                128 + s
            ),
            Cause::Killed(s) => format!("rank {rank} killed by {}", signal_name(*s)),
            Cause::NotStarted(e) => format!("rank {rank} could not be started: {e}"),
        }
    }
}

/// The first rank that failed in an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Its rank in the attempt (0-based).
    pub rank: usize,
    /// How it ended.
    pub cause: Cause,
    /// Time from the start of the attempt's processes to the failure being seen.
    pub after: Duration,
}

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptEnd {
    /// Every rank exited 0.
    Success,
    /// A rank failed; the others were stopped.
    Failed(Failure),
    /// The launcher received this signal (SIGINT or SIGTERM), forwarded it and stopped the
    /// ranks: a user stop.
    Signalled(i32),
}

/// What one attempt runs: `world` processes of `program args`.
#[derive(Debug)]
pub struct Attempt<'a> {
    /// Program every rank runs.
    pub program: &'a Path,
    /// Its arguments.
    pub args: &'a [String],
    /// Number of ranks.
    pub world: usize,
    /// `MASTER_ADDR`.
    pub master_addr: &'a str,
    /// `MASTER_PORT`.
    pub master_port: u16,
    /// Extra variables of every rank's environment (restart count, device list).
    pub env: Vec<(String, String)>,
    /// How long ranks get to exit after a forwarded signal, or to finish after a peer stopped
    /// by a signal, before they are killed.
    pub grace: Duration,
}

/// A started rank: its process until it is reaped.
struct Rank {
    child: Option<Child>,
}

/// Errors of [`run_attempt`] that are bad input: the program cannot be executed.
#[derive(Debug)]
pub struct CannotExecute(pub String);

/// Runs one attempt to its end (see [`AttemptEnd`]). Output lines of rank r are copied to the
/// launcher's stdout / stderr prefixed `[rank r] `; a closed launcher output is ignored and
/// the ranks' pipes are still drained.
///
/// Errors: [`CannotExecute`] when the program does not exist or may not be executed (ranks
/// already started are killed first). A rank that cannot be started for another reason
/// (process limits, memory) is a [`Cause::NotStarted`] failure.
pub fn run_attempt(a: &Attempt<'_>) -> Result<AttemptEnd, CannotExecute> {
    let t0 = Instant::now();
    let mut ranks: Vec<Rank> = Vec::with_capacity(a.world);
    let mut pumps = Vec::new();
    let mut not_started = None;
    for rank in 0..a.world {
        let mut cmd = Command::new(a.program);
        cmd.args(a.args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", a.world.to_string())
            .env("LOCAL_WORLD_SIZE", a.world.to_string())
            .env("MASTER_ADDR", a.master_addr)
            .env("MASTER_PORT", a.master_port.to_string())
            .envs(a.env.iter().map(|(k, v)| (k, v)))
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
                ranks.push(Rank { child: Some(c) });
            }
            Err(e) => {
                use std::io::ErrorKind;
                if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::PermissionDenied) {
                    stop_all(&mut ranks);
                    return Err(CannotExecute(format!(
                        "cannot start rank {rank} ({}): {e}",
                        a.program.display()
                    )));
                }
                not_started = Some(Failure {
                    rank,
                    cause: Cause::NotStarted(e.to_string()),
                    after: t0.elapsed(),
                });
                break;
            }
        }
    }
    let end = match not_started {
        Some(f) => {
            let others = running(&ranks);
            stop_all(&mut ranks);
            say(&format!(
                "{}; stopped ranks {others:?}",
                f.cause.describe(f.rank)
            ));
            AttemptEnd::Failed(f)
        }
        None => monitor(&mut ranks, a.grace, t0),
    };
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
    Ok(end)
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

/// Ranks still running.
fn running(ranks: &[Rank]) -> Vec<usize> {
    (0..ranks.len())
        .filter(|&r| ranks[r].child.is_some())
        .collect()
}

/// Kills every running rank (its whole process group) and waits for it.
fn stop_all(ranks: &mut [Rank]) {
    for c in ranks.iter_mut().filter_map(|r| r.child.as_mut()) {
        kill_rank(c);
    }
    for r in ranks.iter_mut() {
        if let Some(mut c) = r.child.take() {
            let _ = c.wait();
        }
    }
}

/// Waits until every rank exited or `deadline`, reaping (and ignoring) their statuses; a
/// signal to the launcher meanwhile ends the wait at once.
fn wait_until(ranks: &mut [Rank], deadline: Instant) -> Option<i32> {
    while !running(ranks).is_empty() && Instant::now() < deadline {
        if let Some(s) = take_signal() {
            return Some(s);
        }
        let _ = reap(ranks);
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// Polls the ranks until all exited 0, one failed (stops the rest) or a signal arrived
/// (forwards it, waits up to `grace`, kills the rest).
fn monitor(ranks: &mut [Rank], grace: Duration, t0: Instant) -> AttemptEnd {
    loop {
        if let Some(sig) = take_signal() {
            let running = running(ranks);
            say(&format!(
                "received {}; forwarding it to ranks {running:?} ({:.0} s to exit; a second \
                 signal stops them at once)",
                signal_name(sig),
                grace.as_secs_f64()
            ));
            for c in ranks.iter().filter_map(|r| r.child.as_ref()) {
                signal_group(c, sig);
            }
            if let Some(again) = wait_until(ranks, Instant::now() + grace) {
                say(&format!(
                    "received {} again; stopping ranks {:?} now",
                    signal_name(again),
                    self::running(ranks)
                ));
            }
            stop_all(ranks);
            return AttemptEnd::Signalled(sig);
        }
        if let Some((rank, cause)) = reap(ranks) {
            let after = t0.elapsed();
            let mut waited = Vec::new();
            if matches!(cause, Cause::Stopped(_)) {
                // A rank stopped by a signal saves a final checkpoint with its peers first:
                // let them finish it.
                waited = running(ranks);
                if let Some(sig) = wait_until(ranks, Instant::now() + grace) {
                    // A user stop while waiting: the ranks get it too.
                    for c in ranks.iter().filter_map(|r| r.child.as_ref()) {
                        signal_group(c, sig);
                    }
                    let _ = wait_until(ranks, Instant::now() + grace);
                    stop_all(ranks);
                    return AttemptEnd::Signalled(sig);
                }
            }
            let others = running(ranks);
            stop_all(ranks);
            let what = cause.describe(rank);
            if waited.is_empty() {
                say(&format!("{what}; stopped ranks {others:?}"));
            } else {
                say(&format!(
                    "{what}; waited up to {:.0} s for ranks {waited:?} to finish; stopped \
                     ranks {others:?}",
                    grace.as_secs_f64()
                ));
            }
            return AttemptEnd::Failed(Failure { rank, cause, after });
        }
        if running(ranks).is_empty() {
            return AttemptEnd::Success;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Collects finished ranks; returns the first one that failed (rank, cause), if any.
fn reap(ranks: &mut [Rank]) -> Option<(usize, Cause)> {
    for (rank, slot) in ranks.iter_mut().enumerate() {
        if let Some(c) = &mut slot.child {
            match c.try_wait() {
                Ok(Some(status)) => {
                    slot.child = None;
                    if let Some(cause) = Cause::of(status) {
                        return Some((rank, cause));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    slot.child = None;
                    return Some((rank, Cause::NotStarted(format!("cannot watch it: {e}"))));
                }
            }
        }
    }
    None
}

/// Copies `from` line by line to the launcher's stdout (`to_stderr` false) or stderr, each line
/// prefixed with `prefix`; a last line without a newline gets one. A closed or failing
/// launcher output is ignored: the rank's pipe is still read to its end, so the rank never
/// blocks on a full pipe.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    fn status(raw: i32) -> ExitStatus {
        use std::os::unix::process::ExitStatusExt;
        ExitStatus::from_raw(raw)
    }

    #[cfg(all(unix, target_env = "gnu"))]
    #[test]
    fn causes_tell_a_signalled_stop_from_a_kill() {
        // wait(2) encoding: exit code in bits 8..16, a killing signal in bits 0..7.
        assert_eq!(Cause::of(status(0)), None);
        assert_eq!(Cause::of(status(3 << 8)), Some(Cause::Exited(3)));
        assert_eq!(Cause::of(status(143 << 8)), Some(Cause::Stopped(15)));
        assert_eq!(Cause::of(status(130 << 8)), Some(Cause::Stopped(2)));
        assert_eq!(Cause::of(status(137 << 8)), Some(Cause::Exited(137)));
        assert_eq!(Cause::of(status(9)), Some(Cause::Killed(9)));
        assert_eq!(Cause::of(status(15)), Some(Cause::Killed(15)));
        assert_eq!(Cause::Killed(9).code(), 137);
        assert_eq!(Cause::Stopped(15).code(), 143);
        assert_eq!(Cause::Killed(9).describe(1), "rank 1 killed by SIGKILL");
        assert_eq!(
            Cause::Stopped(15).describe(0),
            "rank 0 stopped by SIGTERM (exit 143)"
        );
        assert_eq!(Cause::Exited(3).describe(2), "rank 2 exited with code 3");
        assert_eq!(signal_name(64), "signal 64");
    }
}

//! Every line the `fsdp` binary prints: standard output, standard error and the `--log-file`
//! of `fsdp train`, through writes that never panic and never end the process.
//!
//! When a stream fails — its reader went away (`fsdp train | head -1`: EPIPE; Rust ignores
//! SIGPIPE, so a closed pipe is an error here, never a signal), the terminal closed (EIO), the
//! file it is redirected to filled its disk — that stream is given up for the rest of the
//! process and the work goes on: training keeps training and saving, `plan`, `ckpt` and `data`
//! finish and exit 0 when their work succeeded and the reader went away (EPIPE), or exit 1
//! when their output could not be written otherwise (a full disk: [`stdout_failure`]). `println!` would panic instead (exit 101), so
//! the binary's code prints only through `outln!` / `errln!` and the functions here.
//!
//! With a log file open ([`open_log`]) every line printed on either stream is also appended
//! to it, one `write` per line on a file opened with `O_APPEND`, so each line is in the file
//! when the call returns, whether or not the terminal is still there. A failed write to the
//! log file (a full disk) is said once on stderr and ends the log, not the run.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Mutex;

/// Standard output failed once: nothing more is written to it.
static STDOUT_GONE: AtomicBool = AtomicBool::new(false);
/// Standard error failed once: nothing more is written to it.
static STDERR_GONE: AtomicBool = AtomicBool::new(false);
/// Why standard output failed, when it failed with another error than a closed reader
/// (EPIPE): a full disk (ENOSPC), an I/O error. Commands whose output is their work exit 1
/// with it ([`stdout_failure`]).
static STDOUT_ERROR: Mutex<Option<String>> = Mutex::new(None);
/// The log file, when one is open.
static LOG: Mutex<Option<LogFile>> = Mutex::new(None);
/// The log file's descriptor (-1: none), for the signal handler's last words ([`log_fd`]).
static LOG_FD: AtomicI32 = AtomicI32::new(-1);

struct LogFile {
    file: std::fs::File,
    path: PathBuf,
}

/// `println!` that never panics: formats one line, prints it on standard output (unless that
/// stream is gone) and appends it to the log file, if any ([`print_out`]).
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::output::print_out(&format!("{}\n", format_args!($($arg)*)))
    };
}
pub(crate) use outln;

/// `eprintln!` that never panics: formats one line, prints it on standard error (unless that
/// stream is gone) and appends it to the log file, if any ([`print_err`]).
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::output::print_err(&format!("{}\n", format_args!($($arg)*)))
    };
}
pub(crate) use errln;

/// Writes `text` (whole lines, each ending in `\n`) on standard output and appends it to the
/// log file, if one is open. A failed write to standard output gives that stream up for the
/// rest of the process ([`stdout_gone`]); nothing is returned because nothing can be done.
pub fn print_out(text: &str) {
    write_stream(&STDOUT_GONE, text.as_bytes(), |b| {
        let mut s = std::io::stdout().lock();
        let written = s.write_all(b).and_then(|()| s.flush());
        if let Err(e) = &written {
            if e.kind() != std::io::ErrorKind::BrokenPipe {
                let mut first = STDOUT_ERROR.lock().unwrap_or_else(|p| p.into_inner());
                first.get_or_insert_with(|| e.to_string());
            }
        }
        written
    });
    log_only(text);
}

/// The error that made standard output fail, unless its reader merely went away (EPIPE, as
/// under `| head`): a full disk, an I/O error. `plan`, `ckpt`, `data` and `eval` then exit 1
/// with it, since their output is incomplete; training goes on regardless.
pub fn stdout_failure() -> Option<String> {
    STDOUT_ERROR
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
}

/// As [`print_out`], on standard error.
pub fn print_err(text: &str) {
    write_stream(&STDERR_GONE, text.as_bytes(), |b| {
        let mut s = std::io::stderr().lock();
        s.write_all(b).and_then(|()| s.flush())
    });
    log_only(text);
}

/// Appends `text` (whole lines) to the log file only, if one is open: what the terminal
/// shows in another form (a progress bar) or not at all. A failed write closes the log file
/// and says so once on standard error.
pub fn log_only(text: &str) {
    let mut log = LOG.lock().unwrap_or_else(|p| p.into_inner());
    let Some(l) = log.as_mut() else {
        return;
    };
    if let Err(e) = l.file.write_all(text.as_bytes()) {
        let path = l.path.clone();
        // The descriptor is withdrawn from the signal handler before the file closes.
        LOG_FD.store(-1, Ordering::SeqCst);
        *log = None;
        drop(log);
        let line = format!(
            "warning: --log-file {}: {e}; no more lines are written to it (the run goes on)\n",
            path.display()
        );
        write_stream(&STDERR_GONE, line.as_bytes(), |b| {
            std::io::stderr().lock().write_all(b)
        });
    }
}

fn write_stream(gone: &AtomicBool, bytes: &[u8], write: impl FnOnce(&[u8]) -> std::io::Result<()>) {
    if gone.load(Ordering::Relaxed) {
        return;
    }
    if write(bytes).is_err() {
        gone.store(true, Ordering::Relaxed);
    }
}

/// Whether a write to standard output failed (its reader went away): commands whose output
/// is all their work may stop early.
pub fn stdout_gone() -> bool {
    STDOUT_GONE.load(Ordering::Relaxed)
}

/// Whether a write to standard error failed.
pub fn stderr_gone() -> bool {
    STDERR_GONE.load(Ordering::Relaxed)
}

/// Checks, before any work, that `path` can be a log file: its parent directory exists and it
/// is not a directory itself.
///
/// Errors: a message naming `path` and the fix.
pub fn check_log_path(path: &Path) -> Result<(), String> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        return Err(format!(
            "--log-file {}: the directory {} does not exist; create it first or choose a log \
             file in an existing directory",
            path.display(),
            parent.display()
        ));
    }
    if path.is_dir() {
        return Err(format!(
            "--log-file {}: is a directory; give the path of a file (it is created, or appended \
             to)",
            path.display()
        ));
    }
    Ok(())
}

/// Opens `path` for appending (created if missing, after [`check_log_path`]'s checks) as the
/// log file of every later [`print_out`], [`print_err`] and [`log_only`]; replaces a log file
/// opened before.
///
/// Errors: a message naming `path` and the operating system's reason.
pub fn open_log(path: &Path) -> Result<(), String> {
    check_log_path(path)?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| {
            format!(
                "--log-file {}: cannot open it for appending: {e}",
                path.display()
            )
        })?;
    #[cfg(unix)]
    {
        use std::os::unix::io::AsRawFd;
        LOG_FD.store(file.as_raw_fd(), Ordering::SeqCst);
    }
    *LOG.lock().unwrap_or_else(|p| p.into_inner()) = Some(LogFile {
        file,
        path: path.to_path_buf(),
    });
    Ok(())
}

/// The open log file's raw descriptor, or -1: for a signal handler, which may only call
/// async-signal-safe functions such as `write(2)`.
pub fn log_fd() -> i32 {
    LOG_FD.load(Ordering::SeqCst)
}

/// Whether `a` and `b` name the same file: the same file when both exist (links and `..`
/// resolved), else the same absolute path.
pub fn same_path(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => match (std::path::absolute(a), std::path::absolute(b)) {
            (Ok(x), Ok(y)) => x == y,
            _ => a == b,
        },
    }
}

/// Refuses an output file `out` (given with `flag`) that names one of the command's input
/// files (`inputs`: each flag and its path, `None` when not given; [`same_path`]): writing it
/// would replace the input (the training data, a hardware profile, a model file).
///
/// Errors: the message, naming both flags and the fix.
pub fn check_not_an_input(
    flag: &str,
    out: &Path,
    inputs: &[(&str, Option<&Path>)],
) -> Result<(), String> {
    let given = inputs.iter().filter_map(|(f, p)| p.map(|p| (f, p)));
    match given.into_iter().find(|(_, p)| same_path(out, p)) {
        Some((input, p)) => Err(format!(
            "{flag} {} names the same file as {input} {}: writing it would replace that input; \
             give {flag} another path",
            out.display(),
            p.display()
        )),
        None => Ok(()),
    }
}

/// Refuses an output file `path` (given with `flag`) that cannot be written, before any work:
/// a directory (the message suggests `flag <dir>/<example>`), a parent that is missing (the
/// `mkdir -p` that fixes it) or not a directory, or a parent where this process cannot create
/// a file (a read-only or permission-denied place: probed by creating and removing a hidden
/// file beside `path`).
///
/// Errors: the message, naming `flag`, the path and the fix.
pub fn check_output_path(flag: &str, path: &Path, example: &str) -> Result<(), String> {
    if path.is_dir() {
        return Err(format!(
            "{flag} {}: is a directory; give a file path, e.g. {flag} {}",
            path.display(),
            path.join(example).display()
        ));
    }
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if parent.exists() && !parent.is_dir() {
        return Err(format!(
            "{flag} {}: {} is not a directory; give a path inside a directory",
            path.display(),
            parent.display()
        ));
    }
    if !parent.is_dir() {
        return Err(format!(
            "{flag} {}: the directory {} does not exist; create it first (mkdir -p {})",
            path.display(),
            parent.display(),
            parent.display()
        ));
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    let probe = parent.join(format!(".{name}.probe-{}", std::process::id()));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(format!(
            "{flag} {}: cannot create a file in {}: {e}; give a writable path",
            path.display(),
            parent.display()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::check_output_path;
    use std::path::Path;

    #[test]
    fn an_output_path_that_cannot_be_written_is_refused_with_its_fix() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        let e = check_output_path("-o", dir, "profile.json").unwrap_err();
        assert!(
            e.contains("is a directory") && e.contains("profile.json"),
            "{e}"
        );
        let file = dir.join("f");
        std::fs::write(&file, b"x").unwrap();
        let e = check_output_path("-o", &file.join("x.json"), "profile.json").unwrap_err();
        assert!(
            e.contains("is not a directory") && !e.contains("mkdir"),
            "{e}"
        );
        let e = check_output_path("-o", &dir.join("a/b.json"), "profile.json").unwrap_err();
        assert!(e.contains("mkdir -p"), "{e}");
        // No file can be created in /proc, even by root.
        let e = check_output_path("-o", Path::new("/proc/x.json"), "profile.json").unwrap_err();
        assert!(e.contains("cannot create a file in /proc"), "{e}");
        // A writable place passes and leaves nothing behind.
        check_output_path("-o", &dir.join("ok.json"), "profile.json").unwrap();
        let left: Vec<_> = std::fs::read_dir(dir).unwrap().collect();
        assert_eq!(left.len(), 1, "only the file made above: {left:?}");
    }
}

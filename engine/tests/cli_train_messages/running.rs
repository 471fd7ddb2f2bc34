//! A running `fsdp` process whose standard output is read line by line as it comes, to act
//! (send a signal, close a pipe) at a given point of the run.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// `fsdp` started with piped stdout (read line by line) and stderr (collected).
pub struct Running {
    pub child: Child,
    lines: Receiver<String>,
    stderr: Option<JoinHandle<String>>,
    /// Every stdout line read so far.
    pub seen: Vec<String>,
}

impl Running {
    /// Starts `fsdp args`.
    pub fn start(args: &[String]) -> Running {
        let mut child = Command::new(env!("CARGO_BIN_EXE_fsdp"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start fsdp");
        let out = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut err = child.stderr.take().unwrap();
        let stderr = Some(std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        }));
        Running {
            child,
            lines,
            stderr,
            seen: Vec::new(),
        }
    }

    /// Reads stdout until a JSON line satisfies `pred` and returns it; panics when the output
    /// ends first or after two minutes.
    pub fn until(&mut self, pred: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
        let t0 = Instant::now();
        loop {
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "no such line after 2 min: {:?}",
                self.seen
            );
            match self.lines.recv_timeout(Duration::from_millis(200)) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if let Ok(v) = serde_json::from_str::<serde_json::Value>(&l) {
                        if pred(&v) {
                            return v;
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("the output ended first: {:?}", self.seen)
                }
            }
        }
    }

    /// Sends signal `sig` to the process.
    pub fn signal(&self, sig: i32) {
        // SAFETY: a plain syscall on the pid of a child this test started.
        let r = unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
        assert_eq!(r, 0, "kill: {}", std::io::Error::last_os_error());
    }

    /// Waits until no signal is pending for the process any more (delivered to a thread).
    pub fn wait_delivered(&self) {
        let t0 = Instant::now();
        let status = format!("/proc/{}/status", self.child.id());
        loop {
            let Ok(s) = std::fs::read_to_string(&status) else {
                return;
            };
            let pending = s
                .lines()
                .filter(|l| l.starts_with("ShdPnd:") || l.starts_with("SigPnd:"))
                .any(|l| {
                    l.split_whitespace()
                        .nth(1)
                        .is_some_and(|m| !m.trim_start_matches('0').is_empty())
                });
            if !pending || t0.elapsed() > Duration::from_secs(5) {
                return;
            }
            std::thread::yield_now();
        }
    }

    /// Stops reading stdout, as `| head -1` does once it has its line: the reader is closed
    /// at the next line the process writes. Then waits for the exit (at most two minutes):
    /// the exit code (-1 when killed by a signal), stderr.
    pub fn close_stdout_and_wait(mut self) -> (i32, String) {
        drop(self.lines);
        let t0 = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if t0.elapsed() > Duration::from_secs(120) {
                let _ = self.child.kill();
                panic!("still running after 2 min");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let err = self.stderr.take().unwrap().join().unwrap();
        (status.code().unwrap_or(-1), err)
    }

    /// Reads the rest of stdout and waits for the exit (at most two minutes): the exit code
    /// (-1 when killed by a signal rather than exiting), every stdout line, stderr.
    pub fn finish(mut self) -> (i32, Vec<String>, String) {
        let t0 = Instant::now();
        loop {
            match self.lines.recv_timeout(Duration::from_millis(200)) {
                Ok(l) => self.seen.push(l),
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {}
            }
            if t0.elapsed() > Duration::from_secs(120) {
                let _ = self.child.kill();
                panic!("still running after 2 min: {:?}", self.seen);
            }
        }
        let status = self.child.wait().unwrap();
        let err = self.stderr.take().unwrap().join().unwrap();
        (status.code().unwrap_or(-1), self.seen, err)
    }
}

/// The step lines' `(step, loss bits)` of `--json` output lines.
pub fn step_losses(lines: &[String]) -> Vec<(u64, u64)> {
    lines
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("step").is_some() && v.get("event").is_none())
        .map(|v| {
            (
                v["step"].as_u64().unwrap(),
                v["loss"].as_f64().unwrap().to_bits(),
            )
        })
        .collect()
}

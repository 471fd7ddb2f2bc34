//! The parent side of the benches that measure each configuration in a fresh child process
//! (`benches/train.rs`, `benches/overlap.rs`): a fresh process per configuration so one
//! configuration's allocator state and thread pools never leak into the next.

use std::process::Command;

/// Runs this bench executable again with `key=spec` set (the child branch of the bench's
/// `main`) for `ranks` rank threads of `threads` compute threads, sizing candle's pools as
/// `fsdp train` does (`RAYON_NUM_THREADS` = `threads`, `CANDLE_NUM_THREADS` from
/// [`fsdp::preflight::elementwise_threads`]), echoes the child's first JSON line (the line
/// starting with `{` on stdout) and returns it parsed.
///
/// Panics (a bench, not a library) when the child cannot start, prints no JSON line (its
/// stderr is in the message) or prints malformed JSON.
pub fn run(key: &str, spec: &str, ranks: usize, threads: usize) -> serde_json::Value {
    let exe = std::env::current_exe().expect("bench executable");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let elementwise = fsdp::preflight::elementwise_threads(ranks, threads, cores);
    let out = Command::new(&exe)
        .env(key, spec)
        .env("RAYON_NUM_THREADS", threads.to_string())
        .env("CANDLE_NUM_THREADS", elementwise.to_string())
        .output()
        .expect("child bench");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("child failed: {}", String::from_utf8_lossy(&out.stderr)));
    println!("{line}");
    serde_json::from_str(line).expect("child JSON line")
}

//! Long fuzz run of every reader of a file that comes from outside (see `tests/fuzz/mod.rs`).
//!
//! `cargo run --example fuzz_readers -- [--inputs N] [--readers a,b] [--failures DIR]
//! [--report FILE]`: N inputs per reader (default 1,000,000), every reader in its own thread;
//! prints and optionally writes a Markdown table (inputs, values, distinct error kinds, time,
//! slowest input, peak heap growth and its ratio to the input size) and exits 1 if any input
//! failed (the failing inputs are written under `--failures`, default `target/fuzz-failures`).

#[path = "../tests/fuzz/mod.rs"]
mod fuzz;

#[global_allocator]
static ALLOC: fuzz::Counting = fuzz::Counting;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

fn main() {
    let mut inputs = 1_000_000u64;
    let mut readers: Vec<String> = fuzz::READERS.iter().map(|s| s.to_string()).collect();
    let mut failures = fuzz::repo_root().join("target/fuzz-failures");
    let mut report: Option<PathBuf> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--inputs" => inputs = val().replace('_', "").parse().expect("--inputs N"),
            "--readers" => readers = val().split(',').map(str::to_string).collect(),
            "--failures" => failures = PathBuf::from(val()),
            "--report" => report = Some(PathBuf::from(val())),
            other => panic!("unknown argument {other}"),
        }
    }
    fuzz::quiet_panics();
    let dir = tempfile::tempdir().unwrap();
    let seeds = fuzz::make_seeds(&dir.path().join("seeds"));
    let reports: Vec<(String, fuzz::Report)> = std::thread::scope(|s| {
        let handles: Vec<_> = readers
            .iter()
            .map(|name| {
                let (seeds, dir, failures) = (&seeds, dir.path(), &failures);
                s.spawn(move || {
                    let ws = dir.join("ws").join(name);
                    let mut r = fuzz::reader(name, seeds, &ws);
                    let kept = fuzz::kept_inputs(name);
                    let rep = fuzz::run_reader(
                        &mut r,
                        &seeds.by_reader[name.as_str()],
                        &kept,
                        inputs,
                        Duration::from_secs(5),
                        &ws,
                        failures,
                    );
                    eprintln!(
                        "{name}: {} inputs, {} failures, {:.1?}",
                        rep.inputs,
                        rep.failures.len(),
                        rep.time
                    );
                    (name.clone(), rep)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut md = String::new();
    md.push_str(
        "| reader | inputs | values | error kinds | time | slowest input | peak heap growth | peak / input bytes (less the reader's constant) | failures |\n",
    );
    md.push_str("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    let mut failed = 0;
    for (name, r) in &reports {
        failed += r.failures.len();
        let _ = writeln!(
            md,
            "| {name} | {} | {} | {} | {:.1} s | {:.1} ms | {:.2} MiB | {:.1} | {} |",
            r.inputs,
            r.values,
            r.kinds.len(),
            r.time.as_secs_f64(),
            r.max_time.as_secs_f64() * 1e3,
            r.max_peak as f64 / (1 << 20) as f64,
            r.max_ratio,
            r.failures.len()
        );
    }
    md.push_str("\nMost frequent error kinds per reader (paths, names and numbers masked):\n\n");
    for (name, r) in &reports {
        let mut kinds: Vec<_> = r.kinds.iter().collect();
        kinds.sort_by(|a, b| b.1.cmp(a.1));
        let _ = writeln!(md, "- {name}:");
        for (k, n) in kinds.iter().take(8) {
            let _ = writeln!(md, "  - {n} x `{}`", k.replace('`', "'"));
        }
    }
    for (name, r) in &reports {
        for (i, what) in r.failures.iter().take(10) {
            let _ = writeln!(md, "\nFAILED {name} input {i}: {what}");
        }
    }
    println!("{md}");
    if let Some(p) = report {
        std::fs::write(&p, &md).unwrap();
    }
    if failed > 0 {
        std::process::exit(1);
    }
}

//! The threads of a training process: the size the run gave each pool, and the threads the
//! process really holds (counted from Linux's `/proc/self/task`).
//!
//! The pools of a CPU run: each rank's compute pool (`rankR-computeI`, `--threads-per-rank`:
//! the rank's GEMMs, fused ops and optimizer step run in it), the rank threads themselves
//! (`fsdp-rank-R`, blocked in their pool while it computes), one communication progress
//! thread per rank once a collective is started asynchronously (`rankR-comm`), and
//! candle's process-wide element-wise pool (`candle-bp-I`, `CANDLE_NUM_THREADS` - 1 workers
//! plus the calling thread). `fsdp train` sizes candle's pools before any tensor exists
//! (`RAYON_NUM_THREADS`, `CANDLE_NUM_THREADS`) from the capped `--threads-per-rank`, so no
//! pool is sized from a request the run lowered.

use serde::Serialize;
use std::collections::BTreeMap;

/// The thread pools of a training run and the threads its process held.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ThreadReport {
    /// Rank threads in this process (the world size on the thread backend, 1 per process
    /// under a launcher).
    pub ranks: usize,
    /// Threads of each rank's compute pool: its GEMMs, fused ops and optimizer step.
    pub compute_per_rank: usize,
    /// Threads candle's CPU GEMM splits a product over (`RAYON_NUM_THREADS`), inside the
    /// calling rank's pool.
    pub gemm: usize,
    /// Threads of candle's element-wise pool, the calling thread included
    /// (`CANDLE_NUM_THREADS`, else `RAYON_NUM_THREADS`): one pool for the whole process.
    pub elementwise: usize,
    /// The most threads the process held at the end of a step (rank 0 counts them after
    /// each step); `None` where `/proc/self/task` cannot be read.
    pub live_peak: Option<usize>,
    /// The threads at that count by name, each run of digits written `N` (`rankN-computeN`,
    /// `fsdp-rank-N`, `rankN-comm`, `candle-bp-N`, `fsdp` for the main thread; Linux keeps
    /// the first 15 bytes of a name).
    pub live_by_name: BTreeMap<String, usize>,
}

impl ThreadReport {
    /// The configured sizes for `ranks` rank threads of `compute_per_rank` threads each,
    /// with candle's GEMM and element-wise sizes read as candle reads them, and no live
    /// count yet.
    pub fn configured(ranks: usize, compute_per_rank: usize) -> ThreadReport {
        ThreadReport {
            ranks,
            compute_per_rank,
            gemm: candle_core::utils::get_num_threads(),
            elementwise: elementwise_threads(),
            live_peak: None,
            live_by_name: BTreeMap::new(),
        }
    }

    /// Counts the process's threads now and keeps the count if it is the largest so far.
    pub fn sample(&mut self) {
        if let Some(by_name) = live_threads() {
            let n = by_name.values().sum();
            if self.live_peak.is_none_or(|p| n > p) {
                self.live_peak = Some(n);
                self.live_by_name = by_name;
            }
        }
    }

    /// One line for the run summary, e.g. `threads: 2 ranks x 1 compute thread (GEMM 1,
    /// element-wise 1); at most 7 live: fsdp 1, fsdp-rank-N 2, rankN-comm 2, rankN-computeN
    /// 2`.
    pub fn summary_line(&self) -> String {
        let plural =
            |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        let mut s = format!(
            "threads: {} x {} (GEMM {}, element-wise {})",
            plural(self.ranks, "rank", "ranks"),
            plural(self.compute_per_rank, "compute thread", "compute threads"),
            self.gemm,
            self.elementwise
        );
        if let Some(n) = self.live_peak {
            let names: Vec<String> = self
                .live_by_name
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            s.push_str(&format!("; at most {n} live: {}", names.join(", ")));
        }
        s
    }
}

/// The size of candle's element-wise pool as candle computes it: `CANDLE_NUM_THREADS` when
/// set to a positive number, else candle's GEMM threads (`RAYON_NUM_THREADS`).
fn elementwise_threads() -> usize {
    std::env::var("CANDLE_NUM_THREADS")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(candle_core::utils::get_num_threads)
}

/// The threads of this process now, counted by name with each run of ASCII digits written
/// `N` (`/proc/self/task/*/comm`); `None` where that directory cannot be read (not Linux).
pub fn live_threads() -> Option<BTreeMap<String, usize>> {
    let mut by_name = BTreeMap::new();
    for entry in std::fs::read_dir("/proc/self/task").ok()? {
        let Ok(entry) = entry else { continue };
        // A thread that ended between the listing and this read is not counted.
        let Ok(comm) = std::fs::read_to_string(entry.path().join("comm")) else {
            continue;
        };
        *by_name.entry(digits_as_n(comm.trim())).or_insert(0) += 1;
    }
    Some(by_name)
}

/// `name` with each run of ASCII digits replaced by one `N`: `rank12-compute3` ->
/// `rankN-computeN`.
fn digits_as_n(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut in_digits = false;
    for c in name.chars() {
        if c.is_ascii_digit() {
            if !in_digits {
                out.push('N');
            }
            in_digits = true;
        } else {
            out.push(c);
            in_digits = false;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_threads_counts_a_named_thread_while_it_runs() {
        let before = live_threads().expect("Linux /proc");
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
        let h = std::thread::Builder::new()
            .name("probe42-x7".into())
            .spawn(move || {
                // The new thread names itself before running this closure.
                ready_tx.send(()).unwrap();
                rx.recv().ok()
            })
            .unwrap();
        ready_rx.recv().unwrap();
        let during = live_threads().unwrap();
        tx.send(()).unwrap();
        h.join().unwrap();
        // Other tests of this process start and end threads meanwhile: only the probe's own
        // name is counted exactly.
        assert_eq!(before.get("probeN-xN"), None);
        assert_eq!(during.get("probeN-xN"), Some(&1));
    }

    #[test]
    fn sample_keeps_the_largest_count() {
        let mut r = ThreadReport::configured(2, 1);
        r.live_peak = Some(1_000);
        r.sample();
        assert_eq!(r.live_peak, Some(1_000));
        let mut r = ThreadReport::configured(2, 1);
        r.sample();
        let n = r.live_peak.expect("Linux /proc");
        assert!(n >= 1);
        assert_eq!(r.live_by_name.values().sum::<usize>(), n);
    }

    #[test]
    fn summary_line_names_every_pool() {
        let mut r = ThreadReport {
            ranks: 2,
            compute_per_rank: 1,
            gemm: 1,
            elementwise: 1,
            live_peak: Some(5),
            live_by_name: BTreeMap::new(),
        };
        r.live_by_name.insert("fsdp".into(), 1);
        r.live_by_name.insert("rankN-computeN".into(), 2);
        r.live_by_name.insert("fsdp-rank-N".into(), 2);
        assert_eq!(
            r.summary_line(),
            "threads: 2 ranks x 1 compute thread (GEMM 1, element-wise 1); at most 5 live: \
             fsdp 1, fsdp-rank-N 2, rankN-computeN 2"
        );
    }

    #[test]
    fn digit_runs_become_one_n() {
        assert_eq!(digits_as_n("rank12-compute3"), "rankN-computeN");
        assert_eq!(digits_as_n("fsdp"), "fsdp");
        assert_eq!(digits_as_n("candle-bp-0"), "candle-bp-N");
    }
}

//! Memory accounting: an exact ledger of engine-owned bytes per category and phase, and a
//! counting global allocator for the process peak.
//!
//! The ledger follows the contract of `fsdp_planner::memory`: the engine adds bytes when it allocates a buffer the
//! plan names (shards, unsharded slots, flat gradients, reduce-scatter staging) and subtracts
//! them when it frees it; per phase it records the peak total with the categories at that
//! moment (`at_peak`) and the per-category maximum (`max`). Tests compare both with the
//! planner's `MemoryPlan`, the way PyTorch's `test_fully_shard_memory.py` compares measured peaks
//! with formulas over element counts.
//!
//! Activations are not in the ledger: candle allocates them. They are measured through
//! [`CountingAllocator`], which the `fsdp` binary installs as its `#[global_allocator]`.

use serde::Serialize;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

pub use fsdp_planner::{Category, CategoryBytes, Phase};
use fsdp_types::Bytes;

/// The categories the exact ledger tracks: every [`Category`] except `Activations` (candle
/// allocates activations; they are measured by [`CountingAllocator`]).
pub const LEDGER_CATEGORIES: [Category; 7] = [
    Category::ParamShards,
    Category::ParamShardsLowPrecision,
    Category::GradShards,
    Category::OptimizerState,
    Category::UnshardedParams,
    Category::UnshardedGrads,
    Category::Staging,
];

/// The phases of a step, in order.
pub const PHASES: [Phase; 3] = [Phase::Forward, Phase::Backward, Phase::OptimizerStep];

fn slot(b: &mut CategoryBytes, c: Category) -> &mut Bytes {
    match c {
        Category::ParamShards => &mut b.param_shards,
        Category::ParamShardsLowPrecision => &mut b.param_shards_low_precision,
        Category::GradShards => &mut b.grad_shards,
        Category::OptimizerState => &mut b.optimizer_state,
        Category::UnshardedParams => &mut b.unsharded_params,
        Category::UnshardedGrads => &mut b.unsharded_grads,
        Category::Staging => &mut b.staging,
        Category::Activations => &mut b.activations,
    }
}

fn phase_index(p: Phase) -> usize {
    match p {
        Phase::Forward => 0,
        Phase::Backward => 1,
        Phase::OptimizerStep => 2,
        Phase::Save => 3,
    }
}

/// The peak of one phase as measured by the ledger (the same shape as the plan's
/// `PhaseMemory`; `activations` is always 0 here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct PhasePeak {
    /// The largest total of live ledger bytes seen in the phase.
    pub peak_total: Bytes,
    /// Live bytes per category when `peak_total` was first reached.
    pub at_peak: CategoryBytes,
    /// The largest live bytes of each category seen in the phase.
    pub max: CategoryBytes,
}

/// Exact ledger of engine-owned live bytes (the contract of `fsdp_planner::memory`): add on allocate, subtract on
/// free, peaks per phase. One per rank; not shared between threads.
#[derive(Debug, Clone, Default)]
pub struct MemoryLedger {
    live: CategoryBytes,
    phase: Option<Phase>,
    peaks: [Option<PhasePeak>; 4],
}

impl MemoryLedger {
    /// An empty ledger (no phase entered yet: allocations before the first phase only change the
    /// live bytes, which every phase then starts from).
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `bytes` newly allocated in `cat`.
    pub fn alloc(&mut self, cat: Category, bytes: u64) {
        slot(&mut self.live, cat).0 += bytes;
        self.observe();
    }

    /// Records `bytes` of `cat` freed. Panics if more is freed than is live (an engine bug).
    pub fn free(&mut self, cat: Category, bytes: u64) {
        let live = slot(&mut self.live, cat);
        assert!(
            live.0 >= bytes,
            "ledger: freeing {bytes} B of {} with only {} B live",
            cat.name(),
            live.0
        );
        live.0 -= bytes;
    }

    /// Enters `phase`: from now on peaks are recorded for it (starting from the live bytes).
    pub fn enter(&mut self, phase: Phase) {
        self.phase = Some(phase);
        self.observe();
    }

    /// The phase entered last.
    pub fn phase(&self) -> Option<Phase> {
        self.phase
    }

    /// Live bytes of `cat` now.
    pub fn live(&self, cat: Category) -> Bytes {
        self.live.get(cat)
    }

    /// Live bytes of every category now.
    pub fn live_all(&self) -> CategoryBytes {
        self.live
    }

    /// Sum of live bytes over all categories.
    pub fn live_total(&self) -> Bytes {
        self.live.total()
    }

    /// The peak recorded for `phase` since the last [`MemoryLedger::reset_peaks`] (zeros if
    /// the phase was not entered).
    pub fn peak(&self, phase: Phase) -> PhasePeak {
        self.peaks[phase_index(phase)].unwrap_or_default()
    }

    /// Forgets the recorded peaks (live bytes stay).
    pub fn reset_peaks(&mut self) {
        self.peaks = [None; 4];
        if self.phase.is_some() {
            self.observe();
        }
    }

    fn observe(&mut self) {
        let Some(phase) = self.phase else { return };
        let live = self.live;
        let total = live.total();
        let p = self.peaks[phase_index(phase)].get_or_insert(PhasePeak {
            peak_total: total,
            at_peak: live,
            max: live,
        });
        if total > p.peak_total {
            p.peak_total = total;
            p.at_peak = live;
        }
        for c in LEDGER_CATEGORIES {
            let m = slot(&mut p.max, c);
            *m = (*m).max(live.get(c));
        }
    }
}

/// A global allocator that counts live heap bytes and their peak, delegating to the system
/// allocator. Install it in a binary or test with
/// `#[global_allocator] static A: CountingAllocator = CountingAllocator::new();` and pass
/// `&A` to the training driver, which reports the process peak per step.
#[derive(Debug)]
pub struct CountingAllocator {
    current: AtomicU64,
    peak: AtomicU64,
}

impl CountingAllocator {
    /// A counter at zero.
    pub const fn new() -> Self {
        CountingAllocator {
            current: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    /// Live heap bytes of the whole process now.
    pub fn current(&self) -> u64 {
        self.current.load(Ordering::Relaxed)
    }

    /// Largest live heap bytes since the last [`CountingAllocator::reset_peak`].
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Sets the peak to the current live bytes.
    pub fn reset_peak(&self) {
        self.peak.store(self.current(), Ordering::Relaxed);
    }

    fn add(&self, n: usize) {
        let now = self.current.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn sub(&self, n: usize) {
        self.current.fetch_sub(n as u64, Ordering::Relaxed);
    }
}

impl Default for CountingAllocator {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: every method forwards to `System` with the caller's layout unchanged; the counters
// are plain atomics and never allocate.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            self.add(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            self.add(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        self.sub(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            self.sub(layout.size());
            self.add(new_size);
        }
        p
    }
}

/// Keeps glibc malloc from returning memory to the kernel between tensor operations: candle
/// allocates a fresh buffer for each operation, and memory given back is faulted in and
/// zeroed by the kernel again on its next use (`clear_page` was 7.6% of a Llama step's CPU
/// samples on one thread).
///
/// - `M_MMAP_THRESHOLD` and `M_TRIM_THRESHOLD` at 1 GiB: buffers of 128 KiB or more (glibc's
///   default mmap threshold) would each be an `mmap` + page faults + `munmap`, and the top of
///   the heap would be trimmed on every large free.
/// - `M_ARENA_MAX` = 1: one arena for every thread. A rank's compute runs on a pool thread, and
///   a thread other than `main` gets its own arena made of 64 MiB heaps, which glibc unmaps as
///   soon as one is empty whatever the trim threshold (`heap_trim` in glibc's `arena.c`): one
///   Llama step (d 512, 8 layers, micro-batch 8 x 256) unmapped and re-mapped such a heap and
///   took about 27,000 page faults. With one arena that step's faults after the first steps
///   fall to the first touch of the peak, the process peak resident memory to 0.91x, and the
///   whole run's wall time to 0.93x (one process, 2 threads; 0.97x on `base`, 1.00x at W=2).
///   The arena's lock is taken once per allocation, a few thousand times a step.
///
/// Call it first in `main`, before any thread starts (`fsdp` and the training benches do).
/// The process heap peak (counted by [`CountingAllocator`], in bytes requested) is unchanged;
/// resident memory may stay at its high-water mark. No-op on non-glibc targets.
pub fn tune_allocator() {
    #[cfg(target_env = "gnu")]
    // SAFETY: `mallopt` only changes glibc allocator parameters, under the allocator's own
    // lock; the caller runs it before starting threads, so no allocation sees a half-set
    // configuration.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ledger_records_peak_and_max_per_phase() {
        let mut l = MemoryLedger::new();
        l.alloc(Category::ParamShards, 100);
        l.enter(Phase::Forward);
        l.alloc(Category::UnshardedParams, 40);
        l.alloc(Category::UnshardedParams, 40);
        l.free(Category::UnshardedParams, 40);
        l.enter(Phase::Backward);
        l.alloc(Category::UnshardedGrads, 10);
        l.free(Category::UnshardedParams, 40);
        let f = l.peak(Phase::Forward);
        assert_eq!(f.peak_total, Bytes(180));
        assert_eq!(f.at_peak.unsharded_params, Bytes(80));
        let b = l.peak(Phase::Backward);
        assert_eq!(b.peak_total, Bytes(150));
        assert_eq!(b.max.unsharded_grads, Bytes(10));
        assert_eq!(l.live_total(), Bytes(110));
        assert_eq!(l.peak(Phase::OptimizerStep), PhasePeak::default());
    }
}

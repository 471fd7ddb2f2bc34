//! The process-peak measurement protocol shared by the memory tests that compare the counting
//! allocator's peak with the plan (`engine_memory_process.rs`, `engine_memory_composite.rs`).
//!
//! Step 1 warms every rank up (buffers, candle's caches); then rank 0 resets the allocator's
//! peak, and the peak of step 2 is read. The allocator counts the whole process (all rank
//! threads), so the measured bytes are the step-2 peak minus what was allocated before it that
//! the ranks' ledgers do not own (the engines' persistent bytes are part of the plan).

use fsdp::memory::CountingAllocator;
use fsdp::runtime::{MicroBatch, RankEngine, StagedModel};

/// One rank's sample: the allocator's bytes when rank 0 reset the peak (rank 0 only), the
/// allocator's peak after step 2, and the rank's live ledger bytes, device and host ledger
/// together (bytes).
pub type Sample = (Option<u64>, u64, u64);

/// Runs the two steps on `e` (micro-batches `mbs`, learning rate 1e-3) and returns this rank's
/// sample. Every rank must call it (the batch-count checks are collectives that keep the
/// ranks in step around the reset). Panics on any engine error (test support).
pub fn second_step_sample<M: StagedModel + ?Sized>(
    e: &mut RankEngine<'_, M>,
    mbs: &[MicroBatch],
    alloc: &CountingAllocator,
) -> Sample {
    e.train_step(mbs, 1e-3).unwrap();
    e.check_batch_counts(1).unwrap();
    let base = if e.rank() == 0 {
        alloc.reset_peak();
        Some(alloc.current())
    } else {
        None
    };
    e.check_batch_counts(1).unwrap();
    e.train_step(mbs, 1e-3).unwrap();
    e.check_batch_counts(1).unwrap();
    (
        base,
        alloc.peak(),
        e.ledger().live_total().0 + e.host_ledger().live_total().0,
    )
}

/// The measured process bytes of step 2 from every rank's sample (rank 0 first): the peak over
/// ranks minus the bytes allocated at the reset that no ledger owns.
pub fn measured_bytes(samples: &[Sample]) -> u64 {
    let base = samples[0].0.expect("rank 0's sample holds the reset point");
    let peak = samples.iter().map(|r| r.1).max().unwrap_or(0);
    let persistent: u64 = samples.iter().map(|r| r.2).sum();
    peak - (base - persistent)
}

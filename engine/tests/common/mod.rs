//! Test support shared by the engine's parity tests: the tinyshakespeare bytes and the fixed
//! micro-batches every rank (and the single-process reference) trains on.

use candle_core::{Device, Tensor};
use fsdp::runtime::MicroBatch;

/// Sequences per micro-batch.
pub const B: usize = 2;
/// Tokens per sequence.
pub const T: usize = 32;

/// `testdata/tinyshakespeare.txt` of this repository (Tiny Shakespeare, public domain).
pub fn text() -> Vec<u8> {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/tinyshakespeare.txt"
    );
    std::fs::read(p).expect("tinyshakespeare.txt")
}

/// Micro-batch `k` of `rank` at `step` in a world of `w` ranks with `kk` micro-batches per
/// step: `B` windows of `T + 1` bytes at fixed, distinct offsets.
pub fn micro_batch(
    text: &[u8],
    step: usize,
    k: usize,
    rank: usize,
    w: usize,
    kk: usize,
) -> MicroBatch {
    let span = text.len() - T - 1;
    let mut inp = Vec::with_capacity(B * T);
    let mut tgt = Vec::with_capacity(B * T);
    for b in 0..B {
        let g = ((step * kk + k) * w + rank) * B + b;
        let start = (g * 7919 + 17) % span;
        inp.extend(text[start..start + T].iter().map(|&c| c as u32));
        tgt.extend(text[start + 1..start + T + 1].iter().map(|&c| c as u32));
    }
    MicroBatch {
        input: Tensor::from_vec(inp, (B, T), &Device::Cpu).unwrap(),
        target: Tensor::from_vec(tgt, (B, T), &Device::Cpu).unwrap(),
        count: (B * T) as u64,
    }
}

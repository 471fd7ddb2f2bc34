//! Test support shared by the engine's parity tests: the tinyshakespeare bytes, the fixed
//! micro-batches every rank (and the single-process reference) trains on, the reference run of
//! the tiny GPT and the bit-for-bit comparison of two runs.
// Each test binary uses part of this module.
#![allow(dead_code)]

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

/// What a run leaves to compare: the loss of every step, the final parameters
/// (`[unit][non-tied param][element]`) and, for engine runs, rank 0's gradient shards of one
/// more accumulation.
pub struct Run {
    /// World mean loss per step.
    pub losses: Vec<f64>,
    /// Final parameters.
    pub params: Vec<Vec<Vec<f32>>>,
    /// Gradient shards (empty for the reference).
    pub grads: Vec<Vec<Vec<f32>>>,
}

/// The single-process reference (`fsdp_testing::reference`) of the tiny GPT from the seed-1234
/// initialisation: `steps` steps of `kk` micro-batches of `w` ranks each, accumulated in the
/// order of a shard group of `shard` ranks under `sync`, learning rate 3e-3.
pub fn gpt_reference(
    steps: usize,
    w: usize,
    shard: usize,
    (kk, sync): (usize, fsdp_planner::GradSync),
    clip: Option<fsdp::runtime::Clip>,
    optimizer: fsdp::optim::Optimizer,
) -> Run {
    use fsdp::runtime::StagedModel;
    let model = fsdp::model::Gpt::from_preset("tiny").unwrap();
    let text = text();
    let mut r = fsdp_testing::reference::Reference::new(
        &model,
        StagedModel::init_params(&model, 1234),
        optimizer,
    );
    let mut losses = Vec::new();
    for step in 0..steps {
        let mbs: Vec<Vec<MicroBatch>> = (0..kk)
            .map(|k| {
                (0..w)
                    .map(|rank| micro_batch(&text, step, k, rank, w, kk))
                    .collect()
            })
            .collect();
        losses.push(r.step(&mbs, shard, sync, clip, 3e-3).unwrap());
    }
    Run {
        losses,
        params: r.params().to_vec(),
        grads: Vec::new(),
    }
}

/// The bits of each value.
pub fn bits64(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Asserts that two runs have bit-identical losses and final parameters.
pub fn assert_bitwise(a: &Run, b: &Run, what: &str) {
    assert_eq!(
        bits64(&a.losses),
        bits64(&b.losses),
        "{what}: losses {:?} vs {:?}",
        a.losses,
        b.losses
    );
    // The same units, parameters and lengths first: the element comparison below would
    // otherwise stop silently at the shorter side.
    assert_eq!(
        shape(&a.params),
        shape(&b.params),
        "{what}: element count per unit and parameter"
    );
    for (u, (pa, pb)) in a.params.iter().zip(&b.params).enumerate() {
        for (k, (x, y)) in pa.iter().zip(pb).enumerate() {
            let diff = x
                .iter()
                .zip(y)
                .filter(|(p, q)| p.to_bits() != q.to_bits())
                .count();
            assert_eq!(
                diff,
                0,
                "{what}: unit {u} param {k}: {diff} of {} elements differ",
                x.len()
            );
        }
    }
}

/// The element count of each parameter of each unit.
pub fn shape(params: &[Vec<Vec<f32>>]) -> Vec<Vec<usize>> {
    params
        .iter()
        .map(|u| u.iter().map(Vec::len).collect())
        .collect()
}

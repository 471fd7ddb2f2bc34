//! Parity: a small Llama (grouped-query attention 4/2 heads, Llama 3.1 rope scaling, untied)
//! at world sizes 1..4 under full shard, shard-grad-op, DDP and hybrid 2x2, and with gradient
//! accumulation, equals the single-process reference bit for bit (losses and every final
//! parameter, 4 AdamW steps on tinyshakespeare bytes). In bf16 (where the f32 reference does
//! not apply) full shard and DDP at W = 2 and 4 equal one rank accumulating the same W
//! micro-batches in order, bit for bit.

use crate::common::{micro_batch, text};
use fsdp::model::llama::Llama;
use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::{EngineConfig, InitSync, MicroBatch, RankEngine, StagedModel};
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{
    plan, GradSync, Llama3RopeScaling, LlamaConfig, LlamaNumerics, PlanConfig, Strategy,
};
use fsdp_testing::reference::Reference;
use fsdp_types::DType;
use std::time::Duration;

const STEPS: usize = 4;
const LR: f64 = 3e-3;

/// vocab 256 (bytes), d 64, 2 layers, 4 query heads, 2 key/value heads, ffn 128.
pub fn small_llama() -> Llama {
    Llama::new(
        "llama-parity",
        LlamaConfig {
            vocab_size: 256,
            d_model: 64,
            n_layer: 2,
            n_head: 4,
            n_kv_head: 2,
            ffn_hidden: 128,
            max_seq: 64,
            tied_head: false,
            qkv_bias: false,
        },
        LlamaNumerics {
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: Some(Llama3RopeScaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 32,
            }),
            sliding_window: None,
        },
    )
    .unwrap()
}

fn optimizer() -> Optimizer {
    Optimizer::AdamW(AdamWConfig {
        lr: LR,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    })
}

struct Run {
    losses: Vec<f64>,
    params: Vec<Vec<Vec<f32>>>,
}

fn run_engine(strategy: Strategy, w: usize, kk: usize, sync: GradSync, dtype: DType) -> Run {
    let model = small_llama();
    let mut cfg = PlanConfig::new(w as u64);
    cfg.strategy = strategy;
    cfg.grad_accum = kk as u64;
    cfg.grad_sync = sync;
    cfg.micro_batch = crate::common::B as u64;
    cfg.seq_len = crate::common::T as u64;
    cfg.param_dtype = dtype;
    let plan = plan(model.spec(), &cfg).unwrap();
    let s = plan.shard_size as usize;
    let text = text();
    let init = StagedModel::init_params(&model, 99);
    let ecfg = EngineConfig {
        optimizer: optimizer(),
        clip: None,
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    };
    let results = run_threads(
        Topology::new(s, w / s).unwrap(),
        Duration::from_secs(60),
        |comm| {
            let mut e = RankEngine::new(&model, &plan, &comm, ecfg, &init).unwrap();
            let mut losses = Vec::new();
            for step in 0..STEPS {
                let mbs: Vec<MicroBatch> = (0..kk)
                    .map(|k| micro_batch(&text, step, k, e.rank(), w, kk))
                    .collect();
                losses.push(e.train_step(&mbs, LR).unwrap().loss);
            }
            Run {
                losses,
                params: e.full_params().unwrap(),
            }
        },
    );
    let mut runs: Vec<Run> = results.into_iter().map(|r| r.unwrap()).collect();
    // Every rank saw the same losses and gathers the same full parameters.
    for (rank, r) in runs.iter().enumerate().skip(1) {
        assert_bitwise(
            r,
            &runs[0],
            &format!("{strategy} W={w} {dtype}: rank {rank} vs rank 0"),
        );
    }
    runs.swap_remove(0)
}

fn run_reference(w: usize, shard: usize, kk: usize, sync: GradSync) -> Run {
    let model = small_llama();
    let text = text();
    let mut r = Reference::new(&model, StagedModel::init_params(&model, 99), optimizer());
    let losses = (0..STEPS)
        .map(|step| {
            let mbs: Vec<Vec<MicroBatch>> = (0..kk)
                .map(|k| {
                    (0..w)
                        .map(|rank| micro_batch(&text, step, k, rank, w, kk))
                        .collect()
                })
                .collect();
            r.step(&mbs, shard, sync, None, LR).unwrap()
        })
        .collect();
    Run {
        losses,
        params: r.params().to_vec(),
    }
}

fn assert_bitwise(a: &Run, b: &Run, what: &str) {
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&a.losses),
        bits(&b.losses),
        "{what}: {:?} vs {:?}",
        a.losses,
        b.losses
    );
    // The same units, parameters and lengths first: the element comparison below would
    // otherwise stop silently at the shorter side.
    let shape = |p: &[Vec<Vec<f32>>]| -> Vec<Vec<usize>> {
        p.iter().map(|u| u.iter().map(Vec::len).collect()).collect()
    };
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
                "{what}: unit {u} param {k}: {diff} of {} differ",
                x.len()
            );
        }
    }
}

fn check(strategy: Strategy, w: usize, kk: usize, sync: GradSync) {
    let e = run_engine(strategy, w, kk, sync, DType::F32);
    let shard = strategy.shard_size(w as u64).unwrap() as usize;
    let r = run_reference(w, shard, kk, sync);
    assert_bitwise(&e, &r, &format!("{strategy} W={w} K={kk} {sync:?}"));
    assert!(
        e.losses[STEPS - 1] < e.losses[0],
        "loss falls: {:?}",
        e.losses
    );
}

#[test]
fn llama_parity_full_shard_w1_to_w4_bitwise() {
    for w in 1..=4 {
        check(Strategy::FullShard, w, 1, GradSync::EveryMicroBatch);
    }
}

#[test]
fn llama_parity_shard_grad_op_ddp_hybrid_bitwise() {
    for w in [2, 3] {
        check(Strategy::ShardGradOp, w, 1, GradSync::EveryMicroBatch);
    }
    for w in [2, 4] {
        check(Strategy::NoShard, w, 1, GradSync::EveryMicroBatch);
    }
    check(
        Strategy::Hybrid { shard_size: 2 },
        4,
        1,
        GradSync::EveryMicroBatch,
    );
}

#[test]
fn llama_parity_accumulation_sync_every_and_last_bitwise() {
    check(Strategy::FullShard, 2, 2, GradSync::EveryMicroBatch);
    check(Strategy::FullShard, 2, 2, GradSync::LastMicroBatch);
}

#[test]
fn llama_parity_bf16_sharded_equals_one_rank_accumulating() {
    for w in [2, 4] {
        let one = run_engine(
            Strategy::FullShard,
            1,
            w,
            GradSync::EveryMicroBatch,
            DType::BF16,
        );
        for strategy in [Strategy::FullShard, Strategy::NoShard] {
            let e = run_engine(strategy, w, 1, GradSync::EveryMicroBatch, DType::BF16);
            assert_bitwise(&e, &one, &format!("bf16 {strategy} W={w}"));
        }
        assert!(one.losses[STEPS - 1] < one.losses[0], "{:?}", one.losses);
    }
}

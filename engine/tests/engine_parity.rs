//! Parity: the engine at world sizes 1..4 under full shard, shard-grad-op, DDP (no-shard) and
//! hybrid 2x2 equals the single-process reference that accumulates the same micro-batches in
//! the engine's reduction order — bit for bit on the thread backend (losses and every final
//! parameter), tiny GPT, 5 steps, on tinyshakespeare. Full shard and hybrid with and without
//! unit-level activation checkpointing (the kept graph with resharded, re-gathered parameters
//! equals the recompute bit for bit, gradient shards included), and shard-grad-op / DDP with
//! it.

use fsdp::model::Gpt;
use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::{Clip, EngineConfig, InitSync, MicroBatch, NormType, RankEngine, StagedModel};
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{plan, GradSync, PlanConfig, Strategy};
use std::time::Duration;

mod common;
use common::{assert_bitwise, bits64, gpt_reference, micro_batch, text, Run, B, T};

const STEPS: usize = 5;

fn optimizer() -> Optimizer {
    Optimizer::AdamW(AdamWConfig {
        lr: 3e-3,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    })
}

fn run_engine(strategy: Strategy, w: usize, kk: usize, sync: GradSync, clip: Option<Clip>) -> Run {
    run_engine_ckpt(strategy, w, kk, sync, clip, None)
}

fn run_engine_ckpt(
    strategy: Strategy,
    w: usize,
    kk: usize,
    sync: GradSync,
    clip: Option<Clip>,
    ckpt: Option<bool>,
) -> Run {
    let model = Gpt::from_preset("tiny").unwrap();
    let mut cfg = PlanConfig::new(w as u64);
    cfg.strategy = strategy;
    cfg.activation_checkpointing = ckpt;
    cfg.grad_accum = kk as u64;
    cfg.grad_sync = sync;
    cfg.micro_batch = B as u64;
    cfg.seq_len = T as u64;
    let plan = plan(model.spec(), &cfg).unwrap();
    let s = plan.shard_size as usize;
    let topo = Topology::new(s, w / s).unwrap();
    let text = text();
    let init = StagedModel::init_params(&model, 1234);
    let ecfg = EngineConfig {
        optimizer: optimizer(),
        clip,
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    };
    let results = run_threads(topo, Duration::from_secs(60), |comm| {
        let mut e = RankEngine::new(&model, &plan, &comm, ecfg, &init).unwrap();
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let mbs: Vec<MicroBatch> = (0..kk)
                .map(|k| micro_batch(&text, step, k, e.rank(), w, kk))
                .collect();
            let st = e.train_step(&mbs, 3e-3).unwrap();
            losses.push(st.loss);
        }
        let mbs: Vec<MicroBatch> = (0..kk)
            .map(|k| micro_batch(&text, STEPS, k, e.rank(), w, kk))
            .collect();
        e.accumulate(&mbs).unwrap();
        let grads = e.grad_shards().unwrap();
        e.zero_grad().unwrap();
        let params = e.full_params().unwrap();
        Run {
            losses,
            params,
            grads,
        }
    });
    let mut runs: Vec<Run> = results.into_iter().map(|r| r.unwrap()).collect();
    for r in &runs[1..] {
        assert_eq!(
            bits64(&r.losses),
            bits64(&runs[0].losses),
            "ranks agree on losses"
        );
    }
    runs.swap_remove(0)
}

fn run_reference(
    w: usize,
    shard: usize,
    kk: usize,
    sync: GradSync,
    clip: Option<Clip>,
    optimizer: Optimizer,
) -> Run {
    gpt_reference(STEPS, w, shard, (kk, sync), clip, optimizer)
}

fn check(strategy: Strategy, w: usize, kk: usize, sync: GradSync) {
    let e = run_engine(strategy, w, kk, sync, None);
    let shard = strategy.shard_size(w as u64).unwrap() as usize;
    let r = run_reference(w, shard, kk, sync, None, optimizer());
    assert_bitwise(&e, &r, &format!("{strategy} W={w} K={kk} {sync:?}"));
    assert!(
        e.losses[STEPS - 1] < e.losses[0],
        "loss falls: {:?}",
        e.losses
    );
}

#[test]
fn parity_world_size_1_is_bitwise_reference() {
    check(Strategy::FullShard, 1, 2, GradSync::EveryMicroBatch);
}

#[test]
fn parity_full_shard_w2_w3_w4_bitwise() {
    for w in [2, 3, 4] {
        check(Strategy::FullShard, w, 1, GradSync::EveryMicroBatch);
    }
}

#[test]
fn parity_shard_grad_op_w2_w3_w4_bitwise() {
    for w in [2, 3, 4] {
        check(Strategy::ShardGradOp, w, 1, GradSync::EveryMicroBatch);
    }
}

#[test]
fn parity_ddp_w2_w3_w4_bitwise() {
    for w in [2, 3, 4] {
        check(Strategy::NoShard, w, 1, GradSync::EveryMicroBatch);
    }
}

#[test]
fn parity_hybrid_2x2_bitwise() {
    check(
        Strategy::Hybrid { shard_size: 2 },
        4,
        1,
        GradSync::EveryMicroBatch,
    );
}

#[test]
fn parity_grad_accumulation_sync_every_and_last_bitwise() {
    check(Strategy::FullShard, 2, 3, GradSync::EveryMicroBatch);
    check(Strategy::ShardGradOp, 2, 3, GradSync::LastMicroBatch);
}

/// A full-shard run at W = 3 with global-norm clipping: the world mean loss and the gradient
/// norm before clipping of every step, the final parameters, and, for one more step's
/// gradients, each rank's shards before and after `clip_grad_norm` and the norm it returned.
struct Clipped {
    run: Run,
    norms: Vec<f64>,
    before: Vec<Vec<Vec<Vec<f32>>>>,
    after: Vec<Vec<Vec<Vec<f32>>>>,
    returned: Vec<f64>,
}

fn run_clipped(w: usize, optimizer: Optimizer, clip: Clip) -> Clipped {
    let model = Gpt::from_preset("tiny").unwrap();
    let mut cfg = PlanConfig::new(w as u64);
    cfg.strategy = Strategy::FullShard;
    cfg.micro_batch = B as u64;
    cfg.seq_len = T as u64;
    if let Optimizer::Sgd(c) = optimizer {
        cfg.optimizer = fsdp_planner::Optimizer::Sgd {
            momentum: c.momentum,
        };
    }
    let plan = plan(model.spec(), &cfg).unwrap();
    let text = text();
    let init = StagedModel::init_params(&model, 1234);
    let ecfg = EngineConfig {
        optimizer,
        clip: Some(clip),
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    };
    let topo = Topology::new(w, 1).unwrap();
    let results = run_threads(topo, Duration::from_secs(60), |comm| {
        let mut e = RankEngine::new(&model, &plan, &comm, ecfg, &init).unwrap();
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for step in 0..STEPS {
            let mbs = vec![micro_batch(&text, step, 0, e.rank(), w, 1)];
            let st = e.train_step(&mbs, 3e-3).unwrap();
            losses.push(st.loss);
            norms.push(st.grad_norm.expect("clipping computes the norm"));
        }
        let params = e.full_params().unwrap();
        e.accumulate(&[micro_batch(&text, STEPS, 0, e.rank(), w, 1)])
            .unwrap();
        let before = e.grad_shards().unwrap();
        let returned = e.clip_grad_norm(clip).unwrap();
        let after = e.grad_shards().unwrap();
        (losses, norms, params, before, after, returned)
    });
    let ranks: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    for r in &ranks[1..] {
        assert_eq!(bits64(&r.0), bits64(&ranks[0].0), "ranks agree on losses");
        assert_eq!(bits64(&r.1), bits64(&ranks[0].1), "ranks agree on norms");
    }
    Clipped {
        run: Run {
            losses: ranks[0].0.clone(),
            params: ranks[0].2.clone(),
            grads: Vec::new(),
        },
        norms: ranks[0].1.clone(),
        before: ranks.iter().map(|r| r.3.clone()).collect(),
        after: ranks.iter().map(|r| r.4.clone()).collect(),
        returned: ranks.iter().map(|r| r.5).collect(),
    }
}

/// Global-norm clipping: the norm is the L2 norm of the whole gradient, summed in f64 over
/// every rank's shard here; every rank's shard is multiplied by exactly
/// `max_norm / (norm + 1e-6)` (in f32), leaving a global norm of `max_norm`; and clipping
/// engaged on every step (each norm above `max_norm`). Over 5 steps of plain SGD, where the
/// update is the clipped gradient itself, the engine's parameter updates equal the
/// single-process reference's to 1e-5 of their size (the engine sums squares per shard and
/// then over ranks, the reference over whole parameters: the norms differ in the last bits);
/// with AdamW (nearly blind to the scale of the gradient) losses and parameters agree to fp32
/// tolerance.
#[test]
fn parity_with_global_norm_clipping() {
    let w = 3;
    let max_norm = 0.5;
    let clip = Clip {
        max_norm,
        norm: NormType::L2,
    };
    let sgd = Optimizer::Sgd(fsdp::optim::SgdConfig {
        lr: 3e-3,
        momentum: 0.0,
        weight_decay: 0.0,
    });
    let c = run_clipped(w, sgd, clip);
    assert!(
        c.norms.iter().all(|&n| n > 2.0 * max_norm),
        "clipping engaged on every step: {:?}",
        c.norms
    );
    // The gradients of one more step, clipped by hand.
    let sum_sq: f64 = c
        .before
        .iter()
        .flatten()
        .flatten()
        .flatten()
        .map(|&x| x as f64 * x as f64)
        .sum();
    let norm = sum_sq.sqrt();
    assert!(norm > max_norm, "{norm}");
    for (rank, &n) in c.returned.iter().enumerate() {
        assert!(
            (n - norm).abs() <= 1e-12 * norm,
            "rank {rank}: norm {n} vs {norm} summed over every rank's shard"
        );
    }
    let coef = (max_norm / (c.returned[0] + 1e-6)) as f32;
    let mut clipped_sq = 0f64;
    for (rank, (b, a)) in c.before.iter().zip(&c.after).enumerate() {
        let b: Vec<f32> = b.concat().concat();
        let a: Vec<f32> = a.concat().concat();
        let want: Vec<u32> = b.iter().map(|&x| (x * coef).to_bits()).collect();
        let got: Vec<u32> = a.iter().map(|x| x.to_bits()).collect();
        assert_eq!(got, want, "rank {rank}: shard x {coef}");
        clipped_sq += a.iter().map(|&x| x as f64 * x as f64).sum::<f64>();
    }
    assert!(
        (clipped_sq.sqrt() - max_norm).abs() <= 1e-5 * max_norm,
        "clipped norm {}",
        clipped_sq.sqrt()
    );
    // SGD: the updates against the reference's.
    let r = run_reference(w, w, 1, GradSync::EveryMicroBatch, Some(clip), sgd);
    let model = Gpt::from_preset("tiny").unwrap();
    let init = StagedModel::init_params(&model, 1234);
    assert_eq!(common::shape(&c.run.params), common::shape(&r.params));
    assert_eq!(common::shape(&init), common::shape(&r.params));
    let flat = |p: &[Vec<Vec<f32>>]| p.concat().concat();
    let (p0, pe, pr) = (flat(&init), flat(&c.run.params), flat(&r.params));
    let (mut diff, mut size) = (0f64, 0f64);
    for ((&x0, &xe), &xr) in p0.iter().zip(&pe).zip(&pr) {
        let (de, dr) = ((xe - x0) as f64, (xr - x0) as f64);
        diff += (de - dr) * (de - dr);
        size += dr * dr;
    }
    // 5 steps of lr 3e-3 x a clipped norm of 0.5: the update's norm is at most 7.5e-3.
    assert!(
        size.sqrt() > 5e-3 && size.sqrt() <= 7.5e-3 * (1.0 + 1e-5),
        "update norm {}",
        size.sqrt()
    );
    assert!(
        diff.sqrt() <= 1e-5 * size.sqrt(),
        "updates differ by {} of {}",
        diff.sqrt(),
        size.sqrt()
    );
    for (a, b) in c.run.losses.iter().zip(&r.losses) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "loss {a} vs {b}");
    }
    // AdamW: losses and parameters to fp32 tolerance.
    let e = run_clipped(w, optimizer(), clip).run;
    let r = run_reference(w, w, 1, GradSync::EveryMicroBatch, Some(clip), optimizer());
    assert_eq!(e.losses.len(), STEPS);
    for (a, b) in e.losses.iter().zip(&r.losses) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "loss {a} vs {b}");
    }
    assert_eq!(common::shape(&e.params), common::shape(&r.params));
    let mut worst = 0f32;
    for (x, y) in e.params.iter().flatten().zip(r.params.iter().flatten()) {
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs() / q.abs().max(1e-3));
        }
    }
    assert!(worst < 1e-4, "worst relative difference {worst}");
}

/// Full shard and hybrid without activation checkpointing (graphs kept, unsharded parameters
/// freed after forward and re-gathered into the same tensors for backward) equal the reference
/// and the checkpointed (recompute) run bit for bit: losses, final parameters and the gradient
/// shards of one more step; with gradient accumulation in both sync modes too. Shard-grad-op
/// and DDP with checkpointing (recompute while the unit stays unsharded) equal their default.
#[test]
fn parity_activation_checkpointing_on_and_off_bitwise() {
    let cases = [
        (Strategy::FullShard, 2, 1, GradSync::EveryMicroBatch),
        (Strategy::FullShard, 3, 1, GradSync::EveryMicroBatch),
        (Strategy::FullShard, 2, 3, GradSync::EveryMicroBatch),
        (Strategy::FullShard, 2, 2, GradSync::LastMicroBatch),
        (
            Strategy::Hybrid { shard_size: 2 },
            4,
            1,
            GradSync::EveryMicroBatch,
        ),
        (Strategy::ShardGradOp, 2, 1, GradSync::EveryMicroBatch),
        (Strategy::NoShard, 2, 2, GradSync::LastMicroBatch),
    ];
    for (strategy, w, kk, sync) in cases {
        let what = format!("{strategy} W={w} K={kk} {sync:?}");
        let on = run_engine_ckpt(strategy, w, kk, sync, None, Some(true));
        let off = run_engine_ckpt(strategy, w, kk, sync, None, Some(false));
        let shard = strategy.shard_size(w as u64).unwrap() as usize;
        let r = run_reference(w, shard, kk, sync, None, optimizer());
        assert_bitwise(&on, &r, &format!("{what} checkpointing on vs reference"));
        assert_bitwise(&off, &r, &format!("{what} checkpointing off vs reference"));
        assert_bitwise(&off, &on, &format!("{what} off vs on"));
        assert_eq!(on.grads.len(), off.grads.len());
        let mut nonzero = 0;
        for (u, (a, b)) in on.grads.iter().zip(&off.grads).enumerate() {
            for (f, (x, y)) in a.iter().zip(b).enumerate() {
                assert_eq!(x.len(), y.len());
                let diff = x
                    .iter()
                    .zip(y)
                    .filter(|(p, q)| p.to_bits() != q.to_bits())
                    .count();
                assert_eq!(diff, 0, "{what}: unit {u} flat {f}: gradient shards differ");
                nonzero += x.iter().filter(|g| **g != 0.0).count();
            }
        }
        assert!(nonzero > 0, "{what}: gradients are not all zero");
    }
}

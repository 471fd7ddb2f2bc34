//! Published sharded-training faults, run through the real engine on the thread backend:
//! * padding for sizes not divisible by the world size: unshard, global norm sqrt(46), one
//!   AdamW step (<https://github.com/deepspeedai/DeepSpeed/pull/1380>);
//! * clipping by the global norm, not a rank's local one
//!   (<https://github.com/areal-project/AReaL/issues/312>);
//! * gradient accumulation divides by W*K exactly once
//!   (<https://github.com/NVIDIA/Megatron-LM/pull/3023>);
//! * frozen parameters in a trainable unit (<https://github.com/pytorch/pytorch/pull/104967>);
//! * ranks with different batch counts error instead of hanging
//!   (<https://github.com/deepspeedai/DeepSpeed/issues/2223>), and an uneven last batch is
//!   weighted by its real samples (<https://github.com/PsycheFoundation/nousnet/issues/274>);
//! * different initial weights on different ranks are detected, or broadcast from rank 0
//!   (<https://github.com/pytorch/torchtitan/issues/166>).

use fsdp::error::EngineError;
use fsdp::optim::{AdamWConfig, Optimizer, SgdConfig};
use fsdp::runtime::reference::Reference;
use fsdp::runtime::toy::{DotModel, LayerDef, LinearStack};
use fsdp::runtime::{Clip, EngineConfig, InitSync, MicroBatch, NormType, RankEngine, StagedModel};
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{plan, GradSync, PlanConfig, ShardPlan, Strategy};
use std::time::{Duration, Instant};

fn make_plan(
    model: &dyn StagedModel,
    w: usize,
    strategy: Strategy,
    opt: fsdp_planner::Optimizer,
    k: u64,
    sync: GradSync,
) -> ShardPlan {
    let mut c = PlanConfig::new(w as u64);
    c.strategy = strategy;
    c.optimizer = opt;
    c.grad_accum = k;
    c.grad_sync = sync;
    plan(model.spec(), &c).unwrap()
}

fn adamw(lr: f64, wd: f64) -> Optimizer {
    Optimizer::AdamW(AdamWConfig {
        lr,
        weight_decay: wd,
        ..AdamWConfig::default()
    })
}

fn cfg(optimizer: Optimizer, init_sync: InitSync) -> EngineConfig {
    EngineConfig {
        optimizer,
        clip: None,
        init_sync,
        enforce_memory_plan: true,
        nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    }
}

/// Runs `body` on every rank of a `w`-rank world with the plan's shard size; returns the
/// per-rank results in rank order.
fn on_ranks<M: StagedModel, T: Send>(
    model: &M,
    plan: &ShardPlan,
    ecfg: EngineConfig,
    init: &(dyn Fn(usize) -> Vec<Vec<Vec<f32>>> + Sync),
    body: &(dyn Fn(&mut RankEngine<'_, M>) -> Result<T, EngineError> + Sync),
) -> Vec<Result<T, EngineError>> {
    let w = plan.world_size() as usize;
    let s = plan.shard_size as usize;
    let topo = Topology::new(s, w / s).unwrap();
    run_threads(topo, Duration::from_secs(20), |comm| {
        let rank = fsdp_comm::Communicator::rank(&comm);
        let init = init(rank);
        let mut e = RankEngine::new(model, plan, &comm, ecfg, &init)?;
        body(&mut e)
    })
    .into_iter()
    .map(|r| {
        r.map_err(|source| EngineError::Comm {
            rank: 0,
            source: Box::new(source),
        })
        .and_then(|x| x)
    })
    .collect()
}

/// Reassembles a trainable flat gradient from every rank's shard (shard group = world).
fn full_grad(shards: &[Vec<f32>]) -> Vec<f32> {
    shards.iter().flatten().copied().collect()
}

// ---------------------------------------------------------------------------------------
// Padding for sizes not divisible by the world size
// (https://github.com/deepspeedai/DeepSpeed/pull/1380)
// ---------------------------------------------------------------------------------------

fn padding_model() -> DotModel {
    let shapes: [(&str, &[u64]); 4] = [("A", &[7, 3]), ("B", &[5]), ("C", &[1, 17]), ("D", &[3])];
    let mut k = 0f32;
    let init = shapes
        .iter()
        .map(|(_, s)| {
            let n: u64 = s.iter().product();
            (0..n)
                .map(|_| {
                    k += 1.0;
                    k - 0.5
                })
                .collect()
        })
        .collect();
    DotModel::new("padding", &shapes, init)
}

#[test]
fn padding_engine_unshard_norm_sqrt46_and_one_adamw_step() {
    let model = padding_model();
    let input: Vec<Vec<f32>> = model.init_params(0)[0].clone();
    for w in [1usize, 2, 3, 4, 5, 8] {
        let plan = make_plan(
            &model,
            w,
            Strategy::FullShard,
            fsdp_planner::Optimizer::AdamW,
            1,
            GradSync::EveryMicroBatch,
        );
        let shard_len = plan.units[0].flat_params[0].shard_numel().0 as usize;
        let res = on_ranks(
            &model,
            &plan,
            cfg(adamw(0.1, 0.1), InitSync::Verify),
            &|_| model.init_params(0),
            &|e| {
                // 1. Shard, then unshard: 46 elements, bit-exact, shapes as declared.
                let mut full = e.full_params()?;
                // Gradient 1.0 on every real element: one sample c = ones on every rank.
                let mb = model.batch(&[vec![1.0; 46]]).unwrap();
                let acc = e.accumulate(&[mb])?;
                let norm = e.grad_norm(NormType::L2)?;
                e.optimizer_step(0.1)?;
                let mut after = e.full_params()?;
                let f = &e.units()[0].flats[0];
                let shard = f.param_vec()?;
                let real: Vec<bool> = {
                    let mut v = vec![false; shard.len()];
                    for s in &f.spans {
                        for x in &mut v[s.range()] {
                            *x = true;
                        }
                    }
                    v
                };
                let padding: Vec<f32> = shard
                    .iter()
                    .zip(&real)
                    .filter(|(_, r)| !**r)
                    .map(|(x, _)| *x)
                    .collect();
                Ok((
                    full.swap_remove(0),
                    acc.loss,
                    norm,
                    after.swap_remove(0),
                    padding,
                ))
            },
        );
        let mut padding_total = 0;
        for r in res {
            let (full, _loss, norm, after, padding) = r.unwrap();
            assert_eq!(full, input, "W={w}: unshard returns the input bit for bit");
            assert_eq!(
                full.iter().map(|p| p.len()).collect::<Vec<_>>(),
                vec![21, 5, 17, 3]
            );
            assert!(
                (norm - 46f64.sqrt()).abs() < 1e-6,
                "W={w}: norm {norm} (sqrt 46 = 6.7823300)"
            );
            assert_eq!((norm as f32), 6.78233f32, "W={w}: fp32 norm");
            for (p, v) in after.iter().flatten().zip(input.iter().flatten()) {
                let want = 0.99f32 * v - 0.1;
                assert!(
                    (p - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "W={w}: {v} -> {p}, want {want}"
                );
            }
            assert!(
                padding.iter().all(|x| x.to_bits() == 0),
                "W={w}: padding stays 0.0: {padding:?}"
            );
            padding_total += padding.len();
        }
        assert_eq!(
            padding_total,
            shard_len * w - 46,
            "W={w}: padding = shard_len*W - 46"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Clipping by the global norm (https://github.com/areal-project/AReaL/issues/312)
// ---------------------------------------------------------------------------------------

#[test]
fn clipping_uses_the_global_norm_at_every_world_size() {
    let model = DotModel::new("clip", &[("p", &[8])], vec![vec![0.0; 8]]);
    let c = [3f32, 0., 0., 0., 0., 0., 0., 4.];
    for (norm, want_norm, scale) in [(NormType::L2, 5.0, 0.2f32), (NormType::Inf, 4.0, 0.25f32)] {
        for w in [1usize, 2, 3, 4] {
            let plan = make_plan(
                &model,
                w,
                Strategy::FullShard,
                fsdp_planner::Optimizer::AdamW,
                1,
                GradSync::EveryMicroBatch,
            );
            let res = on_ranks(
                &model,
                &plan,
                cfg(adamw(0.1, 0.0), InitSync::Verify),
                &|_| model.init_params(0),
                &|e| {
                    e.accumulate(&[model.batch(&[c.to_vec()]).unwrap()])?;
                    let before = e.clip_grad_norm(Clip {
                        max_norm: 1.0,
                        norm,
                    })?;
                    let after = e.grad_norm(norm)?;
                    Ok((before, after, e.grad_shards()?[0][0].clone()))
                },
            );
            let res: Vec<_> = res.into_iter().map(|r| r.unwrap()).collect();
            let grad = full_grad(&res.iter().map(|r| r.2.clone()).collect::<Vec<_>>());
            for (before, after, _) in &res {
                assert!(
                    (before - want_norm).abs() < 1e-9,
                    "{norm:?} W={w}: every rank reports {want_norm}, got {before}"
                );
                assert!(
                    (after - 1.0).abs() < 1e-5,
                    "{norm:?} W={w}: norm after clipping {after}"
                );
            }
            for (g, ci) in grad.iter().zip(c) {
                let want = ci * scale;
                assert!((g - want).abs() <= 1e-6, "{norm:?} W={w}: clipped {grad:?}");
            }
            assert!(
                grad[8..].iter().all(|x| *x == 0.0),
                "padding gradient stays 0"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Gradient accumulation scales by 1/(W*K) exactly once
// (https://github.com/NVIDIA/Megatron-LM/pull/3023)
// ---------------------------------------------------------------------------------------

fn sample(i: usize) -> Vec<f32> {
    vec![i as f32; 4]
}

fn accumulated_grads(sync: GradSync, order: [usize; 3], one_batch: bool) -> Vec<Vec<f32>> {
    let model = DotModel::new("accum", &[("w", &[4])], vec![vec![0.5; 4]]);
    let k = if one_batch { 1 } else { 3 };
    let plan = make_plan(
        &model,
        2,
        Strategy::FullShard,
        fsdp_planner::Optimizer::AdamW,
        k,
        sync,
    );
    let res = on_ranks(
        &model,
        &plan,
        cfg(adamw(1e-3, 0.0), InitSync::Verify),
        &|_| model.init_params(0),
        &|e| {
            let base = 3 * e.rank();
            let mbs: Vec<MicroBatch> = if one_batch {
                vec![model
                    .batch(&[sample(base + 1), sample(base + 2), sample(base + 3)])
                    .unwrap()]
            } else {
                order
                    .iter()
                    .map(|&j| model.batch(&[sample(base + 1 + j)]).unwrap())
                    .collect()
            };
            // Cycle 1, the optimizer step and zeroing, then an identical cycle 2.
            let mut out = Vec::new();
            let acc = e.accumulate(&mbs)?;
            assert_eq!(acc.tokens, 6);
            assert!(
                (acc.loss - 0.5 * 4.0 * 3.5).abs() < 1e-12,
                "loss is the mean over 6 samples"
            );
            out.push(e.grad_shards()?[0][0].clone());
            e.optimizer_step(1e-3)?;
            assert!(
                e.grad_shards()?[0][0].iter().all(|x| *x == 0.0),
                "zeroed after the step"
            );
            e.accumulate(&mbs)?;
            out.push(e.grad_shards()?[0][0].clone());
            Ok(out)
        },
    );
    res.into_iter().flat_map(|r| r.unwrap()).collect()
}

#[test]
fn accumulation_divides_by_w_times_k_exactly_once() {
    for sync in [GradSync::EveryMicroBatch, GradSync::LastMicroBatch] {
        for order in [[0, 1, 2], [2, 0, 1]] {
            for g in accumulated_grads(sync, order, false) {
                assert_eq!(
                    g,
                    vec![3.5f32; 2],
                    "{sync:?} order {order:?}: exactly 3.5 (not 4.5833, 7.0, 1.75, 1.5)"
                );
            }
        }
    }
    for g in accumulated_grads(GradSync::EveryMicroBatch, [0, 1, 2], true) {
        assert_eq!(g, vec![3.5f32; 2], "K=1 with 3 samples per rank");
    }
}

// ---------------------------------------------------------------------------------------
// Frozen parameters in a trainable unit (https://github.com/pytorch/pytorch/pull/104967)
// ---------------------------------------------------------------------------------------

#[test]
fn frozen_params_in_a_trainable_unit_get_no_grad_state_and_stay_unchanged() {
    let layer = |trainable| LayerDef {
        d_in: 1000,
        d_out: 1000,
        bias: true,
        trainable,
    };
    let mut units: Vec<Vec<LayerDef>> = (0..8).map(|_| vec![layer(false)]).collect();
    units.push(vec![layer(false), layer(true)]);
    let model = LinearStack::new("frozen", &units, true);
    let plan = make_plan(
        &model,
        4,
        Strategy::FullShard,
        fsdp_planner::Optimizer::AdamW,
        1,
        GradSync::EveryMicroBatch,
    );
    let init = model.init_params(9);
    let x: Vec<f32> = (0..2000).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
    let y: Vec<f32> = (0..2000).map(|i| ((i % 5) as f32 - 2.0) / 4.0).collect();
    let batch = || LinearStack::batch(x.clone(), 1000, y.clone(), 1000).unwrap();
    let opt = adamw(1e-3, 0.1);
    let res = on_ranks(
        &model,
        &plan,
        cfg(opt, InitSync::Verify),
        &|_| init.clone(),
        &|e| {
            let live = e.ledger().live_all();
            for _ in 0..3 {
                e.train_step(&[batch()], 1e-3)?;
            }
            Ok((live, e.full_params()?))
        },
    );
    let mut reference = Reference::new(&model, init.clone(), opt);
    for _ in 0..3 {
        let mbs = vec![(0..4).map(|_| batch()).collect::<Vec<_>>()];
        reference
            .step(&mbs, 4, GradSync::EveryMicroBatch, None, 1e-3)
            .unwrap();
    }
    for r in res {
        let (live, params) = r.unwrap();
        assert_eq!(
            live.param_shards.0, 10_010_000,
            "params per rank = 10,010,000 x 4 / 4 B"
        );
        assert_eq!(
            live.grad_shards.0, 1_001_000,
            "gradient bytes only for the trainable layer"
        );
        assert_eq!(
            live.optimizer_state.0, 2_002_000,
            "AdamW state only for the trainable layer"
        );
        // Frozen: layers 0..8 (units 0..7 and the first layer of unit 8), bit for bit.
        for u in 0..9 {
            let n = if u == 8 { 2 } else { params[u].len() };
            for k in 0..n {
                assert!(
                    params[u][k]
                        .iter()
                        .zip(&init[u][k])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "unit {u} param {k}: frozen parameters are unchanged (no weight decay)"
                );
            }
        }
        // Layer 9 equals the reference run.
        for (k, (mine, want)) in params[8]
            .iter()
            .zip(&reference.params()[8])
            .enumerate()
            .skip(2)
        {
            let worst = mine
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
                .fold(0f32, f32::max);
            assert!(
                worst <= 1e-5,
                "layer 9 param {k}: relative difference {worst}"
            );
        }
        assert_ne!(params[8][2], init[8][2], "the trainable layer trained");
    }
}

// ---------------------------------------------------------------------------------------
// Ranks with different batch counts (https://github.com/deepspeedai/DeepSpeed/issues/2223);
// an uneven last batch (https://github.com/PsycheFoundation/nousnet/issues/274)
// ---------------------------------------------------------------------------------------

#[test]
fn a_rank_with_more_batches_errors_naming_the_mismatch_instead_of_hanging() {
    let model = LinearStack::new(
        "mlp",
        &[
            vec![LayerDef {
                d_in: 4,
                d_out: 3,
                bias: false,
                trainable: true,
            }],
            vec![LayerDef {
                d_in: 3,
                d_out: 3,
                bias: false,
                trainable: true,
            }],
            vec![LayerDef {
                d_in: 3,
                d_out: 2,
                bias: false,
                trainable: true,
            }],
        ],
        true,
    );
    let plan = make_plan(
        &model,
        4,
        Strategy::FullShard,
        fsdp_planner::Optimizer::AdamW,
        1,
        GradSync::EveryMicroBatch,
    );
    let t0 = Instant::now();
    let res = on_ranks(
        &model,
        &plan,
        cfg(adamw(1e-3, 0.0), InitSync::Verify),
        &|_| model.init_params(1),
        &|e| {
            let batches: u64 = if e.rank() == 2 { 8 } else { 4 };
            e.check_batch_counts(batches)?;
            Ok(())
        },
    );
    for r in &res {
        let msg = r.as_ref().unwrap_err().to_string();
        assert!(msg.contains("rank 2: 8 batches, others: 4"), "{msg}");
    }
    // The same inside a step: rank 2 brings two micro-batches, the others one.
    let mb = || LinearStack::batch(vec![0.5; 4], 4, vec![0.1; 2], 2).unwrap();
    let res = on_ranks(
        &model,
        &plan,
        cfg(adamw(1e-3, 0.0), InitSync::Verify),
        &|_| model.init_params(1),
        &|e| {
            let n = if e.rank() == 2 { 2 } else { 1 };
            let mbs: Vec<MicroBatch> = (0..n).map(|_| mb()).collect();
            e.train_step(&mbs, 1e-3).map(|_| ())
        },
    );
    for r in &res {
        let msg = r.as_ref().unwrap_err().to_string();
        assert!(msg.contains("rank 2: 2 micro-batches, others: 1"), "{msg}");
    }
    assert!(t0.elapsed() < Duration::from_secs(60), "bounded by 60 s");
}

#[test]
fn uneven_last_batch_is_weighted_by_real_samples() {
    let model = DotModel::new("uneven", &[("w", &[2])], vec![vec![1.0; 2]]);
    let plan = make_plan(
        &model,
        4,
        Strategy::FullShard,
        fsdp_planner::Optimizer::AdamW,
        1,
        GradSync::EveryMicroBatch,
    );
    let res = on_ranks(
        &model,
        &plan,
        cfg(adamw(1e-3, 0.0), InitSync::Verify),
        &|_| model.init_params(0),
        &|e| {
            let samples: Vec<usize> = match e.rank() {
                3 => vec![10],
                r => (3 * r + 1..=3 * r + 3).collect(),
            };
            let rows: Vec<Vec<f32>> = samples.iter().map(|&i| vec![i as f32; 2]).collect();
            let acc = e.accumulate(&[model.batch(&rows).unwrap()])?;
            Ok((acc.loss, e.grad_shards()?[0][0].clone()))
        },
    );
    let res: Vec<_> = res.into_iter().map(|r| r.unwrap()).collect();
    let grad = full_grad(&res.iter().map(|r| r.1.clone()).collect::<Vec<_>>());
    assert_eq!(
        &grad[..2],
        &[5.5f32, 5.5],
        "mean over the 10 real samples (not 6.25 or 4.583)"
    );
    for (loss, _) in &res {
        assert_eq!(*loss, 11.0, "reported loss is the mean over 10 samples");
    }
}

// ---------------------------------------------------------------------------------------
// Different initial weights on different ranks (https://github.com/pytorch/torchtitan/issues/166)
// ---------------------------------------------------------------------------------------

#[test]
fn different_initial_weights_are_refused_or_broadcast_from_rank_0() {
    let model = LinearStack::new(
        "lin",
        &[vec![LayerDef {
            d_in: 4,
            d_out: 2,
            bias: true,
            trainable: true,
        }]],
        false,
    );
    let sgd = Optimizer::Sgd(SgdConfig {
        lr: 0.1,
        momentum: 0.0,
        weight_decay: 0.0,
    });
    let popt = fsdp_planner::Optimizer::Sgd { momentum: 0.0 };
    let x: Vec<f32> = vec![1.0, -2.0, 0.5, 3.0, 0.25, 1.5, -1.0, 2.0];
    let y: Vec<f32> = vec![1.0, 0.0, -1.0, 2.0];
    let batch = || LinearStack::batch(x.clone(), 4, y.clone(), 2).unwrap();
    for strategy in [Strategy::NoShard, Strategy::FullShard] {
        let plan = make_plan(&model, 2, strategy, popt, 1, GradSync::EveryMicroBatch);
        // Verify: the mismatch is detected on every rank before training.
        let res = on_ranks(
            &model,
            &plan,
            cfg(sgd, InitSync::Verify),
            &|r| model.init_params(r as u64),
            &|_| Ok(()),
        );
        for r in &res {
            let msg = r.as_ref().unwrap_err().to_string();
            assert!(
                msg.contains("initial weights") && msg.contains("ranks [1]"),
                "{strategy}: {msg}"
            );
        }
        // Broadcast from rank 0: identical replicas equal to rank 0's weights, losses equal the
        // single-process run from rank 0's weights.
        let res = on_ranks(
            &model,
            &plan,
            cfg(sgd, InitSync::BroadcastFromRank0),
            &|r| model.init_params(r as u64),
            &|e| {
                let start = e.full_params()?;
                let mut losses = Vec::new();
                for _ in 0..5 {
                    losses.push(e.train_step(&[batch()], 0.1)?.loss);
                }
                Ok((start, losses))
            },
        );
        let mut reference = Reference::new(&model, model.init_params(0), sgd);
        let want: Vec<f64> = (0..5)
            .map(|_| {
                reference
                    .step(
                        &[vec![batch(), batch()]],
                        plan.shard_size as usize,
                        GradSync::EveryMicroBatch,
                        None,
                        0.1,
                    )
                    .unwrap()
            })
            .collect();
        for r in res {
            let (start, losses) = r.unwrap();
            assert_eq!(
                start,
                model.init_params(0),
                "{strategy}: every rank starts from rank 0's weights"
            );
            for (a, b) in losses.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs().max(1e-7),
                    "{strategy}: loss {a} vs reference {b}"
                );
            }
        }
    }
}

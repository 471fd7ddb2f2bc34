//! Shard-optimizer (ZeRO-1) and offload (ZeRO-Offload) executed: bitwise parity with the
//! single-process reference and with the run that keeps everything on the device, and the
//! device and host ledgers against the plan's two memories, exactly.
//!
//! The compute device is the CPU device (`Placement::Device(Device::Cpu)`): the same code path
//! as a GPU, with the flat buffers as device tensors, the offloaded state as host buffers and
//! real copies between them through the staging buffers.

use candle_core::Device;
use fsdp::memory::{LEDGER_CATEGORIES, PHASES};
use fsdp::model::Gpt;
use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::{
    EngineConfig, InitSync, MicroBatch, NonFinitePolicy, Placement, RankEngine, StagedModel,
};
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{plan, GradSync, Offload, PlanConfig, ShardPlan, Strategy};
use fsdp_types::{Bytes, DType};
use std::time::Duration;

mod common;
use common::{bits64 as bits, gpt_reference, micro_batch, shape, text, Run, B, T};

const STEPS: usize = 3;

#[derive(Clone, Copy, Debug)]
struct Case {
    strategy: Strategy,
    w: usize,
    kk: usize,
    sync: GradSync,
    pd: DType,
    offload: Option<Offload>,
    /// Compute on the CPU device (flat buffers as tensors) instead of the host placement.
    device: bool,
}

impl Case {
    fn new(strategy: Strategy, w: usize, kk: usize) -> Case {
        Case {
            strategy,
            w,
            kk,
            sync: GradSync::EveryMicroBatch,
            pd: DType::F32,
            offload: None,
            device: true,
        }
    }
}

fn ecfg() -> EngineConfig {
    EngineConfig {
        optimizer: Optimizer::AdamW(AdamWConfig {
            lr: 3e-3,
            weight_decay: 0.1,
            ..AdamWConfig::default()
        }),
        clip: None,
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    }
}

fn make_plan(model: &Gpt, c: Case) -> ShardPlan {
    let mut cfg = PlanConfig::new(c.w as u64);
    cfg.strategy = c.strategy;
    cfg.grad_accum = c.kk as u64;
    cfg.grad_sync = c.sync;
    cfg.micro_batch = B as u64;
    cfg.seq_len = T as u64;
    cfg.param_dtype = c.pd;
    cfg.offload = c.offload;
    plan(model.spec(), &cfg).unwrap()
}

fn placement(c: Case) -> Placement {
    if c.device {
        Placement::Device(Device::Cpu)
    } else {
        Placement::Host
    }
}

/// `STEPS` steps, then the gradient shards of one more accumulate; rank 0's view, after
/// checking every rank agrees on the losses.
fn run(c: Case) -> Run {
    let model = Gpt::from_preset("tiny").unwrap();
    let plan = make_plan(&model, c);
    let s = plan.shard_size as usize;
    let text = text();
    let init = StagedModel::init_params(&model, 1234);
    let results = run_threads(
        Topology::new(s, c.w / s).unwrap(),
        Duration::from_secs(60),
        |comm| {
            let mut e =
                RankEngine::new_on(&model, &plan, &comm, ecfg(), &init, placement(c)).unwrap();
            let mut losses = Vec::new();
            for step in 0..STEPS {
                let mbs: Vec<MicroBatch> = (0..c.kk)
                    .map(|k| micro_batch(&text, step, k, e.rank(), c.w, c.kk))
                    .collect();
                losses.push(e.train_step(&mbs, 3e-3).unwrap().loss);
            }
            let mbs: Vec<MicroBatch> = (0..c.kk)
                .map(|k| micro_batch(&text, STEPS, k, e.rank(), c.w, c.kk))
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
        },
    );
    let mut runs: Vec<Run> = results.into_iter().map(|r| r.unwrap()).collect();
    for r in &runs[1..] {
        assert_eq!(bits(&r.losses), bits(&runs[0].losses), "{c:?}: ranks agree");
    }
    runs.swap_remove(0)
}

fn reference(w: usize, shard: usize, kk: usize, sync: GradSync) -> Run {
    gpt_reference(STEPS, w, shard, (kk, sync), None, ecfg().optimizer)
}

/// [`common::assert_bitwise`], and the gradient shards of one more accumulation when both
/// runs have them.
fn assert_bitwise(a: &Run, b: &Run, what: &str) {
    common::assert_bitwise(a, b, what);
    if !a.grads.is_empty() && !b.grads.is_empty() {
        assert_eq!(a.grads, b.grads, "{what}: gradient shards");
    }
}

/// Shard-optimizer equals the single-process reference bit for bit at W = 1, 2, 4, with and
/// without accumulation (it reduces once per step, so with accumulation it is the reference
/// under `grad_sync = last`), on the host placement (and on the CPU device at W = 2), and
/// equals shard-grad-op under `grad_sync = last`.
#[test]
fn shard_optimizer_is_bitwise_the_reference() {
    for w in [1, 2, 4] {
        for kk in [1, 2] {
            // The CPU device at W = 2; the host placement everywhere.
            let placements: &[bool] = if w == 2 { &[false, true] } else { &[false] };
            for &device in placements {
                let mut c = Case::new(Strategy::ShardOptimizer, w, kk);
                c.device = device;
                let what = format!("shard-optimizer W={w} K={kk} device {device}");
                let e = run(c);
                let sync = if kk > 1 {
                    GradSync::LastMicroBatch
                } else {
                    GradSync::EveryMicroBatch
                };
                assert_bitwise(&e, &reference(w, w, kk, sync), &what);
                assert!(e.losses[STEPS - 1] < e.losses[0], "{what}: {:?}", e.losses);
                let mut g = Case::new(Strategy::ShardGradOp, w, kk);
                g.sync = sync;
                g.device = device;
                assert_bitwise(&e, &run(g), &format!("{what} vs shard-grad-op"));
            }
        }
    }
}

/// Offloading the optimizer (and the parameters) changes no bit: every strategy it applies to
/// (full shard at W = 1 and 2, shard-grad-op at 2, hybrid 2x2 and shard-optimizer at 4, no-shard
/// at 1), f32 and bf16 parameters, two micro-batches per step; f32 runs also equal the
/// reference.
#[test]
fn offload_is_bitwise_the_run_on_the_device() {
    let cases = [
        (Strategy::FullShard, 1),
        (Strategy::FullShard, 2),
        (Strategy::ShardGradOp, 2),
        (Strategy::Hybrid { shard_size: 2 }, 4),
        (Strategy::ShardOptimizer, 4),
        (Strategy::NoShard, 1),
    ];
    // The pairs refused, by the rule in the docs: no-shard and shard-optimizer keep the whole
    // parameters on the device all step, so there is no parameter shard to offload. (No-shard
    // runs here at W = 1, where offloading its optimizer state applies.)
    let refused = |strategy: Strategy, o: Offload| {
        o == Offload::Params && matches!(strategy, Strategy::NoShard | Strategy::ShardOptimizer)
    };
    let mut compared = Vec::new();
    for (strategy, w) in cases {
        for pd in [DType::F32, DType::BF16] {
            let mut base = Case::new(strategy, w, 2);
            base.pd = pd;
            let on_device = run(base);
            if pd == DType::F32 {
                let shard = strategy.shard_size(w as u64).unwrap() as usize;
                let sync = if strategy == Strategy::ShardOptimizer {
                    GradSync::LastMicroBatch
                } else {
                    GradSync::EveryMicroBatch
                };
                assert_bitwise(
                    &on_device,
                    &reference(w, shard, 2, sync),
                    &format!("{strategy} W={w} on the device vs reference"),
                );
            }
            for o in [Offload::Optimizer, Offload::Params] {
                let mut c = base;
                c.offload = Some(o);
                let what = format!("{strategy} W={w} {pd} --offload {o}");
                let allowed = PlanConfig {
                    offload: Some(o),
                    ..PlanConfig::new(w as u64)
                }
                .check_offload(strategy);
                if refused(strategy, o) {
                    assert!(allowed.is_err(), "{what} is refused");
                    continue;
                }
                assert!(allowed.is_ok(), "{what}: {allowed:?}");
                assert_bitwise(&run(c), &on_device, &what);
                compared.push(what);
            }
        }
    }
    // 6 strategies x 2 offloads, less no-shard and shard-optimizer with the parameters
    // offloaded, in both precisions.
    assert_eq!(compared.len(), (6 * 2 - 2) * 2, "{compared:?}");
}

/// The device ledger equals the plan's device bytes and the host ledger its host bytes, per
/// phase and category, under every strategy with and without offload; offload moves exactly
/// the planned bytes from one side to the other.
#[test]
fn device_and_host_ledgers_equal_the_plan() {
    let model = Gpt::from_preset("tiny").unwrap();
    let text = text();
    let init = StagedModel::init_params(&model, 7);
    let cases = [
        (Strategy::FullShard, 2, DType::F32, None),
        (
            Strategy::FullShard,
            2,
            DType::BF16,
            Some(Offload::Optimizer),
        ),
        (Strategy::FullShard, 2, DType::F32, Some(Offload::Params)),
        (Strategy::FullShard, 1, DType::F32, Some(Offload::Optimizer)),
        (Strategy::ShardGradOp, 4, DType::BF16, Some(Offload::Params)),
        (
            Strategy::Hybrid { shard_size: 2 },
            4,
            DType::F32,
            Some(Offload::Optimizer),
        ),
        (Strategy::ShardOptimizer, 2, DType::F32, None),
        (Strategy::ShardOptimizer, 4, DType::BF16, None),
        (
            Strategy::ShardOptimizer,
            2,
            DType::BF16,
            Some(Offload::Optimizer),
        ),
        (Strategy::NoShard, 1, DType::BF16, Some(Offload::Optimizer)),
    ];
    for (strategy, w, pd, offload) in cases {
        for kk in [1, 2] {
            let mut c = Case::new(strategy, w, kk);
            c.pd = pd;
            c.offload = offload;
            let what = format!("{strategy} W={w} K={kk} {pd} offload {offload:?}");
            let plan = make_plan(&model, c);
            let s = plan.shard_size as usize;
            let res = run_threads(
                Topology::new(s, w / s).unwrap(),
                Duration::from_secs(60),
                |comm| {
                    let mut e =
                        RankEngine::new_on(&model, &plan, &comm, ecfg(), &init, placement(c))
                            .unwrap();
                    let mut out = None;
                    for step in 0..2 {
                        let mbs: Vec<MicroBatch> = (0..kk)
                            .map(|k| micro_batch(&text, step, k, e.rank(), w, kk))
                            .collect();
                        let st = e.train_step(&mbs, 1e-3).unwrap();
                        let host: Vec<_> =
                            PHASES.iter().map(|p| e.host_ledger().peak(*p)).collect();
                        out = Some((st.ledger, host));
                    }
                    out.unwrap()
                },
            );
            for (rank, r) in res.into_iter().enumerate() {
                let (device, host) = r.unwrap();
                for (i, ph) in PHASES.iter().enumerate() {
                    let planned = plan.memory.phase(*ph);
                    for cat in LEDGER_CATEGORIES {
                        assert_eq!(
                            device[i].max.get(cat),
                            planned.max.get(cat),
                            "{what}: rank {rank} device {} {}",
                            ph.name(),
                            cat.name()
                        );
                        assert_eq!(
                            host[i].max.get(cat),
                            planned.host_max.get(cat),
                            "{what}: rank {rank} host {} {}",
                            ph.name(),
                            cat.name()
                        );
                    }
                    let planned_total = plan
                        .memory
                        .timeline
                        .iter()
                        .filter(|p| p.phase == *ph)
                        .map(|p| p.bytes.ledger_total())
                        .max()
                        .unwrap_or(Bytes(0));
                    assert_eq!(device[i].peak_total, planned_total, "{what}: rank {rank}");
                    assert_eq!(
                        host[i].peak_total, plan.memory.host_peak,
                        "{what}: rank {rank}"
                    );
                }
            }
        }
    }
}

/// Offload needs a compute device to offload from: the host placement is refused with the
/// fix.
#[test]
fn offload_on_the_host_placement_is_refused() {
    let model = Gpt::from_preset("tiny").unwrap();
    let mut c = Case::new(Strategy::FullShard, 1, 1);
    c.offload = Some(Offload::Optimizer);
    c.device = false;
    let plan = make_plan(&model, c);
    let init = StagedModel::init_params(&model, 1);
    let res = run_threads(
        Topology::new(1, 1).unwrap(),
        Duration::from_secs(60),
        |comm| {
            RankEngine::new_on(&model, &plan, &comm, ecfg(), &init, Placement::Host)
                .err()
                .map(|e| e.to_string())
        },
    );
    let msg = res.into_iter().next().unwrap().unwrap().expect("refused");
    assert!(msg.contains("offload optimizer"), "{msg}");
    assert!(msg.contains("compute device"), "{msg}");
}

/// A checkpoint's rank state moves between offloaded and device runs: an offloaded run's state
/// imported into a device run (and back) continues bit for bit as the uninterrupted run: every
/// loss, and after the last step the master shards, both moments and the full parameters.
#[test]
fn rank_state_moves_between_offloaded_and_device_runs() {
    let model = Gpt::from_preset("tiny").unwrap();
    let text = text();
    let init = StagedModel::init_params(&model, 1234);
    let w = 2;
    let base = Case::new(Strategy::FullShard, w, 1);
    let mut off = base;
    off.offload = Some(Offload::Optimizer);
    let steps = |e: &mut RankEngine<'_, Gpt>, range: std::ops::Range<usize>| -> Vec<f64> {
        range
            .map(|step| {
                let mbs = vec![micro_batch(&text, step, 0, e.rank(), w, 1)];
                e.train_step(&mbs, 3e-3).unwrap().loss
            })
            .collect()
    };
    let plan_dev = make_plan(&model, base);
    let plan_off = make_plan(&model, off);
    let topo = Topology::new(w, 1).unwrap();
    let whole = run_threads(topo, Duration::from_secs(60), |comm| {
        let mut e =
            RankEngine::new_on(&model, &plan_dev, &comm, ecfg(), &init, placement(base)).unwrap();
        let losses = steps(&mut e, 0..4);
        let flats = e.export_state().unwrap().flats;
        (losses, flats, e.full_params().unwrap())
    });
    let split = run_threads(topo, Duration::from_secs(60), |comm| {
        let mut a =
            RankEngine::new_on(&model, &plan_off, &comm, ecfg(), &init, placement(off)).unwrap();
        let mut losses = steps(&mut a, 0..2);
        let mut st = a.export_state().unwrap();
        drop(a);
        let mut b =
            RankEngine::new_on(&model, &plan_dev, &comm, ecfg(), &init, placement(base)).unwrap();
        st.plan_fingerprint = plan_dev.fingerprint().to_string();
        b.import_state(&st).unwrap();
        losses.extend(steps(&mut b, 2..3));
        let mut st = b.export_state().unwrap();
        drop(b);
        let mut c =
            RankEngine::new_on(&model, &plan_off, &comm, ecfg(), &init, placement(off)).unwrap();
        st.plan_fingerprint = plan_off.fingerprint().to_string();
        c.import_state(&st).unwrap();
        losses.extend(steps(&mut c, 3..4));
        // The last step's update used the moments the third engine imported: its state and
        // parameters after that step are the uninterrupted run's.
        let flats = c.export_state().unwrap().flats;
        (losses, flats, c.full_params().unwrap())
    });
    for (rank, (whole, split)) in whole.into_iter().zip(split).enumerate() {
        let (whole, split) = (whole.unwrap(), split.unwrap());
        assert_eq!(
            bits(&whole.0),
            bits(&split.0),
            "rank {rank}: {:?} vs {:?}",
            whole.0,
            split.0
        );
        assert_eq!(whole.1.len(), split.1.len(), "rank {rank}: flat parameters");
        for (a, b) in whole.1.iter().zip(&split.1) {
            let what = format!("rank {rank} unit {} flat {}", a.unit, a.flat);
            assert_eq!((a.unit, a.flat), (b.unit, b.flat), "{what}");
            assert_eq!(bits32(&a.param), bits32(&b.param), "{what}: master shard");
            assert_eq!(
                a.optimizer_state.len(),
                b.optimizer_state.len(),
                "{what}: optimizer state buffers"
            );
            for ((na, va), (nb, vb)) in a.optimizer_state.iter().zip(&b.optimizer_state) {
                assert_eq!(na, nb, "{what}");
                assert_eq!(bits32(va), bits32(vb), "{what}: {na}");
            }
        }
        assert_eq!(shape(&whole.2), shape(&split.2), "rank {rank}: parameters");
        let flat = |p: &[Vec<Vec<f32>>]| bits32(&p.concat().concat());
        assert_eq!(flat(&whole.2), flat(&split.2), "rank {rank}: parameters");
    }
}

fn bits32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

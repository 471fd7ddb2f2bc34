//! Memory: the engine's exact ledger of engine-owned bytes equals the plan's per-phase,
//! per-category maxima (the contract of `fsdp_planner::memory`) under every strategy, with prefetch depth 1 and 2
//! and with gradient accumulation in both sync modes. (The process heap peak is checked in
//! `engine_memory_process.rs`, alone in its binary so no concurrent test inflates it.)

use candle_core::{Device, Tensor};
use fsdp::memory::{LEDGER_CATEGORIES, PHASES};
use fsdp::model::Gpt;
use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::{EngineConfig, InitSync, MicroBatch, RankEngine, StagedModel};
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{plan, GradSync, PlanConfig, ShardPlan, Strategy};
use fsdp_types::{Bytes, DType};
use std::time::Duration;

fn batch(b: usize, t: usize, salt: usize) -> MicroBatch {
    let ids: Vec<u32> = (0..b * t)
        .map(|i| ((i * 31 + salt * 7) % 256) as u32)
        .collect();
    let tg: Vec<u32> = (0..b * t).map(|i| ((i * 17 + salt) % 256) as u32).collect();
    MicroBatch {
        input: Tensor::from_vec(ids, (b, t), &Device::Cpu).unwrap(),
        target: Tensor::from_vec(tg, (b, t), &Device::Cpu).unwrap(),
        count: (b * t) as u64,
    }
}

struct Cfg {
    preset: &'static str,
    w: usize,
    strategy: Strategy,
    k: usize,
    sync: GradSync,
    prefetch: u64,
    b: usize,
    t: usize,
    /// (param_dtype, reduce_dtype).
    dtypes: (DType, DType),
    /// `PlanConfig::activation_checkpointing`.
    ckpt: Option<bool>,
}

/// The `tiny` preset with one micro-batch of 1 x 16 tokens per rank.
fn tiny(
    w: usize,
    strategy: Strategy,
    k: usize,
    sync: GradSync,
    prefetch: u64,
    dtypes: (DType, DType),
) -> Cfg {
    Cfg {
        preset: "tiny",
        w,
        strategy,
        k,
        sync,
        prefetch,
        b: 1,
        t: 16,
        dtypes,
        ckpt: None,
    }
}

fn make(c: &Cfg) -> (Gpt, ShardPlan) {
    let model = Gpt::from_preset(c.preset).unwrap();
    let mut pc = PlanConfig::new(c.w as u64);
    pc.strategy = c.strategy;
    pc.grad_accum = c.k as u64;
    pc.grad_sync = c.sync;
    pc.prefetch = c.prefetch;
    pc.micro_batch = c.b as u64;
    pc.seq_len = c.t as u64;
    pc.param_dtype = c.dtypes.0;
    pc.reduce_dtype = c.dtypes.1;
    pc.activation_checkpointing = c.ckpt;
    let p = plan(model.spec(), &pc).unwrap();
    (model, p)
}

fn ecfg() -> EngineConfig {
    EngineConfig {
        optimizer: Optimizer::AdamW(AdamWConfig::default()),
        clip: None,
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    }
}

/// Runs 2 steps; per rank returns the ledger peaks of the last step.
fn ledger_matches_plan(c: Cfg) {
    let (model, plan) = make(&c);
    let s = plan.shard_size as usize;
    let init = model.init_params(1);
    let res = run_threads(
        Topology::new(s, c.w / s).unwrap(),
        Duration::from_secs(60),
        |comm| {
            let mut e = RankEngine::new(&model, &plan, &comm, ecfg(), &init).unwrap();
            let mut last = None;
            for step in 0..2 {
                let mbs: Vec<MicroBatch> =
                    (0..c.k).map(|k| batch(c.b, c.t, step * 10 + k)).collect();
                last = Some(e.train_step(&mbs, 1e-3).unwrap());
            }
            last.unwrap().ledger
        },
    );
    for (rank, peaks) in res.into_iter().enumerate() {
        let peaks = peaks.unwrap();
        for (i, ph) in PHASES.iter().enumerate() {
            let planned = plan.memory.phase(*ph);
            for cat in LEDGER_CATEGORIES {
                assert_eq!(
                    peaks[i].max.get(cat),
                    planned.max.get(cat),
                    "{} W={} K={} {:?} prefetch {} checkpointing {:?}: rank {rank} {} {}",
                    c.strategy,
                    c.w,
                    c.k,
                    c.sync,
                    c.prefetch,
                    c.ckpt,
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
            assert_eq!(
                peaks[i].peak_total,
                planned_total,
                "{} rank {rank} {}: ledger peak total",
                c.strategy,
                ph.name()
            );
        }
    }
}

#[test]
fn memory_ledger_equals_plan_full_shard_prefetch_1_and_2() {
    for prefetch in [1, 2] {
        ledger_matches_plan(tiny(
            2,
            Strategy::FullShard,
            1,
            GradSync::EveryMicroBatch,
            prefetch,
            (DType::F32, DType::F32),
        ));
    }
}

#[test]
fn memory_ledger_equals_plan_shard_grad_op_ddp_hybrid() {
    ledger_matches_plan(tiny(
        3,
        Strategy::ShardGradOp,
        1,
        GradSync::EveryMicroBatch,
        1,
        (DType::F32, DType::F32),
    ));
    ledger_matches_plan(tiny(
        2,
        Strategy::NoShard,
        1,
        GradSync::EveryMicroBatch,
        1,
        (DType::F32, DType::F32),
    ));
    ledger_matches_plan(tiny(
        4,
        Strategy::Hybrid { shard_size: 2 },
        1,
        GradSync::EveryMicroBatch,
        1,
        (DType::F32, DType::F32),
    ));
}

#[test]
fn memory_ledger_equals_plan_with_accumulation_sync_every_and_last() {
    ledger_matches_plan(tiny(
        2,
        Strategy::FullShard,
        3,
        GradSync::EveryMicroBatch,
        1,
        (DType::F32, DType::F32),
    ));
    ledger_matches_plan(tiny(
        2,
        Strategy::FullShard,
        3,
        GradSync::LastMicroBatch,
        1,
        (DType::F32, DType::F32),
    ));
    ledger_matches_plan(tiny(
        2,
        Strategy::ShardGradOp,
        2,
        GradSync::LastMicroBatch,
        1,
        (DType::F32, DType::F32),
    ));
}

/// Mixed precision: bf16 parameters with f32 master weights, bf16 or f32 on the wire,
/// prefetch off, 1 and 2 (overlapped gathers and reductions from 1 on), full shard and DDP,
/// and sync-last accumulation with a bf16 cast of the f32 accumulation buffer.
#[test]
fn memory_ledger_equals_plan_mixed_precision_prefetch_0_1_2() {
    for prefetch in [0, 1, 2] {
        for reduce in [DType::F32, DType::BF16] {
            ledger_matches_plan(tiny(
                2,
                Strategy::FullShard,
                1,
                GradSync::EveryMicroBatch,
                prefetch,
                (DType::BF16, reduce),
            ));
        }
    }
    ledger_matches_plan(tiny(
        2,
        Strategy::NoShard,
        1,
        GradSync::EveryMicroBatch,
        1,
        (DType::BF16, DType::BF16),
    ));
    ledger_matches_plan(tiny(
        2,
        Strategy::FullShard,
        2,
        GradSync::LastMicroBatch,
        1,
        (DType::F16, DType::BF16),
    ));
}

/// Activation checkpointing independent of the strategy: full shard and hybrid without it
/// (kept graphs, unsharded parameters still freed after forward and re-gathered for backward:
/// the same `unsharded_params` as with it), prefetch 0-2, accumulation in both sync modes,
/// bf16; shard-grad-op and DDP with it. The ledger equals the plan in every case, and the plan's
/// ledger categories do not depend on the setting (only its activations do).
#[test]
fn memory_ledger_equals_plan_with_and_without_activation_checkpointing() {
    let f32s = (DType::F32, DType::F32);
    let mut cases = Vec::new();
    for prefetch in [0, 1, 2] {
        cases.push((
            tiny(
                2,
                Strategy::FullShard,
                1,
                GradSync::EveryMicroBatch,
                prefetch,
                f32s,
            ),
            false,
        ));
    }
    cases.push((
        tiny(
            4,
            Strategy::Hybrid { shard_size: 2 },
            1,
            GradSync::EveryMicroBatch,
            1,
            f32s,
        ),
        false,
    ));
    cases.push((
        tiny(
            2,
            Strategy::FullShard,
            3,
            GradSync::EveryMicroBatch,
            1,
            f32s,
        ),
        false,
    ));
    cases.push((
        tiny(
            2,
            Strategy::FullShard,
            2,
            GradSync::LastMicroBatch,
            1,
            (DType::BF16, DType::BF16),
        ),
        false,
    ));
    cases.push((
        tiny(
            2,
            Strategy::FullShard,
            1,
            GradSync::EveryMicroBatch,
            1,
            (DType::BF16, DType::F32),
        ),
        false,
    ));
    cases.push((
        tiny(
            3,
            Strategy::ShardGradOp,
            1,
            GradSync::EveryMicroBatch,
            1,
            f32s,
        ),
        true,
    ));
    cases.push((
        tiny(2, Strategy::NoShard, 2, GradSync::LastMicroBatch, 1, f32s),
        true,
    ));
    cases.push((
        tiny(
            2,
            Strategy::NoShard,
            1,
            GradSync::EveryMicroBatch,
            1,
            (DType::BF16, DType::BF16),
        ),
        true,
    ));
    for (mut c, ckpt) in cases {
        c.ckpt = Some(ckpt);
        let (_, with) = make(&c);
        c.ckpt = Some(!ckpt);
        let (_, without) = make(&c);
        assert_eq!(with.schedule.activation_checkpointing, ckpt);
        for (a, b) in with.memory.timeline.iter().zip(&without.memory.timeline) {
            assert_eq!(
                a.bytes.ledger_total(),
                b.bytes.ledger_total(),
                "{}: {}",
                c.strategy,
                a.label
            );
        }
        c.ckpt = Some(ckpt);
        ledger_matches_plan(c);
    }
}

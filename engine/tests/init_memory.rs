//! The process heap peak while four rank threads build their initial shards (a seeded random
//! initialisation, and a load of published weights) against the plan's initialisation bytes
//! ([`fsdp_planner::ShardPlan::init_bytes`]): the plan is never exceeded and at most 10% above
//! what was measured, and no rank ever holds the whole model (the bytes above the model states
//! stay under a quarter of the model's). One test in this binary, so no concurrent test shares the allocator.

use fsdp::init::{FileWeights, ParamSource};
use fsdp::memory::CountingAllocator;
use fsdp::model::decoder::Decoder;
use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::{EngineConfig, InitSync, Placement, RankEngine, StagedModel};
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{plan, PlanConfig, Strategy};
use fsdp_types::Bytes;
use std::time::Duration;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

const W: usize = 4;

/// Heap bytes allocated above the starting point while every rank builds its engine from
/// `source` (the engines are then dropped).
fn build_peak(model: &Decoder, p: &fsdp_planner::ShardPlan, source: &dyn ParamSource) -> u64 {
    let cfg = EngineConfig {
        optimizer: Optimizer::AdamW(AdamWConfig::default()),
        clip: None,
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    };
    let s = p.shard_size as usize;
    let before = ALLOC.current();
    ALLOC.reset_peak();
    let res = run_threads(
        Topology::new(s, W / s).unwrap(),
        Duration::from_secs(120),
        |comm| {
            let mut e =
                RankEngine::new_from(model, p, &comm, cfg, source, Placement::Host).unwrap();
            // A collective: every engine is alive at once before any is dropped.
            e.check_batch_counts(1).unwrap();
            e.ledger().live_total().0
        },
    );
    for r in res {
        r.unwrap();
    }
    ALLOC.peak() - before
}

#[test]
fn initialising_and_loading_stay_within_the_plan_and_never_hold_the_model() {
    let model = Decoder::from_preset("mini").unwrap();
    let whole_model_bytes = 4 * model.spec().numel().0;
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("model.safetensors");
    {
        let values = StagedModel::init_params(&model, 5);
        let tensors: Vec<fsdp_checkpoints::FullTensor> = model
            .spec()
            .units
            .iter()
            .zip(&values)
            .flat_map(|(u, v)| {
                u.params
                    .iter()
                    .filter(|p| p.tied_to.is_none())
                    .zip(v)
                    .map(|(p, t)| fsdp_checkpoints::FullTensor {
                        name: p.name.clone(),
                        shape: p.shape.clone(),
                        data: t.clone(),
                    })
            })
            .collect();
        fsdp_checkpoints::write_full(&file, &tensors, &[]).unwrap();
    }
    let mut bad = Vec::new();
    for strategy in [
        Strategy::FullShard,
        Strategy::ShardGradOp,
        Strategy::Hybrid { shard_size: 2 },
    ] {
        let mut cfg = PlanConfig::new(W as u64);
        cfg.strategy = strategy;
        let p = plan(model.spec(), &cfg).unwrap();
        let random = model.random_init(5);
        let weights = FileWeights::open(&file, model.spec()).unwrap();
        for (what, source) in [
            ("random", &random as &dyn ParamSource),
            ("load", &weights as &dyn ParamSource),
        ] {
            let planned = W as u64 * p.init_bytes(Bytes(source.staging_bytes()), false).0;
            let states = W as u64 * p.memory.model_states.0;
            let measured = build_peak(&model, &p, source);
            let ratio = measured as f64 / planned as f64;
            // Above the model states, what a rank holds in transit.
            let transit = measured.saturating_sub(states) / W as u64;
            println!(
                "{what} {strategy} W={W}: measured {measured} B, plan {planned} B (ratio {ratio:.3}); in transit per rank {transit} B, whole model {whole_model_bytes} B"
            );
            if !(0.9..=1.0).contains(&ratio) || measured < states {
                bad.push(format!("{what} {strategy}: ratio {ratio:.3}"));
            }
            if transit * 4 > whole_model_bytes {
                bad.push(format!(
                    "{what} {strategy}: {transit} B in transit per rank, the whole model is {whole_model_bytes} B"
                ));
            }
        }
    }
    assert!(bad.is_empty(), "{bad:?}");
}

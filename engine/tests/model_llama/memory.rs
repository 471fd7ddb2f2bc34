//! Memory: the engine's ledger of engine-owned bytes equals the plan's per-phase,
//! per-category maxima for a Llama (model states, unsharded parameters and gradients,
//! staging) under full shard with prefetch 1 and 2, shard-grad-op, DDP, hybrid 2x2 and bf16,
//! as for the GPT (`engine_memory.rs`). The planner's Llama activation estimate is compared
//! with the process peak in `engine_memory_process.rs` (within 10%, as the GPT's).

use crate::parity::small_llama;
use fsdp::memory::{LEDGER_CATEGORIES, PHASES};
use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::{EngineConfig, InitSync, RankEngine, StagedModel};
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{plan, PlanConfig, Strategy};
use fsdp_types::DType;
use std::time::Duration;

fn ledger_matches_plan(w: usize, strategy: Strategy, prefetch: u64, dtype: DType) {
    let model = small_llama();
    let mut pc = PlanConfig::new(w as u64);
    pc.strategy = strategy;
    pc.prefetch = prefetch;
    pc.micro_batch = crate::common::B as u64;
    pc.seq_len = crate::common::T as u64;
    pc.param_dtype = dtype;
    let plan = plan(model.spec(), &pc).unwrap();
    let s = plan.shard_size as usize;
    let init = StagedModel::init_params(&model, 1);
    let text = crate::common::text();
    let ecfg = EngineConfig {
        optimizer: Optimizer::AdamW(AdamWConfig::default()),
        clip: None,
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    };
    let res = run_threads(
        Topology::new(s, w / s).unwrap(),
        Duration::from_secs(60),
        |comm| {
            let mut e = RankEngine::new(&model, &plan, &comm, ecfg, &init).unwrap();
            let mut last = None;
            for step in 0..2 {
                let mb = crate::common::micro_batch(&text, step, 0, e.rank(), w, 1);
                last = Some(e.train_step(&[mb], 1e-3).unwrap());
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
                    "{strategy} W={w} prefetch {prefetch} {dtype}: rank {rank} {} {}",
                    ph.name(),
                    cat.name()
                );
            }
        }
    }
}

#[test]
fn llama_memory_ledger_equals_plan() {
    for prefetch in [1, 2] {
        ledger_matches_plan(2, Strategy::FullShard, prefetch, DType::F32);
    }
    ledger_matches_plan(3, Strategy::ShardGradOp, 1, DType::F32);
    ledger_matches_plan(2, Strategy::NoShard, 1, DType::F32);
    ledger_matches_plan(4, Strategy::Hybrid { shard_size: 2 }, 1, DType::F32);
    ledger_matches_plan(2, Strategy::FullShard, 1, DType::BF16);
}

//! A shard-optimizer (ZeRO-1) plan is planned by `fsdp plan` but not executed by this engine:
//! `RankEngine::new` refuses it with `EngineError::Config` naming the strategy, on every rank,
//! before any collective (so no rank waits on another), never a panic.

use fsdp::model::Gpt;
use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::{EngineConfig, InitSync, RankEngine, StagedModel};
use fsdp::EngineError;
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{plan, PlanConfig, Strategy};
use std::time::Duration;

#[test]
fn engine_refuses_a_shard_optimizer_plan_with_a_clear_error() {
    let model = Gpt::from_preset("tiny").unwrap();
    let mut pc = PlanConfig::new(2);
    pc.strategy = Strategy::ShardOptimizer;
    pc.seq_len = 16;
    let p = plan(model.spec(), &pc).unwrap();
    assert_eq!(p.shard_size, 2);
    let init = model.init_params(1);
    let res = run_threads(
        Topology::new(2, 1).unwrap(),
        Duration::from_secs(30),
        |comm| {
            let cfg = EngineConfig {
                optimizer: Optimizer::AdamW(AdamWConfig::default()),
                clip: None,
                init_sync: InitSync::Verify,
                enforce_memory_plan: true,
                nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
                max_consecutive_skips: None,
            };
            match RankEngine::new(&model, &p, &comm, cfg, &init) {
                Ok(_) => None,
                Err(e) => Some((matches!(e, EngineError::Config(_)), e.to_string())),
            }
        },
    );
    assert_eq!(res.len(), 2);
    for (rank, r) in res.into_iter().enumerate() {
        let (is_config, msg) = r.unwrap().expect("the engine must refuse shard-optimizer");
        assert!(is_config, "rank {rank}: {msg}");
        assert!(
            msg.contains("shard-optimizer") && msg.contains("does not execute"),
            "rank {rank}: {msg}"
        );
    }
}

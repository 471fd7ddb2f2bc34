//! Gradient accumulation with reduction only on the last micro-batch keeps unsharded gradients
//! on every rank (<https://github.com/meta-pytorch/tnt/pull/1057>); the plan must say so.
//! 8 x Linear(1024, 1024) without bias (8,388,608 f32 parameters), Adam, W = 8, K = 4
//! micro-batches.

use fsdp_planner::{
    plan, Architecture, GradSync, ModelSpec, ParamSpec, Phase, PlanConfig, UnitSpec,
};

fn plan_with_sync(sync: GradSync) -> fsdp_planner::ShardPlan {
    let spec = ModelSpec {
        name: "accum".into(),
        units: (0..8)
            .map(|i| UnitSpec {
                name: format!("l{i}"),
                params: vec![ParamSpec::new(format!("l{i}.weight"), &[1024, 1024])],
            })
            .collect(),
        arch: Architecture::Generic,
    };
    let mut cfg = PlanConfig::new(8);
    cfg.grad_accum = 4;
    cfg.grad_sync = sync;
    plan(&spec, &cfg).unwrap()
}

#[test]
fn sync_every_micro_batch_keeps_gradients_sharded() {
    let p = plan_with_sync(GradSync::EveryMicroBatch);
    assert_eq!(GradSync::default(), GradSync::EveryMicroBatch);
    let b = p.memory.phase(Phase::Backward);
    assert_eq!(b.max.grad_shards.0, 4_194_304);
    assert_eq!(b.max.optimizer_state.0, 8_388_608);
    // Transient unsharded gradients: two layers (8 MiB, the case's bound): one layer's
    // reduce-scatter is in flight while the next layer's gradient is gathered (prefetch 1).
    assert_eq!(b.max.unsharded_grads.0, 8_388_608);
    assert!(b.max.unsharded_grads.0 <= 8 << 20);
    assert_eq!(p.memory.phase(Phase::Forward).max.unsharded_grads.0, 0);
    assert_eq!(
        p.memory.phase(Phase::OptimizerStep).max.unsharded_grads.0,
        0
    );
    // Every micro-batch reduce-scatters: staging in micro-batch 0 too.
    assert!(p
        .memory
        .timeline
        .iter()
        .any(|t| t.micro_batch == 0 && t.bytes.staging.0 == 524_288));
}

#[test]
fn sync_last_micro_batch_states_unsharded_gradients() {
    let every = plan_with_sync(GradSync::EveryMicroBatch);
    let last = plan_with_sync(GradSync::LastMicroBatch);
    for ph in [Phase::Forward, Phase::Backward] {
        let m = last.memory.phase(ph).max;
        assert_eq!(m.unsharded_grads.0, 33_554_432, "{ph}");
        assert_eq!(m.grad_shards.0, 4_194_304);
    }
    // Eight layers against the every-micro-batch transient of two (one computing, one being
    // reduced), and a higher peak: the bug signature (same gradient memory in both modes)
    // cannot appear.
    assert_eq!(
        last.memory.phase(Phase::Backward).max.unsharded_grads.0,
        4 * every.memory.phase(Phase::Backward).max.unsharded_grads.0
    );
    assert!(last.memory.peak > every.memory.peak);
    // No reduce-scatter before the last micro-batch.
    assert!(last
        .memory
        .timeline
        .iter()
        .filter(|t| t.micro_batch == 0)
        .all(|t| t.bytes.staging.0 == 0));
    assert_ne!(every.fingerprint(), last.fingerprint());
}

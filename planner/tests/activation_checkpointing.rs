//! `PlanConfig::activation_checkpointing`: unit-level activation checkpointing as a setting of
//! its own, independent of the strategy's resharding. It changes the activation estimate (and
//! so the peak), the schedule's flag, the table, the JSON and the fingerprint; it leaves the
//! layout, the alive sets, the prefetches, the reductions and every ledger category alone.

use fsdp_planner::config::default_activation_checkpointing;
use fsdp_planner::{plan, preset, report, PlanConfig, ShardPlan, Strategy};
use fsdp_types::DType;

fn mini(strategy: Strategy, ckpt: Option<bool>) -> ShardPlan {
    let mut c = PlanConfig::new(2);
    c.strategy = strategy;
    c.micro_batch = 8;
    c.seq_len = 128;
    c.activation_checkpointing = ckpt;
    plan(&preset("mini").unwrap(), &c).unwrap()
}

/// Everything but the activations of every timeline point, and the schedule without its flag.
fn same_but_activations(a: &ShardPlan, b: &ShardPlan, what: &str) {
    assert_eq!(a.units, b.units, "{what}: layout");
    assert_eq!(a.schedule.forward, b.schedule.forward, "{what}: forward");
    assert_eq!(a.schedule.backward, b.schedule.backward, "{what}: backward");
    assert_eq!(
        a.schedule.reshard_after_forward, b.schedule.reshard_after_forward,
        "{what}"
    );
    assert_eq!(a.memory.timeline.len(), b.memory.timeline.len(), "{what}");
    for (x, y) in a.memory.timeline.iter().zip(&b.memory.timeline) {
        let (mut bx, mut by) = (x.bytes, y.bytes);
        bx.activations = fsdp_types::Bytes(0);
        by.activations = fsdp_types::Bytes(0);
        assert_eq!(bx, by, "{what}: ledger bytes at {} {}", x.phase, x.label);
    }
    assert_eq!(a.memory.model_states, b.memory.model_states, "{what}");
}

/// The default is FSDP2's: off for every strategy (resharding after forward frees parameters
/// only; recompute is opt-in). `Some(true)` on full shard is the plan every full-shard plan was
/// before the setting existed, fingerprint included (pinned below from commit 440001c's
/// planner, whose full-shard default recomputed).
#[test]
fn defaults_are_off_and_explicit_on_is_the_old_full_shard() {
    for s in [
        Strategy::FullShard,
        Strategy::Hybrid { shard_size: 2 },
        Strategy::ShardGradOp,
        Strategy::NoShard,
    ] {
        assert!(!default_activation_checkpointing(s), "{s}");
    }
    assert!(
        !mini(Strategy::FullShard, None)
            .schedule
            .activation_checkpointing
    );
    assert!(
        !mini(Strategy::ShardGradOp, None)
            .schedule
            .activation_checkpointing
    );
    assert!(
        !mini(Strategy::NoShard, None)
            .schedule
            .activation_checkpointing
    );
    // An explicit setting equal to the default is the default plan, fingerprint included.
    for s in [Strategy::FullShard, Strategy::ShardGradOp] {
        let d = mini(s, None);
        let e = mini(s, Some(false));
        assert_eq!(d.fingerprint, e.fingerprint, "{s}");
        assert_eq!(d.memory, e.memory, "{s}");
    }
    let mut c = PlanConfig::new(2);
    c.micro_batch = 4;
    c.seq_len = 128;
    c.param_dtype = DType::BF16;
    c.activation_checkpointing = Some(true);
    let p = plan(&preset("mini").unwrap(), &c).unwrap();
    assert_eq!(
        p.fingerprint,
        "f998eadc69f55a3a9c7d6e14ff431d6cec410df2fb92189b52a14375aa7d9a25"
    );
    c.activation_checkpointing = None;
    let q = plan(&preset("mini").unwrap(), &c).unwrap();
    assert_ne!(q.fingerprint, p.fingerprint);
}

/// Full shard without checkpointing: the unsharded parameters of full shard, the activations
/// of shard-grad-op (every graph kept), point by point; a bigger peak; its own fingerprint.
#[test]
fn full_shard_without_checkpointing_keeps_graphs_not_parameters() {
    let on = mini(Strategy::FullShard, Some(true));
    let off = mini(Strategy::FullShard, None);
    let sgo = mini(Strategy::ShardGradOp, None);
    assert!(!off.schedule.activation_checkpointing);
    assert!(off.schedule.reshard_after_forward);
    same_but_activations(&on, &off, "full shard on/off");
    for (x, y) in off.memory.timeline.iter().zip(&sgo.memory.timeline) {
        assert_eq!(x.bytes.activations, y.bytes.activations, "{}", x.label);
    }
    // Activations grow, parameters do not: the peak is between full shard's and SGO's.
    assert!(off.memory.peak > on.memory.peak);
    assert!(off.memory.peak < sgo.memory.peak);
    let fwd = |p: &ShardPlan| p.memory.phase(fsdp_planner::Phase::Forward).max;
    assert_eq!(fwd(&off).unsharded_params, fwd(&on).unsharded_params);
    assert!(fwd(&off).unsharded_params < fwd(&sgo).unsharded_params);
    assert!(fwd(&off).activations > fwd(&on).activations);
    assert_ne!(on.fingerprint, off.fingerprint);
}

/// Shard-grad-op and DDP with checkpointing: their parameters, full shard's activations.
#[test]
fn shard_grad_op_and_ddp_with_checkpointing_recompute() {
    let fs = mini(Strategy::FullShard, Some(true));
    for s in [Strategy::ShardGradOp, Strategy::NoShard] {
        let off = mini(s, None);
        let on = mini(s, Some(true));
        assert!(on.schedule.activation_checkpointing);
        same_but_activations(&off, &on, &format!("{s}"));
        for (x, y) in on.memory.timeline.iter().zip(&fs.memory.timeline) {
            assert_eq!(x.bytes.activations, y.bytes.activations, "{s}: {}", x.label);
        }
        assert!(on.memory.peak < off.memory.peak, "{s}");
        assert_ne!(on.fingerprint, off.fingerprint, "{s}");
    }
}

/// The table names the setting, the JSON carries it resolved (strategy and schedule) and, when
/// given, in the config.
#[test]
fn table_and_json_name_the_setting() {
    let on = mini(Strategy::FullShard, Some(true));
    let off = mini(Strategy::FullShard, None);
    let t_on = report::render_table(&on, None);
    let t_off = report::render_table(&off, None);
    assert!(
        t_on.contains("reshard after forward; activation checkpointing (unit inputs kept"),
        "{t_on}"
    );
    assert!(
        t_off.contains("reshard after forward; no activation checkpointing (graphs kept"),
        "{t_off}"
    );
    let j_on = report::render_json(&on, None);
    let j_off = report::render_json(&off, None);
    assert_eq!(j_on["strategy"]["activation_checkpointing"], true);
    assert_eq!(j_off["strategy"]["activation_checkpointing"], false);
    assert_eq!(j_off["schedule"]["activation_checkpointing"], false);
    assert!(j_off["config"].get("activation_checkpointing").is_none());
    assert_eq!(j_on["config"]["activation_checkpointing"], true);
    // Mixed precision changes nothing of this: bf16 off vs on differ only in activations.
    let mut c = PlanConfig::new(4);
    c.param_dtype = DType::BF16;
    c.strategy = Strategy::Hybrid { shard_size: 2 };
    c.activation_checkpointing = Some(true);
    let a = plan(&preset("mini").unwrap(), &c).unwrap();
    c.activation_checkpointing = None;
    let b = plan(&preset("mini").unwrap(), &c).unwrap();
    same_but_activations(&a, &b, "hybrid bf16");
    assert!(b.memory.peak > a.memory.peak);
}

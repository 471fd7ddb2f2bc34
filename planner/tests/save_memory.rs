//! The `save` phase of the memory plan: a checkpoint save holds the model states left after
//! the optimizer step plus the one buffer a rank file streams through; an asynchronous save
//! (`ckpt_async`) also holds, in host memory at every point, a staging copy of the master and
//! optimizer-state shards and its writer's buffer. Neither changes the plan's fingerprint.
//!
//! The spec: unit `a` with a trainable 64 x 8 matrix and 8-vector (one flat parameter of 520
//! elements), unit `b` with a frozen 100-vector; W = 2, full shard, alignment 1, AdamW. Shards:
//! 260 trainable and 50 frozen elements per rank, so (bytes per rank) master 4 x 310 = 1,240,
//! gradient 4 x 260 = 1,040, AdamW 8 x 260 = 2,080; the largest shard is 260 elements, so the
//! save buffer is 4 x 260 = 1,040 bytes (below the 4 MiB bound).

use fsdp_planner::report::render_json;
use fsdp_planner::{plan, Architecture, ModelSpec, ParamSpec, Phase, PlanConfig, UnitSpec};

fn spec() -> ModelSpec {
    let mut c = ParamSpec::new("c", &[100]);
    c.trainable = false;
    ModelSpec {
        name: "save".into(),
        arch: Architecture::Generic,
        units: vec![
            UnitSpec {
                name: "a".into(),
                params: vec![ParamSpec::new("w", &[64, 8]), ParamSpec::new("b", &[8])],
            },
            UnitSpec {
                name: "b".into(),
                params: vec![c],
            },
        ],
    }
}

#[test]
fn a_save_holds_the_model_states_and_one_buffer() {
    let cfg = PlanConfig::new(2);
    let p = plan(&spec(), &cfg).unwrap();
    let save = p.memory.phase(Phase::Save);
    assert_eq!(save.at_peak.param_shards.0, 1_240);
    assert_eq!(save.at_peak.grad_shards.0, 1_040);
    assert_eq!(save.at_peak.optimizer_state.0, 2_080);
    assert_eq!(save.at_peak.staging.0, 1_040, "the save buffer");
    assert_eq!(save.at_peak.unsharded_params.0, 0);
    assert_eq!(save.peak_total.0, 1_240 + 1_040 + 2_080 + 1_040);
    assert_eq!(fsdp_planner::memory::save_buffer_bytes(&p.units), 1_040);
    assert_eq!(
        p.memory.host_peak.0, 0,
        "a synchronous save holds nothing on the host"
    );
    // The save phase is in the JSON, the async setting is not.
    let j = render_json(&p, None);
    assert_eq!(j["memory"]["phases"]["save"]["peak_total"], 5_400);
    assert!(j["config"].get("ckpt_async").is_none(), "{}", j["config"]);
    // The text report shows a save column.
    let t = fsdp_planner::report::render_table(&p, None);
    assert!(t.contains("optimizer_step           save"), "{t}");
}

#[test]
fn an_async_save_holds_a_staging_copy_in_host_memory_and_keeps_the_fingerprint() {
    let sync = plan(&spec(), &PlanConfig::new(2)).unwrap();
    let mut cfg = PlanConfig::new(2);
    cfg.ckpt_async = true;
    let p = plan(&spec(), &cfg).unwrap();
    // Master 1,240 + AdamW 2,080 + the writer's buffer 1,040.
    let staging = 1_240 + 2_080 + 1_040;
    assert_eq!(
        fsdp_planner::memory::async_checkpoint_bytes(&p.units, &p.config),
        staging
    );
    assert_eq!(p.memory.host_peak.0, staging);
    for t in &p.memory.timeline {
        assert_eq!(t.host.staging.0, staging, "host bytes at every point");
        assert_eq!(t.host.total().0, staging);
    }
    for ph in [
        Phase::Forward,
        Phase::Backward,
        Phase::OptimizerStep,
        Phase::Save,
    ] {
        assert_eq!(p.memory.phase(ph).host_max.staging.0, staging, "{ph}");
        assert_eq!(p.memory.phase(ph).at_peak, sync.memory.phase(ph).at_peak);
    }
    assert_eq!(
        p.memory.peak, sync.memory.peak,
        "the device side is unchanged"
    );
    assert_eq!(p.fingerprint(), sync.fingerprint());
    let j = render_json(&p, None);
    assert_eq!(j["config"]["ckpt_async"], true);
    assert_eq!(j["memory"]["host_peak"], staging);
}

//! Frozen parameters in the same unit as trainable ones get no gradient or optimizer bytes
//! (mixing them made gradient memory as large as if nothing were frozen:
//! <https://github.com/pytorch/pytorch/pull/104967>; freezing by lr = 0 under ZeRO still allocated
//! both: <https://github.com/deepspeedai/DeepSpeed/issues/2615>). 10 x Linear(1000, 1000)
//! with bias; layers 0-8 frozen, layer 9 trainable; layers 8 and 9 share a unit; W = 4; AdamW.

use fsdp_planner::{plan, Architecture, ModelSpec, ParamSpec, Phase, PlanConfig, UnitSpec};

fn linear(i: usize, trainable: bool) -> Vec<ParamSpec> {
    let mut w = ParamSpec::new(format!("l{i}.weight"), &[1000, 1000]);
    let mut b = ParamSpec::new(format!("l{i}.bias"), &[1000]);
    w.trainable = trainable;
    b.trainable = trainable;
    vec![w, b]
}

fn frozen_spec() -> ModelSpec {
    let mut units: Vec<UnitSpec> = (0..8)
        .map(|i| UnitSpec {
            name: format!("l{i}"),
            params: linear(i, false),
        })
        .collect();
    let mut mixed = linear(8, false);
    mixed.extend(linear(9, true));
    units.push(UnitSpec {
        name: "l8_9".into(),
        params: mixed,
    });
    ModelSpec {
        name: "frozen".into(),
        units,
        arch: Architecture::Generic,
    }
}

#[test]
fn frozen_params_get_no_grad_or_optimizer_bytes() {
    let spec = frozen_spec();
    assert_eq!(spec.numel().0, 10_010_000);
    assert_eq!(spec.trainable_numel().0, 1_001_000);
    let p = plan(&spec, &PlanConfig::new(4)).unwrap();
    let o = p.memory.phase(Phase::OptimizerStep).at_peak;
    assert_eq!(o.param_shards.0, 10_010_000);
    assert_eq!(o.grad_shards.0, 1_001_000);
    assert_eq!(o.optimizer_state.0, 2_002_000);
    let b = p.memory.phase(Phase::Backward).max;
    assert_eq!(b.grad_shards.0, 1_001_000);
    // Only layer 9's flat gradient is ever unsharded: 1,001,000 f32.
    assert_eq!(b.unsharded_grads.0, 4_004_000);
    assert_eq!(b.staging.0, 1_001_000);
}

#[test]
fn mixed_unit_splits_into_trainable_and_frozen_flat_params() {
    let p = plan(&frozen_spec(), &PlanConfig::new(4)).unwrap();
    let u = &p.units[8];
    assert_eq!(u.flat_params.len(), 2);
    assert!(u.flat_params[0].trainable && !u.flat_params[1].trainable);
    let names = |i: usize| -> Vec<&str> {
        u.flat_params[i]
            .segments
            .iter()
            .map(|s| s.name.as_str())
            .collect()
    };
    assert_eq!(names(0), ["l9.weight", "l9.bias"]);
    assert_eq!(names(1), ["l8.weight", "l8.bias"]);
    // Frozen-only units are never reduce-scattered; the mixed one is, once.
    let rs: Vec<usize> = p
        .schedule
        .backward
        .iter()
        .filter(|s| s.reduce_scatter)
        .map(|s| s.unit)
        .collect();
    assert_eq!(rs, vec![8]);
    // Weight decay spans: the trainable shard spans mark only the weight.
    assert!(u.flat_params[0]
        .shard_spans(0)
        .iter()
        .all(|s| s.weight_decay));
    let last = u.flat_params[0].shard_spans(3);
    assert_eq!(last.len(), 2);
    assert!(last[0].weight_decay && !last[1].weight_decay);
    assert_eq!(last[1].range.end - last[1].range.start, 1000);
}

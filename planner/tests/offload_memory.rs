//! The two memories of an offloaded plan (ZeRO-Offload, Ren et al. 2021): which bytes move
//! from the device to the host, exactly, against plans without offload, and the refusals.

use fsdp_planner::report::{render_json, render_svg, render_table};
use fsdp_planner::{
    plan, Architecture, Category, ModelSpec, Offload, ParamSpec, Phase, PlanConfig, Strategy,
    UnitSpec,
};
use fsdp_types::{Bytes, DType};

/// Units b0 [10], b1 [10] and a tied root [6,5]: padded 10 + 10 + 30 = 50 for S = 2, shards
/// of 5, 5 and 15 elements.
fn chain() -> ModelSpec {
    let mut units: Vec<UnitSpec> = (0..2)
        .map(|i| UnitSpec {
            name: format!("b{i}"),
            params: vec![ParamSpec::new(format!("b{i}.w"), &[10])],
        })
        .collect();
    let mut t = ParamSpec::new("lm_head.weight", &[6, 5]);
    t.tied_to = Some("wte".into());
    units.push(UnitSpec {
        name: "root".into(),
        params: vec![ParamSpec::new("wte", &[6, 5]), t],
    });
    ModelSpec {
        name: "chain".into(),
        units,
        arch: Architecture::Generic,
    }
}

fn cfg(w: u64, s: Strategy, offload: Option<Offload>) -> PlanConfig {
    let mut c = PlanConfig::new(w);
    c.strategy = s;
    c.param_dtype = DType::BF16;
    c.grad_accum = 2;
    c.offload = offload;
    c
}

const STATES: [Category; 3] = [
    Category::ParamShards,
    Category::GradShards,
    Category::OptimizerState,
];

#[test]
fn offload_moves_exactly_the_model_states_to_the_host() {
    for s in [
        Strategy::FullShard,
        Strategy::ShardGradOp,
        Strategy::ShardOptimizer,
    ] {
        let base = plan(&chain(), &cfg(2, s, None)).unwrap();
        for o in [Offload::Optimizer, Offload::Params] {
            if s == Strategy::ShardOptimizer && o == Offload::Params {
                continue;
            }
            let p = plan(&chain(), &cfg(2, s, Some(o))).unwrap();
            assert_eq!(p.memory.timeline.len(), base.memory.timeline.len());
            // Host: f32 master 4*25, f32 gradient shards 4*25, AdamW 8*25, and the staging
            // buffers: the root's 15-element shard in bf16 (parameters) and f32 (gradients).
            let host_expect = [100u64, 100, 200];
            for (a, b) in p.memory.timeline.iter().zip(&base.memory.timeline) {
                let at = format!("{s} {o} {:?} {}", a.phase, a.label);
                for (c, v) in STATES.iter().zip(host_expect) {
                    assert_eq!(a.host.get(*c).0, v, "{at} {}", c.name());
                    assert_eq!(b.bytes.get(*c).0, v, "{at} {}", c.name());
                    assert_eq!(a.bytes.get(*c).0, 0, "{at} {}", c.name());
                }
                assert_eq!(a.host.staging.0, 90, "{at}");
                assert_eq!(a.host.total().0, 490, "{at}");
                // The device keeps the bf16 parameter shards (2*25) under `optimizer` only.
                let lp = if o == Offload::Optimizer { 50 } else { 0 };
                assert_eq!(a.bytes.param_shards_low_precision.0, lp, "{at}");
                // Everything else on the device is unchanged.
                for c in [
                    Category::UnshardedParams,
                    Category::UnshardedGrads,
                    Category::Staging,
                    Category::Activations,
                ] {
                    assert_eq!(a.bytes.get(c), b.bytes.get(c), "{at} {}", c.name());
                }
            }
            assert_eq!(p.memory.host_peak.0, 490);
            for ph in [Phase::Forward, Phase::Backward, Phase::OptimizerStep] {
                assert_eq!(p.memory.phase(ph).host_max.total().0, 490);
            }
            assert_eq!(
                p.memory.peak + Bytes(400),
                base.memory.peak + Bytes(if o == Offload::Optimizer { 50 } else { 0 })
            );
            assert_ne!(p.fingerprint, base.fingerprint);
        }
        assert_eq!(base.memory.host_peak.0, 0);
    }
}

#[test]
fn offloaded_at_one_rank_in_f32_the_device_holds_a_gathered_copy() {
    // One shard of f32 master weights on the device is the parameter itself (no copy);
    // offloaded, the device's parameters are a copy made for each unit as it is needed.
    let mut c = cfg(1, Strategy::FullShard, None);
    c.param_dtype = DType::F32;
    let base = plan(&chain(), &c).unwrap();
    assert_eq!(base.memory.phase(Phase::Forward).max.unsharded_params.0, 0);
    for (o, lp) in [(Offload::Optimizer, 200), (Offload::Params, 0)] {
        c.offload = Some(o);
        let p = plan(&chain(), &c).unwrap();
        let f = p.memory.phase(Phase::Forward).max;
        assert_eq!(f.param_shards_low_precision.0, lp, "{o}");
        // Forward with prefetch 1 holds b0 computing, b1 prefetched and the root (alive from
        // its first use to its last): 50 f32 elements.
        assert_eq!(f.unsharded_params.0, 200, "{o}");
    }
}

#[test]
fn offload_none_spelled_out_keeps_the_fingerprint() {
    let a = plan(&chain(), &cfg(2, Strategy::FullShard, None)).unwrap();
    let b = plan(&chain(), &cfg(2, Strategy::FullShard, Some(Offload::None))).unwrap();
    assert_eq!(a.fingerprint, b.fingerprint);
    assert_eq!(a.memory, b.memory);
    // And the JSON of a plan without offload has no host fields.
    let j = render_json(&a, None).to_string();
    assert!(!j.contains("host"), "{j}");
    let p = plan(
        &chain(),
        &cfg(2, Strategy::FullShard, Some(Offload::Optimizer)),
    )
    .unwrap();
    let j = render_json(&p, None);
    assert_eq!(j["memory"]["host_peak"], 490);
    assert_eq!(j["config"]["offload"], "optimizer");
    assert_eq!(j["memory"]["timeline"][0]["host"]["optimizer_state"], 200);
    assert_eq!(j["memory"]["phases"]["backward"]["host_max"]["staging"], 90);
    let t = render_table(&p, None);
    assert!(t.contains("device memory per rank"), "{t}");
    assert!(
        t.contains("host       490 B per rank in host memory"),
        "{t}"
    );
    let svg = render_svg(&p);
    assert!(
        svg.contains("host memory per rank (--offload optimizer): 490 B"),
        "{svg}"
    );
    assert!(
        svg.contains("<title>host optimizer_state: 200 B</title>"),
        "{svg}"
    );
}

#[test]
fn offload_that_makes_no_sense_is_refused() {
    let e = plan(
        &chain(),
        &cfg(2, Strategy::NoShard, Some(Offload::Optimizer)),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("--offload optimizer with no-shard at 2 ranks makes no sense"),
        "{e}"
    );
    assert!(e.contains("shard-optimizer"), "{e}");
    for s in [Strategy::NoShard, Strategy::ShardOptimizer] {
        let e = plan(&chain(), &cfg(1, s, Some(Offload::Params)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("--offload params with {s} makes no sense")),
            "{e}"
        );
    }
    // Hybrid with shard groups of one is no-shard's layout: refused alike, with a fix that
    // works for the offload asked for.
    let mut c = cfg(4, Strategy::Hybrid { shard_size: 1 }, Some(Offload::Params));
    let e = plan(&chain(), &c).unwrap_err().to_string();
    assert!(e.contains("with one shard per group"), "{e}");
    assert!(
        e.contains("shard-grad-op or full-shard with --offload params, or shard-optimizer with --offload optimizer"),
        "{e}"
    );
    c.offload = Some(Offload::Optimizer);
    assert!(plan(&chain(), &c).is_err());
    // One rank without sharding: offloading the optimizer is ZeRO-Offload on one device.
    let p = plan(
        &chain(),
        &cfg(1, Strategy::NoShard, Some(Offload::Optimizer)),
    )
    .unwrap();
    assert_eq!(
        p.memory.host_peak.0,
        4 * 50 + 4 * 50 + 8 * 50 + (2 + 4) * 30
    );
    "1".parse::<Offload>().unwrap_err();
    assert_eq!("params".parse::<Offload>().unwrap(), Offload::Params);
}

/// Auto at one rank with an offload set considers full shard too (it frees the device's
/// gathered copies that no-shard keeps), and never runs out of candidates.
#[test]
fn auto_at_one_rank_with_offload_considers_full_shard() {
    let gpt2 = fsdp_planner::preset("gpt2").unwrap();
    for o in [Offload::Optimizer, Offload::Params] {
        let mut c = cfg(1, Strategy::Auto, Some(o));
        c.seq_len = 128;
        c.device_memory = Some(Bytes(1 << 40));
        let p = plan(&gpt2, &c).unwrap();
        let want = if o == Offload::Params {
            Strategy::FullShard
        } else {
            Strategy::NoShard
        };
        assert_eq!(p.strategy, want, "{o}");
        // A budget only full shard meets.
        let mut f = c.clone();
        f.strategy = Strategy::FullShard;
        f.device_memory = None;
        let fs = plan(&gpt2, &f).unwrap();
        f.strategy = Strategy::NoShard;
        if o == Offload::Optimizer {
            assert!(fs.memory.peak < plan(&gpt2, &f).unwrap().memory.peak);
        }
        c.device_memory = Some(fs.memory.peak);
        let p = plan(&gpt2, &c).unwrap();
        assert_eq!(p.strategy, Strategy::FullShard, "{o}");
        assert_eq!(p.fits(), Some(true), "{o}");
    }
}

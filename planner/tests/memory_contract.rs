//! The memory plan against the contract of `fsdp_planner::memory` on models small enough to compute by hand:
//! alive units per schedule position (prefetch, keep-after-forward, the tied root), and bytes
//! per category.

use fsdp_planner::{
    plan, Architecture, GradSync, ModelSpec, Offload, ParamSpec, Phase, PlanConfig, Strategy,
    UnitSpec,
};
use fsdp_types::DType;

/// `n` units of one `[10]` parameter each; optionally a tied root unit last.
fn chain(n: usize, tied_root: bool) -> ModelSpec {
    let mut units: Vec<UnitSpec> = (0..n)
        .map(|i| UnitSpec {
            name: format!("b{i}"),
            params: vec![ParamSpec::new(format!("b{i}.w"), &[10])],
        })
        .collect();
    if tied_root {
        let mut t = ParamSpec::new("lm_head.weight", &[6, 5]);
        t.tied_to = Some("wte".into());
        units.push(UnitSpec {
            name: "root".into(),
            params: vec![ParamSpec::new("wte", &[6, 5]), t],
        });
    }
    ModelSpec {
        name: "chain".into(),
        units,
        arch: Architecture::Generic,
    }
}

fn cfg(w: u64, s: Strategy) -> PlanConfig {
    let mut c = PlanConfig::new(w);
    c.strategy = s;
    c.param_dtype = DType::BF16;
    c
}

#[test]
fn full_shard_alive_sets_and_bytes() {
    let p = plan(&chain(4, false), &cfg(2, Strategy::FullShard)).unwrap();
    let alive: Vec<Vec<usize>> = p.schedule.forward.iter().map(|s| s.alive.clone()).collect();
    assert_eq!(alive, vec![vec![0, 1], vec![1, 2], vec![2, 3], vec![3]]);
    let balive: Vec<Vec<usize>> = p
        .schedule
        .backward
        .iter()
        .map(|s| s.alive.clone())
        .collect();
    assert_eq!(balive, vec![vec![2, 3], vec![1, 2], vec![0, 1], vec![0]]);
    assert_eq!(p.schedule.forward[0].prefetch, vec![1]);
    let t = &p.memory.timeline;
    // param shards: 4 units x 5 elements x 4 B; no kept low-precision copy (cast in place
    // into the gather buffer); grads 4 B; AdamW 8 B.
    assert_eq!(t[0].bytes.param_shards.0, 80);
    assert_eq!(t[0].bytes.param_shards_low_precision.0, 0);
    assert_eq!(t[0].bytes.grad_shards.0, 80);
    assert_eq!(t[0].bytes.optimizer_state.0, 160);
    assert_eq!(t[0].bytes.unsharded_params.0, 2 * 20);
    assert_eq!(t[3].bytes.unsharded_params.0, 2 * 10);
    // Backward of unit 3 (W = 2, prefetch 1: reductions overlap): while computing, its f32
    // flat gradient (10 x 4 B) only; after starting its reduce-scatter, also the output.
    assert_eq!((t[4].label.as_str(), t[5].label.as_str()), ("b3", "b3"));
    assert_eq!(
        (t[4].bytes.unsharded_grads.0, t[4].bytes.staging.0),
        (40, 0)
    );
    assert_eq!(t[4].bytes.activations.0, 0);
    assert_eq!(
        (t[5].bytes.unsharded_grads.0, t[5].bytes.staging.0),
        (40, 20)
    );
    // Unit 2's gradient is gathered while unit 3's reduce-scatter is in flight.
    assert_eq!(
        (t[6].bytes.unsharded_grads.0, t[6].bytes.staging.0),
        (80, 20)
    );
    assert_eq!(t.len(), 4 + 2 * 4 + 1);
    let f = p.memory.phase(Phase::Forward);
    assert_eq!(f.peak_total.0, 80 + 80 + 160 + 40);
    assert_eq!(f.peak_unit, "b0");
    let b = p.memory.phase(Phase::Backward);
    assert_eq!(b.peak_total.0, 320 + 40 + 80 + 20);
    assert_eq!(p.memory.peak.0, 460);
    assert_eq!(p.memory.peak_phase, Phase::Backward);
    assert_eq!(p.memory.phase(Phase::OptimizerStep).peak_total.0, 320);
    // Model states: 16 bytes per shard element = ZeRO's (2 + 2 + 12) Psi / N.
    assert_eq!(p.memory.model_states.0, 16 * 20);
    // Prefetch 0: no overlap, one backward point per step, as the synchronous engine runs.
    let mut c0 = cfg(2, Strategy::FullShard);
    c0.prefetch = 0;
    let p0 = plan(&chain(4, false), &c0).unwrap();
    assert_eq!(p0.memory.timeline.len(), 4 + 4 + 1);
    assert_eq!(p0.memory.phase(Phase::Backward).max.unsharded_grads.0, 40);
}

#[test]
fn keep_after_forward_and_prefetch_depth() {
    let mut c = cfg(2, Strategy::ShardGradOp);
    c.prefetch = 2;
    let p = plan(&chain(4, false), &c).unwrap();
    let alive: Vec<Vec<usize>> = p.schedule.forward.iter().map(|s| s.alive.clone()).collect();
    assert_eq!(
        alive,
        vec![
            vec![0, 1, 2],
            vec![0, 1, 2, 3],
            vec![0, 1, 2, 3],
            vec![0, 1, 2, 3]
        ]
    );
    let balive: Vec<Vec<usize>> = p
        .schedule
        .backward
        .iter()
        .map(|s| s.alive.clone())
        .collect();
    assert_eq!(
        balive,
        vec![vec![0, 1, 2, 3], vec![0, 1, 2], vec![0, 1], vec![0]]
    );
    assert!(!p.schedule.reshard_after_forward);
    let mut c0 = cfg(2, Strategy::FullShard);
    c0.prefetch = 0;
    let p0 = plan(&chain(4, false), &c0).unwrap();
    assert!(p0.schedule.forward.iter().all(|s| s.alive == vec![s.unit]));
}

#[test]
fn tied_root_is_used_first_and_last_and_stays_unsharded() {
    let p = plan(&chain(2, true), &cfg(2, Strategy::FullShard)).unwrap();
    assert_eq!(p.schedule.root_unit, Some(2));
    let labels: Vec<&str> = p
        .schedule
        .forward
        .iter()
        .map(|s| s.label.as_str())
        .collect();
    assert_eq!(labels, ["root (embedding)", "b0", "b1", "root (head)"]);
    assert!(p.schedule.forward.iter().all(|s| s.alive.contains(&2)));
    assert!(p.schedule.backward.iter().all(|s| s.alive.contains(&2)));
    // Root's gradient buffer lives from its head backward to its embedding backward; it is
    // reduce-scattered once, at the end.
    let g: Vec<Vec<usize>> = p
        .schedule
        .backward
        .iter()
        .map(|s| s.grads_alive.clone())
        .collect();
    assert_eq!(g, vec![vec![2], vec![1, 2], vec![0, 2], vec![2]]);
    let rs: Vec<bool> = p
        .schedule
        .backward
        .iter()
        .map(|s| s.reduce_scatter)
        .collect();
    assert_eq!(rs, [false, true, true, true]);
    // Root holds 30 elements (the tied head takes none): f32 grads 120 B + unit b0 40 B.
    assert_eq!(p.memory.timeline[4 + 2].bytes.unsharded_grads.0, 160);
    assert_eq!(p.padding.real_numel.0, 50);
}

#[test]
fn no_copy_when_unsharded_f32_and_copy_in_bf16() {
    let mut c = PlanConfig::new(4);
    c.strategy = Strategy::NoShard;
    let p = plan(&chain(3, false), &c).unwrap();
    assert_eq!(p.shard_size, 1);
    assert_eq!(p.replicate_size, 4);
    assert_eq!(p.memory.phase(Phase::Backward).max.unsharded_params.0, 0);
    assert_eq!(p.memory.phase(Phase::Backward).max.staging.0, 0);
    let p = plan(&chain(3, false), &cfg(4, Strategy::NoShard)).unwrap();
    assert_eq!(p.memory.phase(Phase::Backward).max.unsharded_params.0, 60);
    assert_eq!(p.rank(3).unwrap().replicate_index, 3);
}

#[test]
fn hybrid_places_ranks_and_sync_last_reduces_on_last_micro_batch_only() {
    let mut c = cfg(8, Strategy::Hybrid { shard_size: 2 });
    c.grad_accum = 3;
    c.grad_sync = GradSync::LastMicroBatch;
    c.reduce_dtype = DType::BF16;
    let p = plan(&chain(4, false), &c).unwrap();
    assert_eq!((p.shard_size, p.replicate_size), (2, 4));
    let r5 = p.rank(5).unwrap();
    assert_eq!((r5.shard_index, r5.replicate_index), (1, 2));
    let mbs: Vec<u64> = p.memory.timeline.iter().map(|t| t.micro_batch).collect();
    assert_eq!(mbs.first(), Some(&0));
    assert_eq!(mbs.last(), Some(&2));
    let mut first_last_mb_backward = true;
    for t in &p.memory.timeline {
        match (t.phase, t.micro_batch) {
            (Phase::OptimizerStep, _) => assert_eq!(t.bytes.unsharded_grads.0, 0),
            (Phase::Backward, 2) if first_last_mb_backward => {
                // Unit 3 computing, nothing in flight yet.
                first_last_mb_backward = false;
                assert_eq!(t.bytes.unsharded_grads.0, 160);
                assert_eq!(t.bytes.staging.0, 0);
            }
            (Phase::Backward, 2) => {
                // persistent f32 (4 x 10 x 4 B) + bf16 cast of the unit reduced or in flight
                // (10 x 2 B), and its reduce-scatter output
                assert_eq!(t.bytes.unsharded_grads.0, 160 + 20);
                assert_eq!(t.bytes.staging.0, 10);
            }
            _ => {
                assert_eq!(t.bytes.unsharded_grads.0, 160);
                assert_eq!(t.bytes.staging.0, 0);
            }
        }
    }
}

#[test]
fn activations_follow_the_documented_formulas() {
    let spec = fsdp_planner::preset("tiny").unwrap(); // d 128, 4 layers, 4 heads, vocab 256
    let mut c = PlanConfig::new(1);
    c.seq_len = 64;
    c.micro_batch = 2;
    c.activation_checkpointing = Some(true);
    let p = plan(&spec, &c).unwrap();
    let (s, b, h, a, v, e) = (64u64, 2u64, 128u64, 4u64, 256u64, 4u64);
    let n = s * b;
    let hidden = e * n * h;
    // Block forward kept by the graph (fused attention): N*(23h + a*s) elements.
    let block = e * n * (23 * h + a * s);
    // Block backward on top: 13hN + P, P = 12h^2 + 13h (with biases).
    let block_bwd = e * (13 * n * h + (12 * h * h + 13 * h));
    let head_live = e * n * (h + v);
    let t = &p.memory.timeline;
    // Forward step 1 (h.0) under recompute: inputs of embed (ids) and h.0 kept + h.0 live.
    assert_eq!(t[1].bytes.activations.0, 4 * n + hidden + block);
    // Head forward: all inputs, the head's input copy (a fresh autograd variable), LN + logits.
    let inputs = 4 * n + 5 * hidden;
    assert_eq!(t[5].bytes.activations.0, inputs + hidden + head_live);
    // Backward of h.3 (backward step 1): inputs up to h.3 (its own now the variable copy),
    // the recomputed graph, the gradient store, the incoming output gradient.
    assert_eq!(
        t[7].bytes.activations.0,
        4 * n + 4 * hidden + block + block_bwd + hidden
    );
    // Keep-after-forward keeps the whole graph: embedding out, per later use its input copy
    // and its graph.
    c.strategy = Strategy::ShardGradOp;
    c.activation_checkpointing = None;
    let k = plan(&spec, &c).unwrap();
    let all = 4 * n + hidden + 4 * (hidden + block) + hidden + head_live;
    assert_eq!(k.memory.timeline[5].bytes.activations.0, all);
    // So does full shard without activation checkpointing (its default).
    c.strategy = Strategy::FullShard;
    let f = plan(&spec, &c).unwrap();
    assert_eq!(f.memory.timeline[5].bytes.activations.0, all);
}

#[test]
fn config_errors_carry_numbers() {
    let s = chain(2, false);
    let e = |c: PlanConfig| plan(&s, &c).unwrap_err().to_string();
    assert!(e(PlanConfig::new(0)).contains("at least 1, got 0"));
    assert!(e(cfg(6, Strategy::Hybrid { shard_size: 4 }))
        .contains("shard size 4 does not divide world size 6"));
    let mut c = PlanConfig::new(2);
    c.micro_batch = 0;
    assert!(e(c).contains("micro-batch size must be at least 1"));
    let mut c = PlanConfig::new(2);
    c.strategy = Strategy::Auto;
    assert!(e(c).contains("device memory"));
    let mut c = PlanConfig::new(2);
    c.alignment = 0;
    assert!(e(c).contains("alignment"));
    assert!(e(PlanConfig::new(1 << 40)).contains("exceeds the planner's limit"));
    let mut c = PlanConfig::new(2);
    c.micro_batch = u64::MAX;
    assert!(e(c).contains("tokens exceeds the limit"));
    let mut huge = chain(1, false);
    huge.units[0].params[0].shape = vec![1 << 40, 1 << 40];
    assert!(plan(&huge, &PlanConfig::new(2))
        .unwrap_err()
        .to_string()
        .contains("exceeds"));
    let mut split = chain(2, true);
    let t = split.units[2].params.pop().unwrap();
    split.units[0].params.push(t);
    let msg = plan(&split, &PlanConfig::new(2)).unwrap_err().to_string();
    assert!(
        msg.contains("lm_head.weight") && msg.contains("root"),
        "{msg}"
    );
    let gpt = fsdp_planner::preset("gpt2").unwrap();
    let mut c = PlanConfig::new(1);
    c.seq_len = 2048;
    assert!(plan(&gpt, &c)
        .unwrap_err()
        .to_string()
        .contains("1024 positions"));
}

/// The strategies of auto at W = 8, fastest first: no-shard, shard-optimizer, shard-grad-op,
/// hybrid with shard groups of 2 and 4, full shard.
const AUTO_ORDER_W8: [Strategy; 6] = [
    Strategy::NoShard,
    Strategy::ShardOptimizer,
    Strategy::ShardGradOp,
    Strategy::Hybrid { shard_size: 2 },
    Strategy::Hybrid { shard_size: 4 },
    Strategy::FullShard,
];

/// The first `(strategy, activation checkpointing, offload)` whose own plan fits
/// `c.device_memory`, trying every strategy under each checkpointing setting in turn.
fn first_fit(
    spec: &ModelSpec,
    c: &PlanConfig,
    strategies: &[Strategy],
    ckpt: &[Option<bool>],
    offload: Option<Offload>,
) -> Option<(Strategy, Option<bool>, Option<Offload>)> {
    let budget = c.device_memory.unwrap();
    ckpt.iter()
        .flat_map(|&a| strategies.iter().map(move |&s| (s, a)))
        .find(|&(s, a)| {
            let mut e = c.clone();
            e.strategy = s;
            e.device_memory = None;
            e.activation_checkpointing = a;
            e.offload = offload;
            plan(spec, &e).unwrap().memory.peak <= budget
        })
        .map(|(s, a)| (s, a, offload))
}

#[test]
fn auto_picks_the_fastest_strategy_that_fits() {
    let spec = fsdp_planner::preset("llama3-8b").unwrap();
    let mut c = PlanConfig::new(8);
    c.strategy = Strategy::Auto;
    c.device_memory = Some(fsdp_types::Bytes(80 << 30));
    let p = plan(&spec, &c).unwrap();
    // DDP needs ~137 GiB; shard-optimizer at W=8 (f32 parameters replicated, 30 GiB) fits
    // 80 GiB.
    assert_eq!(p.strategy, Strategy::ShardOptimizer);
    let why = p.auto_reason.as_deref().unwrap();
    assert!(why.contains("no-shard needs"), "{why}");
    assert!(
        why.starts_with("shard-optimizer is the fastest strategy that fits"),
        "{why}"
    );
    assert!(!p.schedule.activation_checkpointing);
    c.device_memory = Some(fsdp_types::Bytes(30 << 30));
    // Each candidate planned on its own: the first of the documented order whose peak fits
    // 30 GiB is full shard with activation checkpointing (hybrid with shard groups of 4 and
    // checkpointing does not fit).
    let ckpt = [None, Some(true)];
    let first = first_fit(&spec, &c, &AUTO_ORDER_W8, &ckpt, None);
    assert_eq!(first, Some((Strategy::FullShard, Some(true), None)));
    let p = plan(&spec, &c).unwrap();
    assert_eq!(p.strategy, Strategy::FullShard);
    assert!(p.memory.peak.0 <= 30 << 30);
    // 32 layers of kept graphs do not fit 30 GiB under any strategy: auto then adds
    // activation checkpointing and says so.
    assert!(p.schedule.activation_checkpointing);
    let why = p.auto_reason.as_deref().unwrap();
    assert!(why.contains("with activation checkpointing"), "{why}");
    assert!(why.contains("full-shard needs"), "{why}");
    // An explicit setting is kept: without checkpointing nothing fits 30 GiB on the device
    // alone; auto's last resort moves the master weights and optimizer state, then the
    // parameter shards too, to the host: the optimizer offloaded before the parameters, the
    // strategies fastest first, those that refuse the offload left out (no-shard at W > 1;
    // shard-optimizer for the parameters).
    c.activation_checkpointing = Some(false);
    assert_eq!(
        first_fit(&spec, &c, &AUTO_ORDER_W8, &[Some(false)], None),
        None,
        "nothing fits without offload"
    );
    let mut want = first_fit(
        &spec,
        &c,
        &AUTO_ORDER_W8[1..],
        &[Some(false)],
        Some(Offload::Optimizer),
    );
    if want.is_none() {
        want = first_fit(
            &spec,
            &c,
            &AUTO_ORDER_W8[2..],
            &[Some(false)],
            Some(Offload::Params),
        );
    }
    let (want_s, _, want_o) = want.expect("an offloaded candidate fits 30 GiB");
    let p = plan(&spec, &c).unwrap();
    assert!(!p.schedule.activation_checkpointing);
    assert_eq!((p.strategy, p.config.offload), (want_s, want_o));
    assert_eq!(p.fits(), Some(true));
    let why = p.auto_reason.as_deref().unwrap();
    assert!(
        why.starts_with(&format!(
            "{want_s} with --offload {} is the fastest way it fits, with offload",
            want_o.unwrap()
        )),
        "{why}"
    );
    // One byte below full shard's peak without checkpointing: nothing fits on the device
    // alone, and offloading the optimizer already fits, so auto must not offload the
    // parameters.
    let mut e = c.clone();
    e.strategy = Strategy::FullShard;
    e.device_memory = None;
    let tight = plan(&spec, &e).unwrap().memory.peak.0 - 1;
    let mut t = c.clone();
    t.device_memory = Some(fsdp_types::Bytes(tight));
    assert_eq!(
        first_fit(&spec, &t, &AUTO_ORDER_W8, &[Some(false)], None),
        None
    );
    let (want_s, _, want_o) = first_fit(
        &spec,
        &t,
        &AUTO_ORDER_W8[1..],
        &[Some(false)],
        Some(Offload::Optimizer),
    )
    .expect("offloading the optimizer fits");
    let q = plan(&spec, &t).unwrap();
    assert_eq!((q.strategy, q.config.offload), (want_s, want_o));
    // Every strategy was tried without offload first.
    assert!(why.contains("full-shard needs"), "{why}");
    assert!(why.contains("no-shard needs"), "{why}");
    // 4 + 4 + 8 bytes per element of the rank's shard in host memory, plus the staging
    // buffers.
    let host = p.memory.host_peak.0;
    let shard: u64 = p.padding.padded_numel.0 / p.shard_size;
    let staging = fsdp_planner::memory::host_staging_bytes(&p.units, &p.config);
    assert_eq!(host, 16 * shard + staging, "{host}");
    // Offload set to none explicitly: nothing fits, as before.
    c.offload = Some(Offload::None);
    let p = plan(&spec, &c).unwrap();
    assert_eq!(p.strategy, Strategy::FullShard);
    assert_eq!(p.fits(), Some(false));
    assert!(p.auto_reason.clone().unwrap().starts_with("nothing fits"));
    c.offload = None;
    c.activation_checkpointing = None;
    c.device_memory = Some(fsdp_types::Bytes(1 << 30));
    let p = plan(&spec, &c).unwrap();
    assert_eq!(p.strategy, Strategy::FullShard);
    assert!(p.auto_reason.clone().unwrap().starts_with("nothing fits"));
    assert_eq!(p.fits(), Some(false));
}

#[test]
fn shard_optimizer_keeps_params_replicated_all_step() {
    // Units b0 [10], b1 [10], tied root [6,5] (30): padded 10 + 10 + 30 = 50 for S = 2.
    let mut c = cfg(2, Strategy::ShardOptimizer);
    c.grad_accum = 2;
    let p = plan(&chain(2, true), &c).unwrap();
    assert_eq!((p.shard_size, p.replicate_size), (2, 1));
    assert!(p.schedule.replicated && !p.schedule.reshard_after_forward);
    for st in p.schedule.forward.iter().chain(&p.schedule.backward) {
        assert_eq!(st.alive, vec![0, 1, 2], "{}", st.label);
        assert!(st.prefetch.is_empty(), "{}", st.label);
    }
    // Gradient buffers and reductions as under keep-after-forward.
    let sgo = plan(&chain(2, true), &cfg(2, Strategy::ShardGradOp)).unwrap();
    for (a, b) in p.schedule.backward.iter().zip(&sgo.schedule.backward) {
        assert_eq!(a.grads_alive, b.grads_alive, "{}", a.label);
        assert_eq!(a.reduce_scatter, b.reduce_scatter, "{}", a.label);
    }
    // The root is reduce-scattered once, at its last backward use (the embedding).
    let rs: Vec<&str> = p
        .schedule
        .backward
        .iter()
        .filter(|s| s.reduce_scatter)
        .map(|s| s.label.as_str())
        .collect();
    assert_eq!(rs, ["b1", "b0", "root (embedding)"]);
    // bf16 params 2*50 all step, f32 master 4*25, f32 gradient shards 4*25, AdamW 8*25; with
    // accumulation (grad_sync left at every micro-batch) the f32 gradients 4*50 accumulate
    // until the last micro-batch's reductions, each into an f32 staging shard (b0, b1: 4*5;
    // root: 4*15).
    assert_eq!(p.memory.timeline.len(), 2 * (4 + 4) + 1);
    for t in &p.memory.timeline {
        let b = t.bytes;
        let at = format!("{t:?}");
        assert_eq!(b.unsharded_params.0, 100, "{at}");
        assert_eq!(b.param_shards.0, 100, "{at}");
        assert_eq!(b.grad_shards.0, 100, "{at}");
        assert_eq!(b.optimizer_state.0, 200, "{at}");
        assert_eq!(b.param_shards_low_precision.0, 0, "{at}");
        let opt = t.phase == Phase::OptimizerStep;
        assert_eq!(b.unsharded_grads.0, if opt { 0 } else { 200 }, "{at}");
        let reducing = t.phase == Phase::Backward && t.micro_batch == 1;
        let staging = match t.label.as_str() {
            "b0" | "b1" if reducing => 20,
            "root (embedding)" if reducing => 60,
            _ => 0,
        };
        assert_eq!(b.staging.0, staging, "{at}");
        assert!(t.host.is_zero(), "{at}");
    }
    assert_eq!(p.memory.model_states.0, 500);
    assert_eq!(p.memory.peak.0, 760);
    // Without accumulation the gradients live per unit, as under shard-grad-op.
    c.grad_accum = 1;
    let one = plan(&chain(2, true), &c).unwrap();
    let mut g = cfg(2, Strategy::ShardGradOp);
    g.grad_accum = 1;
    g.prefetch = 0;
    let sgo = plan(&chain(2, true), &g).unwrap();
    for (a, b) in one.memory.timeline.iter().zip(&sgo.memory.timeline) {
        if a.phase == Phase::Backward {
            assert_eq!(
                a.bytes.unsharded_grads, b.bytes.unsharded_grads,
                "{}",
                a.label
            );
        }
    }
    // It reduces once per step whatever grad_sync says: both spellings are one plan.
    let mut every = cfg(2, Strategy::ShardOptimizer);
    every.grad_accum = 2;
    let mut last = every.clone();
    last.grad_sync = GradSync::LastMicroBatch;
    assert_eq!(
        plan(&chain(2, true), &every).unwrap().fingerprint,
        plan(&chain(2, true), &last).unwrap().fingerprint
    );
    // A different strategy, a different fingerprint; the same config, the same one.
    assert_ne!(sgo.fingerprint, one.fingerprint);
    assert_eq!(
        plan(&chain(2, true), &c).unwrap().fingerprint,
        one.fingerprint
    );
}

#[test]
fn auto_tries_shard_optimizer_after_no_shard() {
    let spec = fsdp_planner::preset("gpt2-xl").unwrap();
    let mut c = PlanConfig::new(8);
    c.param_dtype = DType::BF16;
    c.reduce_dtype = DType::BF16;
    let peak = |s: Strategy| {
        let mut c = c.clone();
        c.strategy = s;
        plan(&spec, &c).unwrap().memory.peak
    };
    let (ddp, z1) = (peak(Strategy::NoShard), peak(Strategy::ShardOptimizer));
    // Shard-grad-op keeps every unit unsharded from forward to its backward too: its peak is
    // the same as shard-optimizer's.
    assert!(z1 < ddp && z1 >= peak(Strategy::ShardGradOp));
    c.strategy = Strategy::Auto;
    c.device_memory = Some(z1);
    let p = plan(&spec, &c).unwrap();
    assert_eq!(p.strategy, Strategy::ShardOptimizer);
    let why = p.auto_reason.as_deref().unwrap();
    assert!(
        why.starts_with("shard-optimizer is the fastest strategy that fits"),
        "{why}"
    );
    assert!(why.contains(&format!("no-shard needs {ddp}")), "{why}");
    c.device_memory = Some(ddp);
    assert_eq!(plan(&spec, &c).unwrap().strategy, Strategy::NoShard);
    // The fit report lists shard-optimizer between shard-grad-op and no-shard.
    let mw = fsdp_planner::min_world_sizes(&spec, &c, z1).unwrap();
    let names: Vec<&str> = mw.iter().map(|m| m.strategy.cli_name()).collect();
    assert_eq!(
        names,
        [
            "full-shard",
            "shard-grad-op",
            "shard-optimizer",
            "no-shard",
            "hybrid"
        ]
    );
    let z1_min = mw[2].world_size.unwrap();
    assert!(z1_min <= 8 && mw[2].peak <= z1);
}

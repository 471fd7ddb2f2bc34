//! Model-state bytes per rank against the ZeRO paper's formulas (Rajbhandari et al. 2020,
//! "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", sec. 5, Figure 1),
//! exact up to padding: every `Psi/N` below is `(Psi + padding)/N` = sum of shard lengths.
//!
//! Mapping between the paper's mixed-precision Adam accounting (2 + 2 + K, K = 12) and our
//! categories:
//! - paper "fp16 parameters" 2 Psi  <-> no kept bf16 copy: each unshard casts the fp32 master
//!   shard into the bf16 all-gather buffer in place (`unsharded_params` while gathered);
//!   `param_shards_low_precision` is 0;
//! - paper "fp16 gradients" 2 Psi  <-> our accumulated gradient shard is kept in **f32**
//!   (`grad_shards`, 4 bytes/element) because gradients accumulate across micro-batches in
//!   full precision; bf16 gradients exist only transiently (`unsharded_grads`, `staging`).
//!   So under full shard our model states equal the paper's `(2 + 2 + 12) Psi / N` in total,
//!   the two 2-byte halves being one 4-byte gradient shard;
//! - paper K = 12 (fp32 master 4 + momentum 4 + variance 4) <-> `param_shards` (4) +
//!   `optimizer_state` (8).
//!
//! Optimizer sharding (ZeRO-1, `Strategy::ShardOptimizer`) keeps the paper's replicated bf16
//! parameters as `unsharded_params` alive all step; its gradients are replicated only while
//! backward produces them and are then reduce-scattered into the f32 gradient shard, so its
//! model states are `2Psi + 16Psi/N`: the paper's `2Psi + 2Psi + 12Psi/N` with the replicated
//! 2-byte gradient held as a 4-byte shard instead.

use fsdp_planner::{plan, preset, Phase, PlanConfig, Strategy};
use fsdp_types::DType;

fn states(name: &str, n: u64, s: Strategy, bf16: bool) -> (fsdp_planner::ShardPlan, u64, u64) {
    let spec = preset(name).unwrap();
    let mut cfg = PlanConfig::new(n);
    cfg.strategy = s;
    if bf16 {
        cfg.param_dtype = DType::BF16;
        cfg.reduce_dtype = DType::BF16;
    }
    let p = plan(&spec, &cfg).unwrap();
    let psi = spec.numel().0;
    let padded = p.padding.padded_numel.0;
    (p, psi, padded)
}

#[test]
fn zero3_fp32_adamw_full_shard_is_16_psi_over_n() {
    for (name, n) in [
        ("gpt2-medium", 8u64),
        ("gpt2-medium", 64),
        ("llama2-7b", 64),
        ("llama3-8b", 1000),
    ] {
        let (p, psi, padded) = states(name, n, Strategy::FullShard, false);
        assert_eq!(p.memory.model_states.0, 16 * padded / n, "{name} N={n}");
        // Padding is below one element per rank per flat param.
        let flats = p
            .units
            .iter()
            .map(|u| u.flat_params.len() as u64)
            .sum::<u64>();
        assert!(padded - psi < n * flats);
        let ideal = 16.0 * psi as f64 / n as f64;
        let rel = (p.memory.model_states.0 as f64 - ideal) / ideal;
        assert!((0.0..1e-3).contains(&rel), "{name} N={n}: {rel}");
    }
}

#[test]
fn zero3_bf16_params_with_fp32_master_is_2_2_12_psi_over_n() {
    let (p, psi, padded) = states("llama2-7b", 64, Strategy::FullShard, true);
    let o = p.memory.phase(Phase::OptimizerStep).at_peak;
    let per = padded / 64;
    assert_eq!(o.param_shards_low_precision.0, 0); // cast in place when gathering
    assert_eq!(o.param_shards.0 + o.optimizer_state.0, 12 * per); // paper: K = 12
    assert_eq!(o.grad_shards.0, 4 * per); // paper: 2 + 2 (fp16 params + grads)
    assert_eq!(p.memory.model_states.0, (2 + 2 + 12) * per);
    let ideal = 16.0 * psi as f64 / 64.0;
    let rel = (p.memory.model_states.0 as f64 - ideal) / ideal;
    assert!((0.0..1e-3).contains(&rel), "{rel}");
    // The bf16 gradient is transient: at most the unit computing plus the unit whose
    // reduce-scatter is in flight (prefetch 1 overlaps reductions), 2 bytes/element.
    let b = p.memory.phase(Phase::Backward).max;
    let size = |u: usize| -> u64 {
        p.units[u]
            .flat_params
            .iter()
            .filter(|f| f.trainable)
            .map(|f| f.padded_numel.0)
            .sum()
    };
    let bw = &p.schedule.backward;
    let pair = (0..bw.len())
        .map(|k| {
            let now: u64 = bw[k].grads_alive.iter().map(|&u| size(u)).sum();
            let prev = if k > 0 && bw[k - 1].reduce_scatter {
                size(bw[k - 1].unit)
            } else {
                0
            };
            now + prev
        })
        .max()
        .unwrap();
    assert_eq!(b.unsharded_grads.0, 2 * pair);
    assert!(pair > (0..p.units.len()).map(size).max().unwrap());
}

#[test]
fn zero2_grads_and_optimizer_is_2_psi_plus_14_psi_over_n_plus_f32_grad_shard() {
    let n = 16;
    let (p, psi, padded) = states("gpt2-large", n, Strategy::ShardGradOp, true);
    let per = padded / n;
    // At the first backward step every unit is still gathered: the paper's 2 Psi replicas.
    let first_bwd = p
        .memory
        .timeline
        .iter()
        .find(|t| t.phase == Phase::Backward)
        .unwrap();
    assert_eq!(first_bwd.bytes.unsharded_params.0, 2 * padded);
    assert!(2 * padded - 2 * psi < 2 * n * 37);
    // Sharded: master 4 + Adam 8 (paper 12) + grads 4 (paper 2, ours f32); no bf16 copy.
    assert_eq!(p.memory.model_states.0, (12 + 2) * per + 2 * per);
    assert_eq!(
        first_bwd.bytes.model_states().0 + first_bwd.bytes.unsharded_params.0,
        2 * padded + 16 * per
    );
}

#[test]
fn ddp_no_shard_fp32_is_16_psi() {
    let (p, psi, padded) = states("gpt2", 8, Strategy::NoShard, false);
    assert_eq!(padded, psi); // S = 1: no padding
    assert_eq!(p.memory.model_states.0, 16 * psi);
    // The shard is the parameter: no gathered copy in f32.
    assert_eq!(p.memory.phase(Phase::Forward).max.unsharded_params.0, 0);
    assert_eq!(p.memory.phase(Phase::Backward).max.staging.0, 0);
}

#[test]
fn zero1_replicated_params_are_2_psi_plus_16_psi_over_n() {
    for (name, n) in [("gpt2-large", 16u64), ("llama2-7b", 64), ("gpt2", 3)] {
        let (p, psi, padded) = states(name, n, Strategy::ShardOptimizer, true);
        assert_eq!(
            p.shard_size, n,
            "{name}: optimizer state sharded over the world"
        );
        assert_eq!(p.replicate_size, 1);
        let per = padded / n;
        assert_eq!(per * n, padded);
        // Padding is below one element per rank per flat param.
        let flats = p
            .units
            .iter()
            .map(|u| u.flat_params.len() as u64)
            .sum::<u64>();
        assert!(padded - psi < n * flats, "{name}");
        // Replicated bf16 parameters 2Psi; f32 master 4, f32 gradient 4, Adam 8 per shard
        // element.
        assert_eq!(
            p.memory.model_states.0,
            2 * padded + 16 * per,
            "{name} N={n}"
        );
        let ideal = 2.0 * psi as f64 + 16.0 * psi as f64 / n as f64;
        let rel = (p.memory.model_states.0 as f64 - ideal) / ideal;
        assert!((0.0..1e-3).contains(&rel), "{name} N={n}: {rel}");
        // Category by category, at every point of the step.
        for t in &p.memory.timeline {
            let b = t.bytes;
            let at = format!("{name} {:?} {}", t.phase, t.label);
            assert_eq!(b.unsharded_params.0, 2 * padded, "{at}: 2Psi bf16 params");
            assert_eq!(b.param_shards.0, 4 * per, "{at}: f32 master shard");
            assert_eq!(b.grad_shards.0, 4 * per, "{at}: f32 gradient shard");
            assert_eq!(b.optimizer_state.0, 8 * per, "{at}: Adam moments");
            assert_eq!(b.param_shards_low_precision.0, 0, "{at}");
            if t.phase == Phase::OptimizerStep {
                assert_eq!(b.ledger_total(), p.memory.model_states, "{at}");
                assert_eq!((b.unsharded_grads.0, b.staging.0), (0, 0), "{at}");
            }
        }
        // Every unit stays unsharded at every step; no all-gather after the first.
        let all: Vec<usize> = (0..p.units.len()).collect();
        for st in p.schedule.forward.iter().chain(&p.schedule.backward) {
            assert_eq!(st.alive, all);
            assert!(st.prefetch.is_empty());
        }
        assert!(p.schedule.replicated);
    }
    // Less memory than DDP, more than ZeRO-2 at the optimizer step.
    let (ddp, _, _) = states("gpt2-large", 16, Strategy::NoShard, true);
    let (z1, _, _) = states("gpt2-large", 16, Strategy::ShardOptimizer, true);
    let (z2, _, _) = states("gpt2-large", 16, Strategy::ShardGradOp, true);
    assert!(z1.memory.model_states < ddp.memory.model_states);
    assert!(z2.memory.model_states < z1.memory.model_states);
    assert!(z1.memory.peak < ddp.memory.peak);
    assert!(z2.memory.peak <= z1.memory.peak);
}

#[test]
fn zero1_fp32_world_of_one_is_16_psi_like_ddp() {
    // S = 1 with f32 params: the master shard is the parameter (no copy), grads 4Psi,
    // Adam 8Psi: the same 16Psi as DDP.
    let (p, psi, padded) = states("gpt2", 1, Strategy::ShardOptimizer, false);
    assert_eq!(padded, psi);
    assert_eq!(p.memory.model_states.0, 16 * psi);
    let (ddp, _, _) = states("gpt2", 1, Strategy::NoShard, false);
    assert_eq!(p.memory.model_states, ddp.memory.model_states);
}

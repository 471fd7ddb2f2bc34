//! bf16 gradient reduction that made training unstable as the world size grew
//! (<https://github.com/pytorch/pytorch/issues/106395>), through the real engine: low-precision
//! gradient reduction must not lose the small contributions as the world size grows. One
//! parameter of 4 elements; rank 0's local gradient is 1.0, every other
//! rank's 2^-9 (both exact in bf16); the engine averages by the global sample count W. With
//! `reduce_dtype` f32 the mean is exact to f32; with bf16 on the wire the collective
//! accumulates in f32 and rounds once, so the relative error is at most 2^-8 at every W (a bf16
//! accumulator in ring order would be off by 1.3 % at W = 8). Run for W = 2..8, full shard
//! (reduce-scatter) and no-shard (all-reduce), with f32 and bf16 parameters.

use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::{EngineConfig, InitSync, MicroBatch, RankEngine, StagedModel};
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{plan, PlanConfig, Strategy};
use fsdp_testing::toy::DotModel;
use fsdp_types::DType;
use std::time::Duration;

/// Mean gradient per element as every rank sees it (full shard: reassembled from the shards).
fn mean_grad(w: usize, strategy: Strategy, param: DType, reduce: DType) -> Vec<f32> {
    let model = DotModel::new("bf16-reduce", &[("g", &[4])], vec![vec![0.0; 4]]);
    let mut c = PlanConfig::new(w as u64);
    c.strategy = strategy;
    c.param_dtype = param;
    c.reduce_dtype = reduce;
    let p = plan(model.spec(), &c).unwrap();
    let s = p.shard_size as usize;
    let ecfg = EngineConfig {
        optimizer: Optimizer::AdamW(AdamWConfig::default()),
        clip: None,
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    };
    let init = model.init_params(0);
    let res = run_threads(
        Topology::new(s, w / s).unwrap(),
        Duration::from_secs(30),
        |comm| {
            let rank = fsdp_comm::Communicator::rank(&comm);
            let g = if rank == 0 { 1.0f32 } else { 0.001953125 };
            // The input row is the gradient of the linear loss dot(p, x); in the compute dtype.
            let x = candle_core::Tensor::from_vec(vec![g; 4], (1, 4), &candle_core::Device::Cpu)
                .unwrap()
                .to_dtype(fsdp::runtime::unit::candle_dtype(param))
                .unwrap();
            let mb = MicroBatch {
                input: x.clone(),
                target: x,
                count: 1,
            };
            let mut e = RankEngine::new(&model, &p, &comm, ecfg, &init).unwrap();
            e.accumulate(&[mb]).unwrap();
            e.grad_shards().unwrap().remove(0).remove(0)
        },
    );
    let shards: Vec<Vec<f32>> = res.into_iter().map(|r| r.unwrap()).collect();
    if s == 1 {
        for sh in &shards {
            assert_eq!(sh, &shards[0], "every replica holds the same gradient");
        }
        shards[0][..4].to_vec()
    } else {
        shards.concat()[..4].to_vec()
    }
}

#[test]
fn bf16_reduction_accumulates_in_f32_for_world_sizes_up_to_8() {
    for w in 2..=8usize {
        let truth = (1.0 + (w as f64 - 1.0) * 2f64.powi(-9)) / w as f64;
        for strategy in [Strategy::FullShard, Strategy::NoShard] {
            for param in [DType::F32, DType::BF16] {
                for (reduce, bound) in [(DType::F32, 1e-6), (DType::BF16, 2f64.powi(-8))] {
                    let got = mean_grad(w, strategy, param, reduce);
                    for (i, &v) in got.iter().enumerate() {
                        let rel = ((v as f64 - truth) / truth).abs();
                        assert!(
                            rel <= bound,
                            "W={w} {strategy} params {param} reduce {reduce} element {i}: mean {v} \
                             vs true {truth}: relative error {rel:e} > {bound:e}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn true_means_at_w_8_and_64() {
    // The exact means at W = 8 and 64, so the formula above cannot drift.
    let t = |w: f64| (1.0 + (w - 1.0) * 2f64.powi(-9)) / w;
    assert_eq!(t(8.0), 0.126708984375);
    assert_eq!(t(64.0), 0.017547607421875);
}

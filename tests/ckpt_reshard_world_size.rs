//! Reloading a checkpoint at a different world size: a distributed-optimizer checkpoint saved on
//! 16 GPUs failed to load on 24 (<https://github.com/NVIDIA/Megatron-LM/issues/659>), and an
//! elastic load restored optimizer state misaligned by the padding
//! (<https://github.com/deepspeedai/DeepSpeed/pull/5105>).
//!
//! Parameters `[10,3]`, `[7]`, `[5,5]` (62 elements; not divisible by 3, 4, 5 or 8). The real
//! engine trains 3 AdamW steps (lr 1e-2) at W=2 on fixed data with the linear loss
//! `dot(p, c)`, saves a sharded checkpoint (params, exp_avg, exp_avg_sq, step), loads it at
//! W' in {1, 3, 4, 5, 8} (and DDP / hybrid layouts), and continues 2 steps; the W=2
//! continuation is the reference.

use fsdp::checkpoint::{ckpt_to_engine, engine_to_ckpt};
use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::{EngineConfig, InitSync, RankEngine, StagedModel};
use fsdp_checkpoints::{
    save_checkpoint, Checkpoint, CheckpointLayout, OptimizerState, StateKind, TrainState, Verify,
};
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{plan, PlanConfig, ShardPlan, Strategy};
use fsdp_testing::toy::DotModel;
use std::path::Path;
use std::time::Duration;

const PARAMS: [(&str, &[u64]); 3] = [("w1", &[10, 3]), ("b1", &[7]), ("w2", &[5, 5])];

fn model() -> DotModel {
    let mut k = 0f32;
    let init = PARAMS
        .iter()
        .map(|(_, s)| {
            let n: u64 = s.iter().product();
            (0..n)
                .map(|_| {
                    k += 1.0;
                    k * 0.01 - 0.3
                })
                .collect()
        })
        .collect();
    DotModel::new("reshard", &PARAMS, init)
}

/// The fixed gradient `c` (identical data on every rank): distinct, signed, no zeros.
fn c() -> Vec<f32> {
    (0..62).map(|i| ((i % 9) as f32 - 4.5) * 0.25).collect()
}

fn ecfg() -> EngineConfig {
    EngineConfig {
        optimizer: Optimizer::AdamW(AdamWConfig {
            lr: 1e-2,
            weight_decay: 0.0,
            ..AdamWConfig::default()
        }),
        clip: None,
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    }
}

fn plan_for(m: &DotModel, w: u64, strategy: Strategy) -> ShardPlan {
    let mut cfg = PlanConfig::new(w);
    cfg.strategy = strategy;
    cfg.seq_len = 1;
    plan(m.spec(), &cfg).unwrap()
}

struct Out {
    params: Vec<Vec<Vec<f32>>>,
    steps_taken: u64,
}

/// Runs `steps` steps at `plan`, optionally resuming from `ckpt` first and saving to `save_to`
/// afterwards. Returns the full parameters after the load (before training) and at the end.
fn run(
    m: &DotModel,
    p: &ShardPlan,
    ckpt: Option<&Path>,
    steps: u64,
    save_to: Option<&Path>,
) -> (Out, Out) {
    let layout = CheckpointLayout::from_plan(m.spec().clone(), p).unwrap();
    let s = p.shard_size as usize;
    let w = p.world_size() as usize;
    let topo = Topology::new(s, w / s).unwrap();
    let init = m.init_params(0);
    let opened = ckpt.map(|d| Checkpoint::open(d, Verify::Checksums).unwrap());
    let states = std::sync::Mutex::new(Vec::new());
    let results = run_threads(topo, Duration::from_secs(60), |comm| {
        let mut e = RankEngine::new(m, p, &comm, ecfg(), &init).unwrap();
        let rank = e.rank() as u64;
        if let Some(ck) = &opened {
            let st = ck.load_rank(&layout, rank).unwrap();
            let step = ck.manifest().train.optimizer.step;
            e.import_state(&ckpt_to_engine(&layout, rank, st, step))
                .unwrap();
        }
        let after_load = Out {
            params: e.full_params().unwrap(),
            steps_taken: e.steps_taken(),
        };
        let mb = m.batch(&[c()]).unwrap();
        for _ in 0..steps {
            e.train_step(std::slice::from_ref(&mb), 1e-2).unwrap();
        }
        states
            .lock()
            .unwrap()
            .push(engine_to_ckpt(&layout, &e.export_state().unwrap()).unwrap());
        let end = Out {
            params: e.full_params().unwrap(),
            steps_taken: e.steps_taken(),
        };
        (after_load, end)
    });
    if let Some(dir) = save_to {
        let mut st = states.into_inner().unwrap();
        st.sort_by_key(|r| r.rank);
        let refs: Vec<_> = st.iter().map(|r| r.as_refs()).collect();
        let step = results[0].as_ref().unwrap().1.steps_taken;
        let train = TrainState {
            step,
            optimizer: OptimizerState {
                lr: 1e-2,
                step,
                ..OptimizerState::default()
            },
            ..TrainState::default()
        };
        save_checkpoint(dir, &layout, &refs, &train, 1).unwrap();
    }
    let mut r: Vec<_> = results.into_iter().map(|x| x.unwrap()).collect();
    r.swap_remove(0)
}

fn bits(p: &[Vec<Vec<f32>>]) -> Vec<u32> {
    p.iter().flatten().flatten().map(|x| x.to_bits()).collect()
}

#[test]
fn reshard_any_world_size_bitwise_then_continue() {
    let m = model();
    let t = tempfile::tempdir().unwrap();
    let saved = t.path().join("w2");
    let p2 = plan_for(&m, 2, Strategy::FullShard);
    let (_, trained) = run(&m, &p2, None, 3, Some(&saved));
    assert_eq!(trained.steps_taken, 3);
    let ck = Checkpoint::open(&saved, Verify::Checksums).unwrap();
    assert_eq!(ck.manifest().train.optimizer.step, 3);
    let saved_m = ck.consolidate(StateKind::ExpAvg).unwrap();
    let saved_v = ck.consolidate(StateKind::ExpAvgSq).unwrap();
    assert!(
        saved_v.iter().all(|t| t.data.iter().all(|&x| x > 0.0)),
        "moments are real"
    );

    // Reference continuation at W=2 (from the checkpoint, the same path as every other W).
    let (loaded2, ref_end) = run(&m, &p2, Some(&saved), 2, None);
    assert_eq!(bits(&loaded2.params), bits(&trained.params));

    let targets = [
        (1, Strategy::FullShard),
        (3, Strategy::FullShard),
        (4, Strategy::FullShard),
        (5, Strategy::FullShard),
        (8, Strategy::FullShard),
        (3, Strategy::NoShard),
        (4, Strategy::Hybrid { shard_size: 2 }),
    ];
    for (w, strategy) in targets {
        let pw = plan_for(&m, w, strategy);
        let out = t.path().join(format!("w{w}-{}", strategy.cli_name()));
        let (loaded, end) = run(&m, &pw, Some(&saved), 2, None);
        // After the load: parameters bit for bit, step count restored.
        assert_eq!(
            bits(&loaded.params),
            bits(&trained.params),
            "W={w} {strategy}: params after load"
        );
        assert_eq!(loaded.steps_taken, 3, "W={w}: step count");
        // Moments bit for bit: export at W' immediately after the load, consolidate, compare.
        let (_, _) = run(&m, &pw, Some(&saved), 0, Some(&out));
        let ck2 = Checkpoint::open(&out, Verify::Checksums).unwrap();
        assert_eq!(ck2.manifest().world_size, w);
        let m2 = ck2.consolidate(StateKind::ExpAvg).unwrap();
        let v2 = ck2.consolidate(StateKind::ExpAvgSq).unwrap();
        assert_eq!(m2.len(), saved_m.len(), "W={w} {strategy}: first moments");
        assert_eq!(v2.len(), saved_v.len(), "W={w} {strategy}: second moments");
        for (a, b) in saved_m.iter().zip(&m2).chain(saved_v.iter().zip(&v2)) {
            assert_eq!(a.name, b.name);
            let bits = |d: &[f32]| d.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&b.data),
                bits(&a.data),
                "W={w} {strategy}: moments of {} differ after the load",
                a.name
            );
        }
        // The continuations are bitwise the W=2 one: the same data in every step.
        assert_eq!(
            bits(&end.params),
            bits(&ref_end.params),
            "W={w} {strategy}: params after the continuation"
        );
        assert_eq!(end.steps_taken, 5);
    }
}

#[test]
fn reshard_refuses_another_model_before_changing_state() {
    let m = model();
    let t = tempfile::tempdir().unwrap();
    let p2 = plan_for(&m, 2, Strategy::FullShard);
    run(&m, &p2, None, 1, Some(t.path()));
    let other = DotModel::new(
        "reshard-other",
        &[("w1", &[10, 3]), ("b1", &[8]), ("w2", &[5, 5])],
        vec![vec![0.0; 30], vec![0.0; 8], vec![0.0; 25]],
    );
    let po = plan_for(&other, 3, Strategy::FullShard);
    let layout = CheckpointLayout::from_plan(other.spec().clone(), &po).unwrap();
    let ck = Checkpoint::open(t.path(), Verify::Checksums).unwrap();
    let e = ck.load_rank(&layout, 0).unwrap_err().to_string();
    assert!(
        e.contains("`b1`") && e.contains("[7]") && e.contains("[8]"),
        "{e}"
    );
}

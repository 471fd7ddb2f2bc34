//! The engine's device path ([`Placement::Device`]: every flat buffer a candle tensor, the
//! flat-buffer kernels of `fsdp_kernels::tensor`, collectives on tensor buffers, unsharded
//! parameters as views of the gathered buffer) run on the CPU device, against the host path
//! ([`Placement::Host`]): bit for bit equal losses, gradient shards, final parameters,
//! optimizer state and memory-ledger peaks, for every strategy, world sizes 1 to 4, mixed
//! precision, gradient accumulation with sync on the last micro-batch, and checkpoint
//! export/import across the two placements; full shard and hybrid without activation
//! checkpointing (kept graphs whose parameter storages are emptied at reshard and refilled by
//! the backward all-gather) equal both the other placement and the checkpointed run. This is
//! the CPU test of the logic the CUDA
//! device runs; tiny GPT on tinyshakespeare.

use candle_core::Device;
use fsdp::model::Gpt;
use fsdp::optim::{AdamWConfig, Optimizer, SgdConfig};
use fsdp::runtime::{
    Clip, EngineConfig, InitSync, MicroBatch, NormType, Placement, RankEngine, RankState,
    StagedModel,
};
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{plan, GradSync, PlanConfig, Strategy};
use fsdp_types::DType;
use std::time::Duration;

mod common;
use common::{micro_batch, text, B, T};

const STEPS: usize = 3;

#[derive(Clone, Copy, Debug)]
struct Case {
    strategy: Strategy,
    w: usize,
    kk: usize,
    sync: GradSync,
    param: DType,
    reduce: DType,
    sgd: bool,
    /// `PlanConfig::activation_checkpointing`.
    ckpt: Option<bool>,
    prefetch: u64,
}

impl Case {
    fn new(strategy: Strategy, w: usize) -> Case {
        Case {
            strategy,
            w,
            kk: 1,
            sync: GradSync::EveryMicroBatch,
            param: DType::F32,
            reduce: DType::F32,
            sgd: false,
            ckpt: None,
            prefetch: 1,
        }
    }
}

/// Everything one rank-0 run produced, as bits.
#[derive(Debug, PartialEq)]
struct Run {
    losses: Vec<u64>,
    grad_norms: Vec<Option<u64>>,
    /// Gradient shards after the last accumulate (before the optimizer step).
    grads: Vec<Vec<Vec<u32>>>,
    params: Vec<Vec<Vec<u32>>>,
    state: RankStateBits,
    ledger: String,
    loss_scale: Option<u64>,
}

#[derive(Debug, PartialEq)]
struct RankStateBits(Vec<(Vec<u32>, Vec<Vec<u32>>)>);

fn state_bits(st: &RankState) -> RankStateBits {
    RankStateBits(
        st.flats
            .iter()
            .map(|f| {
                (
                    bits32(&f.param),
                    f.optimizer_state.iter().map(|(_, v)| bits32(v)).collect(),
                )
            })
            .collect(),
    )
}

fn bits32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn optimizer(sgd: bool) -> Optimizer {
    if sgd {
        Optimizer::Sgd(SgdConfig {
            lr: 3e-2,
            momentum: 0.9,
            weight_decay: 0.01,
        })
    } else {
        Optimizer::AdamW(AdamWConfig {
            lr: 3e-3,
            weight_decay: 0.1,
            ..AdamWConfig::default()
        })
    }
}

/// Trains `c` for [`STEPS`] steps on `placement` (every rank), optionally importing `resume`
/// first, and returns rank 0's run and its exported state.
fn run(c: Case, placement: Placement, resume: Option<&RankState>) -> (Run, RankState) {
    let model = Gpt::from_preset("tiny").unwrap();
    let mut cfg = PlanConfig::new(c.w as u64);
    cfg.strategy = c.strategy;
    cfg.grad_accum = c.kk as u64;
    cfg.grad_sync = c.sync;
    cfg.micro_batch = B as u64;
    cfg.seq_len = T as u64;
    cfg.param_dtype = c.param;
    cfg.reduce_dtype = c.reduce;
    cfg.activation_checkpointing = c.ckpt;
    cfg.prefetch = c.prefetch;
    if c.sgd {
        cfg.optimizer = fsdp_planner::Optimizer::Sgd { momentum: 0.9 };
    }
    let plan = plan(model.spec(), &cfg).unwrap();
    let s = plan.shard_size as usize;
    let topo = Topology::new(s, c.w / s).unwrap();
    let text = text();
    let init = StagedModel::init_params(&model, 1234);
    let ecfg = EngineConfig {
        optimizer: optimizer(c.sgd),
        clip: Some(Clip {
            max_norm: 0.5,
            norm: NormType::L2,
        }),
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    };
    let results = run_threads(topo, Duration::from_secs(120), |comm| {
        let mut e =
            RankEngine::new_on(&model, &plan, &comm, ecfg, &init, placement.clone()).unwrap();
        if let Some(st) = resume {
            // A state exported by rank 0 fits every rank of a world of one shard index only;
            // the resume cases run at world size 1.
            e.import_state(st).unwrap();
        }
        let mut losses = Vec::new();
        let mut grad_norms = Vec::new();
        let mut grads = Vec::new();
        let mut loss_scale = None;
        for step in 0..STEPS {
            let mbs: Vec<MicroBatch> = (0..c.kk)
                .map(|k| micro_batch(&text, step, k, e.rank(), c.w, c.kk))
                .collect();
            if step + 1 == STEPS {
                // The last step by hand, to look at the gradient shards before the update.
                let acc = e.accumulate(&mbs).unwrap();
                grads = e.grad_shards().unwrap();
                let g = e.clip_grad_norm(Clip {
                    max_norm: 0.5,
                    norm: NormType::L2,
                });
                grad_norms.push(Some(g.unwrap().to_bits()));
                e.optimizer_step(3e-3).unwrap();
                losses.push(acc.loss.to_bits());
            } else {
                let st = e.train_step(&mbs, 3e-3).unwrap();
                losses.push(st.loss.to_bits());
                grad_norms.push(st.grad_norm.map(f64::to_bits));
                loss_scale = st.loss_scale.map(f64::to_bits);
            }
        }
        let params = e.full_params().unwrap();
        let state = e.export_state().unwrap();
        let ledger = format!(
            "{:?}",
            [
                e.ledger().peak(fsdp_planner::Phase::Forward),
                e.ledger().peak(fsdp_planner::Phase::Backward),
                e.ledger().peak(fsdp_planner::Phase::OptimizerStep),
            ]
        );
        (
            Run {
                losses,
                grad_norms,
                grads: grads
                    .iter()
                    .map(|u| u.iter().map(|g| bits32(g)).collect())
                    .collect(),
                params: params
                    .iter()
                    .map(|u| u.iter().map(|p| bits32(p)).collect())
                    .collect(),
                state: state_bits(&state),
                ledger,
                loss_scale,
            },
            state,
        )
    });
    let mut all: Vec<(Run, RankState)> = results.into_iter().map(|r| r.unwrap()).collect();
    all.swap_remove(0)
}

fn check(c: Case) {
    let (host, _) = run(c, Placement::Host, None);
    let (dev, _) = run(c, Placement::Device(Device::Cpu), None);
    assert_eq!(host.losses, dev.losses, "{c:?}: losses");
    assert_eq!(host.grad_norms, dev.grad_norms, "{c:?}: grad norms");
    assert_eq!(host.grads, dev.grads, "{c:?}: gradient shards");
    assert_eq!(host.params, dev.params, "{c:?}: final parameters");
    assert_eq!(
        host.state, dev.state,
        "{c:?}: master shards and optimizer state"
    );
    assert_eq!(host.ledger, dev.ledger, "{c:?}: memory-ledger peaks");
    assert_eq!(host.loss_scale, dev.loss_scale, "{c:?}: loss scale");
    // The runs trained: the loss moved and some gradient is non-zero.
    assert_ne!(host.losses[0], host.losses[STEPS - 1], "{c:?}: loss moved");
    assert!(
        host.grads
            .iter()
            .flatten()
            .flatten()
            .any(|&b| f32::from_bits(b) != 0.0),
        "{c:?}: non-zero gradients"
    );
}

#[test]
fn device_path_equals_host_full_shard_w1_w2_w4() {
    for w in [1, 2, 4] {
        check(Case::new(Strategy::FullShard, w));
    }
}

#[test]
fn device_path_equals_host_shard_grad_op_ddp_hybrid() {
    check(Case::new(Strategy::ShardGradOp, 2));
    check(Case::new(Strategy::NoShard, 2));
    check(Case::new(Strategy::Hybrid { shard_size: 2 }, 4));
}

#[test]
fn device_path_equals_host_mixed_precision() {
    for (param, reduce, strategy, w) in [
        (DType::BF16, DType::BF16, Strategy::FullShard, 2),
        (DType::BF16, DType::F32, Strategy::FullShard, 1),
        (DType::F16, DType::F32, Strategy::FullShard, 2),
        (
            DType::BF16,
            DType::BF16,
            Strategy::Hybrid { shard_size: 2 },
            4,
        ),
    ] {
        let mut c = Case::new(strategy, w);
        c.param = param;
        c.reduce = reduce;
        check(c);
    }
}

#[test]
fn device_path_equals_host_grad_accumulation_and_sgd() {
    for (sync, reduce) in [
        (GradSync::LastMicroBatch, DType::BF16),
        (GradSync::LastMicroBatch, DType::F32),
        (GradSync::EveryMicroBatch, DType::F32),
    ] {
        let mut c = Case::new(Strategy::FullShard, 2);
        c.kk = 2;
        c.sync = sync;
        c.reduce = reduce;
        c.param = if reduce == DType::BF16 {
            DType::BF16
        } else {
            DType::F32
        };
        check(c);
    }
    let mut c = Case::new(Strategy::FullShard, 2);
    c.sgd = true;
    check(c);
}

#[test]
fn checkpoint_state_moves_between_host_and_device() {
    for w1_strategy in [Strategy::FullShard, Strategy::NoShard] {
        let c = Case::new(w1_strategy, 1);
        let (_, st) = run(c, Placement::Host, None);
        // Resume the host state on both placements: identical continuation.
        let (host, _) = run(c, Placement::Host, Some(&st));
        let (dev, dev_state) = run(c, Placement::Device(Device::Cpu), Some(&st));
        assert_eq!(host.losses, dev.losses, "resumed losses");
        assert_eq!(host.params, dev.params, "resumed parameters");
        // And the device's exported state resumes on the host like the host's own.
        let (a, _) = run(c, Placement::Host, Some(&dev_state));
        let (b, _) = run(c, Placement::Device(Device::Cpu), Some(&dev_state));
        assert_eq!(a.losses, b.losses);
        assert_eq!(a.state, b.state);
    }
}

/// Full shard / hybrid without activation checkpointing on both placements (host: one storage
/// per parameter; device: views of the gathered flat buffer, one storage per flat parameter):
/// bitwise equal to each other and to the checkpointed run (losses, grad norms, gradient
/// shards, parameters, optimizer state, ledger peaks, loss scale), f32/bf16/f16, gradient
/// accumulation with both sync modes, prefetch 0, 1 (all-gathers on the comm thread) and 2.
#[test]
fn no_activation_checkpointing_equals_checkpointing_on_both_placements() {
    let mut cases = Vec::new();
    for (strategy, w) in [
        (Strategy::FullShard, 2),
        (Strategy::FullShard, 4),
        (Strategy::Hybrid { shard_size: 2 }, 4),
        (Strategy::FullShard, 1),
    ] {
        cases.push(Case::new(strategy, w));
    }
    for (param, reduce) in [(DType::BF16, DType::BF16), (DType::F16, DType::F32)] {
        let mut c = Case::new(Strategy::FullShard, 2);
        c.param = param;
        c.reduce = reduce;
        cases.push(c);
    }
    let mut c = Case::new(Strategy::FullShard, 1);
    c.param = DType::BF16;
    cases.push(c);
    for (sync, prefetch) in [
        (GradSync::EveryMicroBatch, 0),
        (GradSync::LastMicroBatch, 2),
    ] {
        let mut c = Case::new(Strategy::FullShard, 2);
        c.kk = 2;
        c.sync = sync;
        c.prefetch = prefetch;
        cases.push(c);
    }
    for mut c in cases {
        c.ckpt = Some(false);
        check(c);
        let (off, _) = run(c, Placement::Device(Device::Cpu), None);
        c.ckpt = Some(true);
        let (on, _) = run(c, Placement::Device(Device::Cpu), None);
        assert_eq!(off, on, "{c:?}: without vs with checkpointing (device)");
    }
}

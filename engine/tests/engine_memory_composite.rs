//! The composite ops path (`OpsPath::Composite`, what a CUDA device runs) against the plan's
//! composite activation model (`ActivationModel::Composite`), measured on the CPU with the
//! counting allocator: the composite path allocates the same tensors on any candle device, so
//! the CPU heap measures what the device will hold.

use candle_core::{DType, Device, Tensor, Var};
use fsdp::memory::CountingAllocator;
use fsdp::model::{Gpt, OpsPath, Stage};
use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::{EngineConfig, InitSync, MicroBatch, Placement, RankEngine};
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::memory::use_activations;
use fsdp_planner::schedule::UseRole;
use fsdp_planner::{plan, ActivationModel, PlanConfig, Strategy};
use fsdp_types::DType as PDType;
use std::time::Duration;

#[path = "support/process_peak.rs"]
mod process_peak;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

fn pdtype(dt: DType) -> PDType {
    match dt {
        DType::F32 => PDType::F32,
        DType::BF16 => PDType::BF16,
        DType::F16 => PDType::F16,
        _ => unreachable!(),
    }
}

/// Per-stage heap bytes of the composite path: held after forward (input excluded, output
/// included) and the peak of backward above the same base, with the planner's estimate.
/// `cargo test -p fsdp --test engine_memory_composite -- --ignored --nocapture stage_bytes`
#[test]
#[ignore = "measurement: run alone with --ignored --nocapture"]
fn stage_bytes() {
    for pass in 0..2 {
        for preset in ["tiny", "mini", "small"] {
            let model = Gpt::from_preset(preset)
                .unwrap()
                .with_ops_path(OpsPath::Composite);
            let d = model.d_model();
            for dt in [DType::F32, DType::BF16] {
                let params: Vec<Vec<Tensor>> = model
                    .params_to_tensors(&model.init_params(1), &Device::Cpu)
                    .unwrap()
                    .into_iter()
                    .map(|u| u.into_iter().map(|t| t.to_dtype(dt).unwrap()).collect())
                    .collect();
                for (b, t) in [(2usize, 64usize), (8, 128), (4, 256), (2, 256)] {
                    let mut pc = PlanConfig::new(1);
                    pc.micro_batch = b as u64;
                    pc.seq_len = t as u64;
                    pc.param_dtype = pdtype(dt);
                    pc.activations = ActivationModel::Composite;
                    for (stage, unit) in [
                        model.stages()[0],
                        model.stages()[1],
                        *model.stages().last().unwrap(),
                    ] {
                        let vars: Vec<Tensor> = params[unit]
                            .iter()
                            .map(|p| Var::from_tensor(p).unwrap().as_tensor().clone())
                            .collect();
                        let ids: Vec<u32> = (0..b * t).map(|i| (i * 31 % 256) as u32).collect();
                        let ids = Tensor::from_vec(ids, (b, t), &Device::Cpu).unwrap();
                        let x = match stage {
                            Stage::Embed => ids.clone(),
                            _ => Var::from_tensor(
                                &Tensor::randn(0f32, 1.0, (b, t, d), &Device::Cpu)
                                    .unwrap()
                                    .to_dtype(dt)
                                    .unwrap(),
                            )
                            .unwrap()
                            .as_tensor()
                            .clone(),
                        };
                        let base = ALLOC.current();
                        ALLOC.reset_peak();
                        let y = match stage {
                            Stage::Head => model.head_loss(&vars, &x, &ids).unwrap(),
                            _ => model.forward_stage(stage, &vars, &x).unwrap(),
                        };
                        let live = ALLOC.current() - base;
                        let g = y.ones_like().unwrap();
                        ALLOC.reset_peak();
                        let root = if matches!(stage, Stage::Head) {
                            y
                        } else {
                            fsdp::model::ops::backward_seed(&y, &g).unwrap()
                        };
                        let grads = root.backward().unwrap();
                        let bwd_peak = ALLOC.peak() - base;
                        drop((root, grads, g));
                        let role = match stage {
                            Stage::Embed => UseRole::Embedding,
                            Stage::Block(_) => UseRole::Block,
                            Stage::Head => UseRole::Head,
                        };
                        let est = use_activations(&model.spec.arch, role, &pc);
                        if pass == 1 {
                            println!(
                                "{preset:5} {dt:?} B={b} T={t:3} {stage:?}: live {live} plan {} ({:.4}) | bwd_extra {} plan {} ({:.3}) | output {}",
                                est.live.0,
                                est.live.0 as f64 / live as f64,
                                bwd_peak - live,
                                est.backward.0 + est.output.0,
                                (est.backward.0 + est.output.0) as f64 / (bwd_peak - live) as f64,
                                est.output.0
                            );
                        }
                    }
                }
            }
        }
    }
}

fn batch(b: usize, t: usize, salt: usize) -> MicroBatch {
    let ids: Vec<u32> = (0..b * t)
        .map(|i| ((i * 31 + salt * 7) % 256) as u32)
        .collect();
    let tg: Vec<u32> = (0..b * t).map(|i| ((i * 17 + salt) % 256) as u32).collect();
    MicroBatch {
        input: Tensor::from_vec(ids, (b, t), &Device::Cpu).unwrap(),
        target: Tensor::from_vec(tg, (b, t), &Device::Cpu).unwrap(),
        count: (b * t) as u64,
    }
}

/// One configuration of [`composite_process_peak_within_5_percent_of_plan`].
struct Cfg {
    preset: &'static str,
    w: usize,
    strategy: Strategy,
    dtype: PDType,
    b: usize,
    t: usize,
}

/// What one configuration measured: the process heap peak of one training step (all ranks,
/// after a warm-up step, minus what was live before the step apart from the engines' own
/// ledger bytes) and `W x` the plan's per-rank peak.
struct Measured {
    measured: u64,
    planned: u64,
    activations: u64,
    /// `W x` the per-rank peak of the same plan with the fused activation model.
    planned_fused: u64,
}

fn measure(c: &Cfg) -> Measured {
    let model = Gpt::from_preset(c.preset)
        .unwrap()
        .with_ops_path(OpsPath::Composite);
    let mut pc = PlanConfig::new(c.w as u64);
    pc.strategy = c.strategy;
    pc.micro_batch = c.b as u64;
    pc.seq_len = c.t as u64;
    pc.param_dtype = c.dtype;
    pc.reduce_dtype = c.dtype;
    pc.activations = ActivationModel::Composite;
    let plan = plan(&model.spec, &pc).unwrap();
    let fused = fsdp_planner::plan(
        &model.spec,
        &PlanConfig {
            activations: ActivationModel::Fused,
            ..pc.clone()
        },
    )
    .unwrap();
    let s = plan.shard_size as usize;
    let init = model.init_params(1);
    let mbs: Vec<MicroBatch> = vec![batch(c.b, c.t, 0)];
    let ecfg = EngineConfig {
        optimizer: Optimizer::AdamW(AdamWConfig::default()),
        clip: None,
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    };
    let res = run_threads(
        Topology::new(s, c.w / s).unwrap(),
        Duration::from_secs(60),
        |comm| {
            let mut e = RankEngine::new_on(
                &model,
                &plan,
                &comm,
                ecfg,
                &init,
                Placement::Device(Device::Cpu),
            )
            .unwrap();
            process_peak::second_step_sample(&mut e, &mbs, &ALLOC)
        },
    );
    let res: Vec<_> = res.into_iter().map(|r| r.unwrap()).collect();
    let measured = process_peak::measured_bytes(&res);
    Measured {
        measured,
        planned: plan.memory.peak.0 * c.w as u64,
        activations: plan
            .memory
            .phase(plan.memory.peak_phase)
            .at_peak
            .activations
            .0,
        planned_fused: fused.memory.peak.0 * c.w as u64,
    }
}

/// The plan's device bytes checked against the device's measured usage, within 5%, on the
/// CPU: the tiny/mini GPT on the composite ops path (`OpsPath::Composite`, what
/// `OpsPath::Auto` runs on CUDA) with its flat buffers as candle tensors
/// (`Placement::Device(Device::Cpu)`), planned with `ActivationModel::Composite`; the process
/// heap peak of one training step against `W x` the plan's per-rank peak.
///
/// Asserted: within [0.95, 1.05] at W = 1, f32 and bf16 (measured 0.975-0.995: tiny
/// 8 x 128 0.991 f32 / 0.992 bf16, mini 4 x 128 0.975 / 0.976, mini no-shard bf16 2 x 256
/// 0.995); W = 2 within [0.85, 1.05] (tiny shard-grad-op bf16 4 x 128: 0.886-0.948 over
/// runs on a loaded machine; mini full shard bf16 0.916, no-shard f32 0.923), because two rank
/// threads share one process-wide counter and reach their backward spikes at different
/// instants (the same bound as full shard at W = 2 in `engine_memory_process`); one rank per
/// GPU, as `fsdp launch` runs it, is the W = 1 measurement. The plan stays above the measurement because it adds the unit's flat gradient
/// (`unsharded_grads`, exact in the ledger) to candle's backward spike, while the engine
/// allocates it after candle's backward returned (the 2.5% of mini at 4 x 128). The fused
/// activation model on the same runs plans 1.3x to 3.2x too little (printed).
/// `FSDP_MEMORY_TABLE=1 cargo test -p fsdp --test engine_memory_composite -- --nocapture`
/// prints every figure, with more configurations.
#[test]
fn composite_process_peak_within_5_percent_of_plan() {
    let configs = [
        ("tiny", 1, Strategy::FullShard, PDType::F32, 8, 128),
        ("tiny", 1, Strategy::FullShard, PDType::BF16, 8, 128),
        ("mini", 1, Strategy::FullShard, PDType::F32, 4, 128),
        ("mini", 1, Strategy::FullShard, PDType::BF16, 4, 128),
        ("mini", 1, Strategy::NoShard, PDType::BF16, 2, 256),
        ("tiny", 2, Strategy::ShardGradOp, PDType::BF16, 4, 128),
    ];
    let configs: Vec<_> = if std::env::var_os("FSDP_MEMORY_TABLE").is_some() {
        configs
            .into_iter()
            .chain([
                ("tiny", 1, Strategy::FullShard, PDType::F32, 4, 256),
                ("mini", 1, Strategy::FullShard, PDType::F32, 8, 128),
                ("mini", 1, Strategy::FullShard, PDType::BF16, 8, 128),
                ("mini", 1, Strategy::ShardGradOp, PDType::F32, 2, 64),
                ("mini", 2, Strategy::FullShard, PDType::BF16, 4, 128),
                ("mini", 2, Strategy::NoShard, PDType::F32, 4, 128),
            ])
            .collect()
    } else {
        configs.to_vec()
    };
    let mut bad = Vec::new();
    for (preset, w, strategy, dtype, b, t) in configs {
        let m = measure(&Cfg {
            preset,
            w,
            strategy,
            dtype,
            b,
            t,
        });
        let ratio = m.measured as f64 / m.planned as f64;
        println!(
            "{preset} W={w} {strategy} {dtype} B={b} T={t}: measured {} B, plan {} B \
             (activations {} B/rank), ratio {ratio:.4}; fused-model plan {} B, ratio {:.4}",
            m.measured,
            m.planned,
            m.activations,
            m.planned_fused,
            m.measured as f64 / m.planned_fused as f64
        );
        // Two rank threads share one process counter and reach their peaks at different
        // instants (they meet only at collectives), so W = 2 reads a few percent low.
        let low = if w > 1 { 0.85 } else { 0.95 };
        if !(low..=1.05).contains(&ratio) {
            bad.push(format!(
                "{preset} W={w} {strategy} {dtype} B={b} T={t}: {ratio:.4}"
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "process peak / plan total outside [0.95 (W > 1: 0.85), 1.05]: {bad:?}"
    );
}

/// Backward peak above the kept graph of single composite ops (f32), in bytes per output
/// element: where the block's calibrated `64 f h` per token comes from.
/// `cargo test -p fsdp --test engine_memory_composite -- --ignored --nocapture op_bytes`
#[test]
#[ignore = "measurement: run alone with --ignored --nocapture"]
fn op_bytes() {
    use fsdp::model::composite;
    let (n, h) = (1024usize, 256usize);
    for pass in 0..2 {
        for (name, rows, cols) in [
            ("bias_gelu", n, 4 * h),
            ("layer_norm", n, h),
            ("bias_add", n, h),
            ("softmax", 4 * 256, 256),
        ] {
            let x =
                Var::from_tensor(&Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu).unwrap())
                    .unwrap();
            let b =
                Var::from_tensor(&Tensor::randn(0f32, 1.0, cols, &Device::Cpu).unwrap()).unwrap();
            let w =
                Var::from_tensor(&Tensor::randn(0f32, 1.0, cols, &Device::Cpu).unwrap()).unwrap();
            let base = ALLOC.current();
            let y = match name {
                "bias_gelu" => composite::bias_gelu(x.as_tensor(), Some(b.as_tensor())).unwrap(),
                "layer_norm" => {
                    composite::layer_norm(x.as_tensor(), w.as_tensor(), Some(b.as_tensor()), 1e-5)
                        .unwrap()
                }
                "bias_add" => composite::bias_add(x.as_tensor(), b.as_tensor()).unwrap(),
                _ => composite::causal_softmax(&x.as_tensor().reshape((4, 256, 256)).unwrap(), 0.1)
                    .unwrap(),
            };
            let live = ALLOC.current() - base;
            let g = y.ones_like().unwrap();
            ALLOC.reset_peak();
            let root = fsdp::model::ops::backward_seed(&y, &g).unwrap();
            let grads = root.backward().unwrap();
            let peak = ALLOC.peak() - base;
            drop((root, grads, g, y));
            let el = (rows * cols) as f64;
            if pass == 1 {
                println!(
                    "{name}: live {:.2} B/elem, backward above live (incl. seed g) {:.2} B/elem",
                    live as f64 / el,
                    (peak - live) as f64 / el
                );
            }
        }
    }
}

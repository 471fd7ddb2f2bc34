//! The process heap peak measured by the counting allocator against the plan's total
//! (W x per-rank peak, activations estimated by the planner). One test in this binary, so no
//! concurrent test shares the allocator's counters.

use candle_core::{Device, Tensor};
use fsdp::memory::CountingAllocator;
use fsdp::model::decoder::Decoder;
use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::{EngineConfig, InitSync, MicroBatch, Placement, RankEngine, StagedModel};
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{plan, Offload, PlanConfig, Strategy};
use std::time::Duration;

#[path = "support/process_peak.rs"]
mod process_peak;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

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

struct Cfg {
    preset: &'static str,
    w: usize,
    strategy: Strategy,
    b: usize,
    t: usize,
    /// `PlanConfig::activation_checkpointing`.
    ckpt: Option<bool>,
    /// `PlanConfig::offload`; `Some` runs on `Placement::Device(Device::Cpu)`.
    offload: Option<Offload>,
    /// Runs on `Placement::Device(Device::Cpu)` (the placement offload needs) instead of the
    /// host placement.
    cpu_device: bool,
}

fn ecfg() -> EngineConfig {
    EngineConfig {
        optimizer: Optimizer::AdamW(AdamWConfig::default()),
        clip: None,
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    }
}

/// Process heap peak during one training step (all ranks, after a warm-up step; minus what was
/// live before the step apart from the engines' own ledger bytes) over W x the plan's peak,
/// device and host memory added (on the CPU device both are this process's heap).
fn process_peak_ratio(c: &Cfg) -> f64 {
    let model = Decoder::from_preset(c.preset).unwrap();
    let mut pc = PlanConfig::new(c.w as u64);
    pc.strategy = c.strategy;
    pc.micro_batch = c.b as u64;
    pc.seq_len = c.t as u64;
    pc.activation_checkpointing = c.ckpt;
    pc.offload = c.offload;
    let plan = plan(model.spec(), &pc).unwrap();
    let placement = if c.cpu_device {
        Placement::Device(Device::Cpu)
    } else {
        Placement::Host
    };
    let s = plan.shard_size as usize;
    let init = StagedModel::init_params(&model, 1);
    let mbs: Vec<MicroBatch> = vec![batch(c.b, c.t, 0)];
    let res = run_threads(
        Topology::new(s, c.w / s).unwrap(),
        Duration::from_secs(60),
        |comm| {
            let mut e =
                RankEngine::new_on(&model, &plan, &comm, ecfg(), &init, placement.clone()).unwrap();
            process_peak::second_step_sample(&mut e, &mbs, &ALLOC)
        },
    );
    let res: Vec<_> = res.into_iter().map(|r| r.unwrap()).collect();
    let measured = process_peak::measured_bytes(&res);
    let planned = (plan.memory.peak.0 + plan.memory.host_peak.0) * c.w as u64;
    let ratio = measured as f64 / planned as f64;
    println!(
        "{} W={} {} offload {:?} checkpointing {} B={} T={}: measured {measured} B, plan {planned} B (host {} B/rank, activations {} B/rank), ratio {ratio:.3}",
        c.preset, c.w, c.strategy, c.offload, plan.schedule.activation_checkpointing, c.b, c.t,
        plan.memory.host_peak.0,
        plan.memory.phase(plan.memory.peak_phase).at_peak.activations.0
    );
    ratio
}

/// The process peak against the plan's total (within 10%), for full shard,
/// shard-grad-op and DDP (no-shard) at W=2 on `mini` (d 256, 4 layers) and `small` (d 384,
/// 6 layers) with a short and an activation-heavy (B, T).
///
/// The plan's activations are `fsdp_planner::memory::UseActivations`: forward tensors counted
/// op by op for this engine's GPT (they match the allocator to 0.2%), and candle's backward
/// (gradient store, parameter gradients) fitted on `cargo run -p fsdp --example
/// activation_bytes` (within 5% per block). Before that model (Korthikanti-style forward
/// estimate, no backward term) the ratio was 1.16 x to 1.72 x, the plan far too low.
///
/// Asserted: shard-grad-op and DDP within [0.90, 1.10] (measured 0.95 to 0.98), full shard
/// without activation checkpointing (the default) too (0.94 to 0.98); W=1 within [0.90, 1.10]
/// (measured 0.92-0.96 for `mini` 8 x 128); activation checkpointing at W=2 (full shard or
/// shard-grad-op with it) never above 1.10 (the plan is not exceeded by more than 10%) and at
/// least 0.85: measured 0.88 to 0.956 (backward coefficients refit after the vendored candle
/// stopped storing each first gradient through a zero tensor plus a sum), a few percent lower
/// from run to run under load. Why recompute
/// at W=2 is not held to 0.90 here: its per-rank peak is a short spike (the recomputed
/// block's graph plus candle's gradient store at the attention/MLP gradients), and the
/// process-wide counter sums two rank threads that do not reach that spike at the same instant
/// (they meet only at collectives), so the process peak falls below W x one rank's peak by a
/// timing-dependent 3-5% (compare W=1). The rest of the margin: the plan adds the unit's flat
/// gradient (ledger `unsharded_grads`, exact) to that spike while the engine allocates it only
/// after candle's backward returns (about 3% of the peak for `mini`), and the fitted backward
/// coefficients are rounded up.
/// The Llama presets (`llama-tiny`, `llama-mini`) on their fused ops, against the planner's
/// Llama terms (the **Llama** paragraph of `UseActivations`, measured op by op): full shard
/// and shard-grad-op at W=2 and full shard at W=1, with and without activation checkpointing,
/// measured 0.93 to 0.98 (before the fused RMSNorm / rotary / SwiGLU ops and the refit,
/// `llama-tiny` measured 1.17: the plan was too low), under the same bounds as the GPT.
/// Offload and shard-optimizer (ZeRO-1) run on the CPU device, where the host memory offload
/// moves state to and the device memory are the same heap, against W x (device peak + host
/// peak): optimizer offload, parameter offload and shard-optimizer, with and without optimizer
/// offload, on `mini` 8 x 128 measured 0.942 to 0.967, and on `small` 1 x 16
/// (parameter-dominated) 0.955 to 0.993. Same lower bounds; upper bound 1.03, as nothing in
/// these rows lifts the process above the plan (a copy of each downloaded gradient shard
/// kept, a host buffer the host ledger does not charge, measured 1.049 on `small`). Buffers
/// allocated before the measured step (a second master copy made at construction) are
/// outside this protocol: `init_memory` measures construction, offload included.
/// `FSDP_MEMORY_TABLE=1 cargo test -p fsdp --test engine_memory_process -- --nocapture`
/// prints every figure (and `tiny`, 0.83 to 0.88 under full shard with checkpointing at
/// 8 x 128).
#[test]
fn memory_process_peak_within_10_percent_of_plan() {
    let configs = [
        ("mini", 2, Strategy::FullShard, 2, 64, Some(true)),
        ("mini", 2, Strategy::FullShard, 8, 128, Some(true)),
        ("mini", 2, Strategy::ShardGradOp, 8, 128, None),
        ("mini", 2, Strategy::NoShard, 2, 64, None),
        ("small", 2, Strategy::FullShard, 4, 128, Some(true)),
        ("small", 2, Strategy::ShardGradOp, 2, 64, None),
        ("small", 2, Strategy::NoShard, 2, 64, None),
        // One rank: full shard without a second thread to misalign with.
        ("mini", 1, Strategy::FullShard, 8, 128, Some(true)),
        // Activation checkpointing independent of the strategy. Full shard without it (the
        // default) keeps every graph but frees the unsharded parameters after forward:
        // `small` at 1 x 16
        // tokens is parameter-dominated, so parameters the graphs kept alive would show:
        // measured 0.960 of the plan, and 1.196 with the storage release disabled by hand).
        ("mini", 2, Strategy::FullShard, 8, 128, None),
        ("mini", 1, Strategy::FullShard, 8, 128, None),
        ("small", 2, Strategy::FullShard, 1, 16, Some(false)),
        ("mini", 2, Strategy::ShardGradOp, 8, 128, Some(true)),
        // The Llama family on its fused ops (RMSNorm, rotary embedding, SwiGLU; the
        // planner's `llama` activation terms): full shard and shard-grad-op at W=2, one rank,
        // each with and without activation checkpointing.
        ("llama-tiny", 2, Strategy::FullShard, 8, 128, None),
        ("llama-tiny", 2, Strategy::FullShard, 8, 128, Some(true)),
        ("llama-tiny", 2, Strategy::ShardGradOp, 8, 128, None),
        ("llama-tiny", 2, Strategy::ShardGradOp, 4, 64, Some(true)),
        ("llama-tiny", 1, Strategy::FullShard, 8, 128, None),
        ("llama-tiny", 1, Strategy::FullShard, 8, 128, Some(true)),
        ("llama-mini", 2, Strategy::FullShard, 8, 128, None),
        ("llama-mini", 2, Strategy::FullShard, 4, 128, Some(true)),
        ("llama-mini", 2, Strategy::ShardGradOp, 8, 128, None),
        ("llama-mini", 1, Strategy::FullShard, 8, 128, None),
    ];
    // Offload and shard-optimizer on the CPU device, where device and host memory are both
    // this process's heap: the process peak against W x (device peak + host peak) of the plan.
    // A host buffer the host ledger does not charge (a leaked staging copy, a second master)
    // shows here, not in the ledger-against-plan test.
    let cpu_rows = [
        (
            "mini",
            2,
            Strategy::FullShard,
            8,
            128,
            None,
            Some(Offload::Optimizer),
        ),
        (
            "mini",
            2,
            Strategy::FullShard,
            8,
            128,
            None,
            Some(Offload::Params),
        ),
        ("mini", 2, Strategy::ShardOptimizer, 8, 128, None, None),
        (
            "mini",
            2,
            Strategy::ShardOptimizer,
            8,
            128,
            None,
            Some(Offload::Optimizer),
        ),
        (
            "small",
            2,
            Strategy::FullShard,
            1,
            16,
            Some(false),
            Some(Offload::Params),
        ),
        ("small", 2, Strategy::ShardOptimizer, 1, 16, None, None),
    ];
    let rows = configs
        .into_iter()
        .map(|(p, w, s, b, t, c)| (p, w, s, b, t, c, None, false))
        .chain(
            cpu_rows
                .into_iter()
                .map(|(p, w, s, b, t, c, o)| (p, w, s, b, t, c, o, true)),
        );
    let table = std::env::var_os("FSDP_MEMORY_TABLE").is_some();
    let mut bad = Vec::new();
    for (preset, w, strategy, b, t, ckpt, offload, cpu_device) in rows {
        let ratio = process_peak_ratio(&Cfg {
            preset,
            w,
            strategy,
            b,
            t,
            ckpt,
            offload,
            cpu_device,
        });
        let recompute = ckpt.unwrap_or(strategy.reshard_after_forward());
        let low = if recompute && w > 1 { 0.85 } else { 0.9 };
        let high = if cpu_device { 1.03 } else { 1.1 };
        if !(low..=high).contains(&ratio) {
            bad.push(format!(
                "{preset} W={w} {strategy} offload {offload:?} checkpointing {ckpt:?} B={b} T={t}: {ratio:.3}"
            ));
        }
    }
    if table {
        for (preset, strategy, b, t) in [
            ("tiny", Strategy::FullShard, 8, 128),
            ("mini", Strategy::NoShard, 8, 128),
            ("small", Strategy::FullShard, 2, 64),
            ("small", Strategy::NoShard, 4, 128),
            ("llama-mini", Strategy::NoShard, 8, 128),
            ("llama-tiny", Strategy::FullShard, 4, 64),
        ] {
            process_peak_ratio(&Cfg {
                preset,
                w: 2,
                strategy,
                b,
                t,
                ckpt: (strategy == Strategy::FullShard).then_some(true),
                offload: None,
                cpu_device: false,
            });
        }
    }
    assert!(
        bad.is_empty(),
        "process peak / plan total outside [0.90 (full shard W>1: 0.85), 1.10 (CPU device rows: 1.03)]: {bad:?}"
    );
}

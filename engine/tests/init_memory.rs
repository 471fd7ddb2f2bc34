//! The process heap peak while the rank threads build their initial shards (a seeded random
//! initialisation, and a load of published weights) against the plan's initialisation bytes
//! ([`fsdp_planner::ShardPlan::init_bytes`], plus the host bytes beside them under offload):
//! the plan is never exceeded and at most 10% above what was measured (bands per row below),
//! and no rank ever holds the whole model (the bytes above the model states stay under a
//! quarter of the model's) unless rank 0 broadcasts the weights. One test in this binary, so
//! no concurrent test shares the allocator.

use candle_core::Device;
use fsdp::init::{FileWeights, ParamSource};
use fsdp::memory::CountingAllocator;
use fsdp::model::decoder::Decoder;
use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::{EngineConfig, InitSync, Placement, RankEngine, StagedModel};
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{plan, Offload, PlanConfig, Strategy};
use fsdp_types::Bytes;
use std::path::Path;
use std::time::Duration;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

/// Heap bytes allocated above the starting point while every rank builds its engine from
/// `source` with `sync` on `placement` (the engines are then dropped).
fn build_peak(
    model: &Decoder,
    p: &fsdp_planner::ShardPlan,
    source: &dyn ParamSource,
    sync: InitSync,
    placement: &Placement,
) -> u64 {
    let cfg = EngineConfig {
        optimizer: Optimizer::AdamW(AdamWConfig::default()),
        clip: None,
        init_sync: sync,
        enforce_memory_plan: true,
        nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    };
    let s = p.shard_size as usize;
    let w = p.world_size() as usize;
    let before = ALLOC.current();
    ALLOC.reset_peak();
    let res = run_threads(
        Topology::new(s, w / s).unwrap(),
        Duration::from_secs(120),
        |comm| {
            let mut e =
                RankEngine::new_from(model, p, &comm, cfg, source, placement.clone()).unwrap();
            // A collective: every engine is alive at once before any is dropped.
            e.check_batch_counts(1).unwrap();
            e.ledger().live_total().0
        },
    );
    for r in res {
        r.unwrap();
    }
    ALLOC.peak() - before
}

/// Writes `model`'s seeded initial values as a published weights file.
fn write_weights(model: &Decoder, file: &Path) {
    let values = StagedModel::init_params(model, 5);
    let tensors: Vec<fsdp_checkpoints::FullTensor> = model
        .spec()
        .units
        .iter()
        .zip(&values)
        .flat_map(|(u, v)| {
            u.params
                .iter()
                .filter(|p| p.tied_to.is_none())
                .zip(v)
                .map(|(p, t)| fsdp_checkpoints::FullTensor {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                    data: t.clone(),
                })
        })
        .collect();
    fsdp_checkpoints::write_full(file, &tensors, &[]).unwrap();
}

/// A Llama whose tied embedding (8192 x 64) is 93% of its parameters: at W=8 the whole padded
/// flat parameter a broadcast from rank 0 puts in every rank outweighs the model states, so
/// the plan's broadcast term is what the measurement meets.
const EMBEDDING_HEAVY: &str = r#"{"model_type": "llama", "vocab_size": 8192, "hidden_size": 64,
  "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
  "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0, "tie_word_embeddings": true}"#;

struct Row {
    model: usize,
    w: u64,
    strategy: Strategy,
    sync: InitSync,
    offload: Option<Offload>,
    placement: Placement,
    /// Lowest measured / planned ratio accepted (the highest is 1.0).
    low: f64,
}

/// Measured against planned, per row (measured ratios in brackets, this machine):
/// - full shard, shard-grad-op, hybrid (W=4, `mini`): [0.90, 1.00] (0.948);
/// - rank 0 broadcasting a seeded initialisation (W=8, the embedding-heavy Llama, planned
///   with `broadcast`: the planned bytes exceed those without it, so the broadcast term is
///   what is measured): [0.90, 1.00] (0.904). Not asserted: a broadcast load, which the plan
///   counts with a read buffer on every rank while only rank 0 reads (measured 0.628);
///   without broadcast this model measures 0.814 (the plan's shard in transit, 1/8 of the
///   embedding, is not held by this engine at that moment).
/// - shard-optimizer (W=4, host and CPU device): the plan's model states count the replicated
///   parameters (`4 x numel`), which the engine allocates at the first step, not while
///   building, so they are left out of the planned bytes here: [0.90, 1.00] (0.948 to 0.958);
/// - offload (W=4, CPU device, where host and device memory are both this heap): the planned
///   bytes are `init_bytes + host_peak`. With the optimizer offloaded [0.90, 1.00] (0.949 to
///   0.962). With the parameters offloaded [0.75, 1.00] (0.775 load, 0.817 random): the
///   filling term counts the f32 master shards that `host_peak` counts too, so the plan is
///   one set of master shards above the measurement.
#[test]
fn initialising_and_loading_stay_within_the_plan_and_never_hold_the_model() {
    let models = [
        Decoder::from_preset("mini").unwrap(),
        Decoder::from_hf_config_text(EMBEDDING_HEAVY, "config.json", "embedding-heavy").unwrap(),
    ];
    let tmp = tempfile::tempdir().unwrap();
    let files: Vec<_> = models
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let f = tmp.path().join(format!("model-{i}.safetensors"));
            write_weights(m, &f);
            f
        })
        .collect();
    let cpu = Placement::Device(Device::Cpu);
    let row = |model, w, strategy, sync, offload, placement, low| Row {
        model,
        w,
        strategy,
        sync,
        offload,
        placement,
        low,
    };
    use InitSync::{BroadcastFromRank0 as Broadcast, Verify};
    let rows = [
        row(
            0,
            4,
            Strategy::FullShard,
            Verify,
            None,
            Placement::Host,
            0.9,
        ),
        row(
            0,
            4,
            Strategy::ShardGradOp,
            Verify,
            None,
            Placement::Host,
            0.9,
        ),
        row(
            0,
            4,
            Strategy::Hybrid { shard_size: 2 },
            Verify,
            None,
            Placement::Host,
            0.9,
        ),
        row(
            1,
            8,
            Strategy::FullShard,
            Broadcast,
            None,
            Placement::Host,
            0.9,
        ),
        row(
            0,
            4,
            Strategy::ShardOptimizer,
            Verify,
            None,
            Placement::Host,
            0.9,
        ),
        row(
            0,
            4,
            Strategy::ShardOptimizer,
            Verify,
            None,
            cpu.clone(),
            0.9,
        ),
        row(
            0,
            4,
            Strategy::FullShard,
            Verify,
            Some(Offload::Optimizer),
            cpu.clone(),
            0.9,
        ),
        row(
            0,
            4,
            Strategy::FullShard,
            Verify,
            Some(Offload::Params),
            cpu.clone(),
            0.75,
        ),
    ];
    let mut bad = Vec::new();
    for r in rows {
        let model = &models[r.model];
        let whole_model_bytes = 4 * model.spec().numel().0;
        let mut cfg = PlanConfig::new(r.w);
        cfg.strategy = r.strategy;
        cfg.offload = r.offload;
        let p = plan(model.spec(), &cfg).unwrap();
        let random = model.random_init(5);
        let weights = FileWeights::open(&files[r.model], model.spec()).unwrap();
        let broadcast = r.sync == InitSync::BroadcastFromRank0;
        let replicated = if r.strategy == Strategy::ShardOptimizer {
            whole_model_bytes
        } else {
            0
        };
        let sources = [
            ("random", &random as &dyn ParamSource),
            ("load", &weights as &dyn ParamSource),
        ];
        // Broadcast: the seeded initialisation only (see the doc above).
        for (what, source) in &sources[..if broadcast { 1 } else { 2 }] {
            let source = *source;
            let staging = Bytes(source.staging_bytes());
            let per_rank = p.init_bytes(staging, broadcast).0 + p.memory.host_peak.0 - replicated;
            if broadcast {
                assert!(
                    p.init_bytes(staging, true) > p.init_bytes(staging, false),
                    "{what} {}: the broadcast term must be what the plan meets",
                    r.strategy
                );
            }
            let planned = r.w * per_rank;
            let states = r.w * (p.memory.model_states.0 + p.memory.host_peak.0 - replicated);
            let measured = build_peak(model, &p, source, r.sync, &r.placement);
            let ratio = measured as f64 / planned as f64;
            // Above the model states, what a rank holds in transit.
            let transit = measured.saturating_sub(states) / r.w;
            let what = format!(
                "{what} {} W={} {} {:?} offload {:?} {:?}",
                model.spec().name,
                r.w,
                r.strategy,
                r.sync,
                r.offload,
                r.placement
            );
            println!(
                "{what}: measured {measured} B, plan {planned} B (ratio {ratio:.3}); in transit per rank {transit} B, whole model {whole_model_bytes} B"
            );
            if !(r.low..=1.0).contains(&ratio) || measured < states {
                bad.push(format!("{what}: ratio {ratio:.3}"));
            }
            // Under broadcast every rank holds one whole flat parameter by design.
            if !broadcast && transit * 4 > whole_model_bytes {
                bad.push(format!(
                    "{what}: {transit} B in transit per rank, the whole model is {whole_model_bytes} B"
                ));
            }
        }
    }
    assert!(bad.is_empty(), "{bad:?}");
}

//! `plan(spec, config) -> ShardPlan`: the pure, deterministic heart of the planner.

use crate::config::Offload;
use crate::config::{PlanConfig, Strategy};
use crate::error::PlanError;
use crate::layout::{layout_units, UnitLayout};
use crate::memory::{memory_plan, MemoryPlan};
use crate::schedule::{build_replicated_schedule, build_schedule, Schedule};
use crate::spec::{Architecture, ModelSpec};
use fsdp_types::{Bytes, Numel};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Where one rank sits in the world: `shard_index = rank % S`, `replicate_index = rank / S`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankPlacement {
    /// Global rank in `0..W`.
    pub rank: u64,
    /// Which shard of every flat parameter this rank holds, `0..S`.
    pub shard_index: u64,
    /// Which replica of the shard group this rank belongs to, `0..R`.
    pub replicate_index: u64,
}

/// Padding added by the layout, in elements over the whole model (all shards of all flat
/// params) for sizes not divisible by the shard count; it never changes a real value
/// (<https://github.com/deepspeedai/DeepSpeed/pull/1380>).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaddingReport {
    /// Real (parameter) elements in flat params: tied parameters counted once.
    pub real_numel: Numel,
    /// Padded elements: `sum_A P_f`.
    pub padded_numel: Numel,
    /// `padded_numel - real_numel` (alignment gaps plus tail padding).
    pub padding_numel: Numel,
    /// Padding per unit, in unit order.
    pub per_unit: Vec<Numel>,
}

/// The output of the planner: everything the engine needs to execute one training step on
/// every rank, and the memory each rank will hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardPlan {
    /// The model's name.
    pub model: String,
    /// The model's architecture.
    pub arch: Architecture,
    /// Parameter elements (tied once).
    pub numel: Numel,
    /// Trainable parameter elements (tied once).
    pub trainable_numel: Numel,
    /// The configuration as given (`strategy` may be `Auto`).
    pub config: PlanConfig,
    /// The strategy executed (never `Auto`).
    pub strategy: Strategy,
    /// Why `Auto` chose `strategy` (None when the strategy was given).
    pub auto_reason: Option<String>,
    /// Shard-group size `S`.
    pub shard_size: u64,
    /// Replicate-group size `R = W / S`.
    pub replicate_size: u64,
    /// Flat-parameter layouts per unit, laid out for `S` shards.
    pub units: Vec<UnitLayout>,
    /// Forward/backward order, alive units, prefetch.
    pub schedule: Schedule,
    /// Bytes per rank (identical on every rank).
    pub memory: MemoryPlan,
    /// Padding added by the layout.
    pub padding: PaddingReport,
    /// SHA-256 (hex) of the canonical serialization of what every rank must agree on.
    pub fingerprint: String,
}

/// The read buffer of a weight load (bytes): a loader reads element ranges through a staging
/// buffer of at most this size, which [`ShardPlan::init_bytes`] counts.
pub const LOAD_STAGING_BYTES: u64 = 1 << 20;

impl ShardPlan {
    /// Bytes one rank holds at most while it builds its initial shards (a seeded random
    /// initialisation or a load of published weights), before the first step. Two moments:
    /// - filling: every f32 master shard (`4 * shard_numel` per flat parameter) plus `staging`
    ///   (the loader's read buffer, bytes) plus, when rank 0 `broadcast`s the initial weights,
    ///   one whole padded flat parameter (the largest) in every rank;
    /// - building the units: the model states ([`MemoryPlan::model_states`]: master shards,
    ///   gradient shards, optimizer state) plus one flat parameter's shard in transit (a
    ///   device copy, or the per-parameter tensors of an unsharded flat parameter).
    ///
    /// The result is the larger of the two. No rank ever holds the whole model unless the model
    /// is one flat parameter or the world is one rank.
    pub fn init_bytes(&self, staging: Bytes, broadcast: bool) -> Bytes {
        let flats = || self.units.iter().flat_map(|u| &u.flat_params);
        let masters: u64 = flats().map(|f| 4 * f.shard_numel().0).sum();
        let shard = flats().map(|f| 4 * f.shard_numel().0).max().unwrap_or(0);
        let whole = if broadcast {
            flats().map(|f| 4 * f.padded_numel.0).max().unwrap_or(0)
        } else {
            0
        };
        let filling = Bytes(masters + whole) + staging;
        let building = self.memory.model_states + Bytes(shard);
        filling.max(building)
    }

    /// Whether the engine overlaps gradient reductions with the next backward step: prefetch
    /// depth >= 1, more than one rank, sharded gradients (see `memory` module doc, "Overlap").
    /// The memory plan counts the in-flight reduction's buffers exactly when this holds.
    pub fn overlaps_reductions(&self) -> bool {
        crate::schedule::overlaps_reductions(&self.schedule, self.config.world_size)
    }

    /// The fingerprint (64 hex digits). Every rank computes the same value; ranks compare it to
    /// rank 0's at start-up.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// World size `W`.
    pub fn world_size(&self) -> u64 {
        self.config.world_size
    }

    /// The placement of `rank`. Errors: `InvalidConfig` if `rank >= W`.
    pub fn rank(&self, rank: u64) -> Result<RankPlacement, PlanError> {
        if rank >= self.config.world_size {
            return Err(PlanError::InvalidConfig(format!(
                "rank {rank} is outside world size {}",
                self.config.world_size
            )));
        }
        Ok(RankPlacement {
            rank,
            shard_index: rank % self.shard_size,
            replicate_index: rank / self.shard_size,
        })
    }

    /// Every rank's placement, in rank order.
    pub fn ranks(&self) -> Vec<RankPlacement> {
        (0..self.config.world_size)
            .map(|r| RankPlacement {
                rank: r,
                shard_index: r % self.shard_size,
                replicate_index: r / self.shard_size,
            })
            .collect()
    }

    /// The memory plan of `rank`: the same for every rank, since all shards of a flat param
    /// have `s_f` elements. Errors: `InvalidConfig` if `rank >= W`.
    pub fn memory_for_rank(&self, rank: u64) -> Result<&MemoryPlan, PlanError> {
        self.rank(rank)?;
        Ok(&self.memory)
    }

    /// Padding elements inside shard `shard_index` over all flat params.
    pub fn shard_padding_numel(&self, shard_index: u64) -> Numel {
        self.units
            .iter()
            .flat_map(|u| &u.flat_params)
            .map(|f| f.shard_numel() - f.shard_real_numel(shard_index))
            .sum()
    }

    /// Whether the peak fits `device_memory` (None without a budget).
    pub fn fits(&self) -> Option<bool> {
        self.config.device_memory.map(|d| self.memory.peak <= d)
    }
}

/// What every rank must agree on, serialized canonically (serde_json, fields in declaration
/// order, no maps) and hashed with SHA-256.
#[derive(Serialize)]
struct FingerprintInput<'a> {
    domain: &'static str,
    model: &'a str,
    arch: &'a Architecture,
    config: &'a PlanConfig,
    strategy: &'a Strategy,
    shard_size: u64,
    replicate_size: u64,
    units: &'a [UnitLayout],
    schedule: ScheduleFingerprint<'a>,
}

/// The schedule as the fingerprint hashes it: [`Schedule`]'s serialization with
/// `activation_checkpointing` present only when it differs from `reshard_after_forward`, so
/// plans equal to those made before the setting existed keep their fingerprints.
#[derive(Serialize)]
struct ScheduleFingerprint<'a> {
    reshard_after_forward: bool,
    prefetch: u64,
    root_unit: Option<usize>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    replicated: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    activation_checkpointing: Option<bool>,
    forward: &'a [crate::schedule::ScheduleStep],
    backward: &'a [crate::schedule::ScheduleStep],
}

impl<'a> ScheduleFingerprint<'a> {
    fn of(s: &'a Schedule) -> Self {
        ScheduleFingerprint {
            reshard_after_forward: s.reshard_after_forward,
            prefetch: s.prefetch,
            root_unit: s.root_unit,
            replicated: s.replicated,
            activation_checkpointing: (s.activation_checkpointing != s.reshard_after_forward)
                .then_some(s.activation_checkpointing),
            forward: &s.forward,
            backward: &s.backward,
        }
    }
}

/// The strategies `Strategy::Auto` tries at world size `w` (ranks), fastest first: NoShard,
/// then for `w > 1` ShardOptimizer, ShardGradOp, Hybrid for every shard-group size dividing
/// `w` (smallest first) and FullShard. See [`plan`] for why this order.
pub fn auto_candidates(w: u64) -> Vec<Strategy> {
    let mut strategies = vec![Strategy::NoShard];
    if w > 1 {
        strategies.push(Strategy::ShardOptimizer);
        strategies.push(Strategy::ShardGradOp);
        strategies.extend(
            (2..w)
                .filter(|s| w.is_multiple_of(*s))
                .map(|s| Strategy::Hybrid { shard_size: s }),
        );
        strategies.push(Strategy::FullShard);
    }
    strategies
}

/// Plans `spec` under `cfg`: lays every unit out in flat parameters for the shard group, builds
/// the schedule and the memory plan, and fingerprints the result. Pure and deterministic: no
/// I/O, no clock, no randomness; the same inputs give the same bytes on every rank.
///
/// `Strategy::Auto` tries NoShard, ShardOptimizer, ShardGradOp, Hybrid (each shard-group size
/// dividing `W`, smallest first) and FullShard — without activation checkpointing first, then
/// with it, unless the config sets it — fastest first (ShardOptimizer and ShardGradOp
/// move the volume of DDP's all-reduce, Rajbhandari et al. 2020 sec. 7, but ShardOptimizer
/// all-gathers once after the optimizer step while ShardGradOp all-gathers unit by unit in
/// forward; FullShard gathers again in backward, 1.5x the volume), and
/// keeps the first whose peak fits `device_memory`; if none fits it keeps FullShard (the least
/// memory: with checkpointing when the config leaves it open) and says so in `auto_reason`.
/// The returned plan's config then carries the checkpointing auto chose.
///
/// Errors: `ZeroWorldSize`, `ShardSizeNotDivisor`, `ZeroAlignment`, `InvalidConfig`
/// (micro-batch, sequence length or accumulation 0; auto without a budget; a sequence longer
/// than GPT-2's position table), `InvalidSpec`, `TiedAcrossUnits`.
pub fn plan(spec: &ModelSpec, cfg: &PlanConfig) -> Result<ShardPlan, PlanError> {
    check_plan_input(spec, cfg)?;
    if cfg.strategy != Strategy::Auto {
        return plan_with(spec, cfg, cfg.strategy, None);
    }
    let budget = cfg.device_memory.expect("validated: auto has a budget");
    let candidates = auto_search_candidates(cfg);
    let name = |s: Strategy, c: &PlanConfig| candidate_name(cfg, s, c);
    let mut rejected = Vec::new();
    let mut last = None;
    for (s, c) in candidates {
        let p = plan_with(spec, &c, s, None)?;
        let name = name(s, &c);
        let peak = p.memory.peak;
        if peak <= budget {
            let free = budget - peak;
            let why = if c.offload != cfg.offload {
                format!(
                    "{name} is the fastest way it fits, with offload: device peak {peak} of {budget} ({free} free), {} in host memory per rank; faster ones do not fit: {}",
                    p.memory.host_peak,
                    rejected.join(", ")
                )
            } else if rejected.is_empty() {
                format!("{name} is the fastest strategy and fits: peak {peak} of {budget} ({free} free)")
            } else {
                format!(
                    "{name} is the fastest strategy that fits: peak {peak} of {budget} ({free} free); faster ones do not fit: {}",
                    rejected.join(", ")
                )
            };
            return plan_with(spec, &c, s, Some(why));
        }
        rejected.push(format!("{name} needs {peak}"));
        last = Some((p, c));
    }
    let (p, c) = last.expect("at least one candidate");
    let why = format!(
        "nothing fits in {budget}: {}; keeping {} (the least memory), over by {}",
        rejected.join(", "),
        name(p.strategy, &c),
        p.memory.peak - budget
    );
    plan_with(spec, &c, p.strategy, Some(why))
}

/// The configuration checks of [`plan`]: `cfg.validate()` and a sequence within GPT-2's
/// position table.
fn check_plan_input(spec: &ModelSpec, cfg: &PlanConfig) -> Result<(), PlanError> {
    cfg.validate()?;
    if let Architecture::Gpt2(c) = &spec.arch {
        if cfg.seq_len > c.n_positions {
            return Err(PlanError::InvalidConfig(format!(
                "sequence length {} exceeds the model's {} positions",
                cfg.seq_len, c.n_positions
            )));
        }
    }
    Ok(())
}

/// How many runners-up an `auto_reason` of [`plan_fastest`] names.
const RUNNERS_UP_NAMED: usize = 3;

/// Plans `spec` like [`plan`], except that `Strategy::Auto` ranks every candidate that fits
/// `device_memory` by the step time [`crate::time::predict`] gives on `profile` and keeps the
/// fastest (ties keep [`plan`]'s fixed order), instead of taking the first that fits in that
/// order. Offloaded candidates compete with the rest: the time model charges their host-link
/// copies and host optimizer. `auto_reason` names the predicted step, the runners-up and what
/// does not fit. When nothing fits, or the strategy is not `Auto`, the result is [`plan`]'s.
///
/// Errors: those of [`plan`], and those of [`crate::time::predict`] (a generic architecture,
/// a profile without a GEMM curve for `param_dtype`).
pub fn plan_fastest(
    spec: &ModelSpec,
    cfg: &PlanConfig,
    profile: &crate::time::HardwareProfile,
    inputs: &crate::time::TimeInputs,
) -> Result<ShardPlan, PlanError> {
    plan_fastest_ranked(spec, cfg, profile, inputs).map(|(p, _)| p)
}

/// A candidate of `Strategy::Auto` that fits the budget, with its predicted step
/// ([`plan_fastest_ranked`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RankedCandidate {
    /// The candidate as `auto_reason` names it: the strategy, and the activation
    /// checkpointing and offload the search added.
    pub name: String,
    /// The strategy (never `Auto`).
    pub strategy: Strategy,
    /// The candidate's `PlanConfig::activation_checkpointing`.
    pub activation_checkpointing: Option<bool>,
    /// The candidate's `PlanConfig::offload`.
    pub offload: Option<Offload>,
    /// Its plan's peak bytes per rank (at most the budget).
    pub peak: Bytes,
    /// Its predicted step time, seconds ([`crate::time::predict`]).
    pub step_s: f64,
}

/// How [`plan_fastest_ranked`] ranked the candidates of `Strategy::Auto` that fit.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoRanking {
    /// The profile's name.
    pub hardware: String,
    /// The budget per rank the candidates fit (`PlanConfig::device_memory`).
    pub budget: Bytes,
    /// Every candidate that fits, shortest predicted step first (equal predictions in the
    /// fixed order of [`plan`]); never empty. The first is the chosen plan.
    pub fitting: Vec<RankedCandidate>,
    /// The candidates that do not fit, as `name needs PEAK`, in the fixed order.
    pub rejected: Vec<String>,
}

/// [`plan_fastest`], also returning the ranking behind an `Auto` choice: `None` when the
/// strategy is not `Auto` or nothing fits (the plan is then [`plan`]'s).
///
/// Errors: as [`plan_fastest`].
pub fn plan_fastest_ranked(
    spec: &ModelSpec,
    cfg: &PlanConfig,
    profile: &crate::time::HardwareProfile,
    inputs: &crate::time::TimeInputs,
) -> Result<(ShardPlan, Option<AutoRanking>), PlanError> {
    check_plan_input(spec, cfg)?;
    if cfg.strategy != Strategy::Auto {
        return Ok((plan_with(spec, cfg, cfg.strategy, None)?, None));
    }
    let budget = cfg.device_memory.expect("validated: auto has a budget");
    let mut fitting = Vec::new();
    let mut rejected = Vec::new();
    for (s, c) in auto_search_candidates(cfg) {
        let p = plan_with(spec, &c, s, None)?;
        let name = candidate_name(cfg, s, &c);
        if p.memory.peak <= budget {
            let step_s = crate::time::predict(&p, profile, inputs)?.step_s;
            fitting.push((
                RankedCandidate {
                    name,
                    strategy: s,
                    activation_checkpointing: c.activation_checkpointing,
                    offload: c.offload,
                    peak: p.memory.peak,
                    step_s,
                },
                c,
            ));
        } else {
            rejected.push(format!("{name} needs {}", p.memory.peak));
        }
    }
    if fitting.is_empty() {
        return Ok((plan(spec, cfg)?, None));
    }
    // Stable: equal predictions keep the fixed order.
    fitting.sort_by(|a, b| a.0.step_s.total_cmp(&b.0.step_s));
    let (best, c) = &fitting[0];
    let fmt = crate::time::format_seconds;
    let mut why = format!(
        "{} has the shortest predicted step on {} of the {} plans that fit: {}/step, peak {} of {budget} ({} free)",
        best.name,
        profile.name,
        fitting.len(),
        fmt(best.step_s),
        best.peak,
        budget - best.peak
    );
    if fitting.len() > 1 {
        let next: Vec<String> = fitting[1..]
            .iter()
            .take(RUNNERS_UP_NAMED)
            .map(|(r, _)| format!("{} {}", r.name, fmt(r.step_s)))
            .collect();
        why.push_str(&format!("; next: {}", next.join(", ")));
    }
    if !rejected.is_empty() {
        why.push_str(&format!("; do not fit: {}", rejected.join(", ")));
    }
    let chosen = plan_with(spec, c, best.strategy, Some(why))?;
    let ranking = AutoRanking {
        hardware: profile.name.clone(),
        budget,
        fitting: fitting.into_iter().map(|(r, _)| r).collect(),
        rejected,
    };
    Ok((chosen, Some(ranking)))
}

/// Every candidate `Strategy::Auto` considers for `cfg`, fastest first by the fixed order of
/// [`plan`]: each strategy of [`auto_candidates`] under each activation-checkpointing setting,
/// then (unless `cfg` sets an offload) the offloaded candidates as the last resort.
fn auto_search_candidates(cfg: &PlanConfig) -> Vec<(Strategy, PlanConfig)> {
    let mut strategies = auto_candidates(cfg.world_size);
    // Offloaded, a device's parameters are always gathered copies: at one rank full shard
    // (which frees them after use) then holds less than no-shard (which keeps them).
    if cfg.world_size == 1 && cfg.offload_mode().is_some() {
        strategies.push(Strategy::FullShard);
    }
    strategies.retain(|&s| cfg.check_offload(s).is_ok());
    // Activation checkpointing as set, or, when left to the planner, every strategy without it
    // first (no recompute), then every strategy with it (one extra forward per unit).
    let settings: Vec<Option<bool>> = match cfg.activation_checkpointing {
        Some(x) => vec![Some(x)],
        None => vec![None, Some(true)],
    };
    // Every candidate, fastest first: each strategy under each checkpointing setting, then, as
    // the last resort before "does not fit" (unless the config sets an offload), full shard
    // with its master weights and optimizer state (then its parameter shards too) in host
    // memory, each without activation checkpointing first, then with it.
    let with = |ckpt: Option<bool>, offload: Option<Offload>| PlanConfig {
        activation_checkpointing: ckpt,
        offload,
        ..cfg.clone()
    };
    let mut candidates: Vec<(Strategy, PlanConfig)> = settings
        .iter()
        .flat_map(|&ckpt| strategies.iter().map(move |&s| (s, ckpt)))
        .map(|(s, ckpt)| (s, with(ckpt, cfg.offload)))
        .collect();
    if cfg.offload.is_none() {
        for offload in [Offload::Optimizer, Offload::Params] {
            let c = with(None, Some(offload));
            let mut offloaded = auto_candidates(cfg.world_size);
            // Offloaded, a device's parameters are always gathered copies: at one rank full
            // shard (which frees them after use) holds less than no-shard (which keeps them).
            if cfg.world_size == 1 {
                offloaded.push(Strategy::FullShard);
            }
            offloaded.retain(|&s| c.check_offload(s).is_ok());
            for &ckpt in &settings {
                for &s in &offloaded {
                    candidates.push((s, with(ckpt, Some(offload))));
                }
            }
        }
    }
    candidates
}

/// A candidate's name in `auto_reason`: the strategy, and the checkpointing and offload the
/// search added to `cfg`.
fn candidate_name(cfg: &PlanConfig, s: Strategy, c: &PlanConfig) -> String {
    let mut n = s.to_string();
    if c.activation_checkpointing == Some(true) && cfg.activation_checkpointing.is_none() {
        n.push_str(" with activation checkpointing");
    }
    if let (Some(o), None) = (c.offload, cfg.offload) {
        n.push_str(&format!(" with --offload {o}"));
    }
    n
}

fn plan_with(
    spec: &ModelSpec,
    cfg: &PlanConfig,
    strategy: Strategy,
    auto_reason: Option<String>,
) -> Result<ShardPlan, PlanError> {
    cfg.check_offload(strategy)?;
    let w = cfg.world_size;
    let shard_size = strategy.shard_size(w).expect("resolved strategy");
    let units = layout_units(spec, shard_size, cfg.alignment)?;
    let mut schedule = if strategy.replicated_params_and_grads() {
        build_replicated_schedule(spec, &units)
    } else {
        build_schedule(spec, &units, strategy.reshard_after_forward(), cfg.prefetch)
    };
    schedule.activation_checkpointing = cfg.activation_checkpointing_for(strategy);
    let memory = memory_plan(&spec.arch, &units, &schedule, cfg, shard_size);
    let per_unit: Vec<Numel> = units
        .iter()
        .map(|u| u.flat_params.iter().map(|f| f.padding_numel()).sum())
        .collect();
    let padded: Numel = units
        .iter()
        .flat_map(|u| &u.flat_params)
        .map(|f| f.padded_numel)
        .sum();
    let real: Numel = units
        .iter()
        .flat_map(|u| &u.flat_params)
        .map(|f| f.real_numel())
        .sum();
    let replicate_size = w / shard_size;
    // The resolved activation checkpointing is in the schedule's part of the input; leaving the
    // config's spelling of it out gives an explicit setting equal to the default the default's
    // fingerprint.
    let fp_config = PlanConfig {
        activation_checkpointing: None,
        // How checkpoints are saved is no part of the sharding.
        ckpt_async: false,
        offload: cfg.offload.filter(|o| o.is_some()),
        // Shard-optimizer reduces once per step whatever `grad_sync` says: both spellings are
        // the same plan.
        grad_sync: if strategy.replicated_params_and_grads() && cfg.grad_accum > 1 {
            crate::config::GradSync::LastMicroBatch
        } else {
            cfg.grad_sync
        },
        ..cfg.clone()
    };
    let input = FingerprintInput {
        domain: "fsdp-plan-fingerprint/1",
        model: &spec.name,
        arch: &spec.arch,
        config: &fp_config,
        strategy: &strategy,
        shard_size,
        replicate_size,
        units: &units,
        schedule: ScheduleFingerprint::of(&schedule),
    };
    let bytes = serde_json::to_vec(&input).expect("plan types serialize");
    let fingerprint = hex(&Sha256::digest(&bytes));
    Ok(ShardPlan {
        model: spec.name.clone(),
        arch: spec.arch,
        numel: spec.numel(),
        trainable_numel: spec.trainable_numel(),
        config: cfg.clone(),
        strategy,
        auto_reason,
        shard_size,
        replicate_size,
        units,
        schedule,
        memory,
        padding: PaddingReport {
            real_numel: real,
            padded_numel: padded,
            padding_numel: padded - real,
            per_unit,
        },
        fingerprint,
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The smallest world size at which one strategy fits a budget.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MinWorld {
    /// The strategy (for Hybrid: the shard-group size found, replicate size 1 or more).
    pub strategy: Strategy,
    /// Smallest world size that fits (for Hybrid: smallest shard-group size; the world may
    /// be any multiple of it), or None if none up to [`MAX_SEARCH_WORLD`] fits.
    pub world_size: Option<u64>,
    /// The peak at that size (or at [`MAX_SEARCH_WORLD`] if none fits).
    pub peak: Bytes,
}

/// Largest world size the fit search tries.
pub const MAX_SEARCH_WORLD: u64 = 1 << 20;

/// For each of full shard, shard-grad-op, shard-optimizer, no-shard and hybrid (in that
/// order in the result), the smallest world size whose
/// peak fits `budget`, with every other setting of `cfg` kept. The peak falls with the world
/// size except for padding (at most `alignment * W` elements per flat param), so the search
/// doubles to the first fitting size and then bisects.
///
/// Hybrid with shard group `S` holds exactly what full shard holds at `W = S` (the replicas
/// add no bytes), so its answer is the full-shard one read as a shard-group size.
///
/// A strategy that `cfg`'s offload makes no sense with ([`PlanConfig::check_offload`]) is
/// left out.
///
/// Errors: as [`plan`].
pub fn min_world_sizes(
    spec: &ModelSpec,
    cfg: &PlanConfig,
    budget: Bytes,
) -> Result<Vec<MinWorld>, PlanError> {
    let peak_at = |s: Strategy, w: u64| -> Result<Bytes, PlanError> {
        let mut c = cfg.clone();
        c.world_size = w;
        c.strategy = s;
        c.device_memory = None;
        Ok(plan(spec, &c)?.memory.peak)
    };
    let mut out = Vec::new();
    for s in [
        Strategy::FullShard,
        Strategy::ShardGradOp,
        Strategy::ShardOptimizer,
        Strategy::NoShard,
    ] {
        // A strategy the offload makes no sense with is not listed.
        if (PlanConfig {
            world_size: 1,
            ..cfg.clone()
        })
        .check_offload(s)
        .is_err()
        {
            continue;
        }
        let p1 = peak_at(s, 1)?;
        if p1 <= budget {
            out.push(MinWorld {
                strategy: s,
                world_size: Some(1),
                peak: p1,
            });
            continue;
        }
        if s == Strategy::NoShard {
            out.push(MinWorld {
                strategy: s,
                world_size: None,
                peak: p1,
            });
            continue;
        }
        let mut hi = 2;
        let mut p_hi = peak_at(s, hi)?;
        while p_hi > budget && hi < MAX_SEARCH_WORLD {
            hi *= 2;
            p_hi = peak_at(s, hi)?;
        }
        if p_hi > budget {
            out.push(MinWorld {
                strategy: s,
                world_size: None,
                peak: p_hi,
            });
            continue;
        }
        let mut lo = hi / 2; // does not fit
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            let p = peak_at(s, mid)?;
            if p <= budget {
                hi = mid;
                p_hi = p;
            } else {
                lo = mid;
            }
        }
        out.push(MinWorld {
            strategy: s,
            world_size: Some(hi),
            peak: p_hi,
        });
    }
    let fs = out[0].clone();
    out.push(MinWorld {
        strategy: Strategy::Hybrid {
            shard_size: fs.world_size.unwrap_or(0),
        },
        world_size: fs.world_size,
        peak: fs.peak,
    });
    Ok(out)
}

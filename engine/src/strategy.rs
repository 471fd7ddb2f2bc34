//! The plan stage of a run's preparation: the strategy and its plan, computed once for the
//! options ([`crate::options`]). `--strategy auto` is resolved here for a memory budget per
//! rank: by the planner's fixed order, or with a hardware profile by the shortest predicted
//! step among the candidates that fit; an explicit strategy's plan peak is checked against the
//! budget when one is given. The budget itself (given, or a share of the hosts' memory) comes
//! from [`crate::preflight::auto_budget`], which calls into this module, never the reverse.

use crate::error::{Result, RunError};
use crate::model::decoder::Decoder;
use crate::options::{model_of, plan_config, time_inputs, TrainOptions};
use crate::runtime::{Placement, StagedModel};
use fsdp_planner::{plan, ShardPlan, Strategy};
use fsdp_types::Bytes;

/// `--strategy auto` resolved for a run: the choice and where its budget came from.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoResolution {
    /// The strategy, activation checkpointing, peak, budget and reason.
    pub choice: AutoChoice,
    /// Where the budget came from (`--device-memory 512MiB`, or the host share it was
    /// computed from).
    pub source: String,
}

/// A memory budget per rank as given (`--device-memory`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    /// Bytes per rank.
    pub bytes: u64,
    /// The value as written (`512MiB`), for messages.
    pub given: String,
}

/// What `fsdp train --strategy auto` resolved to for a per-rank memory budget.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoChoice {
    /// The strategy to run (never `Auto`).
    pub strategy: Strategy,
    /// The `TrainOptions::activation_checkpointing` to run it with: the options' own setting
    /// when given, else `None` (the strategy's default, off) for the first pass and
    /// `Some(true)` for the second.
    pub activation_checkpointing: Option<bool>,
    /// The `TrainOptions::offload` to run it with: the options' own setting, or the offload
    /// the search added as its last resort.
    pub offload: Option<fsdp_planner::Offload>,
    /// The chosen plan's peak bytes per rank (the device's under offload).
    pub peak: Bytes,
    /// The budget searched against, bytes per rank.
    pub budget: Bytes,
    /// Whether `peak <= budget`. When nothing fits, the choice is the last candidate (the
    /// least memory) and this is `false`; the caller must refuse the run.
    pub fits: bool,
    /// Why: the planner's reason (the chosen candidate's peak against the budget, the faster
    /// candidates that did not fit and their peaks; with a hardware profile the predicted
    /// step, the runners-up and what does not fit).
    pub reason: String,
    /// With a hardware profile ([`TrainOptions::hardware`]) and something that fits: every
    /// candidate that fits, shortest predicted step first (the first is the choice). `None`:
    /// the fixed order chose.
    pub ranking: Option<fsdp_planner::AutoRanking>,
}

/// Resolves `Strategy::Auto` for the engine: the fastest strategy whose per-rank plan peak
/// fits `budget` bytes, as `fsdp_planner::plan` resolves `Strategy::Auto` (so it picks what
/// `fsdp plan --strategy auto --device-memory B` picks for the same flags): no-shard,
/// shard-optimizer, shard-grad-op, hybrid (shard-group sizes dividing `W`, smallest first),
/// full shard — every one without activation checkpointing first, then every one with it,
/// unless `o.activation_checkpointing` is set — and, when nothing fits, `o.offload` is not set
/// and the run computes on a device (not the host placement, whose "device" is host memory
/// already), full shard with the optimizer (then the parameters too) offloaded to host memory.
/// Ranking after Rajbhandari et al. 2020 (ZeRO), sec. 7: replicated parameters move the
/// least, full shard gathers again in backward (1.5x).
///
/// With a hardware profile ([`TrainOptions::hardware`]) the candidates that fit are ranked
/// by the step time predicted on it instead, and the shortest wins
/// ([`fsdp_planner::plan_fastest_ranked`], as `fsdp plan --strategy auto --hardware`); when
/// nothing fits the choice is the fixed order's.
///
/// `o.strategy` is ignored (normally `Auto`). Pure and deterministic: the same options and
/// budget give the same choice on every rank.
///
/// Errors: [`crate::error::EngineError::Config`] for an unknown model; [`crate::error::EngineError::Plan`] for options
/// the planner refuses (sequence longer than the model's positions, zero sizes) and a
/// profile the prediction refuses (no GEMM curve for `--param-dtype`).
pub fn resolve_auto(o: &TrainOptions, budget: Bytes) -> Result<AutoChoice> {
    let model = model_of(o)?;
    search_auto(&model, o, budget).map(|(choice, _)| choice)
}

/// [`resolve_auto`] for a model already built, also returning the plan the run executes: the
/// plan of `o` with the choice's strategy, activation checkpointing and offload.
///
/// Errors: as [`resolve_auto`].
pub fn search_auto(
    model: &Decoder,
    o: &TrainOptions,
    budget: Bytes,
) -> Result<(AutoChoice, ShardPlan)> {
    let mut c = plan_config(o);
    c.strategy = Strategy::Auto;
    c.device_memory = Some(budget);
    // On the host placement the "device" is host memory: offloading to the host frees
    // nothing, so the search does not try it (an explicit `--offload` still applies).
    if c.offload.is_none() && matches!(o.placement, Placement::Host) {
        c.offload = Some(fsdp_planner::Offload::None);
    }
    let (searched, ranking) = match &o.hardware {
        Some(h) => fsdp_planner::plan_fastest_ranked(model.spec(), &c, h, &time_inputs(o))?,
        None => (plan(model.spec(), &c)?, None),
    };
    let choice = AutoChoice {
        strategy: searched.strategy,
        activation_checkpointing: searched.config.activation_checkpointing,
        offload: searched.config.offload,
        peak: searched.memory.peak,
        budget,
        fits: searched.memory.peak <= budget,
        reason: searched.auto_reason.clone().unwrap_or_default(),
        ranking,
    };
    let resolved = TrainOptions {
        strategy: choice.strategy,
        activation_checkpointing: choice.activation_checkpointing,
        offload: choice.offload,
        ..o.clone()
    };
    let run_plan = plan(model.spec(), &plan_config(&resolved))?;
    Ok((choice, run_plan))
}

/// The plan of `model` under `opts`, computed once. With `Strategy::Auto`, `auto_budget`
/// (from [`crate::preflight::auto_budget`]) is the budget the search fits ([`search_auto`]):
/// `opts.strategy` and `opts.activation_checkpointing` are set to the choice and its plan is
/// returned with the resolution. With an explicit strategy and `budget`, the plan's peak per
/// rank must fit it.
///
/// Errors: [`RunError::Refused`] for a budget nothing fits (naming the least-memory
/// candidate's peak and the budget), an explicit strategy whose peak exceeds `budget`, and
/// options the planner refuses.
pub fn plan_for(
    model: &Decoder,
    opts: &mut TrainOptions,
    budget: Option<&Budget>,
    auto_budget: Option<(u64, String)>,
) -> Result<(ShardPlan, Option<AutoResolution>), RunError> {
    if opts.strategy != Strategy::Auto {
        let plan = fsdp_planner::plan(StagedModel::spec(model), &plan_config(opts))?;
        if let Some(b) = budget {
            let peak = plan.memory.peak.0;
            if peak > b.bytes {
                return Err(RunError::Refused(format!(
                    "--strategy {}: the plan's peak {} per rank exceeds --device-memory {} = {}; \
                     use --strategy auto, a sharded strategy, --activation-checkpointing on, or a \
                     smaller --micro-batch or --seq-len",
                    opts.strategy.cli_name(),
                    bytes_exact(peak),
                    b.given,
                    bytes_exact(b.bytes)
                )));
            }
        }
        return Ok((plan, None));
    }
    let (budget, source) = match auto_budget {
        Some(b) => b,
        None => auto_budget_missing()?,
    };
    let (choice, plan) = search_auto(model, opts, Bytes(budget))?;
    if !choice.fits {
        return Err(RunError::Refused(format!(
            "--strategy auto: nothing fits the memory budget of {} per rank ({source}): the \
             least memory is {}{}, peak {} per rank; {}; use a smaller --micro-batch, --seq-len \
             or --grad-accum, more ranks, a larger --device-memory, or --offload optimizer|params \
             (the optimizer state in host memory)",
            bytes_exact(budget),
            choice.strategy,
            match (choice.activation_checkpointing, choice.offload) {
                (Some(true), Some(o)) if o.is_some() => {
                    format!(" with activation checkpointing and --offload {o}")
                }
                (Some(true), _) => " with activation checkpointing".to_string(),
                (_, Some(o)) if o.is_some() => format!(" with --offload {o}"),
                _ => String::new(),
            },
            bytes_exact(choice.peak.0),
            choice.reason
        )));
    }
    opts.strategy = choice.strategy;
    opts.activation_checkpointing = choice.activation_checkpointing;
    opts.offload = choice.offload;
    Ok((plan, Some(AutoResolution { choice, source })))
}

/// `Strategy::Auto` reached [`plan_for`] without a budget: a caller error.
fn auto_budget_missing() -> Result<(u64, String), RunError> {
    Err(RunError::Refused(
        "--strategy auto needs a memory budget: resolve it first (`auto_budget`)".into(),
    ))
}

/// A byte count as `1,234,567 B (1.18 MiB)`.
fn bytes_exact(b: u64) -> String {
    format!(
        "{} B ({})",
        fsdp_types::group_thousands(b),
        fsdp_types::Bytes(b)
    )
}

//! From a validated [`TrainOptions`] to a run, in one pass: the model is built once from its
//! preset or `config.json`, the plan is computed once (`Strategy::Auto` chooses here, for a
//! memory budget), the pre-flight memory checks read that plan, and the training driver
//! executes it ([`crate::train::train_prepared`]).
//!
//! ```text
//! TrainOptions ──validate──▶ model (Decoder) ──plan──▶ ShardPlan ──preflight──▶ PreparedRun ──▶ train
//! ```
//!
//! The modules follow the same direction: [`crate::options`] (the options, the model) <-
//! [`crate::strategy`] (the plan, auto) <- [`crate::preflight`] (the hosts' memory) <- this
//! module (composes them) <- [`crate::train`] (executes a [`PreparedRun`]). None of them
//! imports a later one.
//!
//! A new run setting is one field of [`TrainOptions`], read by
//! [`crate::options::plan_config`] (what the planner sees) and the driver (what the engine does).

use crate::model::decoder::Decoder;
use crate::options::{model_of, validate, TrainOptions};
use crate::preflight::{self, RankMemory};
use crate::runtime::Placement;
use crate::strategy::{self, AutoResolution, Budget};
use fsdp_checkpoints::CkptError;
use fsdp_planner::{ShardPlan, Strategy};

/// The error of [`prepare`] (defined with the engine's errors, where every stage reaches it).
pub use crate::error::RunError;

/// What [`prepare`] needs besides the options: the memory budget per rank and what the ranks
/// can see of their hosts' memory.
#[derive(Debug, Clone)]
pub struct RunRequest {
    /// The run's options; `strategy` may be [`Strategy::Auto`]. `world_size` is the run's
    /// (an MPI or NCCL job's, after its initialisation).
    pub options: TrainOptions,
    /// The memory budget per rank (`--device-memory`): what `Auto` fits, or the bound an
    /// explicit strategy's plan peak must keep.
    pub budget: Option<Budget>,
    /// The ranks' host memory: what the pre-flight checks and auto's default budget read.
    pub ranks: RankMemory,
}

/// A run ready to start: its resolved options, its model and its plan, each computed once and
/// checked by the pre-flight.
#[derive(Debug)]
pub struct PreparedRun {
    /// The options with the strategy resolved (never `Auto`) and activation checkpointing as
    /// the auto search chose it.
    pub options: TrainOptions,
    /// The model the options name (preset or `config.json`), checked against the data.
    pub model: Decoder,
    /// The plan of `model` under `options`: the one the pre-flight checked and the engine
    /// executes.
    pub plan: ShardPlan,
    /// How `Strategy::Auto` was resolved (`None` for an explicit strategy).
    pub auto: Option<AutoResolution>,
}

/// Prepares a run in one pass: validates the flags, builds the model once
/// ([`model_of`]), plans once (resolving `Strategy::Auto` for the budget, or checking an
/// explicit strategy's peak against it), runs the pre-flight memory check of the ranks' hosts
/// on that plan ([`preflight::preflight_threads`], [`preflight::preflight_mpi`]) and checks
/// `--init-from` against the model.
///
/// Errors: [`RunError::Refused`] for bad flags, an unknown model, a plan the planner refuses,
/// a budget nothing fits, not enough memory, weights of another model.
pub fn prepare(req: RunRequest) -> Result<PreparedRun, RunError> {
    let RunRequest {
        options: mut o,
        budget,
        ranks,
    } = req;
    // Flags first (any strategy stands in for auto, which the plan below resolves).
    let mut probe = o.clone();
    if probe.strategy == Strategy::Auto {
        probe.strategy = Strategy::FullShard;
    }
    validate(&probe)?;
    if let RankMemory::Threads { .. } = ranks {
        preflight::check_thread_world_size(o.world_size)?;
    }
    let auto_budget = if o.strategy == Strategy::Auto {
        Some(preflight::auto_budget(&o, budget.as_ref(), &ranks)?)
    } else {
        None
    };
    let model = model_of(&o)?;
    let (plan, auto) = strategy::plan_for(&model, &mut o, budget.as_ref(), auto_budget)?;
    validate(&o)?;
    // Offloading moves state from a compute device to host memory: on the CPU the run
    // computes on the CPU device (flat buffers as device tensors, state in host buffers).
    if plan.config.offload_mode().is_some() && matches!(o.placement, Placement::Host) {
        o.placement = Placement::Device(candle_core::Device::Cpu);
    }
    // What each rank holds in this host's memory: the plan's peak and its host bytes on the
    // CPU; only the host bytes (offload) beside a GPU.
    let host_bytes = plan.memory.host_peak.0;
    let resident = if o.placement.device().is_cuda() {
        host_bytes
    } else {
        plan.memory.peak.0 + host_bytes
    };
    match &ranks {
        RankMemory::Threads { available } => {
            preflight::preflight_threads(&o, resident, *available)?
        }
        RankMemory::Mpi { hosts: Some(h) } => preflight::preflight_mpi(&o, resident, h)?,
        RankMemory::Device if host_bytes > 0 => preflight::preflight_offload_host(
            &o,
            host_bytes,
            preflight::available_memory(),
            // `fsdp launch` (torchrun's variables), else the MPI launcher's, else one.
            std::env::var("LOCAL_WORLD_SIZE")
                .ok()
                .and_then(|v| v.parse().ok())
                .or_else(|| preflight::launcher_local_ranks(|k| std::env::var(k).ok()))
                .unwrap_or(1),
        )?,
        RankMemory::Mpi { hosts: None } | RankMemory::Device => {}
    }
    check_init_from(&o, &model)?;
    Ok(PreparedRun {
        options: o,
        model,
        plan,
        auto,
    })
}

/// Checks `--init-from` against the run's model before any rank starts: opens the weight
/// files (headers only) and binds every tensor to a parameter strictly
/// ([`crate::init::FileWeights::open`]). Each rank later reads only its own shards' bytes.
///
/// Errors: [`RunError::Refused`] naming the file and the tensor: a missing, unexpected
/// or mis-shaped tensor (with the model's name and how to name the right configuration), a
/// stored `lm_head.weight` that differs from the embedding a tying config makes it (naming
/// both and the `tie_word_embeddings` fix), a truncated or malformed file, a per-rank shard
/// file.
pub fn check_init_from(
    o: &TrainOptions,
    model: &crate::model::decoder::Decoder,
) -> Result<(), RunError> {
    let Some(p) = &o.init_from else {
        return Ok(());
    };
    match crate::init::FileWeights::open(p, crate::runtime::StagedModel::spec(model)) {
        Ok(_) => Ok(()),
        Err(
            e @ (CkptError::MissingKey { .. }
            | CkptError::UnexpectedKey { .. }
            | CkptError::ShapeMismatch { .. }),
        ) => {
            let model_desc = format!(
                "model {}{}",
                model.name(),
                o.hf_config
                    .as_ref()
                    .map(|c| format!(" (from {})", c.display()))
                    .unwrap_or_else(|| " (a preset)".into())
            );
            // What the files hold, to point at the right model.
            let family = fsdp_checkpoints::WeightFiles::open(p).ok().map(|w| {
                let names = w.tensors();
                if names.iter().any(|t| t.name.contains("model.layers.")) {
                    "Llama-family names (model.layers.N....)"
                } else if names
                    .iter()
                    .any(|t| t.name.starts_with("transformer.") || t.name.starts_with("h."))
                {
                    "GPT-2 names"
                } else {
                    "names of another model"
                }
            });
            let sibling = p
                .parent()
                .map(|d| d.join(fsdp_checkpoints::hfdir::CONFIG_FILE))
                .filter(|c| !p.is_dir() && c.is_file() && o.hf_config.as_deref() != Some(c));
            let fix = match (&sibling, o.hf_config.is_some()) {
                (Some(c), _) => format!(
                    "pass the config.json beside them (--hf-config {}), or their directory as \
                     --init-from",
                    c.display()
                ),
                (None, true) => "pass the config.json they were saved with (--hf-config)".into(),
                (None, false) => "name their model: --hf-config with the config.json they were \
                     saved with, --model with the preset they were trained as, or their model \
                     directory as --init-from"
                    .into(),
            };
            let why = if matches!(e, CkptError::MissingKey { .. }) {
                "Either the weights are incomplete (a file or an index entry missing) or they \
                 belong to another model than"
            } else {
                "The weights belong to another model than"
            };
            Err(RunError::Refused(format!(
                "{e}. {why} {model_desc}{}: {fix}",
                family
                    .map(|f| format!("; the files hold {f}"))
                    .unwrap_or_default()
            )))
        }
        Err(e) => Err(e.into()),
    }
}

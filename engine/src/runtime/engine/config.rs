//! The engine's settings that are not part of the plan: the optimizer, global-norm clipping,
//! initial-weight synchronisation, memory-plan enforcement and the non-finite policy. Read at
//! construction and by every phase of a step.

use crate::optim::Optimizer;
use serde::{Deserialize, Serialize};

/// Which norm clipping uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NormType {
    /// Euclidean norm over all trainable real elements of the model.
    L2,
    /// Largest absolute value.
    Inf,
}

/// Gradient clipping by the global norm (Pascanu et al. 2013, sec. 3.2): if the norm exceeds
/// `max_norm`, every gradient is multiplied by `max_norm / (norm + 1e-6)` (PyTorch's
/// `clip_grad_norm_` formula).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Clip {
    /// Largest allowed norm (> 0).
    pub max_norm: f64,
    /// The norm.
    pub norm: NormType,
}

/// How the engine makes sure every rank starts from the same weights (ranks initialised
/// differently would train different models: <https://github.com/pytorch/torchtitan/issues/166>).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InitSync {
    /// Each rank builds the initial weights itself (seeded); a 64-bit checksum of the full
    /// initial model is compared with rank 0's and a difference is an error before training.
    #[default]
    Verify,
    /// Rank 0's initial weights are broadcast to every rank (other ranks' values are ignored).
    BroadcastFromRank0,
}

/// Engine settings that are not part of the plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineConfig {
    /// Optimizer and its hyper-parameters (the learning rate is given per step).
    pub optimizer: Optimizer,
    /// Global-norm clipping, if any.
    pub clip: Option<Clip>,
    /// Initial-weight synchronisation.
    pub init_sync: InitSync,
    /// Stop with [`EngineError::MemoryOverPlan`](crate::error::EngineError::MemoryOverPlan)
    /// when ledger bytes exceed the plan.
    pub enforce_memory_plan: bool,
    /// What a step whose gradient or loss is not finite does (see [`NonFinitePolicy`]).
    pub nonfinite: NonFinitePolicy,
    /// Stop with [`EngineError::TooManySkipped`](crate::error::EngineError::TooManySkipped)
    /// once this many steps in a row were skipped (`None`: never). A diverged run then ends
    /// instead of skipping forever.
    pub max_consecutive_skips: Option<u64>,
}

/// What the engine does with a step in which some gradient element (after the reduction, or
/// in one rank's own contribution before it) or the loss is infinite or NaN.
///
/// The decision is taken once per step from one flag all-reduced over the world with the loss,
/// so every rank takes the same one. In both cases nothing is updated: parameters, master
/// weights, optimizer state, AdamW's update count and the learning-rate schedule position (the
/// driver advances it on applied updates only, as DeepSpeed does on overflow) stay as they
/// were, and the gradient shards are zeroed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum NonFinitePolicy {
    /// [`NonFinitePolicy::Skip`] when `param_dtype` is f16 (dynamic loss scaling: an overflow
    /// halves the scale and skips the step), [`NonFinitePolicy::Error`] otherwise.
    #[default]
    Auto,
    /// Skip the step: no update; the step counts for the data position and checkpoint
    /// numbering, is reported as skipped ([`StepStats::skipped`](super::StepStats::skipped),
    /// [`StepStats::nonfinite`](super::StepStats::nonfinite)) and counted
    /// ([`RankEngine::skipped_steps`](super::RankEngine::skipped_steps)).
    Skip,
    /// Return [`EngineError::NonFinite`](crate::error::EngineError::NonFinite) on every rank,
    /// naming the step and the parameters whose gradients were not finite and whose rank's
    /// contribution held them; the engine is left as before the step (usable for the next
    /// one). Not with f16 parameters, whose loss scaler must skip overflowing steps.
    Error,
}

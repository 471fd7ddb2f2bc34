//! The one error type of the `fsdp` engine crate.
//!
//! Every variant carries the numbers that made it fail (step, rank, bytes, counts), so a caller
//! can print it as it is. The CLI maps configuration variants to exit code 2 and run failures
//! to exit code 1.

/// Everything the engine (step loop, optimizer, memory ledger, training driver) can reject.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A configuration that cannot run (bad flag combination, sizes that do not fit the model).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The planner rejected the model or the configuration.
    #[error("plan: {0}")]
    Plan(#[from] fsdp_planner::PlanError),
    /// A kernel rejected its arguments (length mismatch, bad hyper-parameter, bad spans).
    #[error("kernel: {0}")]
    Kernel(#[from] fsdp_kernels::KernelError),
    /// A collective failed (mismatched call, dead peer, timeout): the communicator's error,
    /// kept whole, with the rank that observed it.
    #[error("collective on rank {rank}: {source}")]
    Comm {
        /// The rank that observed the failure.
        rank: usize,
        /// The communicator's error (boxed: it is large, and errors travel through every
        /// `Result`).
        #[source]
        source: Box<fsdp_comm::CommError>,
    },
    /// The communicator of a launched process could not be built for `topology`.
    #[error("collective on rank 0: cannot build the communicator for {topology}: {source}")]
    CommSetup {
        /// The world the plan needs (`Topology`'s words).
        topology: String,
        /// The communicator's error (boxed, as above).
        #[source]
        source: Box<fsdp_comm::CommError>,
    },
    /// candle-core failed while computing a unit's forward or backward.
    #[error("compute: {0}")]
    Compute(#[from] candle_core::Error),
    /// Ranks disagree on something that must be identical everywhere (plan fingerprint,
    /// initial weights, number of batches). `detail` names the ranks and the values.
    #[error("ranks disagree on {what}: {detail}")]
    RankMismatch {
        /// What differs (`plan fingerprint`, `initial weights`, `number of batches`, ...).
        what: &'static str,
        /// Per-rank values, e.g. `rank 2: 8 batches, others: 4`.
        detail: String,
    },
    /// A gradient element (some rank's contribution, or the sum of the ranks' contributions)
    /// or the loss was infinite or NaN, under [`NonFinitePolicy::Error`]: no rank updated
    /// anything, the gradients were zeroed and the step count is unchanged. The report names
    /// the step, the parameters and the ranks whose contribution held the values.
    ///
    /// [`NonFinitePolicy::Error`]: crate::runtime::NonFinitePolicy::Error
    #[error("{0}; nothing was updated")]
    NonFinite(Box<crate::runtime::NonFiniteReport>),
    /// `skipped` steps in a row were skipped for non-finite gradients or loss (the engine's
    /// `max_consecutive_skips`): the run has diverged or its f16 loss scale cannot recover.
    #[error("step {step}: {skipped} steps in a row were skipped for non-finite values (the limit); the last: {last}")]
    TooManySkipped {
        /// 1-based step of the last skipped step.
        step: u64,
        /// Consecutive skipped steps.
        skipped: u64,
        /// What the last one found.
        last: String,
    },
    /// Engine-owned live bytes of one category exceeded what the plan allows.
    #[error("step {step}, phase {phase}: {category} live bytes {measured} exceed the plan's {planned} B on rank {rank}")]
    MemoryOverPlan {
        /// 1-based optimizer step.
        step: u64,
        /// Rank that measured it.
        rank: usize,
        /// Phase name (`forward`, `backward`, `optimizer_step`).
        phase: &'static str,
        /// Category name (`param_shards`, ...).
        category: &'static str,
        /// Measured live bytes.
        measured: u64,
        /// Planned bytes.
        planned: u64,
    },
    /// A state import (checkpoint resume) whose sizes do not match this engine's layout.
    #[error("state import: {0}")]
    State(String),
    /// A checkpoint's rank state could not be read for this engine's layout (the checkpoint
    /// crate's error, kept whole).
    #[error("state import: {0}")]
    Ckpt(#[from] fsdp_checkpoints::CkptError),
    /// Published weights could not be opened or bound to the model (the checkpoint crate's
    /// error, kept whole); nothing was trained.
    #[error("initial weights: {source}")]
    InitFiles {
        /// The weight files' error.
        #[source]
        source: fsdp_checkpoints::CkptError,
    },
    /// Saving a checkpoint failed or was refused (the message names the step, the directory
    /// and the problem); the newest complete checkpoint is unchanged.
    #[error("{0}")]
    Checkpoint(String),
    /// Reading training data failed.
    #[error("data: {0}")]
    Data(String),
    /// The initial weights could not be produced on some rank (a read failed, a value is not
    /// finite): every rank returns this error, with the failing rank's message, before any
    /// training.
    #[error("initial weights: {0}")]
    Init(String),
    /// An FSDP unit was asked for a transition its state does not allow (an engine bug, never
    /// a user error): the unit, its state and the refused transition.
    #[error("unit {unit}: {transition} refused in state {state}: {reason}")]
    UnitTransition {
        /// The unit's name.
        unit: String,
        /// The state it was in.
        state: crate::runtime::UnitState,
        /// The refused transition (`start_unshard`, `finish_unshard`, `gather_grads`, ...).
        transition: &'static str,
        /// Why that state does not allow it.
        reason: &'static str,
    },
    /// A rank thread panicked.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank.
        rank: usize,
        /// The panic payload, if it was a string.
        message: String,
    },
}

/// The engine's result type.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// Why preparing a run, or offline checkpoint work, did not go through. The two kinds are
/// what a command-line front end tells apart: bad input (nothing was started) and a failure
/// of work that had started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunError {
    /// Bad input: a flag value, a file, a model description, a budget nothing fits; nothing
    /// was started or written.
    #[error("{0}")]
    Refused(String),
    /// Work that started and failed (a run, a write).
    #[error("{0}")]
    Failed(String),
}

impl RunError {
    /// The exit status a command line reports for it: 2 for bad input, 1 for a failed run.
    pub fn exit_code(&self) -> u8 {
        match self {
            RunError::Refused(_) => 2,
            RunError::Failed(_) => 1,
        }
    }
}

impl From<fsdp_checkpoints::CkptError> for RunError {
    /// Every checkpoint error is bad input (a file, a model, a layout).
    fn from(e: fsdp_checkpoints::CkptError) -> Self {
        RunError::Refused(e.to_string())
    }
}

impl From<EngineError> for RunError {
    /// Configuration, plan, data and initial-value errors are bad input; everything else is a
    /// failed run, non-finite values and diverged runs with what to do next.
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Config(_)
            | EngineError::Plan(_)
            | EngineError::Data(_)
            | EngineError::Init(_)
            | EngineError::InitFiles { .. }
            | EngineError::Ckpt(_) => RunError::Refused(e.to_string()),
            EngineError::NonFinite(_) => RunError::Failed(format!(
                "{e}. Every rank stopped before updating anything: the newest checkpoint (if \
                 --ckpt-dir was given) is intact and `--resume` restarts from it; lower --lr or \
                 --clip, or pass --nonfinite skip to skip such steps"
            )),
            EngineError::TooManySkipped { .. } => RunError::Failed(format!(
                "{e}. The run has diverged: the newest checkpoint (if --ckpt-dir was given) holds \
                 the last applied update; lower --lr, or raise --max-skipped"
            )),
            other => RunError::Failed(other.to_string()),
        }
    }
}

impl From<fsdp_planner::PlanError> for RunError {
    /// A plan the planner refuses is bad input.
    fn from(e: fsdp_planner::PlanError) -> Self {
        RunError::from(EngineError::from(e))
    }
}

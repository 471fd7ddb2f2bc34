//! The model interface the engine executes: an ordered list of stages, each computed by one
//! FSDP unit, on candle-core tensors.
//!
//! The engine owns every parameter; a model owns only its math. For each stage the engine
//! passes the stage's unit parameters as tensors (views of the unsharded flat parameter, in the
//! unit's declaration order from the [`ModelSpec`], a tied parameter passed as its target's
//! tensor) and the stage input; the last stage returns the SUM of the per-token (per-sample)
//! losses of the micro-batch, which the engine divides by the global count exactly once.

use candle_core::Tensor;
use fsdp_planner::ModelSpec;

/// One micro-batch as the engine sees it.
///
/// `input` is what the first stage consumes (u32 token ids `[B, T]` for the GPT, a feature
/// tensor for small models), `target` what the loss consumes, `count` the number of
/// contributing tokens or samples (elements whose loss enters the sum; masked padding
/// excluded). The gradient of a step is divided by the global sum of `count` over every rank
/// and micro-batch, exactly once (so an uneven last batch is weighted by its real samples).
#[derive(Debug, Clone)]
pub struct MicroBatch {
    /// Input of stage 0.
    pub input: Tensor,
    /// Targets of the loss stage (any tensor the model's loss understands).
    pub target: Tensor,
    /// Contributing tokens or samples (>= 0; 0 for a rank without data in join mode).
    pub count: u64,
}

impl MicroBatch {
    /// The same micro-batch with its tensors on `device` (a shallow copy when they are there
    /// already).
    ///
    /// Errors: a failed device copy.
    pub fn to_device(&self, device: &candle_core::Device) -> candle_core::Result<MicroBatch> {
        Ok(MicroBatch {
            input: self.input.to_device(device)?,
            target: self.target.to_device(device)?,
            count: self.count,
        })
    }
}

/// A model computed stage by stage, one FSDP unit per stage (a unit may serve several stages,
/// like a tied-embedding root unit used first and last).
///
/// Contract: `stage_units()` agrees with the planner's schedule for `spec()` (the engine checks
/// it at construction); every method is deterministic (same inputs, same bits), which the
/// world-size parity tests rely on.
pub trait StagedModel: Sync {
    /// The units and parameters (names, shapes, trainable, weight decay, ties).
    fn spec(&self) -> &ModelSpec;

    /// For each stage in forward order, the index of the unit (into `spec().units`) computing it.
    fn stage_units(&self) -> Vec<usize>;

    /// Forward of a non-final stage `stage`: `params` are ALL parameters of the stage's unit in
    /// declaration order (tied ones as their target's tensor), `x` the stage input (the
    /// micro-batch `input` for stage 0). Returns the stage output.
    fn forward(&self, stage: usize, params: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor>;

    /// The final stage: `x` its input (the micro-batch `input` when the model has one stage),
    /// `mb` the micro-batch (for its targets). Returns a 0-dim f32 tensor: the SUM of the
    /// per-token (per-sample) losses.
    fn loss(&self, params: &[Tensor], x: &Tensor, mb: &MicroBatch) -> candle_core::Result<Tensor>;

    /// Deterministic initial values from `seed`: `[unit][param][element]`, per unit in spec
    /// order, per non-tied parameter in declaration order, flattened row-major.
    fn init_params(&self, seed: u64) -> Vec<Vec<Vec<f32>>>;
}

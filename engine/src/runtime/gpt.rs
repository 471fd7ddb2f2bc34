//! The GPT model ([`crate::model::Gpt`]) as a [`StagedModel`]: stage 0 is the embedding,
//! stages `1..=L` the blocks, stage `L + 1` the final norm, LM head and cross-entropy sum.

use crate::model::Gpt;
use crate::runtime::staged::{MicroBatch, StagedModel};
use candle_core::Tensor;
use fsdp_planner::ModelSpec;

impl StagedModel for Gpt {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn stage_units(&self) -> Vec<usize> {
        self.stages().into_iter().map(|(_, u)| u).collect()
    }

    fn forward(&self, stage: usize, params: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_stage(self.stage_at(stage), params, x)
    }

    fn loss(&self, params: &[Tensor], x: &Tensor, mb: &MicroBatch) -> candle_core::Result<Tensor> {
        self.head_loss(params, x, &mb.target)
    }

    fn init_params(&self, seed: u64) -> Vec<Vec<Vec<f32>>> {
        Gpt::init_params(self, seed)
    }
}

//! Measures, with the counting allocator, the heap bytes one GPT or Llama stage holds on the CPU
//! (f32): after its forward (`live`: the graph's intermediates, output included, input
//! excluded), the peak during its forward, and the peak during its backward (graph + the
//! gradient store + transients, parameter gradients included), each above what was live
//! before the forward. Prints one line per (preset, B, T, stage) with the planner's estimate
//! for the same quantities, so the formulas of `fsdp_planner::memory::UseActivations` can be
//! checked against the engine.
//!
//! `cargo run -p fsdp --example activation_bytes [--release] [-- llama]` (`llama`: the
//! `llama-tiny` and `llama-mini` presets, parameters from the spec's shapes).

use candle_core::{DType, Device, Tensor, Var};
use fsdp::memory::CountingAllocator;
use fsdp::model::llama::Llama;
use fsdp::model::{Gpt, Stage};
use fsdp_planner::memory::use_activations;
use fsdp_planner::schedule::UseRole;
use fsdp_planner::PlanConfig;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

/// What this example needs of a decoder (the GPT and the Llama have the same stage methods).
trait Stages {
    fn stages(&self) -> Vec<(Stage, usize)>;
    fn spec(&self) -> &fsdp_planner::ModelSpec;
    fn fwd(&self, s: Stage, p: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor>;
    fn loss(&self, p: &[Tensor], x: &Tensor, t: &Tensor) -> candle_core::Result<Tensor>;
}

macro_rules! impl_stages {
    ($t:ty) => {
        impl Stages for $t {
            fn stages(&self) -> Vec<(Stage, usize)> {
                <$t>::stages(self)
            }
            fn spec(&self) -> &fsdp_planner::ModelSpec {
                &self.spec
            }
            fn fwd(&self, s: Stage, p: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor> {
                self.forward_stage(s, p, x)
            }
            fn loss(&self, p: &[Tensor], x: &Tensor, t: &Tensor) -> candle_core::Result<Tensor> {
                self.head_loss(p, x, t)
            }
        }
    };
}
impl_stages!(Gpt);
impl_stages!(Llama);

/// Parameters from the spec's shapes: vectors 1, matrices `N(0, 0.02)` (a tied parameter as
/// its target's tensor).
fn spec_params(spec: &fsdp_planner::ModelSpec) -> candle_core::Result<Vec<Vec<Tensor>>> {
    spec.units
        .iter()
        .map(|u| {
            let mut ts: Vec<Tensor> = Vec::new();
            for p in &u.params {
                let shape: Vec<usize> = p.shape.iter().map(|&s| s as usize).collect();
                let t = match &p.tied_to {
                    Some(name) => {
                        let j = u.params.iter().position(|q| &q.name == name).unwrap();
                        ts[j].clone()
                    }
                    None if shape.len() == 1 => Tensor::ones(shape, DType::F32, &Device::Cpu)?,
                    None => Tensor::randn(0f32, 0.02, shape, &Device::Cpu)?,
                };
                ts.push(t);
            }
            Ok(ts)
        })
        .collect()
}

/// One line per (B, T, stage) of `model` (printed on pass 1).
fn measure<M: Stages>(
    preset: &str,
    model: &M,
    params: &[Vec<Tensor>],
    pass: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let d = model.spec().units[model.stages()[1].1].params[0].shape[0] as usize;
    for (b, t) in [(2usize, 64usize), (8, 128), (4, 256)] {
        let mut pc = PlanConfig::new(1);
        pc.micro_batch = b as u64;
        pc.seq_len = t as u64;
        let stages = model.stages();
        for (stage, unit) in [stages[0], stages[1], *stages.last().unwrap()] {
            let vars: Vec<Tensor> = params[unit]
                .iter()
                .map(|p| Var::from_tensor(p).map(|v| v.as_tensor().clone()))
                .collect::<Result<_, _>>()?;
            let ids: Vec<u32> = (0..b * t).map(|i| (i * 31 % 256) as u32).collect();
            let ids = Tensor::from_vec(ids, (b, t), &Device::Cpu)?;
            let x = match stage {
                Stage::Embed => ids.clone(),
                _ => Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, t, d), &Device::Cpu)?)?
                    .as_tensor()
                    .clone(),
            };
            let base = ALLOC.current();
            ALLOC.reset_peak();
            let y = match stage {
                Stage::Head => model.loss(&vars, &x, &ids)?,
                _ => model.fwd(stage, &vars, &x)?,
            };
            let live = ALLOC.current() - base;
            let fwd_peak = ALLOC.peak() - base;
            let g = y.ones_like()?;
            ALLOC.reset_peak();
            let root = if matches!(stage, Stage::Head) {
                y
            } else {
                fsdp::model::ops::backward_seed(&y, &g)?
            };
            let grads = root.backward()?;
            let bwd_peak = ALLOC.peak() - base;
            let after = ALLOC.current() - base;
            drop((root, grads, g));
            let role = match stage {
                Stage::Embed => UseRole::Embedding,
                Stage::Block(_) => UseRole::Block,
                Stage::Head => UseRole::Head,
            };
            let est = use_activations(&model.spec().arch, role, &pc);
            if pass == 1 {
                println!(
                    "{preset:10} B={b} T={t:3} {stage:?}: live {live} fwd_peak {fwd_peak} bwd_peak {bwd_peak} after_bwd {after} | plan live {} backward {}",
                    est.live.0, est.backward.0
                );
            }
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // `llama` as the first argument measures the Llama presets instead of the GPT's.
    let llama = std::env::args().nth(1).as_deref() == Some("llama");
    // The first pass warms up lazily allocated thread-local buffers (matmul packing); only
    // the second pass prints.
    for pass in 0..2 {
        if llama {
            for preset in ["llama-tiny", "llama-mini"] {
                let model = Llama::from_preset(preset)?;
                let params = spec_params(&model.spec)?;
                measure(preset, &model, &params, pass)?;
            }
            continue;
        }
        for preset in ["tiny", "mini", "small"] {
            let model = Gpt::from_preset(preset)?;
            let params = model.params_to_tensors(&model.init_params(1), &Device::Cpu)?;
            measure(preset, &model, &params, pass)?;
        }
    }
    Ok(())
}

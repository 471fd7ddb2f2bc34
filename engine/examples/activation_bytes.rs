//! Measures, with the counting allocator, the heap bytes one GPT stage holds on the CPU
//! (f32): after its forward (`live`: the graph's intermediates, output included, input
//! excluded), the peak during its forward, and the peak during its backward (graph + the
//! gradient store + transients, parameter gradients included), each above what was live
//! before the forward. Prints one line per (preset, B, T, stage) with the planner's estimate
//! for the same quantities, so the formulas of `fsdp_planner::memory::UseActivations` can be
//! checked against the engine.
//!
//! `cargo run -p fsdp --example activation_bytes [--release]`

use candle_core::{Device, Tensor, Var};
use fsdp::memory::CountingAllocator;
use fsdp::model::{Gpt, Stage};
use fsdp_planner::memory::use_activations;
use fsdp_planner::schedule::UseRole;
use fsdp_planner::PlanConfig;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The first pass warms up lazily allocated thread-local buffers (matmul packing); only
    // the second pass prints.
    for pass in 0..2 {
        for preset in ["tiny", "mini", "small"] {
            let model = Gpt::from_preset(preset)?;
            let params = model.params_to_tensors(&model.init_params(1), &Device::Cpu)?;
            let d = model.spec.units[1].params[0].shape[0] as usize;
            for (b, t) in [(2usize, 64usize), (8, 128), (4, 256)] {
                let mut pc = PlanConfig::new(1);
                pc.micro_batch = b as u64;
                pc.seq_len = t as u64;
                for (stage, unit) in [
                    model.stages()[0],
                    model.stages()[1],
                    *model.stages().last().unwrap(),
                ] {
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
                        Stage::Head => model.head_loss(&vars, &x, &ids)?,
                        _ => model.forward_stage(stage, &vars, &x)?,
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
                    let est = use_activations(&model.spec.arch, role, &pc);
                    if pass == 1 {
                        println!(
                    "{preset:5} B={b} T={t:3} {stage:?}: live {live} fwd_peak {fwd_peak} bwd_peak {bwd_peak} after_bwd {after} | plan live {} backward {}",
                    est.live.0, est.backward.0
                );
                    }
                }
            }
        }
    }
    Ok(())
}

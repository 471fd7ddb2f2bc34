//! The single-process reference the parity tests compare the engine with: the whole model in
//! one process, no sharding, no collectives, whole-model candle autograd, per-parameter fp32
//! buffers and the same optimizer kernels.
//!
//! To be comparable bit for bit with a sharded run it accumulates the same micro-batches in
//! the order the engine's collectives add them: per micro-batch the per-rank gradients are
//! summed within each shard group in rank order, then across shard groups (the thread
//! backend's deterministic rank-order reductions), then added to the accumulated gradient,
//! which is divided once by the global token count. Under `grad_sync = last` each rank's
//! micro-batch gradients are summed first and the ranks reduced once at the end.

use candle_core::{Device, Tensor, Var};
use fsdp::error::{EngineError, Result};
use fsdp::optim::Optimizer;
use fsdp::runtime::unit::with_f32;
use fsdp::runtime::{Clip, MicroBatch, NormType, StagedModel};
use fsdp_kernels::Span;
use fsdp_planner::GradSync;

/// Single-process training of a [`StagedModel`].
#[derive(Debug)]
pub struct Reference<'a, M: StagedModel + ?Sized> {
    model: &'a M,
    /// `[unit][non-tied param]` values.
    params: Vec<Vec<Vec<f32>>>,
    /// `[unit][non-tied param]` optimizer state buffers.
    state: Vec<Vec<Vec<Vec<f32>>>>,
    trainable: Vec<Vec<bool>>,
    decay: Vec<Vec<bool>>,
    optimizer: Optimizer,
    step: u64,
}

impl<'a, M: StagedModel + ?Sized> Reference<'a, M> {
    /// Starts from `init` (`[unit][non-tied param][element]`).
    pub fn new(model: &'a M, init: Vec<Vec<Vec<f32>>>, optimizer: Optimizer) -> Self {
        let spec = model.spec();
        let nontied = |u: usize| spec.units[u].params.iter().filter(|p| p.tied_to.is_none());
        let trainable: Vec<Vec<bool>> = (0..spec.units.len())
            .map(|u| nontied(u).map(|p| p.trainable).collect())
            .collect();
        let decay = (0..spec.units.len())
            .map(|u| nontied(u).map(|p| p.weight_decay).collect())
            .collect();
        let state = init
            .iter()
            .map(|u| {
                u.iter()
                    .map(|p| vec![vec![0f32; p.len()]; optimizer.state_buffers()])
                    .collect()
            })
            .collect();
        Reference {
            model,
            params: init,
            state,
            trainable,
            decay,
            optimizer,
            step: 0,
        }
    }

    /// The current parameters `[unit][non-tied param][element]`.
    pub fn params(&self) -> &[Vec<Vec<f32>>] {
        &self.params
    }

    /// Loss sum and gradients `[unit][non-tied param]` (zeros for frozen) of one micro-batch,
    /// by whole-model autograd.
    pub fn micro_batch_grads(&self, mb: &MicroBatch) -> Result<(f64, Vec<Vec<Vec<f32>>>)> {
        let spec = self.model.spec();
        let mut tensors: Vec<Vec<Tensor>> = Vec::with_capacity(spec.units.len());
        for (u, us) in spec.units.iter().enumerate() {
            let mut ts: Vec<Tensor> = Vec::with_capacity(us.params.len());
            let mut k = 0;
            for p in &us.params {
                match &p.tied_to {
                    Some(t) => {
                        let j = us
                            .params
                            .iter()
                            .position(|q| &q.name == t)
                            .expect("validated tie");
                        ts.push(ts[j].clone());
                    }
                    None => {
                        let shape: Vec<usize> = p.shape.iter().map(|&d| d as usize).collect();
                        let v = &self.params[u][k];
                        ts.push(if self.trainable[u][k] {
                            Var::from_slice(v, shape.as_slice(), &Device::Cpu)?
                                .as_tensor()
                                .clone()
                        } else {
                            Tensor::from_slice(v, shape.as_slice(), &Device::Cpu)?
                        });
                        k += 1;
                    }
                }
            }
            tensors.push(ts);
        }
        let stages = self.model.stage_units();
        let m = stages.len();
        let mut x = mb.input.clone();
        for (s, &u) in stages.iter().enumerate().take(m - 1) {
            x = self.model.forward(s, &tensors[u], &x)?;
        }
        let loss = self.model.loss(&tensors[stages[m - 1]], &x, mb)?;
        let value = loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        let grads = loss.backward()?;
        let mut out = Vec::with_capacity(spec.units.len());
        for (u, us) in spec.units.iter().enumerate() {
            let mut gs = Vec::new();
            let mut k = 0;
            for (i, p) in us.params.iter().enumerate() {
                if p.tied_to.is_some() {
                    continue;
                }
                let n = self.params[u][k].len();
                let g = match grads.get(&tensors[u][i]) {
                    Some(g) if self.trainable[u][k] => with_f32(g, |x| x.to_vec())?,
                    _ => vec![0f32; n],
                };
                gs.push(g);
                k += 1;
            }
            out.push(gs);
        }
        Ok((value, out))
    }

    /// One training step over `mbs[k][rank]` (micro-batch `k` of rank `rank`) for a world of
    /// `shard_size x replicate_size` ranks; returns the mean loss per token.
    ///
    /// Errors: compute errors, a step without tokens.
    pub fn step(
        &mut self,
        mbs: &[Vec<MicroBatch>],
        shard_size: usize,
        grad_sync: GradSync,
        clip: Option<Clip>,
        lr: f64,
    ) -> Result<f64> {
        let world = mbs.first().map_or(0, |v| v.len());
        let tokens: u64 = mbs.iter().flatten().map(|m| m.count).sum();
        if tokens == 0 || world == 0 {
            return Err(EngineError::Data("reference step without tokens".into()));
        }
        let zeros = || -> Vec<Vec<Vec<f32>>> {
            self.params
                .iter()
                .map(|u| u.iter().map(|p| vec![0f32; p.len()]).collect())
                .collect()
        };
        let mut acc = zeros();
        let mut loss_per_rank = vec![0f64; world];
        let sync_last = grad_sync == GradSync::LastMicroBatch && mbs.len() > 1;
        let mut per_rank_acc: Vec<Vec<Vec<Vec<f32>>>> = if sync_last {
            (0..world).map(|_| zeros()).collect()
        } else {
            Vec::new()
        };
        for row in mbs {
            let mut gs = Vec::with_capacity(world);
            for (r, mb) in row.iter().enumerate() {
                let (l, g) = self.micro_batch_grads(mb)?;
                loss_per_rank[r] += l;
                gs.push(g);
            }
            if sync_last {
                for (a, g) in per_rank_acc.iter_mut().zip(&gs) {
                    add_into(a, g);
                }
            } else {
                let total = reduce_world(&gs, shard_size);
                add_into(&mut acc, &total);
            }
        }
        if sync_last {
            let total = reduce_world(&per_rank_acc, shard_size);
            add_into(&mut acc, &total);
        }
        for g in acc.iter_mut().flatten() {
            fsdp_kernels::div_scalar(g, tokens as f32);
        }
        if let Some(c) = clip {
            let norm = match c.norm {
                NormType::L2 => acc
                    .iter()
                    .flatten()
                    .map(|g| g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>())
                    .sum::<f64>()
                    .sqrt(),
                NormType::Inf => acc
                    .iter()
                    .flatten()
                    .flat_map(|g| g.iter())
                    .fold(0f64, |m, &x| m.max(x.abs() as f64)),
            };
            let coef = c.max_norm / (norm + 1e-6);
            if coef < 1.0 {
                for g in acc.iter_mut().flatten() {
                    fsdp_kernels::scale(g, coef as f32);
                }
            }
        }
        self.step += 1;
        let opt = self.optimizer.with_lr(lr);
        for (u, unit) in self.params.iter_mut().enumerate() {
            for (k, p) in unit.iter_mut().enumerate() {
                if !self.trainable[u][k] {
                    continue;
                }
                let spans = [Span::new(0, p.len(), self.decay[u][k])];
                let mut st: Vec<&mut [f32]> = self.state[u][k]
                    .iter_mut()
                    .map(|s| s.as_mut_slice())
                    .collect();
                opt.step_shard(p, &acc[u][k], &mut st, &spans, self.step)?;
            }
        }
        let mut loss = 0f64;
        for l in loss_per_rank {
            loss += l;
        }
        Ok(loss / tokens as f64)
    }
}

fn add_into(acc: &mut [Vec<Vec<f32>>], g: &[Vec<Vec<f32>>]) {
    for (a, b) in acc.iter_mut().flatten().zip(g.iter().flatten()) {
        for (x, y) in a.iter_mut().zip(b) {
            *x += *y;
        }
    }
}

/// The engine's reduction order over ranks: within each shard group (contiguous ranks) in
/// rank order starting from the first rank's value, then the groups' sums in order.
fn reduce_world(gs: &[Vec<Vec<Vec<f32>>>], shard_size: usize) -> Vec<Vec<Vec<f32>>> {
    let sum_in_order = |items: Vec<&Vec<Vec<Vec<f32>>>>| -> Vec<Vec<Vec<f32>>> {
        let mut out = items[0].clone();
        for g in &items[1..] {
            add_into(&mut out, g);
        }
        out
    };
    let groups: Vec<Vec<Vec<Vec<f32>>>> = gs
        .chunks(shard_size)
        .map(|c| sum_in_order(c.iter().collect()))
        .collect();
    sum_in_order(groups.iter().collect())
}

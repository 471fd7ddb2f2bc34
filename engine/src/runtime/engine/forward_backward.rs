//! One micro-batch's forward and backward, unit by unit (plan phases forward and backward): the
//! stage computations on candle autograd (kept graphs, or recompute under activation
//! checkpointing), the parameter gradients copied into each unit's unsharded flat gradient,
//! and the reductions started where the schedule says, overlapped with the next backward step.

use super::reduce::PendingReduce;
use super::RankEngine;
use crate::error::{EngineError, Result};
use crate::runtime::staged::{MicroBatch, StagedModel};
use crate::runtime::unit::Placement;
use candle_core::{Tensor, Var};
use fsdp_planner::time::SpanKind;
use fsdp_planner::Phase;
use fsdp_types::DType;

impl<M: StagedModel + ?Sized> RankEngine<'_, M> {
    /// Forward and backward of one micro-batch; returns its local loss sum.
    pub(super) fn micro_batch(
        &mut self,
        mb: &MicroBatch,
        sync_last: bool,
        reduce: bool,
    ) -> Result<f64> {
        let on_device;
        let mb = match &self.placement {
            Placement::Host => mb,
            Placement::Device(d) => {
                on_device = mb.to_device(d)?;
                &on_device
            }
        };
        let plan = self.plan;
        let sched = &plan.schedule;
        // Without activation checkpointing every use keeps its graph (with or without resharding
        // after forward: a resharded unit's parameter memory is freed and re-gathered into the
        // same tensors before its backward, see `FsdpUnit::reshard`).
        let keep = !sched.activation_checkpointing;
        let m = self.stage_units.len();
        self.enter_phase(Phase::Forward);
        // Per stage: the input kept for backward, and (keep mode) the output with its graph.
        let mut inputs: Vec<Option<Tensor>> = vec![None; m];
        let mut outputs: Vec<Option<Tensor>> = vec![None; m];
        let mut x = mb.input.clone();
        let mut loss_value = 0f64;
        for unit in self.units.iter_mut() {
            unit.clear_graph_uses();
        }
        for s in 0..m {
            let u = self.stage_units[s];
            self.transition_to(&sched.forward[s].alive, Some(u), &sched.forward[s].prefetch)?;
            let t = self.trace_clock();
            let unit = &self.units[u];
            if s + 1 == m {
                // The loss stage keeps its graph into backward (its unit stays unsharded across
                // the forward/backward boundary in every schedule).
                let x_in = if self.needs_input_grad[s] {
                    Var::from_tensor(&x)?.as_tensor().clone()
                } else {
                    x.clone()
                };
                let params = if self.needs_backward[s] {
                    unit.params()?
                } else {
                    unit.plain_params()?
                };
                let loss = self.model.loss(params, &x_in, mb)?;
                if self.needs_backward[s] {
                    self.units[u].add_graph_use();
                }
                loss_value = loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
                inputs[s] = Some(x_in);
                outputs[s] = Some(loss);
            } else if keep && self.needs_backward[s] {
                let x_in = if self.needs_input_grad[s] {
                    Var::from_tensor(&x)?.as_tensor().clone()
                } else {
                    x.clone()
                };
                let y = self.model.forward(s, unit.params()?, &x_in)?;
                self.units[u].add_graph_use();
                x = y.detach();
                inputs[s] = Some(x_in);
                outputs[s] = Some(y);
            } else {
                let y = self.model.forward(s, unit.plain_params()?, &x)?;
                inputs[s] = Some(std::mem::replace(&mut x, y));
            }
            self.trace_compute(t, SpanKind::Forward, "forward", s, u);
        }
        drop(x);
        self.enter_phase(Phase::Backward);
        let mut g_out: Option<Tensor> = None;
        let mut touched = vec![false; self.units.len()];
        let grad_dtype = if sync_last {
            DType::F32
        } else {
            plan.config.reduce_dtype
        };
        let mut pending: Option<PendingReduce> = None;
        for kb in 0..m {
            let s = m - 1 - kb;
            let u = self.stage_units[s];
            self.transition_to(
                &sched.backward[kb].alive,
                Some(u),
                &sched.backward[kb].prefetch,
            )?;
            if self.needs_backward[s] {
                let mut t = self.trace_clock();
                let x_in = inputs[s].take().expect("stage input kept");
                let root = if s + 1 == m {
                    let loss = outputs[s].take().expect("loss kept");
                    match self.scaler {
                        Some(sc) => loss.affine(sc.scale, 0.0)?,
                        None => loss,
                    }
                } else {
                    let g = g_out.take().expect("upstream gradient");
                    let y = match outputs[s].take() {
                        Some(y) => y,
                        None => {
                            let x_var = if self.needs_input_grad[s] {
                                Var::from_tensor(&x_in)?.as_tensor().clone()
                            } else {
                                x_in.clone()
                            };
                            let y = self.model.forward(s, self.units[u].params()?, &x_var)?;
                            inputs[s] = Some(x_var);
                            self.trace_compute(t, SpanKind::Recompute, "recompute", s, u);
                            t = self.trace_clock();
                            y
                        }
                    };
                    crate::model::ops::backward_seed(&y, &g)?
                };
                let x_in = inputs[s].take().unwrap_or(x_in);
                let mut grads = root.backward()?;
                drop(root);
                let unit = &mut self.units[u];
                unit.drop_graph_use();
                if self.needs_input_grad[s] {
                    g_out = Some(
                        grads
                            .remove(&x_in)
                            .ok_or_else(|| {
                                EngineError::Config(format!("stage {s}: no gradient for its input"))
                            })?
                            .detach(),
                    );
                }
                drop(x_in);
                self.trace_compute(t, SpanKind::Backward, "backward", s, u);
                if self.units[u].trainable() {
                    // Keep only the parameter gradients: intermediate gradients go first.
                    let mut params: Vec<Option<Tensor>> = self.units[u]
                        .params()?
                        .iter()
                        .map(|v| grads.remove(v))
                        .collect();
                    drop(grads);
                    self.units[u].alloc_flat_grads(grad_dtype, &mut self.ledger)?;
                    let add = sync_last || touched[u];
                    self.units[u].gather_grads(&mut params, add)?;
                    touched[u] = true;
                }
            }
            // The previous unit's reduction ran while this step computed.
            if let Some(p) = pending.take() {
                self.finish_reduce(p)?;
            }
            if sched.backward[kb].reduce_scatter && reduce {
                let p = self.start_reduce(u, sync_last)?;
                if self.overlap {
                    pending = Some(p);
                } else {
                    self.finish_reduce(p)?;
                }
            }
        }
        if let Some(p) = pending.take() {
            self.finish_reduce(p)?;
        }
        Ok(loss_value)
    }
}

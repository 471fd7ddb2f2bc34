//! The per-rank FSDP engine: executes a [`ShardPlan`]'s schedule for one training step.
//!
//! One step (ARCHITECTURE-GUIDE "One training step"; Zhao et al. 2023, "PyTorch FSDP", sec. 3;
//! Rajbhandari et al. 2020, "ZeRO", sec. 5):
//! 1. All ranks exchange their micro-batch count and token count: a different count is an
//!    error naming the ranks (real-world case BC-10a), the global token count `N` is known.
//! 2. Per micro-batch, forward: at each schedule position the plan's `alive` units are
//!    unsharded (all-gathered) and the others resharded; a unit computes its stage. With
//!    `reshard_after_forward` only the stage input is kept and the backward recomputes the
//!    stage (unit-level activation checkpointing); otherwise the graph is kept.
//! 3. Backward in reverse order: gradients of the unit's parameters are copied into its
//!    unsharded flat gradient; where the plan says `reduce_scatter` the flat gradient is
//!    sum-reduce-scattered over the shard group, all-reduced over the replicate group and
//!    added into the fp32 gradient shard (every micro-batch, or only on the last one under
//!    `grad_sync = last`, real-world case BC-04).
//! 4. The gradient shards are divided by `N` exactly once (BC-03, BC-10b); the loss is the
//!    world's loss sum over `N`. A non-finite loss or ledger bytes above the plan stop the run
//!    on every rank.
//! 5. Clipping by the global norm over the shard group, padding excluded (BC-02); the optimizer
//!    on each flat shard with the plan's spans; gradients zeroed.
//!
//! DDP is the same path with a shard group of one; hybrid sharding has both groups above one.

use crate::error::{EngineError, Result};
use crate::memory::{MemoryLedger, PhasePeak, LEDGER_CATEGORIES};
use crate::optim::Optimizer;
use crate::runtime::collectives::{f64_chunks_to_u64, u64_to_f64_chunks, Collectives};
use crate::runtime::staged::{MicroBatch, StagedModel};
use crate::runtime::unit::{with_f32, FsdpUnit};
use candle_core::{Tensor, Var};
use fsdp_comm::{Buf, BufMut, Communicator, Group, ReduceOp};
use fsdp_planner::{GradSync, Phase, ShardPlan};
use fsdp_types::DType;
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

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

/// How the engine makes sure every rank starts from the same weights (real-world case BC-11).
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
    /// Stop with [`EngineError::MemoryOverPlan`] when ledger bytes exceed the plan.
    pub enforce_memory_plan: bool,
}

/// What one call of [`RankEngine::accumulate`] produced (identical on every rank).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Accumulated {
    /// The world's mean loss per contributing token: loss sum over all ranks and micro-batches
    /// divided by `tokens`.
    pub loss: f64,
    /// Global number of contributing tokens (samples), the divisor of the gradient.
    pub tokens: u64,
    /// This rank's loss sum (before the world sum).
    pub local_loss_sum: f64,
}

/// Timing and measurements of one training step on one rank.
#[derive(Debug, Clone, Serialize)]
pub struct StepStats {
    /// 1-based optimizer step.
    pub step: u64,
    /// World mean loss per token.
    pub loss: f64,
    /// Global contributing tokens of the step.
    pub tokens: u64,
    /// The gradient norm before clipping (when clipping is on).
    pub grad_norm: Option<f64>,
    /// Learning rate used.
    pub lr: f64,
    /// Wall time of the step (seconds).
    pub step_seconds: f64,
    /// Wall time inside collectives (seconds).
    pub comm_seconds: f64,
    /// Number of collective calls.
    pub comm_calls: u64,
    /// Ledger peaks per phase: forward, backward, optimizer step.
    pub ledger: [PhasePeak; 3],
}

/// One flat parameter's part of a rank's state, for checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlatShardState {
    /// Unit index.
    pub unit: usize,
    /// Index of the flat parameter in the unit's layout (trainable first).
    pub flat: usize,
    /// Whether it is trainable.
    pub trainable: bool,
    /// fp32 master shard (`s_f` elements; padding zero).
    pub param: Vec<f32>,
    /// Optimizer state buffers, named (`exp_avg`, `exp_avg_sq` for AdamW; `momentum_buffer`
    /// for SGD with momentum), `s_f` elements each; empty for frozen flat params.
    pub optimizer_state: Vec<(String, Vec<f32>)>,
}

/// Everything of one rank's engine state a checkpoint needs to resume exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankState {
    /// The rank.
    pub rank: usize,
    /// World size `W`.
    pub world_size: usize,
    /// Shard-group size `S`.
    pub shard_size: usize,
    /// This rank's shard index (`rank % S`).
    pub shard_index: usize,
    /// The plan fingerprint the state belongs to.
    pub plan_fingerprint: String,
    /// Optimizer steps taken (the next step is `optimizer_step + 1`).
    pub optimizer_step: u64,
    /// Every flat parameter of every unit, in unit order.
    pub flats: Vec<FlatShardState>,
}

/// The engine of one rank: its FSDP units, the plan, a communicator, a memory ledger.
pub struct RankEngine<'a, M: StagedModel + ?Sized> {
    model: &'a M,
    plan: &'a ShardPlan,
    comm: Collectives<'a>,
    cfg: EngineConfig,
    units: Vec<FsdpUnit>,
    stage_units: Vec<usize>,
    needs_input_grad: Vec<bool>,
    needs_backward: Vec<bool>,
    ledger: MemoryLedger,
    step: u64,
    rank: usize,
    shard_index: usize,
}

impl<M: StagedModel + ?Sized> std::fmt::Debug for RankEngine<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankEngine")
            .field("rank", &self.rank)
            .field("units", &self.units.len())
            .field("step", &self.step)
            .finish()
    }
}

/// FNV-1a 64 over bytes (a checksum for cross-rank comparison, not a cryptographic hash).
fn fnv1a(h: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *h ^= *b as u64;
        *h = h.wrapping_mul(0x100000001b3);
    }
}

const FNV_OFFSET: u64 = 0xcbf29ce484222325;

fn state_names(opt: &Optimizer) -> &'static [&'static str] {
    match opt.state_buffers() {
        2 => &["exp_avg", "exp_avg_sq"],
        1 => &["momentum_buffer"],
        _ => &[],
    }
}

impl<'a, M: StagedModel + ?Sized> RankEngine<'a, M> {
    /// Builds the engine of `comm`'s rank: checks that the plan fits the communicator and the
    /// model, compares the plan fingerprint with rank 0's, makes the initial weights identical
    /// on every rank (`cfg.init_sync`) and keeps this rank's shards.
    ///
    /// `init` is `[unit][non-tied param][element]` (see [`StagedModel::init_params`]).
    ///
    /// Errors: [`EngineError::Config`] (a shard-optimizer plan, which this engine does not
    /// execute; world size, shard size, dtypes, optimizer or stages differ from the plan;
    /// wrong init sizes), [`EngineError::RankMismatch`] (fingerprint or
    /// initial-weight checksum differs from rank 0's), [`EngineError::Comm`].
    pub fn new(
        model: &'a M,
        plan: &'a ShardPlan,
        comm: &'a dyn Communicator,
        cfg: EngineConfig,
        init: &[Vec<Vec<f32>>],
    ) -> Result<Self> {
        if plan.strategy.replicated_params_and_grads() {
            return Err(EngineError::Config(format!(
                "strategy {} (ZeRO-1: replicated params and grads, sharded optimizer state) is planned by `fsdp plan` but this engine does not execute it; use full-shard, shard-grad-op, no-shard or hybrid",
                plan.strategy
            )));
        }
        let mut comm = Collectives::new(comm);
        let topo = comm.topology();
        let rank = comm.rank();
        if topo.world_size as u64 != plan.world_size() || topo.shard_size as u64 != plan.shard_size
        {
            return Err(EngineError::Config(format!(
                "the plan is for world size {} with shard groups of {}, the communicator has {} ranks in shard groups of {}",
                plan.world_size(),
                plan.shard_size,
                topo.world_size,
                topo.shard_size
            )));
        }
        if plan.config.param_dtype != DType::F32 || plan.config.reduce_dtype != DType::F32 {
            return Err(EngineError::Config(format!(
                "param_dtype {} / reduce_dtype {}: this engine computes and reduces in f32 only",
                plan.config.param_dtype, plan.config.reduce_dtype
            )));
        }
        let planned_state = plan.config.optimizer.state_bytes_per_element();
        if planned_state != 4 * cfg.optimizer.state_buffers() as u64 {
            return Err(EngineError::Config(format!(
                "the plan counts {planned_state} optimizer bytes per element, the optimizer keeps {}",
                4 * cfg.optimizer.state_buffers()
            )));
        }
        let spec = model.spec();
        let stage_units = model.stage_units();
        let planned: Vec<usize> = plan.schedule.forward.iter().map(|s| s.unit).collect();
        if stage_units != planned {
            return Err(EngineError::Config(format!(
                "the model's stages use units {stage_units:?}, the plan's schedule {planned:?}"
            )));
        }
        if spec.units.len() != plan.units.len() || init.len() != spec.units.len() {
            return Err(EngineError::Config(format!(
                "model has {} units, plan {}, initial values {}",
                spec.units.len(),
                plan.units.len(),
                init.len()
            )));
        }

        // Plan fingerprint against rank 0's.
        let mut h = FNV_OFFSET;
        fnv1a(&mut h, plan.fingerprint().as_bytes());
        let all = comm.all_gather_f64(&u64_to_f64_chunks(h))?;
        let fps: Vec<u64> = all.iter().map(|c| f64_chunks_to_u64(c)).collect();
        if let Some(bad) = fps.iter().position(|&f| f != fps[0]) {
            return Err(EngineError::RankMismatch {
                what: "plan fingerprint",
                detail: format!(
                    "rank {bad} has plan hash {:016x}, rank 0 has {:016x} (this rank: {})",
                    fps[bad],
                    fps[0],
                    plan.fingerprint()
                ),
            });
        }

        // Full initial flat parameters, per unit per flat.
        let mut full: Vec<Vec<Vec<f32>>> = Vec::with_capacity(spec.units.len());
        for (u, (us, ul)) in spec.units.iter().zip(&plan.units).enumerate() {
            let nontied: Vec<usize> = us
                .params
                .iter()
                .enumerate()
                .filter(|(_, p)| p.tied_to.is_none())
                .map(|(i, _)| i)
                .collect();
            if init[u].len() != nontied.len() {
                return Err(EngineError::Config(format!(
                    "unit {}: {} initial tensors for {} parameters",
                    us.name,
                    init[u].len(),
                    nontied.len()
                )));
            }
            let mut flats = Vec::with_capacity(ul.flat_params.len());
            for fl in &ul.flat_params {
                let mut parts: Vec<&[f32]> = Vec::with_capacity(fl.segments.len());
                for seg in &fl.segments {
                    let k = nontied
                        .iter()
                        .position(|&i| i == seg.param_index)
                        .ok_or_else(|| {
                            EngineError::Config(format!("segment {} is a tied parameter", seg.name))
                        })?;
                    if init[u][k].len() as u64 != seg.numel.0 {
                        return Err(EngineError::Config(format!(
                            "{}: {} initial values for {} elements",
                            seg.name,
                            init[u][k].len(),
                            seg.numel.0
                        )));
                    }
                    parts.push(&init[u][k]);
                }
                flats.push(fl.flatten(&parts));
            }
            full.push(flats);
        }
        match cfg.init_sync {
            InitSync::BroadcastFromRank0 => {
                for flats in full.iter_mut() {
                    for f in flats.iter_mut() {
                        comm.broadcast(Group::World, 0, BufMut::F32(f))?;
                    }
                }
            }
            InitSync::Verify => {
                let mut h = FNV_OFFSET;
                for f in full.iter().flatten() {
                    fnv1a(&mut h, bytemuck::cast_slice(f));
                }
                let all = comm.all_gather_f64(&u64_to_f64_chunks(h))?;
                let sums: Vec<u64> = all.iter().map(|c| f64_chunks_to_u64(c)).collect();
                let bad: Vec<usize> = (0..sums.len()).filter(|&r| sums[r] != sums[0]).collect();
                if !bad.is_empty() {
                    return Err(EngineError::RankMismatch {
                        what: "initial weights",
                        detail: format!(
                            "ranks {bad:?} start from weights whose checksum differs from rank 0's ({:016x} vs {:016x}); seed every rank identically or use broadcast from rank 0",
                            sums[bad[0]], sums[0]
                        ),
                    });
                }
            }
        }
        let shard_index = rank % topo.shard_size;
        let mut ledger = MemoryLedger::new();
        let mut units = Vec::with_capacity(spec.units.len());
        for (u, (us, ul)) in spec.units.iter().zip(&plan.units).enumerate() {
            units.push(FsdpUnit::new(
                u,
                us,
                ul,
                &full[u],
                shard_index as u64,
                cfg.optimizer.state_buffers(),
                &mut ledger,
            )?);
        }
        drop(full);
        let m = stage_units.len();
        let mut needs_input_grad = vec![false; m];
        let mut seen_trainable = false;
        for s in 0..m {
            needs_input_grad[s] = seen_trainable;
            seen_trainable |= units[stage_units[s]].trainable();
        }
        let needs_backward = (0..m)
            .map(|s| needs_input_grad[s] || units[stage_units[s]].trainable())
            .collect();
        Ok(RankEngine {
            model,
            plan,
            comm,
            cfg,
            units,
            stage_units,
            needs_input_grad,
            needs_backward,
            ledger,
            step: 0,
            rank,
            shard_index,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The plan executed.
    pub fn plan(&self) -> &ShardPlan {
        self.plan
    }

    /// Optimizer steps taken so far.
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// The memory ledger (live bytes and per-phase peaks).
    pub fn ledger(&self) -> &MemoryLedger {
        &self.ledger
    }

    /// The FSDP units (shards, gradient shards, optimizer state).
    pub fn units(&self) -> &[FsdpUnit] {
        &self.units
    }

    /// Returns and resets the time spent in collectives and their count.
    pub fn take_comm_time(&mut self) -> (Duration, u64) {
        self.comm.take_time()
    }

    /// Exchanges the number of batches each rank will train on and errors, on every rank, if
    /// they differ (instead of hanging in a collective later; real-world case BC-10a).
    ///
    /// Errors: [`EngineError::RankMismatch`] naming the ranks and counts; [`EngineError::Comm`].
    pub fn check_batch_counts(&mut self, batches: u64) -> Result<()> {
        let all = self.comm.all_gather_f64(&[batches as f64])?;
        check_counts(&all, "number of batches", "batches")
    }

    /// Makes exactly the units in `alive` unsharded: reshards the others first (so live bytes
    /// never exceed either position), then unshards `first` and the rest in order.
    fn transition_to(&mut self, alive: &[usize], first: Option<usize>) -> Result<()> {
        for u in 0..self.units.len() {
            if self.units[u].is_unsharded() && !alive.contains(&u) {
                self.units[u].reshard(&mut self.ledger);
            }
        }
        let order = first
            .into_iter()
            .chain(alive.iter().copied().filter(|&u| Some(u) != first));
        for u in order {
            if !self.units[u].is_unsharded() {
                self.units[u].unshard(&mut self.comm, &mut self.ledger)?;
            }
        }
        Ok(())
    }

    /// Runs forward and backward over this rank's micro-batches and leaves in the gradient
    /// shards the world's mean gradient (sum over every rank's tokens divided by the global
    /// token count once). Collective: every rank must call it with the same number of
    /// micro-batches, else [`EngineError::RankMismatch`] on every rank.
    ///
    /// Errors: [`EngineError::RankMismatch`], [`EngineError::NonFiniteLoss`],
    /// [`EngineError::MemoryOverPlan`], [`EngineError::Compute`], [`EngineError::Comm`].
    pub fn accumulate(&mut self, mbs: &[MicroBatch]) -> Result<Accumulated> {
        let local_tokens: u64 = mbs.iter().map(|m| m.count).sum();
        let all = self
            .comm
            .all_gather_f64(&[mbs.len() as f64, local_tokens as f64])?;
        check_counts(&all, "number of micro-batches in a step", "micro-batches")?;
        let tokens: u64 = all.iter().map(|v| v[1] as u64).sum();
        if tokens == 0 {
            return Err(EngineError::Data(
                "a step with no contributing tokens on any rank".into(),
            ));
        }
        if mbs.is_empty() {
            return Err(EngineError::Data(
                "a step needs at least one micro-batch".into(),
            ));
        }
        self.ledger.reset_peaks();
        // Persistent unsharded gradients (sync on the last micro-batch) belong to the forward
        // phase of the first micro-batch.
        self.ledger.enter(Phase::Forward);
        let k_total = mbs.len();
        let sync_last = self.plan.config.grad_sync == GradSync::LastMicroBatch && k_total > 1;
        if sync_last {
            for u in 0..self.units.len() {
                if self.units[u].trainable() {
                    self.units[u].alloc_flat_grads(&mut self.ledger);
                }
            }
        }
        let mut local_loss = 0f64;
        for (k, mb) in mbs.iter().enumerate() {
            let last = k + 1 == k_total;
            local_loss += self.micro_batch(mb, sync_last, !sync_last || last)?;
        }
        // End of the backward phase: everything unsharded goes.
        self.transition_to(&[], None)?;
        for u in self.units.iter_mut() {
            u.free_flat_grads(&mut self.ledger);
        }
        for u in self.units.iter_mut() {
            for f in u.flats.iter_mut().filter(|f| f.layout.trainable) {
                fsdp_kernels::div_scalar(&mut f.grad, tokens as f32);
            }
        }
        let violation = self.memory_violation();
        let mut buf = [local_loss, violation.is_some() as u64 as f64];
        self.comm
            .all_reduce(Group::World, ReduceOp::Sum, BufMut::F64(&mut buf))?;
        if let Some(e) = violation {
            return Err(e);
        }
        if buf[1] > 0.0 {
            return Err(EngineError::MemoryOverPlan {
                step: self.step + 1,
                rank: self.rank,
                phase: "backward",
                category: "(another rank)",
                measured: 0,
                planned: 0,
            });
        }
        let loss = buf[0] / tokens as f64;
        if !loss.is_finite() {
            return Err(EngineError::NonFiniteLoss {
                step: self.step + 1,
                loss,
            });
        }
        Ok(Accumulated {
            loss,
            tokens,
            local_loss_sum: local_loss,
        })
    }

    fn memory_violation(&self) -> Option<EngineError> {
        if !self.cfg.enforce_memory_plan {
            return None;
        }
        for phase in [Phase::Forward, Phase::Backward] {
            let measured = self.ledger.peak(phase).max;
            let planned = self.plan.memory.phase(phase).max;
            for c in LEDGER_CATEGORIES {
                if measured.get(c) > planned.get(c) {
                    return Some(EngineError::MemoryOverPlan {
                        step: self.step + 1,
                        rank: self.rank,
                        phase: phase.name(),
                        category: c.name(),
                        measured: measured.get(c).0,
                        planned: planned.get(c).0,
                    });
                }
            }
        }
        None
    }

    /// Forward and backward of one micro-batch; returns its local loss sum.
    fn micro_batch(&mut self, mb: &MicroBatch, sync_last: bool, reduce: bool) -> Result<f64> {
        let plan = self.plan;
        let sched = &plan.schedule;
        let keep = !sched.reshard_after_forward;
        let m = self.stage_units.len();
        self.ledger.enter(Phase::Forward);
        // Per stage: the input kept for backward, and (keep mode) the output with its graph.
        let mut inputs: Vec<Option<Tensor>> = vec![None; m];
        let mut outputs: Vec<Option<Tensor>> = vec![None; m];
        let mut x = mb.input.clone();
        let mut loss_value = 0f64;
        for s in 0..m {
            let u = self.stage_units[s];
            self.transition_to(&sched.forward[s].alive, Some(u))?;
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
                    &unit.vars
                } else {
                    &unit.plain
                };
                let loss = self.model.loss(params, &x_in, mb)?;
                loss_value = loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
                inputs[s] = Some(x_in);
                outputs[s] = Some(loss);
            } else if keep && self.needs_backward[s] {
                let x_in = if self.needs_input_grad[s] {
                    Var::from_tensor(&x)?.as_tensor().clone()
                } else {
                    x.clone()
                };
                let y = self.model.forward(s, &unit.vars, &x_in)?;
                x = y.detach();
                inputs[s] = Some(x_in);
                outputs[s] = Some(y);
            } else {
                let y = self.model.forward(s, &unit.plain, &x)?;
                inputs[s] = Some(std::mem::replace(&mut x, y));
            }
        }
        drop(x);
        self.ledger.enter(Phase::Backward);
        let mut g_out: Option<Tensor> = None;
        let mut touched = vec![false; self.units.len()];
        for kb in 0..m {
            let s = m - 1 - kb;
            let u = self.stage_units[s];
            self.transition_to(&sched.backward[kb].alive, Some(u))?;
            if self.needs_backward[s] {
                let x_in = inputs[s].take().expect("stage input kept");
                let root = if s + 1 == m {
                    outputs[s].take().expect("loss kept")
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
                            let y = self.model.forward(s, &self.units[u].vars, &x_var)?;
                            inputs[s] = Some(x_var);
                            y
                        }
                    };
                    crate::model::ops::backward_seed(&y, &g)?
                };
                let x_in = inputs[s].take().unwrap_or(x_in);
                let mut grads = root.backward()?;
                drop(root);
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
                if self.units[u].trainable() {
                    // Keep only the parameter gradients: intermediate gradients go first.
                    let mut params: Vec<Option<Tensor>> =
                        self.units[u].vars.iter().map(|v| grads.remove(v)).collect();
                    drop(grads);
                    self.units[u].alloc_flat_grads(&mut self.ledger);
                    let add = sync_last || touched[u];
                    self.units[u].gather_grads(&mut params, add)?;
                    touched[u] = true;
                }
            }
            if sched.backward[kb].reduce_scatter && reduce {
                self.reduce_unit(u)?;
                if !sync_last {
                    self.units[u].free_flat_grads(&mut self.ledger);
                }
            }
        }
        Ok(loss_value)
    }

    /// Reduces unit `u`'s unsharded flat gradients into its fp32 gradient shards:
    /// reduce-scatter (sum) over the shard group into a staging buffer, all-reduce (sum) over
    /// the replicate group, add into the shard. With a shard group of one the replicate
    /// all-reduce runs in place on the flat gradient.
    fn reduce_unit(&mut self, u: usize) -> Result<()> {
        let s = self.comm.group_size(Group::Shard);
        let unit = &mut self.units[u];
        let mut t = 0;
        for fs in unit.flats.iter_mut() {
            if !fs.layout.trainable {
                continue;
            }
            let flat_grad = &mut unit.flat_grads[t];
            t += 1;
            if s > 1 {
                let n = fs.shard_numel();
                self.ledger
                    .alloc(fsdp_planner::Category::Staging, 4 * n as u64);
                let mut staging = vec![0f32; n];
                self.comm.reduce_scatter_sum(
                    Group::Shard,
                    Buf::F32(flat_grad),
                    BufMut::F32(&mut staging),
                )?;
                self.comm
                    .all_reduce(Group::Replicate, ReduceOp::Sum, BufMut::F32(&mut staging))?;
                fsdp_kernels::accumulate(&mut fs.grad, &staging)?;
                drop(staging);
                self.ledger
                    .free(fsdp_planner::Category::Staging, 4 * n as u64);
            } else {
                self.comm
                    .all_reduce(Group::Replicate, ReduceOp::Sum, BufMut::F32(flat_grad))?;
                fsdp_kernels::accumulate(&mut fs.grad, flat_grad)?;
            }
        }
        Ok(())
    }

    /// The global gradient norm over every trainable real element of the model (padding
    /// excluded): local sums of squares (f64) summed over the shard group, or local max-abs
    /// maxed over it. Collective over the shard group.
    pub fn grad_norm(&mut self, norm: NormType) -> Result<f64> {
        let mut local = 0f64;
        for f in self
            .units
            .iter()
            .flat_map(|u| &u.flats)
            .filter(|f| f.layout.trainable)
        {
            match norm {
                NormType::L2 => local += fsdp_kernels::sum_squares(&f.grad, &f.spans)?,
                NormType::Inf => {
                    let m = fsdp_kernels::max_abs(&f.grad, &f.spans)? as f64;
                    local = if m.is_nan() || m > local { m } else { local };
                }
            }
        }
        let mut buf = [local];
        let op = match norm {
            NormType::L2 => ReduceOp::Sum,
            NormType::Inf => ReduceOp::Max,
        };
        self.comm
            .all_reduce(Group::Shard, op, BufMut::F64(&mut buf))?;
        Ok(match norm {
            NormType::L2 => buf[0].sqrt(),
            NormType::Inf => buf[0],
        })
    }

    /// Clips the gradient shards by the global norm (see [`Clip`]); returns the norm before
    /// clipping. Collective over the shard group.
    pub fn clip_grad_norm(&mut self, clip: Clip) -> Result<f64> {
        if clip.max_norm.is_nan() || clip.max_norm <= 0.0 {
            return Err(EngineError::Config(format!(
                "max_norm must be > 0, got {}",
                clip.max_norm
            )));
        }
        let norm = self.grad_norm(clip.norm)?;
        let coef = clip.max_norm / (norm + 1e-6);
        if coef < 1.0 {
            for f in self.units.iter_mut().flat_map(|u| u.flats.iter_mut()) {
                if f.layout.trainable {
                    fsdp_kernels::scale(&mut f.grad, coef as f32);
                }
            }
        }
        Ok(norm)
    }

    /// One optimizer step with learning rate `lr` on every trainable flat shard (spans from
    /// the plan: padding untouched, weight decay only on decayed spans), then zeroes the
    /// gradient shards. Frozen flat parameters are never touched.
    pub fn optimizer_step(&mut self, lr: f64) -> Result<()> {
        self.ledger.enter(Phase::OptimizerStep);
        let opt = self.cfg.optimizer.with_lr(lr);
        let step = self.step + 1;
        for f in self.units.iter_mut().flat_map(|u| u.flats.iter_mut()) {
            if f.layout.trainable {
                f.step(&opt, step)?;
            }
        }
        self.step = step;
        self.zero_grad();
        Ok(())
    }

    /// Sets every gradient shard to zero.
    pub fn zero_grad(&mut self) {
        for f in self.units.iter_mut().flat_map(|u| u.flats.iter_mut()) {
            fsdp_kernels::zero(&mut f.grad);
        }
    }

    /// One full training step: [`RankEngine::accumulate`], clipping (if configured),
    /// [`RankEngine::optimizer_step`]. Collective.
    pub fn train_step(&mut self, mbs: &[MicroBatch], lr: f64) -> Result<StepStats> {
        let t0 = Instant::now();
        self.comm.take_time();
        let acc = self.accumulate(mbs)?;
        let grad_norm = match self.cfg.clip {
            Some(c) => Some(self.clip_grad_norm(c)?),
            None => None,
        };
        self.optimizer_step(lr)?;
        let (comm, calls) = self.comm.take_time();
        Ok(StepStats {
            step: self.step,
            loss: acc.loss,
            tokens: acc.tokens,
            grad_norm,
            lr,
            step_seconds: t0.elapsed().as_secs_f64(),
            comm_seconds: comm.as_secs_f64(),
            comm_calls: calls,
            ledger: [
                self.ledger.peak(Phase::Forward),
                self.ledger.peak(Phase::Backward),
                self.ledger.peak(Phase::OptimizerStep),
            ],
        })
    }

    /// Forward only over `mbs` (no graph, no gradients) under the plan's forward schedule;
    /// returns the world's (loss sum, contributing tokens). Collective.
    pub fn eval(&mut self, mbs: &[MicroBatch]) -> Result<(f64, u64)> {
        let all = self.comm.all_gather_f64(&[mbs.len() as f64])?;
        check_counts(&all, "number of validation batches", "batches")?;
        let m = self.stage_units.len();
        let mut sum = 0f64;
        let mut count = 0u64;
        for mb in mbs {
            let mut x = mb.input.clone();
            for s in 0..m {
                let u = self.stage_units[s];
                self.transition_to(&self.plan.schedule.forward[s].alive, Some(u))?;
                let params = &self.units[u].plain;
                if s + 1 == m {
                    let l = self.model.loss(params, &x, mb)?;
                    sum += l.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
                } else {
                    x = self.model.forward(s, params, &x)?;
                }
            }
            count += mb.count;
        }
        self.transition_to(&[], None)?;
        let mut buf = [sum, count as f64];
        self.comm
            .all_reduce(Group::World, ReduceOp::Sum, BufMut::F64(&mut buf))?;
        Ok((buf[0], buf[1] as u64))
    }

    /// The full (unsharded) model: `[unit][non-tied param][element]` in declaration order, the
    /// same on every rank. Collective (all-gathers every flat parameter).
    pub fn full_params(&mut self) -> Result<Vec<Vec<Vec<f32>>>> {
        let spec = self.model.spec();
        let mut out = Vec::with_capacity(self.units.len());
        for (u, unit) in self.units.iter().enumerate() {
            let mut flat_full: Vec<Vec<f32>> = Vec::with_capacity(unit.flats.len());
            for fs in &unit.flats {
                let shard = fs.param_vec()?;
                let mut full = vec![0f32; fs.padded_numel()];
                self.comm
                    .all_gather(Group::Shard, Buf::F32(&shard), BufMut::F32(&mut full))?;
                flat_full.push(full);
            }
            let mut params = Vec::new();
            for (i, p) in spec.units[u].params.iter().enumerate() {
                if p.tied_to.is_some() {
                    continue;
                }
                for (f, fs) in unit.flats.iter().enumerate() {
                    if let Some(k) = fs.layout.segments.iter().position(|s| s.param_index == i) {
                        params.push(fs.layout.view(&flat_full[f], k).to_vec());
                    }
                }
            }
            out.push(params);
        }
        Ok(out)
    }

    /// This rank's gradient shards, per unit per trainable flat parameter (`s_f` elements).
    pub fn grad_shards(&self) -> Vec<Vec<Vec<f32>>> {
        self.units
            .iter()
            .map(|u| {
                u.flats
                    .iter()
                    .filter(|f| f.layout.trainable)
                    .map(|f| f.grad.clone())
                    .collect()
            })
            .collect()
    }

    /// A barrier that also exchanges one status value per rank: all-gathers `status` over the
    /// world and returns `[rank]`. The checkpoint hooks call it between save phases so that
    /// every rank (thread or process) knows whether every other rank succeeded.
    ///
    /// Errors: [`EngineError::Comm`] when a rank fails or does not arrive in time.
    pub fn barrier_with_status(&mut self, status: f64) -> Result<Vec<f64>> {
        Ok(self
            .comm
            .all_gather_f64(&[status])?
            .into_iter()
            .map(|v| v[0])
            .collect())
    }

    /// Exports this rank's state (master shards, optimizer state, step) for a checkpoint.
    pub fn export_state(&self) -> Result<RankState> {
        let names = state_names(&self.cfg.optimizer);
        let mut flats = Vec::new();
        for unit in &self.units {
            for (f, fs) in unit.flats.iter().enumerate() {
                flats.push(FlatShardState {
                    unit: unit.index,
                    flat: f,
                    trainable: fs.layout.trainable,
                    param: fs.param_vec()?,
                    optimizer_state: names
                        .iter()
                        .zip(&fs.state)
                        .map(|(n, v)| (n.to_string(), v.clone()))
                        .collect(),
                });
            }
        }
        let topo = self.comm.topology();
        Ok(RankState {
            rank: self.rank,
            world_size: topo.world_size,
            shard_size: topo.shard_size,
            shard_index: self.shard_index,
            plan_fingerprint: self.plan.fingerprint().to_string(),
            optimizer_step: self.step,
            flats,
        })
    }

    /// Imports a state exported by [`RankEngine::export_state`] (or rebuilt for this rank's
    /// layout by a resharding checkpoint reader). Nothing is changed if it does not fit.
    ///
    /// Errors: [`EngineError::State`] naming the unit, flat parameter and sizes that differ.
    pub fn import_state(&mut self, st: &RankState) -> Result<()> {
        let names = state_names(&self.cfg.optimizer);
        let total: usize = self.units.iter().map(|u| u.flats.len()).sum();
        if st.flats.len() != total {
            return Err(EngineError::State(format!(
                "{} flat parameters in the state, {} in the engine",
                st.flats.len(),
                total
            )));
        }
        let mut it = st.flats.iter();
        for unit in &self.units {
            for (f, fs) in unit.flats.iter().enumerate() {
                let s = it.next().expect("counted");
                let n = fs.shard_numel();
                let ok = s.unit == unit.index
                    && s.flat == f
                    && s.trainable == fs.layout.trainable
                    && s.param.len() == n
                    && (!fs.layout.trainable
                        || (s.optimizer_state.len() == names.len()
                            && s.optimizer_state
                                .iter()
                                .zip(names)
                                .all(|((k, v), n2)| k == n2 && v.len() == n)));
                if !ok {
                    return Err(EngineError::State(format!(
                        "unit {} ({}) flat {f}: the state has unit {} flat {} trainable {} with {} elements and {} optimizer buffers; the engine expects trainable {} with {n} elements and buffers {names:?}",
                        unit.index, unit.name, s.unit, s.flat, s.trainable, s.param.len(), s.optimizer_state.len(), fs.layout.trainable
                    )));
                }
            }
        }
        let mut it = st.flats.iter();
        for unit in self.units.iter_mut() {
            for fs in unit.flats.iter_mut() {
                let s = it.next().expect("checked");
                fs.set_param(&s.param)?;
                for (dst, (_, v)) in fs.state.iter_mut().zip(&s.optimizer_state) {
                    dst.copy_from_slice(v);
                }
            }
        }
        self.step = st.optimizer_step;
        Ok(())
    }
}

fn check_counts(all: &[Vec<f64>], what: &'static str, unit: &str) -> Result<()> {
    let first = all[0][0];
    if all.iter().all(|v| v[0] == first) {
        return Ok(());
    }
    // Name the odd ranks against the most common count.
    let mut counts: Vec<(u64, usize)> = Vec::new();
    for v in all {
        let c = v[0] as u64;
        match counts.iter_mut().find(|(x, _)| *x == c) {
            Some(e) => e.1 += 1,
            None => counts.push((c, 1)),
        }
    }
    let common = counts
        .iter()
        .max_by_key(|(_, n)| *n)
        .map(|(c, _)| *c)
        .unwrap_or(0);
    let odd: Vec<String> = all
        .iter()
        .enumerate()
        .filter(|(_, v)| v[0] as u64 != common)
        .map(|(r, v)| format!("rank {r}: {} {unit}", v[0] as u64))
        .collect();
    Err(EngineError::RankMismatch {
        what,
        detail: format!("{}, others: {common}", odd.join(", ")),
    })
}

/// Reads a 0-dim or 1-element f32 tensor (helper for tests and drivers).
pub fn scalar_f32(t: &Tensor) -> Result<f32> {
    with_f32(t, |x| x[0])
}

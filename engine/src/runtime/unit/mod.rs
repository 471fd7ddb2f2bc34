//! FSDP units on one rank: their flat-parameter shards (master fp32, gradient, optimizer state)
//! and the unit's life cycle as a state machine whose states carry their data.
//!
//! Layout comes from the plan ([`fsdp_planner::FlatParamLayout`]): a flat parameter is its
//! parameters concatenated with alignment gaps, padded to a multiple of the shard-group size,
//! cut into equal contiguous shards (Zhao et al. 2023, "PyTorch FSDP", sec. 3.2.1).
//!
//! Unsharded parameters are separate candle tensors per parameter (variables for trainable
//! ones), so autograd stops at each parameter and its gradient is copied once into the unit's
//! flat gradient; views of one flat variable would make candle's `narrow` backward build a
//! zero-padded flat-sized tensor per parameter. With a shard group of more than one rank the
//! all-gather fills the unsharded flat buffer (`P_f` elements, counted in `unsharded_params`),
//! whose parameter tensors are views of it (no copy; the buffer is freed with its last view).
//! With a shard group of one rank the
//! shard IS the unsharded parameter: the master weights are stored as those per-parameter
//! tensors, no copy is made and `unsharded_params` stays 0 (the contract of `fsdp_planner::memory`).
//!
//! Resharding a unit whose parameters a kept forward graph still refers to (full shard or
//! hybrid without activation checkpointing) frees their memory without dropping the tensors:
//! each distinct storage behind them is swapped with an empty one (vendor patch 3,
//! `Tensor::storage_mut_and_layout`), and the tensors are parked. The next unshard gathers as
//! usual and swaps the gathered storages into the parked tensors, so the graph's backward reads
//! the re-gathered values through the same tensor ids autograd returns gradients for
//! (PyTorch FSDP2's `fully_shard` resizes an unsharded parameter's storage to 0 and back).
//!
//! # States
//!
//! The unit's parameter state is one private enum whose variants hold exactly the buffers
//! that exist in that state (as PyTorch FSDP2's `FSDPParamGroup` with its sharded/unsharded
//! states); every change is a method that checks where it starts from and refuses a wrong
//! start with [`EngineError::UnitTransition`] (unit, state, transition), never a panic.
//! In every state the flat shards ([`FlatShard`]: master, gradient and optimizer shards) exist
//! and are counted in `param_shards`, `grad_shards` and `optimizer_state`; per state, what
//! else exists and which plan bytes it is:
//!
//! - [`UnitState::Sharded`]: nothing else; no plan bytes.
//! - [`UnitState::Unsharding`]: the in-flight in-place all-gathers, each owning its
//!   `P_f`-element param_dtype output with this rank's block already cast in, and the parked
//!   tensors if a kept forward graph holds them; `unsharded_params` is charged `pd·P_f` per
//!   gathered flat parameter (and per cast copy of a 16-bit unit with a shard group of one).
//! - [`UnitState::Unsharded`]: the parameter tensors, as variables and detached (views of the
//!   gathered buffers, or with a shard group of one the master tensors or their cast copies);
//!   `unsharded_params` as charged when unsharding started.
//! - [`UnitState::Resharded`]: the parked tensors (storages emptied) while a kept forward graph
//!   holds them, else nothing; no plan bytes.
//!
//! Transitions: `start_unshard` (sharded or resharded → unsharding), `finish_unshard`
//! (unsharding → unsharded), `unshard` (both), `reshard` (any → resharded; from unsharding it
//! first waits for the in-flight all-gathers; from sharded it changes nothing).
//!
//! The unsharded flat gradients are a second piece of state, independent of the parameters'
//! (they outlive a reshard under gradient sync on the last micro-batch): absent, or one
//! buffer per trainable flat parameter (`P_f` elements, counted in `unsharded_grads`), each
//! held by the unit or lent to a reduction. `alloc_flat_grads`, `gather_grads` (which needs
//! the unit unsharded and its buffers held), `take_flat_grad`/`restore_flat_grad`,
//! `clear_lent_flat_grads` and `free_flat_grads` are its transitions.

mod flat;
mod grads;
mod park;

pub(crate) use flat::F32Buf;
pub use flat::{mut_f32, with_f32, FlatShard, ShardBuf};
pub(crate) use grads::owned_bytes;

use crate::error::{EngineError, Result};
use crate::memory::{Category, MemoryLedger};
use crate::runtime::collectives::Collectives;
use crate::runtime::offload::HostStaging;
use candle_core::{Device, Tensor, Var};
use flat::{lock, seg_range, Master, Offloaded};
use fsdp_comm::{Group, OwnedBuf, PendingOp};
use fsdp_kernels::tensor::TensorKernels;
use fsdp_kernels::Span;
use fsdp_planner::{FlatParamLayout, UnitLayout, UnitSpec};
use fsdp_types::DType;
use park::{refill, release_storages};
use std::sync::{Arc, Mutex};

/// Where a rank's flat buffers live and its FSDP units compute.
#[derive(Debug, Clone, Default)]
pub enum Placement {
    /// Host memory and CPU compute: flat buffers are `Vec`s, gathered parameters are copied
    /// out of the all-gather buffer (the default, and the path every parity test pins).
    #[default]
    Host,
    /// Flat buffers (master, gradient and optimizer shards, all-gather and flat-gradient
    /// buffers) are 1-D candle tensors on this device, the units compute there, and the
    /// unsharded parameters are views of the gathered buffer (no copy). On a CUDA device the
    /// kernels are fsdp-kernels' CUDA kernels and the collectives need the NCCL backend; on
    /// the CPU device the same code runs on host tensors, with results bitwise equal to
    /// [`Placement::Host`] (tested).
    Device(Device),
}

impl Placement {
    /// The candle device units compute on.
    pub fn device(&self) -> Device {
        match self {
            Placement::Host => Device::Cpu,
            Placement::Device(d) => d.clone(),
        }
    }
}

/// The name of the state an FSDP unit is in within a step (see the module documentation for
/// what each state holds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitState {
    /// Only the local shard exists (start of a step, after the optimizer step).
    Sharded,
    /// The all-gather of the unit's flat parameters is in flight.
    Unsharding,
    /// The unsharded parameters exist.
    Unsharded,
    /// The unsharded parameters were freed after use in this step.
    Resharded,
}

impl std::fmt::Display for UnitState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            UnitState::Sharded => "sharded",
            UnitState::Unsharding => "unsharding",
            UnitState::Unsharded => "unsharded",
            UnitState::Resharded => "resharded",
        })
    }
}

/// A unit's parameter state with the data that exists in it (see the module documentation).
#[derive(Debug)]
enum Lifecycle {
    /// Only the shards.
    Sharded,
    /// All-gathers in flight.
    Unsharding {
        /// One in-place all-gather per gathered flat parameter, in flat order (none for a
        /// shard group of one); each owns the buffer it fills.
        gathers: Vec<PendingOp>,
        /// Bytes charged to the ledger's `unsharded_params` for this unit.
        charged: u64,
        /// Tensors a kept forward graph holds, storages emptied, to be refilled by
        /// [`FsdpUnit::finish_unshard`] (empty when no graph holds them).
        parked: Vec<Tensor>,
    },
    /// Parameters usable for compute.
    Unsharded {
        /// Parameter tensors in declaration order (variables for trainable ones).
        vars: Vec<Tensor>,
        /// The same parameters detached (no graph is recorded through them).
        plain: Vec<Tensor>,
        /// Bytes charged to the ledger's `unsharded_params` for this unit.
        charged: u64,
    },
    /// Parameters freed after use.
    Resharded {
        /// Parameter tensors (declaration order) whose storages were emptied while a kept
        /// forward graph holds them (empty when none does).
        parked: Vec<Tensor>,
    },
}

impl Lifecycle {
    fn name(&self) -> UnitState {
        match self {
            Lifecycle::Sharded => UnitState::Sharded,
            Lifecycle::Unsharding { .. } => UnitState::Unsharding,
            Lifecycle::Unsharded { .. } => UnitState::Unsharded,
            Lifecycle::Resharded { .. } => UnitState::Resharded,
        }
    }
}

/// Where a unit parameter (declaration order) lives.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ParamLoc {
    /// Segment `segment` of flat parameter `flat`.
    Flat { flat: usize, segment: usize },
    /// Tied to the parameter with this declaration index (same tensor).
    Tied(usize),
}

/// What a unit is built from: the plan's description of it and this rank's initial shards.
#[derive(Debug)]
pub(crate) struct UnitInit<'a> {
    /// Unit index in the model.
    pub index: usize,
    /// The model's unit (names, shapes, ties).
    pub spec: &'a UnitSpec,
    /// The plan's layout of the unit's flat parameters.
    pub layout: &'a UnitLayout,
    /// `shards[f]`: shard `shard_index` of flat parameter `f` (`s_f` elements, padding 0).
    pub shards: Vec<Vec<f32>>,
    /// This rank's shard index in the shard group.
    pub shard_index: u64,
    /// Optimizer state buffers per element (AdamW 2, SGD with momentum 1).
    pub state_buffers: usize,
    /// dtype of the unsharded parameters (the plan's param_dtype).
    pub param_dtype: DType,
    /// The device kernels under [`Placement::Device`].
    pub dev: Option<&'a Arc<TensorKernels>>,
    /// Offloaded shards (`--offload optimizer|params`; needs `dev`).
    pub offload: Option<OffloadInit<'a>>,
}

/// How an offloaded unit's shards are built ([`UnitInit::offload`]).
#[derive(Debug)]
pub(crate) struct OffloadInit<'a> {
    /// Keep a device `param_dtype` copy of each shard (`--offload optimizer`).
    pub device_shard: bool,
    /// The rank's host staging buffers.
    pub staging: Arc<Mutex<HostStaging>>,
    /// Threads of the host optimizer step.
    pub threads: usize,
    /// The rank's host ledger (master, gradient and optimizer-state shards).
    pub host: &'a mut MemoryLedger,
}

/// One FSDP unit on one rank.
#[derive(Debug)]
pub struct FsdpUnit {
    /// Unit index in the model.
    pub index: usize,
    /// Unit name.
    pub name: String,
    /// Flat parameters (trainable first, then frozen), as the plan lays them out.
    pub flats: Vec<FlatShard>,
    /// Life-cycle state with its data; changed only by the transition methods.
    lifecycle: Lifecycle,
    locs: Vec<ParamLoc>,
    shapes: Vec<Vec<usize>>,
    /// Unsharded flat gradients, per trainable flat parameter (`P_f` elements of
    /// reduce_dtype while backpropagated; f32 when accumulated across micro-batches without
    /// sync): empty when absent, `None` where a reduction has borrowed the buffer.
    flat_grads: Vec<Option<OwnedBuf>>,
    /// dtype of the unsharded parameters (the plan's param_dtype).
    param_dtype: DType,
    /// Forward graphs (kept for backward, no activation checkpointing) that hold this unit's
    /// parameter tensors: counted by the engine per kept forward use, released after the
    /// use's backward. While positive, [`FsdpUnit::reshard`] frees the parameters' memory but
    /// keeps their tensors parked, and the next unshard refills those same tensors.
    graph_uses: usize,
}

impl FsdpUnit {
    /// Builds the unit from this rank's initial shards (`init.shards`), which become the f32
    /// master shards, and records param/grad/optimizer shard bytes in the ledger.
    ///
    /// Errors: [`EngineError::Config`] for a param_dtype the engine does not compute in,
    /// initial shards that do not fit the layout, or parameters the layout does not place.
    pub(crate) fn new(init: UnitInit<'_>, ledger: &mut MemoryLedger) -> Result<Self> {
        let UnitInit {
            index,
            spec,
            layout,
            shards,
            shard_index,
            state_buffers,
            param_dtype,
            dev,
            mut offload,
        } = init;
        if offload.is_some() && dev.is_none() {
            return Err(EngineError::Config(format!(
                "unit {}: offloaded shards need a compute device",
                spec.name
            )));
        }
        if !matches!(param_dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(EngineError::Config(format!(
                "param_dtype {param_dtype}: the engine computes in f32, bf16 or f16"
            )));
        }
        let mut flats = Vec::with_capacity(layout.flat_params.len());
        let copies = layout.flat_params.first().is_some_and(|f| f.shard_size > 1);
        if shards.len() != layout.flat_params.len() {
            return Err(EngineError::Config(format!(
                "unit {}: {} initial shards for {} flat parameters",
                spec.name,
                shards.len(),
                layout.flat_params.len()
            )));
        }
        for (fl, shard) in layout.flat_params.iter().zip(shards) {
            if shard.len() as u64 != fl.shard_numel().0 {
                return Err(EngineError::Config(format!(
                    "unit {}: an initial shard of {} elements, the layout's has {}",
                    spec.name,
                    shard.len(),
                    fl.shard_numel().0
                )));
            }
            let n = shard.len();
            if let (Some(o), Some(k)) = (offload.as_mut(), dev) {
                // Offloaded: master, gradient and optimizer state on the host; the device keeps
                // a param_dtype copy of the shard under `optimizer` only.
                o.host.alloc(Category::ParamShards, 4 * n as u64);
                let (grad, state) = if fl.trainable {
                    o.host.alloc(Category::GradShards, 4 * n as u64);
                    o.host
                        .alloc(Category::OptimizerState, 4 * (n * state_buffers) as u64);
                    (
                        F32Buf::Host(vec![0.0; n]),
                        (0..state_buffers)
                            .map(|_| F32Buf::Host(vec![0.0; n]))
                            .collect(),
                    )
                } else {
                    (F32Buf::empty(), Vec::new())
                };
                let device_shard = if o.device_shard {
                    ledger.alloc(
                        Category::ParamShardsLowPrecision,
                        param_dtype.size_bytes() * n as u64,
                    );
                    let t = k.zeros(param_dtype, n)?;
                    lock(&o.staging)?.upload_cast(k, &shard, &t, 0)?;
                    Some(t)
                } else {
                    None
                };
                flats.push(FlatShard {
                    layout: fl.clone(),
                    shard_index,
                    spans: shard_spans(fl, shard_index),
                    master: Master::Flat(F32Buf::Host(shard)),
                    grad,
                    state,
                    dev: Some(k.clone()),
                    offload: Some(Offloaded {
                        device_shard,
                        staging: o.staging.clone(),
                        threads: o.threads,
                    }),
                });
                continue;
            }
            ledger.alloc(Category::ParamShards, 4 * n as u64);
            let (grad, state) = if fl.trainable {
                ledger.alloc(Category::GradShards, 4 * n as u64);
                ledger.alloc(Category::OptimizerState, 4 * (n * state_buffers) as u64);
                let state = (0..state_buffers)
                    .map(|_| F32Buf::zeros(dev, n))
                    .collect::<Result<Vec<_>>>()?;
                (F32Buf::zeros(dev, n)?, state)
            } else {
                (F32Buf::empty(), Vec::new())
            };
            let spans = shard_spans(fl, shard_index);
            let device = dev.map_or(Device::Cpu, |k| k.device().clone());
            let master = if copies {
                Master::Flat(F32Buf::from_vec(dev, shard)?)
            } else {
                let mut parts = Vec::with_capacity(fl.segments.len());
                for seg in &fl.segments {
                    let shape: Vec<usize> = seg.shape.iter().map(|&d| d as usize).collect();
                    let data = fl.view(&shard, parts.len()).to_vec();
                    let t = if fl.trainable {
                        Var::from_vec(data, shape.as_slice(), &device)?
                            .as_tensor()
                            .clone()
                    } else {
                        Tensor::from_vec(data, shape.as_slice(), &device)?
                    };
                    parts.push(t);
                }
                Master::Parts(parts)
            };
            flats.push(FlatShard {
                layout: fl.clone(),
                shard_index,
                master,
                grad,
                state,
                spans,
                dev: dev.cloned(),
                offload: None,
            });
        }
        let mut locs = Vec::with_capacity(spec.params.len());
        for p in &spec.params {
            if let Some(t) = &p.tied_to {
                let j = spec
                    .params
                    .iter()
                    .position(|q| &q.name == t)
                    .ok_or_else(|| {
                        EngineError::Config(format!("{} tied to unknown {t}", p.name))
                    })?;
                locs.push(ParamLoc::Tied(j));
                continue;
            }
            let found = layout.flat_params.iter().enumerate().find_map(|(f, fl)| {
                fl.segments
                    .iter()
                    .position(|s| s.name == p.name)
                    .map(|k| ParamLoc::Flat {
                        flat: f,
                        segment: k,
                    })
            });
            locs.push(found.ok_or_else(|| {
                EngineError::Config(format!("parameter {} is in no flat parameter", p.name))
            })?);
        }
        let shapes = spec
            .params
            .iter()
            .map(|p| p.shape.iter().map(|&d| d as usize).collect())
            .collect();
        Ok(FsdpUnit {
            index,
            name: spec.name.clone(),
            flats,
            lifecycle: Lifecycle::Sharded,
            locs,
            shapes,
            flat_grads: Vec::new(),
            param_dtype,
            graph_uses: 0,
        })
    }

    /// Whether the unit holds trainable parameters.
    pub fn trainable(&self) -> bool {
        self.flats.iter().any(|f| f.layout.trainable)
    }

    /// `sum of P_f` over all flat parameters (elements).
    pub fn padded_numel(&self) -> u64 {
        self.flats.iter().map(|f| f.layout.padded_numel.0).sum()
    }

    /// The name of the unit's current state (read only; the transitions change it).
    pub fn state(&self) -> UnitState {
        self.lifecycle.name()
    }

    /// Whether the unit is unsharded now.
    pub fn is_unsharded(&self) -> bool {
        self.state() == UnitState::Unsharded
    }

    /// Whether the unit's all-gather is in flight.
    pub fn is_unsharding(&self) -> bool {
        self.state() == UnitState::Unsharding
    }

    /// Whether the unit's parameter tensors are parked: their memory freed by a reshard while a
    /// kept forward graph refers to them (see `FsdpUnit::reshard`).
    pub fn is_parked(&self) -> bool {
        match &self.lifecycle {
            Lifecycle::Unsharding { parked, .. } | Lifecycle::Resharded { parked } => {
                !parked.is_empty()
            }
            Lifecycle::Sharded | Lifecycle::Unsharded { .. } => false,
        }
    }

    /// The refusal of `transition` in the current state, for `reason`.
    fn refuse(&self, transition: &'static str, reason: &'static str) -> EngineError {
        EngineError::UnitTransition {
            unit: self.name.clone(),
            state: self.state(),
            transition,
            reason,
        }
    }

    /// The unsharded parameter tensors in declaration order (variables for trainable ones):
    /// what a forward that records a graph for backward computes with.
    ///
    /// Errors: [`EngineError::UnitTransition`] unless the unit is unsharded.
    pub(crate) fn params(&self) -> Result<&[Tensor]> {
        match &self.lifecycle {
            Lifecycle::Unsharded { vars, .. } => Ok(vars),
            _ => Err(self.refuse("params", "the parameters exist only while unsharded")),
        }
    }

    /// The unsharded parameters detached (no graph is recorded through them).
    ///
    /// Errors: [`EngineError::UnitTransition`] unless the unit is unsharded.
    pub(crate) fn plain_params(&self) -> Result<&[Tensor]> {
        match &self.lifecycle {
            Lifecycle::Unsharded { plain, .. } => Ok(plain),
            _ => Err(self.refuse("plain_params", "the parameters exist only while unsharded")),
        }
    }

    /// Forgets every kept forward graph (the start of a micro-batch: none is alive).
    pub(crate) fn clear_graph_uses(&mut self) {
        self.graph_uses = 0;
    }

    /// Records one more kept forward graph that holds the parameter tensors.
    pub(crate) fn add_graph_use(&mut self) {
        self.graph_uses += 1;
    }

    /// Records that one kept forward graph was consumed by its backward.
    pub(crate) fn drop_graph_use(&mut self) {
        self.graph_uses = self.graph_uses.saturating_sub(1);
    }

    /// Transition sharded/resharded -> unsharded: [`FsdpUnit::start_unshard`] then
    /// [`FsdpUnit::finish_unshard`].
    ///
    /// Errors: as those two.
    pub(crate) fn unshard(
        &mut self,
        comm: &mut Collectives<'_>,
        ledger: &mut MemoryLedger,
    ) -> Result<()> {
        self.start_unshard(comm, ledger)?;
        self.finish_unshard(comm)
    }

    /// Transition sharded/resharded -> unsharding: for each flat parameter allocates the
    /// `P_f`-element param_dtype buffer (counted in `unsharded_params`), casts the fp32 master
    /// shard into this rank's block `[i s_f, (i+1) s_f)` (round to nearest even for 16-bit)
    /// and starts an in-place all-gather over the shard group, which runs on the
    /// communicator's progress thread while the caller computes (Zhao et al. 2023, "PyTorch
    /// FSDP", sec. 3.3.1 prefetching). With a shard group of one nothing is gathered: f32
    /// units use the master tensors themselves, 16-bit units get cast copies in
    /// [`FsdpUnit::finish_unshard`].
    ///
    /// On a failure part way, the unit is unsharding with what was started and charged, so a
    /// [`FsdpUnit::reshard`] waits for and frees exactly that.
    ///
    /// Errors: a collective failure; [`EngineError::UnitTransition`] for a unit already
    /// unsharding or unsharded.
    pub(crate) fn start_unshard(
        &mut self,
        comm: &mut Collectives<'_>,
        ledger: &mut MemoryLedger,
    ) -> Result<()> {
        let parked = match &mut self.lifecycle {
            Lifecycle::Sharded => Vec::new(),
            Lifecycle::Resharded { parked } => std::mem::take(parked),
            Lifecycle::Unsharding { .. } | Lifecycle::Unsharded { .. } => {
                return Err(self.refuse(
                    "start_unshard",
                    "the unit is already unsharding or unsharded",
                ))
            }
        };
        let mut gathers = Vec::with_capacity(self.flats.len());
        let mut charged = 0;
        let r = self.start_gathers(comm, ledger, &mut gathers, &mut charged);
        self.lifecycle = Lifecycle::Unsharding {
            gathers,
            charged,
            parked,
        };
        r
    }

    /// Charges and starts the all-gathers of [`FsdpUnit::start_unshard`], pushing each started
    /// one to `gathers` and adding each charge to `charged` as it happens.
    fn start_gathers(
        &self,
        comm: &mut Collectives<'_>,
        ledger: &mut MemoryLedger,
        gathers: &mut Vec<PendingOp>,
        charged: &mut u64,
    ) -> Result<()> {
        let pd = self.param_dtype;
        for fs in &self.flats {
            let p = fs.padded_numel();
            if let (Some(o), Some(k), Master::Flat(F32Buf::Host(shard))) =
                (&fs.offload, &fs.dev, &fs.master)
            {
                // Offloaded: this rank's block comes from the device's param_dtype shard
                // (`optimizer`) or from the host master through the staging buffer (`params`).
                let b = pd.size_bytes() * p as u64;
                ledger.alloc(Category::UnshardedParams, b);
                *charged += b;
                let buf = k.zeros(pd, p)?;
                let at = fs.shard_index as usize * shard.len();
                match &o.device_shard {
                    Some(ds) => k.copy_into(&buf, at, ds)?,
                    None => lock(&o.staging)?.upload_cast(k, shard, &buf, at)?,
                }
                gathers.push(comm.start_all_gather_in_place(Group::Shard, OwnedBuf::Tensor(buf))?);
                continue;
            }
            match &fs.master {
                Master::Parts(_) => {
                    if pd != DType::F32 {
                        let b = pd.size_bytes() * p as u64;
                        ledger.alloc(Category::UnshardedParams, b);
                        *charged += b;
                    }
                }
                Master::Flat(F32Buf::Dev(shard, k)) => {
                    let b = pd.size_bytes() * p as u64;
                    ledger.alloc(Category::UnshardedParams, b);
                    *charged += b;
                    let buf = k.zeros(pd, p)?;
                    let at = fs.shard_index as usize * shard.elem_count();
                    k.cast_into(&buf, at, shard)?;
                    gathers
                        .push(comm.start_all_gather_in_place(Group::Shard, OwnedBuf::Tensor(buf))?);
                }
                Master::Flat(F32Buf::Host(shard)) => {
                    let b = pd.size_bytes() * p as u64;
                    ledger.alloc(Category::UnshardedParams, b);
                    *charged += b;
                    // SAFETY: every element is written before it is read: the rank's own
                    // chunk just below, every other chunk by the in-place all-gather; when the
                    // all-gather fails the buffer is dropped unread (`finish_unshard`/`reshard`).
                    let mut buf = unsafe { OwnedBuf::uninit(pd, p) };
                    let n = shard.len();
                    let at = fs.shard_index as usize * n;
                    match &mut buf {
                        OwnedBuf::F32(v) => v[at..at + n].copy_from_slice(shard),
                        OwnedBuf::BF16(v) => {
                            fsdp_kernels::cast::cast_f32_to_bf16(shard, &mut v[at..at + n])?
                        }
                        OwnedBuf::F16(v) => {
                            fsdp_kernels::cast::cast_f32_to_f16(shard, &mut v[at..at + n])?
                        }
                        OwnedBuf::F64(_) | OwnedBuf::Tensor(_) => {
                            unreachable!("param_dtype checked at construction")
                        }
                    }
                    gathers.push(comm.start_all_gather_in_place(Group::Shard, buf)?);
                }
            }
        }
        Ok(())
    }

    /// Transition unsharding -> unsharded: waits for the unit's all-gathers (the wait is
    /// exposed communication time) and makes each gathered flat buffer (`P_f` elements of
    /// param_dtype, host or device) the storage of its parameter tensors, which are views of
    /// it (variables when trainable): no copy-out, and the buffer is freed with its last view.
    /// (PyTorch FSDP2 copies the all-gather output out into per-parameter tensors instead,
    /// `split_with_sizes_copy`; on this CPU that copy was 6.5% of a `base` full-shard step.)
    /// Parked tensors (a kept forward graph holds them) receive the gathered storages.
    ///
    /// On a failure the unit stays unsharding with its charge and no all-gather in flight, so
    /// a [`FsdpUnit::reshard`] frees the charge.
    ///
    /// Errors: the collective's failure; [`EngineError::UnitTransition`] for a unit not
    /// unsharding.
    pub(crate) fn finish_unshard(&mut self, comm: &mut Collectives<'_>) -> Result<()> {
        let Lifecycle::Unsharding { .. } = self.lifecycle else {
            return Err(self.refuse("finish_unshard", "no all-gather is in flight"));
        };
        let Lifecycle::Unsharding {
            gathers,
            charged,
            mut parked,
        } = std::mem::replace(&mut self.lifecycle, Lifecycle::Sharded)
        else {
            unreachable!("matched just above")
        };
        match self.gathered_params(comm, gathers, &mut parked) {
            Ok(vars) => {
                let plain = vars.iter().map(|t| t.detach()).collect();
                self.lifecycle = Lifecycle::Unsharded {
                    vars,
                    plain,
                    charged,
                };
                Ok(())
            }
            Err(e) => {
                self.lifecycle = Lifecycle::Unsharding {
                    gathers: Vec::new(),
                    charged,
                    parked,
                };
                Err(e)
            }
        }
    }

    /// The parameter tensors (declaration order) from the finished `gathers` and the master
    /// shards; the parked tensors, if any, are taken from `parked` and refilled.
    fn gathered_params(
        &self,
        comm: &mut Collectives<'_>,
        gathers: Vec<PendingOp>,
        parked: &mut Vec<Tensor>,
    ) -> Result<Vec<Tensor>> {
        let pd = self.param_dtype;
        let mut gathers = gathers.into_iter();
        let mut per_flat: Vec<Vec<Tensor>> = Vec::with_capacity(self.flats.len());
        for fs in &self.flats {
            match &fs.master {
                Master::Parts(parts) if pd == DType::F32 => per_flat.push(parts.clone()),
                Master::Parts(parts) => {
                    let dt = candle_dtype(pd);
                    let mut ts = Vec::with_capacity(parts.len());
                    for t in parts {
                        // A fresh cast copy: a variable view of it needs no second copy.
                        let c = t.to_dtype(dt)?;
                        ts.push(if fs.layout.trainable {
                            c.variable_view()
                        } else {
                            c
                        });
                    }
                    per_flat.push(ts);
                }
                Master::Flat(_) => {
                    let op = gathers.next().ok_or_else(|| {
                        EngineError::Config(format!("unit {}: missing all-gather", self.name))
                    })?;
                    let full = comm.wait(op)?.buf.into_tensor()?;
                    per_flat.push(views(&full, &fs.layout, fs.layout.trainable)?);
                }
            }
        }
        let mut vars: Vec<Tensor> = Vec::with_capacity(self.locs.len());
        for (i, loc) in self.locs.iter().enumerate() {
            let t = match *loc {
                ParamLoc::Flat { flat, segment } => per_flat[flat][segment].clone(),
                ParamLoc::Tied(j) => vars[j].clone(),
            };
            debug_assert_eq!(t.dims(), self.shapes[i].as_slice());
            vars.push(t);
        }
        drop(per_flat);
        if !parked.is_empty() {
            // A kept forward graph holds the parked tensors: give them the gathered values.
            let parked = std::mem::take(parked);
            refill(&parked, vars, &self.name)?;
            vars = parked;
        }
        Ok(vars)
    }

    /// Transition any state -> resharded: waits for in-flight all-gathers (unsharding), then
    /// frees the unsharded parameters and their `unsharded_params` charge. When a kept forward
    /// graph still refers to them (`graph_uses > 0`, full shard without activation
    /// checkpointing) their storages are emptied in place (the memory is freed, the tensors
    /// stay valid handles) and the tensors are parked for [`FsdpUnit::finish_unshard`] to
    /// refill before the unit's backward. With a shard group of one and f32 parameters the
    /// tensors are the master weights and are never emptied (nothing is unsharded). A sharded
    /// unit stays sharded; a resharded one drops its parked tensors once no graph holds them.
    ///
    /// Errors: the failure of an in-flight all-gather; a storage swap failure (the unit is
    /// resharded all the same).
    pub(crate) fn reshard(
        &mut self,
        comm: &mut Collectives<'_>,
        ledger: &mut MemoryLedger,
    ) -> Result<()> {
        let mut first_err = None;
        let keep_parked = self.graph_uses > 0;
        self.lifecycle = match std::mem::replace(&mut self.lifecycle, Lifecycle::Sharded) {
            Lifecycle::Sharded => Lifecycle::Sharded,
            Lifecycle::Resharded { parked } => Lifecycle::Resharded {
                parked: if keep_parked { parked } else { Vec::new() },
            },
            Lifecycle::Unsharding {
                gathers,
                charged,
                parked,
            } => {
                for op in gathers {
                    if let Err(e) = comm.wait(op) {
                        first_err.get_or_insert(e);
                    }
                }
                ledger.free(Category::UnshardedParams, charged);
                Lifecycle::Resharded {
                    parked: if keep_parked { parked } else { Vec::new() },
                }
            }
            Lifecycle::Unsharded { vars, charged, .. } => {
                ledger.free(Category::UnshardedParams, charged);
                let parked = if keep_parked && charged > 0 {
                    // Free the memory, keep the tensors the graph refers to.
                    if let Err(e) = release_storages(&vars) {
                        first_err.get_or_insert(e);
                    }
                    vars
                } else {
                    Vec::new()
                };
                Lifecycle::Resharded { parked }
            }
        };
        first_err.map_or(Ok(()), Err)
    }
}

/// The candle dtype of a planner dtype.
pub fn candle_dtype(d: DType) -> candle_core::DType {
    match d {
        DType::F32 => candle_core::DType::F32,
        DType::BF16 => candle_core::DType::BF16,
        DType::F16 => candle_core::DType::F16,
        DType::F64 => candle_core::DType::F64,
    }
}

/// The layout's parameter tensors as views of a gathered flat buffer (`P_f` elements, host
/// or device; no copy: the buffer lives as long as its last view), variables when `trainable`.
fn views(full: &Tensor, layout: &FlatParamLayout, trainable: bool) -> Result<Vec<Tensor>> {
    let mut ts = Vec::with_capacity(layout.segments.len());
    for seg in &layout.segments {
        let shape: Vec<usize> = seg.shape.iter().map(|&d| d as usize).collect();
        let r = seg_range(seg);
        let v = full
            .narrow(0, r.start, r.len())?
            .reshape(shape.as_slice())?;
        ts.push(if trainable { v.variable_view() } else { v });
    }
    Ok(ts)
}

/// The real spans of shard `shard_index` of `fl`, with their weight-decay flags.
fn shard_spans(fl: &FlatParamLayout, shard_index: u64) -> Vec<Span> {
    fl.shard_spans(shard_index)
        .into_iter()
        .map(|s| {
            Span::new(
                s.range.start as usize,
                (s.range.end - s.range.start) as usize,
                s.weight_decay,
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use fsdp_comm::{run_threads, Topology};
    use fsdp_planner::{layout_units, Architecture, ModelSpec, ParamSpec};
    use std::time::Duration;

    /// A one-unit model `blk` with a trainable `[2, 3]` weight and `[3]` bias, laid out for a
    /// shard group of one (no all-gather needs a peer).
    fn spec() -> ModelSpec {
        ModelSpec {
            name: "m".into(),
            units: vec![UnitSpec {
                name: "blk".into(),
                params: vec![ParamSpec::new("w", &[2, 3]), ParamSpec::new("b", &[3])],
            }],
            arch: Architecture::Generic,
        }
    }

    fn unit(spec: &ModelSpec, param_dtype: DType, ledger: &mut MemoryLedger) -> FsdpUnit {
        let layouts = layout_units(spec, 1, 1).unwrap();
        let shards = layouts[0]
            .flat_params
            .iter()
            .map(|f| vec![0.5f32; f.shard_numel().0 as usize])
            .collect();
        let init = UnitInit {
            index: 0,
            spec: &spec.units[0],
            layout: &layouts[0],
            shards,
            shard_index: 0,
            state_buffers: 2,
            param_dtype,
            dev: None,
            offload: None,
        };
        FsdpUnit::new(init, ledger).unwrap()
    }

    /// Runs `f` with a fresh unit, its ledger and a one-rank communicator.
    fn with_unit(
        param_dtype: DType,
        f: impl Fn(&mut FsdpUnit, &mut Collectives<'_>, &mut MemoryLedger) + Sync,
    ) {
        let spec = spec();
        let topo = Topology::new(1, 1).unwrap();
        for r in run_threads(topo, Duration::from_secs(20), |comm| {
            let mut ledger = MemoryLedger::new();
            let mut u = unit(&spec, param_dtype, &mut ledger);
            let mut c = Collectives::new(&comm);
            f(&mut u, &mut c, &mut ledger);
        }) {
            r.unwrap();
        }
    }

    /// Asserts that `r` is the refusal of `transition` in `state` for unit `blk`, by its text.
    fn refused<T: std::fmt::Debug>(r: Result<T>, transition: &str, state: &str) {
        let e = r.unwrap_err();
        assert!(
            matches!(e, EngineError::UnitTransition { .. }),
            "a transition refusal expected: {e}"
        );
        let text = e.to_string();
        assert!(
            text.starts_with(&format!(
                "unit blk: {transition} refused in state {state}: "
            )),
            "{text}"
        );
    }

    #[test]
    fn finish_unshard_is_refused_unless_unsharding() {
        with_unit(DType::F32, |u, c, l| {
            refused(u.finish_unshard(c), "finish_unshard", "sharded");
            u.unshard(c, l).unwrap();
            refused(u.finish_unshard(c), "finish_unshard", "unsharded");
            u.reshard(c, l).unwrap();
            assert_eq!(u.state(), UnitState::Resharded);
            refused(u.finish_unshard(c), "finish_unshard", "resharded");
        });
    }

    #[test]
    fn start_unshard_twice_is_refused() {
        with_unit(DType::F32, |u, c, l| {
            u.start_unshard(c, l).unwrap();
            refused(u.start_unshard(c, l), "start_unshard", "unsharding");
            u.finish_unshard(c).unwrap();
            refused(u.start_unshard(c, l), "start_unshard", "unsharded");
            assert!(u.is_unsharded(), "a refusal leaves the state as it was");
        });
    }

    /// A reshard while the all-gather is in flight waits for it and frees the charge; the
    /// next unshard starts from resharded.
    #[test]
    fn reshard_while_unsharding_frees_the_charge() {
        with_unit(DType::BF16, |u, c, l| {
            u.start_unshard(c, l).unwrap();
            assert!(u.is_unsharding());
            assert_eq!(l.live(Category::UnshardedParams).0, 2 * 9);
            u.reshard(c, l).unwrap();
            assert_eq!(u.state(), UnitState::Resharded);
            assert_eq!(l.live(Category::UnshardedParams).0, 0);
            u.unshard(c, l).unwrap();
            assert_eq!(u.params().unwrap().len(), 2);
            assert_eq!(u.params().unwrap()[0].dtype(), candle_core::DType::BF16);
        });
    }

    #[test]
    fn parameters_exist_only_while_unsharded() {
        with_unit(DType::F32, |u, c, l| {
            refused(u.params(), "params", "sharded");
            refused(u.plain_params(), "plain_params", "sharded");
            u.start_unshard(c, l).unwrap();
            refused(u.params(), "params", "unsharding");
            u.finish_unshard(c).unwrap();
            assert_eq!(u.plain_params().unwrap().len(), 2);
            u.reshard(c, l).unwrap();
            refused(u.params(), "params", "resharded");
        });
    }

    #[test]
    fn gather_grads_needs_an_unsharded_unit_with_its_buffers() {
        with_unit(DType::F32, |u, c, l| {
            let grad = || {
                vec![
                    Some(Tensor::ones((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap()),
                    Some(Tensor::ones(3, candle_core::DType::F32, &Device::Cpu).unwrap()),
                ]
            };
            u.alloc_flat_grads(DType::F32, l).unwrap();
            refused(
                u.gather_grads(&mut grad(), false),
                "gather_grads",
                "sharded",
            );
            u.unshard(c, l).unwrap();
            u.free_flat_grads(l);
            refused(
                u.gather_grads(&mut grad(), false),
                "gather_grads",
                "unsharded",
            );
            u.alloc_flat_grads(DType::F32, l).unwrap();
            let lent = u.take_flat_grad(0).unwrap();
            refused(
                u.gather_grads(&mut grad(), false),
                "gather_grads",
                "unsharded",
            );
            u.restore_flat_grad(0, lent).unwrap();
            u.gather_grads(&mut grad(), false).unwrap();
            u.reshard(c, l).unwrap();
            refused(
                u.gather_grads(&mut grad(), true),
                "gather_grads",
                "resharded",
            );
        });
    }

    #[test]
    fn gradient_buffers_are_lent_once_and_given_back_once() {
        with_unit(DType::F32, |u, _, l| {
            refused(u.take_flat_grad(0), "take_flat_grad", "sharded");
            u.alloc_flat_grads(DType::F32, l).unwrap();
            assert_eq!(l.live(Category::UnshardedGrads).0, 4 * 9);
            refused(
                u.clear_lent_flat_grads(),
                "clear_lent_flat_grads",
                "sharded",
            );
            let b = u.take_flat_grad(0).unwrap();
            refused(u.take_flat_grad(0), "take_flat_grad", "sharded");
            refused(u.flat_grad(0), "flat_grad", "sharded");
            u.restore_flat_grad(0, b).unwrap();
            let again = OwnedBuf::zeros(DType::F32, 9);
            refused(
                u.restore_flat_grad(0, again),
                "restore_flat_grad",
                "sharded",
            );
            assert_eq!(u.flat_grad(0).unwrap().len(), 9);
            let b = u.take_flat_grad(0).unwrap();
            u.clear_lent_flat_grads().unwrap();
            l.free(Category::UnshardedGrads, owned_bytes(&b));
            assert_eq!(l.live(Category::UnshardedGrads).0, 0);
        });
    }
}

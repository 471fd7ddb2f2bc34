//! FSDP units on one rank: their flat-parameter shards (master fp32, gradient, optimizer state)
//! and the named state transitions sharded -> unsharding -> unsharded -> resharded.
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
//! which is cut into the parameter tensors and dropped. With a shard group of one rank the
//! shard IS the unsharded parameter: the master weights are stored as those per-parameter
//! tensors, no copy is made and `unsharded_params` stays 0 (MEMORY-CONTRACT.md).
//!
//! Resharding a unit whose parameters a kept forward graph still refers to (full shard or
//! hybrid without activation checkpointing) frees their memory without dropping the tensors:
//! each distinct storage behind them is swapped with an empty one (vendor patch 3,
//! `Tensor::storage_mut_and_layout`), and the tensors are parked. The next unshard gathers as
//! usual and swaps the gathered storages into the parked tensors, so the graph's backward reads
//! the re-gathered values through the same tensor ids autograd returns gradients for
//! (PyTorch FSDP2's `fully_shard` resizes an unsharded parameter's storage to 0 and back).

use crate::error::{EngineError, Result};
use crate::memory::{Category, MemoryLedger};
use crate::optim::Optimizer;
use crate::runtime::collectives::Collectives;
use candle_core::{CpuStorage, Device, InplaceOp1, Layout, Storage, Tensor, Var};
use fsdp_comm::{Group, OwnedBuf, PendingOp};
use fsdp_kernels::tensor::TensorKernels;
use fsdp_kernels::Span;
use fsdp_planner::{FlatParamLayout, UnitLayout, UnitSpec};
use fsdp_types::DType;
use half::{bf16, f16};
use std::cell::RefCell;
use std::sync::Arc;

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

/// An fp32 flat buffer of a shard (master weights, gradient, optimizer state): a host `Vec`
/// or a 1-D f32 tensor on the placement's device with the kernels that update it.
#[derive(Debug)]
pub(crate) enum F32Buf {
    Host(Vec<f32>),
    Dev(Tensor, Arc<TensorKernels>),
}

impl F32Buf {
    /// `values` where `dev` is `None`, else a copy of them on the device.
    pub(crate) fn from_vec(dev: Option<&Arc<TensorKernels>>, values: Vec<f32>) -> Result<F32Buf> {
        Ok(match dev {
            None => F32Buf::Host(values),
            Some(k) => F32Buf::Dev(k.from_f32(&values, DType::F32)?, k.clone()),
        })
    }

    /// `n` zeros.
    pub(crate) fn zeros(dev: Option<&Arc<TensorKernels>>, n: usize) -> Result<F32Buf> {
        Ok(match dev {
            None => F32Buf::Host(vec![0.0; n]),
            Some(k) => F32Buf::Dev(k.zeros(DType::F32, n)?, k.clone()),
        })
    }

    /// An empty buffer (frozen flat parameters have no gradient).
    pub(crate) fn empty() -> F32Buf {
        F32Buf::Host(Vec::new())
    }

    /// Elements.
    pub(crate) fn len(&self) -> usize {
        match self {
            F32Buf::Host(v) => v.len(),
            F32Buf::Dev(t, _) => t.elem_count(),
        }
    }

    /// A host copy.
    pub(crate) fn to_vec(&self) -> Result<Vec<f32>> {
        Ok(match self {
            F32Buf::Host(v) => v.clone(),
            F32Buf::Dev(t, k) => k.to_f32(t)?,
        })
    }

    /// Overwrites the buffer with `values` (same length).
    pub(crate) fn set(&mut self, values: &[f32]) -> Result<()> {
        if values.len() != self.len() {
            return Err(EngineError::State(format!(
                "{} values for a buffer of {} elements",
                values.len(),
                self.len()
            )));
        }
        match self {
            F32Buf::Host(v) => v.copy_from_slice(values),
            F32Buf::Dev(t, k) => k.copy_into(t, 0, &k.from_f32(values, DType::F32)?)?,
        }
        Ok(())
    }

    /// Largest absolute value over `spans` (NaN if any is NaN).
    pub(crate) fn max_abs(&self, spans: &[Span]) -> Result<f32> {
        Ok(match self {
            F32Buf::Host(v) => fsdp_kernels::max_abs(v, spans)?,
            F32Buf::Dev(t, k) => k.max_abs(t, spans)?,
        })
    }

    /// Sum of squares over `spans`, accumulated in f64.
    pub(crate) fn sum_squares(&self, spans: &[Span]) -> Result<f64> {
        Ok(match self {
            F32Buf::Host(v) => fsdp_kernels::sum_squares(v, spans)?,
            F32Buf::Dev(t, k) => k.sum_squares(t, spans)?,
        })
    }

    /// Multiplies every element by `a`.
    pub(crate) fn scale(&mut self, a: f32) -> Result<()> {
        match self {
            F32Buf::Host(v) => fsdp_kernels::scale(v, a),
            F32Buf::Dev(t, k) => k.scale(t, a)?,
        }
        Ok(())
    }

    /// Divides every element by `d`.
    pub(crate) fn div_scalar(&mut self, d: f32) -> Result<()> {
        match self {
            F32Buf::Host(v) => fsdp_kernels::div_scalar(v, d),
            F32Buf::Dev(t, k) => k.div_scalar(t, d)?,
        }
        Ok(())
    }

    /// Sets every element to zero.
    pub(crate) fn zero(&mut self) -> Result<()> {
        match self {
            F32Buf::Host(v) => fsdp_kernels::zero(v),
            F32Buf::Dev(t, k) => k.zero(t)?,
        }
        Ok(())
    }

    /// Adds a reduced gradient shard (`len()` elements of any dtype) into this fp32 buffer;
    /// 16-bit values widen exactly.
    pub(crate) fn accumulate(&mut self, src: &OwnedBuf) -> Result<()> {
        if self.len() != src.len() {
            return Err(EngineError::Config(format!(
                "reduced gradient of {} elements for a shard of {}",
                src.len(),
                self.len()
            )));
        }
        match (self, src) {
            (F32Buf::Host(grad), OwnedBuf::F32(v)) => fsdp_kernels::accumulate(grad, v)?,
            (F32Buf::Host(grad), OwnedBuf::BF16(v)) => {
                grad.iter_mut().zip(v).for_each(|(g, x)| *g += x.to_f32())
            }
            (F32Buf::Host(grad), OwnedBuf::F16(v)) => {
                grad.iter_mut().zip(v).for_each(|(g, x)| *g += x.to_f32())
            }
            (F32Buf::Host(grad), OwnedBuf::F64(v)) => {
                grad.iter_mut().zip(v).for_each(|(g, x)| *g += *x as f32)
            }
            (F32Buf::Dev(t, k), OwnedBuf::Tensor(x)) => k.accumulate(t, x)?,
            (F32Buf::Host(_), _) | (F32Buf::Dev(..), _) => {
                return Err(EngineError::Config(
                    "a reduced gradient and its shard live on different devices".into(),
                ))
            }
        }
        Ok(())
    }
}

/// Where an FSDP unit is in its life cycle within a step.
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

/// Storage of a master fp32 shard.
#[derive(Debug)]
enum Master {
    /// Shard group > 1: the shard as one flat buffer of `s_f` elements.
    Flat(F32Buf),
    /// Shard group of one: one tensor per segment (variables when trainable); padding and
    /// alignment gaps are implicit zeros.
    Parts(Vec<Tensor>),
}

/// One flat parameter of a unit on this rank.
#[derive(Debug)]
pub struct FlatShard {
    /// The plan's layout of this flat parameter.
    pub layout: FlatParamLayout,
    /// This rank's shard index in the shard group.
    pub shard_index: u64,
    master: Master,
    /// The fp32 accumulated gradient shard (`s_f` elements); empty for frozen flat params.
    pub(crate) grad: F32Buf,
    /// Optimizer state buffers (`s_f` elements each): AdamW `[exp_avg, exp_avg_sq]`, SGD
    /// `[momentum]` or none; empty for frozen flat params.
    pub(crate) state: Vec<F32Buf>,
    /// The real spans of this shard with their weight-decay flags (padding excluded).
    pub spans: Vec<Span>,
    /// The device kernels when the shard lives on a compute device ([`Placement::Device`]).
    pub(crate) dev: Option<Arc<TensorKernels>>,
}

impl FlatShard {
    /// Shard length `s_f` (elements).
    pub fn shard_numel(&self) -> usize {
        self.layout.shard_numel().0 as usize
    }

    /// Padded length `P_f` (elements).
    pub fn padded_numel(&self) -> usize {
        self.layout.padded_numel.0 as usize
    }

    /// A copy of the master shard (`s_f` elements, padding zero).
    pub fn param_vec(&self) -> Result<Vec<f32>> {
        match &self.master {
            Master::Flat(v) => v.to_vec(),
            Master::Parts(parts) => {
                let mut out = vec![0f32; self.shard_numel()];
                for (seg, t) in self.layout.segments.iter().zip(parts) {
                    let r = seg_range(seg);
                    match &self.dev {
                        None => with_f32(t, |x| out[r].copy_from_slice(x))?,
                        Some(k) => out[r].copy_from_slice(&k.to_f32(t)?),
                    }
                }
                Ok(out)
            }
        }
    }

    /// A host copy of the fp32 gradient shard (`s_f` elements; empty for frozen ones).
    pub fn grad_vec(&self) -> Result<Vec<f32>> {
        self.grad.to_vec()
    }

    /// Host copies of the optimizer state buffers (`s_f` elements each).
    pub fn state_vecs(&self) -> Result<Vec<Vec<f32>>> {
        self.state.iter().map(F32Buf::to_vec).collect()
    }

    /// Overwrites optimizer state buffer `i` with `values` (`s_f` elements).
    ///
    /// Errors: [`EngineError::State`] on a bad index or length.
    pub fn set_state(&mut self, i: usize, values: &[f32]) -> Result<()> {
        let n = self.state.len();
        self.state
            .get_mut(i)
            .ok_or_else(|| EngineError::State(format!("optimizer state {i} of {n}")))?
            .set(values)
    }

    /// Overwrites the master shard with `values` (`s_f` elements; padding must be zero).
    ///
    /// Errors: [`EngineError::State`] on a length mismatch.
    pub fn set_param(&mut self, values: &[f32]) -> Result<()> {
        if values.len() != self.shard_numel() {
            return Err(EngineError::State(format!(
                "unit {} flat param: {} elements given, shard has {}",
                self.layout.unit,
                values.len(),
                self.shard_numel()
            )));
        }
        match &mut self.master {
            Master::Flat(v) => v.set(values)?,
            Master::Parts(parts) => {
                for (seg, t) in self.layout.segments.iter().zip(parts.iter()) {
                    let r = seg_range(seg);
                    match &self.dev {
                        None => mut_f32(t, |x| x.copy_from_slice(&values[r]))?,
                        Some(k) => k.copy_into(t, 0, &k.from_f32(&values[r], DType::F32)?)?,
                    }
                }
            }
        }
        Ok(())
    }

    /// One optimizer step on this shard (trainable only) with the plan's spans: padding is
    /// never read or written, weight decay only where the span says so.
    pub(crate) fn step(&mut self, opt: &Optimizer, step: u64) -> Result<()> {
        let FlatShard {
            master,
            grad,
            state,
            spans,
            layout,
            ..
        } = self;
        if let (Master::Flat(F32Buf::Dev(p, k)), F32Buf::Dev(g, _)) = (&*master, &*grad) {
            let st = dev_tensors(state)?;
            return opt.step_tensors(k, p, g, &st, spans, step);
        }
        if let (Master::Parts(parts), F32Buf::Dev(g, k)) = (&*master, &*grad) {
            let st = dev_tensors(state)?;
            for (seg, t) in layout.segments.iter().zip(parts.iter()) {
                let r = seg_range(seg);
                let sp = [Span::new(0, r.len(), seg.weight_decay)];
                let gs = g.narrow(0, r.start, r.len())?;
                let ss: Vec<Tensor> = st
                    .iter()
                    .map(|s| s.narrow(0, r.start, r.len()))
                    .collect::<candle_core::Result<_>>()?;
                opt.step_tensors(k, t, &gs, &ss, &sp, step)?;
            }
            return Ok(());
        }
        let (F32Buf::Host(grad), Ok(mut state)) = (&*grad, host_slices(state)) else {
            return Err(EngineError::Config(
                "a shard's master, gradient and optimizer state live on different devices".into(),
            ));
        };
        match master {
            Master::Flat(F32Buf::Host(p)) => opt.step_shard(p, grad, &mut state, spans, step),
            Master::Flat(F32Buf::Dev(..)) => Err(EngineError::Config(
                "a shard's master and gradient live on different devices".into(),
            )),
            Master::Parts(parts) => {
                let mut err = None;
                for (seg, t) in layout.segments.iter().zip(parts.iter()) {
                    let r = seg_range(seg);
                    let sp = [Span::new(0, r.len(), seg.weight_decay)];
                    let mut st: Vec<&mut [f32]> =
                        state.iter_mut().map(|s| &mut s[r.clone()]).collect();
                    let g = &grad[r.clone()];
                    mut_f32(t, |x| {
                        if let Err(e) = opt.step_shard(x, g, &mut st, &sp, step) {
                            err = Some(e);
                        }
                    })?;
                    if let Some(e) = err.take() {
                        return Err(e);
                    }
                }
                Ok(())
            }
        }
    }
}

/// The device tensors of state buffers (all must be on the device).
fn dev_tensors(state: &[F32Buf]) -> Result<Vec<Tensor>> {
    state
        .iter()
        .map(|s| match s {
            F32Buf::Dev(t, _) => Ok(t.clone()),
            F32Buf::Host(_) => Err(EngineError::Config(
                "optimizer state on the host for a shard on a device".into(),
            )),
        })
        .collect()
}

/// The host slices of state buffers (all must be on the host).
fn host_slices(state: &mut [F32Buf]) -> std::result::Result<Vec<&mut [f32]>, ()> {
    state
        .iter_mut()
        .map(|s| match s {
            F32Buf::Host(v) => Ok(v.as_mut_slice()),
            F32Buf::Dev(..) => Err(()),
        })
        .collect()
}

fn seg_range(seg: &fsdp_planner::Segment) -> std::ops::Range<usize> {
    let r = seg.range();
    r.start as usize..r.end as usize
}

type MutFn<'a> = Box<dyn FnOnce(&mut [f32]) + 'a>;

/// A candle in-place op handing a closure the f32 elements of a contiguous CPU tensor.
struct MutSlice<'a>(RefCell<Option<MutFn<'a>>>);

impl InplaceOp1 for MutSlice<'_> {
    fn name(&self) -> &'static str {
        "fsdp-mut-slice"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("master tensor is not contiguous".into()))?;
        let CpuStorage::F32(v) = storage else {
            candle_core::bail!("master tensor is not f32");
        };
        if let Some(f) = self.0.borrow_mut().take() {
            f(&mut v[start..end]);
        }
        Ok(())
    }
}

/// Runs `f` on the f32 elements of the contiguous CPU tensor `t`, mutably, through a candle
/// in-place op (other handles of the same storage see the change).
///
/// Errors: a non-contiguous, non-f32 or non-CPU tensor.
pub fn mut_f32<'a>(t: &Tensor, f: impl FnOnce(&mut [f32]) + 'a) -> Result<()> {
    let op = MutSlice(RefCell::new(Some(Box::new(f))));
    t.inplace_op1(&op)?;
    Ok(())
}

/// Runs `f` on the f32 elements of `t` (made contiguous first if needed; CPU only).
///
/// Errors: a non-f32 or non-CPU tensor.
pub fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let owned;
    let t = if t.is_contiguous() {
        t
    } else {
        owned = t.contiguous()?;
        &owned
    };
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(EngineError::Config(
            "the engine's flat buffers live on the CPU in this build".into(),
        ));
    };
    let all = cpu.as_slice::<f32>()?;
    let start = layout.start_offset();
    Ok(f(&all[start..start + t.elem_count()]))
}

/// Where a unit parameter (declaration order) lives.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ParamLoc {
    /// Segment `segment` of flat parameter `flat`.
    Flat { flat: usize, segment: usize },
    /// Tied to the parameter with this declaration index (same tensor).
    Tied(usize),
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
    /// Life-cycle state.
    pub state: UnitState,
    pub(crate) locs: Vec<ParamLoc>,
    shapes: Vec<Vec<usize>>,
    /// Parameter tensors in declaration order (variables for trainable ones; while unsharded).
    pub(crate) vars: Vec<Tensor>,
    /// The same parameters detached (no graph is recorded through them).
    pub(crate) plain: Vec<Tensor>,
    /// Unsharded flat gradients, per trainable flat parameter (`P_f` elements of
    /// reduce_dtype while backpropagated; f32 when accumulated across micro-batches without
    /// sync). Empty while a reduction owns them.
    pub(crate) flat_grads: Vec<OwnedBuf>,
    /// dtype of the unsharded parameters (the plan's param_dtype).
    param_dtype: DType,
    /// In-flight all-gathers (state `Unsharding`), one per flat parameter, in order.
    gathers: Vec<PendingOp>,
    /// Ledger bytes of `unsharded_params` this unit holds while unsharding/unsharded.
    unsharded_bytes: u64,
    /// Forward graphs (kept for backward, no activation checkpointing) that hold this unit's
    /// parameter tensors (`vars`): set by the engine per kept forward use, cleared after the
    /// use's backward. While positive, [`FsdpUnit::reshard`] frees the parameters' memory but
    /// keeps their tensors in `parked`, and the next unshard refills those same tensors.
    pub(crate) graph_uses: usize,
    /// Parameter tensors (declaration order, as `vars`) whose storages were emptied by a
    /// reshard while a kept forward graph holds them; the next [`FsdpUnit::finish_unshard`]
    /// moves the freshly gathered storages into them (as PyTorch FSDP2 resizes an unsharded
    /// parameter's storage to 0 and back).
    parked: Vec<Tensor>,
}

impl FsdpUnit {
    /// Builds the unit from this rank's initial shards `shards[f]` (shard `shard_index` of
    /// flat parameter `f`, `shard_numel` elements, padding 0), which become the f32 master
    /// shards, and records
    /// param/grad/optimizer shard bytes in the ledger.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        index: usize,
        spec: &UnitSpec,
        layout: &UnitLayout,
        shards: Vec<Vec<f32>>,
        shard_index: u64,
        state_buffers: usize,
        param_dtype: DType,
        dev: Option<&Arc<TensorKernels>>,
        ledger: &mut MemoryLedger,
    ) -> Result<Self> {
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
            let spans = fl
                .shard_spans(shard_index)
                .into_iter()
                .map(|s| {
                    Span::new(
                        s.range.start as usize,
                        (s.range.end - s.range.start) as usize,
                        s.weight_decay,
                    )
                })
                .collect();
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
            state: UnitState::Sharded,
            locs,
            shapes,
            vars: Vec::new(),
            plain: Vec::new(),
            flat_grads: Vec::new(),
            param_dtype,
            gathers: Vec::new(),
            unsharded_bytes: 0,
            graph_uses: 0,
            parked: Vec::new(),
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

    /// Whether the unit is unsharded now.
    pub fn is_unsharded(&self) -> bool {
        self.state == UnitState::Unsharded
    }

    /// Whether the unit's all-gather is in flight.
    pub fn is_unsharding(&self) -> bool {
        self.state == UnitState::Unsharding
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
    /// Errors: a collective failure; a unit already unsharding or unsharded (engine bug).
    pub(crate) fn start_unshard(
        &mut self,
        comm: &mut Collectives<'_>,
        ledger: &mut MemoryLedger,
    ) -> Result<()> {
        if matches!(self.state, UnitState::Unsharded | UnitState::Unsharding) {
            return Err(EngineError::Config(format!(
                "unit {} unsharded twice (state {:?})",
                self.name, self.state
            )));
        }
        self.state = UnitState::Unsharding;
        let pd = self.param_dtype;
        for fs in &self.flats {
            let p = fs.padded_numel();
            match &fs.master {
                Master::Parts(_) => {
                    if pd != DType::F32 {
                        let b = pd.size_bytes() * p as u64;
                        ledger.alloc(Category::UnshardedParams, b);
                        self.unsharded_bytes += b;
                    }
                }
                Master::Flat(F32Buf::Dev(shard, k)) => {
                    let b = pd.size_bytes() * p as u64;
                    ledger.alloc(Category::UnshardedParams, b);
                    self.unsharded_bytes += b;
                    let buf = k.zeros(pd, p)?;
                    let at = fs.shard_index as usize * shard.elem_count();
                    k.cast_into(&buf, at, shard)?;
                    self.gathers
                        .push(comm.start_all_gather_in_place(Group::Shard, OwnedBuf::Tensor(buf))?);
                }
                Master::Flat(F32Buf::Host(shard)) => {
                    let b = pd.size_bytes() * p as u64;
                    ledger.alloc(Category::UnshardedParams, b);
                    self.unsharded_bytes += b;
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
                    self.gathers
                        .push(comm.start_all_gather_in_place(Group::Shard, buf)?);
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
    ///
    /// Errors: the collective's failure; a unit not unsharding (engine bug).
    pub(crate) fn finish_unshard(&mut self, comm: &mut Collectives<'_>) -> Result<()> {
        if self.state != UnitState::Unsharding {
            return Err(EngineError::Config(format!(
                "unit {}: finish_unshard in state {:?}",
                self.name, self.state
            )));
        }
        let pd = self.param_dtype;
        let mut gathers = std::mem::take(&mut self.gathers).into_iter();
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
        if !self.parked.is_empty() {
            // A kept forward graph holds the parked tensors: give them the gathered values.
            let parked = std::mem::take(&mut self.parked);
            refill(&parked, vars, &self.name)?;
            vars = parked;
        }
        self.plain = vars.iter().map(|t| t.detach()).collect();
        self.vars = vars;
        self.state = UnitState::Unsharded;
        Ok(())
    }

    /// Transition unsharding/unsharded -> resharded: waits for an in-flight all-gather, then
    /// frees the unsharded parameters. When a kept forward graph still refers to them
    /// (`graph_uses > 0`, full shard without activation checkpointing) their storages are
    /// emptied in place (the memory is freed, the tensors stay valid handles) and the tensors
    /// are parked for [`FsdpUnit::finish_unshard`] to refill before the unit's backward.
    /// With a shard group of one and f32 parameters the tensors are the master weights and are
    /// never emptied (nothing is unsharded).
    ///
    /// Errors: the failure of an in-flight all-gather; a storage swap failure.
    pub(crate) fn reshard(
        &mut self,
        comm: &mut Collectives<'_>,
        ledger: &mut MemoryLedger,
    ) -> Result<()> {
        let mut first_err = None;
        for op in self.gathers.drain(..) {
            if let Err(e) = comm.wait(op) {
                first_err.get_or_insert(e);
            }
        }
        if matches!(self.state, UnitState::Unsharded | UnitState::Unsharding) {
            let owned = self.unsharded_bytes > 0;
            ledger.free(Category::UnshardedParams, self.unsharded_bytes);
            self.unsharded_bytes = 0;
            self.plain.clear();
            if self.graph_uses > 0 && owned && self.state == UnitState::Unsharded {
                // Free the memory, keep the tensors the graph refers to.
                if let Err(e) = release_storages(&self.vars) {
                    first_err.get_or_insert(e);
                }
                self.parked = std::mem::take(&mut self.vars);
            } else {
                self.vars.clear();
            }
            self.state = UnitState::Resharded;
        }
        if self.graph_uses == 0 {
            self.parked.clear();
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Whether the unit's parameter tensors are parked: their memory freed by a reshard while a
    /// kept forward graph refers to them (see `FsdpUnit::reshard`).
    pub fn is_parked(&self) -> bool {
        !self.parked.is_empty()
    }

    /// Allocates zeroed unsharded gradient buffers of `dtype` (`P_f` elements per trainable
    /// flat parameter, counted in `unsharded_grads`); a no-op if they exist.
    ///
    /// Errors: a device allocation failure.
    pub(crate) fn alloc_flat_grads(
        &mut self,
        dtype: DType,
        ledger: &mut MemoryLedger,
    ) -> Result<()> {
        if !self.flat_grads.is_empty() {
            return Ok(());
        }
        for fs in self.flats.iter().filter(|f| f.layout.trainable) {
            let p = fs.padded_numel();
            ledger.alloc(Category::UnshardedGrads, dtype.size_bytes() * p as u64);
            self.flat_grads.push(match &fs.dev {
                None => OwnedBuf::zeros(dtype, p),
                Some(k) => OwnedBuf::Tensor(k.zeros(dtype, p)?),
            });
        }
        Ok(())
    }

    /// Frees the unsharded gradient buffers.
    pub(crate) fn free_flat_grads(&mut self, ledger: &mut MemoryLedger) {
        for g in self.flat_grads.drain(..) {
            ledger.free(Category::UnshardedGrads, owned_bytes(&g));
        }
    }

    /// Copies (`add == false`) or adds the gradients of this unit's trainable parameters
    /// (`grads[i]` for declaration index `i`, taken and freed one by one) into the unsharded flat
    /// gradients. Parameters without a gradient contribute 0.
    pub(crate) fn gather_grads(&mut self, grads: &mut [Option<Tensor>], add: bool) -> Result<()> {
        let mut t_index = 0;
        for fs in self.flats.iter() {
            if !fs.layout.trainable {
                continue;
            }
            let buf = &mut self.flat_grads[t_index];
            t_index += 1;
            for seg in &fs.layout.segments {
                let Some(g) = grads[seg.param_index].take() else {
                    continue;
                };
                let r = seg_range(seg);
                if let OwnedBuf::Tensor(b) = buf {
                    let k = fs.dev.as_ref().ok_or_else(|| {
                        EngineError::Config("a device gradient buffer without kernels".into())
                    })?;
                    add_grad_into(k, b, r, &g, add)?;
                    continue;
                }
                let g = if g.dtype() == candle_core::DType::F32 {
                    g
                } else {
                    g.to_dtype(candle_core::DType::F32)?
                };
                with_f32(&g, |src| match buf {
                    OwnedBuf::F32(b) => {
                        let dst = &mut b[r];
                        if add {
                            for (d, s) in dst.iter_mut().zip(src) {
                                *d += *s;
                            }
                        } else {
                            dst.copy_from_slice(src);
                        }
                    }
                    OwnedBuf::BF16(b) => {
                        for (d, s) in b[r].iter_mut().zip(src) {
                            *d = bf16::from_f32(if add { d.to_f32() + *s } else { *s });
                        }
                    }
                    OwnedBuf::F16(b) => {
                        for (d, s) in b[r].iter_mut().zip(src) {
                            *d = f16::from_f32(if add { d.to_f32() + *s } else { *s });
                        }
                    }
                    OwnedBuf::F64(b) => {
                        for (d, s) in b[r].iter_mut().zip(src) {
                            *d = if add { *d + *s as f64 } else { *s as f64 };
                        }
                    }
                    OwnedBuf::Tensor(_) => unreachable!("device buffers handled above"),
                })?;
            }
        }
        Ok(())
    }
}

/// Copies (`add == false`) or adds the parameter gradient `g` (any shape and float dtype) into
/// elements `r` of the device flat gradient `buf`, with the host path's arithmetic: a copy
/// rounds once to `buf`'s dtype; an add widens both to f32 (f64 for an f64 buffer), adds and
/// rounds once.
fn add_grad_into(
    k: &TensorKernels,
    buf: &Tensor,
    r: std::ops::Range<usize>,
    g: &Tensor,
    add: bool,
) -> Result<()> {
    let bd = buf.dtype();
    let g = g.flatten_all()?;
    if !add {
        let g = if g.dtype() == bd {
            g.contiguous()?
        } else {
            g.to_dtype(candle_core::DType::F32)?.to_dtype(bd)?
        };
        k.copy_into(buf, r.start, &g)?;
        return Ok(());
    }
    let dst = buf.narrow(0, r.start, r.len())?;
    if bd == candle_core::DType::F32 {
        k.accumulate(&dst, &g.contiguous()?)?;
        return Ok(());
    }
    let wide = if bd == candle_core::DType::F64 {
        candle_core::DType::F64
    } else {
        candle_core::DType::F32
    };
    let sum = (dst.to_dtype(wide)? + g.to_dtype(candle_core::DType::F32)?.to_dtype(wide)?)?;
    k.copy_into(buf, r.start, &sum.to_dtype(bd)?)?;
    Ok(())
}

/// Address of the storage behind `t` (tensors sharing a storage have the same key).
fn storage_key(t: &Tensor) -> usize {
    let (g, _) = t.storage_and_layout();
    std::ptr::from_ref::<Storage>(&g).addr()
}

/// Swaps the contents of the storages behind `a` and `b` (vendor patch 3's write access):
/// every tensor sharing `a`'s storage then sees `b`'s elements and the reverse. The caller
/// keeps layouts compatible.
fn swap_storages(a: &Tensor, b: &Tensor) {
    let (mut ga, _) = a.storage_mut_and_layout();
    let (mut gb, _) = b.storage_mut_and_layout();
    std::mem::swap(&mut *ga, &mut *gb);
}

/// An empty storage's tensor of `t`'s dtype on its device: zero elements on the CPU, one
/// element elsewhere (a zero-byte device allocation is not portable).
fn empty_like(t: &Tensor) -> Result<Tensor> {
    let n = if t.device().is_cpu() { 0 } else { 1 };
    Ok(Tensor::zeros(n, t.dtype(), t.device())?)
}

/// Frees the memory of the distinct storages behind `ts` by swapping in empty ones; the
/// tensors stay valid handles (a kept autograd graph refers to them) but must not be read until
/// [`refill`] gives them values again.
fn release_storages(ts: &[Tensor]) -> Result<()> {
    let mut seen: Vec<usize> = Vec::with_capacity(ts.len());
    for t in ts {
        let key = storage_key(t);
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        let e = empty_like(t)?;
        swap_storages(t, &e);
        // `e` now owns the unsharded elements and frees them here.
    }
    Ok(())
}

/// Moves the storages behind `fresh` (freshly gathered parameters, declaration order) into the
/// parked tensors `parked` (same parameters, emptied by [`release_storages`]), one swap per
/// distinct parked storage, so a kept forward graph computes its backward on the gathered
/// values. `fresh` is dropped with the empty storages.
///
/// Errors: [`EngineError::Config`] when the two do not describe the same parameters (count,
/// shape, dtype, layout, or storage sharing differ; an engine bug).
fn refill(parked: &[Tensor], fresh: Vec<Tensor>, unit: &str) -> Result<()> {
    if parked.len() != fresh.len() {
        return Err(EngineError::Config(format!(
            "unit {unit}: {} parked parameters, {} gathered",
            parked.len(),
            fresh.len()
        )));
    }
    let mut seen: Vec<(usize, usize)> = Vec::with_capacity(parked.len());
    for (i, (p, f)) in parked.iter().zip(&fresh).enumerate() {
        if p.dtype() != f.dtype() || p.layout() != f.layout() {
            return Err(EngineError::Config(format!(
                "unit {unit} parameter {i}: parked {:?} {:?}, gathered {:?} {:?}",
                p.dtype(),
                p.layout(),
                f.dtype(),
                f.layout()
            )));
        }
        let (kp, kf) = (storage_key(p), storage_key(f));
        match seen.iter().find(|(a, _)| *a == kp) {
            Some(&(_, b)) if b == kf => continue,
            Some(_) => {
                return Err(EngineError::Config(format!(
                    "unit {unit} parameter {i}: parked and gathered parameters share storages differently"
                )))
            }
            None => {}
        }
        if seen.iter().any(|&(_, b)| b == kf) {
            return Err(EngineError::Config(format!(
                "unit {unit} parameter {i}: parked and gathered parameters share storages differently"
            )));
        }
        seen.push((kp, kf));
        swap_storages(p, f);
    }
    Ok(())
}

/// Bytes of an owned buffer (elements x element size).
pub(crate) fn owned_bytes(b: &OwnedBuf) -> u64 {
    b.dtype().size_bytes() * b.len() as u64
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

#[cfg(test)]
mod tests {
    use super::*;

    fn host_len(t: &Tensor) -> usize {
        let (g, _) = t.storage_and_layout();
        match &*g {
            Storage::Cpu(CpuStorage::F32(v)) => v.len(),
            _ => panic!("f32 CPU storage expected"),
        }
    }

    /// `y = sum((x @ w) * b)`: a graph that holds `w` and `b` (views of them) for backward.
    fn graph(w: &Tensor, b: &Tensor) -> (Tensor, Tensor) {
        let x = Var::from_slice(&[1f32, -2.0, 0.5, 3.0, 0.25, -1.0], (3, 2), &Device::Cpu)
            .unwrap()
            .as_tensor()
            .clone();
        let y = x
            .matmul(&w.t().unwrap())
            .unwrap()
            .broadcast_mul(b)
            .unwrap()
            .sum_all()
            .unwrap();
        (x, y)
    }

    /// Parked parameters: the storages are emptied while the graph keeps the tensors, refilled
    /// from fresh tensors, and backward gives bitwise the gradients of an untouched graph. Host
    /// layout (one storage per parameter) and device layout (views of one flat storage, shared
    /// by two parameters and a tied alias).
    #[test]
    fn release_and_refill_keep_the_graph_valid() {
        let wv: Vec<f32> = (0..4).map(|i| i as f32 * 0.5 - 1.0).collect();
        let bv = [2f32, -3.0];
        for shared in [false, true] {
            let make = || -> Vec<Tensor> {
                if shared {
                    let flat: Vec<f32> = wv.iter().chain(&bv).copied().collect();
                    let full = Tensor::from_vec(flat, 6, &Device::Cpu).unwrap();
                    let w = full.narrow(0, 0, 4).unwrap().reshape((2, 2)).unwrap();
                    let b = full.narrow(0, 4, 2).unwrap();
                    let w = w.variable_view();
                    vec![w.clone(), b.variable_view(), w]
                } else {
                    let w = Var::from_slice(&wv, (2, 2), &Device::Cpu).unwrap();
                    let b = Var::from_slice(&bv, 2, &Device::Cpu).unwrap();
                    let w = w.as_tensor().clone();
                    vec![w.clone(), b.as_tensor().clone(), w]
                }
            };
            let reference = make();
            let (xr, yr) = graph(&reference[0], &reference[1]);
            let gr = yr.backward().unwrap();

            let params = make();
            let (x, y) = graph(&params[0], &params[1]);
            release_storages(&params).unwrap();
            for p in &params {
                assert_eq!(host_len(p), 0, "shared {shared}: storage emptied");
            }
            refill(&params, make(), "test").unwrap();
            assert_eq!(host_len(&params[0]), if shared { 6 } else { 4 });
            let g = y.backward().unwrap();
            for (a, b) in [
                (&x, &xr),
                (&params[0], &reference[0]),
                (&params[1], &reference[1]),
            ] {
                let ga = g
                    .get(a)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let gb = gr
                    .get(b)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                assert_eq!(
                    ga.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    gb.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "shared {shared}"
                );
            }
        }
    }

    /// Refilling from tensors of another layout or sharing is an error, not a silent swap.
    #[test]
    fn refill_refuses_mismatched_parameters() {
        let a = Tensor::zeros((2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::zeros(4, candle_core::DType::F32, &Device::Cpu).unwrap();
        let e = refill(std::slice::from_ref(&a), vec![b], "u").unwrap_err();
        assert!(e.to_string().contains("unit u parameter 0"), "{e}");
        let e = refill(std::slice::from_ref(&a), vec![], "u").unwrap_err();
        assert!(
            e.to_string().contains("1 parked parameters, 0 gathered"),
            "{e}"
        );
        // Two parked parameters with separate storages cannot take one shared storage.
        let c = Tensor::zeros((2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let f = Tensor::zeros((2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let e = refill(&[a, c], vec![f.clone(), f], "u").unwrap_err();
        assert!(e.to_string().contains("share storages differently"), "{e}");
    }
}

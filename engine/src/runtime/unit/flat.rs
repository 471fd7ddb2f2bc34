//! The flat buffers of a unit's shards: [`F32Buf`] (an fp32 buffer on the host or a device),
//! [`FlatShard`] (one flat parameter's master, gradient and optimizer-state shards, and the
//! optimizer step on them) and the host-tensor access helpers [`mut_f32`] and [`with_f32`].
//! These exist in every state of a unit (`param_shards`, `grad_shards`, `optimizer_state`).

use crate::error::{EngineError, Result};
use crate::optim::Optimizer;
use crate::runtime::offload::HostStaging;
use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor};
use fsdp_comm::OwnedBuf;
use fsdp_kernels::tensor::TensorKernels;
use fsdp_kernels::Span;
use fsdp_planner::FlatParamLayout;
use fsdp_types::DType;
use std::cell::RefCell;
use std::sync::{Arc, Mutex, MutexGuard};

/// Locks the rank's host staging buffers (one rank's threads share them).
pub(crate) fn lock(s: &Mutex<HostStaging>) -> Result<MutexGuard<'_, HostStaging>> {
    s.lock()
        .map_err(|_| EngineError::Config("offload: a thread panicked while copying".into()))
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

/// Storage of a master fp32 shard.
#[derive(Debug)]
pub(super) enum Master {
    /// Shard group > 1: the shard as one flat buffer of `s_f` elements.
    Flat(F32Buf),
    /// Shard group of one: one tensor per segment (variables when trainable); padding and
    /// alignment gaps are implicit zeros.
    Parts(Vec<Tensor>),
}

/// What an offloaded shard keeps beside its host buffers (see [`crate::runtime::offload`]).
#[derive(Debug)]
pub(crate) struct Offloaded {
    /// Under `--offload optimizer`: the device's `param_dtype` copy of the master shard (`s_f`
    /// elements; the all-gather input), refreshed after every update. `None` under `params`.
    pub(crate) device_shard: Option<Tensor>,
    /// The rank's host staging buffers, shared by all its shards.
    pub(crate) staging: Arc<Mutex<HostStaging>>,
    /// Threads the optimizer step on the host uses.
    pub(crate) threads: usize,
}

/// One flat parameter of a unit on this rank.
#[derive(Debug)]
pub struct FlatShard {
    /// The plan's layout of this flat parameter.
    pub layout: FlatParamLayout,
    /// This rank's shard index in the shard group.
    pub shard_index: u64,
    pub(super) master: Master,
    /// The fp32 accumulated gradient shard (`s_f` elements); empty for frozen flat params.
    pub(crate) grad: F32Buf,
    /// Optimizer state buffers (`s_f` elements each): AdamW `[exp_avg, exp_avg_sq]`, SGD
    /// `[momentum]` or none; empty for frozen flat params.
    pub(crate) state: Vec<F32Buf>,
    /// The real spans of this shard with their weight-decay flags (padding excluded).
    pub spans: Vec<Span>,
    /// The device kernels when the unit computes on a device ([`Placement::Device`]).
    pub(crate) dev: Option<Arc<TensorKernels>>,
    /// Offloaded: the master, gradient and optimizer-state shards are host buffers and this
    /// holds the rest (`None` without offload).
    pub(crate) offload: Option<Offloaded>,
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

    /// Whether the shard's master, gradient and optimizer state are offloaded to host memory.
    pub fn is_offloaded(&self) -> bool {
        self.offload.is_some()
    }

    /// Adds a reduced gradient shard (`s_f` elements of reduce_dtype, where the reduction left
    /// it: a host buffer, or a device tensor) into the f32 gradient shard. Offloaded, a device
    /// tensor is copied to the host through the gradient staging buffer first.
    ///
    /// Errors: a length or placement mismatch, a kernel or device failure.
    pub(crate) fn accumulate_reduced(&mut self, reduced: &OwnedBuf) -> Result<()> {
        match (&self.offload, &mut self.grad, reduced, &self.dev) {
            (Some(o), F32Buf::Host(g), OwnedBuf::Tensor(t), Some(k)) => {
                lock(&o.staging)?.download_accumulate(k, t, g)
            }
            _ => self.grad.accumulate(reduced),
        }
    }

    /// Offloaded under `optimizer`: casts the host master shard into the device's
    /// `param_dtype` shard through the parameter staging buffer (after an update or a load).
    /// A no-op otherwise.
    ///
    /// Errors: a kernel or device failure.
    fn refresh_device_shard(&self) -> Result<()> {
        match (&self.offload, &self.master) {
            (Some(o), Master::Flat(F32Buf::Host(p))) => refresh(o, p, self.dev.as_deref()),
            _ => Ok(()),
        }
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
            Master::Flat(v) => {
                v.set(values)?;
                self.refresh_device_shard()?;
            }
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
            offload,
            dev,
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
            Master::Flat(F32Buf::Host(p)) => match &*offload {
                // Offloaded: the step on the CPU, on several threads (bitwise one thread's),
                // then the device's param_dtype shard refreshed from the new master.
                Some(o) => {
                    opt.step_shard_threads(p, grad, &mut state, spans, step, o.threads)?;
                    refresh(o, p, dev.as_deref())
                }
                // On the rank's compute threads (bitwise one thread's).
                None => opt.step_shard_threads(
                    p,
                    grad,
                    &mut state,
                    spans,
                    step,
                    rayon::current_num_threads(),
                ),
            },
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
                    // On the rank's compute threads (bitwise one thread's).
                    let threads = rayon::current_num_threads();
                    mut_f32(t, |x| {
                        if let Err(e) = opt.step_shard_threads(x, g, &mut st, &sp, step, threads) {
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

/// A buffer of a shard as a checkpoint reads and writes it: the fp32 master, or optimizer
/// state buffer `i` (AdamW: 0 = `exp_avg`, 1 = `exp_avg_sq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardBuf {
    /// The fp32 master shard.
    Param,
    /// Optimizer state buffer `i`.
    State(usize),
}

/// Calls `f` with host copies of elements `range` of `t` (a contiguous f32 device tensor,
/// flattened), at most `chunk` elements at a time.
fn visit_dev(
    t: &Tensor,
    k: &TensorKernels,
    range: std::ops::Range<usize>,
    chunk: usize,
    f: &mut dyn FnMut(&[f32]),
) -> Result<()> {
    let t = t.flatten_all()?;
    let mut a = range.start;
    while a < range.end {
        let n = chunk.max(1).min(range.end - a);
        f(&k.to_f32(&t.narrow(0, a, n)?)?);
        a += n;
    }
    Ok(())
}

/// Fills elements `offset..offset + len` of `t` (a contiguous f32 device tensor, flattened:
/// a view of the same storage) through `fill(position, dest)`, at most `chunk` elements at a
/// time through one host buffer.
fn fill_dev(
    t: &Tensor,
    k: &TensorKernels,
    offset: usize,
    len: usize,
    chunk: usize,
    at: usize,
    fill: &mut dyn FnMut(usize, &mut [f32]) -> Result<()>,
) -> Result<()> {
    let t = t.flatten_all()?;
    let mut buf = vec![0f32; chunk.max(1).min(len)];
    let mut a = 0;
    while a < len {
        let n = buf.len().min(len - a);
        fill(at + a, &mut buf[..n])?;
        k.copy_into(&t, offset + a, &k.from_f32(&buf[..n], DType::F32)?)?;
        a += n;
    }
    Ok(())
}

/// Calls `f` with `n` zeros, at most `chunk` at a time.
fn visit_zeros(n: usize, chunk: usize, f: &mut dyn FnMut(&[f32])) {
    let zeros = vec![0f32; chunk.max(1).min(n)];
    let mut left = n;
    while left > 0 {
        let m = zeros.len().min(left);
        f(&zeros[..m]);
        left -= m;
    }
}

impl FlatShard {
    /// Elements of buffer `b` (`s_f`); `None` for an optimizer state buffer the shard lacks.
    pub fn buf_len(&self, b: ShardBuf) -> Option<usize> {
        match b {
            ShardBuf::Param => Some(self.shard_numel()),
            ShardBuf::State(i) => self.state.get(i).map(F32Buf::len),
        }
    }

    /// Calls `f` with consecutive host slices that together are elements `range` of buffer
    /// `b`, in order: a host buffer in place (no copy), a device buffer through copies of at
    /// most `chunk` elements; under a shard group of one (a master kept per segment) the
    /// gaps between segments are zeros, as the flat shard holds them.
    ///
    /// Errors: [`EngineError::State`] for a buffer the shard lacks or a range past its end; a
    /// device copy failure.
    pub fn visit(
        &self,
        b: ShardBuf,
        range: std::ops::Range<usize>,
        chunk: usize,
        f: &mut dyn FnMut(&[f32]),
    ) -> Result<()> {
        let len = self.buf_len(b).unwrap_or(0);
        if range.start > range.end || range.end > len || self.buf_len(b).is_none() {
            return Err(EngineError::State(format!(
                "unit {} flat param: elements {}..{} of {b:?}, a buffer of {len}",
                self.layout.unit, range.start, range.end
            )));
        }
        let flat = match b {
            ShardBuf::Param => match &self.master {
                Master::Flat(v) => v,
                Master::Parts(parts) => {
                    let mut pos = range.start;
                    for (seg, t) in self.layout.segments.iter().zip(parts) {
                        let r = seg_range(seg);
                        let (lo, hi) = (r.start.max(pos), r.end.min(range.end));
                        if lo >= hi {
                            continue;
                        }
                        visit_zeros(lo - pos, chunk, f);
                        let sub = lo - r.start..hi - r.start;
                        match &self.dev {
                            None => with_f32(t, |x| f(&x[sub]))?,
                            Some(k) => visit_dev(t, k, sub, chunk, f)?,
                        }
                        pos = hi;
                    }
                    visit_zeros(range.end - pos, chunk, f);
                    return Ok(());
                }
            },
            ShardBuf::State(i) => &self.state[i],
        };
        match flat {
            F32Buf::Host(v) => f(&v[range]),
            F32Buf::Dev(t, k) => visit_dev(t, k, range, chunk, f)?,
        }
        Ok(())
    }

    /// Overwrites every element of buffer `b` with what `fill(position, dest)` writes into
    /// `dest` (elements `position..position + dest.len()` of the buffer): a host buffer in
    /// place in one call, a device buffer through one host buffer of at most `chunk` elements;
    /// under a shard group of one only the segments are asked for (the gaps are zeros). An
    /// offloaded master refreshes the device's `param_dtype` shard afterwards.
    ///
    /// Errors: [`EngineError::State`] for a buffer the shard lacks; `fill`'s errors; a device
    /// copy failure.
    pub fn fill(
        &mut self,
        b: ShardBuf,
        chunk: usize,
        fill: &mut dyn FnMut(usize, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let n = self.shard_numel();
        let flat = match b {
            ShardBuf::Param => match &mut self.master {
                Master::Flat(v) => v,
                Master::Parts(parts) => {
                    for (seg, t) in self.layout.segments.iter().zip(parts.iter()) {
                        let r = seg_range(seg);
                        match &self.dev {
                            None => {
                                let mut out = Ok(());
                                mut_f32(t, |x| out = fill(r.start, x))?;
                                out?;
                            }
                            Some(k) => fill_dev(t, k, 0, r.len(), chunk, r.start, fill)?,
                        }
                    }
                    return Ok(());
                }
            },
            ShardBuf::State(i) => {
                let len = self.state.len();
                self.state
                    .get_mut(i)
                    .ok_or_else(|| EngineError::State(format!("optimizer state {i} of {len}")))?
            }
        };
        match flat {
            F32Buf::Host(v) => fill(0, v)?,
            F32Buf::Dev(t, k) => fill_dev(t, k, 0, n, chunk, 0, fill)?,
        }
        if b == ShardBuf::Param {
            self.refresh_device_shard()?;
        }
        Ok(())
    }

    /// The first infinite or NaN value among the real elements (padding excluded) of buffer
    /// `b`, as (element of the shard, value): found in place (a device buffer is reduced on
    /// the device, and read back in pieces of at most `chunk` elements only when it holds one).
    ///
    /// Errors: as [`FlatShard::visit`].
    pub fn first_nonfinite(&self, b: ShardBuf, chunk: usize) -> Result<Option<(usize, f32)>> {
        let quick = match (b, &self.master) {
            (ShardBuf::Param, Master::Flat(v)) => Some(v.max_abs(&self.spans)?),
            (ShardBuf::Param, Master::Parts(_)) => None,
            (ShardBuf::State(i), _) => match self.state.get(i) {
                Some(v) => Some(v.max_abs(&self.spans)?),
                None => return Ok(None),
            },
        };
        if quick.is_some_and(f32::is_finite) {
            return Ok(None);
        }
        for sp in &self.spans {
            let mut at = sp.start;
            let mut found = None;
            self.visit(b, sp.start..sp.start + sp.len, chunk, &mut |x| {
                if found.is_none() {
                    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
                        found = Some((at + i, x[i]));
                    }
                }
                at += x.len();
            })?;
            if found.is_some() {
                return Ok(found);
            }
        }
        Ok(None)
    }
}

/// Casts the host master shard `p` into `o`'s device `param_dtype` shard (under `--offload
/// optimizer`; nothing under `params`).
fn refresh(o: &Offloaded, p: &[f32], dev: Option<&TensorKernels>) -> Result<()> {
    match (&o.device_shard, dev) {
        (Some(ds), Some(k)) => lock(&o.staging)?.upload_cast(k, p, ds, 0),
        (Some(_), None) => Err(EngineError::Config(
            "an offloaded shard without device kernels".into(),
        )),
        (None, _) => Ok(()),
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

/// The element range of a segment in its flat parameter (or in a shard of one).
pub(super) fn seg_range(seg: &fsdp_planner::Segment) -> std::ops::Range<usize> {
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

#[cfg(test)]
mod tests {
    use super::super::{FsdpUnit, UnitInit};
    use super::*;
    use crate::memory::MemoryLedger;
    use candle_core::Device;
    use fsdp_planner::{layout_units, Architecture, ModelSpec, ParamSpec, UnitSpec};

    /// A `[2, 3]` weight and a `[3]` bias, segments aligned to 4 elements: the bias starts at
    /// element 8 (a gap of 2), the flat parameter is padded to 12 (S = 1) or 16 (S = 2).
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

    /// Every kind of master and state buffer: host or CPU-device, a master per segment (S =
    /// 1) or one flat shard (S = 2, shard 1).
    fn units() -> Vec<(String, bool, FsdpUnit)> {
        let spec = spec();
        let dev = Arc::new(TensorKernels::new(&Device::Cpu).unwrap());
        let mut out = Vec::new();
        for s in [1u64, 2] {
            let layouts = layout_units(&spec, s, 4).unwrap();
            for on_dev in [false, true] {
                let shard_index = s - 1;
                let init = UnitInit {
                    index: 0,
                    spec: &spec.units[0],
                    layout: &layouts[0],
                    shards: layouts[0]
                        .flat_params
                        .iter()
                        .map(|f| vec![0.0; f.shard_numel().0 as usize])
                        .collect(),
                    shard_index,
                    state_buffers: 2,
                    param_dtype: DType::F32,
                    dev: on_dev.then_some(&dev),
                    offload: None,
                };
                let u = FsdpUnit::new(init, &mut MemoryLedger::new()).unwrap();
                out.push((format!("S={s} device {on_dev}"), on_dev, u));
            }
        }
        out
    }

    /// Element `i` of the shard as a checkpoint holds it: `base + i` on real elements, 0 on
    /// padding and gaps.
    fn expected(f: &FlatShard, base: f32) -> Vec<f32> {
        let mut v = vec![0f32; f.shard_numel()];
        for sl in f.layout.shard_slices(f.shard_index) {
            let d = sl.shard_offset.0 as usize;
            for (i, x) in v[d..d + sl.numel.0 as usize].iter_mut().enumerate() {
                *x = base + (d + i) as f32;
            }
        }
        v
    }

    #[test]
    fn visit_and_fill_move_every_buffer_in_pieces_of_any_size() {
        for (name, on_dev, mut u) in units() {
            let f = &mut u.flats[0];
            let n = f.shard_numel();
            assert!(n > 4, "{name}: {n}");
            for chunk in [1, 2, 3, 5, n, 4096] {
                for (b, base) in [
                    (ShardBuf::Param, 100.0),
                    (ShardBuf::State(0), 200.0),
                    (ShardBuf::State(1), 300.0),
                ] {
                    let want = expected(f, base + chunk as f32);
                    let mut asked = Vec::new();
                    f.fill(b, chunk, &mut |at, dest| {
                        // A device buffer goes through pieces of at most `chunk` elements.
                        assert!(!on_dev || dest.len() <= chunk, "{name}");
                        asked.push(at..at + dest.len());
                        dest.copy_from_slice(&want[at..at + dest.len()]);
                        Ok(())
                    })
                    .unwrap();
                    let held = match b {
                        ShardBuf::Param => f.param_vec().unwrap(),
                        ShardBuf::State(i) => f.state_vecs().unwrap()[i].clone(),
                    };
                    assert_eq!(held, want, "{name} {b:?} chunk {chunk}: filled");
                    for lo in 0..n {
                        for hi in lo..=n {
                            let mut got = Vec::new();
                            f.visit(b, lo..hi, chunk, &mut |x| {
                                assert!(!on_dev || x.len() <= chunk, "{name}");
                                got.extend_from_slice(x);
                            })
                            .unwrap();
                            assert_eq!(got, want[lo..hi], "{name} {b:?} chunk {chunk} {lo}..{hi}");
                        }
                    }
                }
            }
            assert!(f.visit(ShardBuf::Param, 0..n + 1, 4, &mut |_| {}).is_err());
            assert!(f.visit(ShardBuf::State(2), 0..1, 4, &mut |_| {}).is_err());
        }
    }

    #[test]
    fn the_first_nonfinite_value_is_found_in_place() {
        for (name, _, mut u) in units() {
            let f = &mut u.flats[0];
            let want = expected(f, 1.0);
            for b in [ShardBuf::Param, ShardBuf::State(1)] {
                f.fill(b, 3, &mut |at, d| {
                    d.copy_from_slice(&want[at..at + d.len()]);
                    Ok(())
                })
                .unwrap();
                assert_eq!(f.first_nonfinite(b, 3).unwrap(), None, "{name}");
                // The last real element, then also an earlier one.
                let real: Vec<usize> = (0..want.len()).filter(|&i| want[i] != 0.0).collect();
                for (i, v) in [(real[real.len() - 1], f32::INFINITY), (real[1], f32::NAN)] {
                    let mut cur = Vec::new();
                    f.visit(b, 0..want.len(), 3, &mut |x| cur.extend_from_slice(x))
                        .unwrap();
                    cur[i] = v;
                    f.fill(b, 3, &mut |at, d| {
                        d.copy_from_slice(&cur[at..at + d.len()]);
                        Ok(())
                    })
                    .unwrap();
                    let (at, found) = f.first_nonfinite(b, 3).unwrap().expect("found");
                    let first = (0..cur.len()).find(|&j| !cur[j].is_finite()).unwrap();
                    assert_eq!(at, first, "{name} {b:?}");
                    assert_eq!(found.to_bits(), cur[first].to_bits(), "{name} {b:?}");
                }
            }
        }
    }
}

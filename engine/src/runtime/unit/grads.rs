//! A unit's unsharded flat gradients (`unsharded_grads`): one `P_f`-element buffer per
//! trainable flat parameter, allocated for backward, filled from the parameters' gradients,
//! lent to the reduction that consumes it (and, for the persistent f32 buffer of gradient
//! sync on the last micro-batch, given back) and freed.

use super::{flat::seg_range, with_f32, FsdpUnit, Lifecycle};
use crate::error::{EngineError, Result};
use crate::memory::{Category, MemoryLedger};
use candle_core::Tensor;
use fsdp_comm::OwnedBuf;
use fsdp_kernels::tensor::TensorKernels;
use fsdp_types::DType;
use half::{bf16, f16};

impl FsdpUnit {
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
            self.flat_grads.push(Some(match &fs.dev {
                None => OwnedBuf::zeros(dtype, p),
                Some(k) => OwnedBuf::Tensor(k.zeros(dtype, p)?),
            }));
        }
        Ok(())
    }

    /// Frees the unsharded gradient buffers the unit holds (a lent one is the borrower's to
    /// free) and forgets the lent ones.
    pub(crate) fn free_flat_grads(&mut self, ledger: &mut MemoryLedger) {
        for g in self.flat_grads.drain(..).flatten() {
            ledger.free(Category::UnshardedGrads, owned_bytes(&g));
        }
    }

    /// The unsharded gradient buffer of trainable flat parameter `t`, held by the unit.
    ///
    /// Errors: [`EngineError::UnitTransition`] when the buffers are absent or that one is lent.
    pub(crate) fn flat_grad(&self, t: usize) -> Result<&OwnedBuf> {
        match self.flat_grads.get(t) {
            Some(Some(b)) => Ok(b),
            Some(None) => Err(self.refuse("flat_grad", "the gradient buffer is lent")),
            None => Err(self.refuse("flat_grad", "no unsharded gradient buffers")),
        }
    }

    /// Lends the unsharded gradient buffer of trainable flat parameter `t` to a reduction
    /// (its ledger bytes go with it): the slot is empty until
    /// [`FsdpUnit::restore_flat_grad`] or [`FsdpUnit::clear_lent_flat_grads`].
    ///
    /// Errors: [`EngineError::UnitTransition`] when the buffers are absent or that one is
    /// already lent.
    pub(crate) fn take_flat_grad(&mut self, t: usize) -> Result<OwnedBuf> {
        match self.flat_grads.get(t) {
            Some(Some(_)) => Ok(self.flat_grads[t].take().expect("matched Some")),
            Some(None) => Err(self.refuse("take_flat_grad", "the gradient buffer is lent")),
            None => Err(self.refuse("take_flat_grad", "no unsharded gradient buffers")),
        }
    }

    /// Gives a lent gradient buffer back to slot `t` (the persistent f32 buffer after its
    /// reduction).
    ///
    /// Errors: [`EngineError::UnitTransition`] when slot `t` does not exist or is not lent.
    pub(crate) fn restore_flat_grad(&mut self, t: usize, buf: OwnedBuf) -> Result<()> {
        match self.flat_grads.get(t) {
            Some(None) => {
                self.flat_grads[t] = Some(buf);
                Ok(())
            }
            Some(Some(_)) => {
                Err(self.refuse("restore_flat_grad", "the gradient buffer was not lent"))
            }
            None => Err(self.refuse("restore_flat_grad", "no unsharded gradient buffers")),
        }
    }

    /// Forgets gradient buffers that were all lent to reductions for good (the reductions
    /// free their bytes when they finish).
    ///
    /// Errors: [`EngineError::UnitTransition`] when the unit still holds one of them (its bytes
    /// would never be freed).
    pub(crate) fn clear_lent_flat_grads(&mut self) -> Result<()> {
        if self.flat_grads.iter().any(Option::is_some) {
            return Err(self.refuse("clear_lent_flat_grads", "a gradient buffer is still held"));
        }
        self.flat_grads.clear();
        Ok(())
    }

    /// Copies (`add == false`) or adds the gradients of this unit's trainable parameters
    /// (`grads[i]` for declaration index `i`, taken and freed one by one) into the unsharded flat
    /// gradients. Parameters without a gradient contribute 0.
    ///
    /// Errors: [`EngineError::UnitTransition`] unless the unit is unsharded (its backward just
    /// ran) and holds every gradient buffer; a kernel or device failure.
    pub(crate) fn gather_grads(&mut self, grads: &mut [Option<Tensor>], add: bool) -> Result<()> {
        if !matches!(self.lifecycle, Lifecycle::Unsharded { .. }) {
            return Err(self.refuse(
                "gather_grads",
                "parameter gradients come from an unsharded unit's backward",
            ));
        }
        let trainable = self.flats.iter().filter(|f| f.layout.trainable).count();
        if self.flat_grads.len() != trainable || self.flat_grads.iter().any(Option::is_none) {
            return Err(self.refuse(
                "gather_grads",
                "the unsharded gradient buffers are absent or lent",
            ));
        }
        let mut t_index = 0;
        for fs in self.flats.iter() {
            if !fs.layout.trainable {
                continue;
            }
            let buf = self.flat_grads[t_index].as_mut().expect("checked above");
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

/// Bytes of an owned buffer (elements x element size).
pub(crate) fn owned_bytes(b: &OwnedBuf) -> u64 {
    b.dtype().size_bytes() * b.len() as u64
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

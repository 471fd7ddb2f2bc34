//! Offload (ZeRO-Offload, Ren et al. 2021; PyTorch FSDP2's `CPUOffloadPolicy`): the host
//! staging buffers and the two copies an offloaded rank makes each step.
//!
//! Under [`fsdp_planner::Offload`] `optimizer` or `params` a rank's f32 master shards, f32
//! gradient shards and optimizer state are host buffers while the model computes on the
//! device. Two reusable host buffers carry every copy (the plan's host `staging`, allocated
//! once, as pinned-memory engines keep theirs):
//! - **parameters**, host to device: a master shard is cast to `param_dtype` into the
//!   parameter staging buffer, then uploaded into the device buffer it feeds (the rank's block
//!   of the all-gather buffer under `params`; the device `param_dtype` shard under
//!   `optimizer`, after each optimizer step);
//! - **gradients**, device to host: a reduced gradient shard (`reduce_dtype`, in the device's
//!   staging buffer the reduce-scatter filled) is downloaded into the gradient staging buffer
//!   and added, widened exactly, into the host f32 gradient shard.
//!
//! The casts and the additions are the kernels the device path runs (round to nearest even;
//! exact widening then one rounded f32 add), so an offloaded run is bitwise the run that keeps
//! everything on the device.

use crate::error::{EngineError, Result};
use crate::memory::MemoryLedger;
use candle_core::Tensor;
use fsdp_kernels::tensor::TensorKernels;
use fsdp_kernels::FlatBuffer;
use fsdp_planner::{Category, ShardPlan};

/// The host staging buffers of an offloaded rank (see the module doc).
#[derive(Debug)]
pub struct HostStaging {
    /// `param_dtype`, the largest flat parameter's shard length (elements).
    params: FlatBuffer,
    /// `reduce_dtype`, the largest trainable flat parameter's shard length (elements).
    grads: FlatBuffer,
}

impl HostStaging {
    /// Allocates both buffers for `plan` and charges them to the host ledger's `staging`
    /// ([`fsdp_planner::memory::host_staging_bytes`] bytes).
    pub(crate) fn new(plan: &ShardPlan, host: &mut MemoryLedger) -> HostStaging {
        let flats = || plan.units.iter().flat_map(|u| &u.flat_params);
        let largest = flats().map(|f| f.shard_numel().0).max().unwrap_or(0) as usize;
        let largest_trainable = flats()
            .filter(|f| f.trainable)
            .map(|f| f.shard_numel().0)
            .max()
            .unwrap_or(0) as usize;
        let params = FlatBuffer::zeros(plan.config.param_dtype, largest);
        let grads = FlatBuffer::zeros(plan.config.reduce_dtype, largest_trainable);
        host.alloc(
            Category::Staging,
            params.size_bytes().0 + grads.size_bytes().0,
        );
        HostStaging { params, grads }
    }

    /// Host to device: casts `master` (f32, `n` elements) to the parameter staging buffer's
    /// dtype and uploads it into elements `[at, at + n)` of the device buffer `dst`.
    ///
    /// Errors: a shard longer than the staging buffer (a plan/engine mismatch:
    /// [`fsdp_kernels::KernelError::LengthMismatch`]), a kernel or device failure.
    pub(crate) fn upload_cast(
        &mut self,
        k: &TensorKernels,
        master: &[f32],
        dst: &Tensor,
        at: usize,
    ) -> Result<()> {
        let n = master.len();
        self.params.copy_from_f32_prefix(master)?;
        k.upload(dst, at, &self.params, n)?;
        Ok(())
    }

    /// Device to host: downloads the reduced gradient shard `src` (`reduce_dtype`, `n`
    /// elements) into the gradient staging buffer and adds it into `dst` (f32, `n`
    /// elements), each element widened exactly and the sum rounded once.
    ///
    /// Errors: a length or dtype mismatch, a kernel or device failure.
    pub(crate) fn download_accumulate(
        &mut self,
        k: &TensorKernels,
        src: &Tensor,
        dst: &mut [f32],
    ) -> Result<()> {
        if src.elem_count() != dst.len() {
            return Err(EngineError::Config(format!(
                "offload: a reduced gradient shard of {} elements for a host shard of {}",
                src.elem_count(),
                dst.len()
            )));
        }
        k.download(src, &mut self.grads)?;
        self.grads.accumulate_prefix_into_f32(dst)?;
        Ok(())
    }
}

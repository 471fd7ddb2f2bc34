//! The optimizer as the engine runs it: which kernel steps each flat shard, how many state
//! buffers it owns, and the learning-rate schedule.
//!
//! The arithmetic lives in `fsdp-kernels` (AdamW: Loshchilov & Hutter 2019, Algorithm 2; SGD
//! with momentum as in PyTorch). The engine calls it on each rank's flat shard with the spans
//! the plan marks, so padding is never updated and weight decay touches only decayed spans.

use crate::error::{EngineError, Result};
use candle_core::Tensor;
pub use fsdp_kernels::optim::{AdamWConfig, SgdConfig};
use fsdp_kernels::span::Span;
use fsdp_kernels::tensor::TensorKernels;

/// The optimizer of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optimizer {
    /// AdamW with two fp32 moments per trainable element (8 bytes per element).
    AdamW(AdamWConfig),
    /// SGD; a momentum buffer (4 bytes per trainable element) iff `momentum > 0`.
    Sgd(SgdConfig),
}

impl Optimizer {
    /// Number of fp32 state buffers per trainable element: AdamW 2, SGD with momentum 1,
    /// plain SGD 0.
    pub fn state_buffers(&self) -> usize {
        match self {
            Optimizer::AdamW(_) => 2,
            Optimizer::Sgd(c) if c.momentum > 0.0 => 1,
            Optimizer::Sgd(_) => 0,
        }
    }

    /// The same optimizer with learning rate `lr` (the schedule's value for one step).
    pub fn with_lr(&self, lr: f64) -> Optimizer {
        match *self {
            Optimizer::AdamW(c) => Optimizer::AdamW(AdamWConfig { lr, ..c }),
            Optimizer::Sgd(c) => Optimizer::Sgd(SgdConfig { lr, ..c }),
        }
    }

    /// The configured (peak) learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            Optimizer::AdamW(c) => c.lr,
            Optimizer::Sgd(c) => c.lr,
        }
    }

    /// Steps one flat shard in place. `param`, `grad` and each `state` buffer have the shard's
    /// length (elements); `state` holds [`Optimizer::state_buffers`] buffers; `step` is 1-based.
    ///
    /// Errors: [`EngineError::Kernel`] (length mismatch, bad spans, bad hyper-parameters).
    pub fn step_shard(
        &self,
        param: &mut [f32],
        grad: &[f32],
        state: &mut [&mut [f32]],
        spans: &[Span],
        step: u64,
    ) -> Result<()> {
        match self {
            Optimizer::AdamW(c) => {
                let [m, v] = state else {
                    return Err(EngineError::Config(format!(
                        "AdamW needs 2 state buffers, the shard has {}",
                        state.len()
                    )));
                };
                fsdp_kernels::optim::adamw_step(param, grad, m, v, spans, c, step)?;
            }
            Optimizer::Sgd(c) => {
                let mut empty: [f32; 0] = [];
                let buf: &mut [f32] = match state {
                    [b] => b,
                    [] => &mut empty,
                    _ => {
                        return Err(EngineError::Config(format!(
                            "SGD needs at most 1 state buffer, the shard has {}",
                            state.len()
                        )))
                    }
                };
                fsdp_kernels::optim::sgd_step(param, grad, buf, spans, c, step)?;
            }
        }
        Ok(())
    }
}

impl Optimizer {
    /// [`Optimizer::step_shard`] on flat buffers that are tensors on a compute device
    /// ([`crate::runtime::Placement::Device`]): `param`, `grad` and each `state` tensor are
    /// contiguous f32 buffers of the shard's length (elements), updated in place by `kernels`
    /// (on the CPU device bitwise equal to `step_shard`; on CUDA fsdp-kernels' CUDA kernels
    /// with the bounds their docstrings state).
    ///
    /// Errors: [`EngineError::Kernel`] (length, dtype or device mismatch, bad spans or
    /// hyper-parameters, a device failure); [`EngineError::Config`] on a wrong number of state
    /// buffers.
    pub fn step_tensors(
        &self,
        kernels: &TensorKernels,
        param: &Tensor,
        grad: &Tensor,
        state: &[Tensor],
        spans: &[Span],
        step: u64,
    ) -> Result<()> {
        match self {
            Optimizer::AdamW(c) => {
                let [m, v] = state else {
                    return Err(EngineError::Config(format!(
                        "AdamW needs 2 state buffers, the shard has {}",
                        state.len()
                    )));
                };
                kernels.adamw_step(param, grad, m, v, spans, c, step)?;
            }
            Optimizer::Sgd(c) => {
                let momentum = match state {
                    [b] => Some(b),
                    [] => None,
                    _ => {
                        return Err(EngineError::Config(format!(
                            "SGD needs at most 1 state buffer, the shard has {}",
                            state.len()
                        )))
                    }
                };
                kernels.sgd_step(param, grad, momentum, spans, c, step)?;
            }
        }
        Ok(())
    }
}

/// Linear warmup then cosine decay (Loshchilov & Hutter 2017, "SGDR", eq. 5, one cycle without
/// restarts), the schedule of GPT-2 style training.
///
/// `lr(step)` for the 1-based optimizer step: `peak * step / warmup` while `step <= warmup`,
/// then `min + (peak - min) * (1 + cos(pi * t)) / 2` with
/// `t = (step - warmup) / (total - warmup)` clamped to `[0, 1]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub peak: f64,
    /// Final learning rate (reached at `total`).
    pub min: f64,
    /// Warmup steps (0: start at the peak).
    pub warmup: u64,
    /// Total steps of the run.
    pub total: u64,
}

impl LrSchedule {
    /// A constant learning rate.
    pub fn constant(lr: f64) -> Self {
        LrSchedule {
            peak: lr,
            min: lr,
            warmup: 0,
            total: 1,
        }
    }

    /// The learning rate of 1-based step `step`.
    pub fn lr(&self, step: u64) -> f64 {
        if self.warmup > 0 && step <= self.warmup {
            return self.peak * step as f64 / self.warmup as f64;
        }
        if self.total <= self.warmup {
            return self.peak;
        }
        let t = (step.saturating_sub(self.warmup)) as f64 / (self.total - self.warmup) as f64;
        let t = t.clamp(0.0, 1.0);
        self.min + (self.peak - self.min) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_min() {
        let s = LrSchedule {
            peak: 1e-3,
            min: 1e-4,
            warmup: 10,
            total: 110,
        };
        assert_eq!(s.lr(5), 5e-4);
        assert_eq!(s.lr(10), 1e-3);
        assert!((s.lr(60) - 5.5e-4).abs() < 1e-12);
        assert!((s.lr(110) - 1e-4).abs() < 1e-15);
        assert!((s.lr(500) - 1e-4).abs() < 1e-15);
    }

    #[test]
    fn state_buffer_counts() {
        assert_eq!(Optimizer::AdamW(AdamWConfig::default()).state_buffers(), 2);
        let sgd = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
        };
        assert_eq!(Optimizer::Sgd(sgd).state_buffers(), 1);
        assert_eq!(
            Optimizer::Sgd(SgdConfig {
                momentum: 0.0,
                ..sgd
            })
            .state_buffers(),
            0
        );
    }
}

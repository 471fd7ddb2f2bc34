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
use fsdp_kernels::tensor::{AdamWTensors, TensorKernels};
use rayon::prelude::*;

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

/// Shards shorter than this many elements per thread are stepped on one thread: below it a
/// thread costs more than it saves.
pub const MIN_ELEMENTS_PER_THREAD: usize = 1 << 15;

impl Optimizer {
    /// [`Optimizer::step_shard`] on up to `threads` threads (the optimizer step of a shard in
    /// host memory): the shard's `n` elements are cut into contiguous chunks (at least
    /// [`MIN_ELEMENTS_PER_THREAD`] each), each chunk's part of `spans` shifted to it, and each
    /// chunk stepped by the same kernel as a task of the current rayon pool. The update of an element
    /// depends only on that element and the step's scalars, so the result is bitwise the
    /// one-thread result (`tests`: `threaded_step_is_bitwise_the_serial_step`).
    ///
    /// Errors: as [`Optimizer::step_shard`]; spans are validated for the whole shard first, so
    /// an invalid span writes nothing.
    #[allow(clippy::needless_range_loop)]
    pub fn step_shard_threads(
        &self,
        param: &mut [f32],
        grad: &[f32],
        state: &mut [&mut [f32]],
        spans: &[Span],
        step: u64,
        threads: usize,
    ) -> Result<()> {
        let n = param.len();
        let chunks = threads.min(n / MIN_ELEMENTS_PER_THREAD).max(1);
        if chunks == 1 || grad.len() != n || state.iter().any(|b| b.len() != n) {
            return self.step_shard(param, grad, state, spans, step);
        }
        fsdp_kernels::span::validate_spans(spans, n)?;
        let bounds: Vec<usize> = (0..=chunks).map(|i| i * n / chunks).collect();
        let cut = |r: std::ops::Range<usize>| -> Vec<Span> {
            spans
                .iter()
                .filter_map(|sp| {
                    let sr = sp.range();
                    let (lo, hi) = (sr.start.max(r.start), sr.end.min(r.end));
                    (lo < hi).then(|| Span::new(lo - r.start, hi - lo, sp.weight_decay))
                })
                .collect()
        };
        // Chunk i of every buffer: param, grad and each state buffer.
        let mut p_parts = Vec::with_capacity(chunks);
        let mut rest = param;
        for i in 0..chunks {
            let (a, b) = std::mem::take(&mut rest).split_at_mut(bounds[i + 1] - bounds[i]);
            p_parts.push(a);
            rest = b;
        }
        let mut s_parts: Vec<Vec<&mut [f32]>> = (0..chunks).map(|_| Vec::new()).collect();
        for buf in state.iter_mut() {
            let mut rest: &mut [f32] = buf;
            for i in 0..chunks {
                let (a, b) = std::mem::take(&mut rest).split_at_mut(bounds[i + 1] - bounds[i]);
                s_parts[i].push(a);
                rest = b;
            }
        }
        // Each chunk is a task in the current rayon pool (the rank's compute pool: idle while
        // its rank steps the optimizer), so the step adds no thread to the process.
        let tasks: Vec<_> = p_parts
            .into_iter()
            .zip(s_parts)
            .enumerate()
            .map(|(i, (p, st))| (p, st, bounds[i]..bounds[i + 1]))
            .collect();
        let results: Vec<Result<()>> = tasks
            .into_par_iter()
            .map(|(p, mut st, r)| {
                let g = &grad[r.clone()];
                self.step_shard(p, g, &mut st, &cut(r), step)
            })
            .collect();
        results.into_iter().collect()
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
                kernels.adamw_step(
                    AdamWTensors {
                        param,
                        grad,
                        exp_avg: m,
                        exp_avg_sq: v,
                    },
                    spans,
                    c,
                    step,
                )?;
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

#[cfg(test)]
mod threaded_tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2654435761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
            .collect()
    }

    #[test]
    fn threaded_step_is_bitwise_the_serial_step() {
        let n = 5 * MIN_ELEMENTS_PER_THREAD + 17;
        let spans = [
            Span::new(3, 40_000, true),
            Span::new(40_010, 70_000, false),
            Span::new(120_000, n - 120_000 - 5, true),
        ];
        let opts = [
            Optimizer::AdamW(AdamWConfig::default()),
            Optimizer::Sgd(SgdConfig {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 1e-3,
            }),
        ];
        for opt in opts {
            let bufs = opt.state_buffers();
            let mut runs: Vec<(Vec<f32>, Vec<Vec<f32>>)> = Vec::new();
            for threads in [1, 2, 3, 8] {
                let mut p = data(n, 1);
                let mut st: Vec<Vec<f32>> = (0..bufs).map(|b| data(n, 7 + b as u32)).collect();
                for b in st.iter_mut() {
                    for x in b.iter_mut() {
                        *x = x.abs();
                    }
                }
                for step in 1..=3 {
                    let g = data(n, 100 + step as u32);
                    let mut sr: Vec<&mut [f32]> = st.iter_mut().map(|v| v.as_mut_slice()).collect();
                    opt.step_shard_threads(&mut p, &g, &mut sr, &spans, step, threads)
                        .unwrap();
                }
                runs.push((p, st));
            }
            for r in &runs[1..] {
                assert!(r
                    .0
                    .iter()
                    .zip(&runs[0].0)
                    .all(|(a, b)| a.to_bits() == b.to_bits()));
                assert_eq!(r.1, runs[0].1);
            }
            // Elements outside every span (padding) are untouched.
            assert_eq!(runs[0].0[0..3], data(n, 1)[0..3]);
        }
        // An invalid span writes nothing, whatever the thread count.
        let mut p = data(n, 1);
        let g = data(n, 2);
        let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
        let mut st: Vec<&mut [f32]> = vec![&mut m, &mut v];
        let bad = [Span::new(n - 2, 10, true)];
        assert!(opts[0]
            .step_shard_threads(&mut p, &g, &mut st, &bad, 1, 4)
            .is_err());
        assert_eq!(p, data(n, 1));
    }
}

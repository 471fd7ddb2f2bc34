//! Optimizer steps on flat fp32 buffers: AdamW and SGD with momentum.
//!
//! Both update only the elements inside the given [`Span`]s; padding is never read or written,
//! so padding that starts at 0 stays exactly 0.
//!
//! Hyperparameters are `f64`, like Python floats in PyTorch. Every scalar a kernel needs is
//! computed once per step in `f64` and rounded once to `f32` ([`AdamWScalars`]), which is how
//! PyTorch's single-tensor (for-loop) CPU implementation hands Python scalars to fp32 tensor ops.
//! A CUDA kernel receives the very same `f32` scalars, so it can be checked against this CPU
//! reference element by element.

use crate::error::{check_len, KernelError};
use crate::span::{validate_spans, Span};

/// Hyperparameters of AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay
/// Regularization", Algorithm 2), with Adam's bias correction (Kingma & Ba 2015, "Adam: A Method
/// for Stochastic Optimization", Algorithm 1). All values are plain numbers (no units); `lr` is
/// the learning rate of the current step (schedules are applied by the caller).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate, `>= 0`.
    pub lr: f64,
    /// Decay rate of the first moment, in `[0, 1)`.
    pub beta1: f64,
    /// Decay rate of the second moment, in `[0, 1)`.
    pub beta2: f64,
    /// Term added to the denominator, `>= 0`.
    pub eps: f64,
    /// Decoupled weight decay coefficient, `>= 0`; applied as `p *= 1 - lr * weight_decay`
    /// only on spans with `weight_decay == true`.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    /// PyTorch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2.
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

fn check_nonneg(name: &'static str, value: f64) -> Result<(), KernelError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(KernelError::InvalidHyperparameter {
            name,
            value,
            requirement: "finite and >= 0",
        })
    }
}

fn check_beta(name: &'static str, value: f64) -> Result<(), KernelError> {
    if (0.0..1.0).contains(&value) {
        Ok(())
    } else {
        Err(KernelError::InvalidHyperparameter {
            name,
            value,
            requirement: "in [0, 1)",
        })
    }
}

/// The per-step `f32` scalars of one AdamW step, computed in `f64` and rounded once.
///
/// Given to CPU and CUDA kernels alike so that both use identical constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScalars {
    /// `1 - lr * weight_decay`: the decoupled decay factor for decayed spans.
    pub decay_factor: f32,
    /// `1 - beta1`: the weight of the first-moment interpolation.
    pub one_minus_beta1: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `lr / (1 - beta1^step)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^step)`.
    pub bias_correction2_sqrt: f32,
    /// `eps`.
    pub eps: f32,
}

impl AdamWConfig {
    /// Checks the ranges documented on each field.
    ///
    /// Errors: [`KernelError::InvalidHyperparameter`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), KernelError> {
        check_nonneg("lr", self.lr)?;
        check_beta("beta1", self.beta1)?;
        check_beta("beta2", self.beta2)?;
        check_nonneg("eps", self.eps)?;
        check_nonneg("weight_decay", self.weight_decay)
    }

    /// The `f32` scalars of step `step` (1-based). `beta^step` is computed with `f64::powf`
    /// (C's `pow`, as Python's `**` on floats).
    ///
    /// Errors: [`KernelError::ZeroStep`] for `step == 0`, and those of [`AdamWConfig::validate`].
    pub fn scalars(&self, step: u64) -> Result<AdamWScalars, KernelError> {
        self.validate()?;
        if step == 0 {
            return Err(KernelError::ZeroStep { step });
        }
        let t = step as f64;
        let bias_correction1 = 1.0 - self.beta1.powf(t);
        let bias_correction2 = 1.0 - self.beta2.powf(t);
        Ok(AdamWScalars {
            decay_factor: (1.0 - self.lr * self.weight_decay) as f32,
            one_minus_beta1: (1.0 - self.beta1) as f32,
            beta2: self.beta2 as f32,
            one_minus_beta2: (1.0 - self.beta2) as f32,
            step_size: (self.lr / bias_correction1) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            eps: self.eps as f32,
        })
    }
}

/// One AdamW step, in place, on the elements of `spans` (Loshchilov & Hutter 2019, "Decoupled
/// Weight Decay Regularization", Algorithm 2; bias correction from Kingma & Ba 2015, Algorithm 1).
///
/// Shapes: `param`, `grad`, `exp_avg` (first moment m) and `exp_avg_sq` (second moment v) are
/// flat fp32 buffers of the same length N (elements); `spans` lie inside `[0, N)`, sorted and
/// disjoint. `step` is the 1-based number of this step (1 on the first call).
///
/// For every element inside a span, in this order and in fp32 with the scalars of
/// [`AdamWConfig::scalars`] (the operation order of PyTorch's single-tensor `torch.optim.AdamW`):
/// 1. `p = p * (1 - lr*wd)`, only on spans with `weight_decay`;
/// 2. `m = m + (g - m) * (1 - beta1)` (the linear interpolation `lerp(m, g, 1 - beta1)`, equal to
///    `beta1*m + (1-beta1)*g` in exact arithmetic; PyTorch's vectorized CPU `lerp_` may fuse this
///    multiply-add, so bits can differ from PyTorch by 1 ulp, never between our ranks);
/// 3. `v = v * beta2 + ((1 - beta2) * g) * g`;
/// 4. `denom = sqrt(v) / sqrt(1 - beta2^step) + eps`;
/// 5. `p = p - (step_size * m) / denom` with `step_size = lr / (1 - beta1^step)`.
///
/// Elements outside every span (padding) are not read or written.
///
/// Errors: [`KernelError::LengthMismatch`] if a buffer's length differs from `param.len()`;
/// [`KernelError::SpanOutOfBounds`] / [`KernelError::SpansOverlap`] for bad spans;
/// [`KernelError::InvalidHyperparameter`]; [`KernelError::ZeroStep`]. Nothing is written when an
/// error is returned.
pub fn adamw_step(
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    spans: &[Span],
    cfg: &AdamWConfig,
    step: u64,
) -> Result<(), KernelError> {
    let n = param.len();
    check_len("grad", n, grad.len())?;
    check_len("exp_avg", n, exp_avg.len())?;
    check_len("exp_avg_sq", n, exp_avg_sq.len())?;
    validate_spans(spans, n)?;
    let s = cfg.scalars(step)?;
    for span in spans {
        let r = span.range();
        adamw_span(
            &mut param[r.clone()],
            &grad[r.clone()],
            &mut exp_avg[r.clone()],
            &mut exp_avg_sq[r],
            &s,
            span.weight_decay,
        );
    }
    Ok(())
}

/// The AdamW update of one span (all slices of equal length; checked by the caller).
#[inline]
fn adamw_span(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    s: &AdamWScalars,
    decay: bool,
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    let AdamWScalars {
        decay_factor,
        one_minus_beta1: w1,
        beta2,
        one_minus_beta2: w2,
        step_size,
        bias_correction2_sqrt: bc2,
        eps,
    } = *s;
    // Two copies of the loop so the weight-decay branch is not inside it (keeps it vectorizable).
    if decay {
        for i in 0..n {
            let gi = g[i];
            let pi = p[i] * decay_factor;
            let mi = m[i] + (gi - m[i]) * w1;
            let vi = v[i] * beta2 + (w2 * gi) * gi;
            let denom = vi.sqrt() / bc2 + eps;
            p[i] = pi - (step_size * mi) / denom;
            m[i] = mi;
            v[i] = vi;
        }
    } else {
        for i in 0..n {
            let gi = g[i];
            let mi = m[i] + (gi - m[i]) * w1;
            let vi = v[i] * beta2 + (w2 * gi) * gi;
            let denom = vi.sqrt() / bc2 + eps;
            p[i] -= (step_size * mi) / denom;
            m[i] = mi;
            v[i] = vi;
        }
    }
}

/// Hyperparameters of stochastic gradient descent with momentum, with PyTorch's `torch.optim.SGD`
/// semantics for `dampening = 0`, `nesterov = false` (heavy-ball momentum as written by Sutskever
/// et al. 2013, "On the importance of initialization and momentum in deep learning", eq. 1-2,
/// with the learning rate moved outside the buffer).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate, `>= 0`.
    pub lr: f64,
    /// Momentum factor, in `[0, 1)`; 0 disables the momentum buffer.
    pub momentum: f64,
    /// Coupled (L2) weight decay, `>= 0`: `g = g + weight_decay * p`, only on spans with
    /// `weight_decay == true`.
    pub weight_decay: f64,
}

impl SgdConfig {
    /// Checks the ranges documented on each field.
    ///
    /// Errors: [`KernelError::InvalidHyperparameter`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), KernelError> {
        check_nonneg("lr", self.lr)?;
        check_beta("momentum", self.momentum)?;
        check_nonneg("weight_decay", self.weight_decay)
    }
}

/// One SGD step with momentum, in place, on the elements of `spans` (PyTorch `torch.optim.SGD`
/// semantics, dampening 0, no Nesterov).
///
/// Shapes: `param`, `grad` are flat fp32 buffers of N elements. `momentum_buf` has N elements,
/// or may be empty when `cfg.momentum == 0` (then it is neither read nor written). `step` is
/// 1-based.
///
/// For every element inside a span, in fp32 (scalars rounded once from `f64`):
/// 1. `d = g + weight_decay * p` on spans with `weight_decay` (else `d = g`);
/// 2. if momentum > 0: `buf = d` on step 1, else `buf = buf * momentum + d`; then `d = buf`;
/// 3. `p = p - lr * d`.
///
/// Padding is not read or written.
///
/// Errors: [`KernelError::LengthMismatch`], [`KernelError::SpanOutOfBounds`],
/// [`KernelError::SpansOverlap`], [`KernelError::InvalidHyperparameter`],
/// [`KernelError::ZeroStep`]. Nothing is written when an error is returned.
pub fn sgd_step(
    param: &mut [f32],
    grad: &[f32],
    momentum_buf: &mut [f32],
    spans: &[Span],
    cfg: &SgdConfig,
    step: u64,
) -> Result<(), KernelError> {
    let n = param.len();
    check_len("grad", n, grad.len())?;
    cfg.validate()?;
    let use_momentum = cfg.momentum > 0.0;
    if use_momentum || !momentum_buf.is_empty() {
        check_len("momentum_buf", n, momentum_buf.len())?;
    }
    validate_spans(spans, n)?;
    if step == 0 {
        return Err(KernelError::ZeroStep { step });
    }
    let lr = cfg.lr as f32;
    let wd = cfg.weight_decay as f32;
    let mu = cfg.momentum as f32;
    for span in spans {
        let r = span.range();
        let p = &mut param[r.clone()];
        let g = &grad[r.clone()];
        let decay = span.weight_decay && cfg.weight_decay != 0.0;
        if use_momentum {
            let b = &mut momentum_buf[r];
            for i in 0..p.len() {
                let d = if decay { g[i] + wd * p[i] } else { g[i] };
                let bi = if step == 1 { d } else { b[i] * mu + d };
                b[i] = bi;
                p[i] -= lr * bi;
            }
        } else {
            for i in 0..p.len() {
                let d = if decay { g[i] + wd * p[i] } else { g[i] };
                p[i] -= lr * d;
            }
        }
    }
    Ok(())
}

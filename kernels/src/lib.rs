//! fsdp-kernels: the flat-buffer kernels of fsdp-rs, on the CPU.
//!
//! One job: element-wise and reduction work on flat buffers, the way an FSDP engine stores
//! parameters, gradients and optimizer state (a flat parameter per FSDP unit, cut into shards).
//! Kernels are *flat and ignorant*: they take slices plus [`Span`]s (element ranges of real
//! parameters, with a weight-decay flag) and know nothing about ranks, world size or plans.
//! Elements in no span are padding; span-taking kernels never touch them.
//!
//! - Optimizers: [`adamw_step`] (Loshchilov & Hutter 2019), [`sgd_step`] (PyTorch SGD semantics).
//! - Reductions for gradient clipping: [`sum_squares`] (sequential, f64), [`max_abs`].
//! - Element-wise: [`scale`], [`div_scalar`], [`accumulate`], [`axpy`], [`zero`], [`copy`].
//! - Casts f32/bf16/f16/f64, round to nearest even: module [`cast`].
//! - [`FlatBuffer`]: an owned dtype-tagged buffer with `zeros`, `cast`, byte views.
//! - Module [`tensor`]: [`tensor::TensorKernels`], the same kernels on flat buffers held as
//!   candle tensors (CPU: these slice kernels on the locked storage, bitwise; CUDA: the NVRTC
//!   kernels of [`cuda`] on candle's stream).
//!
//! Every kernel is single-threaded and has a fixed operation order, so a result depends only on
//! its inputs: what lets a sharded run equal a single-process run bit for bit.
//!
//! CUDA: these functions are the reference. Module [`cuda`] holds the CUDA kernels
//! (`cuda::CudaKernels`, feature `cuda`: AdamW, SGD, casts, sum of squares, max-abs, scale,
//! divide, accumulate from f32/bf16/f16/f64,
//! compiled by NVRTC at first use) with the same names and argument order over device buffers,
//! the same [`AdamWScalars`] and span validation, tested against these functions on random
//! inputs; its host-side logic (span tiles, launch grids, the device probe) builds everywhere.

#![warn(missing_docs)]

pub mod buffer;
pub mod cast;
pub mod cuda;
pub mod elementwise;
pub mod error;
pub mod optim;
pub mod reduce;
pub mod span;
pub mod tensor;

pub use buffer::FlatBuffer;
pub use elementwise::{accumulate, axpy, copy, div_scalar, scale, zero};
pub use error::KernelError;
pub use optim::{adamw_step, sgd_step, AdamWConfig, AdamWScalars, SgdConfig};
pub use reduce::{
    first_nonfinite, first_nonfinite_bf16, first_nonfinite_f16, max_abs, sum_squares,
};
pub use span::{validate_spans, Span};

/// Re-exported so callers name the same `bf16` / `f16` types as the kernels.
pub use half::{bf16, f16};

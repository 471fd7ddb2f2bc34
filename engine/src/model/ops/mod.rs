//! Fused CPU custom ops for the GPT hot path, each with a hand-written backward pass that
//! candle's autograd calls: LayerNorm, causal self-attention ([`causal_attention`]: qkv rows
//! to the attention output through strided GEMMs, its own module), causal softmax, bias +
//! GELU, summed cross-entropy, token + position embedding, bias add (with its column-sum
//! backward) and the backward seed; and for the Llama family (their own modules) RMSNorm
//! ([`rms_norm`](fn@rms_norm)), the rotary embedding packed for the attention ([`rope_qkv`])
//! and the SwiGLU gate ([`swiglu`](fn@swiglu)).
//!
//! Composed from candle primitives, each of these is 5-10 full passes over memory and as many
//! temporaries in the autograd graph; fused, it is one pass forward and one backward. Inputs
//! are made contiguous first (a no-op when they already are).
//!
//! # Speed and determinism
//!
//! - **Vectorised kernels.** Each row kernel is plain branch-free element loops (polynomial
//!   `exp` through the exponent bits, [`exp_f32`], and [`exp_f64`] for the cross-entropy's
//!   f64 log-sum-exp; GELU through a sigmoid, see [`bias_gelu`](fn@bias_gelu)) that the compiler vectorises, compiled three times: for AVX-512 (16 f32 lanes), AVX2
//!   (8 lanes) and the baseline (SSE2), the widest the CPU has chosen at run time. Only IEEE-754
//!   add, subtract, multiply, divide, square root, min/max, compares and bit operations are
//!   used, never a fused multiply-add or an approximate reciprocal, and every reduction has a
//!   fixed lane structure (8 accumulators), so the three builds give the same
//!   bits (tested) and the results do not depend on the CPU.
//! - **Rows in parallel, bits independent of the thread count.** When the current rayon pool
//!   (the rank's pool: `cores / W` threads, the one candle's matmul uses) has more than one
//!   thread, rows are computed in parallel tasks. A row's output depends only on that row, so
//!   any partition gives the same bits. Column sums (bias and LayerNorm weight gradients) use
//!   a partition fixed by the row count alone: blocks of [`SUM_BLOCK_ROWS`] rows, each summed
//!   in row order, then the block sums added in block order, with one thread or many.
//!   Row-independent values that are summed (cross-entropy's per-row losses) are added in row
//!   order after the parallel part. So an op gives the same bits for the same input whatever
//!   the thread count, world size or batch split. The embedding backward (a scatter-add in
//!   token order into `[V + P, D]`) stays sequential.
//! - **No zero-fill.** Outputs that every row writes in full are allocated without
//!   initialisation: each row is computed into a reused (cache-resident) row buffer and then
//!   stored into its place in the output's spare capacity, and the length is set after every
//!   row has been stored.
//!
//! # Dtypes: f32, f64, and bf16 / f16 storage with f32 math
//!
//! Each op takes CPU tensors of ONE float dtype (token ids and targets are u32):
//! - f32 and f64 are computed in their own precision.
//! - bf16 and f16 (a unit computing in `param_dtype`, mixed precision as in Micikevicius et al.
//!   2018, "Mixed Precision Training", §3) are 16-bit STORAGE only: each input row is widened
//!   exactly to f32, computed by the f32 kernel (same f32 operations in the same order, so the
//!   same f32 bits as the f32 op on the widened inputs), and each output element is narrowed
//!   back to the input dtype with round-to-nearest-even (`half`'s `from_f32`, what candle's
//!   `to_dtype` does), the way GPU bf16 kernels keep f32 registers and 16-bit memory.
//!   Reductions (LayerNorm statistics and its `dw`/`db`, softmax sums, bias and embedding
//!   gradients, cross-entropy) accumulate in f32 (cross-entropy's loss in f64), never in 16 bits.
//!   Rows are widened one at a time into a reused scratch buffer (no full-tensor f32 copy),
//!   except the embedding gradient, which is accumulated in an f32 `[V + P, D]` buffer.
//!   So a 16-bit op's output is `round16(f32 op(widen(inputs)))` exactly: each element is
//!   within one rounding (relative `2^-8` for bf16, `2^-11` for f16, or half an f16 subnormal
//!   step, `2^-25`, below f16's normal range) of the f32 op on the same values.
//!   The backward passes that read a 16-bit forward result are the causal softmax's (it saves
//!   `y`, already rounded) and the causal attention's (it saves the probabilities `P`, rounded
//!   to the storage dtype; its forward used them unrounded), so their gradients carry that
//!   rounding through their dot products too. The attention widens each (sequence, head)
//!   pair's `[T, hd]` q/k/v (and in backward `dY` and `[T, T]` `P`) into per-task f32
//!   scratch rather than row by row, since its GEMMs read whole matrices.
//! - [`cross_entropy_sum`] returns an F32 scalar for bf16/f16 logits (f32 for f32, f64 for f64;
//!   see [`compute_dtype`]): the loss is never rounded to 16 bits. Its backward takes the f32
//!   upstream gradient unrounded and returns the logits gradient in the logits dtype.
//! - [`backward_seed`](fn@backward_seed) works for all four dtypes.
//! - Mixed float dtypes in one op (e.g. f32 activations with a bf16 weight) are an error naming
//!   both dtypes, never a silent cast. Any other dtype is an error.
//!
//! Matrix products are not here: candle's CPU matmul serves bf16 (widened to f32, multiplied,
//! narrowed) and f16 (gemm's f16 kernel). Parameter gradients from candle autograd come out in
//! the parameters' dtype.
//!
//! These ops have no GPU kernels: on a CUDA device the model uses their candle-primitive
//! counterparts in [`super::composite`] (same contract; [`super::OpsPath`]). The f32/f64 ops
//! are tested against those compositions (engine/tests/model_gpt.rs, model_device.rs); the
//! 16-bit ops against the f32 ops (engine/tests/model_half.rs) and against the 16-bit
//! compositions (model_device.rs); the f32 kernels against f64 and across thread counts
//! (engine/tests/model_ops_accuracy.rs).
//!
//! # Layout
//!
//! One op, forward and backward, per module (`layer_norm`, `causal_softmax`, `bias_gelu`,
//! `cross_entropy`, `embedding`, `bias_add`, `attention`, `backward_seed`, and for the Llama
//! family `rms_norm`, `rope`, `swiglu`); what they share lives apart: the element types and
//! the dtype dispatch (`elem`), the vectorised building blocks and the per-ISA kernel builds
//! (`simd`), and the row-parallel drivers (`rows`).

mod attention;
mod backward_seed;
mod bias_add;
mod bias_gelu;
mod causal_softmax;
mod cross_entropy;
mod elem;
mod embedding;
mod layer_norm;
mod rms_norm;
mod rope;
mod rows;
mod simd;
mod swiglu;

pub use attention::{causal_attention, ATTN_BLOCK_ROWS};
pub use backward_seed::backward_seed;
pub use bias_add::bias_add;
pub use bias_gelu::bias_gelu;
pub use causal_softmax::causal_softmax;
pub use cross_entropy::cross_entropy_sum;
pub use elem::compute_dtype;
pub(crate) use elem::same_dtype;
pub use embedding::embedding;
pub use layer_norm::layer_norm;
pub use rms_norm::rms_norm;
pub use rope::{rope_qkv, Rotary};
pub use rows::SUM_BLOCK_ROWS;
pub use simd::{exp_f32, exp_f64};
pub use swiglu::swiglu;

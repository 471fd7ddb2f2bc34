//! Backward seed: a scalar whose gradient with respect to `y` is exactly `g`.

use candle_core::Tensor;

/// A 0-dim tensor `s` such that `s.backward()` delivers exactly `g` as the gradient of `y`
/// (`y`, `g` of the same shape, float dtype (f32, f64, bf16 or f16) and device): the
/// upstream-gradient seed of unit-level backward. It replaces `(y * g).sum_all().backward()`,
/// which gives the same bits for f32 (`1 * g = g`) but costs two strided broadcast multiplies
/// (also computing an unused gradient for `g`) — about 7 ms per `[1024, 256]` stage output on
/// one core — and about three `y`-sized buffers no memory plan counts. The forward value is a
/// 0-dim zero on `y`'s device (CPU, or CUDA with feature `cuda`): see
/// [`fsdp_kernels::tensor::backward_seed`]. Errors: shape, dtype or device mismatch, an
/// unsupported dtype.
pub fn backward_seed(y: &Tensor, g: &Tensor) -> candle_core::Result<Tensor> {
    fsdp_kernels::tensor::backward_seed(y, g)
}

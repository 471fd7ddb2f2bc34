//! Element-wise kernels on whole flat fp32 buffers: scale, divide, accumulate, axpy, zero, copy.
//!
//! These run over every element, padding included: padding is 0 in every flat buffer, and
//! scaling, dividing by a non-zero number, adding zeros and copying keep it 0.

use crate::error::{check_len, KernelError};

/// `x[i] *= a` for every element. `x`: N fp32 elements. One rounding per element.
pub fn scale(x: &mut [f32], a: f32) {
    for v in x.iter_mut() {
        *v *= a;
    }
}

/// `x[i] /= d` for every element. `x`: N fp32 elements. Dividing (rather than multiplying by
/// `1/d`) rounds once, so `sum / n` is exactly the mean a single process would compute; the
/// engine uses it to divide the gradient by the number of contributing samples exactly once.
/// Division by 0 follows IEEE-754 (inf or NaN); the caller checks `d`.
pub fn div_scalar(x: &mut [f32], d: f32) {
    for v in x.iter_mut() {
        *v /= d;
    }
}

/// `dst[i] += src[i]` (gradient accumulation). `dst`, `src`: N fp32 elements each.
///
/// Errors: [`KernelError::LengthMismatch`] (nothing is written).
pub fn accumulate(dst: &mut [f32], src: &[f32]) -> Result<(), KernelError> {
    check_len("src", dst.len(), src.len())?;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d += s;
    }
    Ok(())
}

/// `dst[i] += a * src[i]` (BLAS axpy; the product is rounded, then the sum: no fused
/// multiply-add, so results are the same on every machine). `dst`, `src`: N fp32 elements.
///
/// Errors: [`KernelError::LengthMismatch`] (nothing is written).
pub fn axpy(dst: &mut [f32], a: f32, src: &[f32]) -> Result<(), KernelError> {
    check_len("src", dst.len(), src.len())?;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d += a * s;
    }
    Ok(())
}

/// Sets every element to `+0.0`. `x`: N fp32 elements.
pub fn zero(x: &mut [f32]) {
    x.fill(0.0);
}

/// `dst[i] = src[i]`, bit for bit. Generic over the element type (f32, bf16, f16, f64, ...).
///
/// Errors: [`KernelError::LengthMismatch`] (nothing is written).
pub fn copy<T: Copy>(dst: &mut [T], src: &[T]) -> Result<(), KernelError> {
    check_len("src", dst.len(), src.len())?;
    dst.copy_from_slice(src);
    Ok(())
}

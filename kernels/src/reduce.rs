//! Reductions over the spans of a flat fp32 buffer, for global gradient-norm clipping.
//!
//! The L2 norm of all gradients is `sqrt(sum over ranks and units of sum_squares(...))`
//! (Pascanu et al. 2013, "On the difficulty of training recurrent neural networks", section 3.2,
//! clipping by the global norm); the inf norm is the max of [`max_abs`]. Padding is excluded
//! because only span elements are read.

use crate::error::KernelError;
use crate::span::{validate_spans, Span};

/// Sum of squares of the elements of `x` inside `spans`, accumulated in `f64`, returned as
/// `f64`.
///
/// Shapes: `x` is a flat fp32 buffer of N elements; `spans` lie inside `[0, N)`, sorted and
/// disjoint. Order: strictly sequential, span after span in list order, element after element,
/// each term `(x as f64) * (x as f64)` added to one `f64` accumulator. The result is therefore
/// bitwise determined by the input and the span list (no reassociation, no threads), which the
/// world-size parity tests rely on. Each square is exact in `f64` (24-bit mantissa squared fits
/// in 53 bits); only the additions round.
///
/// A NaN or infinite element makes the result NaN or infinite.
///
/// Errors: [`KernelError::SpanOutOfBounds`], [`KernelError::SpansOverlap`].
pub fn sum_squares(x: &[f32], spans: &[Span]) -> Result<f64, KernelError> {
    validate_spans(spans, x.len())?;
    let mut acc = 0.0f64;
    for span in spans {
        for &v in &x[span.range()] {
            let d = v as f64;
            acc += d * d;
        }
    }
    Ok(acc)
}

/// Largest absolute value of the elements of `x` inside `spans` (the local part of the inf
/// norm), as `f32`; 0.0 when the spans hold no element.
///
/// Shapes: `x` is a flat fp32 buffer of N elements; `spans` lie inside `[0, N)`, sorted and
/// disjoint. If any element is NaN the result is NaN (unlike `f32::max`, which drops NaN), so a
/// NaN gradient is never hidden by clipping. The result does not depend on order.
///
/// Errors: [`KernelError::SpanOutOfBounds`], [`KernelError::SpansOverlap`].
pub fn max_abs(x: &[f32], spans: &[Span]) -> Result<f32, KernelError> {
    validate_spans(spans, x.len())?;
    let mut best = 0.0f32;
    let mut nan = false;
    for span in spans {
        for &v in &x[span.range()] {
            let a = v.abs();
            nan |= a.is_nan();
            best = if a > best { a } else { best };
        }
    }
    Ok(if nan { f32::NAN } else { best })
}

/// Index of the first element of `x` that is not finite (infinite or NaN), or `None` when
/// every element is finite.
///
/// Shapes: any fp32 buffer. Reads the exponent bits (all ones = infinite or NaN) in blocks of
/// 1,024 elements, so it vectorises and stops within one block of the first non-finite value.
/// Used to attribute a non-finite gradient to the rank whose own contribution held it, before
/// the contributions are summed.
pub fn first_nonfinite(x: &[f32]) -> Option<usize> {
    first_with_exponent_all_ones(x, |v| v.to_bits(), 0x7f80_0000)
}

/// As [`first_nonfinite`] for bf16 elements (exponent bits `0x7f80`).
pub fn first_nonfinite_bf16(x: &[half::bf16]) -> Option<usize> {
    first_with_exponent_all_ones(x, |v| v.to_bits() as u32, 0x7f80)
}

/// As [`first_nonfinite`] for f16 elements (exponent bits `0x7c00`).
pub fn first_nonfinite_f16(x: &[half::f16]) -> Option<usize> {
    first_with_exponent_all_ones(x, |v| v.to_bits() as u32, 0x7c00)
}

fn first_with_exponent_all_ones<T: Copy>(
    x: &[T],
    bits: impl Fn(T) -> u32 + Copy,
    mask: u32,
) -> Option<usize> {
    const BLOCK: usize = 1024;
    for (b, chunk) in x.chunks(BLOCK).enumerate() {
        let any = chunk
            .iter()
            .fold(false, |acc, &v| acc | (bits(v) & mask == mask));
        if any {
            let i = chunk.iter().position(|&v| bits(v) & mask == mask)?;
            return Some(b * BLOCK + i);
        }
    }
    None
}

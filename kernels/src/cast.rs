//! Casts between fp32, bf16, f16 and f64 flat buffers, rounding to nearest, ties to even.
//!
//! Every narrowing cast rounds exactly once to the nearest representable value, ties to even
//! (IEEE-754 roundTiesToEven), overflowing to infinity; NaN stays NaN (quiet). Widening casts
//! are exact. f32 -> bf16/f16 use the `half` crate (its f16 slice conversion uses the F16C
//! instructions when the CPU has them; both paths round to nearest even). f64 -> bf16/f16 round
//! once: the f64 is first rounded to f32 *to odd* and then to the target to nearest even, which
//! is correctly rounded whenever the intermediate format has at least 2 more mantissa bits than
//! the target (Boldo & Melquiond 2008, "Emulation of FMA and correctly rounded sums: proved
//! algorithms using rounding to odd", IEEE Trans. Computers 57(4), Theorem 1). `half`'s own
//! `from_f64` is not used because it rounds twice on x86.
//!
//! Shapes: `src` and `dst` have the same number of elements; errors:
//! [`KernelError::LengthMismatch`] (nothing is written).

use crate::error::{check_len, KernelError};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Rounds an `f64` to `f32` with rounding to odd: exact values are kept; an inexact value becomes
/// whichever of its two `f32` neighbours has an odd last mantissa bit (the largest finite f32
/// stands in for values beyond it). NaN maps to NaN. Used as the first half of a correctly
/// rounded f64 -> bf16/f16 conversion (Boldo & Melquiond 2008).
pub fn f64_to_f32_round_to_odd(x: f64) -> f32 {
    if x.is_nan() {
        return x as f32;
    }
    let r = x as f32; // to nearest even
    if r as f64 == x {
        return r;
    }
    // Truncate toward zero: step back one ulp if rounding went away from zero.
    let mut bits = r.to_bits();
    if (r as f64).abs() > x.abs() {
        bits -= 1; // sign-magnitude: one step toward zero (inf -> f32::MAX)
    }
    f32::from_bits(bits | 1)
}

/// Rounds an `f64` to the nearest `bf16`, ties to even, in one rounding.
pub fn f64_to_bf16_rne(x: f64) -> bf16 {
    bf16::from_f32(f64_to_f32_round_to_odd(x))
}

/// Rounds an `f64` to the nearest `f16`, ties to even, in one rounding.
pub fn f64_to_f16_rne(x: f64) -> f16 {
    f16::from_f32(f64_to_f32_round_to_odd(x))
}

/// fp32 -> bf16, round to nearest even (8-bit exponent kept, mantissa 23 -> 7 bits).
pub fn cast_f32_to_bf16(src: &[f32], dst: &mut [bf16]) -> Result<(), KernelError> {
    check_len("dst", src.len(), dst.len())?;
    dst.convert_from_f32_slice(src);
    Ok(())
}

/// bf16 -> fp32, exact.
pub fn cast_bf16_to_f32(src: &[bf16], dst: &mut [f32]) -> Result<(), KernelError> {
    check_len("dst", src.len(), dst.len())?;
    src.convert_to_f32_slice(dst);
    Ok(())
}

/// fp32 -> f16, round to nearest even; magnitudes of 65520 and above become infinity, small
/// values become f16 subnormals or zero.
pub fn cast_f32_to_f16(src: &[f32], dst: &mut [f16]) -> Result<(), KernelError> {
    check_len("dst", src.len(), dst.len())?;
    dst.convert_from_f32_slice(src);
    Ok(())
}

/// f16 -> fp32, exact.
pub fn cast_f16_to_f32(src: &[f16], dst: &mut [f32]) -> Result<(), KernelError> {
    check_len("dst", src.len(), dst.len())?;
    src.convert_to_f32_slice(dst);
    Ok(())
}

/// f64 -> fp32, round to nearest even (Rust's `as`).
pub fn cast_f64_to_f32(src: &[f64], dst: &mut [f32]) -> Result<(), KernelError> {
    check_len("dst", src.len(), dst.len())?;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s as f32;
    }
    Ok(())
}

/// fp32 -> f64, exact.
pub fn cast_f32_to_f64(src: &[f32], dst: &mut [f64]) -> Result<(), KernelError> {
    check_len("dst", src.len(), dst.len())?;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s as f64;
    }
    Ok(())
}

/// f64 -> bf16, round to nearest even, one rounding (see the module notes).
pub fn cast_f64_to_bf16(src: &[f64], dst: &mut [bf16]) -> Result<(), KernelError> {
    check_len("dst", src.len(), dst.len())?;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f64_to_bf16_rne(s);
    }
    Ok(())
}

/// f64 -> f16, round to nearest even, one rounding (see the module notes).
pub fn cast_f64_to_f16(src: &[f64], dst: &mut [f16]) -> Result<(), KernelError> {
    check_len("dst", src.len(), dst.len())?;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f64_to_f16_rne(s);
    }
    Ok(())
}

/// bf16 -> f64, exact.
pub fn cast_bf16_to_f64(src: &[bf16], dst: &mut [f64]) -> Result<(), KernelError> {
    check_len("dst", src.len(), dst.len())?;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s.to_f64();
    }
    Ok(())
}

/// f16 -> f64, exact.
pub fn cast_f16_to_f64(src: &[f16], dst: &mut [f64]) -> Result<(), KernelError> {
    check_len("dst", src.len(), dst.len())?;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s.to_f64();
    }
    Ok(())
}

/// bf16 -> f16, round to nearest even in one rounding (bf16 is exact in fp32, which is then
/// rounded once). Values beyond f16's range become infinity.
pub fn cast_bf16_to_f16(src: &[bf16], dst: &mut [f16]) -> Result<(), KernelError> {
    check_len("dst", src.len(), dst.len())?;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f16::from_f32(s.to_f32());
    }
    Ok(())
}

/// f16 -> bf16, round to nearest even in one rounding (f16 is exact in fp32).
pub fn cast_f16_to_bf16(src: &[f16], dst: &mut [bf16]) -> Result<(), KernelError> {
    check_len("dst", src.len(), dst.len())?;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16::from_f32(s.to_f32());
    }
    Ok(())
}

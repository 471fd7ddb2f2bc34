//! A natural logarithm that gives the same bits on every platform.

/// Natural logarithm of a positive, finite, normal `x` using only IEEE-754 correctly rounded
/// operations (+, -, *, /), so it gives the same bits on every platform (unlike a platform
/// `libm`). Method: `x = m * 2^e` with `m` in `[sqrt(1/2), sqrt(2))`, then `ln m = 2 atanh(s)`,
/// `s = (m - 1)/(m + 1)`, summed as the odd power series `2 (s + s^3/3 + s^5/5 + ...)` to 14
/// terms (`|s| < 0.172`, truncation error below 1e-17). Accuracy: within a few ulp of `ln`.
pub fn det_ln(x: f64) -> f64 {
    debug_assert!(x.is_finite() && x > 0.0 && x.is_normal());
    let bits = x.to_bits();
    let mut e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mut m = f64::from_bits((bits & 0x000f_ffff_ffff_ffff) | 0x3ff0_0000_0000_0000);
    if m > std::f64::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let mut term = s;
    let mut sum = 0.0;
    for k in 0..14 {
        sum += term / (2 * k + 1) as f64;
        term *= s2;
    }
    2.0 * sum + e as f64 * std::f64::consts::LN_2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn det_ln_matches_std_ln() {
        for &x in &[
            1e-300, 1e-10, 0.001, 0.3, 0.5, 0.7, 0.99999, 1.0, 1.5, 2.0, 1e10,
        ] {
            let (a, b) = (det_ln(x), x.ln());
            assert!(
                (a - b).abs() <= 4.0 * f64::EPSILON * b.abs().max(1.0),
                "{x}: {a} vs {b}"
            );
        }
    }
}

//! Casts (round to nearest even), reductions (sum of squares, max-abs), element-wise kernels and
//! FlatBuffer.

use fsdp_kernels::cast::*;
use fsdp_kernels::{
    accumulate, axpy, bf16, copy, div_scalar, f16, max_abs, scale, sum_squares, zero, FlatBuffer,
    KernelError, Span,
};
use fsdp_types::{Bytes, DType, Numel};
use proptest::prelude::*;

fn bf16_bits(x: f32) -> u16 {
    let mut d = [bf16::ZERO];
    cast_f32_to_bf16(&[x], &mut d).unwrap();
    d[0].to_bits()
}

fn f16_bits(x: f32) -> u16 {
    let mut d = [f16::ZERO];
    cast_f32_to_f16(&[x], &mut d).unwrap();
    d[0].to_bits()
}

/// Ties go to the even neighbour; just above a tie goes up.
#[test]
fn cast_f32_to_bf16_round_to_nearest_even_cases() {
    // 1.0 = 0x3F80_0000. bf16 ulp at 1.0 is 2^-7; a tie sits at bit 15 of the f32.
    assert_eq!(
        bf16_bits(f32::from_bits(0x3F80_8000)),
        0x3F80,
        "tie, even below"
    );
    assert_eq!(
        bf16_bits(f32::from_bits(0x3F81_8000)),
        0x3F82,
        "tie, odd below -> up"
    );
    assert_eq!(
        bf16_bits(f32::from_bits(0x3F80_8001)),
        0x3F81,
        "above tie -> up"
    );
    assert_eq!(
        bf16_bits(f32::from_bits(0x3F80_7FFF)),
        0x3F80,
        "below tie -> down"
    );
    assert_eq!(bf16_bits(-1.0), 0xBF80);
    assert_eq!(bf16_bits(f32::MAX), 0x7F80, "f32::MAX rounds to +inf");
    assert_eq!(bf16_bits(f32::INFINITY), 0x7F80);
    assert!(bf16::from_bits(bf16_bits(f32::NAN)).is_nan());
    assert_eq!(bf16_bits(-0.0), 0x8000, "sign of zero kept");
}

#[test]
fn cast_f32_to_f16_round_to_nearest_even_cases() {
    // f16 ulp at 1.0 is 2^-10; 1 + 2^-11 is a tie.
    assert_eq!(f16_bits(1.0 + 2f32.powi(-11)), 0x3C00, "tie, even below");
    assert_eq!(
        f16_bits(1.0 + 3.0 * 2f32.powi(-11)),
        0x3C02,
        "tie, odd below -> up"
    );
    assert_eq!(f16_bits(65504.0), 0x7BFF, "f16 max");
    assert_eq!(f16_bits(65519.0), 0x7BFF, "below overflow threshold");
    assert_eq!(f16_bits(65520.0), 0x7C00, "overflow threshold ties to inf");
    assert_eq!(f16_bits(2f32.powi(-24)), 0x0001, "smallest subnormal");
    assert_eq!(
        f16_bits(2f32.powi(-25)),
        0x0000,
        "half the smallest subnormal ties to 0"
    );
    assert_eq!(
        f16_bits(1.5 * 2f32.powi(-24)),
        0x0002,
        "1.5 subnormal ulps ties to 2"
    );
}

/// Round trips: every bf16 and every finite f16 bit pattern survives half -> f32 -> half and
/// half -> f64 -> half exactly.
#[test]
fn cast_round_trips_all_half_values() {
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let b: Vec<bf16> = all.iter().map(|&x| bf16::from_bits(x)).collect();
    let h: Vec<f16> = all.iter().map(|&x| f16::from_bits(x)).collect();
    let mut f = vec![0f32; all.len()];
    let mut d = vec![0f64; all.len()];
    let mut b2 = vec![bf16::ZERO; all.len()];
    let mut h2 = vec![f16::ZERO; all.len()];
    cast_bf16_to_f32(&b, &mut f).unwrap();
    cast_f32_to_bf16(&f, &mut b2).unwrap();
    cast_bf16_to_f64(&b, &mut d).unwrap();
    let mut b3 = vec![bf16::ZERO; all.len()];
    cast_f64_to_bf16(&d, &mut b3).unwrap();
    for i in 0..all.len() {
        if b[i].is_nan() {
            assert!(b2[i].is_nan() && b3[i].is_nan());
        } else {
            assert_eq!(
                b2[i].to_bits(),
                b[i].to_bits(),
                "bf16 {:#06x} via f32",
                all[i]
            );
            assert_eq!(
                b3[i].to_bits(),
                b[i].to_bits(),
                "bf16 {:#06x} via f64",
                all[i]
            );
        }
    }
    cast_f16_to_f32(&h, &mut f).unwrap();
    cast_f32_to_f16(&f, &mut h2).unwrap();
    cast_f16_to_f64(&h, &mut d).unwrap();
    let mut h3 = vec![f16::ZERO; all.len()];
    cast_f64_to_f16(&d, &mut h3).unwrap();
    for i in 0..all.len() {
        if h[i].is_nan() {
            assert!(h2[i].is_nan() && h3[i].is_nan());
        } else {
            assert_eq!(
                h2[i].to_bits(),
                h[i].to_bits(),
                "f16 {:#06x} via f32",
                all[i]
            );
            assert_eq!(
                h3[i].to_bits(),
                h[i].to_bits(),
                "f16 {:#06x} via f64",
                all[i]
            );
        }
    }
}

/// f64 -> bf16 rounds once: a value just above a bf16 tie (by less than an f32 ulp) must round
/// up, where rounding to f32 first would land on the tie and round to even (down).
#[test]
fn cast_f64_to_half_rounds_once() {
    let tie = 1.0 + 2f64.powi(-8); // halfway between bf16 1.0 and 1.0 + 2^-7
    let x = tie + 2f64.powi(-40);
    assert_eq!(
        (x as f32) as f64,
        tie,
        "f32 rounding alone would create the tie"
    );
    assert_eq!(f64_to_bf16_rne(x).to_bits(), 0x3F81);
    assert_eq!(f64_to_bf16_rne(tie).to_bits(), 0x3F80);
    assert_eq!(f64_to_bf16_rne(tie - 2f64.powi(-40)).to_bits(), 0x3F80);
    let tie16 = 1.0 + 2f64.powi(-11);
    assert_eq!(f64_to_f16_rne(tie16 + 2f64.powi(-40)).to_bits(), 0x3C01);
    assert_eq!(f64_to_f16_rne(tie16).to_bits(), 0x3C00);
    assert_eq!(f64_to_bf16_rne(1e300).to_bits(), 0x7F80);
    assert_eq!(f64_to_bf16_rne(-1e300).to_bits(), 0xFF80);
    assert_eq!(f64_to_f16_rne(1e-300).to_bits(), 0x0000);
    assert!(f64_to_bf16_rne(f64::NAN).is_nan());
    assert_eq!(f64_to_f32_round_to_odd(1.0), 1.0);
    assert_eq!(
        f64_to_f32_round_to_odd(1.0 + 2f64.powi(-30)).to_bits(),
        0x3F80_0001
    );
}

/// Correct rounding reference for positive `x`: the nearer of the two neighbours among the
/// values `to_f64(bits)`, ties to the even bit pattern.
fn nearest(x: f64, start: u16, to_f64: impl Fn(u16) -> f64) -> u16 {
    let mut a = start;
    while to_f64(a) > x {
        a -= 1;
    }
    while to_f64(a + 1) <= x {
        a += 1;
    }
    let (da, db) = (x - to_f64(a), to_f64(a + 1) - x);
    if da < db || (da == db && (a & 1) == 0) {
        a
    } else {
        a + 1
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn cast_f64_to_bf16_is_correctly_rounded(mant in 1u64..(1u64 << 52), exp in -100i32..100) {
        let x = f64::from_bits(((1023 + exp) as u64) << 52 | mant);
        let start = bf16::from_f32(x as f32).to_bits();
        let expect = nearest(x, start, |b| bf16::from_bits(b).to_f64());
        prop_assert_eq!(f64_to_bf16_rne(x).to_bits(), expect, "x = {:e}", x);
    }

    #[test]
    fn cast_f64_to_f16_is_correctly_rounded(mant in 1u64..(1u64 << 52), exp in -24i32..15) {
        // Normal and subnormal f16 range, below the overflow threshold.
        let x = f64::from_bits(((1023 + exp) as u64) << 52 | mant);
        prop_assume!(x <= 65504.0); // above: overflow cases, tested by value above
        let start = f16::from_f32(x as f32).to_bits().max(1);
        let expect = nearest(x, start, |b| f16::from_bits(b).to_f64());
        prop_assert_eq!(f64_to_f16_rne(x).to_bits(), expect, "x = {:e}", x);
    }

    /// sum_squares is a fixed sequential f64 sum: equal to a plain loop, bit for bit, and the
    /// same when the same elements are given as one span or split into several.
    #[test]
    fn sum_squares_is_sequential_f64(xs in proptest::collection::vec(-1e3f32..1e3, 0..200), cut in 0usize..200) {
        let n = xs.len();
        let cut = cut.min(n);
        let mut seq = 0.0f64;
        for &x in &xs { seq += (x as f64) * (x as f64); }
        let one = sum_squares(&xs, &[Span::new(0, n, false)]).unwrap();
        let two = sum_squares(&xs, &[Span::new(0, cut, false), Span::new(cut, n - cut, true)]).unwrap();
        prop_assert_eq!(one.to_bits(), seq.to_bits());
        prop_assert_eq!(two.to_bits(), seq.to_bits());
    }
}

/// Padding never enters a norm (<https://github.com/deepspeedai/DeepSpeed/pull/1380>):
/// 46 real gradient elements of 1.0, padding excluded: sqrt(sum) = 6.7823300 in fp32.
#[test]
fn sum_squares_of_46_real_elements_excludes_padding() {
    let mut g = vec![1.0f32; 50];
    g[46..].fill(7.0); // padding that must not be read
    let spans = [
        Span::new(0, 21, true),
        Span::new(21, 5, true),
        Span::new(26, 17, false),
        Span::new(43, 3, true),
    ];
    let s = sum_squares(&g, &spans).unwrap();
    assert_eq!(s, 46.0);
    assert_eq!(s.sqrt() as f32, 6.78233f32);
    assert_eq!(max_abs(&g, &spans).unwrap(), 1.0);
}

/// The order is fixed: summing the same values in another order can give other bits, and the
/// kernel follows the span order it is given.
#[test]
fn sum_squares_order_is_the_span_order() {
    // 1e8^2 = 1e16; adding 1.0 to 1e16 in f64 is lost (ulp 2), but 1+1 first then 1e16 keeps 2.
    let x = [1.0f32, 1.0, 1e8];
    let forward = sum_squares(&x, &[Span::new(0, 3, false)]).unwrap();
    assert_eq!(forward, 1e16 + 2.0);
    let mut seq = 0.0f64;
    for v in [1e16f64, 1.0, 1.0] {
        seq += v;
    }
    assert_eq!(seq, 1e16, "big-first order loses the ones");
    assert_ne!(forward, seq);
    // Repeated calls: identical bits.
    let xs: Vec<f32> = (0..10_000)
        .map(|i| (i as f32 * 0.618).sin() * 1e3)
        .collect();
    let spans = [Span::new(0, 5_000, true), Span::new(5_000, 5_000, false)];
    let a = sum_squares(&xs, &spans).unwrap();
    let b = sum_squares(&xs, &spans).unwrap();
    assert_eq!(a.to_bits(), b.to_bits());
}

#[test]
fn max_abs_propagates_nan_and_ignores_padding() {
    let x = [0.5f32, -3.0, 2.0, f32::NAN, -9.0];
    assert_eq!(max_abs(&x, &[Span::new(0, 3, false)]).unwrap(), 3.0);
    assert!(max_abs(&x, &[Span::new(0, 4, false)]).unwrap().is_nan());
    assert_eq!(
        max_abs(&x, &[Span::new(0, 3, false), Span::new(4, 1, false)]).unwrap(),
        9.0
    );
    assert_eq!(max_abs(&x, &[]).unwrap(), 0.0);
    assert_eq!(
        max_abs(&[f32::NEG_INFINITY], &[Span::new(0, 1, true)]).unwrap(),
        f32::INFINITY
    );
    assert_eq!(
        sum_squares(&x, &[Span::new(3, 3, false)]),
        Err(KernelError::SpanOutOfBounds {
            index: 0,
            start: 3,
            len: 3,
            buffer_len: 5
        })
    );
}

#[test]
fn elementwise_kernels_exact_values() {
    let mut x = vec![1.0f32, -2.0, 0.0, 3.5];
    scale(&mut x, 0.5);
    assert_eq!(x, vec![0.5, -1.0, 0.0, 1.75]);
    div_scalar(&mut x, 4.0);
    assert_eq!(x, vec![0.125, -0.25, 0.0, 0.4375]);
    // Division rounds once: 5/3 = 1.6666666, while 5 * (1/3 rounded) = 1.6666667.
    let mut y = vec![5.0f32];
    div_scalar(&mut y, 3.0);
    assert_eq!(y[0], 1.6666666f32);
    assert_ne!(y[0], 5.0f32 * (1.0f32 / 3.0));
    accumulate(&mut x, &[1.0, 1.0, 1.0, 1.0]).unwrap();
    assert_eq!(x, vec![1.125, 0.75, 1.0, 1.4375]);
    axpy(&mut x, -2.0, &[0.5, 0.25, 0.5, 0.0]).unwrap();
    assert_eq!(x, vec![0.125, 0.25, 0.0, 1.4375]);
    assert_eq!(
        accumulate(&mut x, &[1.0]),
        Err(KernelError::LengthMismatch {
            what: "src",
            expected: 4,
            actual: 1
        })
    );
    assert_eq!(
        x,
        vec![0.125, 0.25, 0.0, 1.4375],
        "nothing written on error"
    );
    let mut c = vec![0.0f32; 4];
    copy(&mut c, &x).unwrap();
    assert_eq!(c, x);
    zero(&mut c);
    assert!(c.iter().all(|v| v.to_bits() == 0));
    assert!(axpy(&mut c, 1.0, &[1.0; 3]).is_err());
}

#[test]
fn flat_buffer_dtype_len_bytes_and_casts() {
    for (dt, size) in [
        (DType::F32, 4),
        (DType::BF16, 2),
        (DType::F16, 2),
        (DType::F64, 8),
    ] {
        let b = FlatBuffer::zeros(dt, 10);
        assert_eq!(b.dtype(), dt);
        assert_eq!(b.len(), 10);
        assert_eq!(b.numel(), Numel(10));
        assert_eq!(b.size_bytes(), Bytes(10 * size));
        assert_eq!(b.as_bytes().len(), 10 * size as usize);
        assert!(b.as_bytes().iter().all(|&x| x == 0));
    }
    // 1 + 2^-8 is halfway between bf16 1.0 and its successor: ties to even (1.0).
    const TIE: f32 = 1.0 + 1.0 / 256.0;
    let src = FlatBuffer::F32(vec![1.0, TIE, -2.5, 65520.0]);
    let b = src.cast(DType::BF16);
    assert_eq!(
        b.as_bf16()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect::<Vec<_>>(),
        vec![0x3F80, 0x3F80, 0xC020, 0x4780]
    );
    let h = src.cast(DType::F16);
    assert_eq!(
        h.as_f16().unwrap()[3].to_bits(),
        0x7C00,
        "65520 overflows f16"
    );
    assert_eq!(h.cast(DType::F32).as_f32().unwrap()[..3], [1.0, TIE, -2.5]);
    assert_eq!(src.cast(DType::F64).cast(DType::F32), src);
    assert_eq!(src.cast(DType::F32), src);
    assert_eq!(
        src.as_bf16().unwrap_err(),
        KernelError::DTypeMismatch {
            what: "buffer",
            expected: DType::BF16,
            actual: DType::F32
        }
    );
    let mut small = FlatBuffer::zeros(DType::BF16, 3);
    assert_eq!(
        src.cast_into(&mut small),
        Err(KernelError::LengthMismatch {
            what: "dst",
            expected: 4,
            actual: 3
        })
    );
    // bytes round trip
    let back = FlatBuffer::from_bytes(DType::F32, src.as_bytes()).unwrap();
    assert_eq!(back, src);
    assert!(FlatBuffer::from_bytes(DType::F32, &[0u8; 6]).is_err());
    // accumulate a bf16 gradient into fp32
    let mut acc = vec![0.5f32; 4];
    b.accumulate_into_f32(&mut acc).unwrap();
    assert_eq!(acc, vec![1.5, 1.5, -2.0, 65536.5]);
    let mut f = vec![0.0f32; 4];
    b.copy_to_f32(&mut f).unwrap();
    assert_eq!(f, vec![1.0, 1.0, -2.5, 65536.0]);
    let mut p = FlatBuffer::zeros(DType::F16, 4);
    p.copy_from_f32(&[0.1, 0.2, 0.3, 0.4]).unwrap();
    assert_eq!(p.as_f16().unwrap()[0], f16::from_f32(0.1));
    p.fill_zero();
    assert!(p.as_f16().unwrap().iter().all(|x| x.to_bits() == 0));
}

/// `first_nonfinite*` find the first infinite or NaN element in every dtype, in any block of
/// the scan (first, middle, last, a block boundary), and nothing in finite buffers that hold
/// the largest finite values and subnormals.
#[test]
fn first_nonfinite_finds_the_first_inf_or_nan_in_each_dtype() {
    use fsdp_kernels::{first_nonfinite, first_nonfinite_bf16, first_nonfinite_f16};
    let n = 3000;
    let mut x = vec![0.5f32; n];
    x[7] = f32::MAX;
    x[8] = -f32::MAX;
    x[9] = f32::from_bits(1); // smallest subnormal
    assert_eq!(first_nonfinite(&x), None);
    assert_eq!(first_nonfinite(&[]), None);
    for (at, bad) in [
        (0, f32::INFINITY),
        (1023, f32::NEG_INFINITY),
        (1024, f32::NAN),
        (2999, -f32::NAN),
    ] {
        let mut y = x.clone();
        y[at] = bad;
        if at + 5 < n {
            y[at + 5] = f32::NAN;
        }
        assert_eq!(first_nonfinite(&y), Some(at), "{bad} at {at}");
        // f32::MAX rounds up to infinity in bf16: use the largest values bf16 holds.
        let b: Vec<bf16> = y
            .iter()
            .map(|&v| {
                if v.is_finite() {
                    bf16::from_f32(v.clamp(-3.0e38, 3.0e38))
                } else {
                    bf16::from_f32(v)
                }
            })
            .collect();
        assert_eq!(first_nonfinite_bf16(&b), Some(at), "bf16 {bad} at {at}");
        // f32::MAX is infinite in f16: use values f16 holds.
        let h: Vec<f16> = y
            .iter()
            .map(|&v| {
                if v.is_finite() {
                    f16::from_f32(v.clamp(-65504.0, 65504.0))
                } else {
                    f16::from_f32(v)
                }
            })
            .collect();
        assert_eq!(first_nonfinite_f16(&h), Some(at), "f16 {bad} at {at}");
    }
    let b: Vec<bf16> = x
        .iter()
        .map(|&v| bf16::from_f32(v.clamp(-3.0e38, 3.0e38)))
        .collect();
    assert_eq!(first_nonfinite_bf16(&b), None);
    let h = vec![f16::MAX, f16::MIN, f16::from_bits(1)];
    assert_eq!(first_nonfinite_f16(&h), None);
}

//! The shared vectorised building blocks of the row kernels: the polynomial exponentials
//! ([`exp_f32`], [`exp_f64`]), fixed-lane reductions, and `simd_kernel!`, which compiles a row
//! kernel for AVX-512, AVX2 and the baseline and picks the widest the CPU has at run time.

use super::elem::Flt;

/// `e^x` in f32 from IEEE-754 operations only (so the compiler vectorises it and it is the same
/// on every platform): `x = n ln 2 + r` with `n = round(x / ln 2)` (the 1.5 * 2^23 trick),
/// `|r| <= ln 2 / 2` (Cody-Waite split of ln 2), `e^r` by Cephes `expf`'s degree-7 minimax
/// polynomial (Moshier 1992), times `2^n` built in the exponent bits. Inputs are clamped to
/// `[-87, 88]`: results below `e^-87 = 1.6e-38` are returned as that (absolute error below
/// `1.7e-38`), `+inf` and overflow give `e^88 = 1.65e38`; NaN stays NaN. Relative error
/// within `[-87, 88]`: below `2^-22` (2 ulp; tested against f64 in model_gpt.rs and
/// model_ops_accuracy.rs).
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    // `clamp` keeps NaN as NaN.
    let x = x.clamp(-87.0, 88.0);
    // 1.5 * 2^23: v's low mantissa bits hold n = round(x / ln 2) exactly (v is in
    // [2^23, 2^24)).
    const MAGIC: f32 = 12_582_912.0;
    let v = x * std::f32::consts::LOG2_E + MAGIC;
    let n = v - MAGIC;
    let ni = (v.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let p = 1.987_569_1e-4_f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let y = p * (r * r) + r + 1.0;
    let scale = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    y * scale
}

/// `e^x` in f64 from IEEE-754 operations only (vectorisable, the same on every platform):
/// `x = n ln 2 + r`, `n = round(x / ln 2)` (the 1.5 * 2^52 trick), `|r| <= ln 2 / 2` (Cody-Waite
/// split of ln 2, fdlibm's constants), `e^r` by its Taylor polynomial to degree 13
/// (truncation below `5e-18` relative), times `2^n` built in the exponent bits. Inputs are
/// clamped to `[-708, 709]`: results below `e^-708 = 3.3e-308` are returned as that, `+inf`
/// and overflow give `e^709 = 8.2e307`; NaN stays NaN. Relative error within the range: a
/// few ulp of f64 (below `2^-50`; tested against `f64::exp` in model_ops_accuracy.rs). Used
/// by the cross-entropy, whose log-sum-exp is accumulated in f64.
#[inline(always)]
pub fn exp_f64(x: f64) -> f64 {
    let x = x.clamp(-708.0, 709.0);
    const MAGIC: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52
    let v = x * std::f64::consts::LOG2_E + MAGIC;
    let n = v - MAGIC;
    let ni = (v.to_bits() as i64).wrapping_sub(MAGIC.to_bits() as i64);
    // fdlibm's ln 2 split: LN2_HI ends in 21 zero bits, so `n * LN2_HI` is exact (`|n| <= 1075`).
    const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
    const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
    let r = x - n * LN2_HI - n * LN2_LO;
    // 1/k! for k = 13 down to 2.
    let mut p = 1.0 / 6_227_020_800.0;
    for c in [
        1.0 / 479_001_600.0,
        1.0 / 39_916_800.0,
        1.0 / 3_628_800.0,
        1.0 / 362_880.0,
        1.0 / 40_320.0,
        1.0 / 5_040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
    ] {
        p = p * r + c;
    }
    let y = p * (r * r) + r + 1.0;
    let scale = f64::from_bits((ni.wrapping_add(1023) as u64) << 52);
    y * scale
}

/// Sum of `xs` with 8 independent accumulators (vectorisable, fixed order: deterministic, and
/// the same bits for every vector width).
#[inline(always)]
pub(super) fn lane_sum<T: Flt>(xs: &[T]) -> T {
    let mut acc = [T::zero(); 8];
    let chunks = xs.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] = acc[l].add(c[l]);
        }
    }
    let mut t = T::zero();
    for &v in tail {
        t = t.add(v);
    }
    let a = acc[0].add(acc[4]).add(acc[1].add(acc[5]));
    let b = acc[2].add(acc[6]).add(acc[3].add(acc[7]));
    a.add(b).add(t)
}

/// `sum_j a_j b_j` with 8 independent accumulators (see [`lane_sum`]).
#[inline(always)]
pub(super) fn lane_dot<T: Flt>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::zero(); 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] = acc[l].add(x[l].mul(y[l]));
        }
    }
    let mut t = T::zero();
    for (x, y) in ta.iter().zip(tb) {
        t = t.add(x.mul(*y));
    }
    let s = acc[0].add(acc[4]).add(acc[1].add(acc[5]));
    let u = acc[2].add(acc[6]).add(acc[3].add(acc[7]));
    s.add(u).add(t)
}

/// The largest (`MAX`) or smallest element of `xs` ignoring NaNs (`-inf` / `+inf` for an
/// empty or all-NaN slice), with 8 independent accumulators (vectorisable; `max` and `min` are
/// exact, so the order does not matter).
#[inline(always)]
pub(super) fn lane_extreme<T: Flt, const MAX: bool>(xs: &[T]) -> T {
    let pick = |a: T, b: T| if MAX { a.max(b) } else { a.min(b) };
    let init = if MAX {
        f64::NEG_INFINITY
    } else {
        f64::INFINITY
    };
    let mut acc = [T::of(init); 8];
    let chunks = xs.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] = pick(acc[l], c[l]);
        }
    }
    let mut m = acc[0];
    for &v in acc[1..].iter().chain(tail) {
        m = pick(m, v);
    }
    m
}

/// Defines `fn $name<T: Flt>(args)` that runs `$imp::<T>(args)` (an `#[inline(always)]`
/// kernel) compiled for AVX-512 or AVX2 when the CPU has it, else for the baseline target, and
/// a module `$name` holding the per-ISA builds (`v4`, `v3`; tests compare their bits).
/// Only IEEE operations appear in the kernels and Rust never contracts `a * b + c` into a fused
/// multiply-add, so every build returns the same bits.
macro_rules! simd_kernel {
    ($(#[$attr:meta])* $vis:vis fn $name:ident = $imp:ident ( $($arg:ident : $ty:ty),* $(,)? ) $(-> $ret:ty)?) => {
        #[allow(dead_code)]
        mod $name {
            use super::*;
            /// The kernel built for AVX-512 (F, VL, DQ, BW). Safety: the CPU must have them.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx512bw")]
            pub(super) unsafe fn v4<T: Flt>($($arg: $ty),*) $(-> $ret)? {
                $imp::<T>($($arg),*)
            }
            /// The kernel built for AVX2. Safety: the CPU must have AVX2.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            pub(super) unsafe fn v3<T: Flt>($($arg: $ty),*) $(-> $ret)? {
                $imp::<T>($($arg),*)
            }
        }
        $(#[$attr])*
        #[inline]
        $vis fn $name<T: Flt>($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512dq")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                {
                    // SAFETY: the CPU has the features `v4` is built for (checked above).
                    return unsafe { $name::v4::<T>($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2 (checked above).
                    return unsafe { $name::v3::<T>($($arg),*) };
                }
            }
            $imp::<T>($($arg),*)
        }
    };
}
pub(super) use simd_kernel;

simd_kernel!(
    /// `acc[j] += row[j]`.
    pub(super) fn add_into = add_into_impl(acc: &mut [T], row: &[T])
);
#[inline(always)]
fn add_into_impl<T: Flt>(acc: &mut [T], row: &[T]) {
    for (a, &v) in acc.iter_mut().zip(row) {
        *a = a.add(v);
    }
}

simd_kernel!(
    /// `y[j] = x[j] + b[j]`.
    pub(super) fn bias_add_row = bias_add_row_impl(x: &[T], b: &[T], y: &mut [T])
);
#[inline(always)]
fn bias_add_row_impl<T: Flt>(x: &[T], b: &[T], y: &mut [T]) {
    for ((o, &xv), &bv) in y.iter_mut().zip(x).zip(b) {
        *o = xv.add(bv);
    }
}

/// The per-ISA check of the row kernels: every kernel's AVX-512 and AVX2 builds give the bits
/// of its baseline build (on a CPU that has them; the baseline always runs), on lengths with
/// vector tails and on special values (infinities, NaN, zeros, the clamp edges).
#[cfg(all(test, target_arch = "x86_64"))]
pub(super) mod isa {
    /// `n` values `scale * U(-1, 1)` (a fixed LCG).
    pub(in super::super) fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                scale * ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The inputs of one row length `n`.
    pub(in super::super) struct Inputs {
        /// Row length.
        pub n: usize,
        /// How many special values lead `x`.
        pub k: usize,
        /// `14 U(-1, 1)` led by the special values.
        pub x: Vec<f32>,
        /// `U(-1, 1)`.
        pub b: Vec<f32>,
        /// `U(-1, 1)`.
        pub g: Vec<f32>,
        /// `U(-1, 1)`.
        pub w: Vec<f32>,
        /// `|0.5 U(-1, 1)|`.
        pub y: Vec<f32>,
        /// `40 U(-1, 1)`: finite softmax scores.
        pub s: Vec<f32>,
        /// `3 U(-1, 1)`.
        pub xf: Vec<f32>,
    }

    /// The inputs for each tested row length (1, 7, 16, 61, 1003).
    pub(in super::super) fn inputs() -> Vec<Inputs> {
        [1usize, 7, 16, 61, 1003]
            .into_iter()
            .map(|n| {
                let mut x = data(n, 1, 14.0);
                let special = [
                    f32::INFINITY,
                    f32::NEG_INFINITY,
                    f32::NAN,
                    0.0,
                    -0.0,
                    10.0,
                    -10.0,
                    1e30,
                    -1e30,
                    88.5,
                ];
                let k = special.len().min(n);
                x[..k].copy_from_slice(&special[..k]);
                Inputs {
                    n,
                    k,
                    x,
                    b: data(n, 2, 1.0),
                    g: data(n, 3, 1.0),
                    w: data(n, 4, 1.0),
                    y: data(n, 5, 0.5).iter().map(|v| v.abs()).collect(),
                    s: data(n, 6, 40.0),
                    xf: data(n, 7, 3.0),
                }
            })
            .collect()
    }

    /// Runs `f(level)` for the baseline (0) and, where the CPU has them, AVX2 (3) and AVX-512
    /// (4), and asserts the same bits.
    pub(in super::super) fn check(name: &str, f: &dyn Fn(u8) -> Vec<f32>) {
        let has4 = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512bw");
        let has3 = std::arch::is_x86_feature_detected!("avx2");
        let base = bits(&f(0));
        if has3 {
            assert_eq!(bits(&f(3)), base, "{name}: AVX2 build differs");
        }
        if has4 {
            assert_eq!(bits(&f(4)), base, "{name}: AVX-512 build differs");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bias-add and accumulate kernels' ISA builds give the same bits.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn isa_builds_give_the_same_bits() {
        for isa::Inputs { n, x, b, g, w, .. } in isa::inputs() {
            isa::check("bias_add/add_into", &|l| {
                let (mut o, mut acc) = (vec![0.0; n], w.clone());
                match l {
                    0 => {
                        bias_add_row_impl(&x, &b, &mut o);
                        add_into_impl(&mut acc, &g);
                    }
                    // SAFETY: `check` runs level 3 / 4 only on CPUs with the features.
                    3 => unsafe {
                        bias_add_row::v3(&x, &b, &mut o);
                        add_into::v3(&mut acc, &g);
                    },
                    _ => unsafe {
                        bias_add_row::v4(&x, &b, &mut o);
                        add_into::v4(&mut acc, &g);
                    },
                }
                o.extend(acc);
                o
            });
        }
    }
}

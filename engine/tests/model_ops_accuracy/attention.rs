//! The fused causal attention (`ops::causal_attention`, engine/src/model/ops/attention.rs):
//! - f32 forward and the three parts of the qkv gradient within the bound its docs state,
//!   against an f64 evaluation of the same function on the same f32 inputs, on odd shapes
//!   (T not a multiple of the block, T = 1, one head, hd not a multiple of 16, B = 1) and on
//!   peaked softmax rows;
//! - the same bits in rayon pools of 1, 2 and 3 threads, and for a sequence alone (B = 1) as
//!   inside a batch (the bits of a (sequence, head) pair do not depend on the batch split),
//!   f32 and bf16;
//! - bf16: the forward is the f32 op on the widened input rounded once; the gradient within
//!   a bf16 rounding of the f32 gradient (its saved probabilities are rounded to bf16);
//! - the fused op against the composite path's attention (candle primitives) in f32.

use super::{bits, tensor, Lcg, U};
use candle_core::{DType, Device, Tensor, Var};
use fsdp::model::ops;

/// `(y [B*T, D], dqkv [B*T, 3D])` of the fused op for upstream gradient `g` `[B*T, D]`.
fn fused(qkv: &Tensor, g: &Tensor, b: usize, t: usize, h: usize) -> (Tensor, Tensor) {
    let v = Var::from_tensor(qkv).unwrap();
    let y = ops::causal_attention(v.as_tensor(), b, t, h).unwrap();
    let grads = ops::backward_seed(&y, g).unwrap().backward().unwrap();
    let dq = grads.get(v.as_tensor()).unwrap().clone();
    (y, dq)
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// f64 reference: values and magnitudes (the same formulas on absolute values, with the
/// propagated relative error of the probabilities) of `y` and `dqkv`.
struct Reference {
    y: Vec<f64>,
    my: Vec<f64>,
    dq: Vec<f64>,
    mdq: Vec<f64>,
}

// Indexed loops: the code follows the formulas' subscripts.
#[allow(clippy::needless_range_loop)]
fn reference(qkv: &[f64], g: &[f64], b: usize, t: usize, h: usize) -> Reference {
    let d = qkv.len() / (b * t * 3);
    let hd = d / h;
    let sc = 1.0 / (hd as f64).sqrt();
    let mut r = Reference {
        y: vec![0.0; b * t * d],
        my: vec![0.0; b * t * d],
        dq: vec![0.0; b * t * 3 * d],
        mdq: vec![0.0; b * t * 3 * d],
    };
    for bi in 0..b {
        for hi in 0..h {
            let at = |i: usize, part: usize, c: usize| {
                qkv[(bi * t + i) * 3 * d + part * d + hi * hd + c]
            };
            let gy = |i: usize, c: usize| g[(bi * t + i) * d + hi * hd + c];
            let yi = |i: usize, c: usize| (bi * t + i) * d + hi * hd + c;
            let oi =
                |i: usize, part: usize, c: usize| (bi * t + i) * 3 * d + part * d + hi * hd + c;
            // P, and E = sc sum |q||k| (score magnitude), its row max.
            let mut p = vec![vec![0.0; t]; t];
            let mut e = vec![vec![0.0; t]; t];
            let mut emax = vec![0.0f64; t];
            for i in 0..t {
                let mut s = vec![0.0; i + 1];
                for j in 0..=i {
                    let (mut v, mut m) = (0.0, 0.0);
                    for c in 0..hd {
                        v += at(i, 0, c) * at(j, 1, c);
                        m += (at(i, 0, c) * at(j, 1, c)).abs();
                    }
                    s[j] = sc * v;
                    e[i][j] = sc * m;
                    emax[i] = emax[i].max(e[i][j]);
                }
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|&v| (v - mx).exp()).sum();
                for j in 0..=i {
                    p[i][j] = (s[j] - mx).exp() / z;
                }
            }
            // Relative error amplification of P_ij: 1 + E_ij + max_k E_ik.
            let amp = |i: usize, j: usize| 1.0 + e[i][j] + emax[i];
            for i in 0..t {
                for c in 0..hd {
                    let (mut v, mut m) = (0.0, 0.0);
                    for j in 0..=i {
                        v += p[i][j] * at(j, 2, c);
                        m += p[i][j] * amp(i, j) * at(j, 2, c).abs();
                    }
                    r.y[yi(i, c)] = v;
                    r.my[yi(i, c)] = m;
                }
            }
            // Backward.
            let mut ds = vec![vec![0.0; t]; t];
            let mut dsm = vec![vec![0.0; t]; t];
            for i in 0..t {
                let mut dp = vec![0.0; i + 1];
                let mut dpm = vec![0.0; i + 1];
                for j in 0..=i {
                    for c in 0..hd {
                        dp[j] += gy(i, c) * at(j, 2, c);
                        dpm[j] += (gy(i, c) * at(j, 2, c)).abs();
                    }
                }
                let dot: f64 = (0..=i).map(|j| p[i][j] * dp[j]).sum();
                let dotm: f64 = (0..=i).map(|j| p[i][j] * dpm[j]).sum();
                for j in 0..=i {
                    ds[i][j] = sc * p[i][j] * (dp[j] - dot);
                    dsm[i][j] = sc * p[i][j] * amp(i, j) * (dpm[j] + dotm);
                }
            }
            for i in 0..t {
                for c in 0..hd {
                    let (mut dq, mut mq, mut dk, mut mk, mut dv, mut mv) =
                        (0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
                    for j in 0..=i {
                        dq += ds[i][j] * at(j, 1, c);
                        mq += dsm[i][j] * at(j, 1, c).abs();
                    }
                    for j in i..t {
                        dk += ds[j][i] * at(j, 0, c);
                        mk += dsm[j][i] * at(j, 0, c).abs();
                        dv += p[j][i] * gy(j, c);
                        mv += p[j][i] * amp(j, i) * gy(j, c).abs();
                    }
                    r.dq[oi(i, 0, c)] = dq;
                    r.mdq[oi(i, 0, c)] = mq;
                    r.dq[oi(i, 1, c)] = dk;
                    r.mdq[oi(i, 1, c)] = mk;
                    r.dq[oi(i, 2, c)] = dv;
                    r.mdq[oi(i, 2, c)] = mv;
                }
            }
        }
    }
    r
}

/// `(b, t, h, hd)`: odd T (below, at and past the 64-row block), T = 1, one head, hd not a
/// multiple of 16, B = 1.
const SHAPES: [(usize, usize, usize, usize); 6] = [
    (1, 1, 1, 8),
    (2, 37, 3, 12),
    (1, 64, 1, 10),
    (1, 130, 2, 64),
    (3, 67, 1, 8),
    (1, 200, 3, 20),
];

/// The stated bound: `(8 + hd + T) 2^-24 M + 1e-30` (docs of `ops::causal_attention`).
fn bound(hd: usize, t: usize, m: f64) -> f64 {
    (8 + hd + t) as f64 * U * m + 1e-30
}

#[test]
fn causal_attention_f32_within_stated_bound_of_f64() {
    let mut r = Lcg(29);
    let mut worst = [0.0f64; 4];
    for &(b, t, h, hd) in &SHAPES {
        // Unit-scale inputs, and large ones that make the softmax rows peaked.
        for scale in [1.0, 4.0] {
            let d = h * hd;
            let qkv = tensor(&mut r, &[b * t, 3 * d], scale, DType::F32);
            let g = tensor(&mut r, &[b * t, d], 1.0, DType::F32);
            let (y, dq) = fused(&qkv, &g, b, t, h);
            assert_eq!(y.dims(), &[b * t, d]);
            assert_eq!(dq.dims(), &[b * t, 3 * d]);
            let rf = reference(&f64s(&qkv), &f64s(&g), b, t, h);
            for (k, (got, want, mag)) in [(f64s(&y), &rf.y, &rf.my), (f64s(&dq), &rf.dq, &rf.mdq)]
                .into_iter()
                .enumerate()
            {
                for (idx, ((&a, &w), &m)) in got.iter().zip(want).zip(mag).enumerate() {
                    let err = (a - w).abs();
                    let part = if k == 0 { 0 } else { 1 + (idx % (3 * d)) / d };
                    assert!(
                        err <= bound(hd, t, m),
                        "b{b} t{t} h{h} hd{hd} scale {scale}: {} [{idx}] = {a}, f64 {w}, \
                         error {err:e} > bound {:e}",
                        ["y", "dq", "dk", "dv"][part],
                        bound(hd, t, m)
                    );
                    if m > 0.0 {
                        worst[part] = worst[part].max(err / (U * m));
                    }
                }
            }
        }
    }
    println!(
        "causal_attention f32 max error / (2^-24 M): y {:.2}, dq {:.2}, dk {:.2}, dv {:.2}",
        worst[0], worst[1], worst[2], worst[3]
    );
    // The checks are not vacuous: some error is seen.
    assert!(worst.iter().all(|&w| w > 0.0));
}

/// The same bits with 1, 2 and 3 threads, and each sequence alone (B = 1) equal to its rows
/// in the batch, in f32 and bf16.
#[test]
fn causal_attention_bits_independent_of_threads_and_batch_split() {
    for dt in [DType::F32, DType::BF16] {
        let mut r = Lcg(31);
        let (b, t, h, hd) = (3usize, 75usize, 4usize, 12usize);
        let d = h * hd;
        let qkv = tensor(&mut r, &[b * t, 3 * d], 1.5, dt);
        let g = tensor(&mut r, &[b * t, d], 1.0, dt);
        let runs: Vec<(Vec<u32>, Vec<u32>)> = [1usize, 2, 3]
            .iter()
            .map(|&threads| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap()
                    .install(|| {
                        let (y, dq) = fused(&qkv, &g, b, t, h);
                        (bits(&y), bits(&dq))
                    })
            })
            .collect();
        for (k, run) in runs.iter().enumerate().skip(1) {
            assert!(run == &runs[0], "{dt:?}: 1 vs {} threads differ", k + 1);
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for bi in 0..b {
            let q1 = qkv.narrow(0, bi * t, t).unwrap();
            let g1 = g.narrow(0, bi * t, t).unwrap();
            let (y1, d1) = pool.install(|| fused(&q1, &g1, 1, t, h));
            assert_eq!(
                bits(&y1),
                runs[0].0[bi * t * d..(bi + 1) * t * d],
                "{dt:?}: sequence {bi} alone: forward differs from its rows in the batch"
            );
            assert_eq!(
                bits(&d1),
                runs[0].1[bi * t * 3 * d..(bi + 1) * t * 3 * d],
                "{dt:?}: sequence {bi} alone: gradient differs from its rows in the batch"
            );
        }
    }
}

/// bf16: forward = round(f32 op on the widened input); gradient within a bf16 rounding of
/// the f32 gradient's magnitude (the saved probabilities are rounded to bf16).
#[test]
fn causal_attention_bf16_is_f32_rounded() {
    let mut r = Lcg(37);
    let (b, t, h, hd) = (2usize, 70usize, 2usize, 24usize);
    let d = h * hd;
    let qkv = tensor(&mut r, &[b * t, 3 * d], 1.0, DType::BF16);
    let g = tensor(&mut r, &[b * t, d], 1.0, DType::BF16);
    let (y16, d16) = fused(&qkv, &g, b, t, h);
    assert_eq!((y16.dtype(), d16.dtype()), (DType::BF16, DType::BF16));
    let (q32, g32) = (
        qkv.to_dtype(DType::F32).unwrap(),
        g.to_dtype(DType::F32).unwrap(),
    );
    let (y32, d32) = fused(&q32, &g32, b, t, h);
    assert_eq!(
        bits(&y16),
        bits(&y32.to_dtype(DType::BF16).unwrap()),
        "bf16 forward is not the f32 forward rounded once"
    );
    let rf = reference(&f64s(&q32), &f64s(&g32), b, t, h);
    let (a, w) = (f64s(&d16), f64s(&d32));
    for i in 0..a.len() {
        // One bf16 rounding of the result, and the bf16 rounding of P carried through.
        let tol = 2.0 * 2f64.powi(-8) * (w[i].abs() + rf.mdq[i]) + 1e-30;
        assert!(
            (a[i] - w[i]).abs() <= tol,
            "bf16 gradient [{i}] {} vs f32 {} (tol {tol:e})",
            a[i],
            w[i]
        );
    }
}

/// The fused op against the composite path's attention (candle primitives, as in
/// `Gpt::block_fwd` on the composite path), f32: forward and gradient agree to f32 rounding.
#[test]
fn causal_attention_matches_composite() {
    let mut r = Lcg(41);
    for &(b, t, h, hd) in &SHAPES {
        let d = h * hd;
        let qkv = tensor(&mut r, &[b * t, 3 * d], 1.0, DType::F32);
        let g = tensor(&mut r, &[b * t, d], 1.0, DType::F32);
        let (y, dq) = fused(&qkv, &g, b, t, h);
        let v = Var::from_tensor(&qkv).unwrap();
        let x = v
            .as_tensor()
            .reshape((b, t, 3, h, hd))
            .unwrap()
            .permute((2, 0, 3, 1, 4))
            .unwrap();
        let (q, k, vv) = (
            x.get(0).unwrap().contiguous().unwrap(),
            x.get(1).unwrap().contiguous().unwrap(),
            x.get(2).unwrap().contiguous().unwrap(),
        );
        let s = q.matmul(&k.t().unwrap()).unwrap();
        let att = fsdp::model::composite::causal_softmax(&s, 1.0 / (hd as f64).sqrt()).unwrap();
        let yc = att
            .matmul(&vv)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b * t, d))
            .unwrap();
        let gc = ops::backward_seed(&yc, &g).unwrap().backward().unwrap();
        let dqc = gc.get(v.as_tensor()).unwrap();
        let rf = reference(&f64s(&qkv), &f64s(&g), b, t, h);
        for (got, want, mag, what) in [
            (f64s(&y), f64s(&yc), &rf.my, "y"),
            (f64s(&dq), f64s(dqc), &rf.mdq, "dqkv"),
        ] {
            for i in 0..got.len() {
                let tol = 2.0 * bound(hd, t, mag[i]);
                assert!(
                    (got[i] - want[i]).abs() <= tol,
                    "b{b} t{t} h{h} hd{hd}: {what}[{i}] fused {} composite {} (tol {tol:e})",
                    got[i],
                    want[i]
                );
            }
        }
    }
}

/// Bad shapes are errors, not panics.
#[test]
fn causal_attention_rejects_bad_shapes() {
    let x = Tensor::zeros((6, 9), DType::F32, &Device::Cpu).unwrap();
    assert!(ops::causal_attention(&x, 2, 4, 1).is_err()); // B*T != rows
    assert!(ops::causal_attention(&x, 2, 3, 2).is_err()); // D = 3 not a multiple of 2
    assert!(ops::causal_attention(&x, 0, 3, 1).is_err());
    let y = Tensor::zeros((6, 8), DType::F32, &Device::Cpu).unwrap();
    assert!(ops::causal_attention(&y, 2, 3, 1).is_err()); // 8 not a multiple of 3
    assert!(ops::causal_attention(&x, 2, 3, 3).is_ok());
}

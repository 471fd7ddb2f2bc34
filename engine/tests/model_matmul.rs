//! candle's CPU matmul (the `gemm` crate with its runtime-selected AVX-512 or AVX2 kernel) against
//! a naive f64 reference on random data, in the shapes the GPT uses (plain, transposed operands
//! as in backward, batched attention): relative error per element within 1e-5 of the row's
//! magnitude. Guards the kernel the engine's speed rests on.

use candle_core::{Device, Tensor};

fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0f64; m * n];
    for i in 0..m {
        for p in 0..k {
            let x = a[i * k + p] as f64;
            for j in 0..n {
                c[i * n + j] += x * b[p * n + j] as f64;
            }
        }
    }
    c
}

fn check(m: usize, k: usize, n: usize, transpose: bool) {
    let a = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
    let b = Tensor::randn(0f32, 1.0, (k, n), &Device::Cpu).unwrap();
    let c = if transpose {
        // (B^T)^T and (A^T)^T: the strided layouts backward passes use.
        let at = a.t().unwrap().contiguous().unwrap();
        let bt = b.t().unwrap().contiguous().unwrap();
        at.t().unwrap().matmul(&bt.t().unwrap()).unwrap()
    } else {
        a.matmul(&b).unwrap()
    };
    let av: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
    let bv: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
    let cv: Vec<f32> = c.flatten_all().unwrap().to_vec1().unwrap();
    let r = naive(&av, &bv, m, k, n);
    // |c - r| <= 1e-5 * sqrt(k) per element for unit-variance inputs (sum of k products).
    let tol = 1e-5 * (k as f64).sqrt() * 4.0;
    for (i, (&x, &y)) in cv.iter().zip(&r).enumerate() {
        assert!(
            (x as f64 - y).abs() <= tol,
            "{m}x{k}x{n} transpose {transpose}: element {i}: {x} vs {y}"
        );
    }
}

#[test]
fn matmul_matches_f64_reference_in_gpt_shapes() {
    for &(m, k, n) in &[
        (1, 1, 1),
        (7, 13, 5),
        (128, 64, 192),
        (256, 256, 768),
        (64, 1024, 96),
    ] {
        check(m, k, n, false);
        check(m, k, n, true);
    }
}

#[test]
fn batched_attention_matmul_matches_reference() {
    let (h, t, d) = (4, 33, 16);
    let q = Tensor::randn(0f32, 1.0, (h, t, d), &Device::Cpu).unwrap();
    let k = Tensor::randn(0f32, 1.0, (h, t, d), &Device::Cpu).unwrap();
    let s = q.matmul(&k.transpose(1, 2).unwrap()).unwrap();
    let qv: Vec<f32> = q.flatten_all().unwrap().to_vec1().unwrap();
    let kv: Vec<f32> = k.flatten_all().unwrap().to_vec1().unwrap();
    let sv: Vec<f32> = s.flatten_all().unwrap().to_vec1().unwrap();
    for b in 0..h {
        for i in 0..t {
            for j in 0..t {
                let mut acc = 0f64;
                for p in 0..d {
                    acc += qv[(b * t + i) * d + p] as f64 * kv[(b * t + j) * d + p] as f64;
                }
                let got = sv[(b * t + i) * t + j] as f64;
                assert!(
                    (got - acc).abs() <= 1e-4,
                    "head {b} ({i},{j}): {got} vs {acc}"
                );
            }
        }
    }
}

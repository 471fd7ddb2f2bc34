//! Checks of vendored candle-core patches 5 and 6 (`vendor/README.md`).
//!
//! 5. The CPU matmul allocates its output without the zero-fill: every output element is
//!    still written (plain, transposed, batched, batch-folded and broadcast-rhs layouts, k = 0,
//!    f32/f64/f16/bf16), checked against an f64 reference on data that leaves no zero in the
//!    output, after the allocator has been handed freed buffers full of NaN.
//! 6. The backward of `narrow` writes into one zeroed gradient buffer shared by the disjoint
//!    narrows of a tensor: the gradients equal, bit for bit, those of an explicit reference
//!    (`cat` of zero pads and the narrow's gradient, summed as upstream did), for the q/k/v
//!    split of an attention block, for a tensor used by narrows and by another op, for
//!    overlapping narrows and narrows along two dims (the fallback path).

use candle_core::{DType, Device, Tensor, Var, D};

/// Allocates and frees buffers full of NaN of the sizes the next matmuls ask for, so a
/// matmul that left an element unwritten would most likely return NaN (glibc hands freed
/// chunks of the same size back first).
fn poison_allocator(elements: usize) {
    for _ in 0..4 {
        let v = vec![f32::NAN; elements];
        std::hint::black_box(&v);
        drop(v);
    }
}

/// `a @ b` in f64 for `a` `[m, k]`, `b` `[k, n]` row-major.
fn reference(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0f64; m * n];
    for i in 0..m {
        for p in 0..k {
            for j in 0..n {
                c[i * n + j] += a[i * k + p] * b[p * n + j];
            }
        }
    }
    c
}

/// Positive data (1..=2) so that no product sum is 0 and an unwritten element shows up.
fn data(len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| 1.0 + ((i * 7919 + salt * 104729) % 1000) as f32 / 1000.0)
        .collect()
}

fn to_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `lhs` `[batch, m, k]` times `rhs` (`[batch, k, n]`, or `[k, n]` broadcast) in `dtype`,
/// through the layout `mode` gives the operands, checked element by element against f64.
fn check_matmul(batch: usize, m: usize, k: usize, n: usize, dtype: DType, mode: &str) {
    let dev = Device::Cpu;
    let a = Tensor::from_vec(data(batch * m * k, 1), (batch, m, k), &dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let rhs_batch = if mode == "broadcast" { 1 } else { batch };
    let b = Tensor::from_vec(data(rhs_batch * k * n, 2), (rhs_batch, k, n), &dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    poison_allocator(batch * m * n);
    let c = match mode {
        "plain" => a.matmul(&b).unwrap(),
        // The layouts of backward: transposed views of contiguous transposes.
        "transposed" => {
            let at = a.transpose(1, 2).unwrap().contiguous().unwrap();
            let bt = b.transpose(1, 2).unwrap().contiguous().unwrap();
            at.transpose(1, 2)
                .unwrap()
                .matmul(&bt.transpose(1, 2).unwrap())
                .unwrap()
        }
        // A batch-invariant rhs: candle folds the batches into one (batch * m, k) gemm.
        "broadcast" => a.broadcast_matmul(&b.squeeze(0).unwrap()).unwrap(),
        other => panic!("unknown mode {other}"),
    };
    assert_eq!(c.dims(), &[batch, m, n]);
    let (av, bv, cv) = (to_f64(&a), to_f64(&b), to_f64(&c));
    for s in 0..batch {
        let bs = if mode == "broadcast" { 0 } else { s };
        let r = reference(
            &av[s * m * k..(s + 1) * m * k],
            &bv[bs * k * n..(bs + 1) * k * n],
            m,
            k,
            n,
        );
        let tol = match dtype {
            DType::F64 => 1e-12,
            DType::F32 => 1e-5,
            _ => 2e-2,
        };
        for (i, (&got, &want)) in cv[s * m * n..(s + 1) * m * n].iter().zip(&r).enumerate() {
            assert!(
                got.is_finite() && (got - want).abs() <= tol * want.abs().max(1.0),
                "{dtype:?} {mode} batch {s} of {batch}, {m}x{k}x{n}: element {i} = {got}, \
                 want {want}"
            );
        }
    }
}

#[test]
fn matmul_writes_every_output_element() {
    for &(batch, m, k, n) in &[
        (1, 1, 1, 1),
        (1, 7, 13, 5),
        (3, 17, 9, 33),
        (1, 128, 64, 192),
        (4, 65, 70, 67),
        (2, 256, 256, 96),
    ] {
        for mode in ["plain", "transposed", "broadcast"] {
            check_matmul(batch, m, k, n, DType::F32, mode);
        }
        check_matmul(batch, m, k, n, DType::F64, "plain");
        check_matmul(batch, m, k, n, DType::F16, "plain");
        check_matmul(batch, m, k, n, DType::BF16, "transposed");
    }
}

#[test]
fn matmul_with_empty_inner_dimension_is_zero() {
    let dev = Device::Cpu;
    poison_allocator(2 * 5 * 6);
    let a = Tensor::zeros((2, 5, 0), DType::F32, &dev).unwrap();
    let b = Tensor::zeros((2, 0, 6), DType::F32, &dev).unwrap();
    let c = a.matmul(&b).unwrap();
    assert_eq!(c.dims(), &[2, 5, 6]);
    let v: Vec<f32> = c.flatten_all().unwrap().to_vec1().unwrap();
    assert!(v.iter().all(|&x| x.to_bits() == 0), "{v:?}");
}

fn bits(t: &Tensor) -> Vec<u64> {
    to_f64(t).iter().map(|x| x.to_bits()).collect()
}

/// Upstream's narrow backward: `cat([zeros(start), g, zeros(rest)], dim)`.
fn padded(g: &Tensor, full: &[usize], dim: usize, start: usize) -> Tensor {
    let len = g.dims()[dim];
    let mut parts = Vec::new();
    if start > 0 {
        let mut d = full.to_vec();
        d[dim] = start;
        parts.push(Tensor::zeros(d, g.dtype(), g.device()).unwrap());
    }
    parts.push(g.clone());
    if start + len < full[dim] {
        let mut d = full.to_vec();
        d[dim] = full[dim] - start - len;
        parts.push(Tensor::zeros(d, g.dtype(), g.device()).unwrap());
    }
    Tensor::cat(&parts, dim).unwrap()
}

/// Random-ish f64 values of both signs.
fn values(len: usize, salt: u64) -> Vec<f64> {
    (0..len as u64)
        .map(|i| {
            let x = (i
                .wrapping_mul(6364136223846793005)
                .wrapping_add(salt * 1442695040888963407)
                >> 33) as f64;
            x / (1u64 << 31) as f64 - 0.5
        })
        .collect()
}

#[test]
fn attention_qkv_split_gradient_equals_reference() {
    // qkv [B*T, 3*D] split into heads as engine/src/model/gpt.rs does, each part used by a
    // different op; the gradient of qkv must be the three parts side by side.
    let dev = Device::Cpu;
    let (b, t, h, hd) = (2, 5, 3, 4);
    let d = h * hd;
    let qkv = Var::from_vec(values(b * t * 3 * d, 1), (b * t, 3 * d), &dev).unwrap();
    let w = [
        Tensor::from_vec(values(b * h * t * hd, 2), (b, h, t, hd), &dev).unwrap(),
        Tensor::from_vec(values(b * h * t * hd, 3), (b, h, t, hd), &dev).unwrap(),
        Tensor::from_vec(values(b * h * t * hd, 4), (b, h, t, hd), &dev).unwrap(),
    ];
    let split = qkv
        .as_tensor()
        .reshape((b, t, 3, h, hd))
        .unwrap()
        .permute((2, 0, 3, 1, 4))
        .unwrap();
    let parts: Vec<Tensor> = (0..3).map(|i| split.get(i).unwrap()).collect();
    // q and v used linearly, k squared (its gradient depends on k).
    let loss = ((&parts[0] * &w[0]).unwrap().sum_all().unwrap()
        + (parts[1].sqr().unwrap() * &w[1])
            .unwrap()
            .sum_all()
            .unwrap()
        + (&parts[2] * &w[2]).unwrap().sum_all().unwrap())
    .unwrap();
    let g = loss.backward().unwrap();
    let got = g.get(qkv.as_tensor()).unwrap();
    // Reference: d/dq = w0, d/dk = 2 k w1, d/dv = w2, placed back into [B*T, 3*D] by upstream's
    // padded sums, then the inverse permute.
    let k2 = (parts[1].affine(2.0, 0.0).unwrap() * &w[1]).unwrap();
    let full = [3, b, h, t, hd];
    let gs = [w[0].clone(), k2, w[2].clone()];
    let mut sum: Option<Tensor> = None;
    for (i, gi) in gs.iter().enumerate() {
        let p = padded(&gi.unsqueeze(0).unwrap(), &full, 0, i);
        sum = Some(match sum {
            None => p,
            Some(s) => (s + p).unwrap(),
        });
    }
    let want = sum
        .unwrap()
        .permute((1, 3, 0, 2, 4))
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((b * t, 3 * d))
        .unwrap();
    assert_eq!(got.dims(), want.dims());
    assert!(got.is_contiguous());
    assert_eq!(bits(got), bits(&want));
}

#[test]
fn narrow_gradients_with_other_uses_overlaps_and_two_dims_equal_reference() {
    let dev = Device::Cpu;
    let x = Var::from_vec(values(6 * 8, 5), (6, 8), &dev).unwrap();
    let xt = x.as_tensor();
    let w = Tensor::from_vec(values(6 * 8, 6), (6, 8), &dev).unwrap();
    // Two disjoint narrows of dim 1, an overlapping one, one along dim 0, a narrow of a
    // narrow, and a direct use of x: the fast path, its fallbacks and mixed accumulation.
    let a = xt.narrow(1, 0, 3).unwrap();
    let b = xt.narrow(1, 5, 3).unwrap();
    let c = xt.narrow(1, 2, 4).unwrap();
    let e = xt.narrow(0, 1, 2).unwrap();
    let f = xt.narrow(1, 3, 2).unwrap().narrow(0, 4, 2).unwrap();
    let loss = ((a.sqr().unwrap().sum_all().unwrap()
        + b.affine(3.0, 0.0).unwrap().sum_all().unwrap())
    .unwrap()
        + (c.exp().unwrap().sum_all().unwrap()
            + (e.sqr().unwrap().sum_all().unwrap()
                + (f.affine(-2.0, 0.0).unwrap().sum_all().unwrap()
                    + (xt * &w).unwrap().sum_all().unwrap())
                .unwrap())
            .unwrap())
        .unwrap())
    .unwrap();
    let g = loss.backward().unwrap();
    let got = g.get(xt).unwrap();
    // Analytic gradient, summed in f64 in the same spirit (values must agree exactly where
    // only one term contributes, and to rounding elsewhere).
    let xv: Vec<f64> = xt.flatten_all().unwrap().to_vec1().unwrap();
    let wv: Vec<f64> = w.flatten_all().unwrap().to_vec1().unwrap();
    let gv: Vec<f64> = got.flatten_all().unwrap().to_vec1().unwrap();
    for r in 0..6 {
        for col in 0..8 {
            let i = r * 8 + col;
            let mut want = wv[i];
            if col < 3 {
                want += 2.0 * xv[i];
            }
            if col >= 5 {
                want += 3.0;
            }
            if (2..6).contains(&col) {
                want += xv[i].exp();
            }
            if (1..3).contains(&r) {
                want += 2.0 * xv[i];
            }
            if (3..5).contains(&col) && (4..6).contains(&r) {
                want += -2.0;
            }
            assert!(
                (gv[i] - want).abs() <= 1e-12 * want.abs().max(1.0),
                "[{r}, {col}]: {} vs {want}",
                gv[i]
            );
        }
    }
}

#[test]
fn single_narrow_gradient_is_exact_and_zero_elsewhere() {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = Var::from_tensor(
            &Tensor::from_vec(values(4 * 6 * 5, 7), (4, 6, 5), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        let w = Tensor::from_vec(values(4 * 2 * 5, 8), (4, 2, 5), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let y = x.as_tensor().narrow(D::Minus2, 3, 2).unwrap();
        let g = (y * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let got = g.get(x.as_tensor()).unwrap();
        assert_eq!(got.dtype(), dtype);
        let want = padded(&w, &[4, 6, 5], 1, 3);
        assert_eq!(bits(got), bits(&want), "{dtype:?}");
    }
}

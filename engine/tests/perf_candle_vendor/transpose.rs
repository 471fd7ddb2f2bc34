//! Patch 7: the contiguous copy of a transposed matrix (`w.t().contiguous()`, and the gradient
//! of `x.matmul(&w.t())` stored for `w`) is copied by tiles. Every element must land where the
//! layout says, for shapes that are and are not multiples of the tile, for views that start
//! inside their storage (a narrow before the transpose), in every dtype width, and through
//! autograd.

use candle_core::{DType, Device, Tensor, Var};

/// `rows x cols` values, whole numbers below 251 (exact in bf16, whose 8-bit significand holds
/// every integer up to 256), varying along both dims so a misplaced element shows.
fn matrix(rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| ((i * 7 + 3) % 251) as f32)
        .collect()
}

/// `w` (`[o, i]` row-major, `v` its values) narrowed to columns `c0..c0 + n` and transposed,
/// made contiguous: element `(a, b)` of the `[n, o]` result must be `v[b * i + c0 + a]`.
fn check(o: usize, i: usize, c0: usize, n: usize, dtype: DType) {
    let v = matrix(o, i);
    let w = Tensor::from_vec(v.clone(), (o, i), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let t = w.narrow(1, c0, n).unwrap().t().unwrap();
    assert!(!t.is_contiguous());
    let got = t
        .contiguous()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(got.len(), n * o);
    for a in 0..n {
        for b in 0..o {
            let want = v[b * i + c0 + a];
            assert_eq!(
                got[a * o + b],
                want,
                "{dtype:?} [{o}, {i}] columns {c0}..{}: element ({a}, {b})",
                c0 + n
            );
        }
    }
}

#[test]
fn transposed_copies_put_every_element_where_the_layout_says() {
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64, DType::U32] {
        for (o, i) in [
            (2, 2),
            (5, 7),
            (32, 32),
            (33, 31),
            (64, 96),
            (70, 129),
            (256, 40),
        ] {
            check(o, i, 0, i, dtype);
            if i > 3 {
                check(o, i, 1, i - 3, dtype);
            }
        }
    }
}

#[test]
fn transposed_weight_gradient_is_the_transpose_of_the_product() {
    // y = x w^T for x [n, i], w [o, i]; with dy = 1 everywhere, dW[b][a] = sum_r x[r][a].
    let (n, i, o) = (5, 37, 70);
    let xv = matrix(n, i);
    let x = Tensor::from_vec(xv.clone(), (n, i), &Device::Cpu).unwrap();
    let w = Var::from_tensor(&Tensor::ones((o, i), DType::F32, &Device::Cpu).unwrap()).unwrap();
    let y = x.matmul(&w.as_tensor().t().unwrap()).unwrap();
    let grads = y.sum_all().unwrap().backward().unwrap();
    let g = grads.get(w.as_tensor()).unwrap();
    assert_eq!(g.dims(), &[o, i]);
    let g = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for b in 0..o {
        for a in 0..i {
            let want: f32 = (0..n).map(|r| xv[r * i + a]).sum();
            assert_eq!(g[b * i + a], want, "dW ({b}, {a})");
        }
    }
}

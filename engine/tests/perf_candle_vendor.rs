//! Checks of the patches of the vendored candle-core (`vendor/README.md`); patches 5-7 in the
//! submodules.
//!
//! 1. x86 bf16/f16 element-wise add (vectorised body and scalar tail, two-tensor and
//!    tensor-plus-scalar kernels) gives, bit for bit, `half`'s scalar arithmetic (widen to f32,
//!    add, round to nearest even) for every 16-bit input pattern: subnormals are not flushed,
//!    overflow gives infinity, NaN stays NaN.
//! 2. The gradient store takes a node's first gradient itself instead of `zeros + grad`: equal
//!    values (a -0.0 gradient now stays -0.0), sums for a tensor used twice, contiguous stored
//!    gradients for strided ones, the same detach behaviour and the same shape/dtype errors.
//!
//! The inputs are every 16-bit pattern against several permutations of them (about half a
//! million additions per dtype), of lengths that leave a scalar tail.

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor, Var};
use half::{bf16, f16};

/// Every 16-bit pattern, then `extra` more from a second permutation so the length is not a
/// multiple of the 32-element SIMD step (the scalar tail runs too).
fn patterns(extra: usize, mul: u32, add: u32) -> Vec<u16> {
    (0..65536u32 + extra as u32)
        .map(|i| (i.wrapping_mul(mul).wrapping_add(add) & 0xffff) as u16)
        .collect()
}

/// Asserts `got` equals `want` bit for bit, NaN matching any NaN (the payload of NaN + NaN
/// depends on operand order, which the compiler may swap in scalar code).
fn assert_same(what: &str, got: &[f32], want: &[f32], a: &[f32], b: &[f32]) {
    assert_eq!(got.len(), want.len());
    for i in 0..got.len() {
        let ok = if want[i].is_nan() {
            got[i].is_nan()
        } else {
            got[i].to_bits() == want[i].to_bits()
        };
        assert!(
            ok,
            "{what}: element {i}: {:e} + {:e} gave {:e} ({:#x}), half gives {:e} ({:#x})",
            a[i],
            b[i],
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

fn bf16s(bits: &[u16]) -> Vec<bf16> {
    bits.iter().map(|&b| bf16::from_bits(b)).collect()
}

fn f16s(bits: &[u16]) -> Vec<f16> {
    bits.iter().map(|&b| f16::from_bits(b)).collect()
}

#[test]
fn bf16_add_is_half_rounding_for_every_pattern() {
    let a = patterns(13, 1, 0);
    for (mul, add) in [
        (1u32, 0u32),
        (40503, 12345),
        (7919, 1),
        (65535, 32768),
        (3, 0x7f80),
    ] {
        let b = patterns(13, mul, add);
        let (va, vb) = (bf16s(&a), bf16s(&b));
        let n = va.len();
        let ta = Tensor::from_vec(va.clone(), n, &Device::Cpu).unwrap();
        let tb = Tensor::from_vec(vb.clone(), n, &Device::Cpu).unwrap();
        let got = ta.add(&tb).unwrap().to_vec1::<bf16>().unwrap();
        let want: Vec<bf16> = va.iter().zip(&vb).map(|(&x, &y)| x + y).collect();
        let f = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        assert_same("bf16 add", &f(&got), &f(&want), &f(&va), &f(&vb));
    }
}

#[test]
fn bf16_scalar_add_is_half_rounding() {
    let a = bf16s(&patterns(29, 1, 0));
    let n = a.len();
    let ta = Tensor::from_vec(a.clone(), n, &Device::Cpu).unwrap();
    for s in [0.0f32, -0.0, 1.0, -3.5, 1e-40, 3.0e38, f32::INFINITY, 0.1] {
        let s = bf16::from_f32(s);
        let ts = Tensor::from_vec(vec![s], 1, &Device::Cpu).unwrap();
        let got = ta.broadcast_add(&ts).unwrap().to_vec1::<bf16>().unwrap();
        let want: Vec<bf16> = a.iter().map(|&x| x + s).collect();
        let f = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        let sv = vec![s.to_f32(); n];
        assert_same("bf16 scalar add", &f(&got), &f(&want), &f(&a), &sv);
    }
}

#[test]
fn f16_add_is_half_rounding_for_every_pattern() {
    let a = patterns(13, 1, 0);
    for (mul, add) in [
        (1u32, 0u32),
        (40503, 12345),
        (7919, 1),
        (65535, 32768),
        (3, 0x7c00),
    ] {
        let b = patterns(13, mul, add);
        let (va, vb) = (f16s(&a), f16s(&b));
        let n = va.len();
        let ta = Tensor::from_vec(va.clone(), n, &Device::Cpu).unwrap();
        let tb = Tensor::from_vec(vb.clone(), n, &Device::Cpu).unwrap();
        let got = ta.add(&tb).unwrap().to_vec1::<f16>().unwrap();
        let want: Vec<f16> = va.iter().zip(&vb).map(|(&x, &y)| x + y).collect();
        let f = |v: &[f16]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        assert_same("f16 add", &f(&got), &f(&want), &f(&va), &f(&vb));
        // tensor + scalar
        let s = vb[7];
        let ts = Tensor::from_vec(vec![s], 1, &Device::Cpu).unwrap();
        let got = ta.broadcast_add(&ts).unwrap().to_vec1::<f16>().unwrap();
        let want: Vec<f16> = va.iter().map(|&x| x + s).collect();
        let sv = vec![s.to_f32(); n];
        assert_same("f16 scalar add", &f(&got), &f(&want), &f(&va), &sv);
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

#[test]
fn first_gradient_is_stored_exactly() {
    // d/dx sum(x * w) = w, -0.0 included (upstream stored 0.0 + -0.0 = +0.0).
    let w = Tensor::new(&[1.5f32, -0.0, 0.0, -2.25, 1e-42, f32::MAX], &Device::Cpu).unwrap();
    let x = Var::new(&[1f32, 2., 3., 4., 5., 6.], &Device::Cpu).unwrap();
    let grads = x
        .as_tensor()
        .mul(&w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g = grads.get(x.as_tensor()).unwrap();
    assert_eq!(bits(g), bits(&w));
    assert_eq!(g.dims(), &[6]);
    assert_eq!(g.dtype(), DType::F32);
    // Used twice: the second gradient is added to the first.
    let w2 = Tensor::new(&[0.25f32, 1., -1., 2., 3., -0.0], &Device::Cpu).unwrap();
    let y = (x.as_tensor().mul(&w).unwrap() + x.as_tensor().mul(&w2).unwrap()).unwrap();
    let grads = y.sum_all().unwrap().backward().unwrap();
    let want = w.add(&w2).unwrap();
    assert_eq!(bits(grads.get(x.as_tensor()).unwrap()), bits(&want));
}

#[test]
fn strided_first_gradient_is_stored_contiguous() {
    // x [2, 3] used transposed: its gradient arrives as a transposed view of [3, 2].
    let x = Var::new(&[[1f32, 2., 3.], [4., 5., 6.]], &Device::Cpu).unwrap();
    let w = Tensor::new(&[[0.5f32, -1.], [2., 0.25], [-3., 4.]], &Device::Cpu).unwrap();
    let y = x
        .as_tensor()
        .t()
        .unwrap()
        .mul(&w)
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = y.backward().unwrap();
    let g = grads.get(x.as_tensor()).unwrap();
    assert!(g.is_contiguous());
    assert_eq!(
        g.to_vec2::<f32>().unwrap(),
        vec![vec![0.5, 2., -3.], vec![-1., 0.25, 4.]]
    );
    // A matmul consumes the stored gradient of a transposed operand (needs the layout).
    let a = Var::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu).unwrap();
    let b = Tensor::new(&[[1f32, 0.], [0.5, 2.]], &Device::Cpu).unwrap();
    let h = a.as_tensor().t().unwrap();
    let out = h.matmul(&b).unwrap().matmul(&b).unwrap().sum_all().unwrap();
    let grads = out.backward().unwrap();
    let ga = grads.get(a.as_tensor()).unwrap();
    // d/dA sum(A^T B B) = (B B 1 1^T)^T ... checked against the closed form.
    let bb = b.matmul(&b).unwrap();
    let ones = Tensor::ones((2, 2), DType::F32, &Device::Cpu).unwrap();
    let want = ones.matmul(&bb.t().unwrap()).unwrap().t().unwrap();
    assert_eq!(ga.to_vec2::<f32>().unwrap(), want.to_vec2::<f32>().unwrap());
}

#[test]
fn stored_gradients_keep_detach_behaviour() {
    let x = Var::new(&[1f32, 2., 3.], &Device::Cpu).unwrap();
    let w = Tensor::new(&[4f32, 5., 6.], &Device::Cpu).unwrap();
    let grads = x
        .as_tensor()
        .mul(&w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    // grad * w with w untracked: untracked, as zeros + (grad * w) was.
    assert!(!grads.get(x.as_tensor()).unwrap().track_op());
    // With w a variable, grad * w tracks w (it did before too).
    let wv = Var::new(&[4f32, 5., 6.], &Device::Cpu).unwrap();
    let grads = (x.as_tensor() * wv.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(grads.get(x.as_tensor()).unwrap().track_op());
    assert!(grads.get(wv.as_tensor()).unwrap().track_op());
}

/// Identity forward whose backward returns a gradient of the wrong shape or dtype.
struct BadGrad {
    dtype: DType,
    len: usize,
}

impl CustomOp1 for BadGrad {
    fn name(&self) -> &'static str {
        "bad-grad"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((s.clone(), l.shape().clone()))
    }
    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        _grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(Tensor::zeros(self.len, self.dtype, &Device::Cpu)?))
    }
}

#[test]
fn wrong_gradient_shape_or_dtype_is_still_an_error() {
    let x = Var::new(&[1f32, 2.], &Device::Cpu).unwrap();
    for (dtype, len, what) in [
        (DType::F32, 3, "shape"),
        (DType::F64, 2, "dtype"),
        (DType::F32, 2, "none"),
    ] {
        let y = x.as_tensor().apply_op1(BadGrad { dtype, len }).unwrap();
        let r = y.sum_all().unwrap().backward();
        match what {
            "none" => assert!(r.is_ok(), "{r:?}"),
            _ => {
                let e = r.expect_err(what).to_string();
                assert!(e.contains("mismatch"), "{what}: {e}");
            }
        }
    }
}

/// The vendored matmul without zero-fill and the shared narrow backward (patches 5-6), in this
/// binary to keep the number of test executables (and CI link time) down.
#[path = "perf_candle_vendor/gemm.rs"]
mod gemm;

/// The tiled copy of a transposed matrix (patch 7).
#[path = "perf_candle_vendor/transpose.rs"]
mod transpose;

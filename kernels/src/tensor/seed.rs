//! The upstream-gradient seed of unit-level backward: a 0-dim tensor `s` whose gradient with
//! respect to `y` is exactly a given tensor `g`, on any candle device.
//!
//! Backward through one FSDP unit starts from the gradient `g = dL/dy` of the unit's output
//! `y`, delivered by the next unit's backward (Chen et al. 2016, "Training Deep Nets with
//! Sublinear Memory Cost", sec. 3: checkpointed segments are back-propagated one at a time
//! from their output gradient). candle's `backward()` starts from a scalar, so the engine needs
//! a scalar `s(y)` with `ds/dy = g`. The textbook `(y * g).sum_all()` gives the same gradient
//! bits in f32 (`1 * g = g` elementwise) but allocates and computes a `y`-sized product in
//! forward and two broadcast multiplies in backward (one of them an unused gradient for `g`),
//! about three `y`-sized buffers at the backward peak that no memory plan wants to count.
//!
//! This op's forward returns a 0-dim zero of `y`'s dtype (one element: 4 bytes for f32, 2 for
//! bf16/f16, 8 for f64) and allocates nothing else; its backward returns `g` itself (the same
//! tensor, no copy). On the CPU the zero is a host `CpuStorage`; on CUDA (feature `cuda`) it is
//! one device element from candle's own allocator on `y`'s device (`zeros_impl`, ordered on
//! candle's stream), so no host synchronisation happens.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

/// The custom op behind [`backward_seed`]: holds the seed gradient (detached).
struct BackwardSeed {
    g: Tensor,
}

impl CustomOp1 for BackwardSeed {
    fn name(&self) -> &'static str {
        "backward-seed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let zero = match s {
            CpuStorage::F32(_) => CpuStorage::F32(vec![0.0]),
            CpuStorage::F64(_) => CpuStorage::F64(vec![0.0]),
            CpuStorage::BF16(_) => CpuStorage::BF16(vec![half::bf16::ZERO]),
            CpuStorage::F16(_) => CpuStorage::F16(vec![half::f16::ZERO]),
            other => candle_core::bail!("backward_seed: unsupported dtype {:?}", other.dtype()),
        };
        Ok((zero, Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendDevice;
        let dtype = s.dtype();
        if !is_float(dtype) {
            candle_core::bail!("backward_seed: unsupported dtype {dtype:?}");
        }
        let shape = Shape::from(());
        Ok((s.device().zeros_impl(&shape, dtype)?, shape))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        _grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(self.g.clone()))
    }
}

fn is_float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
}

/// A 0-dim tensor `s` such that `s.backward()` delivers exactly `g` (the same tensor, bit for
/// bit) as the gradient of `y`: the upstream-gradient seed of unit-level backward (see the
/// module docs; Chen et al. 2016, sec. 3).
///
/// `y` and `g`: the same shape, the same float dtype (f32, f64, bf16 or f16) and the same
/// device (CPU, or CUDA with feature `cuda`). The forward value is a 0-dim zero of `y`'s dtype
/// on `y`'s device (one element); nothing `y`-sized is allocated in forward or backward.
/// Note that the result's own value is meaningless (always zero): only its gradient matters.
///
/// Errors: shapes, dtypes or devices that differ; a non-float dtype; a device whose backend
/// this build lacks (candle's error).
pub fn backward_seed(y: &Tensor, g: &Tensor) -> candle_core::Result<Tensor> {
    if y.dims() != g.dims() || y.dtype() != g.dtype() {
        candle_core::bail!(
            "backward_seed: y {:?} {:?} vs g {:?} {:?}",
            y.dims(),
            y.dtype(),
            g.dims(),
            g.dtype()
        );
    }
    if !is_float(y.dtype()) {
        candle_core::bail!("backward_seed: unsupported dtype {:?}", y.dtype());
    }
    if !y.device().same_device(g.device()) {
        candle_core::bail!(
            "backward_seed: y on {:?}, g on {:?}",
            y.device().location(),
            g.device().location()
        );
    }
    y.apply_op1(BackwardSeed { g: g.detach() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn seeded_grad(dtype: DType) -> (Tensor, Tensor) {
        let x = Var::from_tensor(
            &Tensor::arange(0f32, 12.0, &Device::Cpu)
                .unwrap()
                .reshape((3, 4))
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        // y = 3 x (+ 1): dL/dx = 3 g exactly for these small integers.
        let y = ((x.as_tensor() * 3.0).unwrap() + 1.0).unwrap();
        let g = Tensor::new(
            &[
                [0.5f32, -1.0, 2.0, 0.25],
                [1.5, 0.0, -3.0, 4.0],
                [8.0, -0.5, 1.0, 2.5],
            ],
            &Device::Cpu,
        )
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
        let s = backward_seed(&y, &g).unwrap();
        assert_eq!(s.dims(), &[] as &[usize]);
        assert_eq!(s.dtype(), dtype);
        assert_eq!(
            s.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap(),
            0.0
        );
        let grads = s.backward().unwrap();
        let gx = grads.get(x.as_tensor()).unwrap().clone();
        (gx, g)
    }

    #[test]
    fn gradient_of_the_input_is_the_chain_rule_of_the_seed() {
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let (gx, g) = seeded_grad(dtype);
            let want: Vec<f64> = g
                .to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()
                .iter()
                .map(|v| 3.0 * v)
                .collect();
            let got = gx
                .to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            assert_eq!(got, want, "{dtype:?}");
        }
    }

    #[test]
    fn seed_gradient_enters_the_graph_unchanged() {
        // y = exp(x): candle's exp backward multiplies the incoming gradient by y, so dL/dx
        // must be bitwise `g * exp(x)`, which holds only if the seed delivered g unchanged.
        let x = Var::from_tensor(&Tensor::new(&[1f32, 2.0, 3.0], &Device::Cpu).unwrap()).unwrap();
        let y = x.as_tensor().exp().unwrap();
        let g = Tensor::new(&[0.1f32, -7.25, 3.0e-30], &Device::Cpu).unwrap();
        let grads = backward_seed(&y, &g).unwrap().backward().unwrap();
        let gx = grads.get(x.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
        let want = (&g * &y).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(gx, want);
        assert_ne!(gx, y.to_vec1::<f32>().unwrap());
    }

    #[test]
    fn mismatches_are_errors() {
        let d = Device::Cpu;
        let y = Tensor::zeros((2, 3), DType::F32, &d).unwrap();
        let e = backward_seed(&y, &Tensor::zeros((3, 2), DType::F32, &d).unwrap()).unwrap_err();
        assert!(e.to_string().contains("backward_seed"), "{e}");
        assert!(backward_seed(&y, &Tensor::zeros((2, 3), DType::BF16, &d).unwrap()).is_err());
        let yi = Tensor::zeros((2, 3), DType::U32, &d).unwrap();
        let e = backward_seed(&yi, &yi).unwrap_err();
        assert!(e.to_string().contains("unsupported dtype"), "{e}");
    }
}

//! Parking: freeing the memory of unsharded parameter tensors that a kept forward graph still
//! refers to, by swapping their storages with empty ones, and refilling those same tensors
//! from freshly gathered ones before the graph's backward (vendor patch 3,
//! `Tensor::storage_mut_and_layout`).

use crate::error::{EngineError, Result};
use candle_core::{Storage, Tensor};

/// Address of the storage behind `t` (tensors sharing a storage have the same key).
fn storage_key(t: &Tensor) -> usize {
    let (g, _) = t.storage_and_layout();
    std::ptr::from_ref::<Storage>(&g).addr()
}

/// Swaps the contents of the storages behind `a` and `b` (vendor patch 3's write access):
/// every tensor sharing `a`'s storage then sees `b`'s elements and the reverse. The caller
/// keeps layouts compatible.
fn swap_storages(a: &Tensor, b: &Tensor) {
    let (mut ga, _) = a.storage_mut_and_layout();
    let (mut gb, _) = b.storage_mut_and_layout();
    std::mem::swap(&mut *ga, &mut *gb);
}

/// An empty storage's tensor of `t`'s dtype on its device: zero elements on the CPU, one
/// element elsewhere (a zero-byte device allocation is not portable).
fn empty_like(t: &Tensor) -> Result<Tensor> {
    let n = if t.device().is_cpu() { 0 } else { 1 };
    Ok(Tensor::zeros(n, t.dtype(), t.device())?)
}

/// Frees the memory of the distinct storages behind `ts` by swapping in empty ones; the
/// tensors stay valid handles (a kept autograd graph refers to them) but must not be read until
/// [`refill`] gives them values again.
pub(super) fn release_storages(ts: &[Tensor]) -> Result<()> {
    let mut seen: Vec<usize> = Vec::with_capacity(ts.len());
    for t in ts {
        let key = storage_key(t);
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        let e = empty_like(t)?;
        swap_storages(t, &e);
        // `e` now owns the unsharded elements and frees them here.
    }
    Ok(())
}

/// Moves the storages behind `fresh` (freshly gathered parameters, declaration order) into the
/// parked tensors `parked` (same parameters, emptied by [`release_storages`]), one swap per
/// distinct parked storage, so a kept forward graph computes its backward on the gathered
/// values. `fresh` is dropped with the empty storages.
///
/// Errors: [`EngineError::Config`] when the two do not describe the same parameters (count,
/// shape, dtype, layout, or storage sharing differ; an engine bug).
pub(super) fn refill(parked: &[Tensor], fresh: Vec<Tensor>, unit: &str) -> Result<()> {
    if parked.len() != fresh.len() {
        return Err(EngineError::Config(format!(
            "unit {unit}: {} parked parameters, {} gathered",
            parked.len(),
            fresh.len()
        )));
    }
    let mut seen: Vec<(usize, usize)> = Vec::with_capacity(parked.len());
    for (i, (p, f)) in parked.iter().zip(&fresh).enumerate() {
        if p.dtype() != f.dtype() || p.layout() != f.layout() {
            return Err(EngineError::Config(format!(
                "unit {unit} parameter {i}: parked {:?} {:?}, gathered {:?} {:?}",
                p.dtype(),
                p.layout(),
                f.dtype(),
                f.layout()
            )));
        }
        let (kp, kf) = (storage_key(p), storage_key(f));
        match seen.iter().find(|(a, _)| *a == kp) {
            Some(&(_, b)) if b == kf => continue,
            Some(_) => {
                return Err(EngineError::Config(format!(
                    "unit {unit} parameter {i}: parked and gathered parameters share storages differently"
                )))
            }
            None => {}
        }
        if seen.iter().any(|&(_, b)| b == kf) {
            return Err(EngineError::Config(format!(
                "unit {unit} parameter {i}: parked and gathered parameters share storages differently"
            )));
        }
        seen.push((kp, kf));
        swap_storages(p, f);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{CpuStorage, Device, Var};

    fn host_len(t: &Tensor) -> usize {
        let (g, _) = t.storage_and_layout();
        match &*g {
            Storage::Cpu(CpuStorage::F32(v)) => v.len(),
            _ => panic!("f32 CPU storage expected"),
        }
    }

    /// `y = sum((x @ w) * b)`: a graph that holds `w` and `b` (views of them) for backward.
    fn graph(w: &Tensor, b: &Tensor) -> (Tensor, Tensor) {
        let x = Var::from_slice(&[1f32, -2.0, 0.5, 3.0, 0.25, -1.0], (3, 2), &Device::Cpu)
            .unwrap()
            .as_tensor()
            .clone();
        let y = x
            .matmul(&w.t().unwrap())
            .unwrap()
            .broadcast_mul(b)
            .unwrap()
            .sum_all()
            .unwrap();
        (x, y)
    }

    /// Parked parameters: the storages are emptied while the graph keeps the tensors, refilled
    /// from fresh tensors, and backward gives bitwise the gradients of an untouched graph. Host
    /// layout (one storage per parameter) and device layout (views of one flat storage, shared
    /// by two parameters and a tied alias).
    #[test]
    fn release_and_refill_keep_the_graph_valid() {
        let wv: Vec<f32> = (0..4).map(|i| i as f32 * 0.5 - 1.0).collect();
        let bv = [2f32, -3.0];
        for shared in [false, true] {
            let make = || -> Vec<Tensor> {
                if shared {
                    let flat: Vec<f32> = wv.iter().chain(&bv).copied().collect();
                    let full = Tensor::from_vec(flat, 6, &Device::Cpu).unwrap();
                    let w = full.narrow(0, 0, 4).unwrap().reshape((2, 2)).unwrap();
                    let b = full.narrow(0, 4, 2).unwrap();
                    let w = w.variable_view();
                    vec![w.clone(), b.variable_view(), w]
                } else {
                    let w = Var::from_slice(&wv, (2, 2), &Device::Cpu).unwrap();
                    let b = Var::from_slice(&bv, 2, &Device::Cpu).unwrap();
                    let w = w.as_tensor().clone();
                    vec![w.clone(), b.as_tensor().clone(), w]
                }
            };
            let reference = make();
            let (xr, yr) = graph(&reference[0], &reference[1]);
            let gr = yr.backward().unwrap();

            let params = make();
            let (x, y) = graph(&params[0], &params[1]);
            release_storages(&params).unwrap();
            for p in &params {
                assert_eq!(host_len(p), 0, "shared {shared}: storage emptied");
            }
            refill(&params, make(), "test").unwrap();
            assert_eq!(host_len(&params[0]), if shared { 6 } else { 4 });
            let g = y.backward().unwrap();
            for (a, b) in [
                (&x, &xr),
                (&params[0], &reference[0]),
                (&params[1], &reference[1]),
            ] {
                let ga = g
                    .get(a)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let gb = gr
                    .get(b)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                assert_eq!(
                    ga.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    gb.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "shared {shared}"
                );
            }
        }
    }

    /// Refilling from tensors of another layout or sharing is an error, not a silent swap.
    #[test]
    fn refill_refuses_mismatched_parameters() {
        let a = Tensor::zeros((2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::zeros(4, candle_core::DType::F32, &Device::Cpu).unwrap();
        let e = refill(std::slice::from_ref(&a), vec![b], "u").unwrap_err();
        assert!(e.to_string().contains("unit u parameter 0"), "{e}");
        let e = refill(std::slice::from_ref(&a), vec![], "u").unwrap_err();
        assert!(
            e.to_string().contains("1 parked parameters, 0 gathered"),
            "{e}"
        );
        // Two parked parameters with separate storages cannot take one shared storage.
        let c = Tensor::zeros((2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let f = Tensor::zeros((2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let e = refill(&[a, c], vec![f.clone(), f], "u").unwrap_err();
        assert!(e.to_string().contains("share storages differently"), "{e}");
    }
}

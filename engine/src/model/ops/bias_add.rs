//! Bias add: y = x + b (broadcast over rows). candle's broadcast_add backward reduces over the
//! broadcast dim with a strided sum; here the bias gradient is a row-block (vectorised) sum and
//! the input gradient is the upstream gradient itself (no copy).

use super::elem::{dispatch, same_dtype, view, Elem};
use super::rows::{block_sums, map_rows};
use super::simd::{add_into, bias_add_row};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};

struct BiasAdd;

fn ba_fwd<E: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let x = view::<E>("bias_add", s1, l1)?;
    let b = E::acc_all(view::<E>("bias_add", s2, l2)?);
    let f = b.len();
    let n = x.len().checked_div(f).unwrap_or(0);
    let y = map_rows::<E, _>(n, f, 0, |r, s, out| {
        let xr = E::acc(&x[r * f..(r + 1) * f], &mut s.a);
        bias_add_row(xr, &b, out);
    });
    Ok((E::wrap(y), l1.shape().clone()))
}

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "fused-bias-add"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s1, ba_fwd(s1, l1, s2, l2))
    }
    fn bwd(
        &self,
        _x: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let db = grad
            .contiguous()?
            .apply_op1_no_bwd(&ColumnSum { f: b.elem_count() })?;
        Ok((Some(grad.clone()), Some(db)))
    }
}

/// Column sums of a contiguous `[N, F]` tensor -> `[F]`, in the compute dtype (blocks of
/// [`SUM_BLOCK_ROWS`](super::SUM_BLOCK_ROWS) rows, see the module docs of [`super`]),
/// narrowed once.
struct ColumnSum {
    f: usize,
}

fn colsum<E: Elem>(
    f: usize,
    s: &CpuStorage,
    l: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let g = view::<E>("column_sum", s, l)?;
    let n = g.len().checked_div(f).unwrap_or(0);
    let out = block_sums::<E::Acc, _>(n, f, 1, |r, s, part| {
        add_into(part, E::acc(&g[r * f..(r + 1) * f], &mut s.a));
    });
    Ok((E::wrap(E::from_acc(out)), Shape::from(f)))
}

impl CustomOp1 for ColumnSum {
    fn name(&self) -> &'static str {
        "column-sum"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s, colsum(self.f, s, l))
    }
}

/// Fused `x + b`: `x` `[N, F]`, `b` `[F]` -> `[N, F]`, dtype of `x` (16-bit: added in f32,
/// rounded once, as candle's own bf16/f16 add). Gradients: `dx = g` (the same tensor),
/// `db = sum_n g_n` (accumulated in the compute dtype in blocks of
/// [`SUM_BLOCK_ROWS`](super::SUM_BLOCK_ROWS) rows).
/// Errors: shapes that do not match, mixed or unsupported dtypes.
pub fn bias_add(x: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let f = x.dim(candle_core::D::Minus1)?;
    if b.elem_count() != f {
        candle_core::bail!("bias_add: x {:?} vs bias {:?}", x.dims(), b.dims());
    }
    same_dtype("bias_add", &[("x", x), ("bias", b)])?;
    x.contiguous()?.apply_op2(&b.contiguous()?, BiasAdd)
}

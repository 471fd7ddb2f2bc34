//! Composite formulations of the fused ops in [`super::ops`], built only from candle-core
//! primitives that have CUDA kernels (candle-core's `cuda_backend` with the `candle-kernels`
//! PTX, cuBLAS for matrix products), and differentiated by candle autograd. This is the path a
//! GPT unit takes on a CUDA device ([`super::OpsPath`]); on the CPU it runs too (same code, CPU
//! kernels), which is how it is tested against the fused ops
//! (`engine/tests/model_device.rs`).
//!
//! Each function has the signature and the contract of its fused counterpart: same shapes, same
//! errors for bad input (mixed dtypes, a token id or target `>= V`, mismatched shapes), same
//! result dtype.
//!
//! # Precision: the fused ops' contract
//!
//! - f32 and f64 compute in their own precision.
//! - bf16 and f16 are storage only, as in the fused ops (Micikevicius et al. 2018, §3): every
//!   input of an op is widened once with `to_dtype(F32)` (exact), the whole op — the LayerNorm
//!   statistics, the softmax max/exp/sum, `x + b` and the GELU, the bias and embedding
//!   gradients, the cross-entropy — runs in f32, and the output is narrowed once with
//!   `to_dtype` (round to nearest even). Autograd mirrors that: the gradient arriving at the
//!   narrowing is widened exactly, the op's backward runs in f32, and each input gradient is
//!   rounded once when it crosses the widening (so `dw`, `db` and the embedding rows are summed
//!   over the tokens in f32, never in 16 bits).
//! - [`cross_entropy_sum`] returns the F32 loss for bf16/f16 logits (never rounded to 16 bits);
//!   its upstream gradient stays f32 down to the logits gradient, rounded once.
//! - Matrix products are not here: they stay in the parameter dtype on both paths.
//!
//! The results are not bitwise those of the fused ops (different operation order in the
//! reductions; candle's `exp`/`tanh` against the fused ops' polynomial `exp`; candle's GELU
//! backward uses 6-significant-digit constants), only within f32 rounding of them; in 16 bits
//! a value that lands within that distance of a rounding boundary rounds the other way
//! (measured in `engine/tests/model_device.rs`).
//!
//! # The candle CUDA kernels this relies on
//!
//! Checked in candle-core 0.11.1 `cuda_backend/mod.rs` and candle-kernels 0.11.1 (`*.cu`):
//! `cast_{bf16,f16}_f32` / `cast_f32_{bf16,f16}` (to_dtype); `affine_f32` (affine, scalar
//! add/mul, `mean`); `badd/bsub/bmul/bdiv_f32` (broadcast binary ops, strided); `uexp_f32`,
//! `ulog_f32`, `usqr_f32`, `usqrt_f32`, `urecip_f32`, `ugelu_f32`, `utanh_f32`, `upowf_f32`
//! (unary, and the GELU backward); `fast_sum_f32`, `fast_max_f32`, `fast_max_u32` (reductions
//! with keepdim; the u32 max checks ids and targets); `is_u32_f32` / `ia_u32_f32`
//! (index_select and its backward index_add), `gather_u32_f32` / `sa_u32_f32` (gather and its
//! backward scatter_add); `gt_u32` and `where_u8_f32` (the causal mask, built on the device);
//! `const_set_f32` (zeros, full); `ucopy_*` / `copy2d_*` (contiguous, narrow and its backward).
//! bf16 kernels need compute capability 8.0 (the H200 is 9.0). None of these is a CPU-only op.

use candle_core::{DType, Tensor, D};

use super::ops;

/// Whether `t` is 16-bit float storage (bf16, f16), which these ops widen to f32.
fn is_half(t: &Tensor) -> bool {
    matches!(t.dtype(), DType::BF16 | DType::F16)
}

/// `t` in the dtype the op computes in ([`ops::compute_dtype`]): a widened copy for bf16/f16,
/// the tensor itself otherwise (candle's `to_dtype` to the same dtype is a no-op).
fn widen(t: &Tensor) -> candle_core::Result<Tensor> {
    t.to_dtype(ops::compute_dtype(t.dtype()))
}

/// Refuses dtypes the model never computes in (the fused ops accept f32, f64, bf16, f16).
fn float_dtype(op: &str, t: &Tensor) -> candle_core::Result<()> {
    if !matches!(
        t.dtype(),
        DType::F32 | DType::F64 | DType::BF16 | DType::F16
    ) {
        candle_core::bail!(
            "{op}: dtype {:?} is not supported (f32, f64, bf16, f16)",
            t.dtype()
        );
    }
    Ok(())
}

/// The largest u32 in `ids` (any shape, at least one element), read back to the host: one
/// device-to-host copy of a scalar (a synchronisation on CUDA), the price of refusing a bad
/// token id or target with an error instead of reading out of bounds on the device.
fn max_id(ids: &Tensor) -> candle_core::Result<Option<u32>> {
    if ids.elem_count() == 0 {
        return Ok(None);
    }
    Ok(Some(ids.flatten_all()?.max(0)?.to_scalar::<u32>()?))
}

/// Composite LayerNorm over the last dim (Ba et al. 2016): `x` `[N, D]` (any leading dims),
/// `w` `[D]`, optional `b` `[D]` -> same shape and dtype as `x`:
/// `(x - mean) * rstd * w + b` with `rstd = 1 / sqrt(var + eps)`, biased variance (two passes,
/// as [`ops::layer_norm`]). bf16/f16: statistics and affine in f32, rounded once.
/// Errors: mixed or unsupported dtypes, `x`'s last dim not `D`.
pub fn layer_norm(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f64,
) -> candle_core::Result<Tensor> {
    let d = w.elem_count();
    if x.dim(D::Minus1)? != d {
        candle_core::bail!("layer_norm: x {:?} vs weight [{d}]", x.dims());
    }
    let mut inputs = vec![("x", x), ("weight", w)];
    if let Some(b) = b {
        if b.elem_count() != d {
            candle_core::bail!("layer_norm: bias {:?} vs weight [{d}]", b.dims());
        }
        inputs.push(("bias", b));
    }
    ops::same_dtype("layer_norm", &inputs)?;
    float_dtype("layer_norm", x)?;
    let (x32, w32) = (widen(x)?, widen(w)?);
    let mean = x32.mean_keepdim(D::Minus1)?;
    let xc = x32.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let rstd = (var + eps)?.sqrt()?.recip()?;
    let y = xc.broadcast_mul(&rstd)?.broadcast_mul(&w32)?;
    let y = match b {
        Some(b) => y.broadcast_add(&widen(b)?)?,
        None => y,
    };
    y.to_dtype(x.dtype())
}

/// The additive causal mask `[T, T]` in `dtype` on `device`: 0 where `j <= i`, `-inf` where
/// `j > i`. Built on the device (`arange`, a broadcast `>` on u32, `where_cond`), so no `T x T`
/// host buffer crosses to the GPU per call; it is a constant (no gradient).
fn causal_mask(
    t: usize,
    dtype: DType,
    device: &candle_core::Device,
) -> candle_core::Result<Tensor> {
    let i = Tensor::arange(0u32, t as u32, device)?;
    let above = i.reshape((1, t))?.broadcast_gt(&i.reshape((t, 1))?)?; // u8, 1 where j > i
    let neg = Tensor::full(f32::NEG_INFINITY, (t, t), device)?.to_dtype(dtype)?;
    let zero = Tensor::zeros((t, t), dtype, device)?;
    above.where_cond(&neg, &zero)
}

/// Composite scaled causal softmax over the last dim of scores `s` `[..., T, T]`:
/// `softmax(scale * s + mask)`, `mask[i][j] = -inf` for `j > i` (masked probabilities are
/// exactly 0 and get exactly 0 gradient), as [`ops::causal_softmax`]: the row max (a constant
/// for autograd) subtracted before `exp`, the row sum inverted once and multiplied in.
/// bf16/f16: computed in f32, the probabilities rounded once. Errors: last two dims not equal,
/// unsupported dtype.
pub fn causal_softmax(s: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    let dims = s.dims();
    if dims.len() < 2 || dims[dims.len() - 1] != dims[dims.len() - 2] {
        candle_core::bail!("causal_softmax: scores must be [..., T, T], got {dims:?}");
    }
    float_dtype("causal_softmax", s)?;
    let t = dims[dims.len() - 1];
    let s32 = widen(s)?;
    let mask = causal_mask(t, s32.dtype(), s.device())?;
    let z = s32.affine(scale, 0.0)?.broadcast_add(&mask)?;
    let max = z.max_keepdim(D::Minus1)?.detach();
    let e = z.broadcast_sub(&max)?.exp()?;
    let inv = e.sum_keepdim(D::Minus1)?.recip()?;
    e.broadcast_mul(&inv)?.to_dtype(s.dtype())
}

/// Composite `gelu(x + b)`, tanh approximation (Hendrycks & Gimpel 2016, as GPT-2), through
/// candle's `gelu` (one kernel forward; its autograd backward is candle's formula with
/// 6-significant-digit constants, relative error below 1e-6 of the derivative): `x` `[N, F]`,
/// optional `b` `[F]` -> `[N, F]`, dtype of `x`. bf16/f16: `x + b` and the GELU in f32 (the
/// sum is not rounded to 16 bits), the output rounded once; the bias gradient summed in f32.
/// Errors: mixed or unsupported dtypes, shapes.
pub fn bias_gelu(x: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    float_dtype("bias_gelu", x)?;
    let x32 = widen(x)?;
    let z = match b {
        Some(b) => {
            let f = x.dim(D::Minus1)?;
            if b.elem_count() != f {
                candle_core::bail!("bias_gelu: x {:?} vs bias {:?}", x.dims(), b.dims());
            }
            ops::same_dtype("bias_gelu", &[("x", x), ("bias", b)])?;
            x32.broadcast_add(&widen(b)?)?
        }
        None => x32,
    };
    z.gelu()?.to_dtype(x.dtype())
}

/// Composite `x + b`: `x` `[N, F]`, `b` `[F]` -> `[N, F]`, dtype of `x`. bf16/f16: added in
/// f32 and rounded once (the same bits as the fused op and candle's 16-bit add), so the bias
/// gradient is summed over the rows in f32 and `dx` is the upstream gradient exactly.
/// Errors: shapes, mixed or unsupported dtypes.
pub fn bias_add(x: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let f = x.dim(D::Minus1)?;
    if b.elem_count() != f {
        candle_core::bail!("bias_add: x {:?} vs bias {:?}", x.dims(), b.dims());
    }
    ops::same_dtype("bias_add", &[("x", x), ("bias", b)])?;
    float_dtype("bias_add", x)?;
    if is_half(x) {
        return widen(x)?.broadcast_add(&widen(b)?)?.to_dtype(x.dtype());
    }
    x.broadcast_add(b)
}

/// Composite summed cross-entropy: `logits` `[N, V]`, `targets` u32 `[N]` -> a 0-dim scalar
/// `sum_n (logsumexp(logits_n) - logits_n[targets_n])` in nats (f32 sum; the fused op sums in
/// f64), of dtype [`ops::compute_dtype`]`(logits.dtype())`: F32 for f32, bf16 and f16 logits,
/// F64 for f64. The logsumexp subtracts the row max (a constant for autograd); the target
/// logit is a `gather`. Gradient flows to `logits` (`g (softmax - onehot)` by autograd), in
/// the logits' dtype. Errors: a target `>= V` (checked on the host: one scalar read-back),
/// `N` mismatch, unsupported dtype.
pub fn cross_entropy_sum(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let (n, v) = logits.dims2()?;
    if targets.elem_count() != n {
        candle_core::bail!(
            "cross_entropy: {n} logit rows but {} targets",
            targets.elem_count()
        );
    }
    if targets.dtype() != DType::U32 {
        candle_core::bail!(
            "cross_entropy: targets must be u32, got {:?}",
            targets.dtype()
        );
    }
    float_dtype("cross_entropy", logits)?;
    if let Some(m) = max_id(targets)? {
        if m as usize >= v {
            candle_core::bail!("cross_entropy: target {m} >= vocab size {v}");
        }
    }
    let z = widen(logits)?;
    let max = z.max_keepdim(D::Minus1)?.detach();
    let lse = (z
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + max)?;
    let picked = z.gather(
        &targets.flatten_all()?.reshape((n, 1))?.contiguous()?,
        D::Minus1,
    )?;
    (lse - picked)?.sum_all()
}

/// Composite token + position embedding: `wte` `[V, D]`, `wpe` `[P, D]`, `ids` u32 `[B, T]`
/// (`T <= P`) -> `[B * T, D]`, row `b T + i` = `wte[ids[b][i]] + wpe[i]` (`index_select`,
/// a broadcast add), dtype of `wte`. bf16/f16: the tables are widened to f32 (the gathered
/// rows are exact), the sum rounded once, and the gradient rows of repeated tokens (the
/// `index_add` of `index_select`'s backward) and of each position over the batch are summed
/// in f32 and rounded once, as [`ops::embedding`]. Errors: a token id `>= V` (checked on the
/// host: one scalar read-back), `T > P`, mixed or unsupported dtypes.
pub fn embedding(wte: &Tensor, wpe: &Tensor, ids: &Tensor) -> candle_core::Result<Tensor> {
    let (b, t) = ids.dims2()?;
    let (v, d) = wte.dims2()?;
    let p = wpe.dim(0)?;
    if t > p {
        candle_core::bail!("Embed: sequence length {t} exceeds n_positions {p}");
    }
    if ids.dtype() != DType::U32 {
        candle_core::bail!("Embed: token ids must be u32, got {:?}", ids.dtype());
    }
    ops::same_dtype("embedding", &[("wte", wte), ("wpe", wpe)])?;
    float_dtype("embedding", wte)?;
    if let Some(m) = max_id(ids)? {
        if m as usize >= v {
            candle_core::bail!("Embed: token id {m} >= vocab_size {v}");
        }
    }
    let flat = ids.flatten_all()?.contiguous()?;
    // The table the rows are selected from is a node of its own (the widened copy, or for
    // f32/f64 an exact `1 * wte + 0`), so `index_select`'s backward `index_add`s the token rows
    // into fresh zeros and the result reaches `wte` as ONE term: with a tied LM head,
    // `dwte = d(head) + d(embedding)` is then the same bits whether the stages run in one
    // graph or one unit at a time (as the fused op's packed gradient).
    let table = if is_half(wte) {
        widen(&wte.contiguous()?)?
    } else {
        wte.contiguous()?.affine(1.0, 0.0)?
    };
    let tok = table.index_select(&flat, 0)?.reshape((b, t, d))?;
    let h = tok.broadcast_add(&widen(wpe)?.narrow(0, 0, t)?)?;
    h.reshape((b * t, d))?.to_dtype(wte.dtype())
}

// The composite ops under the names of the reference functions they replaced.

/// `x + b` from candle primitives: the same function as [`bias_add`] (this name is
/// kept for existing callers).
pub fn bias_add_ref(x: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    bias_add(x, b)
}

/// `gelu(x + b)` (tanh approximation) from candle primitives: the same function as
/// [`bias_gelu`] (this name is kept for existing callers).
pub fn gelu_ref(x: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    bias_gelu(x, b)
}

/// LayerNorm from candle primitives: the same function as [`layer_norm`] (this
/// name is kept for existing callers).
pub fn layer_norm_ref(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f64,
) -> candle_core::Result<Tensor> {
    layer_norm(x, w, b, eps)
}

/// Causal softmax from candle primitives: the same function as [`causal_softmax`]
/// (this name is kept for existing callers).
pub fn causal_softmax_ref(s: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    causal_softmax(s, scale)
}

/// Summed cross-entropy from candle primitives: the same function as
/// [`cross_entropy_sum`] (this name is kept for existing callers).
pub fn cross_entropy_sum_ref(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    cross_entropy_sum(logits, targets)
}

//! Fused rotary position embedding (Su et al. 2021, "RoFormer: Enhanced Transformer with
//! Rotary Position Embedding", §3.4.2, eq. 34) of queries and keys, in the "rotate half"
//! layout of Hugging Face `transformers` (`x * cos + rotate_half(x) * sin` with the frequency
//! table repeated for both halves), fused with grouped-query attention's key/value head
//! repetition (Ainslie et al. 2023, `transformers`' `repeat_kv`) and the packing of the
//! `[B·T, 3D]` rows the fused causal attention ([`super::causal_attention`]) reads.
//!
//! For a head row `x` of `hd` elements at position `p`, halves `x1 = x[..hd/2]`,
//! `x2 = x[hd/2..]`, and the angles `p · inv_freq[i]` (`cos`, `sin` tables `[T, hd/2]`):
//! `y1 = x1 cos - x2 sin`, `y2 = x2 cos + x1 sin` (the composite path's operations in the same
//! order, so the same bits for f32). The rotation is orthogonal and linear, so its backward is
//! the rotation by the negated angle: `dx1 = g1 cos + g2 sin`, `dx2 = g2 cos - g1 sin`, and the
//! op keeps nothing for backward (no saved tensor; the graph holds its inputs, the projection
//! outputs). The gradient of a key/value head is the sum over the `n_head / n_kv_head` query
//! heads that read it (in head order), then (keys) rotated back.

use super::elem::{dispatch, same_dtype, view, Elem, Flt};
use super::rows::map_rows;
use super::simd::{add_into, simd_kernel};
use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Shape, Tensor};

/// The rotary angles' `cos` and `sin`, `[T, hd/2]` each, row-major, in f64 (rounded to the
/// compute dtype once per op call, as the composite path's tables).
#[derive(Clone)]
struct RopeTables {
    t: usize,
    half: usize,
    cos: std::sync::Arc<Vec<f64>>,
    sin: std::sync::Arc<Vec<f64>>,
}

impl RopeTables {
    /// The tables in compute type `T`.
    fn of<T: Flt>(&self) -> (Vec<T>, Vec<T>) {
        (
            self.cos.iter().map(|&v| T::of(v)).collect(),
            self.sin.iter().map(|&v| T::of(v)).collect(),
        )
    }
}

/// The sizes of one packed `[B·T, 3D]` row: `h` query heads, `kv` key/value heads of `hd`
/// elements.
#[derive(Clone, Copy)]
struct Heads {
    h: usize,
    kv: usize,
    hd: usize,
}

simd_kernel!(
    /// Rotates each `hd`-element head of `x` by its position's angles (`c`, `s`: `hd/2`
    /// each) into `y`; `neg` rotates by the negated angles (the backward).
    fn rope_row = rope_row_impl(x: &[T], c: &[T], s: &[T], neg: bool, y: &mut [T])
);
#[inline(always)]
fn rope_row_impl<T: Flt>(x: &[T], c: &[T], s: &[T], neg: bool, y: &mut [T]) {
    let half = c.len();
    for (xh, yh) in x.chunks_exact(2 * half).zip(y.chunks_exact_mut(2 * half)) {
        let (x1, x2) = xh.split_at(half);
        let (y1, y2) = yh.split_at_mut(half);
        if neg {
            for i in 0..half {
                y1[i] = x1[i].mul(c[i]).add(x2[i].mul(s[i]));
                y2[i] = x2[i].mul(c[i]).sub(x1[i].mul(s[i]));
            }
        } else {
            for i in 0..half {
                y1[i] = x1[i].mul(c[i]).sub(x2[i].mul(s[i]));
                y2[i] = x2[i].mul(c[i]).add(x1[i].mul(s[i]));
            }
        }
    }
}

struct RopeQkv {
    tables: RopeTables,
    heads: Heads,
}

fn rq_fwd<E: Elem>(
    op: &RopeQkv,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let Heads { h, kv, hd } = op.heads;
    let (d, dkv) = (h * hd, kv * hd);
    let q = view::<E>("rope_qkv", s1, l1)?;
    let k = view::<E>("rope_qkv", s2, l2)?;
    let v = view::<E>("rope_qkv", s3, l3)?;
    let n = q.len().checked_div(d).unwrap_or(0);
    if k.len() != n * dkv || v.len() != n * dkv {
        candle_core::bail!(
            "rope_qkv: q {:?}, k {:?}, v {:?} are not [N, {d}], [N, {dkv}], [N, {dkv}]",
            l1.dims(),
            l2.dims(),
            l3.dims()
        );
    }
    let (t, half) = (op.tables.t, op.tables.half);
    let (cos, sin) = op.tables.of::<E::Acc>();
    let rep = h / kv;
    let zero = <E::Acc as Flt>::zero();
    let y = map_rows::<E, _>(n, 3 * d, 0, |r, s, out| {
        let p = r % t;
        let (c, sn) = (
            &cos[p * half..(p + 1) * half],
            &sin[p * half..(p + 1) * half],
        );
        let (oq, rest) = out.split_at_mut(d);
        let (ok, ov) = rest.split_at_mut(d);
        let qr = E::acc(&q[r * d..(r + 1) * d], &mut s.a);
        rope_row(qr, c, sn, false, oq);
        let kr = E::acc(&k[r * dkv..(r + 1) * dkv], &mut s.b);
        s.d.resize(dkv, zero);
        rope_row(kr, c, sn, false, &mut s.d);
        let vr = E::acc(&v[r * dkv..(r + 1) * dkv], &mut s.c);
        for (j, (okh, ovh)) in ok
            .chunks_exact_mut(hd)
            .zip(ov.chunks_exact_mut(hd))
            .enumerate()
        {
            let g = j / rep;
            okh.copy_from_slice(&s.d[g * hd..(g + 1) * hd]);
            ovh.copy_from_slice(&vr[g * hd..(g + 1) * hd]);
        }
    });
    Ok((E::wrap(y), Shape::from((n, 3 * d))))
}

impl CustomOp3 for RopeQkv {
    fn name(&self) -> &'static str {
        "fused-rope-qkv"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s1, rq_fwd(self, s1, l1, s2, l2, s3, l3))
    }
    fn bwd(
        &self,
        _q: &Tensor,
        _k: &Tensor,
        _v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let part = |part| {
            grad.apply_op1_no_bwd(&RopeQkvBwd {
                tables: self.tables.clone(),
                heads: self.heads,
                part,
            })
        };
        Ok((Some(part(0)?), Some(part(1)?), Some(part(2)?)))
    }
}

/// One part of the backward of [`rope_qkv`] from the packed gradient `[N, 3D]`: `part` 0 the
/// query gradient `[N, D]` (rotated back), 1 the key gradient `[N, KV hd]` (summed over each
/// group's query heads, rotated back), 2 the value gradient `[N, KV hd]` (summed).
struct RopeQkvBwd {
    tables: RopeTables,
    heads: Heads,
    part: usize,
}

fn rq_bwd<E: Elem>(
    op: &RopeQkvBwd,
    s1: &CpuStorage,
    l1: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let Heads { h, kv, hd } = op.heads;
    let (d, dkv) = (h * hd, kv * hd);
    let g = view::<E>("rope_qkv_bwd", s1, l1)?;
    let n = g.len().checked_div(3 * d).unwrap_or(0);
    let (t, half) = (op.tables.t, op.tables.half);
    let (cos, sin) = op.tables.of::<E::Acc>();
    let rep = h / kv;
    let zero = <E::Acc as Flt>::zero();
    let part = op.part;
    let w = if part == 0 { d } else { dkv };
    let out = map_rows::<E, _>(n, w, 0, |r, s, out| {
        let p = r % t;
        let (c, sn) = (
            &cos[p * half..(p + 1) * half],
            &sin[p * half..(p + 1) * half],
        );
        let row = &g[r * 3 * d..(r + 1) * 3 * d];
        if part == 0 {
            let gq = E::acc(&row[..d], &mut s.a);
            rope_row(gq, c, sn, true, out);
            return;
        }
        let src = E::acc(&row[part * d..(part + 1) * d], &mut s.a);
        let sum: &mut [E::Acc] = if part == 1 {
            s.d.resize(dkv, zero);
            &mut s.d
        } else {
            &mut *out
        };
        for (gi, acc) in sum.chunks_exact_mut(hd).enumerate() {
            let heads = &src[gi * rep * hd..(gi + 1) * rep * hd];
            acc.copy_from_slice(&heads[..hd]);
            for hh in heads.chunks_exact(hd).skip(1) {
                add_into(acc, hh);
            }
        }
        if part == 1 {
            rope_row(&s.d, c, sn, true, out);
        }
    });
    Ok((E::wrap(out), Shape::from((n, w))))
}

impl CustomOp1 for RopeQkvBwd {
    fn name(&self) -> &'static str {
        "fused-rope-qkv-bwd"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(self.name(), s, rq_bwd(self, s, l))
    }
}

/// The angle tables and head layout of [`rope_qkv`].
#[derive(Debug, Clone, Copy)]
pub struct Rotary<'a> {
    /// `cos` of the angles, f64 `[T·hd/2]` (row `p` the angles `p · inv_freq`).
    pub cos: &'a [f64],
    /// `sin` of the same angles.
    pub sin: &'a [f64],
    /// Tokens per sequence `T`.
    pub t: usize,
    /// Query heads `H`.
    pub n_head: usize,
    /// Key/value heads `KV` (`H` a multiple of it).
    pub n_kv_head: usize,
}

/// Rotary embedding of the queries and keys with the key/value heads repeated for their
/// queries, packed for [`super::causal_attention`]: `q` `[B·T, H·hd]`, `k` and `v`
/// `[B·T, KV·hd]` (rows in (sequence, position) order, heads in order within a row), the
/// angles' `cos` and `sin` as f64 `[T·hd/2]` (row `p` the angles `p · inv_freq`), ->
/// `[B·T, 3·H·hd]` rows `[rope(q) | rope(k) repeated | v repeated]`, query head `j` reading
/// key/value head `j / (H / KV)`. Dtype of `q` (f32, f64, or bf16/f16 computed in f32 and
/// rounded once; the tables are rounded to the compute dtype first, as the composite path
/// does). Gradients flow to `q`, `k` and `v`; every row's bits are independent of the thread
/// count. Algorithm: Su et al. 2021 (RoFormer), in `transformers`' rotate-half layout; see the
/// module docs.
///
/// Errors: `H` not a multiple of `KV`, odd `hd`, tables of another length than `T·hd/2`,
/// `B·T` not a multiple of `T`, shapes that do not match, mixed or unsupported dtypes.
pub fn rope_qkv(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    rotary: Rotary<'_>,
) -> candle_core::Result<Tensor> {
    let Rotary {
        cos,
        sin,
        t,
        n_head,
        n_kv_head,
    } = rotary;
    let (n, d) = q.dims2()?;
    if n_head == 0 || n_kv_head == 0 || !n_head.is_multiple_of(n_kv_head) {
        candle_core::bail!("rope_qkv: {n_head} heads is not a multiple of {n_kv_head} KV heads");
    }
    if !d.is_multiple_of(n_head) || !(d / n_head).is_multiple_of(2) {
        candle_core::bail!("rope_qkv: q [{n}, {d}] has no even head dimension for {n_head} heads");
    }
    let hd = d / n_head;
    let half = hd / 2;
    if cos.len() != t * half || sin.len() != t * half {
        candle_core::bail!(
            "rope_qkv: cos/sin have {}/{} angles, expected T {t} x {half}",
            cos.len(),
            sin.len()
        );
    }
    if t == 0 || !n.is_multiple_of(t) {
        candle_core::bail!("rope_qkv: {n} rows are not whole sequences of {t} tokens");
    }
    for (name, x) in [("k", k), ("v", v)] {
        if x.dims() != [n, n_kv_head * hd] {
            candle_core::bail!(
                "rope_qkv: {name} {:?} vs [{n}, {}] ({n_kv_head} KV heads of {hd})",
                x.dims(),
                n_kv_head * hd
            );
        }
    }
    same_dtype("rope_qkv", &[("q", q), ("k", k), ("v", v)])?;
    let op = RopeQkv {
        tables: RopeTables {
            t,
            half,
            cos: std::sync::Arc::new(cos.to_vec()),
            sin: std::sync::Arc::new(sin.to_vec()),
        },
        heads: Heads {
            h: n_head,
            kv: n_kv_head,
            hd,
        },
    };
    q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}

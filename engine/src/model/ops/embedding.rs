//! Token + position embedding: h[n] = wte[ids[n]] + wpe[n mod T].

use super::elem::{dispatch, same_dtype, u32_view, view, Elem, Flt};
use super::rows::map_rows;
use super::simd::{add_into, bias_add_row};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};

struct Embedding {
    t: usize,
}

fn emb_fwd<E: Elem>(
    t: usize,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let wte = view::<E>("embedding", s1, l1)?;
    let wpe = view::<E>("embedding", s2, l2)?;
    let ids = u32_view("embedding", s3, l3)?;
    let (v, d) = l1.shape().dims2()?;
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= v) {
        candle_core::bail!("Embed: token id {id} >= vocab_size {v}");
    }
    let h = map_rows::<E, _>(ids.len(), d, 0, |n, s, hr| {
        let id = ids[n] as usize;
        let tok = E::acc(&wte[id * d..(id + 1) * d], &mut s.a);
        let p = n % t;
        let pos = E::acc(&wpe[p * d..(p + 1) * d], &mut s.b);
        bias_add_row(tok, pos, hr);
    });
    Ok((E::wrap(h), Shape::from((ids.len(), d))))
}

impl CustomOp3 for Embedding {
    fn name(&self) -> &'static str {
        "fused-embedding"
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
        dispatch!(self.name(), s1, emb_fwd(self.t, s1, l1, s2, l2, s3, l3))
    }
    fn bwd(
        &self,
        wte: &Tensor,
        wpe: &Tensor,
        ids: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let v = wte.dim(0)?;
        let p = wpe.dim(0)?;
        let packed = grad
            .contiguous()?
            .apply_op2_no_bwd(ids, &EmbeddingBwd { t: self.t, v, p })?;
        Ok((
            Some(packed.narrow(0, 0, v)?),
            Some(packed.narrow(0, v, p)?),
            None,
        ))
    }
}

/// Backward of the embedding: inputs `(g [N, D], ids u32 [N])`, output packed `[V + P, D]`:
/// `dwte` (rows of `g` added into row `ids[n]`, in order `n = 0, 1, ...`) then `dwpe` (row
/// `p` = sum over sequences of `g[b T + p]`, rows `>= T` zero), accumulated in the compute
/// dtype (an f32 `[V + P, D]` buffer for 16-bit `g`) and narrowed once. The result is a fresh
/// sum, so candle adds it to any other gradient of `wte` (a tied LM head) as ONE term: the
/// total is the same bits whether the stages run in one graph or one unit at a time.
struct EmbeddingBwd {
    t: usize,
    v: usize,
    p: usize,
}

fn emb_bwd<E: Elem>(
    (t, v, p): (usize, usize, usize),
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let g = view::<E>("embedding_bwd", s1, l1)?;
    let ids = u32_view("embedding_bwd", s2, l2)?;
    let d = g.len() / ids.len().max(1);
    let mut out = vec![<E::Acc as Flt>::zero(); (v + p) * d];
    let (dwte, dwpe) = out.split_at_mut(v * d);
    let mut gbuf = Vec::new();
    for (n, (&id, gr)) in ids.iter().zip(g.chunks_exact(d)).enumerate() {
        let gr = E::acc(gr, &mut gbuf);
        add_into(&mut dwte[id as usize * d..(id as usize + 1) * d], gr);
        let pos = n % t;
        add_into(&mut dwpe[pos * d..(pos + 1) * d], gr);
    }
    Ok((E::wrap(E::from_acc(out)), Shape::from((v + p, d))))
}

impl CustomOp2 for EmbeddingBwd {
    fn name(&self) -> &'static str {
        "fused-embedding-bwd"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(
            self.name(),
            s1,
            emb_bwd((self.t, self.v, self.p), s1, l1, s2, l2)
        )
    }
}

/// Fused token + position embedding: `wte` `[V, D]`, `wpe` `[P, D]`, `ids` u32 `[B, T]` (`T <=
/// P`) -> `[B * T, D]`, row `b T + i` = `wte[ids[b][i]] + wpe[i]`, dtype of `wte` (16-bit: the
/// sum in f32, rounded once). Gradients flow to `wte` and `wpe`. Errors: a token id `>= V`,
/// `T > P`, mixed or unsupported dtypes.
pub fn embedding(wte: &Tensor, wpe: &Tensor, ids: &Tensor) -> candle_core::Result<Tensor> {
    let (_b, t) = ids.dims2()?;
    let p = wpe.dim(0)?;
    if t > p {
        candle_core::bail!("Embed: sequence length {t} exceeds n_positions {p}");
    }
    same_dtype("embedding", &[("wte", wte), ("wpe", wpe)])?;
    wte.contiguous()?.apply_op3(
        &wpe.contiguous()?,
        &ids.flatten_all()?.contiguous()?,
        Embedding { t },
    )
}

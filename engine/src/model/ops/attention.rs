//! Fused causal multi-head self-attention (Vaswani et al. 2017, "Attention Is All You Need",
//! §3.2.1-3.2.2, with the decoder's causal mask) on the CPU: one candle custom op from the
//! `[B*T, 3D]` output of the qkv projection to the `[B*T, D]` attention output, and one for
//! its backward.
//!
//! # Algorithm
//!
//! For each (sequence `b`, head `h`) pair independently, with `Q`, `K`, `V` the `[T, hd]`
//! head views of the qkv rows (`hd = D / H`; `Q` at column `h*hd`, `K` at `D + h*hd`, `V` at
//! `2D + h*hd`, row stride `3D`: read in place, never copied for f32/f64) and
//! `sc = 1 / sqrt(hd)`:
//!
//! - forward, in row blocks `[i0, i1)` of [`ATTN_BLOCK_ROWS`] rows: `S = Q[i0..i1] K[0..i1]^T`
//!   (one GEMM; the columns past the block's last row are never computed), `P = causal
//!   softmax(sc S)` per row (the row kernel of [`super::causal_softmax`]: `e^((s - max) sc)`,
//!   8-lane sum, one f64 reciprocal; masked entries exactly 0), `Y[i0..i1] = P[i0..i1, 0..i1]
//!   V[0..i1]` (one GEMM) stored at column `h*hd` of the `[B*T, D]` output (no transpose copy).
//!   The op keeps `P` (`[B, H, T, T]`, the input dtype, masked entries 0) for backward; the
//!   graph keeps `qkv` anyway.
//! - backward, with `dY` the output gradient: per row block `dP = dY[i0..i1] V[0..i1]^T`,
//!   `dS = sc P ⊙ (dP − rowsum(dP ⊙ P))` (the softmax backward identity `∂y_j/∂x_k =
//!   y_j (δ_jk − y_k)`, the kernel of the fused causal softmax backward), `dQ[i0..i1] =
//!   dS[i0..i1, 0..i1] K[0..i1]`; then per column block `[j0, j1)`: `dK[j0..j1] = dS[j0..T,
//!   j0..j1]^T Q[j0..T]` and `dV[j0..j1] = P[j0..T, j0..j1]^T dY[j0..T]` (the causal zeros
//!   are skipped). All three are written straight into one `[B*T, 3D]` gradient of `qkv`, at
//!   the columns `q`, `k` and `v` came from; `dS` lives in a per-task `[T, T]` scratch.
//!
//! The GEMMs are the `gemm` crate's (the kernels candle's CPU matmul runs), called
//! single-threaded on each pair. Pairs run in parallel tasks in the current rayon pool when it
//! has more than one thread; a pair's computation depends only on `T`, `hd` and its own rows,
//! never on the other pairs, the thread count, the world size or the batch split, so the op's
//! bits do not either (tested in `engine/tests/model_ops_accuracy/attention.rs`).
//!
//! # Dtypes
//!
//! f32 and f64 compute in their own precision on the tensors in place. bf16 and f16 are
//! storage only, as for every fused op ([`super`] module docs): each pair's `Q`, `K`, `V` (and
//! in backward `dY`, `P`) are widened exactly to f32 into per-task scratch, the f32 algorithm
//! runs, and `Y`, `P` and the gradient are rounded once to the input dtype. The saved `P` is
//! rounded (as the fused causal softmax's saved output): the forward's `Y` uses the unrounded
//! f32 `P`, the backward the rounded one.

use super::elem::{dispatch, view, Elem, Flt};
use super::simd::{lane_dot, lane_extreme, lane_sum, simd_kernel};
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Shape, Tensor};
use candle_core::{Device, Storage};
use rayon::prelude::*;
use std::mem::MaybeUninit;
use std::sync::Mutex;

/// Rows per block of the fused attention (forward row blocks, backward row and column blocks):
/// the unit by which the causal upper triangle is skipped (only the block diagonal computes
/// masked entries, as zeros). Fixed, so a pair's bits depend only on its input.
pub const ATTN_BLOCK_ROWS: usize = 64;

/// A raw output pointer shared by the parallel tasks, each writing its own disjoint elements.
#[derive(Clone, Copy)]
struct SharedOut<T>(*mut T);
// SAFETY: the tasks write disjoint elements (see each use) and nothing reads them until every
// task has finished.
unsafe impl<T> Send for SharedOut<T> {}
unsafe impl<T> Sync for SharedOut<T> {}
impl<T> SharedOut<T> {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper).
    fn ptr(self) -> *mut T {
        self.0
    }
}

/// `dst[m x n] = lhs[m x k] · rhs[k x n]` by the `gemm` crate, single-threaded, `dst` row-major
/// with row stride `dst_rs` (elements), `lhs`/`rhs` addressed by (column stride, row stride).
///
/// Safety: every addressed element of `lhs`, `rhs` and `dst` must be valid (and `dst`
/// writable and not aliased by `lhs`/`rhs`).
unsafe fn mm<T: Flt>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    dst_rs: usize,
    lhs: *const T,
    (lhs_cs, lhs_rs): (usize, usize),
    rhs: *const T,
    (rhs_cs, rhs_rs): (usize, usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: forwarded to the caller; `read_dst = false`, so `dst = 1 · lhs · rhs`
    // (`alpha` scales the old `dst`, `beta` the product).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            false,
            lhs,
            lhs_cs as isize,
            lhs_rs as isize,
            rhs,
            rhs_cs as isize,
            rhs_rs as isize,
            T::zero(),
            T::of(1.0),
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

simd_kernel!(
    /// In place: `x_j <- softmax_j(sc x)` over the row's unmasked part `x`.
    fn softmax_inplace = softmax_inplace_impl(x: &mut [T], sc: T)
);
/// The operations of `softmax_row_impl` in the same order (so the same bits), in place.
#[inline(always)]
fn softmax_inplace_impl<T: Flt>(x: &mut [T], sc: T) {
    let m = if sc.lt(T::zero()) {
        lane_extreme::<T, false>(x)
    } else {
        lane_extreme::<T, true>(x)
    };
    for v in x.iter_mut() {
        *v = v.sub(m).mul(sc).exp_fast();
    }
    let inv = T::of(1.0 / lane_sum(x).f());
    for v in x.iter_mut() {
        *v = v.mul(inv);
    }
}

simd_kernel!(
    /// In place: `g_j <- sc y_j (g_j - sum_k g_k y_k)` over the row's unmasked part.
    fn softmax_bwd_inplace = softmax_bwd_inplace_impl(y: &[T], g: &mut [T], sc: T)
);
/// The operations of `softmax_bwd_row_impl` in the same order (so the same bits), in place.
#[inline(always)]
fn softmax_bwd_inplace_impl<T: Flt>(y: &[T], g: &mut [T], sc: T) {
    let dot = lane_dot(g, y);
    for (o, &yv) in g.iter_mut().zip(y) {
        *o = sc.mul(yv).mul(o.sub(dot));
    }
}

/// Per-task scratch (compute precision), reused from pair to pair.
struct Scratch<E: Elem> {
    q: Vec<E::Acc>,
    k: Vec<E::Acc>,
    v: Vec<E::Acc>,
    g: Vec<E::Acc>,
    p: Vec<E::Acc>,
    s: Vec<E::Acc>,
    o: Vec<E::Acc>,
    tmp: Vec<E>,
}

impl<E: Elem> Scratch<E> {
    /// Q, K and V of head `hi` of sequence `bi` as `[T, hd]` matrices in compute precision,
    /// each `(first element, row stride)`: strided views into `qkv` (`[B*T, 3D]` rows) for
    /// f32/f64, widened copies in this scratch for 16-bit storage (`Elem::mat`).
    fn head_qkv(
        &mut self,
        qkv: &[E],
        bi: usize,
        hi: usize,
        (t, d, hd): (usize, usize, usize),
    ) -> [(*const E::Acc, usize); 3] {
        let rows = &qkv[bi * t * 3 * d..(bi + 1) * t * 3 * d];
        [
            E::mat(&rows[hi * hd..], t, hd, 3 * d, &mut self.q),
            E::mat(&rows[d + hi * hd..], t, hd, 3 * d, &mut self.k),
            E::mat(&rows[2 * d + hi * hd..], t, hd, 3 * d, &mut self.v),
        ]
    }

    fn new() -> Self {
        Scratch {
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            g: Vec::new(),
            p: Vec::new(),
            s: Vec::new(),
            o: Vec::new(),
            tmp: Vec::new(),
        }
    }
}

/// Runs `f(scratch, pair)` for every pair in `0..pairs`, in parallel tasks when the current
/// rayon pool has more than one thread (the bits of a pair do not depend on it).
fn for_pairs<E: Elem, F>(pairs: usize, f: F)
where
    F: Fn(&mut Scratch<E>, usize) + Sync + Send,
{
    if pairs > 1 && rayon::current_num_threads() > 1 {
        (0..pairs)
            .into_par_iter()
            .for_each_init(Scratch::<E>::new, |st, p| f(st, p));
    } else {
        let mut st = Scratch::new();
        for p in 0..pairs {
            f(&mut st, p);
        }
    }
}

/// Stores `m` rows of `w` compute-precision elements (`src`, row stride `w`) into `dst` at
/// `first` + `r * stride` (narrowed for 16-bit storage).
///
/// Safety: those `m * w` elements of `dst` must be valid for writes and written by no one
/// else meanwhile.
unsafe fn store_rows<E: Elem>(
    src: &[E::Acc],
    (m, w): (usize, usize),
    dst: SharedOut<MaybeUninit<E>>,
    (first, stride): (usize, usize),
    tmp: &mut Vec<E>,
) {
    for r in 0..m {
        // SAFETY: by the caller's contract, `w` elements at `first + r * stride` are this
        // task's alone and valid.
        let d = unsafe { std::slice::from_raw_parts_mut(dst.ptr().add(first + r * stride), w) };
        E::store(&src[r * w..(r + 1) * w], d, tmp);
    }
}

/// The shape arguments of the op, checked by [`causal_attention`].
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    h: usize,
    d: usize,
    hd: usize,
}

/// The forward op: `qkv` `[B*T, 3D]` -> `Y` `[B*T, D]`; keeps `P` for its backward.
struct CausalAttention {
    dims: Dims,
    scale: f64,
    /// `P` `[B, H, T, T]` (input dtype), set by the forward.
    saved: Mutex<Option<Tensor>>,
}

fn attn_fwd<E: Elem>(
    dims: Dims,
    scale: f64,
    s: &CpuStorage,
    l: &Layout,
) -> candle_core::Result<(CpuStorage, CpuStorage)> {
    let Dims { b, t, h, d, hd } = dims;
    let qkv = view::<E>("causal_attention", s, l)?;
    if qkv.len() != b * t * 3 * d {
        candle_core::bail!(
            "causal_attention: qkv has {} elements, expected B*T*3D = {b}*{t}*3*{d}",
            qkv.len()
        );
    }
    let sc = <E::Acc as Flt>::of(scale);
    let zero = <E::Acc as Flt>::zero();
    let (ylen, plen) = (b * t * d, b * h * t * t);
    let mut y: Vec<E> = Vec::with_capacity(ylen);
    let mut p: Vec<E> = Vec::with_capacity(plen);
    let yo = SharedOut(y.spare_capacity_mut().as_mut_ptr());
    let po = SharedOut(p.spare_capacity_mut().as_mut_ptr());
    for_pairs::<E, _>(b * h, |st, pair| {
        let (bi, hi) = (pair / h, pair % h);
        let [(q, qs), (k, ks), (v, vs)] = st.head_qkv(qkv, bi, hi, (t, d, hd));
        st.s.resize(ATTN_BLOCK_ROWS * t, zero);
        st.o.resize(ATTN_BLOCK_ROWS * hd, zero);
        for i0 in (0..t).step_by(ATTN_BLOCK_ROWS) {
            let i1 = (i0 + ATTN_BLOCK_ROWS).min(t);
            let m = i1 - i0;
            // SAFETY: `q` (rows i0..i1) and `k` (rows 0..i1) are `[T, hd]` matrices with the
            // returned strides (`E::mat`); `st.s` holds `m` rows of stride `t >= i1`.
            unsafe {
                mm(
                    (m, i1, hd),
                    st.s.as_mut_ptr(),
                    t,
                    q.add(i0 * qs),
                    (1, qs),
                    k,
                    (ks, 1),
                );
            }
            for r in 0..m {
                let i = i0 + r;
                let row = &mut st.s[r * t..(r + 1) * t];
                softmax_inplace(&mut row[..=i], sc);
                row[i + 1..].fill(zero);
            }
            // SAFETY: rows `pair*T + i0 .. pair*T + i1` of `P` (`T` elements each) belong to
            // this pair alone and lie inside `p`'s capacity `B*H*T*T`.
            unsafe { store_rows(&st.s, (m, t), po, ((pair * t + i0) * t, t), &mut st.tmp) };
            // SAFETY: `st.s` rows (stride `t`) columns `0..i1`; `v` rows `0..i1`; `st.o` has
            // `m * hd` elements.
            unsafe {
                mm(
                    (m, hd, i1),
                    st.o.as_mut_ptr(),
                    hd,
                    st.s.as_ptr(),
                    (1, t),
                    v,
                    (1, vs),
                );
            }
            // SAFETY: output rows `bi*T + i0 .. bi*T + i1`, columns `hi*hd .. (hi+1)*hd` of
            // `[B*T, D]` belong to this pair alone and lie inside `y`'s capacity.
            unsafe {
                store_rows(
                    &st.o,
                    (m, hd),
                    yo,
                    ((bi * t + i0) * d + hi * hd, d),
                    &mut st.tmp,
                )
            };
        }
    });
    // SAFETY: the pairs together wrote every element: `P`'s `B*H` blocks of `T` full rows,
    // and every (row, head) column range of `Y`; a panic in a task propagates before this.
    unsafe {
        y.set_len(ylen);
        p.set_len(plen);
    }
    Ok((E::wrap(y), E::wrap(p)))
}

impl CustomOp1 for CausalAttention {
    fn name(&self) -> &'static str {
        "fused-causal-attention"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (y, p) = dispatch!(self.name(), s, attn_fwd(self.dims, self.scale, s, l))?;
        let Dims { b, t, h, d, .. } = self.dims;
        let p = Tensor::from_storage(Storage::Cpu(p), (b, h, t, t), BackpropOp::none(), false);
        *self
            .saved
            .lock()
            .map_err(|_| candle_core::Error::Msg("causal_attention: poisoned lock".into()))? =
            Some(p);
        Ok((y, Shape::from((b * t, d))))
    }
    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let p = self
            .saved
            .lock()
            .map_err(|_| candle_core::Error::Msg("causal_attention: poisoned lock".into()))?
            .clone()
            .ok_or_else(|| {
                candle_core::Error::Msg("causal_attention: backward before forward".into())
            })?;
        let dqkv = arg.apply_op3_no_bwd(
            &grad.contiguous()?,
            &p,
            &CausalAttentionBwd {
                dims: self.dims,
                scale: self.scale,
            },
        )?;
        Ok(Some(dqkv))
    }
}

/// The backward op: `(qkv [B*T, 3D], dY [B*T, D], P [B, H, T, T])` -> `dqkv` `[B*T, 3D]`.
#[derive(Clone, Copy)]
struct CausalAttentionBwd {
    dims: Dims,
    scale: f64,
}

fn attn_bwd<E: Elem>(
    op: &CausalAttentionBwd,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let CausalAttentionBwd { dims, scale } = *op;
    let Dims { b, t, h, d, hd } = dims;
    let op = "causal_attention_bwd";
    let qkv = view::<E>(op, s1, l1)?;
    let dy = view::<E>(op, s2, l2)?;
    let pv = view::<E>(op, s3, l3)?;
    if qkv.len() != b * t * 3 * d || dy.len() != b * t * d || pv.len() != b * h * t * t {
        candle_core::bail!(
            "{op}: qkv {}, dY {}, P {} elements; expected {}, {}, {}",
            qkv.len(),
            dy.len(),
            pv.len(),
            b * t * 3 * d,
            b * t * d,
            b * h * t * t
        );
    }
    let sc = <E::Acc as Flt>::of(scale);
    let zero = <E::Acc as Flt>::zero();
    let len = b * t * 3 * d;
    let mut out: Vec<E> = Vec::with_capacity(len);
    let go = SharedOut(out.spare_capacity_mut().as_mut_ptr());
    let nb = ATTN_BLOCK_ROWS;
    for_pairs::<E, _>(b * h, |st, pair| {
        let (bi, hi) = (pair / h, pair % h);
        let [(q, qs), (k, ks), (v, vs)] = st.head_qkv(qkv, bi, hi, (t, d, hd));
        let (g, gs) = E::mat(&dy[bi * t * d + hi * hd..], t, hd, d, &mut st.g);
        let (pp, ps) = E::mat(&pv[pair * t * t..(pair + 1) * t * t], t, t, t, &mut st.p);
        st.s.resize(t * t, zero);
        st.o.resize(nb * hd, zero);
        let out_row = |i: usize, part: usize| (bi * t + i) * 3 * d + part * d + hi * hd;
        for i0 in (0..t).step_by(nb) {
            let i1 = (i0 + nb).min(t);
            let m = i1 - i0;
            // dP = dY[i0..i1] V[0..i1]^T into rows i0..i1 of dS.
            // SAFETY: `g`, `v` are `[T, hd]` with their strides; `st.s` is `[T, T]`.
            unsafe {
                mm(
                    (m, i1, hd),
                    st.s.as_mut_ptr().add(i0 * t),
                    t,
                    g.add(i0 * gs),
                    (1, gs),
                    v,
                    (vs, 1),
                );
            }
            for i in i0..i1 {
                let ds = &mut st.s[i * t..i * t + i1];
                // SAFETY: row `i` of `P` (`T` elements at stride `ps >= T`) is valid.
                let pr = unsafe { std::slice::from_raw_parts(pp.add(i * ps), i + 1) };
                softmax_bwd_inplace(pr, &mut ds[..=i], sc);
                ds[i + 1..].fill(zero);
            }
            // dQ = dS[i0..i1, 0..i1] K[0..i1].
            // SAFETY: `st.s` rows i0..i1 columns 0..i1; `k` rows 0..i1; `st.o` `m * hd`.
            unsafe {
                mm(
                    (m, hd, i1),
                    st.o.as_mut_ptr(),
                    hd,
                    st.s.as_ptr().add(i0 * t),
                    (1, t),
                    k,
                    (1, ks),
                );
                // SAFETY: rows bi*T + i0.. of the q columns of this head: this pair's alone.
                store_rows(&st.o, (m, hd), go, (out_row(i0, 0), 3 * d), &mut st.tmp);
            }
        }
        for j0 in (0..t).step_by(nb) {
            let j1 = (j0 + nb).min(t);
            let (m, kk) = (j1 - j0, t - j0);
            // dK = dS[j0..T, j0..j1]^T Q[j0..T]; dV = P[j0..T, j0..j1]^T dY[j0..T]. The
            // entries of dS and P above the diagonal inside the block are zeros.
            // SAFETY: `st.s`, `pp` rows j0..T columns j0..j1 (as lhs with column stride =
            // their row stride); `q`, `g` rows j0..T; `st.o` `m * hd`; the stores write this
            // pair's own k and v columns.
            unsafe {
                mm(
                    (m, hd, kk),
                    st.o.as_mut_ptr(),
                    hd,
                    st.s.as_ptr().add(j0 * t + j0),
                    (t, 1),
                    q.add(j0 * qs),
                    (1, qs),
                );
                store_rows(&st.o, (m, hd), go, (out_row(j0, 1), 3 * d), &mut st.tmp);
                mm(
                    (m, hd, kk),
                    st.o.as_mut_ptr(),
                    hd,
                    pp.add(j0 * ps + j0),
                    (ps, 1),
                    g.add(j0 * gs),
                    (1, gs),
                );
                store_rows(&st.o, (m, hd), go, (out_row(j0, 2), 3 * d), &mut st.tmp);
            }
        }
    });
    // SAFETY: every (row, part, head) range of the `[B*T, 3D]` gradient was written by
    // exactly one pair (q rows by the row blocks, k and v rows by the column blocks).
    unsafe { out.set_len(len) };
    Ok((E::wrap(out), Shape::from((b * t, 3 * d))))
}

impl CustomOp3 for CausalAttentionBwd {
    fn name(&self) -> &'static str {
        "fused-causal-attention-bwd"
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
        dispatch!(self.name(), s1, attn_bwd(self, s1, l1, s2, l2, s3, l3))
    }
}

/// Fused causal multi-head self-attention: `qkv` `[B*T, 3D]` (the qkv projection's output:
/// per token `q` in columns `0..D`, `k` in `D..2D`, `v` in `2D..3D`, head `h` at `h*hd..
/// (h+1)*hd` of each, `hd = D / n_head`) -> `[B*T, D]`, row `b*T + i` holding head `h`'s
/// `softmax_j<=i(q_i·k_j / sqrt(hd)) v` at columns `h*hd..(h+1)*hd` (the layout of the
/// composite path's `transpose(1, 2).reshape((B*T, D))`). Dtype of `qkv`: f32, f64, or
/// bf16/f16 computed in f32 (module docs of `ops`). The gradient flows to `qkv`.
///
/// Algorithm (Vaswani et al. 2017 §3.2.1, strided GEMMs per (sequence, head) pair, causal
/// upper triangle skipped in blocks of [`ATTN_BLOCK_ROWS`] rows) and backward formulas
/// (`dV = P^T dY`, `dP = dY V^T`, `dS = P ⊙ (dP − rowsum(dP ⊙ P)) / sqrt(hd)`, `dQ = dS K`,
/// `dK = dS^T Q`): see the source module's docs. Keeps `P` `[B, H, T, T]` (the input dtype)
/// for backward: with the graph's `qkv` and output, `N (3D + D + H T)` elements per sequence
/// position instead of the unfused path's separate q/k/v copies, scores, probabilities and
/// head-transpose copy.
///
/// Determinism: every pair is computed alone (single-threaded GEMMs, fixed blocks), so the
/// bits depend only on the pair's rows: not on the thread count, `B`, the world size or the
/// batch split.
///
/// f32 accuracy against an f64 evaluation of the same function on the same f32 inputs
/// (`engine/tests/model_ops_accuracy/attention.rs`: T in {1, 37, 64, 67, 130, 200}, hd in
/// {8, 10, 12, 20, 64}, H in {1, 2, 3}, B in {1, 2, 3}, inputs up to 4 in magnitude): every
/// element of `Y` and of each part of `dqkv` is within `(8 + hd + T) · 2^-24 · M + 1e-30`,
/// where `M` is the same formula evaluated on magnitudes, with each probability's relative
/// error amplification `1 + E_ij + max_k E_ik` (`E_ij = |q_i|·|k_j| / sqrt(hd)`, elementwise
/// absolute values): `M = Σ_j P_ij (1 + E_ij + max_k E_ik) |v_j|` for `Y`, and for the
/// gradients the same chains with `|dP| = |dY|·|V|^T`, `Σ_j P_ij |dP_ij|`, `|Q|`, `|K|`,
/// `|dY|` — the worst-case error of inner products of length `hd` and `T` plus the
/// softmax's few ulp. Measured at most 1.4 `2^-24 M` (Y 1.18, dQ 0.31, dK 0.42, dV 1.38).
///
/// Errors: `qkv` not 2-D `[B*T, 3D]` with `B*T = b*t`, `D` not a multiple of `n_head`, a zero
/// size, an unsupported dtype, a non-CPU tensor.
pub fn causal_attention(
    qkv: &Tensor,
    b: usize,
    t: usize,
    n_head: usize,
) -> candle_core::Result<Tensor> {
    let (n, c) = qkv.dims2()?;
    if b == 0 || t == 0 || n_head == 0 || n != b * t || c == 0 || c % 3 != 0 {
        candle_core::bail!(
            "causal_attention: qkv {:?} must be [B*T, 3D] with B={b}, T={t} > 0 (n_head \
             {n_head} > 0)",
            qkv.dims()
        );
    }
    let d = c / 3;
    if d % n_head != 0 {
        candle_core::bail!("causal_attention: D = {d} is not a multiple of n_head {n_head}");
    }
    if !matches!(qkv.device(), Device::Cpu) {
        candle_core::bail!(
            "causal_attention: the fused attention runs on the CPU only, qkv is on {:?}",
            qkv.device()
        );
    }
    let hd = d / n_head;
    let dims = Dims {
        b,
        t,
        h: n_head,
        d,
        hd,
    };
    qkv.contiguous()?.apply_op1(CausalAttention {
        dims,
        scale: 1.0 / (hd as f64).sqrt(),
        saved: Mutex::new(None),
    })
}

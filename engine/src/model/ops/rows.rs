//! The row-parallel drivers of the fused ops: rows computed in parallel tasks into a reused
//! row buffer and stored without a zero-fill, and column sums in fixed blocks of
//! [`SUM_BLOCK_ROWS`] rows, so an op's bits never depend on the thread count.

use super::elem::{Elem, Flt};
use super::simd::add_into;
use candle_core::{CpuStorage, Shape};
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// About this many elements per parallel task of a row-wise op (rows are never split).
pub(super) const ROW_TASK_ELEMS: usize = 1 << 14;

/// Rows per block of a column sum: the sum of a column is the sum, in block order, of the
/// block sums, each accumulated in row order. Fixed (never derived from the thread count), so
/// the bits of a column sum depend only on the input.
pub const SUM_BLOCK_ROWS: usize = 32;

/// Whether `rows` rows, `per` per task, are worth running in parallel tasks: the current rayon
/// pool has more than one thread and there are at least two tasks.
pub(super) fn parallel(rows: usize, per: usize) -> bool {
    rows > per && rayon::current_num_threads() > 1
}

/// Scratch buffers in compute precision, reused from row to row by one task.
pub(super) struct Bufs<A> {
    /// Scratch row.
    pub(super) a: Vec<A>,
    /// Scratch row.
    pub(super) b: Vec<A>,
    /// Scratch row.
    pub(super) c: Vec<A>,
    /// Scratch row.
    pub(super) d: Vec<A>,
}

/// Everything one task reuses: input scratch, the row being computed, the narrowing buffer.
struct RowState<E: Elem> {
    bufs: Bufs<E::Acc>,
    out: Vec<E::Acc>,
    tmp: Vec<E>,
}

impl<E: Elem> RowState<E> {
    fn new() -> Self {
        RowState {
            bufs: Bufs {
                a: Vec::new(),
                b: Vec::new(),
                c: Vec::new(),
                d: Vec::new(),
            },
            out: Vec::new(),
            tmp: Vec::new(),
        }
    }
}

/// A `rows x w` output (plus `extra` elements of spare capacity for the caller), row `r`
/// computed by `f(r, scratch, out)` into a reused row buffer `out` of `w` elements (its
/// contents on entry are unspecified: `f` must set every element it means to keep, the rest
/// are stored as found) and stored (narrowed for 16-bit storage) into its place. The output is
/// never zero-filled. Rows run in parallel tasks in the current rayon pool when it has more
/// than one thread; a row's bits do not depend on the partition.
pub(super) fn map_rows<E, F>(rows: usize, w: usize, extra: usize, f: F) -> Vec<E>
where
    E: Elem,
    F: Fn(usize, &mut Bufs<E::Acc>, &mut [E::Acc]) + Sync,
{
    let len = rows * w;
    let mut v: Vec<E> = Vec::with_capacity(len + extra);
    if len == 0 {
        return v;
    }
    let run = |first: usize, dst: &mut [MaybeUninit<E>], st: &mut RowState<E>| {
        st.out.resize(w, <E::Acc as Flt>::zero());
        for (k, d) in dst.chunks_exact_mut(w).enumerate() {
            f(first + k, &mut st.bufs, &mut st.out);
            E::store(&st.out, d, &mut st.tmp);
        }
    };
    let dst = &mut v.spare_capacity_mut()[..len];
    let per = (ROW_TASK_ELEMS / w).max(1);
    if parallel(rows, per) {
        dst.par_chunks_mut(per * w)
            .enumerate()
            .for_each_init(RowState::new, |st, (i, d)| run(i * per, d, st));
    } else {
        run(0, dst, &mut RowState::new());
    }
    // SAFETY: `dst` is the first `len` elements of the spare capacity; its chunks (each a
    // whole number of rows, as `len = rows * w`) cover it, and `E::store` wrote every element
    // of every row (it panics unless the row buffer has exactly `w` elements, and a panic
    // propagates out of rayon before this line). So `v[..len]` is initialised.
    unsafe { v.set_len(len) };
    v
}

/// Like [`map_rows`], and `f(r, scratch, out, sums)` also adds row `r`'s contributions to `k`
/// column sums (`sums`: `k * w` elements, zero at the start of each block). Returns the output
/// and the `k * w` column sums: blocks of [`SUM_BLOCK_ROWS`] rows, block sums added in block
/// order (the same bits with one thread or many).
pub(super) fn map_rows_sums<E, F>(
    rows: usize,
    w: usize,
    k: usize,
    extra: usize,
    f: F,
) -> (Vec<E>, Vec<E::Acc>)
where
    E: Elem,
    F: Fn(usize, &mut Bufs<E::Acc>, &mut [E::Acc], &mut [E::Acc]) + Sync,
{
    let zero = <E::Acc as Flt>::zero();
    let len = rows * w;
    let mut v: Vec<E> = Vec::with_capacity(len + extra);
    let mut sums = vec![zero; k * w];
    if len == 0 {
        return (v, sums);
    }
    let block =
        |b: usize, dst: &mut [MaybeUninit<E>], st: &mut RowState<E>, part: &mut [E::Acc]| {
            part.fill(zero);
            st.out.resize(w, zero);
            for (i, d) in dst.chunks_exact_mut(w).enumerate() {
                f(b * SUM_BLOCK_ROWS + i, &mut st.bufs, &mut st.out, part);
                E::store(&st.out, d, &mut st.tmp);
            }
        };
    let dst = &mut v.spare_capacity_mut()[..len];
    if parallel(rows, SUM_BLOCK_ROWS) {
        let parts: Vec<Vec<E::Acc>> = dst
            .par_chunks_mut(SUM_BLOCK_ROWS * w)
            .enumerate()
            .map_init(RowState::new, |st, (b, d)| {
                let mut part = vec![zero; k * w];
                block(b, d, st, &mut part);
                part
            })
            .collect();
        for p in &parts {
            add_into(&mut sums, p);
        }
    } else {
        let (mut st, mut part) = (RowState::new(), vec![zero; k * w]);
        for (b, d) in dst.chunks_mut(SUM_BLOCK_ROWS * w).enumerate() {
            block(b, d, &mut st, &mut part);
            add_into(&mut sums, &part);
        }
    }
    // SAFETY: as in `map_rows`: the chunks cover `dst`, a whole number of rows each, and
    // `E::store` wrote every element of every row.
    unsafe { v.set_len(len) };
    (v, sums)
}

/// `k * w` column sums over `rows` rows, `f(r, scratch, sums)` adding row `r`'s
/// contributions; blocks of [`SUM_BLOCK_ROWS`] rows as in [`map_rows_sums`], no row output.
pub(super) fn block_sums<A, F>(rows: usize, w: usize, k: usize, f: F) -> Vec<A>
where
    A: Flt,
    F: Fn(usize, &mut Bufs<A>, &mut [A]) + Sync,
{
    let zero = A::zero();
    let mut sums = vec![zero; k * w];
    let nblocks = rows.div_ceil(SUM_BLOCK_ROWS);
    let block = |b: usize, bufs: &mut Bufs<A>, part: &mut [A]| {
        part.fill(zero);
        for r in b * SUM_BLOCK_ROWS..((b + 1) * SUM_BLOCK_ROWS).min(rows) {
            f(r, bufs, part);
        }
    };
    let new_bufs = || Bufs {
        a: Vec::new(),
        b: Vec::new(),
        c: Vec::new(),
        d: Vec::new(),
    };
    if parallel(rows, SUM_BLOCK_ROWS) {
        let parts: Vec<Vec<A>> = (0..nblocks)
            .into_par_iter()
            .map_init(new_bufs, |bufs, b| {
                let mut part = vec![zero; k * w];
                block(b, bufs, &mut part);
                part
            })
            .collect();
        for p in &parts {
            add_into(&mut sums, p);
        }
    } else {
        let (mut bufs, mut part) = (new_bufs(), vec![zero; k * w]);
        for b in 0..nblocks {
            block(b, &mut bufs, &mut part);
            add_into(&mut sums, &part);
        }
    }
    sums
}

/// The inputs of one backward row of a normalisation over the last dim (LayerNorm, RMSNorm):
/// the input row, its upstream gradient, the weight and `eps`, in compute precision.
#[derive(Debug, Clone, Copy)]
pub(super) struct NormBwdRow<'a, T> {
    /// The input row `x` (`D` elements).
    pub(super) x: &'a [T],
    /// The upstream gradient row `g` (`D` elements).
    pub(super) g: &'a [T],
    /// The weight `w` (`D` elements).
    pub(super) w: &'a [T],
    /// The variance epsilon.
    pub(super) eps: f64,
}

/// The forward rows of a normalisation over the last dim: `x` `[N, D]` (`N = len / D`), row
/// `r` computed by `f(x_r, scratch, out)` from `x_r` in compute precision, with `scratch` a
/// `D`-element row buffer; see [`map_rows`].
pub(super) fn norm_fwd_rows<E, F>(x: &[E], d: usize, f: F) -> Vec<E>
where
    E: Elem,
    F: Fn(&[E::Acc], &mut [E::Acc], &mut [E::Acc]) + Sync,
{
    let n = x.len().checked_div(d).unwrap_or(0);
    map_rows::<E, _>(n, d, 0, |r, s, out| {
        let row = E::acc(&x[r * d..(r + 1) * d], &mut s.a);
        s.c.resize(d, <E::Acc as Flt>::zero());
        f(row, &mut s.c, out);
    })
}

/// The backward rows of a normalisation over the last dim: `x` and `g` `[N, D]`, row `r`'s
/// `dx` computed by `f(x_r, g_r, xhat, gw, dx_r, sums)` (`xhat`, `gw`: `D`-element scratch
/// rows), which also adds the row's contributions to `k` column sums (`k * D` elements,
/// see [`map_rows_sums`]). Returns the packed `[N + k, D]` output: the rows `dx`, then the
/// column sums.
pub(super) fn norm_bwd_rows<E, F>(x: &[E], g: &[E], d: usize, k: usize, f: F) -> (CpuStorage, Shape)
where
    E: Elem,
    F: Fn(&[E::Acc], &[E::Acc], &mut [E::Acc], &mut [E::Acc], &mut [E::Acc], &mut [E::Acc]) + Sync,
{
    let n = x.len().checked_div(d).unwrap_or(0);
    let zero = <E::Acc as Flt>::zero();
    let (mut out, sums) = map_rows_sums::<E, _>(n, d, k, k * d, |r, s, dxr, part| {
        let xr = E::acc(&x[r * d..(r + 1) * d], &mut s.a);
        let gr = E::acc(&g[r * d..(r + 1) * d], &mut s.b);
        s.c.resize(d, zero);
        s.d.resize(d, zero);
        f(xr, gr, &mut s.c, &mut s.d, dxr, part);
    });
    E::extend_from_acc(&mut out, &sums);
    (E::wrap(out), Shape::from((n + k, d)))
}

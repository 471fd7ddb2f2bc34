//! The conformance suite every [`Communicator`] backend must pass.
//!
//! A backend provides a [`Launcher`] (runs one closure per rank with that rank's communicator);
//! its tests call [`run_all`] or the individual checks, which return a [`CheckFailure`] with the
//! first wrong value or error. The checks cover world sizes 1..8 and hybrid topologies (2x2,
//! 3x2, 2x3, DDP 1x4), sizes 0, 1, odd, larger than a reduction block, every dtype, every group,
//! started (asynchronous) calls, in-place all-gather (alone and mixed with plain all-gathers of
//! the same collective), the error cases, three published faults (bf16 reduction accuracy,
//! an average that sums, ranks with different batch counts), and the collectives on candle
//! tensor buffers ([`OwnedBuf::Tensor`] on [`Launcher::tensor_device`], started and in place).
//! Expected values come from an independent scalar
//! reference (sequential sum in rank order, 16-bit accumulated in f32, one division for `Avg`),
//! compared bit for bit.

use crate::buf::{Buf, BufMut, OwnedBuf};
use crate::comm::Communicator;
use crate::error::{CommError, OpKind};
use crate::thread::run_threads;
use crate::topology::{Group, ReduceOp, Topology};
use fsdp_types::DType;
use half::{bf16, f16};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// What one rank's body returns: values to compare (any length), or its communication error.
pub type RankResult = Result<Vec<f64>, CommError>;

/// The per-rank closure a check hands to a [`Launcher`].
pub type RankBody<'a> = &'a (dyn Fn(&dyn Communicator) -> RankResult + Sync);

/// Runs a body once per rank of a world of a backend.
pub trait Launcher: Sync {
    /// Backend name for messages.
    fn name(&self) -> &str;
    /// Runs `body` on every rank of a fresh world of `topology` (collective timeout `timeout`)
    /// and returns the results in rank order; a rank that panics yields
    /// [`CommError::RankPanicked`].
    fn launch(&self, topology: Topology, timeout: Duration, body: RankBody<'_>) -> Vec<RankResult>;
    /// The largest world size this launcher can start (an MPI job's process count); checks
    /// skip larger topologies. Default: unbounded (the thread launcher).
    fn max_world_size(&self) -> usize {
        usize::MAX
    }
    /// The candle device on which the tensor checks ([`tensor_buffers_match_reference`],
    /// [`tensor_bad_buffers_are_local_errors`]) place this process's rank buffers
    /// ([`OwnedBuf::Tensor`]). Default: the CPU (host backends use CPU tensors in place); the
    /// NCCL launcher answers its CUDA device. Called on the rank's own thread, inside the body.
    ///
    /// Errors: why the device cannot be opened (candle's message).
    fn tensor_device(&self) -> Result<candle_core::Device, String> {
        Ok(candle_core::Device::Cpu)
    }
}

/// True when `launcher` can start a world of `t`'s size (see [`Launcher::max_world_size`]).
fn fits(launcher: &dyn Launcher, t: Topology) -> bool {
    t.world_size <= launcher.max_world_size()
}

/// The [`Launcher`] of the thread backend ([`run_threads`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct ThreadLauncher;

impl Launcher for ThreadLauncher {
    fn name(&self) -> &str {
        "threads"
    }
    fn launch(&self, topology: Topology, timeout: Duration, body: RankBody<'_>) -> Vec<RankResult> {
        run_threads(topology, timeout, |c| body(&c))
            .into_iter()
            .map(|r| r.and_then(|x| x))
            .collect()
    }
}

/// A failed conformance check: the check's name and what was wrong (ranks, indices, values).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckFailure {
    /// Name of the check.
    pub check: &'static str,
    /// What went wrong.
    pub detail: String,
}

impl fmt::Display for CheckFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "conformance check `{}` failed: {}",
            self.check, self.detail
        )
    }
}

impl std::error::Error for CheckFailure {}

/// A conformance check: takes a launcher, returns the first failure.
pub type Check = fn(&dyn Launcher) -> Result<(), CheckFailure>;

/// Every check, by name, in the order [`run_all`] runs them.
pub const CHECKS: &[(&str, Check)] = &[
    ("all_gather_matches_reference", all_gather_matches_reference),
    (
        "reduce_scatter_matches_reference",
        reduce_scatter_matches_reference,
    ),
    ("all_reduce_matches_reference", all_reduce_matches_reference),
    (
        "all_gather_in_place_matches_reference",
        all_gather_in_place_matches_reference,
    ),
    (
        "all_gather_in_place_mixes_with_plain_all_gather",
        all_gather_in_place_mixes_with_plain_all_gather,
    ),
    (
        "all_gather_in_place_size_not_multiple_is_error",
        all_gather_in_place_size_not_multiple_is_error,
    ),
    ("broadcast_from_every_root", broadcast_from_every_root),
    (
        "large_buffers_match_reference",
        large_buffers_match_reference,
    ),
    ("barrier_waits_for_every_rank", barrier_waits_for_every_rank),
    (
        "started_calls_complete_in_issue_order",
        started_calls_complete_in_issue_order,
    ),
    ("bad_buffers_are_local_errors", bad_buffers_are_local_errors),
    ("mismatched_calls_are_errors", mismatched_calls_are_errors),
    (
        "mismatched_groups_are_errors_not_hangs",
        mismatched_groups_are_errors_not_hangs,
    ),
    (
        "panicking_rank_fails_its_peers",
        panicking_rank_fails_its_peers,
    ),
    ("late_rank_times_out", late_rank_times_out),
    ("bf16_wire_fp32_accumulation", bf16_wire_fp32_accumulation),
    ("average_by_rank_count", average_by_rank_count),
    (
        "rank_with_fewer_batches_does_not_hang",
        rank_with_fewer_batches_does_not_hang,
    ),
    (
        "tensor_buffers_match_reference",
        tensor_buffers_match_reference,
    ),
    (
        "tensor_bad_buffers_are_local_errors",
        tensor_bad_buffers_are_local_errors,
    ),
];

/// Runs every check of [`CHECKS`] and returns all failures (empty: the backend conforms).
pub fn run_all(launcher: &dyn Launcher) -> Vec<CheckFailure> {
    CHECKS
        .iter()
        .filter_map(|(_, c)| c(launcher).err())
        .collect()
}

// ---------------------------------------------------------------- helpers

const DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];
/// Shard lengths: empty, one, odd, and odd above one reduction block.
const SIZES: [usize; 4] = [0, 1, 7, 3 * crate::reduce::BLOCK + 5];
const GROUPS: [Group; 3] = [Group::World, Group::Shard, Group::Replicate];
const LIMIT: Duration = Duration::from_secs(30);

/// Fully sharded W = 1..8, hybrid 2x2, 3x2, 2x3 (shard x replicate), DDP 1x4.
fn topologies() -> Vec<Topology> {
    let mut t: Vec<Topology> = (1..=8).map(|w| topo(w, 1)).collect();
    t.extend([topo(2, 2), topo(3, 2), topo(2, 3), topo(1, 4)]);
    t
}

fn topo(shard: usize, replicate: usize) -> Topology {
    Topology::new(shard, replicate).expect("non-zero factors")
}

fn fail(check: &'static str, detail: impl Into<String>) -> CheckFailure {
    CheckFailure {
        check,
        detail: detail.into(),
    }
}

/// A deterministic test value for (rank, index, salt), exactly representable in `dtype`, with
/// magnitudes spread enough that the order of a sum changes its rounding.
fn value(dtype: DType, rank: usize, i: usize, salt: u64) -> f64 {
    let mut h = (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (i as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ salt.wrapping_mul(0x1656_67B1_9E37_79F9);
    h ^= h >> 29;
    h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h ^= h >> 32;
    let m = (h % 255) as i64 - 127; // 8 significant bits: exact in bf16 and f16
    let e = match dtype {
        DType::F16 => [-8, 0, 4][(h >> 20) as usize % 3],
        _ => [-20, 0, 20][(h >> 20) as usize % 3],
    };
    m as f64 * 2f64.powi(e)
}

fn values(dtype: DType, rank: usize, n: usize, salt: u64) -> OwnedBuf {
    let v: Vec<f64> = (0..n).map(|i| value(dtype, rank, i, salt)).collect();
    OwnedBuf::from_f64(dtype, &v)
}

/// Memoised [`values`] widened to f64, so expected results cost one generation per rank.
#[derive(Default)]
struct Memo(std::collections::HashMap<(DType, usize, usize, u64), Vec<f64>>);

impl Memo {
    fn get(&mut self, dtype: DType, rank: usize, n: usize, salt: u64) -> &[f64] {
        self.0
            .entry((dtype, rank, n, salt))
            .or_insert_with(|| values(dtype, rank, n, salt).to_f64_vec())
    }
}

/// Rounds an accumulator value into `dtype`, as f64.
fn round_to(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::F32 => x as f32 as f64,
        DType::BF16 => bf16::from_f32(x as f32).to_f64(),
        DType::F16 => f16::from_f32(x as f32).to_f64(),
        DType::F64 => x,
    }
}

/// Independent scalar reference of a reduction: sequential in contribution order, accumulated in
/// f32 (f32, bf16, f16) or f64, `Avg` divides once by the number of contributions.
fn reference_reduce(dtype: DType, op: ReduceOp, contributions: &[Vec<f64>]) -> Vec<f64> {
    let n = contributions[0].len();
    let k = contributions.len();
    (0..n)
        .map(|i| {
            if dtype == DType::F64 {
                let mut a = contributions[0][i];
                for c in &contributions[1..] {
                    a = match op {
                        ReduceOp::Max => {
                            if c[i] > a || c[i].is_nan() {
                                c[i]
                            } else {
                                a
                            }
                        }
                        _ => a + c[i],
                    };
                }
                if op == ReduceOp::Avg {
                    a /= k as f64;
                }
                a
            } else {
                let mut a = contributions[0][i] as f32;
                for c in &contributions[1..] {
                    let x = c[i] as f32;
                    a = match op {
                        ReduceOp::Max => {
                            if x > a || x.is_nan() {
                                x
                            } else {
                                a
                            }
                        }
                        _ => a + x,
                    };
                }
                if op == ReduceOp::Avg {
                    a /= k as f32;
                }
                round_to(dtype, a as f64)
            }
        })
        .collect()
}

/// Compares bit patterns (through f64, exact for every dtype; NaN equals NaN).
fn compare(check: &'static str, what: &str, got: &[f64], want: &[f64]) -> Result<(), CheckFailure> {
    if got.len() != want.len() {
        return Err(fail(
            check,
            format!("{what}: got {} values, expected {}", got.len(), want.len()),
        ));
    }
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let same = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
        if !same {
            return Err(fail(
                check,
                format!("{what}: element {i} is {g:e}, expected {w:e}"),
            ));
        }
    }
    Ok(())
}

fn launch_ok(
    check: &'static str,
    l: &dyn Launcher,
    t: Topology,
    body: RankBody<'_>,
) -> Result<Vec<Vec<f64>>, CheckFailure> {
    l.launch(t, LIMIT, body)
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.map_err(|e| fail(check, format!("{t}, rank {r}: unexpected error: {e}"))))
        .collect()
}

// ---------------------------------------------------------------- checks

/// All-gather: every topology, group, dtype and shard size; rank `i`'s shard lands at offset
/// `i x n` of every group member's buffer, bit for bit.
pub fn all_gather_matches_reference(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "all_gather_matches_reference";
    for t in topologies() {
        if !fits(l, t) {
            continue;
        }
        for group in GROUPS {
            let g = t.group_size(group);
            let body = |c: &dyn Communicator| -> RankResult {
                let mut out = Vec::new();
                for (di, &d) in DTYPES.iter().enumerate() {
                    for &n in &SIZES {
                        let send = values(d, c.rank(), n, di as u64);
                        let mut recv = OwnedBuf::zeros(d, g * n);
                        c.all_gather(group, send.as_buf(), recv.as_buf_mut())?;
                        out.extend(recv.to_f64_vec());
                    }
                }
                Ok(out)
            };
            let res = launch_ok(C, l, t, &body)?;
            let mut memo = Memo::default();
            for (r, got) in res.iter().enumerate() {
                let members = t.group_members(group, r);
                let mut want = Vec::new();
                for (di, &d) in DTYPES.iter().enumerate() {
                    for &n in &SIZES {
                        for &m in &members {
                            want.extend_from_slice(memo.get(d, m, n, di as u64));
                        }
                    }
                }
                compare(C, &format!("{t}, {group} group, rank {r}"), got, &want)?;
            }
        }
    }
    Ok(())
}

/// Reduce-scatter: every topology, group, dtype, size and op; group rank `i` gets chunk `i` of
/// the rank-order reduction, bit for bit.
pub fn reduce_scatter_matches_reference(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "reduce_scatter_matches_reference";
    let ops = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];
    for t in topologies() {
        if !fits(l, t) {
            continue;
        }
        for group in GROUPS {
            let g = t.group_size(group);
            let body = |c: &dyn Communicator| -> RankResult {
                let mut out = Vec::new();
                for (di, &d) in DTYPES.iter().enumerate() {
                    for &n in &SIZES {
                        for (oi, &op) in ops.iter().enumerate() {
                            let send = values(d, c.rank(), g * n, (10 * di + oi) as u64);
                            let mut recv = OwnedBuf::zeros(d, n);
                            c.reduce_scatter(group, op, send.as_buf(), recv.as_buf_mut())?;
                            out.extend(recv.to_f64_vec());
                        }
                    }
                }
                Ok(out)
            };
            let res = launch_ok(C, l, t, &body)?;
            let mut memo = Memo::default();
            for (r, got) in res.iter().enumerate() {
                let members = t.group_members(group, r);
                let gr = t.group_rank(group, r);
                let mut want = Vec::new();
                for (di, &d) in DTYPES.iter().enumerate() {
                    for &n in &SIZES {
                        for (oi, &op) in ops.iter().enumerate() {
                            let contribs: Vec<Vec<f64>> = members
                                .iter()
                                .map(|&m| {
                                    let v = memo.get(d, m, g * n, (10 * di + oi) as u64);
                                    v[gr * n..(gr + 1) * n].to_vec()
                                })
                                .collect();
                            want.extend(reference_reduce(d, op, &contribs));
                        }
                    }
                }
                compare(C, &format!("{t}, {group} group, rank {r}"), got, &want)?;
            }
        }
    }
    Ok(())
}

/// All-reduce in place: every topology, group, dtype, size (including sizes not divisible by
/// the group) and op; every rank holds the rank-order reduction, bit for bit.
pub fn all_reduce_matches_reference(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "all_reduce_matches_reference";
    let ops = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];
    for t in topologies() {
        if !fits(l, t) {
            continue;
        }
        for group in GROUPS {
            let body = |c: &dyn Communicator| -> RankResult {
                let mut out = Vec::new();
                for (di, &d) in DTYPES.iter().enumerate() {
                    for &n in &SIZES {
                        for (oi, &op) in ops.iter().enumerate() {
                            let mut buf = values(d, c.rank(), n, (100 + 10 * di + oi) as u64);
                            c.all_reduce(group, op, buf.as_buf_mut())?;
                            out.extend(buf.to_f64_vec());
                        }
                    }
                }
                Ok(out)
            };
            let res = launch_ok(C, l, t, &body)?;
            let mut memo = Memo::default();
            for (r, got) in res.iter().enumerate() {
                let members = t.group_members(group, r);
                let mut want = Vec::new();
                for (di, &d) in DTYPES.iter().enumerate() {
                    for &n in &SIZES {
                        for (oi, &op) in ops.iter().enumerate() {
                            let contribs: Vec<Vec<f64>> = members
                                .iter()
                                .map(|&m| memo.get(d, m, n, (100 + 10 * di + oi) as u64).to_vec())
                                .collect();
                            want.extend(reference_reduce(d, op, &contribs));
                        }
                    }
                }
                compare(C, &format!("{t}, {group} group, rank {r}"), got, &want)?;
            }
        }
    }
    Ok(())
}

/// An in-place all-gather buffer of `g x n` elements of `dtype` for group rank `gr` of world
/// rank `rank`: block `gr` holds the rank's shard (`values(dtype, rank, n, salt)`), every other
/// block stale NaNs (never an expected value) that the collective must overwrite.
fn in_place_buf(dtype: DType, rank: usize, gr: usize, g: usize, n: usize, salt: u64) -> OwnedBuf {
    let mut v = vec![f64::NAN; g * n];
    for i in 0..n {
        v[gr * n + i] = value(dtype, rank, i, salt);
    }
    OwnedBuf::from_f64(dtype, &v)
}

/// Shard lengths of the in-place all-gather checks: [`SIZES`], plus a large odd one (about 2^18
/// elements) for f32 and bf16 on the 4-rank fully sharded world.
fn in_place_sizes(t: Topology, dtype: DType) -> Vec<usize> {
    let mut s = SIZES.to_vec();
    if t == topo(4, 1) && matches!(dtype, DType::F32 | DType::BF16) {
        s.push((1 << 18) + 1);
    }
    s
}

/// In-place all-gather (`MPI_IN_PLACE` semantics), synchronous and started: every topology
/// (W = 1..8, hybrid 2x2, 3x2, 2x3, DDP 1x4), every group, every dtype, shard sizes 0, 1, odd,
/// above a reduction block and (4x1, f32 and bf16) about 2^18; each rank's buffer holds its own
/// shard in its block and stale values elsewhere; afterwards block `i` of every member holds
/// group rank `i`'s shard, bit for bit. The started calls are all issued before the first wait
/// (prefetch).
pub fn all_gather_in_place_matches_reference(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "all_gather_in_place_matches_reference";
    for t in topologies() {
        if !fits(l, t) {
            continue;
        }
        for group in GROUPS {
            let g = t.group_size(group);
            let body = |c: &dyn Communicator| -> RankResult {
                let gr = c.group_rank(group);
                let mut out = Vec::new();
                for (di, &d) in DTYPES.iter().enumerate() {
                    for &n in &in_place_sizes(t, d) {
                        let mut buf = in_place_buf(d, c.rank(), gr, g, n, 500 + di as u64);
                        c.all_gather_in_place(group, buf.as_buf_mut())?;
                        out.extend(buf.to_f64_vec());
                    }
                }
                let mut pending = Vec::new();
                for (di, &d) in DTYPES.iter().enumerate() {
                    for &n in &in_place_sizes(t, d) {
                        let buf = in_place_buf(d, c.rank(), gr, g, n, 520 + di as u64);
                        pending.push(c.start_all_gather_in_place(group, buf)?);
                    }
                }
                for p in pending {
                    let done = p.wait_all()?;
                    if done.send.is_some() {
                        // An in-place call has no separate send buffer to hand back.
                        return Ok(vec![f64::NAN]);
                    }
                    out.extend(done.buf.to_f64_vec());
                }
                Ok(out)
            };
            let res = launch_ok(C, l, t, &body)?;
            let mut memo = Memo::default();
            for (r, got) in res.iter().enumerate() {
                let members = t.group_members(group, r);
                let mut want = Vec::new();
                for salt in [500u64, 520] {
                    for (di, &d) in DTYPES.iter().enumerate() {
                        for &n in &in_place_sizes(t, d) {
                            for &m in &members {
                                want.extend_from_slice(memo.get(d, m, n, salt + di as u64));
                            }
                        }
                    }
                }
                compare(C, &format!("{t}, {group} group, rank {r}"), got, &want)?;
            }
        }
    }
    Ok(())
}

/// In-place and plain all-gathers are one collective: on 1x1, 4x1 (world) and 2x2, 2x3 (shard
/// and replicate groups), odd group ranks call [`Communicator::all_gather`] while even ones call
/// [`Communicator::all_gather_in_place`], then the reverse, then started forms mixed
/// (in-place started against plain started and against plain synchronous); every rank of
/// every group holds every member's shard, bit for bit, in f32, bf16 and f64.
pub fn all_gather_in_place_mixes_with_plain_all_gather(
    l: &dyn Launcher,
) -> Result<(), CheckFailure> {
    const C: &str = "all_gather_in_place_mixes_with_plain_all_gather";
    let dtypes = [DType::F32, DType::BF16, DType::F64];
    let cases = [
        (topo(1, 1), Group::World),
        (topo(4, 1), Group::World),
        (topo(2, 2), Group::Shard),
        (topo(2, 2), Group::Replicate),
        (topo(2, 3), Group::Shard),
        (topo(2, 3), Group::Replicate),
    ];
    let n = 3 * crate::reduce::BLOCK + 5;
    for (t, group) in cases {
        if !fits(l, t) {
            continue;
        }
        let g = t.group_size(group);
        let body = |c: &dyn Communicator| -> RankResult {
            let gr = c.group_rank(group);
            let mut out = Vec::new();
            for (di, &d) in dtypes.iter().enumerate() {
                // Round 0: even group ranks in place; round 1: odd ones; both synchronous.
                for round in 0..2u64 {
                    let salt = 600 + 10 * round + di as u64;
                    if gr % 2 == round as usize {
                        let mut buf = in_place_buf(d, c.rank(), gr, g, n, salt);
                        c.all_gather_in_place(group, buf.as_buf_mut())?;
                        out.extend(buf.to_f64_vec());
                    } else {
                        let send = values(d, c.rank(), n, salt);
                        let mut recv = OwnedBuf::zeros(d, g * n);
                        c.all_gather(group, send.as_buf(), recv.as_buf_mut())?;
                        out.extend(recv.to_f64_vec());
                    }
                }
                // Round 2: in-place started against plain started; round 3: in-place started
                // against plain synchronous.
                for round in 2..4u64 {
                    let salt = 600 + 10 * round + di as u64;
                    if gr % 2 == 0 {
                        let buf = in_place_buf(d, c.rank(), gr, g, n, salt);
                        let p = c.start_all_gather_in_place(group, buf)?;
                        out.extend(p.wait()?.to_f64_vec());
                    } else if round == 2 {
                        let send = values(d, c.rank(), n, salt);
                        let p = c.start_all_gather(group, send, OwnedBuf::zeros(d, g * n))?;
                        out.extend(p.wait()?.to_f64_vec());
                    } else {
                        let send = values(d, c.rank(), n, salt);
                        let mut recv = OwnedBuf::zeros(d, g * n);
                        c.all_gather(group, send.as_buf(), recv.as_buf_mut())?;
                        out.extend(recv.to_f64_vec());
                    }
                }
            }
            Ok(out)
        };
        let res = launch_ok(C, l, t, &body)?;
        let mut memo = Memo::default();
        for (r, got) in res.iter().enumerate() {
            let members = t.group_members(group, r);
            let mut want = Vec::new();
            for (di, &d) in dtypes.iter().enumerate() {
                for round in 0..4u64 {
                    for &m in &members {
                        want.extend_from_slice(memo.get(d, m, n, 600 + 10 * round + di as u64));
                    }
                }
            }
            compare(C, &format!("{t}, {group} group, rank {r}"), got, &want)?;
        }
    }
    Ok(())
}

/// An in-place all-gather buffer whose length is not a multiple of the group size is a
/// [`CommError::SizeMismatch`] on the calling rank (`in-place buf`, the rounded-up length
/// expected, the length got, the group size), synchronous and started, on the world group of
/// 3 ranks and the shard and replicate groups of 2x3; the world stays usable afterwards (a
/// correct in-place all-gather and an all-reduce follow).
pub fn all_gather_in_place_size_not_multiple_is_error(
    l: &dyn Launcher,
) -> Result<(), CheckFailure> {
    const C: &str = "all_gather_in_place_size_not_multiple_is_error";
    for (t, group) in [
        (topo(3, 1), Group::World),
        (topo(2, 3), Group::Shard),
        (topo(2, 3), Group::Replicate),
    ] {
        if !fits(l, t) {
            continue;
        }
        let g = t.group_size(group);
        let body = |c: &dyn Communicator| -> RankResult {
            let mut codes = Vec::new();
            let is_size_err = |e: &CommError, expected: usize, got: usize| {
                matches!(
                    e,
                    CommError::SizeMismatch {
                        op: OpKind::AllGather,
                        what: "in-place buf",
                        expected: ex,
                        got: gt,
                        group_size: gs,
                        group: gp,
                        ..
                    } if *ex == expected && *gt == got && *gs == g && *gp == group
                )
            };
            let len = 2 * g + 1;
            let mut buf = OwnedBuf::zeros(DType::F32, len);
            codes.push(match c.all_gather_in_place(group, buf.as_buf_mut()) {
                Err(e) if is_size_err(&e, 3 * g, len) => 1.0,
                _ => 0.0,
            });
            let len = 3 * g - 1;
            codes.push(
                match c.start_all_gather_in_place(group, OwnedBuf::zeros(DType::BF16, len)) {
                    Err(e) if is_size_err(&e, 3 * g, len) => 1.0,
                    _ => 0.0,
                },
            );
            // The group still works: a correct in-place all-gather, then a world all-reduce.
            let gr = c.group_rank(group);
            let mut buf = in_place_buf(DType::F32, c.rank(), gr, g, 5, 700);
            c.all_gather_in_place(group, buf.as_buf_mut())?;
            codes.extend(buf.to_f64_vec());
            let mut x = vec![1.0f32; 3];
            c.all_reduce(Group::World, ReduceOp::Sum, (&mut x).into())?;
            codes.extend(x.iter().map(|&v| v as f64));
            Ok(codes)
        };
        let res = launch_ok(C, l, t, &body)?;
        for (r, got) in res.iter().enumerate() {
            let mut want = vec![1.0, 1.0];
            for m in t.group_members(group, r) {
                want.extend(values(DType::F32, m, 5, 700).to_f64_vec());
            }
            want.extend([t.world_size as f64; 3]);
            compare(
                C,
                &format!("{t}, {group} group, rank {r} (1 = the expected error)"),
                got,
                &want,
            )?;
        }
    }
    Ok(())
}

/// Expected all-reduce result and reduced shards of one group instance and dtype.
type Expected = (Vec<f64>, Vec<Vec<f64>>);

/// Large buffers (about a million elements, not divisible by the group size) in f32 and bf16
/// on a fully sharded and a hybrid world: all-reduce(avg), reduce-scatter(sum) and all-gather
/// equal the reference bit for bit.
pub fn large_buffers_match_reference(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "large_buffers_match_reference";
    let n = (1 << 20) + 3;
    let shard = (1 << 18) + 1;
    for t in [topo(4, 1), topo(3, 2)] {
        if !fits(l, t) {
            continue;
        }
        for group in [Group::World, Group::Shard] {
            let g = t.group_size(group);
            let body = |c: &dyn Communicator| -> RankResult {
                let mut out = Vec::new();
                for (di, d) in [DType::F32, DType::BF16].into_iter().enumerate() {
                    let mut buf = values(d, c.rank(), n, 400 + di as u64);
                    c.all_reduce(group, ReduceOp::Avg, buf.as_buf_mut())?;
                    out.extend(buf.to_f64_vec());
                    let send = values(d, c.rank(), g * shard, 410 + di as u64);
                    let mut recv = OwnedBuf::zeros(d, shard);
                    c.reduce_scatter(group, ReduceOp::Sum, send.as_buf(), recv.as_buf_mut())?;
                    out.extend(recv.to_f64_vec());
                    let mut all = OwnedBuf::zeros(d, g * shard);
                    c.all_gather(group, recv.as_buf(), all.as_buf_mut())?;
                    out.extend(all.to_f64_vec());
                }
                Ok(out)
            };
            let res = launch_ok(C, l, t, &body)?;
            let mut memo = Memo::default();
            // Expected (all-reduce result, reduced shards) per (group instance, dtype).
            let mut expected: std::collections::HashMap<(usize, usize), Expected> =
                Default::default();
            for (r, got) in res.iter().enumerate() {
                let members = t.group_members(group, r);
                let gr = t.group_rank(group, r);
                let inst = t.group_instance(group, r);
                let mut want = Vec::new();
                for (di, d) in [DType::F32, DType::BF16].into_iter().enumerate() {
                    let (ar, shards) = expected.entry((inst, di)).or_insert_with(|| {
                        let c: Vec<Vec<f64>> = members
                            .iter()
                            .map(|&m| memo.get(d, m, n, 400 + di as u64).to_vec())
                            .collect();
                        let ar = reference_reduce(d, ReduceOp::Avg, &c);
                        let shards = (0..g)
                            .map(|k| {
                                let c: Vec<Vec<f64>> = members
                                    .iter()
                                    .map(|&m| {
                                        memo.get(d, m, g * shard, 410 + di as u64)
                                            [k * shard..(k + 1) * shard]
                                            .to_vec()
                                    })
                                    .collect();
                                reference_reduce(d, ReduceOp::Sum, &c)
                            })
                            .collect();
                        (ar, shards)
                    });
                    want.extend_from_slice(ar);
                    want.extend_from_slice(&shards[gr]);
                    for s in shards.iter() {
                        want.extend_from_slice(s);
                    }
                }
                compare(C, &format!("{t}, {group} group, rank {r}"), got, &want)?;
            }
        }
    }
    Ok(())
}

/// Broadcast from every group rank of every group: all members end with the root's values.
pub fn broadcast_from_every_root(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "broadcast_from_every_root";
    for t in [topo(1, 1), topo(3, 1), topo(2, 3), topo(4, 2)] {
        if !fits(l, t) {
            continue;
        }
        for group in GROUPS {
            let g = t.group_size(group);
            let body = |c: &dyn Communicator| -> RankResult {
                let mut out = Vec::new();
                for root in 0..g {
                    for (di, &d) in DTYPES.iter().enumerate() {
                        for &n in &SIZES {
                            let mut buf = values(d, c.rank(), n, (200 + di) as u64);
                            c.broadcast(group, root, buf.as_buf_mut())?;
                            out.extend(buf.to_f64_vec());
                        }
                    }
                }
                Ok(out)
            };
            let res = launch_ok(C, l, t, &body)?;
            let mut memo = Memo::default();
            for (r, got) in res.iter().enumerate() {
                let members = t.group_members(group, r);
                let mut want = Vec::new();
                for &m in &members {
                    for (di, &d) in DTYPES.iter().enumerate() {
                        for &n in &SIZES {
                            want.extend_from_slice(memo.get(d, m, n, (200 + di) as u64));
                        }
                    }
                }
                compare(C, &format!("{t}, {group} group, rank {r}"), got, &want)?;
            }
        }
    }
    Ok(())
}

/// Barrier: no rank leaves before every member arrived (a shared counter seen after the barrier
/// equals the number of arrivals), on every group of hybrid topologies, 20 rounds.
pub fn barrier_waits_for_every_rank(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "barrier_waits_for_every_rank";
    for t in [topo(1, 1), topo(4, 1), topo(2, 3), topo(3, 2)] {
        if !fits(l, t) {
            continue;
        }
        // One counter per group instance; each round every rank adds 1 before the barrier and
        // reads at least (round + 1) x group size after it.
        let counters: Vec<AtomicUsize> = (0..t.num_group_instances())
            .map(|_| AtomicUsize::new(0))
            .collect();
        let body = |c: &dyn Communicator| -> RankResult {
            let mut seen = Vec::new();
            for round in 0..20 {
                let group = GROUPS[round % 3];
                let k = &counters[t.group_instance(group, c.rank())];
                k.fetch_add(1, Ordering::SeqCst);
                c.barrier(group)?;
                seen.push(k.load(Ordering::SeqCst) as f64);
            }
            Ok(seen)
        };
        let res = launch_ok(C, l, t, &body)?;
        for (r, seen) in res.iter().enumerate() {
            for (round, &s) in seen.iter().enumerate() {
                let group = GROUPS[round % 3];
                let g = t.group_size(group);
                let rounds_on_group = (0..=round).filter(|x| x % 3 == round % 3).count();
                if (s as usize) < rounds_on_group * g {
                    return Err(fail(
                        C,
                        format!(
                            "{t}, rank {r}, round {round} ({group} group): counter {s} after the \
                             barrier, expected at least {}",
                            rounds_on_group * g
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Started calls: three all-gathers started back to back (prefetch), a synchronous all-reduce
/// issued while they are pending, a started reduce-scatter and broadcast; every result is right
/// and the buffers come back.
pub fn started_calls_complete_in_issue_order(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "started_calls_complete_in_issue_order";
    for t in [topo(1, 1), topo(4, 1), topo(2, 2)] {
        if !fits(l, t) {
            continue;
        }
        let g = t.shard_size;
        let n = 1000;
        let body = |c: &dyn Communicator| -> RankResult {
            let mut out = Vec::new();
            let pending: Vec<_> = (0..3)
                .map(|k| {
                    c.start_all_gather(
                        Group::Shard,
                        values(DType::BF16, c.rank(), n, 300 + k),
                        OwnedBuf::zeros(DType::BF16, g * n),
                    )
                })
                .collect::<Result<_, _>>()?;
            let mut x = values(DType::F32, c.rank(), n, 310);
            c.all_reduce(Group::World, ReduceOp::Sum, x.as_buf_mut())?;
            let rs = c.start_reduce_scatter(
                Group::Shard,
                ReduceOp::Avg,
                values(DType::F32, c.rank(), g * n, 320),
                OwnedBuf::zeros(DType::F32, n),
            )?;
            let bc = c.start_broadcast(Group::World, 0, values(DType::F64, c.rank(), n, 330))?;
            for p in pending {
                let done = p.wait_all()?;
                let send = done.send.expect("all-gather hands its send buffer back");
                if send.len() != n {
                    return Ok(vec![f64::NAN]);
                }
                out.extend(done.buf.to_f64_vec());
            }
            out.extend(x.to_f64_vec());
            out.extend(rs.wait()?.to_f64_vec());
            out.extend(bc.wait()?.to_f64_vec());
            Ok(out)
        };
        let res = launch_ok(C, l, t, &body)?;
        for (r, got) in res.iter().enumerate() {
            let shard = t.group_members(Group::Shard, r);
            let world: Vec<usize> = (0..t.world_size).collect();
            let mut want = Vec::new();
            for k in 0..3 {
                for &m in &shard {
                    want.extend(values(DType::BF16, m, n, 300 + k).to_f64_vec());
                }
            }
            let c: Vec<Vec<f64>> = world
                .iter()
                .map(|&m| values(DType::F32, m, n, 310).to_f64_vec())
                .collect();
            want.extend(reference_reduce(DType::F32, ReduceOp::Sum, &c));
            let gr = t.group_rank(Group::Shard, r);
            let c: Vec<Vec<f64>> = shard
                .iter()
                .map(|&m| {
                    values(DType::F32, m, g * n, 320).to_f64_vec()[gr * n..(gr + 1) * n].to_vec()
                })
                .collect();
            want.extend(reference_reduce(DType::F32, ReduceOp::Avg, &c));
            want.extend(values(DType::F64, 0, n, 330).to_f64_vec());
            compare(C, &format!("{t}, rank {r}"), got, &want)?;
        }
    }
    Ok(())
}

/// Wrong buffer sizes, send/recv dtype differences and out-of-range roots are reported on the
/// calling rank with the numbers; when every rank makes the same bad call the world stays usable.
pub fn bad_buffers_are_local_errors(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "bad_buffers_are_local_errors";
    let t = topo(3, 1);
    if !fits(l, t) {
        return Ok(());
    }
    let body = |c: &dyn Communicator| -> RankResult {
        let mut codes = Vec::new();
        let send = vec![1.0f32; 4];
        let mut recv = vec![0.0f32; 11];
        codes.push(
            match c.all_gather(Group::World, (&send).into(), (&mut recv).into()) {
                Err(CommError::SizeMismatch {
                    op: OpKind::AllGather,
                    expected: 12,
                    got: 11,
                    group_size: 3,
                    ..
                }) => 1.0,
                _ => 0.0,
            },
        );
        let send = vec![1.0f32; 10];
        let mut recv = vec![0.0f32; 3];
        codes.push(
            match c.reduce_scatter(
                Group::World,
                ReduceOp::Sum,
                (&send).into(),
                (&mut recv).into(),
            ) {
                Err(CommError::SizeMismatch {
                    op: OpKind::ReduceScatter,
                    expected: 9,
                    got: 10,
                    ..
                }) => 1.0,
                _ => 0.0,
            },
        );
        let send = vec![bf16::ONE; 2];
        let mut recv = vec![0.0f32; 6];
        codes.push(
            match c.all_gather(Group::World, (&send).into(), (&mut recv).into()) {
                Err(CommError::DTypeMismatch {
                    send: DType::BF16,
                    recv: DType::F32,
                    ..
                }) => 1.0,
                _ => 0.0,
            },
        );
        let mut buf = vec![0.0f64; 2];
        codes.push(match c.broadcast(Group::World, 3, (&mut buf).into()) {
            Err(CommError::InvalidRoot {
                root: 3,
                group_size: 3,
                ..
            }) => 1.0,
            _ => 0.0,
        });
        // The world still works after the (identical) bad calls.
        let mut x = vec![c.rank() as f32 + 1.0; 5];
        c.all_reduce(Group::World, ReduceOp::Sum, (&mut x).into())?;
        codes.extend(x.iter().map(|&v| v as f64));
        Ok(codes)
    };
    let res = launch_ok(C, l, t, &body)?;
    for (r, got) in res.iter().enumerate() {
        compare(
            C,
            &format!("rank {r} (1 = the expected error)"),
            got,
            &[1.0, 1.0, 1.0, 1.0, 6.0, 6.0, 6.0, 6.0, 6.0],
        )?;
    }
    Ok(())
}

fn expect_all_errors(
    check: &'static str,
    what: &str,
    res: &[RankResult],
    ok: impl Fn(usize, &CommError) -> bool,
) -> Result<(), CheckFailure> {
    for (r, x) in res.iter().enumerate() {
        match x {
            Ok(v) => {
                return Err(fail(
                    check,
                    format!("{what}: rank {r} succeeded with {} values", v.len()),
                ))
            }
            Err(e) if ok(r, e) => {}
            Err(e) => return Err(fail(check, format!("{what}: rank {r}: wrong error: {e}"))),
        }
    }
    Ok(())
}

/// Ranks of one group making different calls (collective, element count, dtype, reduction)
/// all get an error naming every rank's call.
pub fn mismatched_calls_are_errors(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "mismatched_calls_are_errors";
    let t = topo(3, 1);
    if !fits(l, t) {
        return Ok(());
    }
    let timeout = Duration::from_secs(5);
    type Case = (&'static str, fn(&dyn Communicator) -> Result<(), CommError>);
    let cases: [Case; 4] = [
        ("collective", |c| {
            if c.rank() == 1 {
                c.barrier(Group::World)
            } else {
                let mut x = vec![1.0f32; 4];
                c.all_reduce(Group::World, ReduceOp::Sum, (&mut x).into())
            }
        }),
        ("size", |c| {
            let mut x = vec![1.0f32; 4 + usize::from(c.rank() == 2)];
            c.all_reduce(Group::World, ReduceOp::Sum, (&mut x).into())
        }),
        ("dtype", |c| {
            if c.rank() == 0 {
                let mut x = vec![1.0f64; 4];
                c.all_reduce(Group::World, ReduceOp::Sum, (&mut x).into())
            } else {
                let mut x = vec![1.0f32; 4];
                c.all_reduce(Group::World, ReduceOp::Sum, (&mut x).into())
            }
        }),
        ("reduction", |c| {
            let op = if c.rank() == 2 {
                ReduceOp::Max
            } else {
                ReduceOp::Avg
            };
            let mut x = vec![1.0f32; 4];
            c.all_reduce(Group::World, op, (&mut x).into())
        }),
    ];
    for (what, f) in cases {
        let body = |c: &dyn Communicator| -> RankResult { f(c).map(|()| vec![]) };
        let res = l.launch(t, timeout, &body);
        expect_all_errors(C, what, &res, |_, e| {
            let m = e.to_string();
            matches!(e, CommError::MismatchedCalls { .. })
                && m.contains("rank 0")
                && m.contains("rank 1")
                && m.contains("rank 2")
        })?;
    }
    Ok(())
}

/// Ranks calling the same collective on different groups (world vs shard group of the same
/// ranks) get an error within the timeout instead of hanging.
pub fn mismatched_groups_are_errors_not_hangs(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "mismatched_groups_are_errors_not_hangs";
    let t = topo(2, 2);
    if !fits(l, t) {
        return Ok(());
    }
    let timeout = Duration::from_secs(3);
    let body = |c: &dyn Communicator| -> RankResult {
        let group = if c.rank() == 1 {
            Group::World
        } else {
            Group::Shard
        };
        let mut x = vec![1.0f32; 8];
        c.all_reduce(group, ReduceOp::Sum, (&mut x).into())?;
        c.barrier(Group::World)?;
        Ok(x.iter().map(|&v| v as f64).collect())
    };
    let start = Instant::now();
    let res = l.launch(t, timeout, &body);
    let took = start.elapsed();
    if took > timeout + Duration::from_secs(10) {
        return Err(fail(C, format!("ranks returned after {took:?}")));
    }
    // Ranks 2 and 3 complete their shard-group all-reduce; the world barrier then cannot
    // complete. Every rank must end in an error.
    expect_all_errors(C, "world vs shard group", &res, |_, e| {
        matches!(
            e,
            CommError::MismatchedCalls { .. }
                | CommError::Timeout { .. }
                | CommError::PeerExited { .. }
                | CommError::PeerFailed { .. }
        )
    })
}

/// A rank that panics is reported as panicked; its peers get an error, not a hang.
pub fn panicking_rank_fails_its_peers(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "panicking_rank_fails_its_peers";
    let t = topo(4, 1);
    if !fits(l, t) {
        return Ok(());
    }
    let timeout = Duration::from_secs(20);
    let body = |c: &dyn Communicator| -> RankResult {
        let mut x = vec![1.0f32; 16];
        c.all_reduce(Group::World, ReduceOp::Sum, (&mut x).into())?;
        if c.rank() == 3 {
            panic!("rank 3 fails on purpose");
        }
        c.all_reduce(Group::World, ReduceOp::Sum, (&mut x).into())?;
        Ok(vec![])
    };
    let start = Instant::now();
    let res = l.launch(t, timeout, &body);
    if start.elapsed() >= timeout {
        return Err(fail(
            C,
            "peers of the panicking rank waited for the whole timeout",
        ));
    }
    expect_all_errors(C, "rank 3 panics", &res, |r, e| match e {
        CommError::RankPanicked { rank, message } => {
            r == 3 && *rank == 3 && message.contains("on purpose")
        }
        CommError::PeerFailed { peer, .. } => r != 3 && *peer == 3,
        CommError::PeerExited { peer, .. } => r != 3 && *peer == 3,
        _ => false,
    })
}

/// A rank that joins later than the timeout makes its peers fail with a timeout naming it.
pub fn late_rank_times_out(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "late_rank_times_out";
    let t = topo(2, 1);
    if !fits(l, t) {
        return Ok(());
    }
    let timeout = Duration::from_millis(300);
    let body = |c: &dyn Communicator| -> RankResult {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500));
        }
        c.barrier(Group::World)?;
        Ok(vec![])
    };
    let res = l.launch(t, timeout, &body);
    match &res[0] {
        Err(CommError::Timeout {
            rank: 0, missing, ..
        }) if missing == &vec![1] => {}
        other => {
            return Err(fail(
                C,
                format!("rank 0: expected a timeout naming rank 1, got {other:?}"),
            ))
        }
    }
    if res[1].is_ok() {
        return Err(fail(C, "rank 1 succeeded after its peer timed out"));
    }
    Ok(())
}

/// Casts `values` to `wire` (round to nearest even), all-reduces them with `op` over `group`
/// (the backend accumulates 16-bit dtypes in f32 and rounds once), and widens the result back
/// into `values`. With `wire = BF16` this is "bf16 on the wire, fp32 accumulation":
/// relative error at most 2^-8 at any world size.
///
/// Errors: the all-reduce's [`CommError`].
pub fn all_reduce_on_wire(
    comm: &dyn Communicator,
    group: Group,
    op: ReduceOp,
    wire: DType,
    values: &mut [f32],
) -> Result<(), CommError> {
    match wire {
        DType::F32 => comm.all_reduce(group, op, BufMut::F32(values)),
        _ => {
            let v: Vec<f64> = values.iter().map(|&x| x as f64).collect();
            let mut b = OwnedBuf::from_f64(wire, &v);
            comm.all_reduce(group, op, b.as_buf_mut())?;
            let b: Buf<'_> = b.as_buf();
            for (i, x) in values.iter_mut().enumerate() {
                *x = b.get_f64(i) as f32;
            }
            Ok(())
        }
    }
}

/// bf16 reduction must not lose accuracy as W grows
/// (<https://github.com/pytorch/pytorch/issues/106395>): rank 0's gradient is 1.0, every other
/// rank's 2^-9, mean over W in {8, 64}: f32 on the wire matches the true mean to fp32 precision;
/// bf16 on the wire with f32 accumulation is within 2^-8 relative (a bf16 accumulator would be off
/// by 1.3 % at W=8 and 11 % at W=64).
pub fn bf16_wire_fp32_accumulation(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "bf16_wire_fp32_accumulation";
    for w in [8usize, 64] {
        let t = topo(w, 1);
        if !fits(l, t) {
            continue;
        }
        let body = |c: &dyn Communicator| -> RankResult {
            let g = if c.rank() == 0 { 1.0f32 } else { 0.001953125 };
            let mut a = vec![g; 4];
            all_reduce_on_wire(c, Group::World, ReduceOp::Avg, DType::F32, &mut a)?;
            let mut b = vec![g; 4];
            all_reduce_on_wire(c, Group::World, ReduceOp::Avg, DType::BF16, &mut b)?;
            Ok(a.iter().chain(&b).map(|&x| x as f64).collect())
        };
        let res = launch_ok(C, l, t, &body)?;
        let truth = (1.0 + (w as f64 - 1.0) * 2f64.powi(-9)) / w as f64;
        for (r, got) in res.iter().enumerate() {
            for (i, &v) in got.iter().enumerate() {
                let rel = ((v - truth) / truth).abs();
                let bound = if i < 4 { 1e-6 } else { 2f64.powi(-8) };
                if rel > bound {
                    return Err(fail(
                        C,
                        format!(
                            "W={w}, rank {r}, {} wire: mean {v} vs true {truth} (relative error \
                             {rel:e} > {bound:e})",
                            if i < 4 { "f32" } else { "bf16" }
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// An average must divide by the rank count, never sum silently
/// (<https://github.com/pytorch/pytorch/issues/162338>): W ranks, rank r's gradient
/// `(r+1) x ones(8)` padded with zeros to a multiple of W; average reduce-scatter then all-gather
/// gives `(W+1)/2` on every real element (2.0 at W=3) and zero padding, for W = 1..4 and every
/// dtype. Bug signatures: 6.0 (summed), 0.75 (divided by the element count), 0.667 (divided by
/// the padded count).
pub fn average_by_rank_count(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "average_by_rank_count";
    for w in 1..=4usize {
        let t = topo(w, 1);
        if !fits(l, t) {
            continue;
        }
        let shard = 8usize.div_ceil(w);
        let body = |c: &dyn Communicator| -> RankResult {
            let mut out = Vec::new();
            for d in DTYPES {
                let mut grad = vec![(c.rank() + 1) as f64; 8];
                grad.resize(shard * w, 0.0);
                let send = OwnedBuf::from_f64(d, &grad);
                let mut mine = OwnedBuf::zeros(d, shard);
                c.reduce_scatter(
                    Group::Shard,
                    ReduceOp::Avg,
                    send.as_buf(),
                    mine.as_buf_mut(),
                )?;
                let mut full = OwnedBuf::zeros(d, shard * w);
                c.all_gather(Group::Shard, mine.as_buf(), full.as_buf_mut())?;
                out.extend(full.to_f64_vec());
            }
            Ok(out)
        };
        let res = launch_ok(C, l, t, &body)?;
        let mut want1 = vec![(w as f64 + 1.0) / 2.0; 8];
        want1.resize(shard * w, 0.0);
        let want: Vec<f64> = (0..4).flat_map(|_| want1.clone()).collect();
        for (r, got) in res.iter().enumerate() {
            compare(C, &format!("W={w}, rank {r}"), got, &want)?;
        }
    }
    Ok(())
}

/// Ranks with different batch counts must not hang
/// (<https://github.com/deepspeedai/DeepSpeed/issues/2223>): rank 2 of 4 has 8 batches, the
/// others 4. (a) The others then stop calling; (b) the others go on to an end-of-epoch barrier.
/// Every rank returns within a bound; the ranks whose calls all completed hold exact results, and
/// rank 2 (and in (b) every rank) gets an error naming the mismatch.
pub fn rank_with_fewer_batches_does_not_hang(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "rank_with_fewer_batches_does_not_hang";
    let t = topo(4, 1);
    if !fits(l, t) {
        return Ok(());
    }
    let timeout = Duration::from_secs(5);
    let bound = timeout + Duration::from_secs(10);
    for variant in ["stop", "barrier"] {
        let body = |c: &dyn Communicator| -> RankResult {
            let batches = if c.rank() == 2 { 8 } else { 4 };
            let mut last = Vec::new();
            for b in 0..batches {
                let mut g = vec![(c.rank() + b) as f32; 6];
                c.all_reduce(Group::World, ReduceOp::Avg, (&mut g).into())?;
                last = g.iter().map(|&x| x as f64).collect();
            }
            if variant == "barrier" {
                c.barrier(Group::World)?;
            }
            Ok(last)
        };
        let start = Instant::now();
        let res = l.launch(t, timeout, &body);
        let took = start.elapsed();
        if took > bound {
            return Err(fail(
                C,
                format!("{variant}: ranks returned after {took:?} (bound {bound:?})"),
            ));
        }
        match &res[2] {
            Ok(_) => {
                return Err(fail(
                    C,
                    format!("{variant}: rank 2 completed 8 batches alone"),
                ))
            }
            Err(e) => {
                let m = e.to_string();
                let named = match e {
                    CommError::PeerExited { rank: 2, .. } => true,
                    CommError::MismatchedCalls { .. } => {
                        m.contains("rank 2: all_reduce") && m.contains("barrier")
                    }
                    CommError::Timeout { rank: 2, .. } => true,
                    _ => false,
                };
                if !named {
                    return Err(fail(
                        C,
                        format!("{variant}: rank 2's error does not name the mismatch: {e}"),
                    ));
                }
            }
        }
        for r in [0usize, 1, 3] {
            match (&res[r], variant) {
                // Batch 3's average over ranks: (0+3 + 1+3 + 2+3 + 3+3) / 4 = 4.5.
                (Ok(v), "stop") => compare(C, &format!("{variant}, rank {r}"), v, &[4.5; 6])?,
                (Err(CommError::MismatchedCalls { .. }), "barrier")
                | (Err(CommError::Timeout { .. }), "barrier")
                | (Err(CommError::PeerFailed { .. }), "barrier") => {}
                (other, _) => {
                    return Err(fail(
                        C,
                        format!("{variant}: rank {r}: unexpected outcome {other:?}"),
                    ))
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_reduce_is_sequential() {
        let c = vec![vec![1.0e8], vec![1.0], vec![-1.0e8]];
        assert_eq!(reference_reduce(DType::F32, ReduceOp::Sum, &c), vec![0.0]);
        assert_eq!(reference_reduce(DType::F64, ReduceOp::Sum, &c), vec![1.0]);
    }
}

// ---------------------------------------------------------------- tensor buffers

/// Candle's error as a [`CommError`] of the check body.
fn candle_err(what: &str) -> impl Fn(candle_core::Error) -> CommError + '_ {
    move |e| CommError::Device {
        rank: 0,
        library: "candle",
        call: what.to_string(),
        message: e.to_string(),
    }
}

/// The elements of a vector buffer as a 1-D tensor on `dev` (exact copy).
fn tensor_of(b: &OwnedBuf, dev: &candle_core::Device) -> Result<candle_core::Tensor, CommError> {
    use candle_core::Tensor;
    let r = match b {
        OwnedBuf::F32(v) => Tensor::from_slice(v, v.len(), dev),
        OwnedBuf::BF16(v) => Tensor::from_slice(v, v.len(), dev),
        OwnedBuf::F16(v) => Tensor::from_slice(v, v.len(), dev),
        OwnedBuf::F64(v) => Tensor::from_slice(v, v.len(), dev),
        OwnedBuf::Tensor(t) => Ok(t.clone()),
    };
    r.map_err(candle_err("Tensor::from_slice"))
}

/// The launcher's tensor device, as the body's error when it cannot be opened.
fn open_tensor_device(l: &dyn Launcher) -> Result<candle_core::Device, CommError> {
    l.tensor_device().map_err(|why| CommError::Device {
        rank: 0,
        library: "candle",
        call: "open the tensor checks' device".into(),
        message: why,
    })
}

/// Padding (elements) on each side of the in-place all-gather's narrow view.
const PAD: usize = 3;
/// The padding's value (exact in every dtype); the collective must leave it alone.
const PAD_VALUE: f64 = -3.0;

/// Tensor buffers ([`OwnedBuf::Tensor`] on [`Launcher::tensor_device`]: CPU tensors for host
/// backends, CUDA tensors for NCCL), every topology (W = 1..8, hybrid 2x2, 3x2, 2x3, DDP 1x4),
/// group, dtype and shard size (0 on the CPU only): per (dtype, size) a started all-gather, a
/// started reduce-scatter and all-reduce per op (sum, avg, max), a started in-place all-gather
/// into a `narrow` of a larger 1-D tensor (the view starts 3 elements into its storage, padding
/// on both sides must stay untouched, stale NaNs in the other blocks must be overwritten) and a
/// started broadcast from the last group rank, all issued before the first wait (prefetch);
/// on CPU tensors also a synchronous all-reduce through [`OwnedBuf::with_host_mut`]. Results
/// are read from the caller's own handles (in place: the tensors the communicator handed back
/// are the same storage, checked), bit for bit against the scalar reference.
pub fn tensor_buffers_match_reference(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "tensor_buffers_match_reference";
    let ops = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];
    let host = match l.tensor_device() {
        Ok(d) => d.is_cpu(),
        Err(why) => return Err(fail(C, format!("cannot open the tensor device: {why}"))),
    };
    let sizes: Vec<usize> = SIZES.iter().copied().filter(|&n| host || n > 0).collect();
    for t in topologies() {
        if !fits(l, t) {
            continue;
        }
        for group in GROUPS {
            let g = t.group_size(group);
            let body = |c: &dyn Communicator| -> RankResult {
                let dev = open_tensor_device(l)?;
                let gr = c.group_rank(group);
                let r = c.rank();
                // (handle the caller keeps, pending op) in issue order.
                let mut pending = Vec::new();
                let mut keep = Vec::new();
                for (di, &d) in DTYPES.iter().enumerate() {
                    for &n in &sizes {
                        let salt = 700 + 10 * di as u64;
                        let send = tensor_of(&values(d, r, n, salt), &dev)?;
                        let recv = tensor_of(&OwnedBuf::zeros(d, g * n), &dev)?;
                        keep.push(recv.clone());
                        pending.push(c.start_all_gather(
                            group,
                            OwnedBuf::Tensor(send),
                            OwnedBuf::Tensor(recv),
                        )?);
                        for (oi, &op) in ops.iter().enumerate() {
                            let send = tensor_of(&values(d, r, g * n, salt + 1 + oi as u64), &dev)?;
                            let recv = tensor_of(&OwnedBuf::zeros(d, n), &dev)?;
                            keep.push(recv.clone());
                            pending.push(c.start_reduce_scatter(
                                group,
                                op,
                                OwnedBuf::Tensor(send),
                                OwnedBuf::Tensor(recv),
                            )?);
                            let x = tensor_of(&values(d, r, n, salt + 4 + oi as u64), &dev)?;
                            keep.push(x.clone());
                            pending.push(c.start_all_reduce(group, op, OwnedBuf::Tensor(x))?);
                        }
                        let mut v = vec![PAD_VALUE; PAD + g * n + PAD];
                        v[PAD..PAD + g * n].fill(f64::NAN);
                        for i in 0..n {
                            v[PAD + gr * n + i] = value(d, r, i, salt + 7);
                        }
                        let whole = tensor_of(&OwnedBuf::from_f64(d, &v), &dev)?;
                        let view = whole
                            .narrow(0, PAD, g * n)
                            .map_err(candle_err("Tensor::narrow"))?;
                        keep.push(whole);
                        pending.push(c.start_all_gather_in_place(group, OwnedBuf::Tensor(view))?);
                        let b = tensor_of(&values(d, r, n, salt + 8), &dev)?;
                        keep.push(b.clone());
                        pending.push(c.start_broadcast(group, g - 1, OwnedBuf::Tensor(b))?);
                    }
                }
                for p in pending {
                    let done = p.wait_all()?;
                    let handed_back = done.buf.tensor().is_some()
                        && done.send.as_ref().is_none_or(|s| s.tensor().is_some());
                    if !handed_back {
                        // The tensors must come back as tensors.
                        return Ok(vec![f64::NAN; 1]);
                    }
                }
                let mut out = Vec::new();
                for k in &keep {
                    out.extend(OwnedBuf::Tensor(k.clone()).to_f64_vec());
                }
                if dev.is_cpu() {
                    for (di, &d) in DTYPES.iter().enumerate() {
                        let x = tensor_of(&values(d, r, 7, 790 + di as u64), &dev)?;
                        let mut b = OwnedBuf::Tensor(x.clone());
                        b.with_host_mut(|m| c.all_reduce(group, ReduceOp::Sum, m))
                            .ok_or_else(|| CommError::Unsupported {
                                backend: "conformance",
                                what: "a CPU tensor has no host view".into(),
                            })??;
                        out.extend(OwnedBuf::Tensor(x).to_f64_vec());
                    }
                }
                Ok(out)
            };
            let res = launch_ok(C, l, t, &body)?;
            let mut memo = Memo::default();
            for (r, got) in res.iter().enumerate() {
                let members = t.group_members(group, r);
                let gr = t.group_rank(group, r);
                let mut want = Vec::new();
                for (di, &d) in DTYPES.iter().enumerate() {
                    for &n in &sizes {
                        let salt = 700 + 10 * di as u64;
                        for &m in &members {
                            want.extend_from_slice(memo.get(d, m, n, salt));
                        }
                        for (oi, &op) in ops.iter().enumerate() {
                            let s = salt + 1 + oi as u64;
                            let contribs: Vec<Vec<f64>> = members
                                .iter()
                                .map(|&m| memo.get(d, m, g * n, s)[gr * n..(gr + 1) * n].to_vec())
                                .collect();
                            want.extend(reference_reduce(d, op, &contribs));
                            let s = salt + 4 + oi as u64;
                            let contribs: Vec<Vec<f64>> = members
                                .iter()
                                .map(|&m| memo.get(d, m, n, s).to_vec())
                                .collect();
                            want.extend(reference_reduce(d, op, &contribs));
                        }
                        want.extend([PAD_VALUE; PAD]);
                        for &m in &members {
                            want.extend_from_slice(memo.get(d, m, n, salt + 7));
                        }
                        want.extend([PAD_VALUE; PAD]);
                        want.extend_from_slice(memo.get(d, members[g - 1], n, salt + 8));
                    }
                }
                if host {
                    for (di, &d) in DTYPES.iter().enumerate() {
                        let contribs: Vec<Vec<f64>> = members
                            .iter()
                            .map(|&m| memo.get(d, m, 7, 790 + di as u64).to_vec())
                            .collect();
                        want.extend(reference_reduce(d, ReduceOp::Sum, &contribs));
                    }
                }
                compare(C, &format!("{t}, {group} group, rank {r}"), got, &want)?;
            }
        }
    }
    Ok(())
}

/// Bad tensor buffers are local errors with the numbers, before anything moves: a strided
/// (transposed 2-D) tensor and a u8 tensor are [`CommError::InvalidTensor`] (rank, op, dtype,
/// shape, device), a send tensor overlapping its receive tensor (two narrows of one storage)
/// is [`CommError::InvalidTensor`] too, on the world group of 3 ranks; every rank makes the
/// same bad calls, so the world stays usable (a started all-reduce of tensors follows).
pub fn tensor_bad_buffers_are_local_errors(l: &dyn Launcher) -> Result<(), CheckFailure> {
    const C: &str = "tensor_bad_buffers_are_local_errors";
    let t = topo(3, 1);
    if !fits(l, t) {
        return Ok(());
    }
    let body = |c: &dyn Communicator| -> RankResult {
        use candle_core::Tensor;
        let dev = open_tensor_device(l)?;
        let rank = c.rank();
        let err = candle_err("tensor construction");
        let mut codes = Vec::new();
        let strided = Tensor::zeros((3, 2), candle_core::DType::F32, &dev)
            .and_then(|x| x.t())
            .map_err(&err)?;
        codes.push(
            match c.start_all_reduce(Group::World, ReduceOp::Sum, OwnedBuf::Tensor(strided)) {
                Err(CommError::InvalidTensor {
                    rank: r,
                    op: OpKind::AllReduce,
                    ref shape,
                    ..
                }) if r == rank && shape == &[2, 3] => 1.0,
                _ => 0.0,
            },
        );
        let bytes = Tensor::zeros(6, candle_core::DType::U8, &dev).map_err(&err)?;
        codes.push(
            match c.start_broadcast(Group::World, 0, OwnedBuf::Tensor(bytes)) {
                Err(CommError::InvalidTensor {
                    op: OpKind::Broadcast,
                    ref dtype,
                    ..
                }) if dtype == "u8" => 1.0,
                _ => 0.0,
            },
        );
        let whole = Tensor::zeros(12, candle_core::DType::F32, &dev).map_err(&err)?;
        let send = whole.narrow(0, 4, 4).map_err(&err)?;
        let recv = whole.narrow(0, 0, 12).map_err(&err)?;
        codes.push(
            match c.start_all_gather(Group::World, OwnedBuf::Tensor(send), OwnedBuf::Tensor(recv)) {
                Err(CommError::InvalidTensor {
                    op: OpKind::AllGather,
                    ref reason,
                    ..
                }) if reason.contains("overlaps") => 1.0,
                _ => 0.0,
            },
        );
        // The world still works after the (identical) bad calls.
        let x = Tensor::from_slice(&[rank as f32 + 1.0; 5], 5, &dev).map_err(&err)?;
        let done = c
            .start_all_reduce(Group::World, ReduceOp::Sum, OwnedBuf::Tensor(x.clone()))?
            .wait()?;
        codes.push(if done.tensor().is_some() { 1.0 } else { 0.0 });
        codes.extend(OwnedBuf::Tensor(x).to_f64_vec());
        Ok(codes)
    };
    let res = launch_ok(C, l, t, &body)?;
    for (r, got) in res.iter().enumerate() {
        compare(
            C,
            &format!("rank {r} (1 = the expected error)"),
            got,
            &[1.0, 1.0, 1.0, 1.0, 6.0, 6.0, 6.0, 6.0, 6.0],
        )?;
    }
    Ok(())
}

/// How [`device_tensors_are_errors_on_host_backends`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceCheck {
    /// Run with CUDA tensors: every started call answered
    /// [`CommError::DeviceBufferUnreachable`] with the numbers, and the world stayed usable.
    Passed,
    /// No CUDA device to make a CUDA tensor on (why, candle's message); nothing was checked.
    Skipped(String),
}

/// For host backends only (threads, MPI; not in [`CHECKS`], NCCL takes CUDA tensors): CUDA
/// tensors ([`OwnedBuf::Tensor`] on device `cuda:0`) given to every started call (all-gather
/// with a CUDA receive tensor, in-place all-gather, reduce-scatter with a CUDA send tensor,
/// all-reduce, broadcast) are [`CommError::DeviceBufferUnreachable`] naming the rank, the
/// collective, the dtype, the element count, `cuda:0` and the backend, and the message says to
/// use `--backend nccl`; the world stays usable (a host all-reduce follows), on 2 ranks.
/// Without a CUDA device (or a build without candle's `cuda` feature) returns
/// [`DeviceCheck::Skipped`] and prints `SKIPPED (no CUDA device): ...` to stderr.
pub fn device_tensors_are_errors_on_host_backends(
    l: &dyn Launcher,
) -> Result<DeviceCheck, CheckFailure> {
    const C: &str = "device_tensors_are_errors_on_host_backends";
    let dev = match candle_core::Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            let why = e.to_string();
            eprintln!("SKIPPED (no CUDA device): {C} on {} ({why})", l.name());
            return Ok(DeviceCheck::Skipped(why));
        }
    };
    let t = topo(2, 1);
    if !fits(l, t) {
        return Ok(DeviceCheck::Skipped(format!(
            "{} cannot start 2 ranks",
            l.name()
        )));
    }
    let backend = l.name().to_string();
    let body = |c: &dyn Communicator| -> RankResult {
        use candle_core::Tensor;
        let err = candle_err("CUDA tensor construction");
        let rank = c.rank();
        let cuda = |n: usize, d: candle_core::DType| {
            Tensor::zeros(n, d, &dev)
                .map(OwnedBuf::Tensor)
                .map_err(&err)
        };
        let is = |r: Result<crate::PendingOp, CommError>, want_op: OpKind, dt: DType, n: usize| {
            match r {
                Err(e @ CommError::DeviceBufferUnreachable { .. }) => {
                    let CommError::DeviceBufferUnreachable {
                        rank: r,
                        op,
                        dtype,
                        numel,
                        ref device,
                        ..
                    } = e
                    else {
                        unreachable!()
                    };
                    let text = e.to_string();
                    let ok = r == rank
                        && op == want_op
                        && dtype == dt
                        && numel == n
                        && device == "cuda:0"
                        && text.contains("--backend nccl")
                        && text.contains(&backend);
                    if ok {
                        1.0
                    } else {
                        0.0
                    }
                }
                _ => 0.0,
            }
        };
        let mut codes = vec![0.0; 0];
        codes.extend([
            is(
                c.start_all_gather(
                    Group::World,
                    OwnedBuf::zeros(DType::F32, 4),
                    cuda(8, candle_core::DType::F32)?,
                ),
                OpKind::AllGather,
                DType::F32,
                8,
            ),
            is(
                c.start_all_gather_in_place(Group::World, cuda(10, candle_core::DType::BF16)?),
                OpKind::AllGather,
                DType::BF16,
                10,
            ),
            is(
                c.start_reduce_scatter(
                    Group::World,
                    ReduceOp::Sum,
                    cuda(6, candle_core::DType::F16)?,
                    OwnedBuf::zeros(DType::F16, 3),
                ),
                OpKind::ReduceScatter,
                DType::F16,
                6,
            ),
            is(
                c.start_all_reduce(
                    Group::World,
                    ReduceOp::Avg,
                    cuda(5, candle_core::DType::F64)?,
                ),
                OpKind::AllReduce,
                DType::F64,
                5,
            ),
            is(
                c.start_broadcast(Group::World, 1, cuda(3, candle_core::DType::F32)?),
                OpKind::Broadcast,
                DType::F32,
                3,
            ),
        ]);
        let mut x = vec![rank as f32 + 1.0; 4];
        c.all_reduce(Group::World, ReduceOp::Sum, (&mut x).into())?;
        codes.extend(x.iter().map(|&v| v as f64));
        Ok(codes)
    };
    let res = launch_ok(C, l, t, &body)?;
    for (r, got) in res.iter().enumerate() {
        compare(
            C,
            &format!("rank {r} (1 = the expected error)"),
            got,
            &[1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0],
        )?;
    }
    Ok(DeviceCheck::Passed)
}

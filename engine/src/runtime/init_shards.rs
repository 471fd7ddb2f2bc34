//! Building one rank's initial flat-parameter shards from a [`ParamSource`] and agreeing, across
//! the world, that every rank starts from the same model ([`InitSync`]).
//!
//! Memory: under [`InitSync::Verify`] each shard is filled in place (the buffer becomes the
//! f32 master shard), so initialisation holds the model states the plan counts plus the
//! source's staging buffer; under [`InitSync::BroadcastFromRank0`] one whole flat parameter
//! at a time is filled on rank 0 and broadcast ([`fsdp_planner::ShardPlan::init_bytes`]).

use crate::error::{EngineError, Result};
use crate::init::{fnv1a, ParamSource, FNV_OFFSET};
use crate::runtime::collectives::{f64_chunks_to_u64, u64_to_f64_chunks, Collectives};
use crate::runtime::engine::InitSync;
use fsdp_comm::{BufMut, Group};
use fsdp_planner::{FlatParamLayout, ModelSpec, ShardPlan};

/// Longest failure message exchanged between ranks (bytes; longer ones are cut).
const MESSAGE_BYTES: usize = 2048;

/// Fills the elements of `fl`'s shard `shard_index` into `out` (`shard_numel` elements,
/// padding left 0).
fn fill_shard(
    source: &dyn ParamSource,
    unit: usize,
    fl: &FlatParamLayout,
    shard_index: u64,
    out: &mut [f32],
) -> std::result::Result<(), String> {
    for s in fl.shard_slices(shard_index) {
        let seg = &fl.segments[s.segment];
        let at = s.shard_offset.0 as usize;
        source.fill(
            unit,
            seg.param_index,
            s.param_offset.0,
            &mut out[at..at + s.numel.0 as usize],
        )?;
    }
    Ok(())
}

/// This rank's initial shards, `[unit][flat param][element]` (each `shard_numel` long), built
/// from `source` and checked across ranks (see [`crate::runtime::RankEngine::new_from`]).
///
/// Errors: [`EngineError::Init`] on every rank when any rank's source failed;
/// [`EngineError::RankMismatch`] when fingerprints or replica checksums differ (Verify);
/// [`EngineError::Comm`].
pub(crate) fn init_shards(
    spec: &ModelSpec,
    plan: &ShardPlan,
    comm: &mut Collectives<'_>,
    sync: InitSync,
    source: &dyn ParamSource,
    shard_index: usize,
) -> Result<Vec<Vec<Vec<f32>>>> {
    let rank = comm.rank();
    let si = shard_index as u64;
    let mut failure: Option<String> = None;
    let mut out: Vec<Vec<Vec<f32>>> = Vec::with_capacity(spec.units.len());
    for (u, ul) in plan.units.iter().enumerate() {
        let mut flats = Vec::with_capacity(ul.flat_params.len());
        for fl in &ul.flat_params {
            let shard = match sync {
                InitSync::Verify => {
                    let mut s = vec![0.0f32; fl.shard_numel().as_usize()];
                    if failure.is_none() {
                        if let Err(e) = fill_shard(source, u, fl, si, &mut s) {
                            failure = Some(e);
                        }
                    }
                    s
                }
                InitSync::BroadcastFromRank0 => {
                    let mut full = vec![0.0f32; fl.padded_numel.as_usize()];
                    if rank == 0 && failure.is_none() {
                        let r = (0..fl.shard_size).try_for_each(|k| {
                            let n = fl.shard_numel().as_usize();
                            let at = k as usize * n;
                            fill_shard(source, u, fl, k, &mut full[at..at + n])
                        });
                        if let Err(e) = r {
                            failure = Some(e);
                        }
                    }
                    comm.broadcast(Group::World, 0, BufMut::F32(&mut full))?;
                    fl.shard_of(&full, si)
                }
            };
            flats.push(shard);
        }
        out.push(flats);
    }

    // One exchange: [source fingerprint (4), shard checksum (4), shard index, failed].
    let mut h = FNV_OFFSET;
    for s in out.iter().flatten() {
        h = fnv1a(h, bytemuck::cast_slice(s));
    }
    let mut mine = Vec::with_capacity(10);
    mine.extend(u64_to_f64_chunks(source.fingerprint()));
    mine.extend(u64_to_f64_chunks(h));
    mine.push(shard_index as f64);
    mine.push(if failure.is_some() { 1.0 } else { 0.0 });
    let all = comm.all_gather_f64(&mine)?;
    if let Some(bad) = all.iter().position(|r| r[9] != 0.0) {
        // Every rank reports the first failing rank's own words.
        let mut msg = vec![0.0f64; MESSAGE_BYTES];
        if let Some(m) = &failure {
            for (d, b) in msg.iter_mut().zip(m.bytes()) {
                *d = b as f64;
            }
        }
        let msgs = comm.all_gather_f64(&msg)?;
        let bytes: Vec<u8> = msgs[bad]
            .iter()
            .map(|&b| b as u8)
            .take_while(|&b| b != 0)
            .collect();
        return Err(EngineError::Init(format!(
            "rank {bad}: {}",
            String::from_utf8_lossy(&bytes)
        )));
    }
    if sync == InitSync::Verify {
        let fps: Vec<u64> = all.iter().map(|r| f64_chunks_to_u64(&r[0..4])).collect();
        let bad: Vec<usize> = (0..fps.len()).filter(|&r| fps[r] != fps[0]).collect();
        if !bad.is_empty() {
            return Err(EngineError::RankMismatch {
                what: "initial weights",
                detail: format!(
                    "ranks {bad:?} start from weights whose checksum differs from rank 0's ({:016x} vs {:016x}); seed every rank identically or use broadcast from rank 0",
                    fps[bad[0]], fps[0]
                ),
            });
        }
    }
    // Replicas of one shard hold the same bytes (a non-deterministic source would differ).
    for (r, row) in all.iter().enumerate() {
        let first = all
            .iter()
            .position(|x| x[8] == row[8])
            .expect("a rank matches itself");
        if f64_chunks_to_u64(&row[4..8]) != f64_chunks_to_u64(&all[first][4..8]) {
            return Err(EngineError::RankMismatch {
                what: "initial weights",
                detail: format!(
                    "ranks {first} and {r} hold replicas of shard {} whose checksums differ: the initial-value source is not deterministic",
                    row[8]
                ),
            });
        }
    }
    Ok(out)
}

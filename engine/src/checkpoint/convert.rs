//! The engine's per-rank state to and from the checkpoint crate's per-rank shards: flat
//! parameters addressed by (unit, flat parameter), AdamW moments beside each trainable one.

use fsdp_checkpoints::{CheckpointLayout, CkptError};

/// Converts an engine rank state ([`crate::runtime::RankEngine::export_state`]) into the
/// checkpoint crate's `[unit][flat]` shards for `layout` (the run's layout).
///
/// Only AdamW state (`exp_avg`, `exp_avg_sq`) is stored by format version 1; a trainable
/// flat parameter with other optimizer buffers (SGD momentum) or without both moments is an
/// error, as is a flat parameter missing from the state.
///
/// Errors: `CkptError::InvalidArgument` naming the unit and flat parameter.
pub fn engine_to_ckpt(
    layout: &CheckpointLayout,
    st: &crate::runtime::RankState,
) -> Result<fsdp_checkpoints::RankState, CkptError> {
    let mut flats: Vec<Vec<Option<fsdp_checkpoints::FlatShard>>> = layout
        .units
        .iter()
        .map(|u| vec![None; u.flat_params.len()])
        .collect();
    for f in &st.flats {
        let slot = flats
            .get_mut(f.unit)
            .and_then(|u| u.get_mut(f.flat))
            .ok_or_else(|| {
                CkptError::InvalidArgument(format!(
                    "rank {}: the engine state has unit {} flat {}, which the layout lacks",
                    st.rank, f.unit, f.flat
                ))
            })?;
        let get = |name: &str| {
            f.optimizer_state
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        let (exp_avg, exp_avg_sq) = if f.trainable {
            match (get("exp_avg"), get("exp_avg_sq"), f.optimizer_state.len()) {
                (Some(m), Some(v), 2) => (Some(m), Some(v)),
                _ => {
                    return Err(CkptError::InvalidArgument(format!(
                        "rank {} unit {} flat {}: optimizer state {:?} is not AdamW's (exp_avg, exp_avg_sq); checkpoint format {} stores AdamW state only",
                        st.rank,
                        f.unit,
                        f.flat,
                        f.optimizer_state.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
                        fsdp_checkpoints::FORMAT_VERSION
                    )))
                }
            }
        } else {
            (None, None)
        };
        *slot = Some(fsdp_checkpoints::FlatShard {
            param: f.param.clone(),
            exp_avg,
            exp_avg_sq,
        });
    }
    let flats = flats
        .into_iter()
        .enumerate()
        .map(|(u, v)| {
            v.into_iter()
                .enumerate()
                .map(|(k, f)| {
                    f.ok_or_else(|| {
                        CkptError::InvalidArgument(format!(
                            "rank {}: the engine state lacks unit {u} flat {k}",
                            st.rank
                        ))
                    })
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(fsdp_checkpoints::RankState {
        rank: st.rank as u64,
        flats,
    })
}

/// Converts shards loaded for `rank` under `layout` (e.g. by
/// [`fsdp_checkpoints::Checkpoint::load_rank`], possibly resharded) into the engine's rank state, ready for
/// [`crate::runtime::RankEngine::import_state`]. `optimizer_step` is Adam's step count; trainable
/// flat parameters without moments (a full file) get zero moments (a fresh AdamW state).
pub fn ckpt_to_engine(
    layout: &CheckpointLayout,
    rank: u64,
    st: fsdp_checkpoints::RankState,
    optimizer_step: u64,
) -> crate::runtime::RankState {
    let mut flats = Vec::new();
    for (u, unit) in st.flats.into_iter().enumerate() {
        for (k, f) in unit.into_iter().enumerate() {
            let trainable = layout.units[u].flat_params[k].trainable;
            let n = f.param.len();
            let optimizer_state = if trainable {
                vec![
                    (
                        "exp_avg".to_string(),
                        f.exp_avg.unwrap_or_else(|| vec![0.0; n]),
                    ),
                    (
                        "exp_avg_sq".to_string(),
                        f.exp_avg_sq.unwrap_or_else(|| vec![0.0; n]),
                    ),
                ]
            } else {
                Vec::new()
            };
            flats.push(crate::runtime::FlatShardState {
                unit: u,
                flat: k,
                trainable,
                param: f.param,
                optimizer_state,
            });
        }
    }
    crate::runtime::RankState {
        rank: rank as usize,
        world_size: layout.world_size as usize,
        shard_size: layout.shard_size as usize,
        shard_index: layout.shard_index(rank) as usize,
        plan_fingerprint: layout.plan_fingerprint.clone(),
        optimizer_step,
        skipped_steps: 0,
        loss_scaler: None,
        flats,
    }
}

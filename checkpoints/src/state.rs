//! In-memory per-rank state: the flat shards a rank saves and loads.

/// Which buffer of a flat parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StateKind {
    /// fp32 master parameters.
    Param,
    /// Adam first moment `m`.
    ExpAvg,
    /// Adam second moment `v`.
    ExpAvgSq,
}

impl StateKind {
    /// All three, in file order.
    pub const ALL: [StateKind; 3] = [StateKind::Param, StateKind::ExpAvg, StateKind::ExpAvgSq];

    /// The tensor-name suffix: `param`, `exp_avg`, `exp_avg_sq`.
    pub const fn suffix(self) -> &'static str {
        match self {
            StateKind::Param => "param",
            StateKind::ExpAvg => "exp_avg",
            StateKind::ExpAvgSq => "exp_avg_sq",
        }
    }
}

/// One rank's shard of one flat parameter, owned: `param` and (for trainable flat parameters)
/// both Adam moments, each `shard_numel` f32 elements including padding (zero).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FlatShard {
    /// fp32 master shard (`shard_numel` elements).
    pub param: Vec<f32>,
    /// Adam `exp_avg` shard; `Some` exactly for trainable flat parameters.
    pub exp_avg: Option<Vec<f32>>,
    /// Adam `exp_avg_sq` shard; `Some` exactly for trainable flat parameters.
    pub exp_avg_sq: Option<Vec<f32>>,
}

impl FlatShard {
    /// Borrows this shard for saving.
    pub fn as_ref(&self) -> FlatShardRef<'_> {
        FlatShardRef {
            param: &self.param,
            exp_avg: self.exp_avg.as_deref(),
            exp_avg_sq: self.exp_avg_sq.as_deref(),
        }
    }

    /// The buffer of `kind`, if present.
    pub fn get(&self, kind: StateKind) -> Option<&[f32]> {
        match kind {
            StateKind::Param => Some(&self.param),
            StateKind::ExpAvg => self.exp_avg.as_deref(),
            StateKind::ExpAvgSq => self.exp_avg_sq.as_deref(),
        }
    }
}

/// One rank's shard of one flat parameter, borrowed from the engine's buffers for saving.
/// Same lengths and rules as [`FlatShard`].
#[derive(Debug, Clone, Copy)]
pub struct FlatShardRef<'a> {
    /// fp32 master shard.
    pub param: &'a [f32],
    /// Adam `exp_avg` shard (trainable flat parameters only).
    pub exp_avg: Option<&'a [f32]>,
    /// Adam `exp_avg_sq` shard (trainable flat parameters only).
    pub exp_avg_sq: Option<&'a [f32]>,
}

impl<'a> FlatShardRef<'a> {
    /// The buffer of `kind`, if present.
    pub fn get(&self, kind: StateKind) -> Option<&'a [f32]> {
        match kind {
            StateKind::Param => Some(self.param),
            StateKind::ExpAvg => self.exp_avg,
            StateKind::ExpAvgSq => self.exp_avg_sq,
        }
    }
}

/// Everything one rank holds: `flats[u][k]` is its shard of flat parameter `k` of unit `u`
/// (the order of `CheckpointLayout::units[u].flat_params`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RankState {
    /// The rank.
    pub rank: u64,
    /// Shards indexed `[unit][flat]`.
    pub flats: Vec<Vec<FlatShard>>,
}

impl RankState {
    /// Borrows every shard for saving, indexed `[unit][flat]`.
    pub fn as_refs(&self) -> Vec<Vec<FlatShardRef<'_>>> {
        self.flats
            .iter()
            .map(|u| u.iter().map(FlatShard::as_ref).collect())
            .collect()
    }
}

/// A full (unsharded) tensor: the model's parameter name, shape and f32 data in row-major order.
#[derive(Debug, Clone, PartialEq)]
pub struct FullTensor {
    /// Parameter name.
    pub name: String,
    /// Shape (elements).
    pub shape: Vec<u64>,
    /// Row-major data (`product(shape)` elements).
    pub data: Vec<f32>,
}

/// An infinite or NaN value found in a rank's shards (see [`find_nonfinite`]).
#[derive(Debug, Clone, PartialEq)]
pub struct NonFiniteValue {
    /// Unit index.
    pub unit: usize,
    /// Index of the parameter among the unit's parameters (declaration order of the spec).
    pub param_index: usize,
    /// The parameter's name.
    pub name: String,
    /// The buffer that holds it.
    pub kind: StateKind,
    /// Element index inside the flattened parameter.
    pub index: u64,
    /// The value.
    pub value: f32,
}

/// The first infinite or NaN value among the real elements (padding excluded) of rank
/// `rank`'s shards, in unit, flat-parameter, state-kind and element order; `None` when all are
/// finite. `shards` is `[unit][flat]` as for a save. Shards whose lengths do not match the
/// layout are skipped (the save reports those itself).
pub fn find_nonfinite(
    layout: &crate::layout::CheckpointLayout,
    rank: u64,
    shards: &[Vec<FlatShardRef<'_>>],
) -> Option<NonFiniteValue> {
    let s = layout.shard_index(rank);
    for (u, k, f) in layout.flat_params() {
        let Some(sh) = shards.get(u).and_then(|v| v.get(k)) else {
            continue;
        };
        for kind in StateKind::ALL {
            let Some(buf) = sh.get(kind) else { continue };
            for sl in f.shard_slices(s) {
                let lo = sl.shard_offset.0 as usize;
                let Some(part) = buf.get(lo..lo + sl.numel.0 as usize) else {
                    continue;
                };
                if let Some(i) = part.iter().position(|v| !v.is_finite()) {
                    let seg = &f.segments[sl.segment];
                    return Some(NonFiniteValue {
                        unit: u,
                        param_index: seg.param_index,
                        name: seg.name.clone(),
                        kind,
                        index: sl.param_offset.0 + i as u64,
                        value: part[i],
                    });
                }
            }
        }
    }
    None
}

/// A rank's shards as a save reads them: buffer by buffer, piece by piece, without a copy of
/// the whole state. The engine implements it over its own flat buffers (host vectors directly,
/// device tensors through a bounded host copy); owned and borrowed shards implement it too.
///
/// Buffers are addressed as in a save: `(unit, flat parameter inside the unit, kind)` of the
/// layout being saved, each `shard_numel` elements with padding included.
pub trait ShardSource {
    /// Elements of buffer `kind` of flat parameter `flat` of unit `unit`; `None` when the
    /// source has no such buffer (the moments of a frozen flat parameter, or a flat parameter
    /// the source lacks).
    fn shard_len(&self, unit: usize, flat: usize, kind: StateKind) -> Option<usize>;

    /// Calls `f` with consecutive host slices that together are elements `range` of that
    /// buffer, in order (one slice for a host buffer; bounded pieces for a device buffer).
    /// Stops at the first error `f` returns and returns it.
    ///
    /// Errors: `StateRead` when the buffer is absent or cannot be read; `f`'s errors.
    fn visit(
        &self,
        unit: usize,
        flat: usize,
        kind: StateKind,
        range: std::ops::Range<usize>,
        f: &mut dyn FnMut(&[f32]) -> crate::Result<()>,
    ) -> crate::Result<()>;
}

/// The buffer `kind` of `[unit][flat]` of borrowed shards, if present.
fn slice_of<'a>(
    shards: &[Vec<FlatShardRef<'a>>],
    unit: usize,
    flat: usize,
    kind: StateKind,
) -> Option<&'a [f32]> {
    shards.get(unit)?.get(flat)?.get(kind)
}

/// Visits `range` of `buf` as one slice.
fn visit_slice(
    buf: Option<&[f32]>,
    what: (usize, usize, StateKind),
    range: std::ops::Range<usize>,
    f: &mut dyn FnMut(&[f32]) -> crate::Result<()>,
) -> crate::Result<()> {
    let (unit, flat, kind) = what;
    let len = buf.map_or(0, <[f32]>::len);
    match buf.and_then(|b| b.get(range.clone())) {
        Some(part) => f(part),
        None => Err(crate::CkptError::StateRead(format!(
            "unit {unit} flat param {flat} {}: elements {}..{} of a buffer of {len}",
            kind.suffix(),
            range.start,
            range.end
        ))),
    }
}

/// Borrowed shards `[unit][flat]` (the arguments of
/// [`crate::PendingCheckpoint::write_rank`]) as a [`ShardSource`].
#[derive(Debug, Clone, Copy)]
pub struct ShardRefs<'a, 'b>(pub &'a [Vec<FlatShardRef<'b>>]);

impl ShardSource for ShardRefs<'_, '_> {
    fn shard_len(&self, unit: usize, flat: usize, kind: StateKind) -> Option<usize> {
        slice_of(self.0, unit, flat, kind).map(<[f32]>::len)
    }

    fn visit(
        &self,
        unit: usize,
        flat: usize,
        kind: StateKind,
        range: std::ops::Range<usize>,
        f: &mut dyn FnMut(&[f32]) -> crate::Result<()>,
    ) -> crate::Result<()> {
        visit_slice(
            slice_of(self.0, unit, flat, kind),
            (unit, flat, kind),
            range,
            f,
        )
    }
}

impl ShardSource for RankState {
    fn shard_len(&self, unit: usize, flat: usize, kind: StateKind) -> Option<usize> {
        self.flats.get(unit)?.get(flat)?.get(kind).map(<[f32]>::len)
    }

    fn visit(
        &self,
        unit: usize,
        flat: usize,
        kind: StateKind,
        range: std::ops::Range<usize>,
        f: &mut dyn FnMut(&[f32]) -> crate::Result<()>,
    ) -> crate::Result<()> {
        let buf = self
            .flats
            .get(unit)
            .and_then(|u| u.get(flat))
            .and_then(|s| s.get(kind));
        visit_slice(buf, (unit, flat, kind), range, f)
    }
}

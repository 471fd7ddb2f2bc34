//! Flat-parameter layout: how a unit's parameters are concatenated, padded and cut into shards.
//!
//! A flat parameter is its parameters' elements concatenated in declaration order, each segment
//! starting at a multiple of `alignment` elements, the total padded up to a multiple of
//! `alignment * shard_size`, then cut into `shard_size` equal contiguous shards in shard-index
//! order. A shard range is a pure function of (layout, shard index), as in llm.c's `ShardInfo`
//! and PyTorch FSDP1's `FlatParamHandle` (Zhao et al. 2023, "PyTorch FSDP", section 3.2.1).
//! Padding elements are zero, stay zero, and are never part of a segment.
//!
//! Trainable and frozen parameters of one unit go into separate flat parameters, so that frozen
//! parameters get no gradient or optimizer bytes (mixed in one flat parameter, they would make
//! gradient memory as large as if nothing were frozen:
//! <https://github.com/pytorch/pytorch/pull/104967>).

use crate::error::PlanError;
use crate::hf::{MAX_DIM, MAX_LAYERS};
use crate::spec::{Architecture, ModelSpec, UnitSpec};
use fsdp_types::Numel;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// One parameter's place inside a flat parameter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// Index of the parameter in its unit's `params`.
    pub param_index: usize,
    /// The parameter's name.
    pub name: String,
    /// The parameter's shape (elements).
    pub shape: Vec<u64>,
    /// Offset of the first element inside the unsharded flat parameter (elements).
    pub offset: Numel,
    /// Number of elements.
    pub numel: Numel,
    /// Whether weight decay applies to these elements.
    pub weight_decay: bool,
}

impl Segment {
    /// The element range `[offset, offset + numel)` inside the unsharded flat parameter.
    pub fn range(&self) -> Range<u64> {
        self.offset.0..self.offset.0 + self.numel.0
    }
}

/// The part of one parameter that lies inside one shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardSlice {
    /// Index into the flat parameter's `segments`.
    pub segment: usize,
    /// Offset inside the (flattened) parameter where this slice starts (elements).
    pub param_offset: Numel,
    /// Offset inside the shard where this slice starts (elements).
    pub shard_offset: Numel,
    /// Number of elements in the slice (at least 1).
    pub numel: Numel,
}

/// A span of a shard with one property (a real parameter or padding, decayed or not), in
/// elements relative to the start of the shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardSpan {
    /// Element range inside the shard.
    pub range: Range<u64>,
    /// Whether weight decay applies (always false for padding).
    pub weight_decay: bool,
}

/// The layout of one flat parameter of one unit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatParamLayout {
    /// Index of the owning unit in the model.
    pub unit: usize,
    /// Whether this flat parameter holds trainable parameters (gets grads and optimizer state).
    pub trainable: bool,
    /// Segments in declaration order, non-overlapping, increasing offsets.
    pub segments: Vec<Segment>,
    /// End of the last segment (elements): real elements plus alignment gaps.
    pub unpadded_numel: Numel,
    /// `unpadded_numel` rounded up to a multiple of `alignment * shard_size` (elements).
    pub padded_numel: Numel,
    /// Number of shards (the shard-group size).
    pub shard_size: u64,
    /// Alignment of each segment's offset and of the shard length (elements).
    pub alignment: u64,
}

impl FlatParamLayout {
    /// Lays out `params` (indices into `unit.params`, in order) for a shard group of
    /// `shard_size` ranks, each segment aligned to `alignment` elements.
    ///
    /// Errors: `ZeroAlignment`, `ZeroWorldSize` (shard size 0), `InvalidSpec` when the padded
    /// length does not fit in u64.
    pub fn new(
        unit_index: usize,
        unit: &UnitSpec,
        params: &[usize],
        trainable: bool,
        shard_size: u64,
        alignment: u64,
    ) -> Result<Self, PlanError> {
        if alignment == 0 {
            return Err(PlanError::ZeroAlignment);
        }
        if shard_size == 0 {
            return Err(PlanError::ZeroWorldSize(0));
        }
        let mut offset = 0u64;
        let mut segments = Vec::with_capacity(params.len());
        let too_large = || {
            PlanError::InvalidSpec(format!(
                "unit `{}`: its parameters at alignment {alignment} and shard size {shard_size} \
                 exceed 2^64 elements",
                unit.name
            ))
        };
        for &i in params {
            let p = &unit.params[i];
            offset = offset
                .div_ceil(alignment)
                .checked_mul(alignment)
                .ok_or_else(too_large)?;
            let numel = p.numel();
            segments.push(Segment {
                param_index: i,
                name: p.name.clone(),
                shape: p.shape.clone(),
                offset: Numel(offset),
                numel,
                weight_decay: p.weight_decay,
            });
            offset = offset.checked_add(numel.0).ok_or_else(too_large)?;
        }
        let quantum = alignment.checked_mul(shard_size).ok_or_else(too_large)?;
        let padded = offset
            .div_ceil(quantum)
            .checked_mul(quantum)
            .ok_or_else(too_large)?;
        Ok(FlatParamLayout {
            unit: unit_index,
            trainable,
            segments,
            unpadded_numel: Numel(offset),
            padded_numel: Numel(padded),
            shard_size,
            alignment,
        })
    }

    /// Elements per shard: `padded_numel / shard_size`.
    pub fn shard_numel(&self) -> Numel {
        Numel(self.padded_numel.0 / self.shard_size)
    }

    /// Real (parameter) elements: the sum of the segments' sizes.
    pub fn real_numel(&self) -> Numel {
        self.segments.iter().map(|s| s.numel).sum()
    }

    /// Padding elements: alignment gaps plus tail padding (`padded_numel - real_numel`).
    pub fn padding_numel(&self) -> Numel {
        self.padded_numel - self.real_numel()
    }

    /// The element range of shard `shard_index` inside the unsharded flat parameter.
    /// Panics if `shard_index >= shard_size` (a programming error, not user input).
    pub fn shard_range(&self, shard_index: u64) -> Range<u64> {
        assert!(shard_index < self.shard_size, "shard index out of range");
        let n = self.shard_numel().0;
        shard_index * n..(shard_index + 1) * n
    }

    /// The slices of each parameter that fall inside shard `shard_index`, in order. Parameters
    /// that miss the shard entirely (e.g. a 1-row weight at a large world size) give no slice.
    pub fn shard_slices(&self, shard_index: u64) -> Vec<ShardSlice> {
        let r = self.shard_range(shard_index);
        self.segments
            .iter()
            .enumerate()
            .filter_map(|(k, s)| {
                let lo = s.offset.0.max(r.start);
                let hi = (s.offset.0 + s.numel.0).min(r.end);
                (lo < hi).then(|| ShardSlice {
                    segment: k,
                    param_offset: Numel(lo - s.offset.0),
                    shard_offset: Numel(lo - r.start),
                    numel: Numel(hi - lo),
                })
            })
            .collect()
    }

    /// Real elements in shard `shard_index` (excluding padding).
    pub fn shard_real_numel(&self, shard_index: u64) -> Numel {
        self.shard_slices(shard_index).iter().map(|s| s.numel).sum()
    }

    /// The real spans of shard `shard_index` with their weight-decay flag, relative to the
    /// shard start. Padding is not in any span: kernels given these spans never touch it.
    pub fn shard_spans(&self, shard_index: u64) -> Vec<ShardSpan> {
        self.shard_slices(shard_index)
            .iter()
            .map(|s| ShardSpan {
                range: s.shard_offset.0..s.shard_offset.0 + s.numel.0,
                weight_decay: self.segments[s.segment].weight_decay,
            })
            .collect()
    }

    /// Writes every parameter into a new unsharded flat buffer (padding zero). `params[k]` is
    /// the flattened data of segment `k`. Panics if a length differs from the segment's numel.
    pub fn flatten<T: Copy + Default>(&self, params: &[&[T]]) -> Vec<T> {
        assert_eq!(params.len(), self.segments.len(), "one tensor per segment");
        let mut flat = vec![T::default(); self.padded_numel.as_usize()];
        for (s, p) in self.segments.iter().zip(params) {
            assert_eq!(p.len() as u64, s.numel.0, "tensor `{}` size", s.name);
            flat[s.range().start as usize..s.range().end as usize].copy_from_slice(p);
        }
        flat
    }

    /// Cuts shard `shard_index` out of an unsharded flat buffer of `padded_numel` elements.
    pub fn shard_of<T: Copy>(&self, flat: &[T], shard_index: u64) -> Vec<T> {
        let r = self.shard_range(shard_index);
        flat[r.start as usize..r.end as usize].to_vec()
    }

    /// Reassembles the unsharded flat buffer from all shards in shard-index order (the result
    /// an all-gather produces).
    pub fn unshard<T: Copy>(&self, shards: &[&[T]]) -> Vec<T> {
        assert_eq!(shards.len() as u64, self.shard_size, "one shard per rank");
        let mut flat = Vec::with_capacity(self.padded_numel.as_usize());
        for s in shards {
            assert_eq!(s.len() as u64, self.shard_numel().0, "shard length");
            flat.extend_from_slice(s);
        }
        flat
    }

    /// The data of segment `k` inside an unsharded flat buffer.
    pub fn view<'a, T>(&self, flat: &'a [T], k: usize) -> &'a [T] {
        let r = self.segments[k].range();
        &flat[r.start as usize..r.end as usize]
    }
}

/// The layout of one unit: its flat parameters (trainable first, then frozen; either may be
/// absent) and its tied aliases.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitLayout {
    /// Unit name.
    pub name: String,
    /// Flat parameters: at most one trainable and one frozen.
    pub flat_params: Vec<FlatParamLayout>,
    /// `(tied parameter name, target parameter name)`: the tied name is a view of the target.
    pub tied: Vec<(String, String)>,
}

/// Lays out every unit of `spec` for a shard group of `shard_size`.
///
/// Errors: `InvalidSpec` (no units, empty names, duplicate names, zero-size dims),
/// `TiedAcrossUnits`, `ZeroAlignment`, `ZeroWorldSize`.
pub fn layout_units(
    spec: &ModelSpec,
    shard_size: u64,
    alignment: u64,
) -> Result<Vec<UnitLayout>, PlanError> {
    validate(spec)?;
    let mut out = Vec::with_capacity(spec.units.len());
    for (ui, unit) in spec.units.iter().enumerate() {
        let mut tied = Vec::new();
        let mut trainable = Vec::new();
        let mut frozen = Vec::new();
        for (pi, p) in unit.params.iter().enumerate() {
            if let Some(t) = &p.tied_to {
                tied.push((p.name.clone(), t.clone()));
            } else if p.trainable {
                trainable.push(pi);
            } else {
                frozen.push(pi);
            }
        }
        let mut flat_params = Vec::new();
        if !trainable.is_empty() {
            flat_params.push(FlatParamLayout::new(
                ui, unit, &trainable, true, shard_size, alignment,
            )?);
        }
        if !frozen.is_empty() {
            flat_params.push(FlatParamLayout::new(
                ui, unit, &frozen, false, shard_size, alignment,
            )?);
        }
        out.push(UnitLayout {
            name: unit.name.clone(),
            flat_params,
            tied,
        });
    }
    Ok(out)
}

/// Largest parameter accepted, in elements (2^48: byte counts of whole models stay far from
/// `u64` overflow).
pub const MAX_PARAM_NUMEL: u64 = 1 << 48;

/// Checks a spec: at least one unit, unique non-empty names, no zero-size dimension, no
/// parameter above `MAX_PARAM_NUMEL` elements, every tied parameter's target in the same unit
/// and not itself tied, and the architecture's sizes within the bounds of a `config.json`
/// ([`crate::hf::MAX_DIM`], [`crate::hf::MAX_LAYERS`]).
pub fn validate(spec: &ModelSpec) -> Result<(), PlanError> {
    if spec.units.is_empty() {
        return Err(PlanError::InvalidSpec("the model has no units".into()));
    }
    let mut seen = std::collections::HashMap::new();
    for (ui, u) in spec.units.iter().enumerate() {
        if u.params.is_empty() {
            return Err(PlanError::InvalidSpec(format!(
                "unit `{}` has no parameters",
                u.name
            )));
        }
        for p in &u.params {
            if p.name.is_empty() {
                return Err(PlanError::InvalidSpec(format!(
                    "unit `{}` has a parameter with an empty name",
                    u.name
                )));
            }
            if let Some(d) = p.shape.iter().position(|&d| d == 0) {
                return Err(PlanError::InvalidSpec(format!(
                    "parameter `{}` has size 0 in dimension {d} (shape {:?})",
                    p.name, p.shape
                )));
            }
            let numel = p
                .shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .filter(|&n| n <= MAX_PARAM_NUMEL);
            if numel.is_none() {
                return Err(PlanError::InvalidSpec(format!(
                    "parameter `{}` with shape {:?} exceeds {MAX_PARAM_NUMEL} elements",
                    p.name, p.shape
                )));
            }
            if seen.insert(p.name.clone(), ui).is_some() {
                return Err(PlanError::InvalidSpec(format!(
                    "parameter name `{}` appears twice",
                    p.name
                )));
            }
        }
    }
    for u in &spec.units {
        for p in &u.params {
            if let Some(t) = &p.tied_to {
                let target = u.params.iter().find(|q| &q.name == t);
                match target {
                    Some(q) if q.tied_to.is_none() => {}
                    Some(_) => {
                        return Err(PlanError::InvalidSpec(format!(
                            "`{}` is tied to `{t}`, which is itself tied",
                            p.name
                        )))
                    }
                    None => {
                        let found_in = seen
                            .get(t)
                            .map(|&i| spec.units[i].name.clone())
                            .unwrap_or_default();
                        return Err(PlanError::TiedAcrossUnits {
                            param: p.name.clone(),
                            unit: u.name.clone(),
                            target: t.clone(),
                            found_in,
                        });
                    }
                }
            }
        }
    }
    // The architecture's sizes (as a spec file gives them) feed the activation estimates:
    // they are held to the bounds of a config.json.
    let (sizes, layers): (Vec<(&str, u64)>, u64) = match &spec.arch {
        Architecture::Gpt2(c) => (
            vec![
                ("vocab_size", c.vocab_size),
                ("n_positions", c.n_positions),
                ("d_model", c.d_model),
                ("n_head", c.n_head),
            ],
            c.n_layer,
        ),
        Architecture::Llama(c) => (
            vec![
                ("vocab_size", c.vocab_size),
                ("d_model", c.d_model),
                ("n_head", c.n_head),
                ("n_kv_head", c.n_kv_head),
                ("ffn_hidden", c.ffn_hidden),
                ("max_seq", c.max_seq),
            ],
            c.n_layer,
        ),
        Architecture::Generic => (Vec::new(), 0),
    };
    for (field, v) in sizes {
        if v == 0 || v > MAX_DIM {
            return Err(PlanError::InvalidSpec(format!(
                "architecture field `{field}` is {v}, outside 1..={MAX_DIM}"
            )));
        }
    }
    if layers > MAX_LAYERS {
        return Err(PlanError::InvalidSpec(format!(
            "architecture field `n_layer` is {layers}, above the limit of {MAX_LAYERS}"
        )));
    }
    Ok(())
}

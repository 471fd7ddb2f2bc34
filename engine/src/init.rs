//! Initial parameter values, produced shard by shard: every rank asks a [`ParamSource`] for the
//! element ranges of its own flat-parameter shards only, so no process ever holds the whole
//! model (PyTorch FSDP2 reaches the same end with meta-device construction and
//! `reset_parameters` on the sharded `DTensor`s; DeepSpeed with `zero.Init`).
//!
//! Three sources:
//! - [`RandomInit`]: seeded random initialisation whose element `i` of parameter `p` is a pure
//!   function of `(seed, p's name, i)` (a counter-based generator), so any rank computes any
//!   element without drawing the ones before it, and the initial model is the same at every
//!   world size and sharding;
//! - [`FileWeights`]: published weights (a Hugging Face model directory, a `model.safetensors`,
//!   a sharded index) read by positioned reads of exactly the bytes of the rank's shards
//!   ([`fsdp_checkpoints::WeightFiles`]), cast to the f32 master on the way;
//! - [`FullValues`]: full values already in memory (tests, small models).

use crate::model::det_ln;
use fsdp_checkpoints::{WeightBinding, WeightFiles};
use fsdp_planner::{ModelSpec, ParamSpec};
use rayon::prelude::*;
use std::path::Path;

/// A source of initial parameter values, read by element range.
///
/// Contract: `fill` is deterministic (same arguments, same bits on every rank and every call),
/// and two sources with equal [`ParamSource::fingerprint`]s give the same values.
pub trait ParamSource: Sync {
    /// Writes elements `[start, start + out.len())` (row-major, f32) of parameter `param`
    /// (an index into `spec.units[unit].params`, never a tied parameter) of unit `unit`.
    ///
    /// Errors: a message naming the parameter (and file) when the values cannot be produced
    /// or are not finite.
    fn fill(&self, unit: usize, param: usize, start: u64, out: &mut [f32]) -> Result<(), String>;

    /// A 64-bit digest of what this source produces, equal on every rank that should start
    /// from the same weights (compared across ranks before training).
    fn fingerprint(&self) -> u64;

    /// Largest transient buffer `fill` allocates (bytes), counted by the plan's load bytes.
    fn staging_bytes(&self) -> u64 {
        0
    }
}

/// How a parameter's initial values are drawn ([`RandomInit`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum InitRule {
    /// Every element equal to this value (norm gains 1, biases 0).
    Constant(f32),
    /// Independent normal deviates with mean 0 and this standard deviation.
    Normal {
        /// Standard deviation.
        std: f64,
    },
}

/// SplitMix64's output function (Steele, Lea & Flood 2014, "Fast splittable pseudorandom number
/// generators"): a bijective 64-bit mixer with full avalanche.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// 64-bit FNV-1a of `bytes` from `h`.
pub(crate) fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

pub(crate) const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// The standard normal deviate number `index` of stream `key` under `seed`.
///
/// Method: a counter-based generator in the sense of Salmon et al. 2011 ("Parallel random
/// numbers: as easy as 1, 2, 3"): the 64-bit word for counter `c` is
/// `mix64(mix64(mix64(seed) ^ key) ^ c)` (`mix64`, SplitMix64's mixer), so any element is
/// computed without the ones before it. Element `index` uses counters `2 (8 index + j)` and
/// `2 (8 index + j) + 1` for its `j`-th attempt of Marsaglia's polar method (Marsaglia & Bray
/// 1964): `u, v` uniform in `(-1, 1)` from 53 bits each, accepted when `0 < s = u^2 + v^2 < 1`,
/// result `u sqrt(-2 ln s / s)` with the IEEE-only [`det_ln`]; after 8 rejections (probability
/// `0.215^8 < 5e-6`) the counters continue past every element's (`2^62 + ...`). Only correctly
/// rounded IEEE-754 operations enter, so every platform gives the same bits.
pub fn counter_normal(seed: u64, key: u64, index: u64) -> f64 {
    let base = mix64(mix64(seed) ^ key);
    let word = |c: u64| mix64(base ^ c);
    let unit = |w: u64| 2.0 * ((w >> 11) as f64 * (1.0 / (1u64 << 53) as f64)) - 1.0;
    let mut attempt = 0u64;
    loop {
        let c = if attempt < 8 {
            2 * (8 * index + attempt)
        } else {
            (1u64 << 62) + 2 * (index.wrapping_mul(1 << 20) + attempt)
        };
        let u = unit(word(c));
        let v = unit(word(c + 1));
        let s = u * u + v * v;
        if s > 0.0 && s < 1.0 && s.is_normal() {
            return u * (-2.0 * det_ln(s) / s).sqrt();
        }
        attempt += 1;
    }
}

/// Seeded random initialisation, one [`InitRule`] per parameter, computed element by element
/// with [`counter_normal`] keyed by the FNV-1a hash of the parameter's name.
#[derive(Debug, Clone)]
pub struct RandomInit {
    seed: u64,
    /// `[unit][param]`: the rule and the stream key (FNV-1a of the name).
    rules: Vec<Vec<(InitRule, u64)>>,
}

impl RandomInit {
    /// The initialisation of `spec` under `seed`, with `rule` choosing each parameter's rule.
    pub fn new(spec: &ModelSpec, seed: u64, rule: impl Fn(&ParamSpec) -> InitRule) -> Self {
        RandomInit {
            seed,
            rules: spec
                .units
                .iter()
                .map(|u| {
                    u.params
                        .iter()
                        .map(|p| (rule(p), fnv1a(FNV_OFFSET, p.name.as_bytes())))
                        .collect()
                })
                .collect(),
        }
    }

    /// Every non-tied parameter's full values, `[unit][non-tied param][element]` (the layout
    /// `StagedModel::init_params` returns), for `spec` (the spec given to [`RandomInit::new`]).
    pub fn full(&self, spec: &ModelSpec) -> Vec<Vec<Vec<f32>>> {
        spec.units
            .iter()
            .enumerate()
            .map(|(u, us)| {
                us.params
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.tied_to.is_none())
                    .map(|(k, p)| {
                        let mut v = vec![0.0; p.numel().0 as usize];
                        self.fill(u, k, 0, &mut v)
                            .expect("random values are finite");
                        v
                    })
                    .collect()
            })
            .collect()
    }
}

/// Elements per parallel task of [`RandomInit`]'s fill.
const RANDOM_CHUNK: usize = 1 << 14;

impl ParamSource for RandomInit {
    fn fill(&self, unit: usize, param: usize, start: u64, out: &mut [f32]) -> Result<(), String> {
        let (rule, key) = *self
            .rules
            .get(unit)
            .and_then(|r| r.get(param))
            .ok_or_else(|| format!("no parameter {param} in unit {unit}"))?;
        match rule {
            InitRule::Constant(c) => out.fill(c),
            InitRule::Normal { std } => {
                let seed = self.seed;
                out.par_chunks_mut(RANDOM_CHUNK)
                    .enumerate()
                    .for_each(|(c, chunk)| {
                        let first = start + (c * RANDOM_CHUNK) as u64;
                        for (i, o) in chunk.iter_mut().enumerate() {
                            *o = (counter_normal(seed, key, first + i as u64) * std) as f32;
                        }
                    });
            }
        }
        Ok(())
    }

    fn fingerprint(&self) -> u64 {
        let mut h = fnv1a(FNV_OFFSET, b"random");
        h = fnv1a(h, &self.seed.to_le_bytes());
        for (rule, key) in self.rules.iter().flatten() {
            h = fnv1a(h, &key.to_le_bytes());
            h = match rule {
                InitRule::Constant(c) => fnv1a(fnv1a(h, b"c"), &c.to_le_bytes()),
                InitRule::Normal { std } => fnv1a(fnv1a(h, b"n"), &std.to_le_bytes()),
            };
        }
        h
    }
}

/// Full values held in memory, `[unit][non-tied param][element]` (what
/// `StagedModel::init_params` returns).
#[derive(Debug, Clone, Copy)]
pub struct FullValues<'a> {
    values: &'a [Vec<Vec<f32>>],
    spec: &'a ModelSpec,
}

impl<'a> FullValues<'a> {
    /// Wraps `values` for the parameters of `spec`.
    ///
    /// Errors: a message when the units, tensors or element counts do not match `spec`.
    pub fn new(values: &'a [Vec<Vec<f32>>], spec: &'a ModelSpec) -> Result<Self, String> {
        if values.len() != spec.units.len() {
            return Err(format!(
                "model has {} units, initial values {}",
                spec.units.len(),
                values.len()
            ));
        }
        for (us, v) in spec.units.iter().zip(values) {
            let nontied: Vec<&ParamSpec> =
                us.params.iter().filter(|p| p.tied_to.is_none()).collect();
            if nontied.len() != v.len() {
                return Err(format!(
                    "unit {}: {} initial tensors for {} parameters",
                    us.name,
                    v.len(),
                    nontied.len()
                ));
            }
            for (p, t) in nontied.iter().zip(v) {
                if t.len() as u64 != p.numel().0 {
                    return Err(format!(
                        "{}: {} initial values for {} elements",
                        p.name,
                        t.len(),
                        p.numel().0
                    ));
                }
            }
        }
        Ok(FullValues { values, spec })
    }
}

impl ParamSource for FullValues<'_> {
    fn fill(&self, unit: usize, param: usize, start: u64, out: &mut [f32]) -> Result<(), String> {
        let params = &self.spec.units[unit].params;
        let k = params[..param]
            .iter()
            .filter(|p| p.tied_to.is_none())
            .count();
        let t = &self.values[unit][k];
        let s = start as usize;
        out.copy_from_slice(&t[s..s + out.len()]);
        Ok(())
    }

    fn fingerprint(&self) -> u64 {
        let mut h = fnv1a(FNV_OFFSET, b"values");
        for t in self.values.iter().flatten() {
            h = fnv1a(h, bytemuck::cast_slice(t));
        }
        h
    }
}

/// Published weights bound to a model ([`WeightFiles::bind`]), read shard by shard.
#[derive(Debug)]
pub struct FileWeights {
    files: WeightFiles,
    binding: WeightBinding,
}

impl FileWeights {
    /// Opens the weights at `path` (a model directory, a `.safetensors` file or an index) and
    /// binds them strictly to `spec`. Reads only headers, and the values of a tied parameter
    /// stored anyway (an `lm_head.weight` beside the embedding it is tied to), which must
    /// equal its target's.
    ///
    /// Errors: every [`fsdp_checkpoints::CkptError`] of [`WeightFiles::open`] and
    /// [`WeightFiles::bind`] (missing, unexpected or mis-shaped tensors, truncated files, a
    /// stored tied copy that differs from its target), each naming the tensor and its file.
    pub fn open(path: &Path, spec: &ModelSpec) -> Result<Self, fsdp_checkpoints::CkptError> {
        let files = WeightFiles::open(path)?;
        let binding = files.bind(spec)?;
        Ok(FileWeights { files, binding })
    }

    /// The opened files.
    pub fn files(&self) -> &WeightFiles {
        &self.files
    }

    /// The binding of tensors to parameters.
    pub fn binding(&self) -> &WeightBinding {
        &self.binding
    }
}

impl ParamSource for FileWeights {
    fn fill(&self, unit: usize, param: usize, start: u64, out: &mut [f32]) -> Result<(), String> {
        let t = self.binding.params[unit][param]
            .ok_or_else(|| format!("parameter {param} of unit {unit} is tied"))?;
        self.files
            .read_f32(t, start, out)
            .map_err(|e| e.to_string())?;
        // Initial weights are where a non-finite value would enter without any gradient.
        if let Some(i) = out.iter().position(|v| !v.is_finite()) {
            let e = &self.files.tensors()[t];
            return Err(format!(
                "{}: tensor {} holds {} at element {}: initial weights must be finite",
                self.files.file_of(e).display(),
                e.name,
                out[i],
                start + i as u64
            ));
        }
        Ok(())
    }

    fn fingerprint(&self) -> u64 {
        fnv1a(
            fnv1a(FNV_OFFSET, b"files"),
            &self.files.fingerprint().to_le_bytes(),
        )
    }

    fn staging_bytes(&self) -> u64 {
        let largest = self
            .files
            .tensors()
            .iter()
            .map(|t| t.numel() * t.dtype.size())
            .max()
            .unwrap_or(0);
        largest.min(fsdp_checkpoints::LOAD_CHUNK_BYTES)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_normal_has_unit_moments() {
        let n = 200_000u64;
        let xs: Vec<f64> = (0..n).map(|i| counter_normal(7, 11, i)).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.01, "variance {var}");
        // Tail mass beyond 2 sigma: 4.55 %.
        let tail = xs.iter().filter(|x| x.abs() > 2.0).count() as f64 / n as f64;
        assert!((tail - 0.0455).abs() < 0.002, "tail {tail}");
        // Other seeds and streams give other values.
        assert_ne!(counter_normal(8, 11, 5), xs[5]);
        assert_ne!(counter_normal(7, 12, 5), xs[5]);
    }

    /// A rank fills its shard of a parameter from an offset, in parallel chunks of
    /// `RANDOM_CHUNK`: element `start + i` is deviate `start + i` of the parameter's stream,
    /// whatever the offset and wherever the chunks are cut, so every shard is the slice of the
    /// whole parameter.
    #[test]
    fn random_fill_from_any_offset_is_the_slice_of_the_whole() {
        let numel = 3 * RANDOM_CHUNK as u64 + 123;
        let spec = ModelSpec {
            name: "one".into(),
            units: vec![fsdp_planner::UnitSpec {
                name: "u".into(),
                params: vec![ParamSpec::new("u.w", &[numel])],
            }],
            arch: fsdp_planner::Architecture::Generic,
        };
        let std = 0.02;
        let init = RandomInit::new(&spec, 7, |_| InitRule::Normal { std });
        let key = fnv1a(FNV_OFFSET, b"u.w");
        let whole = init.full(&spec).remove(0).remove(0);
        assert_eq!(whole.len() as u64, numel);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let expect = |start: u64, len: usize| -> Vec<f32> {
            (0..len as u64)
                .map(|i| (counter_normal(7, key, start + i) * std) as f32)
                .collect()
        };
        assert_eq!(bits(&whole), bits(&expect(0, numel as usize)));
        let chunk = RANDOM_CHUNK as u64;
        for (start, len) in [
            (1, 5),
            (chunk - 3, 7),
            (chunk + 17, 2 * RANDOM_CHUNK + 1),
            (numel - 200, 200),
            (numel / 3, (numel / 3) as usize),
        ] {
            let mut out = vec![0f32; len];
            init.fill(0, 0, start, &mut out).unwrap();
            let s = start as usize;
            assert_eq!(bits(&out), bits(&whole[s..s + len]), "from {start}");
            assert_eq!(bits(&out), bits(&expect(start, len)), "from {start}");
        }
    }
}

//! Small models that run through the real engine in the tests of published faults (padding,
//! global-norm clipping, gradient-accumulation scaling, frozen parameters, uneven batches,
//! different initial weights): a linear loss `dot(p, c)` whose gradient is exactly `c`, and a
//! stack of `Linear` layers.

use candle_core::{Device, Tensor};
use fsdp::runtime::{MicroBatch, StagedModel};
use fsdp_planner::{Architecture, ModelSpec, ParamSpec, UnitSpec};

/// A one-stage model with the linear loss `sum_i dot(p, c_i)`: `p` is the concatenation of
/// the unit's non-tied parameters (declaration order, flattened), each sample `c_i` a row of
/// the micro-batch input `[samples, numel]`. The gradient of one sample is exactly `c_i`.
#[derive(Debug, Clone)]
pub struct DotModel {
    spec: ModelSpec,
    init: Vec<Vec<f32>>,
}

impl DotModel {
    /// A one-unit model named `name` with parameters `(name, shape)` (all trainable, weight
    /// decay on) and the given initial values per parameter.
    ///
    /// Panics if a value vector's length differs from its shape's element count.
    pub fn new(name: &str, params: &[(&str, &[u64])], init: Vec<Vec<f32>>) -> Self {
        let ps: Vec<ParamSpec> = params
            .iter()
            .map(|(n, s)| {
                let mut p = ParamSpec::new(*n, s);
                p.weight_decay = true;
                p
            })
            .collect();
        for (p, v) in ps.iter().zip(&init) {
            assert_eq!(p.numel().0 as usize, v.len(), "{}: initial values", p.name);
        }
        DotModel {
            spec: ModelSpec {
                name: name.into(),
                units: vec![UnitSpec {
                    name: "unit".into(),
                    params: ps,
                }],
                arch: Architecture::Generic,
            },
            init,
        }
    }

    /// Total parameter elements.
    pub fn numel(&self) -> usize {
        self.init.iter().map(|v| v.len()).sum()
    }

    /// A micro-batch of samples `rows` (each `numel` long); `count` = number of rows.
    pub fn batch(&self, rows: &[Vec<f32>]) -> candle_core::Result<MicroBatch> {
        let n = self.numel();
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let input = Tensor::from_vec(flat, (rows.len(), n), &Device::Cpu)?;
        Ok(MicroBatch {
            target: input.clone(),
            input,
            count: rows.len() as u64,
        })
    }
}

impl StagedModel for DotModel {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn stage_units(&self) -> Vec<usize> {
        vec![0]
    }

    fn forward(&self, _stage: usize, _p: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(x.clone())
    }

    fn loss(&self, params: &[Tensor], x: &Tensor, _mb: &MicroBatch) -> candle_core::Result<Tensor> {
        let flat: Vec<Tensor> = params
            .iter()
            .map(|p| p.flatten_all())
            .collect::<candle_core::Result<_>>()?;
        let p = Tensor::cat(&flat, 0)?;
        x.broadcast_mul(&p.unsqueeze(0)?)?.sum_all()
    }

    fn init_params(&self, _seed: u64) -> Vec<Vec<Vec<f32>>> {
        vec![self.init.clone()]
    }
}

/// A stack of `Linear` layers `y = x W^T + b` (`W` `[out, in]`), grouped into units (a unit may
/// hold several layers, e.g. a frozen and a trainable one), with `tanh` between layers
/// (none after the last) and the loss `sum over samples of 0.5 * ||y - target||^2`.
#[derive(Debug, Clone)]
pub struct LinearStack {
    spec: ModelSpec,
    /// Per unit: its layers as (weight index, bias index) into the unit's params.
    layers: Vec<Vec<(usize, Option<usize>)>>,
    tanh: bool,
}

/// One layer of a [`LinearStack`].
#[derive(Debug, Clone, Copy)]
pub struct LayerDef {
    /// Input features.
    pub d_in: u64,
    /// Output features.
    pub d_out: u64,
    /// Whether the layer has a bias.
    pub bias: bool,
    /// Whether the layer is trainable.
    pub trainable: bool,
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e3779b97f4a7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^ (z >> 31)
}

impl LinearStack {
    /// Builds the stack: `units[u]` lists the layers of unit `u` in order; `tanh` puts a tanh
    /// between consecutive layers. Parameter names: `layers.{i}.weight` / `layers.{i}.bias`.
    pub fn new(name: &str, units: &[Vec<LayerDef>], tanh: bool) -> Self {
        let mut spec_units = Vec::new();
        let mut layers = Vec::new();
        let mut i = 0;
        for (u, defs) in units.iter().enumerate() {
            let mut ps = Vec::new();
            let mut ls = Vec::new();
            for d in defs {
                let mut w = ParamSpec::new(format!("layers.{i}.weight"), &[d.d_out, d.d_in]);
                w.trainable = d.trainable;
                ps.push(w);
                let wi = ps.len() - 1;
                let bi = if d.bias {
                    let mut b = ParamSpec::new(format!("layers.{i}.bias"), &[d.d_out]);
                    b.trainable = d.trainable;
                    ps.push(b);
                    Some(ps.len() - 1)
                } else {
                    None
                };
                ls.push((wi, bi));
                i += 1;
            }
            spec_units.push(UnitSpec {
                name: format!("unit.{u}"),
                params: ps,
            });
            layers.push(ls);
        }
        LinearStack {
            spec: ModelSpec {
                name: name.into(),
                units: spec_units,
                arch: Architecture::Generic,
            },
            layers,
            tanh,
        }
    }

    fn apply(
        &self,
        unit: usize,
        params: &[Tensor],
        x: &Tensor,
        last_unit: bool,
    ) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        let n = self.layers[unit].len();
        for (j, &(w, b)) in self.layers[unit].iter().enumerate() {
            h = h.matmul(&params[w].t()?)?;
            if let Some(b) = b {
                h = h.broadcast_add(&params[b])?;
            }
            let is_last = last_unit && j + 1 == n;
            if self.tanh && !is_last {
                h = h.tanh()?;
            }
        }
        Ok(h)
    }

    /// A micro-batch of `x` `[samples, d_in]` and targets `[samples, d_out]`.
    pub fn batch(
        x: Vec<f32>,
        d_in: usize,
        y: Vec<f32>,
        d_out: usize,
    ) -> candle_core::Result<MicroBatch> {
        let n = x.len() / d_in;
        Ok(MicroBatch {
            input: Tensor::from_vec(x, (n, d_in), &Device::Cpu)?,
            target: Tensor::from_vec(y, (n, d_out), &Device::Cpu)?,
            count: n as u64,
        })
    }
}

impl StagedModel for LinearStack {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn stage_units(&self) -> Vec<usize> {
        (0..self.layers.len()).collect()
    }

    fn forward(&self, stage: usize, params: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor> {
        self.apply(stage, params, x, false)
    }

    fn loss(&self, params: &[Tensor], x: &Tensor, mb: &MicroBatch) -> candle_core::Result<Tensor> {
        let y = self.apply(self.layers.len() - 1, params, x, true)?;
        let d = (y - &mb.target)?;
        d.sqr()?.sum_all()? * 0.5
    }

    /// Uniform `(-1/sqrt(in), 1/sqrt(in))` weights and biases from SplitMix64 keyed by `seed`
    /// (PyTorch's `nn.Linear` default range).
    fn init_params(&self, seed: u64) -> Vec<Vec<Vec<f32>>> {
        let mut st = seed ^ 0x5eed;
        self.spec
            .units
            .iter()
            .map(|u| {
                u.params
                    .iter()
                    .map(|p| {
                        let fan_in = if p.shape.len() == 2 {
                            p.shape[1]
                        } else {
                            p.shape[0]
                        };
                        let bound = 1.0 / (fan_in as f64).sqrt();
                        (0..p.numel().0)
                            .map(|_| {
                                let r = (splitmix(&mut st) >> 11) as f64 / (1u64 << 53) as f64;
                                ((2.0 * r - 1.0) * bound) as f32
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect()
    }
}

//! The GPT-2 style decoder (Radford et al. 2019, "Language Models are Unsupervised Multitask
//! Learners"; architecture of Vaswani et al. 2017 with pre-LayerNorm as in GPT-2 §2.3) computed
//! one FSDP unit at a time on candle-core tensors.
//!
//! The model owns no parameters: the engine unshards a unit (all-gathers its flat parameter),
//! builds one tensor per parameter (views of the unsharded flat parameter, in the unit's
//! declaration order from the [`ModelSpec`]) and calls [`Gpt::forward_stage`] or
//! [`Gpt::head_loss`]. Backward is candle autograd over the same call (unit-level recompute:
//! make the parameters and the stage input `Var`s, recompute, backpropagate `(y * g_y).sum()`).
//!
//! Parameter names, shapes and unit structure are those of
//! [`fsdp_planner::presets::gpt2_spec`] (Hugging Face `GPT2LMHeadModel` naming, Conv1D weights
//! stored `[in, out]` so a linear layer is `y = x @ W + b`).
//!
//! The hot elementwise parts (token + position embedding, LayerNorm, causal softmax, bias add,
//! bias + GELU, cross-entropy) have two implementations, chosen by [`OpsPath`]: on the CPU they
//! run as fused candle custom ops with hand-written backward passes ([`ops`], CPU only; there
//! the whole causal self-attention, from the qkv projection's output to the heads' output, is
//! one op, [`ops::causal_attention`], while the composite path splits q, k, v and runs two
//! batched matmuls around its softmax); on a
//! CUDA device the same math is composed from candle primitives that have CUDA kernels and
//! differentiated by candle autograd ([`composite`]). The default, [`OpsPath::Auto`], picks by
//! the device of the tensors; [`Gpt::with_ops_path`] forces one path (the composite path runs
//! on the CPU too, which is how the two are tested against each other,
//! `engine/tests/model_device.rs`).
//!
//! Dtypes: a unit computes in the dtype of its parameters (`param_dtype`): f32, bf16 or f16 in
//! training, f64 on the CPU for gradient checks. Stage inputs after the embedding and every
//! activation are in that dtype, matrix products run in it (candle's CPU matmul widens bf16 to
//! f32 and narrows the product; f16 uses gemm's f16 kernel; on CUDA cuBLAS's bf16/f16 GEMMs),
//! and the normalisations, softmax, GELU and cross-entropy compute in f32 on 16-bit storage
//! ([`ops`] and [`composite`] module docs: one contract for both paths), with the loss
//! returned in f32 ([`ops::compute_dtype`]).
//! Parameters of one unit in different dtypes, or activations in another dtype than the
//! parameters, are an error (no silent cast). Mixed precision after Micikevicius et al. 2018.

use super::stage::{StageDriver, StageMath, StageUnits};
use super::{composite, ops, ModelError, OpsPath, Stage};
use candle_core::{DType, Device, Tensor};
use fsdp_planner::presets::{byte_gpt_config, gpt2_spec, openai_gpt2_config};
use fsdp_planner::{Gpt2Config, ModelSpec};

/// LayerNorm epsilon, as GPT-2 (`layer_norm_epsilon = 1e-5`).
pub const LN_EPS: f64 = 1e-5;
/// Standard deviation of the GPT-2 weight initialisation (`initializer_range = 0.02`).
pub const INIT_STD: f64 = 0.02;

/// Positions of the parameters of each kind inside their unit's parameter list.
#[derive(Debug, Clone, Copy)]
struct LnIdx {
    w: usize,
    b: Option<usize>,
}

#[derive(Debug, Clone, Copy)]
struct LinIdx {
    w: usize,
    b: Option<usize>,
}

#[derive(Debug, Clone, Copy)]
struct BlockIdx {
    ln_1: LnIdx,
    c_attn: LinIdx,
    attn_proj: LinIdx,
    ln_2: LnIdx,
    c_fc: LinIdx,
    mlp_proj: LinIdx,
}

#[derive(Debug, Clone, Copy)]
struct EmbedIdx {
    wte: usize,
    wpe: usize,
}

#[derive(Debug, Clone, Copy)]
struct HeadIdx {
    ln_f: LnIdx,
    lm_head: usize,
}

/// A GPT-2 style decoder: configuration, its [`ModelSpec`] (units and parameters in
/// declaration order) and the forward/backward math of each stage.
///
/// Shapes below: `B` micro-batch size (sequences), `T` sequence length (tokens, `T <=
/// n_positions`), `D = d_model`, `V = vocab_size`, `H = n_head`.
#[derive(Debug, Clone)]
pub struct Gpt {
    /// Hyper-parameters.
    pub cfg: Gpt2Config,
    /// The planner's description of the units and parameters (from `gpt2_spec`).
    pub spec: ModelSpec,
    units: StageUnits,
    embed: EmbedIdx,
    head: HeadIdx,
    blocks: Vec<BlockIdx>,
    ops_path: OpsPath,
}

fn find(spec: &ModelSpec, unit: usize, name: &str) -> Option<usize> {
    spec.units[unit].params.iter().position(|p| p.name == name)
}

impl Gpt {
    /// Builds the model `name` from `cfg`: validates the configuration and derives the spec with
    /// [`gpt2_spec`].
    ///
    /// Errors: [`ModelError::ZeroSize`] if any of `vocab_size`, `n_positions`, `d_model`,
    /// `n_layer`, `n_head` is 0; [`ModelError::HeadsDoNotDivide`] if `d_model % n_head != 0`.
    pub fn new(name: &str, cfg: Gpt2Config) -> Result<Self, ModelError> {
        for (field, v) in [
            ("vocab_size", cfg.vocab_size),
            ("n_positions", cfg.n_positions),
            ("d_model", cfg.d_model),
            ("n_layer", cfg.n_layer),
            ("n_head", cfg.n_head),
        ] {
            if v == 0 {
                return Err(ModelError::ZeroSize {
                    name: name.to_string(),
                    field,
                });
            }
        }
        if !cfg.d_model.is_multiple_of(cfg.n_head) {
            return Err(ModelError::HeadsDoNotDivide {
                name: name.to_string(),
                d_model: cfg.d_model,
                n_head: cfg.n_head,
            });
        }
        let spec = gpt2_spec(name, &cfg);
        let l = cfg.n_layer as usize;
        let units = StageUnits::new(l, cfg.tied_head);
        let (embed_unit, head_unit, first_block) = (units.embed, units.head, units.first_block);
        let idx = |unit: usize, n: &str| {
            find(&spec, unit, n).unwrap_or_else(|| panic!("gpt2_spec has no parameter {n}"))
        };
        let opt = |unit: usize, n: &str| find(&spec, unit, n);
        let embed = EmbedIdx {
            wte: idx(embed_unit, "transformer.wte.weight"),
            wpe: idx(embed_unit, "transformer.wpe.weight"),
        };
        let head = HeadIdx {
            ln_f: LnIdx {
                w: idx(head_unit, "transformer.ln_f.weight"),
                b: opt(head_unit, "transformer.ln_f.bias"),
            },
            lm_head: idx(head_unit, "lm_head.weight"),
        };
        let blocks = (0..l)
            .map(|i| {
                let u = first_block + i;
                let p = format!("transformer.h.{i}");
                let ln = |s: &str| LnIdx {
                    w: idx(u, &format!("{p}.{s}.weight")),
                    b: opt(u, &format!("{p}.{s}.bias")),
                };
                let lin = |s: &str| LinIdx {
                    w: idx(u, &format!("{p}.{s}.weight")),
                    b: opt(u, &format!("{p}.{s}.bias")),
                };
                BlockIdx {
                    ln_1: ln("ln_1"),
                    c_attn: lin("attn.c_attn"),
                    attn_proj: lin("attn.c_proj"),
                    ln_2: ln("ln_2"),
                    c_fc: lin("mlp.c_fc"),
                    mlp_proj: lin("mlp.c_proj"),
                }
            })
            .collect();
        Ok(Gpt {
            cfg,
            spec,
            units,
            embed,
            head,
            blocks,
            ops_path: OpsPath::Auto,
        })
    }

    /// This model computing with `path` ([`OpsPath`]; [`Gpt::new`] starts with
    /// [`OpsPath::Auto`]). Only the implementation of the fused-op set changes; parameters,
    /// spec and stages are the same.
    pub fn with_ops_path(mut self, path: OpsPath) -> Self {
        self.ops_path = path;
        self
    }

    /// The configured [`OpsPath`] (not resolved against a device; see [`OpsPath::resolve`]).
    pub fn ops_path(&self) -> OpsPath {
        self.ops_path
    }

    /// With `true`, compute with the candle-primitive compositions even on the CPU (the path
    /// CUDA devices take): the same as `with_ops_path(OpsPath::Composite)`; `false` restores
    /// [`OpsPath::Auto`]. Kept for existing callers; prefer [`Gpt::with_ops_path`].
    pub fn with_reference_ops(self, reference: bool) -> Self {
        self.with_ops_path(if reference {
            OpsPath::Composite
        } else {
            OpsPath::Auto
        })
    }

    /// Builds a preset by name: the byte-level presets `tiny`, `mini`, `small`, `base`
    /// ([`byte_gpt_config`], vocabulary 256, untied head) or the OpenAI GPT-2 sizes `gpt2`,
    /// `gpt2-medium`, `gpt2-large`, `gpt2-xl` ([`openai_gpt2_config`], tied head).
    ///
    /// Errors: [`ModelError::UnknownPreset`] for any other name.
    pub fn from_preset(name: &str) -> Result<Self, ModelError> {
        let cfg = byte_gpt_config(name)
            .or_else(|| openai_gpt2_config(name))
            .ok_or_else(|| ModelError::UnknownPreset {
                name: name.to_string(),
            })?;
        Gpt::new(name, cfg)
    }

    /// Number of transformer blocks `L`.
    pub fn n_layer(&self) -> usize {
        self.cfg.n_layer as usize
    }

    /// Model width `D`.
    pub fn d_model(&self) -> usize {
        self.cfg.d_model as usize
    }

    /// The unit index (into `spec.units`) that computes `stage`.
    ///
    /// Untied: `Embed -> 0`, `Block(i) -> i + 1`, `Head -> L + 1`. Tied: `Block(i) -> i`,
    /// `Embed -> L`, `Head -> L` (the root unit). Panics if `Block(i)` has `i >= L`.
    pub fn unit_of(&self, stage: Stage) -> usize {
        self.units.unit_of(stage)
    }

    /// The forward schedule: `(stage, unit index)` in execution order, `L + 2` entries.
    ///
    /// Untied: `[(Embed, 0), (Block(0), 1), ..., (Block(L-1), L), (Head, L + 1)]`.
    /// Tied: `[(Embed, L), (Block(0), 0), ..., (Block(L-1), L - 1), (Head, L)]`.
    /// Backward runs it in reverse.
    pub fn stages(&self) -> Vec<(Stage, usize)> {
        self.units.stages()
    }

    /// The stage at position `index` of [`Gpt::stages`]: `0` the embedding, `1..=L` the blocks,
    /// anything later the head.
    pub(crate) fn stage_at(&self, index: usize) -> Stage {
        self.units.stage_at(index)
    }

    /// Deterministic GPT-2 initialisation from `seed`: the same values on every rank and every
    /// platform.
    ///
    /// The initial-value rule of parameter `p` (Radford et al. 2019 §2.3; Hugging Face
    /// `GPT2PreTrainedModel`): embeddings, attention/MLP input weights and an untied LM head
    /// ~ N(0, 0.02); the residual projections `attn.c_proj.weight` and `mlp.c_proj.weight`
    /// ~ N(0, 0.02/sqrt(2 L)); biases 0; LayerNorm weights 1.
    pub fn init_rule(&self, p: &fsdp_planner::ParamSpec) -> crate::init::InitRule {
        use crate::init::InitRule;
        let name = p.name.as_str();
        if p.shape.len() == 1 {
            // LayerNorm gain or a bias.
            InitRule::Constant(if name.ends_with(".weight") { 1.0 } else { 0.0 })
        } else if name.ends_with("attn.c_proj.weight") || name.ends_with("mlp.c_proj.weight") {
            InitRule::Normal {
                std: INIT_STD / (2.0 * self.cfg.n_layer as f64).sqrt(),
            }
        } else {
            InitRule::Normal { std: INIT_STD }
        }
    }

    /// The seeded initialisation ([`crate::init::RandomInit`] with [`Gpt::init_rule`]): each
    /// element a pure function of `(seed, parameter name, element index)`, so every rank can
    /// draw its own shards only and the model is the same at every world size.
    pub fn random_init(&self, seed: u64) -> crate::init::RandomInit {
        crate::init::RandomInit::new(&self.spec, seed, |p| self.init_rule(p))
    }

    /// The full initial values of [`Gpt::random_init`]: `[unit][param][element]`, per unit
    /// (spec order), per parameter in declaration order with tied parameters EXCLUDED, the
    /// flattened row-major f32 values (`numel` elements).
    pub fn init_params(&self, seed: u64) -> Vec<Vec<Vec<f32>>> {
        self.random_init(seed).full(&self.spec)
    }

    /// Builds candle tensors for every unit from [`Gpt::init_params`]-style values: per unit,
    /// ALL parameters in declaration order with shapes from the spec, a tied parameter being a
    /// clone (same storage) of its target's tensor. This is the `unit_params` argument of
    /// [`Gpt::forward_stage`] for a single-process model.
    ///
    /// Errors: a candle error if a value vector's length does not match its parameter's numel.
    pub fn params_to_tensors(
        &self,
        values: &[Vec<Vec<f32>>],
        device: &Device,
    ) -> candle_core::Result<Vec<Vec<Tensor>>> {
        let mut out: Vec<Vec<Tensor>> = Vec::with_capacity(self.spec.units.len());
        for (u, unit) in self.spec.units.iter().enumerate() {
            let mut ts: Vec<Tensor> = Vec::with_capacity(unit.params.len());
            let mut k = 0;
            for p in &unit.params {
                let shape: Vec<usize> = p.shape.iter().map(|&s| s as usize).collect();
                match &p.tied_to {
                    None => {
                        ts.push(Tensor::from_slice(&values[u][k], shape, device)?);
                        k += 1;
                    }
                    Some(target) => {
                        let j = unit
                            .params
                            .iter()
                            .position(|q| &q.name == target)
                            .ok_or_else(|| {
                                candle_core::Error::Msg(format!(
                                    "{}: tied target {target} not in unit {}",
                                    p.name, unit.name
                                ))
                            })?;
                        ts.push(ts[j].clone());
                    }
                }
            }
            out.push(ts);
        }
        Ok(out)
    }

    /// Forward of one stage.
    ///
    /// `unit_params`: ALL parameters of the stage's unit ([`Gpt::unit_of`]) in declaration
    /// order (a tied parameter passed as its target's tensor), shapes from the spec, all of one
    /// float dtype, the unit's compute dtype (`param_dtype`: f32, bf16 or f16 in training; f64
    /// works on the CPU for gradient checks). Hidden states in and out have that dtype too.
    /// - `Embed`: `x` u32 token ids `[B, T]` -> hidden `[B, T, D]` (`wte[x] + wpe[0..T]`).
    /// - `Block(i)`: hidden `[B, T, D]` -> `[B, T, D]`:
    ///   `x + attn(ln_1(x))`, then `+ mlp(ln_2(.))` (pre-LayerNorm, causal multi-head
    ///   self-attention with softmax(q k^T / sqrt(D/H)), 4x MLP with tanh-GELU).
    /// - `Head`: hidden `[B, T, D]` -> logits `[B, T, V]` (`ln_f(x) @ lm_head.weight^T`).
    ///
    /// A stage need not use every parameter of its unit (the tied `root` unit's `Embed` stage
    /// uses only `wte`/`wpe`, its `Head` stage only `ln_f` and `lm_head`): after backward,
    /// `grads.get(param)` is `None` for the unused ones, meaning a zero gradient.
    ///
    /// Errors: wrong parameter count or shapes, `T > n_positions`, a token id `>= V`,
    /// parameters of more than one dtype or of a non-float dtype, hidden states `x` of another
    /// dtype than the parameters.
    pub fn forward_stage(
        &self,
        stage: Stage,
        unit_params: &[Tensor],
        x: &Tensor,
    ) -> candle_core::Result<Tensor> {
        self.drive_stage(stage, unit_params, x)
    }

    /// Head stage with the loss: hidden `x` `[B, T, D]` and `targets` u32 `[B, T]` -> a scalar
    /// (0-dim tensor of dtype [`ops::compute_dtype`]`(x.dtype())`: F32 for f32, bf16 and f16
    /// units, so a 16-bit unit's loss is not rounded to 16 bits; F64 for f64): the SUM over the
    /// `B*T` tokens of the cross-entropy `-log softmax(logits)[target]` in nats. The engine
    /// divides by the global token count exactly once. Backward from it gives gradients in the
    /// unit's dtype.
    ///
    /// Errors: as [`Gpt::forward_stage`] for `Head`; a target `>= V`; `targets` not `[B, T]`.
    pub fn head_loss(
        &self,
        unit_params: &[Tensor],
        x: &Tensor,
        targets: &Tensor,
    ) -> candle_core::Result<Tensor> {
        self.drive_head_loss(unit_params, x, targets)
    }

    /// Whole-model forward as ONE autograd graph (the single-process reference): `params` per
    /// unit as for [`Gpt::forward_stage`] (e.g. from [`Gpt::params_to_tensors`], or `Var`s),
    /// `ids` and `targets` u32 `[B, T]` -> the summed cross-entropy scalar of
    /// [`Gpt::head_loss`]. Errors: as the stages.
    pub fn forward_loss(
        &self,
        params: &[Vec<Tensor>],
        ids: &Tensor,
        targets: &Tensor,
    ) -> candle_core::Result<Tensor> {
        self.drive_forward_loss(params, ids, targets)
    }

    fn n_head_usize(&self) -> usize {
        self.cfg.n_head as usize
    }
}

/// The GPT-2 math of each stage; the shared driver ([`StageDriver`]) does the rest.
impl StageMath for Gpt {
    fn stage_spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn stage_units(&self) -> StageUnits {
        self.units
    }

    fn configured_ops_path(&self) -> OpsPath {
        self.ops_path
    }

    fn vocab(&self) -> usize {
        self.cfg.vocab_size as usize
    }

    fn embed_fwd(&self, p: &[Tensor], ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        if ids.dtype() != DType::U32 {
            candle_core::bail!("Embed: token ids must be u32, got {:?}", ids.dtype());
        }
        if t as u64 > self.cfg.n_positions {
            candle_core::bail!(
                "Embed: sequence length {t} exceeds n_positions {}",
                self.cfg.n_positions
            );
        }
        let d = self.d_model();
        let (wte, wpe) = (&p[self.embed.wte], &p[self.embed.wpe]);
        let h = if self.fused(wte)? {
            ops::embedding(wte, wpe, ids)?
        } else {
            composite::embedding(wte, wpe, ids)?
        };
        h.reshape((b, t, d))
    }

    fn block_fwd(&self, layer: usize, p: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor> {
        let ix = &self.blocks[layer];
        let (b, t, d) = x.dims3()?;
        let h = self.n_head_usize();
        let hd = d / h;
        let x2 = x.reshape((b * t, d))?;
        let fz = self.fused(x)?;
        // Attention sub-block.
        let a = layer_norm(fz, &x2, &p[ix.ln_1.w], ix.ln_1.b.map(|i| &p[i]))?;
        let qkv = linear(fz, &a, &p[ix.c_attn.w], ix.c_attn.b.map(|i| &p[i]))?; // [BT, 3D]
        let y = if fz {
            // One fused op: strided GEMMs on the qkv rows, output already [BT, D].
            ops::causal_attention(&qkv, b, t, h)?
        } else {
            let qkv = qkv.reshape((b, t, 3, h, hd))?.permute((2, 0, 3, 1, 4))?; // [3, B, H, T, hd]
            let q = qkv.get(0)?.contiguous()?;
            let k = qkv.get(1)?.contiguous()?;
            let v = qkv.get(2)?.contiguous()?;
            let scores = q.matmul(&k.t()?)?; // [B, H, T, T]
            let scale = 1.0 / (hd as f64).sqrt();
            let att = composite::causal_softmax(&scores, scale)?;
            let y = att.matmul(&v)?; // [B, H, T, hd]
            y.transpose(1, 2)?.reshape((b * t, d))?
        };
        let y = linear(fz, &y, &p[ix.attn_proj.w], ix.attn_proj.b.map(|i| &p[i]))?;
        let x2 = (x2 + y)?;
        // MLP sub-block.
        let m = layer_norm(fz, &x2, &p[ix.ln_2.w], ix.ln_2.b.map(|i| &p[i]))?;
        let f = m.matmul(&p[ix.c_fc.w])?;
        let f = if fz {
            ops::bias_gelu(&f, ix.c_fc.b.map(|i| &p[i]))?
        } else {
            composite::bias_gelu(&f, ix.c_fc.b.map(|i| &p[i]))?
        };
        let y = linear(fz, &f, &p[ix.mlp_proj.w], ix.mlp_proj.b.map(|i| &p[i]))?;
        (x2 + y)?.reshape((b, t, d))
    }

    /// `ln_f(x) @ lm_head^T` as `[B*T, V]`.
    fn logits(&self, p: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let x2 = x.reshape((b * t, d))?;
        let fz = self.fused(x)?;
        let h = layer_norm(
            fz,
            &x2,
            &p[self.head.ln_f.w],
            self.head.ln_f.b.map(|i| &p[i]),
        )?;
        h.matmul(&p[self.head.lm_head].t()?)
    }
}

/// `x @ w (+ b)` for `x` `[N, in]`, `w` `[in, out]`, `b` `[out]`; the bias add fused or
/// composite.
fn linear(fused: bool, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let y = x.matmul(w)?;
    match b {
        Some(b) if fused => ops::bias_add(&y, b),
        Some(b) => composite::bias_add(&y, b),
        None => Ok(y),
    }
}

/// LayerNorm over the last dim of `x` `[N, D]` (Ba et al. 2016), eps [`LN_EPS`], fused or
/// composite.
fn layer_norm(
    fused: bool,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    if fused {
        ops::layer_norm(x, w, b, LN_EPS)
    } else {
        composite::layer_norm(x, w, b, LN_EPS)
    }
}

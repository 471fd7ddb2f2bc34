//! The Llama-family decoder (Touvron et al. 2023, "LLaMA"; Llama 2 and 3; Mistral, Jiang et al.
//! 2023; Qwen2, Yang et al. 2024) computed one FSDP unit at a time on candle-core tensors, with
//! exactly the parameters of [`fsdp_planner::presets::llama_spec`] (Hugging Face
//! `LlamaForCausalLM` names, torch `Linear` weights stored `[out, in]`, so a projection is
//! `y = x @ W^T (+ b)`).
//!
//! A block is pre-norm: `x + attn(rms_norm(x))`, then `+ mlp(rms_norm(.))`, with
//! - RMSNorm (Zhang & Sennrich 2019): `x / sqrt(mean(x^2) + eps) * w`;
//! - rotary position embeddings (Su et al. 2021) on queries and keys, in the "rotate half"
//!   layout of Hugging Face `transformers` (`x * cos + rotate_half(x) * sin`, frequencies
//!   `theta^(-2i/hd)` repeated for both halves), optionally with Llama 3.1's frequency scaling
//!   ([`fsdp_planner::Llama3RopeScaling`]);
//! - grouped-query attention (Ainslie et al. 2023): `n_kv_head` key/value heads, each shared by
//!   `n_head / n_kv_head` consecutive query heads (`transformers`' `repeat_kv`), causal,
//!   `softmax(q k^T / sqrt(hd))`; optional q/k/v biases (Qwen2);
//! - the SwiGLU MLP (Shazeer 2020): `down(silu(gate(x)) * up(x))`.
//!
//! The head is the final RMSNorm and `lm_head` (`[V, D]`, tied to the token embedding when the
//! config says so), followed by the summed cross-entropy.
//!
//! Ops paths ([`OpsPath`], as the GPT): on the CPU RMSNorm is the fused op [`ops::rms_norm`],
//! the rotary embedding with the key/value heads repeated and packed as `[B·T, 3D]` rows is
//! [`ops::rope_qkv`], whose output the fused [`ops::causal_attention`] reads, the SwiGLU gate
//! is [`ops::swiglu`], the q/k/v biases [`ops::bias_add`] and the cross-entropy
//! [`ops::cross_entropy_sum`] (each one pass forward and one backward, hand-written
//! gradients). The composite path (the CUDA path, and available on the CPU as the reference)
//! composes the candle primitives of [`rms_norm`], [`rope`], `repeat_kv` and [`swiglu`]
//! below, computes attention with candle matmuls around [`composite::causal_softmax`] and the
//! loss with [`composite::cross_entropy_sum`].
//!
//! Dtypes: a unit computes in the dtype of its parameters (f32, bf16, f16; f64 for gradient
//! checks). Matrix products run in that dtype; RMSNorm, the rotary embedding, SiLU and the
//! product with `up` widen 16-bit storage to f32 and round each output once; the loss is f32
//! (f64 for f64 parameters).
//!
//! Mistral's sliding window is exact for sequences within the window, where it equals full
//! causal attention; a longer sequence is an error (not silently computed with full
//! attention).

use super::stage::{StageDriver, StageMath, StageUnits};
use super::{composite, ops, ModelError, OpsPath, Stage, INIT_STD};
use candle_core::{DType, Device, Tensor, D};
use fsdp_planner::presets::{llama_config, llama_numerics, llama_spec};
use fsdp_planner::{LlamaConfig, LlamaNumerics, ModelSpec};

#[derive(Debug, Clone, Copy)]
struct ProjIdx {
    w: usize,
    b: Option<usize>,
}

#[derive(Debug, Clone, Copy)]
struct LlamaBlockIdx {
    input_layernorm: usize,
    q: ProjIdx,
    k: ProjIdx,
    v: ProjIdx,
    o: usize,
    post_attention_layernorm: usize,
    gate: usize,
    up: usize,
    down: usize,
}

/// A Llama-family decoder: configuration, numerics, its [`ModelSpec`] and the math of each
/// stage.
///
/// Shapes below: `B` sequences, `T` tokens per sequence, `D = d_model`, `H = n_head`,
/// `KV = n_kv_head`, `hd = D / H`, `F = ffn_hidden`, `V = vocab_size`.
#[derive(Debug, Clone)]
pub struct Llama {
    /// Sizes (what the planner plans).
    pub cfg: LlamaConfig,
    /// RMSNorm epsilon, rotary base and scaling, sliding window.
    pub numerics: LlamaNumerics,
    /// The planner's description of the units and parameters (from [`llama_spec`]).
    pub spec: ModelSpec,
    units: StageUnits,
    embed_tokens: usize,
    norm: usize,
    lm_head: usize,
    blocks: Vec<LlamaBlockIdx>,
    /// Rotary inverse frequencies `[hd / 2]`, scaled, in f64.
    inv_freq: Vec<f64>,
    ops_path: OpsPath,
}

/// Rotary inverse frequencies `theta^(-2i/hd)` for `i < hd/2`, with Llama 3.1's scaling when
/// given (`transformers`' `_compute_llama3_parameters`, computed here in f64).
pub fn rope_inv_freq(head_dim: usize, n: &LlamaNumerics) -> Vec<f64> {
    let base: Vec<f64> = (0..head_dim / 2)
        .map(|i| 1.0 / n.rope_theta.powf((2 * i) as f64 / head_dim as f64))
        .collect();
    let Some(s) = n.rope_scaling else {
        return base;
    };
    let old = s.original_max_position_embeddings as f64;
    let low_wavelen = old / s.low_freq_factor;
    let high_wavelen = old / s.high_freq_factor;
    base.into_iter()
        .map(|f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen > low_wavelen {
                f / s.factor
            } else if wavelen < high_wavelen {
                f
            } else {
                let smooth =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

fn find(spec: &ModelSpec, unit: usize, name: &str) -> Option<usize> {
    spec.units[unit].params.iter().position(|p| p.name == name)
}

impl Llama {
    /// Builds the model `name` from its sizes and numerics; the spec is
    /// [`llama_spec`]`(name, &cfg)`.
    ///
    /// Errors: [`ModelError::ZeroSize`] for a zero size; [`ModelError::HeadsDoNotDivide`] if
    /// `d_model % n_head != 0`; [`ModelError::Invalid`] if `n_head % n_kv_head != 0`, the head
    /// dimension is odd (rotary embeddings rotate pairs), or the numerics are not positive and
    /// finite.
    pub fn new(name: &str, cfg: LlamaConfig, numerics: LlamaNumerics) -> Result<Self, ModelError> {
        for (field, v) in [
            ("vocab_size", cfg.vocab_size),
            ("d_model", cfg.d_model),
            ("n_layer", cfg.n_layer),
            ("n_head", cfg.n_head),
            ("n_kv_head", cfg.n_kv_head),
            ("ffn_hidden", cfg.ffn_hidden),
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
        let invalid = |problem: String| ModelError::Invalid {
            name: name.to_string(),
            problem,
        };
        if !cfg.n_head.is_multiple_of(cfg.n_kv_head) {
            return Err(invalid(format!(
                "n_head {} is not a multiple of n_kv_head {}",
                cfg.n_head, cfg.n_kv_head
            )));
        }
        let hd = cfg.d_model / cfg.n_head;
        if !hd.is_multiple_of(2) {
            return Err(invalid(format!(
                "head dimension {hd} is odd; rotary embeddings rotate pairs of dimensions"
            )));
        }
        for (field, v) in [
            ("rms_norm_eps", numerics.rms_norm_eps),
            ("rope_theta", numerics.rope_theta),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(format!(
                    "{field} must be positive and finite, got {v}"
                )));
            }
        }
        let spec = llama_spec(name, &cfg);
        let l = cfg.n_layer as usize;
        let units = StageUnits::new(l, cfg.tied_head);
        let (embed_unit, head_unit, first_block) = (units.embed, units.head, units.first_block);
        let idx = |unit: usize, n: &str| {
            find(&spec, unit, n).unwrap_or_else(|| panic!("llama_spec has no parameter {n}"))
        };
        let blocks = (0..l)
            .map(|i| {
                let u = first_block + i;
                let p = format!("model.layers.{i}");
                let proj = |s: &str| ProjIdx {
                    w: idx(u, &format!("{p}.self_attn.{s}.weight")),
                    b: find(&spec, u, &format!("{p}.self_attn.{s}.bias")),
                };
                LlamaBlockIdx {
                    input_layernorm: idx(u, &format!("{p}.input_layernorm.weight")),
                    q: proj("q_proj"),
                    k: proj("k_proj"),
                    v: proj("v_proj"),
                    o: idx(u, &format!("{p}.self_attn.o_proj.weight")),
                    post_attention_layernorm: idx(
                        u,
                        &format!("{p}.post_attention_layernorm.weight"),
                    ),
                    gate: idx(u, &format!("{p}.mlp.gate_proj.weight")),
                    up: idx(u, &format!("{p}.mlp.up_proj.weight")),
                    down: idx(u, &format!("{p}.mlp.down_proj.weight")),
                }
            })
            .collect();
        Ok(Llama {
            inv_freq: rope_inv_freq(hd as usize, &numerics),
            embed_tokens: idx(embed_unit, "model.embed_tokens.weight"),
            norm: idx(head_unit, "model.norm.weight"),
            lm_head: idx(head_unit, "lm_head.weight"),
            cfg,
            numerics,
            spec,
            units,
            blocks,
            ops_path: OpsPath::Auto,
        })
    }

    /// Builds a Llama preset by name ([`llama_config`] and [`llama_numerics`]: `llama-tiny`,
    /// `llama-mini`, `llama2-7b`, `llama3-8b`, `llama3-70b`).
    ///
    /// Errors: [`ModelError::UnknownPreset`] for any other name.
    pub fn from_preset(name: &str) -> Result<Self, ModelError> {
        match (llama_config(name), llama_numerics(name)) {
            (Some(c), Some(n)) => Llama::new(name, c, n),
            _ => Err(ModelError::UnknownPreset {
                name: name.to_string(),
            }),
        }
    }

    /// This model computing with `path` (see [`OpsPath`]).
    pub fn with_ops_path(mut self, path: OpsPath) -> Self {
        self.ops_path = path;
        self
    }

    /// Number of decoder layers `L`.
    pub fn n_layer(&self) -> usize {
        self.cfg.n_layer as usize
    }

    /// Head dimension `hd = D / H`.
    pub fn head_dim(&self) -> usize {
        (self.cfg.d_model / self.cfg.n_head) as usize
    }

    /// The unit index computing `stage`: untied `Embed -> 0`, `Block(i) -> i + 1`, `Head ->
    /// L + 1`; tied `Block(i) -> i`, `Embed` and `Head -> L` (the root unit). Panics if
    /// `Block(i)` has `i >= L`.
    pub fn unit_of(&self, stage: Stage) -> usize {
        self.units.unit_of(stage)
    }

    /// The forward schedule `(stage, unit)`: embedding, the `L` blocks, the head.
    pub fn stages(&self) -> Vec<(Stage, usize)> {
        self.units.stages()
    }

    /// The longest sequence this model computes exactly: the sliding window when there is one
    /// (`None`: no limit; rotary positions have no table to run out of).
    pub fn max_exact_seq_len(&self) -> Option<u64> {
        self.numerics.sliding_window
    }

    /// The initial-value rule of parameter `p`, as `transformers`' `LlamaPreTrainedModel`:
    /// embeddings and every projection weight ~ N(0, 0.02), q/k/v biases 0, RMSNorm gains 1.
    pub fn init_rule(&self, p: &fsdp_planner::ParamSpec) -> crate::init::InitRule {
        use crate::init::InitRule;
        if p.shape.len() == 1 {
            InitRule::Constant(if p.name.ends_with("norm.weight") {
                1.0
            } else {
                0.0
            })
        } else {
            InitRule::Normal { std: INIT_STD }
        }
    }

    /// The seeded initialisation ([`crate::init::RandomInit`] with [`Llama::init_rule`]).
    pub fn random_init(&self, seed: u64) -> crate::init::RandomInit {
        crate::init::RandomInit::new(&self.spec, seed, |p| self.init_rule(p))
    }

    /// The full initial values of [`Llama::random_init`]: `[unit][non-tied param][element]`
    /// (row-major).
    pub fn init_params(&self, seed: u64) -> Vec<Vec<Vec<f32>>> {
        self.random_init(seed).full(&self.spec)
    }

    /// Forward of one stage; `unit_params` are ALL parameters of the stage's unit in
    /// declaration order (a tied one as its target's tensor), of one float dtype.
    /// - `Embed`: u32 ids `[B, T]` -> hidden `[B, T, D]` (`embed_tokens[ids]`);
    /// - `Block(i)`: hidden `[B, T, D]` -> `[B, T, D]`;
    /// - `Head`: hidden `[B, T, D]` -> logits `[B, T, V]`.
    ///
    /// Errors: wrong parameter count, shapes or dtypes; a token id `>= V`; hidden states of
    /// another dtype than the parameters; `T` longer than the sliding window.
    pub fn forward_stage(
        &self,
        stage: Stage,
        unit_params: &[Tensor],
        x: &Tensor,
    ) -> candle_core::Result<Tensor> {
        self.drive_stage(stage, unit_params, x)
    }

    /// The head with the loss: hidden `[B, T, D]` and u32 targets `[B, T]` -> the 0-dim SUM
    /// over the `B·T` tokens of `-log softmax(logits)[target]` in nats (f32; f64 for f64
    /// parameters). Errors: as [`Llama::forward_stage`]; a target `>= V`; targets not `[B, T]`.
    pub fn head_loss(
        &self,
        unit_params: &[Tensor],
        x: &Tensor,
        targets: &Tensor,
    ) -> candle_core::Result<Tensor> {
        self.drive_head_loss(unit_params, x, targets)
    }

    /// Whole-model forward as one autograd graph: `params` per unit, u32 `ids` and `targets`
    /// `[B, T]` -> the summed cross-entropy of [`Llama::head_loss`]. Errors: as the stages.
    pub fn forward_loss(
        &self,
        params: &[Vec<Tensor>],
        ids: &Tensor,
        targets: &Tensor,
    ) -> candle_core::Result<Tensor> {
        self.drive_forward_loss(params, ids, targets)
    }

    fn check_seq_len(&self, t: usize) -> candle_core::Result<()> {
        if let Some(w) = self.numerics.sliding_window {
            if t as u64 > w {
                candle_core::bail!(
                    "sequence length {t} exceeds the sliding window {w}: only sequences within \
                     the window are computed (exactly, as full causal attention)"
                );
            }
        }
        Ok(())
    }

    /// `cos` and `sin` of the rotary angles `pos · inv_freq[i]`, `[T · hd/2]` each (row `pos`),
    /// in f64 (the platform's `cos`/`sin`; deterministic in a process).
    fn rope_angles(&self, t: usize) -> (Vec<f64>, Vec<f64>) {
        let half = self.inv_freq.len();
        let mut c = Vec::with_capacity(t * half);
        let mut s = Vec::with_capacity(t * half);
        for pos in 0..t {
            for &f in &self.inv_freq {
                let a = pos as f64 * f;
                c.push(a.cos());
                s.push(a.sin());
            }
        }
        (c, s)
    }

    /// The angles of [`Llama::rope_angles`] as `[T, hd/2]` tensors, rounded once to `dtype`.
    fn rope_tables(
        &self,
        t: usize,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let (c, s) = self.rope_angles(t);
        let c = Tensor::from_vec(c, (t, half), device)?.to_dtype(dtype)?;
        let s = Tensor::from_vec(s, (t, half), device)?.to_dtype(dtype)?;
        Ok((c, s))
    }

    /// RMSNorm of `x` `[N, D]` with gain `w`: the fused op or the composite reference.
    fn norm(&self, fused: bool, x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
        let eps = self.numerics.rms_norm_eps;
        if fused {
            ops::rms_norm(x, w, eps)
        } else {
            rms_norm(x, w, eps)
        }
    }
}

/// The Llama-family math of each stage; the shared driver ([`StageDriver`]) does the rest.
impl StageMath for Llama {
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
        self.check_seq_len(t)?;
        let wte = &p[self.embed_tokens];
        let v = self.cfg.vocab_size as usize;
        if ids.elem_count() > 0 {
            let m = ids.flatten_all()?.max(0)?.to_scalar::<u32>()?;
            if m as usize >= v {
                candle_core::bail!("Embed: token id {m} >= vocab_size {v}");
            }
        }
        let flat = ids.flatten_all()?.contiguous()?;
        // The table is a node of its own (a widened copy, or `1 * w + 0`), so the rows'
        // gradient reaches a tied embedding as ONE term, the same bits in one graph and unit
        // by unit (as the GPT's embedding).
        let table = if is_half(wte) {
            wte.contiguous()?.to_dtype(DType::F32)?
        } else {
            wte.contiguous()?.affine(1.0, 0.0)?
        };
        table
            .index_select(&flat, 0)?
            .to_dtype(wte.dtype())?
            .reshape((b, t, self.cfg.d_model as usize))
    }

    fn block_fwd(&self, layer: usize, p: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor> {
        let ix = &self.blocks[layer];
        let (b, t, d) = x.dims3()?;
        self.check_seq_len(t)?;
        let (h, kv, hd) = (
            self.cfg.n_head as usize,
            self.cfg.n_kv_head as usize,
            self.head_dim(),
        );
        let fz = self.fused(x)?;
        let x2 = x.reshape((b * t, d))?;
        // Attention sub-block.
        let a = self.norm(fz, &x2, &p[ix.input_layernorm])?;
        let q = linear_t(fz, &a, &p[ix.q.w], ix.q.b.map(|i| &p[i]))?; // [BT, H hd]
        let k = linear_t(fz, &a, &p[ix.k.w], ix.k.b.map(|i| &p[i]))?; // [BT, KV hd]
        let v = linear_t(fz, &a, &p[ix.v.w], ix.v.b.map(|i| &p[i]))?;
        let y = if fz {
            // Rotary embedding, repeated key/value heads and the [BT, 3D] packing in one op.
            let (cos, sin) = self.rope_angles(t);
            let rotary = ops::Rotary {
                cos: &cos,
                sin: &sin,
                t,
                n_head: h,
                n_kv_head: kv,
            };
            let qkv = ops::rope_qkv(&q, &k, &v, rotary)?;
            ops::causal_attention(&qkv, b, t, h)?
        } else {
            let cdt = ops::compute_dtype(x.dtype());
            let (cos, sin) = self.rope_tables(t, cdt, x.device())?;
            let q = rope(&q.reshape((b, t, h, hd))?, &cos, &sin)?; // [B, T, H, hd]
            let k = rope(&k.reshape((b, t, kv, hd))?, &cos, &sin)?; // [B, T, KV, hd]
            let v = v.reshape((b, t, kv, hd))?;
            let (k, v) = (repeat_kv(&k, h / kv)?, repeat_kv(&v, h / kv)?); // [B, T, H, hd]
            let q = q.transpose(1, 2)?.contiguous()?; // [B, H, T, hd]
            let k = k.transpose(1, 2)?.contiguous()?;
            let v = v.transpose(1, 2)?.contiguous()?;
            let scores = q.matmul(&k.t()?)?;
            let att = composite::causal_softmax(&scores, 1.0 / (hd as f64).sqrt())?;
            att.matmul(&v)?.transpose(1, 2)?.reshape((b * t, d))?
        };
        let y = y.matmul(&p[ix.o].t()?)?;
        let x2 = (x2 + y)?;
        // SwiGLU MLP sub-block.
        let m = self.norm(fz, &x2, &p[ix.post_attention_layernorm])?;
        let g = m.matmul(&p[ix.gate].t()?)?;
        let u = m.matmul(&p[ix.up].t()?)?;
        let f = if fz {
            ops::swiglu(&g, &u)?
        } else {
            swiglu(&g, &u)?
        };
        let y = f.matmul(&p[ix.down].t()?)?;
        (x2 + y)?.reshape((b, t, d))
    }

    /// `rms_norm(x) @ lm_head^T` as `[B·T, V]`.
    fn logits(&self, p: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let fz = self.fused(x)?;
        let hn = self.norm(fz, &x.reshape((b * t, d))?, &p[self.norm])?;
        hn.matmul(&p[self.lm_head].t()?)
    }
}

fn is_half(t: &Tensor) -> bool {
    matches!(t.dtype(), DType::BF16 | DType::F16)
}

/// `x @ w^T (+ b)` for `x` `[N, in]`, a torch-layout weight `w` `[out, in]`, `b` `[out]`; the
/// bias add fused or composite.
fn linear_t(
    fused: bool,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let y = x.matmul(&w.t()?)?;
    match b {
        Some(b) if fused => ops::bias_add(&y, b),
        Some(b) => composite::bias_add(&y, b),
        None => Ok(y),
    }
}

/// RMSNorm over the last dim (Zhang & Sennrich 2019): `x` `[N, D]`, gain `w` `[D]` -> `x /
/// sqrt(mean(x^2) + eps) * w`, dtype of `x`; 16-bit storage computed in f32 and rounded once.
/// Errors: `x`'s last dim not `D`, mixed dtypes.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let d = w.elem_count();
    if x.dim(D::Minus1)? != d {
        candle_core::bail!("rms_norm: x {:?} vs weight [{d}]", x.dims());
    }
    ops::same_dtype("rms_norm", &[("x", x), ("weight", w)])?;
    let cdt = ops::compute_dtype(x.dtype());
    let (x32, w32) = (x.to_dtype(cdt)?, w.to_dtype(cdt)?);
    let ms = x32.sqr()?.mean_keepdim(D::Minus1)?;
    let r = (ms + eps)?.sqrt()?.recip()?;
    x32.broadcast_mul(&r)?
        .broadcast_mul(&w32)?
        .to_dtype(x.dtype())
}

/// Rotary embedding in the rotate-half layout: `x` `[B, T, heads, hd]`, `cos`/`sin` `[T, hd/2]`
/// in the compute dtype -> `[x1 cos - x2 sin, x2 cos + x1 sin]` (halves `x1`, `x2` of the last
/// dim), which is `x * cos + rotate_half(x) * sin` with `transformers`' repeated frequency
/// table. 16-bit `x` is widened to f32 and the result rounded once.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let (_, t, _, hd) = x.dims4()?;
    let half = hd / 2;
    let xc = x.to_dtype(ops::compute_dtype(x.dtype()))?;
    let c = cos.reshape((1, t, 1, half))?;
    let s = sin.reshape((1, t, 1, half))?;
    let x1 = xc.narrow(D::Minus1, 0, half)?;
    let x2 = xc.narrow(D::Minus1, half, half)?;
    let y1 = (x1.broadcast_mul(&c)? - x2.broadcast_mul(&s)?)?;
    let y2 = (x2.broadcast_mul(&c)? + x1.broadcast_mul(&s)?)?;
    Tensor::cat(&[y1, y2], D::Minus1)?.to_dtype(x.dtype())
}

/// Grouped-query key/value heads repeated for their queries (`transformers`' `repeat_kv`):
/// `x` `[B, T, KV, hd]` -> `[B, T, KV·rep, hd]`, head `g·rep + r` = key/value head `g`.
fn repeat_kv(x: &Tensor, rep: usize) -> candle_core::Result<Tensor> {
    if rep == 1 {
        return Ok(x.clone());
    }
    let (b, t, kv, hd) = x.dims4()?;
    x.reshape((b, t, kv, 1, hd))?
        .broadcast_as((b, t, kv, rep, hd))?
        .reshape((b, t, kv * rep, hd))
}

/// SwiGLU's gated product `silu(g) * u` (Shazeer 2020): `g`, `u` `[N, F]` -> `[N, F]`; 16-bit
/// storage computed in f32 and rounded once.
pub fn swiglu(g: &Tensor, u: &Tensor) -> candle_core::Result<Tensor> {
    let cdt = ops::compute_dtype(g.dtype());
    (g.to_dtype(cdt)?.silu()? * u.to_dtype(cdt)?)?.to_dtype(g.dtype())
}

/// Stage `0` is the embedding, stages `1..=L` the decoder layers, stage `L + 1` the final
/// norm, LM head and cross-entropy sum.
impl crate::runtime::staged::StagedModel for Llama {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn stage_units(&self) -> Vec<usize> {
        self.stages().into_iter().map(|(_, u)| u).collect()
    }

    fn forward(&self, stage: usize, params: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_stage(self.units.stage_at(stage), params, x)
    }

    fn loss(
        &self,
        params: &[Tensor],
        x: &Tensor,
        mb: &crate::runtime::staged::MicroBatch,
    ) -> candle_core::Result<Tensor> {
        self.head_loss(params, x, &mb.target)
    }

    fn init_params(&self, seed: u64) -> Vec<Vec<Vec<f32>>> {
        Llama::init_params(self, seed)
    }
}

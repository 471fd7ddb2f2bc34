//! FLOPs and bytes of every op of one unit use: the GPT-2 block (Radford et al. 2019) and the
//! Llama-family block (Touvron et al. 2023: RMSNorm, rotary positions, grouped-query attention,
//! SwiGLU), their embeddings, final norms, LM heads and cross-entropy; forward, backward and
//! (under activation checkpointing) the recomputed forward.
//!
//! # Conventions
//!
//! - A multiply-add is 2 FLOPs. A matmul `[m, k] x [k, n]` is `2 m k n` FLOPs (Kaplan et al.
//!   2020, "Scaling Laws for Neural Language Models", sec. 2.1; Narayanan et al. 2021).
//! - `N = micro_batch * seq_len` rows (tokens) per micro-batch on one rank.
//! - Backward of a linear layer is two matmuls of its forward size: the input gradient
//!   `dX = dY W^T` and the weight gradient `dW = X^T dY`, so 2x the forward FLOPs when the
//!   unit's weights are trainable (Korthikanti et al. 2022, "Reducing Activation Recomputation
//!   in Large Transformer Models", sec. 4). The weight gradients are counted when the unit
//!   holds a trainable parameter (per unit, as the engine decides which stages run backward;
//!   a unit mixing frozen and trainable matrices is counted as trainable).
//! - A weight stored `[out, in]` (torch's layout: the Llama block's projections and every LM
//!   head) is applied as `x W^T`; its weight gradient comes out of the matmul `[in, out]` and
//!   is copied transposed into `W`'s layout, an elementwise op of one read and one write per
//!   weight element (`<name>.dW.transpose`). GPT-2's block weights are stored `[in, out]`.
//! - Every linear layer's GEMM carries its shape and operand layout ([`GemmShape`]), as the
//!   engine's candle matmuls run it on strided views without copies: a weight stored
//!   `[in, out]` runs `x W` ([`GemmLayout::Nn`]) forward and `dY W^T` ([`GemmLayout::Nt`])
//!   for the input gradient; a weight stored `[out, in]` runs `x W^T` (`Nt`) and `dY W`
//!   (`Nn`); every weight gradient is `X^T dY` ([`GemmLayout::Tn`]). The attention products
//!   carry none: the fused CPU attention runs them as many single-threaded block GEMMs inside
//!   one op, and the composite path as batched matmuls; both are priced by call FLOPs.
//! - Attention is counted as the engine computes it. Per (sequence, head) pair, the scores
//!   `Q K^T` and the weighted sum `P V` are each `2 hd E` FLOPs, `E` the score entries
//!   computed ([`attention_entries`]): the fused CPU attention (`ActivationModel::Fused`)
//!   computes row blocks of [`ATTN_BLOCK_ROWS`] rows against every key up to the block's last
//!   row, so it skips the causal upper triangle except inside the diagonal blocks
//!   (`E = T^2/2 + 32 T` when `T` is a multiple of 64); the composite path a CUDA device runs
//!   (`ActivationModel::Composite`) computes all `T^2` entries and masks them. Backward is
//!   four matmuls of the same size (`dP = dY V^T`, `dQ = dS K`, `dK = dS^T Q`,
//!   `dV = P^T dY`), 2x the forward.
//! - Every other op (norms, bias adds, activations, the softmax, residual adds, rotary
//!   embedding, embedding gathers, cross-entropy) is elementwise: its FLOPs per element and
//!   the elements it reads plus writes are the constants of [`ElemCost`], taken from the
//!   operation counts of the engine's fused ops (`engine/src/model/ops/`). Its time is
//!   memory-bound in the time model; its FLOPs count only in hardware FLOPs, never in the
//!   model FLOPs of MFU.
//! - Activations and GEMM operands are `param_dtype` (the dtype a unit computes in).
//!
//! The MFU numerator is not this count but the formula every paper reports
//! ([`palm_flops_per_token`]), so MFU is comparable across systems; the count here (with
//! recompute and the attention entries actually computed) is the hardware FLOPs.

use crate::error::PlanError;
use crate::schedule::UseRole;
use crate::spec::{Architecture, Gpt2Config, LlamaConfig};
use crate::time::profile::{GemmLayout, GemmShape};
use crate::ActivationModel;
use fsdp_types::DType;
use serde::{Deserialize, Serialize};

/// Rows per block of the engine's fused causal attention (`ATTN_BLOCK_ROWS` in
/// `engine/src/model/ops/attention.rs`): the unit by which it skips the upper triangle.
pub const ATTN_BLOCK_ROWS: u64 = 64;

/// How an op's time is modelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// Matrix multiplications: time = [`OpCost::calls`] x (the FLOPs of one call / the
    /// profile's GEMM rate for the dtype at that call's shape ([`OpCost::shape`]), or at its
    /// FLOPs when the op has no shape).
    Gemm,
    /// Any other op: time = max(bytes / memory bandwidth, FLOPs / elementwise rate).
    Elementwise,
}

/// The cost of one op of one unit use on one rank, for one micro-batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpCost {
    /// The op (`ln_1`, `attn.qkv`, `attn.qkv.dW`, `attn.scores`, `mlp.act`, `lm_head`, ...).
    pub name: String,
    /// GEMM or elementwise.
    pub kind: OpKind,
    /// FLOPs (a multiply-add is 2).
    pub flops: f64,
    /// Bytes read plus written (elementwise ops; 0 for GEMMs, whose time comes from the GEMM
    /// rate curve).
    pub bytes: f64,
    /// GEMMs: how many equal calls the FLOPs are split into; each is priced at the curve's
    /// rate for its own size (`flops / calls`). 1 for one matmul (or one batched matmul,
    /// cuBLAS's strided batched GEMM); for the fused CPU attention, one call per (sequence,
    /// head) pair and row block, each a single-threaded GEMM of a few hundred thousand FLOPs
    /// (priced at the mean call size). 1 for elementwise ops; absent or under 1 reads as 1.
    #[serde(default)]
    pub calls: f64,
    /// GEMMs of one call: its shape and operand layout, priced by the profile's rate for
    /// that shape ([`crate::time::GemmCurve::rate_of`]). `None` for elementwise ops and the
    /// attention products (priced by call FLOPs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<GemmShape>,
}

/// FLOPs per element and elements moved (read + written) per element of an elementwise op,
/// forward and backward. The values are the operation counts of the engine's fused CPU
/// kernels (`engine/src/model/ops/*.rs`), rounded to whole operations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ElemCost {
    /// Forward FLOPs per element.
    pub fwd_flops: f64,
    /// Forward elements read plus written per element.
    pub fwd_moved: f64,
    /// Backward FLOPs per element.
    pub bwd_flops: f64,
    /// Backward elements read plus written per element.
    pub bwd_moved: f64,
}

/// LayerNorm over a row: mean (1 add), centred square sum (3), normalise (2), affine (2);
/// backward: the two row sums and the input gradient (12); reads x, writes y; backward reads
/// x and dy, writes dx.
pub const LAYER_NORM: ElemCost = ElemCost {
    fwd_flops: 8.0,
    fwd_moved: 2.0,
    bwd_flops: 12.0,
    bwd_moved: 3.0,
};
/// RMSNorm: square sum (2), scale (1), gain (1); backward 8.
pub const RMS_NORM: ElemCost = ElemCost {
    fwd_flops: 4.0,
    fwd_moved: 2.0,
    bwd_flops: 8.0,
    bwd_moved: 3.0,
};
/// A bias add over `[N, c]` (forward reads and writes the rows; backward is the column sum of
/// dy into the bias gradient).
pub const BIAS_ADD: ElemCost = ElemCost {
    fwd_flops: 1.0,
    fwd_moved: 2.0,
    bwd_flops: 1.0,
    bwd_moved: 1.0,
};
/// A residual add (forward two reads, one write; backward the gradient sum at the fork).
pub const RESIDUAL_ADD: ElemCost = ElemCost {
    fwd_flops: 1.0,
    fwd_moved: 3.0,
    bwd_flops: 1.0,
    bwd_moved: 3.0,
};
/// Bias + tanh-GELU as the fused op computes it (`z * sigmoid(2u)`, `u` the cubic
/// polynomial: bias 1, polynomial 4, sigmoid 4, product 2); backward 16.
pub const BIAS_GELU: ElemCost = ElemCost {
    fwd_flops: 11.0,
    fwd_moved: 2.0,
    bwd_flops: 16.0,
    bwd_moved: 3.0,
};
/// SwiGLU's gate `silu(g) * u` over `[N, ffn]` (sigmoid 4, two products); reads g and u,
/// writes the output; backward reads g, u, dy and writes dg, du.
pub const SWIGLU: ElemCost = ElemCost {
    fwd_flops: 6.0,
    fwd_moved: 3.0,
    bwd_flops: 12.0,
    bwd_moved: 5.0,
};
/// The causal softmax over the computed score entries (`e^((s - max) sc)`: max, subtract,
/// scale, exp, sum, normalise; 5 per entry); backward `dS = sc P (dP - rowsum(dP P))` (4).
pub const SOFTMAX: ElemCost = ElemCost {
    fwd_flops: 5.0,
    fwd_moved: 2.0,
    bwd_flops: 4.0,
    bwd_moved: 3.0,
};
/// Rotary embedding of one query or key element (`x cos + rot(x) sin`: 3); elements moved are
/// counted per op in [`forward_ops`] (the fused op also packs q and the repeated k, v heads).
pub const ROPE_FLOPS: f64 = 3.0;
/// Cross-entropy over `[N, V]` logits: max, subtract, exp, sum (4 per logit; reads the logits
/// once); backward `softmax - onehot`, recomputed from the logits (4; reads logits, writes the
/// gradient).
pub const CROSS_ENTROPY: ElemCost = ElemCost {
    fwd_flops: 4.0,
    fwd_moved: 1.0,
    bwd_flops: 4.0,
    bwd_moved: 2.0,
};

/// Which score entries of causal attention are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum AttentionCount {
    /// Row blocks of `block_rows` rows against the keys up to the block's last row (the fused
    /// CPU attention).
    BlockCausal {
        /// Rows per block ([`ATTN_BLOCK_ROWS`]).
        block_rows: u64,
    },
    /// The full `T x T` scores, masked afterwards (the composite path).
    Full,
}

impl AttentionCount {
    /// What the engine computes on an ops path: block-causal for the fused CPU ops, full for
    /// the composite path.
    pub fn of(model: ActivationModel) -> Self {
        match model {
            ActivationModel::Fused => AttentionCount::BlockCausal {
                block_rows: ATTN_BLOCK_ROWS,
            },
            ActivationModel::Composite => AttentionCount::Full,
        }
    }
}

/// Score entries computed per (sequence, head) pair for a sequence of `t` tokens: `t^2` for
/// [`AttentionCount::Full`]; for [`AttentionCount::BlockCausal`] the pairs `(i, j)` whose key
/// block is at or before the query's block, `sum_b rows_b * end_b` over the row blocks
/// `[start_b, end_b)` (the forward's row blocks and the backward's column blocks cover the same
/// entries).
pub fn attention_entries(t: u64, count: AttentionCount) -> f64 {
    match count {
        AttentionCount::Full => (t as f64) * (t as f64),
        AttentionCount::BlockCausal { block_rows } => {
            let b = block_rows.max(1);
            let full = t / b;
            // Full blocks: rows b, ending at b, 2b, ..., full*b.
            let mut e = (b * b) as f64 * (full as f64) * (full as f64 + 1.0) / 2.0;
            let rest = t - full * b;
            if rest > 0 {
                e += rest as f64 * t as f64;
            }
            e
        }
    }
}

/// GEMM calls per (sequence, head) pair of each attention product for a sequence of `t`
/// tokens: for [`AttentionCount::BlockCausal`] one per row block (`ceil(t / block_rows)`:
/// the fused CPU attention multiplies each pair's blocks with single-threaded GEMMs, pairs
/// in parallel), `None` for [`AttentionCount::Full`] (the composite path's one batched
/// matmul over every pair).
pub fn attention_calls(t: u64, count: AttentionCount) -> Option<f64> {
    match count {
        AttentionCount::Full => None,
        AttentionCount::BlockCausal { block_rows } => Some(t.div_ceil(block_rows.max(1)) as f64),
    }
}

/// The shape of one micro-batch on one rank and what its ops compute in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OpShape {
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    /// Tokens per sequence.
    pub seq_len: u64,
    /// The dtype of activations and GEMM operands (`param_dtype`).
    pub dtype: DType,
    /// Which attention scores are computed.
    pub attention: AttentionCount,
}

impl OpShape {
    fn rows(&self) -> f64 {
        (self.micro_batch * self.seq_len) as f64
    }
}

/// Which gradients a use's backward computes (the engine's `needs_input_grad` and the unit's
/// trainability; a use with neither runs no backward at all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grads {
    /// The gradient of the use's input (a trainable unit runs before it).
    pub input: bool,
    /// The gradients of the unit's weights (the unit holds a trainable parameter).
    pub weights: bool,
}

struct Ops<'a> {
    shape: &'a OpShape,
    out: Vec<OpCost>,
}

impl Ops<'_> {
    /// One GEMM call `[m, k] x [k, n]` with operands laid out as `layout`.
    fn gemm(&mut self, name: &str, m: f64, k: f64, n: f64, layout: GemmLayout) {
        self.out.push(OpCost {
            name: name.to_string(),
            kind: OpKind::Gemm,
            flops: 2.0 * m * k * n,
            bytes: 0.0,
            calls: 1.0,
            shape: Some(GemmShape {
                m: m as u64,
                k: k as u64,
                n: n as u64,
                layout,
            }),
        });
    }
    /// A GEMM of `flops` split into `calls` equal calls.
    fn gemm_calls(&mut self, name: &str, flops: f64, calls: f64) {
        self.out.push(OpCost {
            name: name.to_string(),
            kind: OpKind::Gemm,
            flops,
            bytes: 0.0,
            calls,
            shape: None,
        });
    }
    /// An elementwise op over `elems` elements with `flops` and `moved` per element.
    fn elem(&mut self, name: &str, elems: f64, flops: f64, moved: f64) {
        self.out.push(OpCost {
            name: name.to_string(),
            kind: OpKind::Elementwise,
            flops: elems * flops,
            bytes: elems * moved * self.shape.dtype.size_bytes() as f64,
            calls: 1.0,
            shape: None,
        });
    }
    fn fwd(&mut self, name: &str, elems: f64, c: ElemCost) {
        self.elem(name, elems, c.fwd_flops, c.fwd_moved);
    }
    fn bwd(&mut self, name: &str, elems: f64, c: ElemCost) {
        self.elem(name, elems, c.bwd_flops, c.bwd_moved);
    }
    /// Backward of a linear layer `[N, i] -> [N, o]` whose weight is stored `[i, o]`: dX
    /// (`dY W^T`) always (the unit's backward runs), dW (`X^T dY`) when the weights are
    /// trainable, the bias gradient with it.
    fn linear_bwd(&mut self, name: &str, n: f64, i: f64, o: f64, bias: bool, g: Grads) {
        self.linear_bwd_as(name, n, i, o, bias, g, GemmLayout::Nt);
    }
    /// [`Ops::linear_bwd`] with the input gradient's layout `dx`.
    #[allow(clippy::too_many_arguments)]
    fn linear_bwd_as(
        &mut self,
        name: &str,
        n: f64,
        i: f64,
        o: f64,
        bias: bool,
        g: Grads,
        dx: GemmLayout,
    ) {
        self.gemm(&format!("{name}.dX"), n, o, i, dx);
        if g.weights {
            self.gemm(&format!("{name}.dW"), i, n, o, GemmLayout::Tn);
            if bias {
                self.bwd(&format!("{name}.bias"), n * o, BIAS_ADD);
            }
        }
    }
    /// Backward of a linear layer whose weight is stored `[o, i]` (torch's layout) and applied
    /// as `x W^T`: as [`Ops::linear_bwd`] with the input gradient `dY W` (both operands as
    /// stored), plus the copy that stores the `[i, o]` product `X^T dY` as `W`'s `[o, i]`
    /// gradient (a transpose: one read and one write per weight).
    fn linear_t_bwd(&mut self, name: &str, n: f64, i: f64, o: f64, bias: bool, g: Grads) {
        self.linear_bwd_as(name, n, i, o, bias, g, GemmLayout::Nn);
        if g.weights {
            self.elem(&format!("{name}.dW.transpose"), i * o, 0.0, 2.0);
        }
    }
}

/// The attention core's shape: heads, head dim, and score entries per pair.
struct Attn {
    heads: f64,
    hd: f64,
    entries: f64,
}

impl Attn {
    fn forward(&self, ops: &mut Ops<'_>, b: f64) {
        let pairs = b * self.heads;
        let mm = 2.0 * self.hd * self.entries * pairs;
        let calls = Self::calls(ops, pairs);
        ops.gemm_calls("attn.scores", mm, calls);
        ops.fwd("attn.softmax", self.entries * pairs, SOFTMAX);
        ops.gemm_calls("attn.context", mm, calls);
    }
    /// The calls of one attention product over `pairs` pairs ([`attention_calls`]).
    fn calls(ops: &Ops<'_>, pairs: f64) -> f64 {
        attention_calls(ops.shape.seq_len, ops.shape.attention).map_or(1.0, |c| c * pairs)
    }
    fn backward(&self, ops: &mut Ops<'_>, b: f64) {
        let pairs = b * self.heads;
        let mm = 2.0 * self.hd * self.entries * pairs;
        let calls = Self::calls(ops, pairs);
        ops.gemm_calls("attn.context.dP", mm, calls);
        ops.gemm_calls("attn.context.dV", mm, calls);
        ops.bwd("attn.softmax", self.entries * pairs, SOFTMAX);
        ops.gemm_calls("attn.scores.dQ", mm, calls);
        ops.gemm_calls("attn.scores.dK", mm, calls);
    }
}

fn generic_error() -> PlanError {
    PlanError::InvalidConfig(
        "the time model counts the ops of GPT-2 and Llama-family models; this spec has no \
         architecture (it was read from weights alone): plan it from its config.json \
         (--hf-config) or a preset"
            .into(),
    )
}

/// The ops of one forward pass of a use with role `role` (the recomputed forward under
/// activation checkpointing is the same list), in execution order.
///
/// Errors: `InvalidConfig` for a generic architecture (no ops to count).
pub fn forward_ops(
    arch: &Architecture,
    role: UseRole,
    shape: &OpShape,
) -> Result<Vec<OpCost>, PlanError> {
    let mut ops = Ops {
        shape,
        out: Vec::new(),
    };
    let n = shape.rows();
    let b = shape.micro_batch as f64;
    let e = attention_entries(shape.seq_len, shape.attention);
    match (arch, role) {
        (Architecture::Generic, _) => return Err(generic_error()),
        (Architecture::Gpt2(c), UseRole::Embedding) => {
            // Token row gather plus position row gather, one add.
            let _ = c;
            let d = c.d_model as f64;
            ops.elem("embedding", n * d, 1.0, 3.0);
        }
        (Architecture::Llama(c), UseRole::Embedding) => {
            let d = c.d_model as f64;
            ops.elem("embedding", n * d, 0.0, 2.0);
        }
        (Architecture::Gpt2(c), UseRole::Block) => gpt2_block_forward(&mut ops, c, n, b, e),
        (Architecture::Llama(c), UseRole::Block) => llama_block_forward(&mut ops, c, n, b, e),
        (Architecture::Gpt2(c), UseRole::Head) => {
            let (d, v) = (c.d_model as f64, c.vocab_size as f64);
            ops.fwd("ln_f", n * d, LAYER_NORM);
            ops.gemm("lm_head", n, d, v, GemmLayout::Nt);
            ops.fwd("cross_entropy", n * v, CROSS_ENTROPY);
        }
        (Architecture::Llama(c), UseRole::Head) => {
            let (d, v) = (c.d_model as f64, c.vocab_size as f64);
            ops.fwd("norm", n * d, RMS_NORM);
            ops.gemm("lm_head", n, d, v, GemmLayout::Nt);
            ops.fwd("cross_entropy", n * v, CROSS_ENTROPY);
        }
    }
    Ok(ops.out)
}

fn gpt2_block_forward(ops: &mut Ops<'_>, c: &Gpt2Config, n: f64, b: f64, e: f64) {
    let d = c.d_model as f64;
    let heads = c.n_head.max(1) as f64;
    let attn = Attn {
        heads,
        hd: d / heads,
        entries: e,
    };
    ops.fwd("ln_1", n * d, LAYER_NORM);
    ops.gemm("attn.qkv", n, d, 3.0 * d, GemmLayout::Nn);
    if c.bias {
        ops.fwd("attn.qkv.bias", n * 3.0 * d, BIAS_ADD);
    }
    attn.forward(ops, b);
    ops.gemm("attn.proj", n, d, d, GemmLayout::Nn);
    if c.bias {
        ops.fwd("attn.proj.bias", n * d, BIAS_ADD);
    }
    ops.fwd("residual_1", n * d, RESIDUAL_ADD);
    ops.fwd("ln_2", n * d, LAYER_NORM);
    ops.gemm("mlp.fc", n, d, 4.0 * d, GemmLayout::Nn);
    let act = if c.bias {
        BIAS_GELU
    } else {
        ElemCost {
            fwd_flops: BIAS_GELU.fwd_flops - 1.0,
            ..BIAS_GELU
        }
    };
    ops.fwd("mlp.act", n * 4.0 * d, act);
    ops.gemm("mlp.proj", n, 4.0 * d, d, GemmLayout::Nn);
    if c.bias {
        ops.fwd("mlp.proj.bias", n * d, BIAS_ADD);
    }
    ops.fwd("residual_2", n * d, RESIDUAL_ADD);
}

/// Llama head dimensions: (query width `H hd`, key/value width `KV hd`, `hd`).
fn llama_widths(c: &LlamaConfig) -> (f64, f64, f64) {
    let hd = (c.d_model / c.n_head.max(1)) as f64;
    (c.n_head as f64 * hd, c.n_kv_head as f64 * hd, hd)
}

fn llama_block_forward(ops: &mut Ops<'_>, c: &LlamaConfig, n: f64, b: f64, e: f64) {
    let d = c.d_model as f64;
    let f = c.ffn_hidden as f64;
    let (q, kv, hd) = llama_widths(c);
    let attn = Attn {
        heads: c.n_head as f64,
        hd,
        entries: e,
    };
    ops.fwd("input_layernorm", n * d, RMS_NORM);
    ops.gemm("attn.q_proj", n, d, q, GemmLayout::Nt);
    ops.gemm("attn.k_proj", n, d, kv, GemmLayout::Nt);
    ops.gemm("attn.v_proj", n, d, kv, GemmLayout::Nt);
    if c.qkv_bias {
        ops.fwd("attn.qkv.bias", n * (q + 2.0 * kv), BIAS_ADD);
    }
    // Rotates q and k, repeats the key/value heads and packs [N, 3 H hd] rows.
    ops.elem(
        "attn.rope",
        n,
        ROPE_FLOPS * (q + kv),
        (q + 2.0 * kv) + 3.0 * q,
    );
    attn.forward(ops, b);
    ops.gemm("attn.o_proj", n, q, d, GemmLayout::Nt);
    ops.fwd("residual_1", n * d, RESIDUAL_ADD);
    ops.fwd("post_attention_layernorm", n * d, RMS_NORM);
    ops.gemm("mlp.gate_proj", n, d, f, GemmLayout::Nt);
    ops.gemm("mlp.up_proj", n, d, f, GemmLayout::Nt);
    ops.fwd("mlp.act", n * f, SWIGLU);
    ops.gemm("mlp.down_proj", n, f, d, GemmLayout::Nt);
    ops.fwd("residual_2", n * d, RESIDUAL_ADD);
}

/// The ops of one backward pass of a use with role `role` (reverse execution order); empty
/// when neither the input nor the weights need a gradient (the engine skips that use's
/// backward).
///
/// Errors: `InvalidConfig` for a generic architecture.
pub fn backward_ops(
    arch: &Architecture,
    role: UseRole,
    shape: &OpShape,
    grads: Grads,
) -> Result<Vec<OpCost>, PlanError> {
    let mut ops = Ops {
        shape,
        out: Vec::new(),
    };
    if matches!(arch, Architecture::Generic) {
        return Err(generic_error());
    }
    if !grads.input && !grads.weights {
        return Ok(ops.out);
    }
    let n = shape.rows();
    let b = shape.micro_batch as f64;
    let e = attention_entries(shape.seq_len, shape.attention);
    match (arch, role) {
        (Architecture::Generic, _) => unreachable!("refused above"),
        (Architecture::Gpt2(c), UseRole::Embedding) => {
            if grads.weights {
                // Scatter-add of the rows into the token and position gradients, over
                // zeroed tables.
                let d = c.d_model as f64;
                ops.elem("embedding.dW", n * d, 2.0, 6.0);
                ops.elem(
                    "embedding.dW.zero",
                    (c.vocab_size + c.n_positions) as f64 * d,
                    0.0,
                    1.0,
                );
            }
        }
        (Architecture::Llama(c), UseRole::Embedding) => {
            if grads.weights {
                let d = c.d_model as f64;
                ops.elem("embedding.dW", n * d, 1.0, 3.0);
                ops.elem("embedding.dW.zero", c.vocab_size as f64 * d, 0.0, 1.0);
            }
        }
        (Architecture::Gpt2(c), UseRole::Block) => {
            let d = c.d_model as f64;
            let heads = c.n_head.max(1) as f64;
            let attn = Attn {
                heads,
                hd: d / heads,
                entries: e,
            };
            ops.bwd("residual_2", n * d, RESIDUAL_ADD);
            ops.linear_bwd("mlp.proj", n, 4.0 * d, d, c.bias, grads);
            ops.bwd("mlp.act", n * 4.0 * d, BIAS_GELU);
            ops.linear_bwd("mlp.fc", n, d, 4.0 * d, c.bias, grads);
            ops.bwd("ln_2", n * d, LAYER_NORM);
            ops.bwd("residual_1", n * d, RESIDUAL_ADD);
            ops.linear_bwd("attn.proj", n, d, d, c.bias, grads);
            attn.backward(&mut ops, b);
            ops.linear_bwd("attn.qkv", n, d, 3.0 * d, c.bias, grads);
            ops.bwd("ln_1", n * d, LAYER_NORM);
        }
        (Architecture::Llama(c), UseRole::Block) => {
            let d = c.d_model as f64;
            let f = c.ffn_hidden as f64;
            let (q, kv, hd) = llama_widths(c);
            let attn = Attn {
                heads: c.n_head as f64,
                hd,
                entries: e,
            };
            ops.bwd("residual_2", n * d, RESIDUAL_ADD);
            ops.linear_t_bwd("mlp.down_proj", n, f, d, false, grads);
            ops.bwd("mlp.act", n * f, SWIGLU);
            ops.linear_t_bwd("mlp.up_proj", n, d, f, false, grads);
            ops.linear_t_bwd("mlp.gate_proj", n, d, f, false, grads);
            ops.bwd("post_attention_layernorm", n * d, RMS_NORM);
            ops.bwd("residual_1", n * d, RESIDUAL_ADD);
            ops.linear_t_bwd("attn.o_proj", n, q, d, false, grads);
            attn.backward(&mut ops, b);
            ops.elem(
                "attn.rope",
                n,
                ROPE_FLOPS * (q + kv),
                (q + 2.0 * kv) + 3.0 * q,
            );
            ops.linear_t_bwd("attn.v_proj", n, d, kv, c.qkv_bias, grads);
            ops.linear_t_bwd("attn.k_proj", n, d, kv, c.qkv_bias, grads);
            ops.linear_t_bwd("attn.q_proj", n, d, q, c.qkv_bias, grads);
            ops.bwd("input_layernorm", n * d, RMS_NORM);
        }
        (Architecture::Gpt2(c), UseRole::Head) => {
            let (d, v) = (c.d_model as f64, c.vocab_size as f64);
            ops.bwd("cross_entropy", n * v, CROSS_ENTROPY);
            ops.linear_t_bwd("lm_head", n, d, v, false, grads);
            ops.bwd("ln_f", n * d, LAYER_NORM);
        }
        (Architecture::Llama(c), UseRole::Head) => {
            let (d, v) = (c.d_model as f64, c.vocab_size as f64);
            ops.bwd("cross_entropy", n * v, CROSS_ENTROPY);
            ops.linear_t_bwd("lm_head", n, d, v, false, grads);
            ops.bwd("norm", n * d, RMS_NORM);
        }
    }
    Ok(ops.out)
}

/// Model FLOPs per token after PaLM (Chowdhery et al. 2022, "PaLM", appendix B), the formula
/// MFU is reported with: `6 N + 12 L H Q T`, where `N` = the parameters that take part in
/// matmuls (`numel` minus the embedding lookup tables: GPT-2's position table, and the token
/// table unless it is tied to the LM head, which is a matmul), `L` layers, `H` query heads of
/// `Q` dims, `T` the sequence length (attention counted over the full `T x T`, not the causal
/// half, as PaLM does). Recompute is not model work and is not counted (Korthikanti et al.
/// 2022 call the count with it hardware FLOPs).
///
/// Errors: `InvalidConfig` for a generic architecture.
pub fn palm_flops_per_token(
    arch: &Architecture,
    numel: u64,
    seq_len: u64,
) -> Result<f64, PlanError> {
    let t = seq_len as f64;
    let (lookup, layers, hq) = match arch {
        Architecture::Generic => return Err(generic_error()),
        Architecture::Gpt2(c) => {
            let wte = if c.tied_head { 0 } else { c.vocab_size };
            (
                (wte + c.n_positions) * c.d_model,
                c.n_layer,
                c.n_head * (c.d_model / c.n_head.max(1)),
            )
        }
        Architecture::Llama(c) => {
            let wte = if c.tied_head { 0 } else { c.vocab_size };
            (
                wte * c.d_model,
                c.n_layer,
                c.n_head * (c.d_model / c.n_head.max(1)),
            )
        }
    };
    let n = numel.saturating_sub(lookup) as f64;
    Ok(6.0 * n + 12.0 * layers as f64 * hq as f64 * t)
}

/// The name of the formula [`palm_flops_per_token`] computes, for reports.
pub const PALM_FORMULA: &str = "6·N + 12·L·H·Q·T FLOPs per token (PaLM, Chowdhery et al. 2022, app. B; N = parameters in matmuls, attention over the full T×T, no recompute)";

/// The sum of the FLOPs of `ops` of one kind (`None`: all).
pub fn total_flops(ops: &[OpCost], kind: Option<OpKind>) -> f64 {
    ops.iter()
        .filter(|o| kind.is_none_or(|k| o.kind == k))
        .map(|o| o.flops)
        .fold(0.0, |a, b| a + b)
}

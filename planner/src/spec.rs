//! `ModelSpec`: what the planner needs to know about a model, and nothing more.
//!
//! A model is an ordered list of FSDP units (the embedding, each transformer block, the final
//! norm and head); each unit owns named parameters in declaration order. Shapes are in elements.

use fsdp_types::{DType, Numel};
use serde::{Deserialize, Serialize};

/// One named parameter of a unit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSpec {
    /// The model's own name, e.g. `transformer.h.0.attn.c_attn.weight` (no wrapper segments).
    pub name: String,
    /// Shape in elements; `[]` is a scalar (1 element); size-0 dims are rejected by the planner.
    pub shape: Vec<u64>,
    /// The dtype the parameter is stored in (in a checkpoint); master weights are always f32.
    pub dtype: DType,
    /// Whether the parameter receives gradients and optimizer state. Frozen parameters get
    /// neither, also when they share a unit with trainable ones
    /// (<https://github.com/pytorch/pytorch/pull/104967>).
    pub trainable: bool,
    /// Whether decoupled weight decay applies (biases and norm gains: no).
    pub weight_decay: bool,
    /// If set, this parameter is the same storage as the named parameter (a tied LM head). It
    /// occupies no space of its own and must live in the same unit as its target.
    pub tied_to: Option<String>,
}

impl ParamSpec {
    /// A trainable f32 parameter with weight decay on iff it has 2 or more dims (matrices).
    pub fn new(name: impl Into<String>, shape: &[u64]) -> Self {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            dtype: DType::F32,
            trainable: true,
            weight_decay: shape.len() >= 2,
            tied_to: None,
        }
    }

    /// Number of elements: the product of the shape (1 for a scalar).
    pub fn numel(&self) -> Numel {
        Numel(self.shape.iter().product())
    }
}

/// One FSDP unit: the parameters all-gathered together as one (or, when trainable and frozen
/// parameters are mixed, two) flat parameter(s).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitSpec {
    /// Unit name, e.g. `embed`, `h.3`, `head`.
    pub name: String,
    /// Parameters in declaration order.
    pub params: Vec<ParamSpec>,
}

/// GPT-2 style decoder hyper-parameters (Radford et al. 2019): learned position embeddings,
/// pre-LayerNorm blocks, GELU MLP with 4x expansion, optional biases, optionally tied LM head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpt2Config {
    /// Vocabulary size (256 for byte-level training, 50257 for GPT-2's BPE).
    pub vocab_size: u64,
    /// Maximum sequence length (rows of the position embedding).
    pub n_positions: u64,
    /// Model width.
    pub d_model: u64,
    /// Number of transformer blocks.
    pub n_layer: u64,
    /// Number of attention heads (`d_model % n_head == 0`).
    pub n_head: u64,
    /// Whether linear layers and LayerNorms carry biases.
    pub bias: bool,
    /// Whether the LM head shares the token embedding's storage.
    pub tied_head: bool,
}

/// Llama style decoder hyper-parameters (Touvron et al. 2023): RMSNorm, SwiGLU MLP, rotary
/// positions (no parameters), grouped-query attention with `n_kv_head` key/value heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Vocabulary size.
    pub vocab_size: u64,
    /// Model width.
    pub d_model: u64,
    /// Number of transformer blocks.
    pub n_layer: u64,
    /// Number of query heads.
    pub n_head: u64,
    /// Number of key/value heads (grouped-query attention; equals `n_head` for MHA).
    pub n_kv_head: u64,
    /// SwiGLU hidden width (`intermediate_size`).
    pub ffn_hidden: u64,
    /// Maximum sequence length the model was configured for.
    pub max_seq: u64,
    /// Whether the LM head shares the token embedding's storage.
    pub tied_head: bool,
    /// Whether q/k/v projections carry biases (Qwen2: yes).
    pub qkv_bias: bool,
}

/// Llama 3.1's rotary frequency scaling (`rope_scaling` with `rope_type` (or `type`) `llama3`
/// in `config.json`; Hugging Face `transformers`' `_compute_llama3_parameters`): wavelengths
/// longer than `original_max_position_embeddings / low_freq_factor` are divided by `factor`,
/// shorter than `original_max_position_embeddings / high_freq_factor` kept, and those between
/// interpolated smoothly.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeScaling {
    /// Divisor of the low frequencies (`factor`, 8 for Llama 3.1).
    pub factor: f64,
    /// `low_freq_factor` (1 for Llama 3.1).
    pub low_freq_factor: f64,
    /// `high_freq_factor` (4 for Llama 3.1); must exceed `low_freq_factor`.
    pub high_freq_factor: f64,
    /// The context length the model was pre-trained with (`original_max_position_embeddings`,
    /// 8192 for Llama 3.1).
    pub original_max_position_embeddings: u64,
}

/// The Llama-family hyper-parameters that change the computation but not one byte of the
/// memory plan, so they are not part of [`LlamaConfig`] (nor of the plan's fingerprint): the
/// RMSNorm epsilon, the rotary base and scaling, Mistral's sliding attention window.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LlamaNumerics {
    /// RMSNorm epsilon (`rms_norm_eps`; `transformers`' default 1e-6).
    pub rms_norm_eps: f64,
    /// Rotary embedding base (`rope_theta`; default 10000).
    pub rope_theta: f64,
    /// Llama 3.1 frequency scaling (`rope_scaling` of type `llama3`), if any.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Sliding attention window in tokens (Mistral's `sliding_window`; Qwen2's when
    /// `use_sliding_window` is true): a query attends to the `sliding_window` most recent
    /// positions, itself included. `None`: full causal attention.
    pub sliding_window: Option<u64>,
}

impl Default for LlamaNumerics {
    /// `transformers`' `LlamaConfig` defaults: eps 1e-6, theta 10000, no scaling, no window.
    fn default() -> Self {
        LlamaNumerics {
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            rope_scaling: None,
            sliding_window: None,
        }
    }
}

/// The architecture behind a spec, used to estimate activation memory. `Generic` specs (read
/// from a safetensors header, or built by hand) have no activation estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "family", rename_all = "lowercase")]
pub enum Architecture {
    /// GPT-2 style.
    Gpt2(Gpt2Config),
    /// Llama / Mistral / Qwen2 style.
    Llama(LlamaConfig),
    /// Unknown architecture: model states only.
    Generic,
}

/// The input of the planner: an ordered list of FSDP units.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// A human name (`gpt2`, `llama3-8b`, a file name).
    pub name: String,
    /// Units in forward order.
    pub units: Vec<UnitSpec>,
    /// The architecture, for activation estimates.
    pub arch: Architecture,
}

impl ModelSpec {
    /// Number of parameter elements, counting tied parameters once (the usual "parameter count").
    pub fn numel(&self) -> Numel {
        self.units
            .iter()
            .flat_map(|u| &u.params)
            .filter(|p| p.tied_to.is_none())
            .map(ParamSpec::numel)
            .sum()
    }

    /// Number of trainable parameter elements (tied parameters once).
    pub fn trainable_numel(&self) -> Numel {
        self.units
            .iter()
            .flat_map(|u| &u.params)
            .filter(|p| p.tied_to.is_none() && p.trainable)
            .map(ParamSpec::numel)
            .sum()
    }
}

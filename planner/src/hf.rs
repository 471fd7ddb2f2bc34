//! Readers of Hugging Face model descriptions: `config.json`, the header of a `.safetensors`
//! file, and a sharded model's `model.safetensors.index.json` with its files' headers. The only
//! I/O in the planner; each reader returns a `ModelSpec` and touches no weights.
//!
//! Safetensors format (huggingface/safetensors, `README.md`): an 8-byte little-endian header
//! length `N`, then `N` bytes of JSON mapping tensor names to `{dtype, shape, data_offsets}`
//! (offsets relative to the byte after the header), then the data. Files are memory-mapped
//! (memmap2), so only the header's pages are read.

use crate::error::PlanError;
use crate::presets::{gpt2_spec, llama_spec};
use crate::spec::{
    Architecture, Gpt2Config, Llama3RopeScaling, LlamaConfig, LlamaNumerics, ModelSpec, ParamSpec,
    UnitSpec,
};
use fsdp_types::DType;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Largest safetensors header accepted (100 MB, the limit of the reference implementation).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Most transformer layers a `config.json` may declare. The spec and the plan hold a few
/// hundred bytes per layer, so a mistyped count (1e6, 1e12) would take gigabytes or abort the
/// allocation before any message; the largest published models have under 200 layers.
pub const MAX_LAYERS: u64 = 10_000;

/// Largest hidden, intermediate, vocabulary, head and position sizes a `config.json` may
/// declare (2^24): products of two of them still fit the planner's u64 element counts.
pub const MAX_DIM: u64 = 1 << 24;

fn bad(file: &str, problem: impl Into<String>) -> PlanError {
    PlanError::BadFile {
        file: file.to_string(),
        problem: problem.into(),
    }
}

fn io(path: &Path, e: std::io::Error) -> PlanError {
    PlanError::Io {
        path: path.display().to_string(),
        source: e,
    }
}

/// A model name from a path: the parent directory's name for `config.json` and index files,
/// else the file stem.
fn model_name(path: &Path) -> String {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let generic = matches!(
        stem.as_str(),
        "config" | "model" | "model.safetensors.index" | "model.safetensors"
    );
    if generic {
        if let Some(d) = path.canonicalize().ok().and_then(|p| {
            p.parent()
                .and_then(|d| d.file_name())
                .map(|s| s.to_string_lossy().into_owned())
        }) {
            return d;
        }
    }
    stem
}

/// Reads a Hugging Face `config.json` and builds the model's spec (see [`parse_hf_config`]).
///
/// Errors: `Io`, `BadFile` (JSON syntax, unsupported `model_type`, inconsistent sizes),
/// `MissingField` (naming the field).
pub fn read_hf_config(path: &Path) -> Result<ModelSpec, PlanError> {
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    parse_hf_config(&text, &path.display().to_string(), &model_name(path))
}

/// The architecture described by a `config.json`'s text: `Gpt2` for `model_type` `gpt2` (or
/// an `n_embd` field), `Llama` for `llama`, `mistral`, `qwen2` (or a `hidden_size` field).
///
/// GPT-2 fields: `n_embd`, `n_layer`, `n_head`, `vocab_size` required; `n_positions` (or
/// `n_ctx`) required; `tie_word_embeddings` defaults to true; biases always present.
/// Llama fields: `hidden_size`, `num_hidden_layers`, `num_attention_heads`,
/// `intermediate_size`, `vocab_size` required; `num_key_value_heads` defaults to
/// `num_attention_heads`, `tie_word_embeddings` to false, `max_position_embeddings` to 2048
/// (the defaults of `transformers`' config classes); q/k/v biases for `qwen2` only.
///
/// Errors: `BadFile`, `MissingField`.
pub fn parse_hf_arch(text: &str, file: &str) -> Result<Architecture, PlanError> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| bad(file, format!("not valid JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| bad(file, "expected a JSON object at the top level"))?;
    let model_type = obj.get("model_type").and_then(Value::as_str).unwrap_or("");
    let family = match model_type {
        "gpt2" => "gpt2",
        "llama" | "mistral" | "qwen2" => "llama",
        "" if obj.contains_key("n_embd") => "gpt2",
        "" if obj.contains_key("hidden_size") => "llama",
        "" => {
            return Err(bad(
                file,
                "no `model_type` and neither `n_embd` (GPT-2) nor `hidden_size` (Llama) found",
            ))
        }
        other => {
            return Err(bad(
                file,
                format!(
                    "unsupported model_type `{other}` (supported: gpt2, llama, mistral, qwen2)"
                ),
            ))
        }
    };
    let fam_name = if model_type.is_empty() {
        family
    } else {
        model_type
    };
    let req = |k: &str| -> Result<u64, PlanError> {
        match obj.get(k) {
            None | Some(Value::Null) => Err(PlanError::MissingField {
                file: file.to_string(),
                field: k.to_string(),
                family: fam_name.to_string(),
            }),
            Some(x) => match x.as_u64() {
                Some(n) if (k == "n_layer" || k == "num_hidden_layers") && n > MAX_LAYERS => {
                    Err(bad(
                        file,
                        format!(
                            "field `{k}` is {n}, above the limit of {MAX_LAYERS} layers (the \
                             largest published models have under 200); check the value"
                        ),
                    ))
                }
                Some(n) if n > MAX_DIM => Err(bad(
                    file,
                    format!(
                        "field `{k}` is {n}, above the limit of {MAX_DIM} (2^24); check the value"
                    ),
                )),
                Some(n) if n > 0 => Ok(n),
                _ => Err(bad(
                    file,
                    format!("field `{k}` must be a positive integer, got {x}"),
                )),
            },
        }
    };
    let opt = |k: &str| -> Result<Option<u64>, PlanError> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(_) => req(k).map(Some),
        }
    };
    let flag = |k: &str, default: bool| -> Result<bool, PlanError> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(x) => Err(bad(
                file,
                format!("field `{k}` must be true or false, got {x}"),
            )),
        }
    };
    if family == "gpt2" {
        let d = req("n_embd")?;
        let n_layer = req("n_layer")?;
        let n_head = req("n_head")?;
        let vocab = req("vocab_size")?;
        let n_positions = match opt("n_positions")? {
            Some(n) => n,
            None => match opt("n_ctx")? {
                Some(n) => n,
                None => req("n_positions")?,
            },
        };
        if d % n_head != 0 {
            return Err(bad(
                file,
                format!("n_embd {d} is not divisible by n_head {n_head}"),
            ));
        }
        return Ok(Architecture::Gpt2(Gpt2Config {
            vocab_size: vocab,
            n_positions,
            d_model: d,
            n_layer,
            n_head,
            bias: true,
            tied_head: flag("tie_word_embeddings", true)?,
        }));
    }
    let d = req("hidden_size")?;
    let n_layer = req("num_hidden_layers")?;
    let n_head = req("num_attention_heads")?;
    let ffn = req("intermediate_size")?;
    let vocab = req("vocab_size")?;
    let n_kv = opt("num_key_value_heads")?.unwrap_or(n_head);
    let max_seq = opt("max_position_embeddings")?.unwrap_or(2048);
    if d % n_head != 0 {
        return Err(bad(
            file,
            format!("hidden_size {d} is not divisible by num_attention_heads {n_head}"),
        ));
    }
    if n_head % n_kv != 0 {
        return Err(bad(
            file,
            format!("num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_kv}"),
        ));
    }
    Ok(Architecture::Llama(LlamaConfig {
        vocab_size: vocab,
        d_model: d,
        n_layer,
        n_head,
        n_kv_head: n_kv,
        ffn_hidden: ffn,
        max_seq,
        tied_head: flag("tie_word_embeddings", false)?,
        qkv_bias: model_type == "qwen2",
    }))
}

/// Builds the spec of a `config.json`'s text with the built-in families' layouts
/// ([`gpt2_spec`], [`llama_spec`]). `name` names the spec. Errors: as [`parse_hf_arch`].
pub fn parse_hf_config(text: &str, file: &str, name: &str) -> Result<ModelSpec, PlanError> {
    match parse_hf_arch(text, file)? {
        Architecture::Gpt2(c) => Ok(gpt2_spec(name, &c)),
        Architecture::Llama(c) => Ok(llama_spec(name, &c)),
        Architecture::Generic => unreachable!("config.json always names a family"),
    }
}

/// Reads the Llama-family numerics of a `config.json` (see [`parse_llama_numerics`]).
///
/// Errors: `Io`; as [`parse_llama_numerics`].
pub fn read_llama_numerics(path: &Path) -> Result<LlamaNumerics, PlanError> {
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    parse_llama_numerics(&text, &path.display().to_string())
}

/// The computation-only hyper-parameters of a Llama, Mistral or Qwen2 `config.json`
/// ([`LlamaNumerics`]), with `transformers`' defaults: `rms_norm_eps` (1e-6), `rope_theta`
/// (10000), `rope_scaling` (`null`, or type `default` or `llama3` with `factor`,
/// `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`), and the
/// sliding window: Mistral's `sliding_window` (`null`: none), Qwen2's `sliding_window` only
/// when `use_sliding_window` is true. The `rope_parameters` object of newer `transformers`
/// releases (holding `rope_theta` and `rope_type`) is read as well.
///
/// Also refuses what the Llama layout of [`llama_spec`] does not describe, so that a model
/// is never trained with other math or other parameters than its file says: a `hidden_act`
/// other than `silu`, `attention_bias` or `mlp_bias` true, a `head_dim` other than
/// `hidden_size / num_attention_heads`, another `rope_scaling` type (linear, dynamic, yarn,
/// longrope).
///
/// Errors: `BadFile` naming the field and the value; as [`parse_hf_arch`] for a file that is
/// not a Llama-family config.
pub fn parse_llama_numerics(text: &str, file: &str) -> Result<LlamaNumerics, PlanError> {
    let arch = parse_hf_arch(text, file)?;
    let Architecture::Llama(cfg) = arch else {
        return Err(bad(
            file,
            "not a Llama-family config (model_type llama, mistral or qwen2)",
        ));
    };
    let v: Value =
        serde_json::from_str(text).map_err(|e| bad(file, format!("not valid JSON: {e}")))?;
    let obj = v.as_object().expect("parse_hf_arch checked the object");
    let model_type = obj.get("model_type").and_then(Value::as_str).unwrap_or("");
    let present =
        |o: &serde_json::Map<String, Value>, k: &str| o.get(k).filter(|x| !x.is_null()).cloned();
    let num = |o: &serde_json::Map<String, Value>, k: &str| -> Result<Option<f64>, PlanError> {
        match present(o, k) {
            None => Ok(None),
            Some(x) => match x.as_f64() {
                Some(f) if f.is_finite() && f > 0.0 => Ok(Some(f)),
                _ => Err(bad(
                    file,
                    format!("field `{k}` must be a positive number, got {x}"),
                )),
            },
        }
    };
    if let Some(act) = present(obj, "hidden_act") {
        if act.as_str() != Some("silu") {
            return Err(bad(
                file,
                format!(
                    "hidden_act {act} is not supported: the Llama family's MLP is SwiGLU (`silu`)"
                ),
            ));
        }
    }
    for k in ["attention_bias", "mlp_bias"] {
        if present(obj, k).and_then(|x| x.as_bool()) == Some(true) {
            return Err(bad(
                file,
                format!("`{k}: true` is not supported (its biases are not in the planned parameters); only Qwen2's q/k/v biases are"),
            ));
        }
    }
    if let Some(hd) = present(obj, "head_dim") {
        let want = cfg.d_model / cfg.n_head;
        if hd.as_u64() != Some(want) {
            return Err(bad(
                file,
                format!("head_dim {hd} is not hidden_size / num_attention_heads = {want}, which the planned parameter shapes assume"),
            ));
        }
    }
    let mut out = LlamaNumerics::default();
    if let Some(eps) = num(obj, "rms_norm_eps")? {
        out.rms_norm_eps = eps;
    }
    // Newer transformers releases nest the rotary settings in `rope_parameters`.
    let rope_params = present(obj, "rope_parameters");
    let rope_obj = rope_params.as_ref().and_then(Value::as_object);
    let theta = match rope_obj {
        Some(r) => num(r, "rope_theta")?,
        None => None,
    };
    if let Some(t) = theta.or(num(obj, "rope_theta")?) {
        out.rope_theta = t;
    }
    let scaling = match present(obj, "rope_scaling") {
        Some(x) => Some(x),
        None => rope_params.clone(),
    };
    if let Some(sc) = scaling {
        let so = sc.as_object().ok_or_else(|| {
            bad(
                file,
                format!("rope_scaling must be an object or null, got {sc}"),
            )
        })?;
        let kind = so
            .get("rope_type")
            .or_else(|| so.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        match kind {
            "default" => {}
            "llama3" => {
                let need = |k: &str| -> Result<f64, PlanError> {
                    num(so, k)?.ok_or_else(|| PlanError::MissingField {
                        file: file.to_string(),
                        field: format!("rope_scaling.{k}"),
                        family: model_type.to_string(),
                    })
                };
                let s = Llama3RopeScaling {
                    factor: need("factor")?,
                    low_freq_factor: need("low_freq_factor")?,
                    high_freq_factor: need("high_freq_factor")?,
                    original_max_position_embeddings: need("original_max_position_embeddings")?
                        as u64,
                };
                if s.high_freq_factor <= s.low_freq_factor {
                    return Err(bad(
                        file,
                        format!(
                            "rope_scaling: high_freq_factor {} must exceed low_freq_factor {}",
                            s.high_freq_factor, s.low_freq_factor
                        ),
                    ));
                }
                out.rope_scaling = Some(s);
            }
            other => {
                return Err(bad(
                    file,
                    format!(
                        "rope_scaling type `{other}` is not supported (supported: default, llama3)"
                    ),
                ))
            }
        }
    }
    let window = match model_type {
        "mistral" => present(obj, "sliding_window"),
        "qwen2" if present(obj, "use_sliding_window").and_then(|x| x.as_bool()) == Some(true) => {
            present(obj, "sliding_window")
        }
        _ => None,
    };
    if let Some(w) = window {
        match w.as_u64() {
            Some(n) if n > 0 => out.sliding_window = Some(n),
            _ => {
                return Err(bad(
                    file,
                    format!("field `sliding_window` must be a positive integer or null, got {w}"),
                ))
            }
        }
    }
    Ok(out)
}

/// `arch` in words for messages: the family and every size that decides parameter shapes.
pub fn describe_arch(arch: &Architecture) -> String {
    match arch {
        Architecture::Gpt2(c) => format!(
            "a GPT-2 (vocab {}, n_embd {}, {} layers, {} heads, {} positions, {} head{})",
            c.vocab_size,
            c.d_model,
            c.n_layer,
            c.n_head,
            c.n_positions,
            if c.tied_head { "tied" } else { "untied" },
            if c.bias { "" } else { ", no biases" }
        ),
        Architecture::Llama(c) => format!(
            "a Llama-family model (vocab {}, hidden {}, {} layers, {} heads, {} key/value heads, \
             intermediate {}, {} head{})",
            c.vocab_size,
            c.d_model,
            c.n_layer,
            c.n_head,
            c.n_kv_head,
            c.ffn_hidden,
            if c.tied_head { "tied" } else { "untied" },
            if c.qkv_bias { ", q/k/v biases" } else { "" }
        ),
        Architecture::Generic => "a model of unknown architecture".into(),
    }
}

/// The Hugging Face `config.json` (as JSON) that rebuilds a GPT-2 model of `cfg` in
/// `transformers` (`GPT2LMHeadModel`): sizes, heads, `n_positions`, the tanh-approximated GELU
/// (`gelu_new`), LayerNorm epsilon 1e-5 and `tie_word_embeddings`; `torch_dtype` `float32`.
/// `None` for a model without biases, which `GPT2LMHeadModel` cannot express.
pub fn gpt2_hf_config(cfg: &Gpt2Config) -> Option<Value> {
    if !cfg.bias {
        return None;
    }
    Some(serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.n_positions,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": Value::Null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": cfg.tied_head,
        "torch_dtype": "float32",
    }))
}

/// [`check_gpt2_numerics`] of the `config.json` at `path`. Errors: `Io`; as
/// [`check_gpt2_numerics`].
pub fn read_gpt2_numerics(path: &Path) -> Result<(), PlanError> {
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    check_gpt2_numerics(&text, &path.display().to_string())
}

/// Refuses a GPT-2 `config.json` whose math this engine's GPT does not compute, so that a
/// model is never trained or exported with other math than its file says: an
/// `activation_function` other than the tanh-approximated GELU (`gelu_new`,
/// `gelu_pytorch_tanh`), a `layer_norm_epsilon` other than 1e-5, an `n_inner` other than
/// `4 * n_embd`, `scale_attn_weights: false` or `scale_attn_by_inverse_layer_idx: true`.
///
/// Errors: `BadFile` naming the field and the value.
pub fn check_gpt2_numerics(text: &str, file: &str) -> Result<(), PlanError> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| bad(file, format!("not valid JSON: {e}")))?;
    let Some(o) = v.as_object() else {
        return Err(bad(file, "expected a JSON object at the top level"));
    };
    let get = |k: &str| o.get(k).filter(|x| !x.is_null());
    if let Some(a) = get("activation_function") {
        if !matches!(a.as_str(), Some("gelu_new" | "gelu_pytorch_tanh")) {
            return Err(bad(
                file,
                format!("activation_function {a} is not supported: the GPT computes the tanh-approximated GELU (`gelu_new`)"),
            ));
        }
    }
    if let Some(e) = get("layer_norm_epsilon") {
        if e.as_f64() != Some(1e-5) {
            return Err(bad(
                file,
                format!("layer_norm_epsilon {e} is not supported: the GPT's LayerNorm uses 1e-5"),
            ));
        }
    }
    if let (Some(n), Some(d)) = (get("n_inner"), get("n_embd").and_then(Value::as_u64)) {
        if n.as_u64() != Some(4 * d) {
            return Err(bad(
                file,
                format!(
                    "n_inner {n} is not 4 * n_embd = {}, which the planned MLP shapes assume",
                    4 * d
                ),
            ));
        }
    }
    for (k, ok) in [
        ("scale_attn_weights", true),
        ("scale_attn_by_inverse_layer_idx", false),
    ] {
        if let Some(x) = get(k) {
            if x.as_bool() != Some(ok) {
                return Err(bad(file, format!("`{k}: {x}` is not supported")));
            }
        }
    }
    Ok(())
}

/// The Hugging Face `config.json` (as JSON) that rebuilds a Llama-family model of `cfg` with
/// numerics `n` in `transformers`: `LlamaForCausalLM` (`model_type` `llama`), or
/// `Qwen2ForCausalLM` when `cfg.qkv_bias` (Qwen2's q/k/v biases), or `MistralForCausalLM` when
/// `n.sliding_window` is set (Qwen2 with a window sets `use_sliding_window`). Sizes, head
/// counts, `max_position_embeddings`, `rms_norm_eps`, `rope_theta`, `rope_scaling` (type
/// `llama3`) and `tie_word_embeddings` are written; `torch_dtype` is `float32` (fsdp-rs keeps
/// f32 master weights). [`parse_hf_arch`] and [`parse_llama_numerics`] read it back to `cfg`
/// and `n`.
pub fn llama_hf_config(cfg: &LlamaConfig, n: &LlamaNumerics) -> Value {
    let (arch, model_type) = if cfg.qkv_bias {
        ("Qwen2ForCausalLM", "qwen2")
    } else if n.sliding_window.is_some() {
        ("MistralForCausalLM", "mistral")
    } else {
        ("LlamaForCausalLM", "llama")
    };
    let mut o = serde_json::Map::new();
    let mut put = |k: &str, v: Value| {
        o.insert(k.to_string(), v);
    };
    put("architectures", serde_json::json!([arch]));
    put("model_type", model_type.into());
    put("vocab_size", cfg.vocab_size.into());
    put("hidden_size", cfg.d_model.into());
    put("intermediate_size", cfg.ffn_hidden.into());
    put("num_hidden_layers", cfg.n_layer.into());
    put("num_attention_heads", cfg.n_head.into());
    put("num_key_value_heads", cfg.n_kv_head.into());
    put("hidden_act", "silu".into());
    put("max_position_embeddings", cfg.max_seq.into());
    put("rms_norm_eps", n.rms_norm_eps.into());
    put("rope_theta", n.rope_theta.into());
    put(
        "rope_scaling",
        match n.rope_scaling {
            None => Value::Null,
            Some(s) => serde_json::json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }),
        },
    );
    if model_type == "llama" {
        put("attention_bias", false.into());
        put("mlp_bias", false.into());
    }
    match (model_type, n.sliding_window) {
        ("mistral", w) => put("sliding_window", w.map_or(Value::Null, Value::from)),
        ("qwen2", Some(w)) => {
            put("use_sliding_window", true.into());
            put("sliding_window", w.into());
        }
        ("qwen2", None) => put("use_sliding_window", false.into()),
        _ => {}
    }
    put("tie_word_embeddings", cfg.tied_head.into());
    put("torch_dtype", "float32".into());
    Value::Object(o)
}

/// The `config.json` to write next to exported f32 weights of a model of architecture `arch`
/// (GPT-2 or Llama family): the config text `text` (from the file `file`, named in errors),
/// checked to describe exactly `arch` (same sizes, heads, head tying, biases) with numerics
/// this engine computes ([`parse_llama_numerics`], [`check_gpt2_numerics`]), with
/// `torch_dtype` (and `dtype`, the newer spelling, when present) set to `float32` and an
/// `architectures` entry added when missing.
///
/// Errors: `BadFile` when `text` is not a GPT-2 or Llama-family config, describes another
/// model than `arch` (naming both), or has numerics this engine does not compute.
pub fn export_hf_config(text: &str, file: &str, arch: &Architecture) -> Result<Value, PlanError> {
    let found = parse_hf_arch(text, file)?;
    if found != *arch {
        return Err(bad(
            file,
            format!(
                "describes {}, but the checkpoint holds {}: pass the config.json the checkpoint \
                 was trained from",
                describe_arch(&found),
                describe_arch(arch)
            ),
        ));
    }
    let gpt2 = matches!(found, Architecture::Gpt2(_));
    if gpt2 {
        check_gpt2_numerics(text, file)?;
    } else {
        parse_llama_numerics(text, file)?;
    }
    let mut v: Value =
        serde_json::from_str(text).map_err(|e| bad(file, format!("not valid JSON: {e}")))?;
    let o = v.as_object_mut().expect("parse_hf_arch checked the object");
    let model_type = o
        .get("model_type")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
        .unwrap_or(if gpt2 { "gpt2" } else { "llama" })
        .to_string();
    o.insert("model_type".into(), model_type.clone().into());
    if !o.contains_key("architectures") {
        let a = match model_type.as_str() {
            "gpt2" => "GPT2LMHeadModel",
            "qwen2" => "Qwen2ForCausalLM",
            "mistral" => "MistralForCausalLM",
            _ => "LlamaForCausalLM",
        };
        o.insert("architectures".into(), serde_json::json!([a]));
    }
    o.insert("torch_dtype".into(), "float32".into());
    if o.contains_key("dtype") {
        o.insert("dtype".into(), "float32".into());
    }
    Ok(v)
}

/// One tensor entry of a safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name.
    pub name: String,
    /// The safetensors dtype tag (`F32`, `BF16`, `I64`, ...).
    pub dtype: String,
    /// Shape in elements.
    pub shape: Vec<u64>,
    /// `[begin, end)` byte offsets relative to the start of the data section.
    pub data_offsets: (u64, u64),
}

/// Bytes per element of a safetensors dtype tag, None for unknown tags.
pub fn safetensors_dtype_size(tag: &str) -> Option<u64> {
    Some(match tag {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" => 8,
        _ => return None,
    })
}

/// Parses and validates a safetensors header from the first bytes of a file of `file_len`
/// bytes. `bytes` must hold at least the 8-byte length and the header itself when they fit in
/// the file. Tensors are returned in data-offset order.
///
/// Checks: the file holds the 8-byte length; `8 + N <= file_len`; `N <= MAX_HEADER_BYTES`;
/// the header is a JSON object; each entry has a known dtype, a shape and `data_offsets`
/// `[b, e]` with `b <= e <= file_len - 8 - N` and `e - b = numel * dtype size`.
///
/// Errors: `BadFile` with the numbers.
pub fn parse_safetensors_header(
    bytes: &[u8],
    file_len: u64,
    file: &str,
) -> Result<Vec<TensorInfo>, PlanError> {
    if file_len < 8 || bytes.len() < 8 {
        return Err(bad(
            file,
            format!("truncated safetensors file: {file_len} bytes, shorter than the 8-byte header length"),
        ));
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER_BYTES {
        return Err(bad(
            file,
            format!("safetensors header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit"),
        ));
    }
    if 8 + n > file_len || (bytes.len() as u64) < 8 + n {
        return Err(bad(
            file,
            format!(
                "truncated safetensors header: header length {n} needs {} bytes but the file has {file_len}",
                8 + n
            ),
        ));
    }
    let data_len = file_len - 8 - n;
    let header = &bytes[8..(8 + n) as usize];
    let v: Value = serde_json::from_slice(header)
        .map_err(|e| bad(file, format!("safetensors header is not valid JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| bad(file, "safetensors header is not a JSON object"))?;
    let mut out = Vec::with_capacity(obj.len());
    for (name, entry) in obj {
        if name == "__metadata__" {
            continue;
        }
        let dtype = entry
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(file, format!("tensor `{name}` has no dtype")))?;
        let size = safetensors_dtype_size(dtype)
            .ok_or_else(|| bad(file, format!("tensor `{name}` has unknown dtype `{dtype}`")))?;
        let shape: Vec<u64> = entry
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
            .ok_or_else(|| bad(file, format!("tensor `{name}` has no valid shape")))?;
        let offs = entry
            .get("data_offsets")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
            .filter(|a| a.len() == 2)
            .ok_or_else(|| bad(file, format!("tensor `{name}` has no valid data_offsets")))?;
        let (b, e) = (offs[0], offs[1]);
        if b > e || e > data_len {
            return Err(bad(
                file,
                format!("tensor `{name}`: data_offsets [{b}, {e}] outside the {data_len}-byte data section"),
            ));
        }
        let numel = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(file, format!("tensor `{name}`: shape {shape:?} overflows")))?;
        if numel.checked_mul(size) != Some(e - b) {
            return Err(bad(
                file,
                format!(
                    "tensor `{name}`: shape {shape:?} x {size} bytes ({dtype}) = {} bytes but data_offsets span {} bytes",
                    numel.saturating_mul(size),
                    e - b
                ),
            ));
        }
        out.push(TensorInfo {
            name: name.clone(),
            dtype: dtype.to_string(),
            shape,
            data_offsets: (b, e),
        });
    }
    out.sort_by(|x, y| {
        x.data_offsets
            .cmp(&y.data_offsets)
            .then(x.name.cmp(&y.name))
    });
    Ok(out)
}

/// Reads the header of one `.safetensors` file through a memory map (weights are not read).
/// Errors: `Io`, `BadFile` (see [`parse_safetensors_header`]).
pub fn read_safetensors_header(path: &Path) -> Result<Vec<TensorInfo>, PlanError> {
    let f = std::fs::File::open(path).map_err(|e| io(path, e))?;
    let len = f.metadata().map_err(|e| io(path, e))?.len();
    let file = path.display().to_string();
    if len == 0 {
        return Err(bad(
            &file,
            "truncated safetensors file: 0 bytes, shorter than the 8-byte header length",
        ));
    }
    // SAFETY: the map is read-only and only read while `f` is open; a concurrent truncation
    // of the file by another process could fault, as with any mapped read.
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| io(path, e))?;
    parse_safetensors_header(&map, len, &file)
}

/// Reads a `.safetensors` file's header, or a sharded model's `*.index.json` (its
/// `weight_map` and every file's header), and builds a spec with [`spec_from_tensors`]. A
/// `config.json` next to the file supplies the architecture and `tie_word_embeddings`;
/// without one the spec is `Generic` (GPT-2 style names still imply a tied head when
/// `lm_head.weight` is absent).
///
/// Errors: `Io`, `BadFile` (bad header, a name in the index missing from its file),
/// `MissingField` (from config.json).
pub fn read_safetensors_model(path: &Path) -> Result<ModelSpec, PlanError> {
    let file = path.display().to_string();
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let tensors: Vec<TensorInfo> = if file.ends_with(".json") {
        let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
        let v: Value =
            serde_json::from_str(&text).map_err(|e| bad(&file, format!("not valid JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| {
                bad(
                    &file,
                    "no `weight_map` object (expected a model.safetensors.index.json)",
                )
            })?;
        let mut by_file: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, f) in map {
            let f = f.as_str().ok_or_else(|| {
                bad(
                    &file,
                    format!("weight_map entry `{name}` is not a file name"),
                )
            })?;
            by_file.entry(f.to_string()).or_default().push(name.clone());
        }
        let mut all = Vec::new();
        for (f, names) in &by_file {
            let p: PathBuf = dir.join(f);
            let hdr = read_safetensors_header(&p)?;
            for n in names {
                if !hdr.iter().any(|t| &t.name == n) {
                    return Err(bad(
                        &file,
                        format!("weight_map names `{n}` in `{f}`, but that file's header has no such tensor"),
                    ));
                }
            }
            all.extend(hdr.into_iter().filter(|t| names.contains(&t.name)));
        }
        all
    } else {
        read_safetensors_header(path)?
    };
    let cfg_path = dir.join("config.json");
    let arch = if cfg_path.is_file() {
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| io(&cfg_path, e))?;
        parse_hf_arch(&text, &cfg_path.display().to_string())?
    } else {
        Architecture::Generic
    };
    spec_from_tensors(&model_name(path), &tensors, arch, &file)
}

/// The block index of a tensor name: `(prefix, N)` for names with a `h.N.`, `layers.N.`,
/// `blocks.N.` or `layer.N.` segment pair.
fn block_of(name: &str) -> Option<(&str, u64)> {
    let segs: Vec<&str> = name.split('.').collect();
    segs.windows(2).find_map(|w| {
        matches!(w[0], "h" | "layers" | "blocks" | "layer")
            .then(|| w[1].parse::<u64>().ok().map(|n| (w[0], n)))
            .flatten()
    })
}

/// Whether a tensor is a non-trainable buffer a checkpoint may carry: GPT-2's causal masks
/// (`attn.bias` / `attn.masked_bias` with 4 dims or 0 dims), rotary `inv_freq`.
fn is_buffer(t: &TensorInfo) -> bool {
    let n = &t.name;
    ((n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias"))
        && (t.shape.len() == 4 || t.shape.is_empty()))
        || n.ends_with("rotary_emb.inv_freq")
}

/// Groups tensors into FSDP units by name: one unit per transformer block (`h.N`, `layers.N`,
/// ...; blocks in numeric order), the others into `embed` (names containing `wte`, `wpe` or
/// `embed`) and `head` (everything else: final norm, LM head). Inside a unit, tensors keep
/// file order. Integer tensors and buffers (see `is_buffer`) are skipped.
///
/// Tied head: when the file has no `lm_head.weight` and the architecture says the head is tied
/// (GPT-2 always unless its config says otherwise), `lm_head.weight` is added tied to the token
/// embedding and `embed` and `head` become one root unit `root`, placed last, used first and
/// last (as in the presets).
///
/// Errors: `BadFile` (no floating-point tensors).
pub fn spec_from_tensors(
    name: &str,
    tensors: &[TensorInfo],
    arch: Architecture,
    file: &str,
) -> Result<ModelSpec, PlanError> {
    let mut blocks: BTreeMap<u64, (String, Vec<ParamSpec>)> = BTreeMap::new();
    let mut embed = Vec::new();
    let mut head = Vec::new();
    for t in tensors {
        let Some(dtype) = DType::from_safetensors(&t.dtype) else {
            continue;
        };
        if is_buffer(t) {
            continue;
        }
        let mut p = ParamSpec::new(t.name.clone(), &t.shape);
        p.dtype = dtype;
        if let Some((prefix, n)) = block_of(&t.name) {
            blocks
                .entry(n)
                .or_insert_with(|| (format!("{prefix}.{n}"), Vec::new()))
                .1
                .push(p);
        } else if t.name.contains("wte") || t.name.contains("wpe") || t.name.contains("embed") {
            embed.push(p);
        } else {
            head.push(p);
        }
    }
    if blocks.is_empty() && embed.is_empty() && head.is_empty() {
        return Err(bad(file, "no floating-point tensors to plan"));
    }
    let gpt2_names = embed.iter().any(|p| p.name.ends_with("wte.weight"));
    let tied_cfg = match &arch {
        Architecture::Gpt2(c) => c.tied_head,
        Architecture::Llama(c) => c.tied_head,
        Architecture::Generic => gpt2_names,
    };
    let has_head = head
        .iter()
        .chain(&embed)
        .any(|p| p.name.ends_with("lm_head.weight"));
    let tok = embed
        .iter()
        .find(|p| p.name.ends_with("wte.weight") || p.name.ends_with("embed_tokens.weight"))
        .map(|p| p.name.clone());
    let mut units = Vec::new();
    match (tied_cfg && !has_head, tok) {
        (true, Some(tok)) => {
            units.extend(blocks.into_values().map(|(n, ps)| UnitSpec {
                name: n,
                params: ps,
            }));
            let mut root = embed;
            root.extend(head);
            let mut lm = ParamSpec::new("lm_head.weight", &[0]);
            let target = root
                .iter()
                .find(|p| p.name == tok)
                .expect("tok is in embed");
            lm.shape = target.shape.clone();
            lm.dtype = target.dtype;
            lm.tied_to = Some(tok);
            root.push(lm);
            units.push(UnitSpec {
                name: "root".into(),
                params: root,
            });
        }
        _ => {
            if !embed.is_empty() {
                units.push(UnitSpec {
                    name: "embed".into(),
                    params: embed,
                });
            }
            units.extend(blocks.into_values().map(|(n, ps)| UnitSpec {
                name: n,
                params: ps,
            }));
            if !head.is_empty() {
                units.push(UnitSpec {
                    name: "head".into(),
                    params: head,
                });
            }
        }
    }
    Ok(ModelSpec {
        name: name.to_string(),
        units,
        arch,
    })
}

//! Built-in model families and presets.
//!
//! GPT-2 parameter names and shapes follow Hugging Face `transformers`' `GPT2LMHeadModel`
//! (Conv1D weights stored `[in, out]`), so a consolidated checkpoint loads there unchanged.

use crate::error::PlanError;
use crate::spec::{Architecture, Gpt2Config, LlamaConfig, ModelSpec, ParamSpec, UnitSpec};

/// Builds the GPT-2 style `ModelSpec` (Radford et al. 2019; Hugging Face naming).
///
/// Units, in forward order:
/// - untied head: `embed` = [`transformer.wte.weight` `[vocab, d]`, `transformer.wpe.weight`
///   `[n_positions, d]`], `h.0` .. `h.{L-1}`, `head` = [`transformer.ln_f.weight` `[d]`,
///   `transformer.ln_f.bias` `[d]`, `lm_head.weight` `[vocab, d]`];
/// - tied head: the tied pair must share a unit, so `h.0` .. `h.{L-1}` and one root unit `root`
///   = [wte, wpe, ln_f weight/bias, `lm_head.weight` tied to wte] (like FSDP's root unit); the
///   root unit is used first (embedding) and last (head).
///
/// A block `h.i` holds, in order: `ln_1.weight`, `ln_1.bias`, `attn.c_attn.weight` `[d, 3d]`,
/// `attn.c_attn.bias` `[3d]`, `attn.c_proj.weight` `[d, d]`, `attn.c_proj.bias` `[d]`,
/// `ln_2.weight`, `ln_2.bias`, `mlp.c_fc.weight` `[d, 4d]`, `mlp.c_fc.bias` `[4d]`,
/// `mlp.c_proj.weight` `[4d, d]`, `mlp.c_proj.bias` `[d]`, each prefixed `transformer.h.{i}.`.
/// Without bias, every `*.bias` is absent. Weight decay applies to 2-D weights only.
pub fn gpt2_spec(name: &str, cfg: &Gpt2Config) -> ModelSpec {
    let d = cfg.d_model;
    let p = |n: String, s: &[u64]| ParamSpec::new(n, s);
    let ln = |prefix: &str, out: &mut Vec<ParamSpec>| {
        out.push(p(format!("{prefix}.weight"), &[d]));
        if cfg.bias {
            out.push(p(format!("{prefix}.bias"), &[d]));
        }
    };
    let linear = |prefix: &str, i: u64, o: u64, out: &mut Vec<ParamSpec>| {
        out.push(p(format!("{prefix}.weight"), &[i, o]));
        if cfg.bias {
            out.push(p(format!("{prefix}.bias"), &[o]));
        }
    };
    let mut embed = vec![
        p("transformer.wte.weight".into(), &[cfg.vocab_size, d]),
        p("transformer.wpe.weight".into(), &[cfg.n_positions, d]),
    ];
    let mut head = Vec::new();
    ln("transformer.ln_f", &mut head);
    let mut lm_head = p("lm_head.weight".into(), &[cfg.vocab_size, d]);
    if cfg.tied_head {
        lm_head.tied_to = Some("transformer.wte.weight".into());
    }
    head.push(lm_head);
    let blocks = (0..cfg.n_layer).map(|i| {
        let pre = format!("transformer.h.{i}");
        let mut ps = Vec::new();
        ln(&format!("{pre}.ln_1"), &mut ps);
        linear(&format!("{pre}.attn.c_attn"), d, 3 * d, &mut ps);
        linear(&format!("{pre}.attn.c_proj"), d, d, &mut ps);
        ln(&format!("{pre}.ln_2"), &mut ps);
        linear(&format!("{pre}.mlp.c_fc"), d, 4 * d, &mut ps);
        linear(&format!("{pre}.mlp.c_proj"), 4 * d, d, &mut ps);
        UnitSpec {
            name: format!("h.{i}"),
            params: ps,
        }
    });
    let mut units = Vec::new();
    if cfg.tied_head {
        units.extend(blocks);
        embed.extend(head);
        units.push(UnitSpec {
            name: "root".into(),
            params: embed,
        });
    } else {
        units.push(UnitSpec {
            name: "embed".into(),
            params: embed,
        });
        units.extend(blocks);
        units.push(UnitSpec {
            name: "head".into(),
            params: head,
        });
    }
    ModelSpec {
        name: name.to_string(),
        units,
        arch: Architecture::Gpt2(*cfg),
    }
}

/// Byte-level GPT presets for training on text with a 256-symbol vocabulary (untied head):
/// `tiny` (d 128, 4 layers, 4 heads, 891,648 params), `mini` (d 256, 4 layers, 3,552,768),
/// `small` (d 384, 6 layers, 11,237,376), `base` (d 768, 6 layers, 43,708,416).
pub fn byte_gpt_config(name: &str) -> Option<Gpt2Config> {
    let (d, l, h, pos) = match name {
        "tiny" => (128, 4, 4, 256),
        "mini" => (256, 4, 4, 1024),
        "small" => (384, 6, 6, 1024),
        "base" => (768, 6, 12, 1024),
        _ => return None,
    };
    Some(Gpt2Config {
        vocab_size: 256,
        n_positions: pos,
        d_model: d,
        n_layer: l,
        n_head: h,
        bias: true,
        tied_head: false,
    })
}

/// OpenAI GPT-2 presets (BPE vocabulary 50257, 1024 positions, tied head): `gpt2` (124M),
/// `gpt2-medium` (355M), `gpt2-large` (774M), `gpt2-xl` (1.5B).
pub fn openai_gpt2_config(name: &str) -> Option<Gpt2Config> {
    let (d, l, h) = match name {
        "gpt2" => (768, 12, 12),
        "gpt2-medium" => (1024, 24, 16),
        "gpt2-large" => (1280, 36, 20),
        "gpt2-xl" => (1600, 48, 25),
        _ => return None,
    };
    Some(Gpt2Config {
        vocab_size: 50257,
        n_positions: 1024,
        d_model: d,
        n_layer: l,
        n_head: h,
        bias: true,
        tied_head: true,
    })
}

/// Builds the Llama style `ModelSpec` (Touvron et al. 2023, "LLaMA"; Hugging Face
/// `LlamaForCausalLM` naming; also Mistral and Qwen2, which share the layout).
///
/// Units, in forward order:
/// - untied head: `embed` = [`model.embed_tokens.weight` `[vocab, d]`], `layers.0` ..
///   `layers.{L-1}`, `head` = [`model.norm.weight` `[d]`, `lm_head.weight` `[vocab, d]`];
/// - tied head (small Qwen2 models): `layers.0` .. `layers.{L-1}` and one root unit `root` =
///   [embed_tokens, norm, `lm_head.weight` tied to `model.embed_tokens.weight`], used first and
///   last, as for GPT-2.
///
/// A block `layers.i` holds, in order, each prefixed `model.layers.{i}.`:
/// `input_layernorm.weight` `[d]`, `self_attn.q_proj.weight` `[n_head*hd, d]`,
/// `self_attn.k_proj.weight` `[n_kv_head*hd, d]`, `self_attn.v_proj.weight` `[n_kv_head*hd, d]`
/// (with `qkv_bias`, each followed by its `.bias`), `self_attn.o_proj.weight` `[d, n_head*hd]`,
/// `post_attention_layernorm.weight` `[d]`, `mlp.gate_proj.weight` `[ffn, d]`,
/// `mlp.up_proj.weight` `[ffn, d]`, `mlp.down_proj.weight` `[d, ffn]` (torch `Linear` layout
/// `[out, in]`), where `hd = d / n_head`. Rotary embeddings have no parameters. Weight decay
/// applies to 2-D weights only (not RMSNorm gains, not biases).
pub fn llama_spec(name: &str, cfg: &LlamaConfig) -> ModelSpec {
    let d = cfg.d_model;
    let hd = d / cfg.n_head.max(1);
    let q_out = cfg.n_head * hd;
    let kv_out = cfg.n_kv_head * hd;
    let p = |n: String, s: &[u64]| ParamSpec::new(n, s);
    let blocks = (0..cfg.n_layer).map(|i| {
        let pre = format!("model.layers.{i}");
        let mut ps = vec![p(format!("{pre}.input_layernorm.weight"), &[d])];
        for (proj, out) in [("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)] {
            ps.push(p(format!("{pre}.self_attn.{proj}.weight"), &[out, d]));
            if cfg.qkv_bias {
                ps.push(p(format!("{pre}.self_attn.{proj}.bias"), &[out]));
            }
        }
        ps.push(p(format!("{pre}.self_attn.o_proj.weight"), &[d, q_out]));
        ps.push(p(format!("{pre}.post_attention_layernorm.weight"), &[d]));
        ps.push(p(
            format!("{pre}.mlp.gate_proj.weight"),
            &[cfg.ffn_hidden, d],
        ));
        ps.push(p(format!("{pre}.mlp.up_proj.weight"), &[cfg.ffn_hidden, d]));
        ps.push(p(
            format!("{pre}.mlp.down_proj.weight"),
            &[d, cfg.ffn_hidden],
        ));
        UnitSpec {
            name: format!("layers.{i}"),
            params: ps,
        }
    });
    let embed = p("model.embed_tokens.weight".into(), &[cfg.vocab_size, d]);
    let norm = p("model.norm.weight".into(), &[d]);
    let mut lm_head = p("lm_head.weight".into(), &[cfg.vocab_size, d]);
    let mut units = Vec::new();
    if cfg.tied_head {
        lm_head.tied_to = Some("model.embed_tokens.weight".into());
        units.extend(blocks);
        units.push(UnitSpec {
            name: "root".into(),
            params: vec![embed, norm, lm_head],
        });
    } else {
        units.push(UnitSpec {
            name: "embed".into(),
            params: vec![embed],
        });
        units.extend(blocks);
        units.push(UnitSpec {
            name: "head".into(),
            params: vec![norm, lm_head],
        });
    }
    ModelSpec {
        name: name.to_string(),
        units,
        arch: Architecture::Llama(*cfg),
    }
}

/// Llama presets (Meta's published configs): `llama2-7b` (d 4096, 32 layers, 32 heads, MHA,
/// ffn 11008, vocab 32000, 6.74B), `llama3-8b` (d 4096, 32 layers, 32 heads, 8 KV heads, ffn
/// 14336, vocab 128256, 8.03B), `llama3-70b` (d 8192, 80 layers, 64 heads, 8 KV heads, ffn
/// 28672, vocab 128256, 70.55B). Untied heads, no biases.
pub fn llama_config(name: &str) -> Option<LlamaConfig> {
    let (vocab, d, l, h, kv, ffn, seq) = match name {
        "llama2-7b" => (32000, 4096, 32, 32, 32, 11008, 4096),
        "llama3-8b" => (128256, 4096, 32, 32, 8, 14336, 8192),
        "llama3-70b" => (128256, 8192, 80, 64, 8, 28672, 8192),
        _ => return None,
    };
    Some(LlamaConfig {
        vocab_size: vocab,
        d_model: d,
        n_layer: l,
        n_head: h,
        n_kv_head: kv,
        ffn_hidden: ffn,
        max_seq: seq,
        tied_head: false,
        qkv_bias: false,
    })
}

/// Every built-in preset name, in the order `fsdp plan --help` lists them.
pub const PRESET_NAMES: [&str; 11] = [
    "tiny",
    "mini",
    "small",
    "base",
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "llama2-7b",
    "llama3-8b",
    "llama3-70b",
];

/// The `ModelSpec` of a built-in preset: byte-level GPTs ([`byte_gpt_config`]), OpenAI GPT-2
/// ([`openai_gpt2_config`]) or Llama ([`llama_config`]).
///
/// Errors: `PlanError::UnknownPreset` naming every known preset.
pub fn preset(name: &str) -> Result<ModelSpec, PlanError> {
    if let Some(c) = byte_gpt_config(name).or_else(|| openai_gpt2_config(name)) {
        return Ok(gpt2_spec(name, &c));
    }
    if let Some(c) = llama_config(name) {
        return Ok(llama_spec(name, &c));
    }
    Err(PlanError::UnknownPreset {
        name: name.to_string(),
        known: format!(
            "{}; the Llama presets are plan-only: fsdp train does not run them yet",
            PRESET_NAMES.join(", ")
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_parameter_count() {
        let s = gpt2_spec("gpt2", &openai_gpt2_config("gpt2").unwrap());
        assert_eq!(s.numel().0, 124_439_808);
    }

    #[test]
    fn exact_parameter_counts() {
        for (name, n) in [
            ("gpt2", 124_439_808u64),
            ("gpt2-medium", 354_823_168),
            ("gpt2-large", 774_030_080),
            ("gpt2-xl", 1_557_611_200),
            ("llama2-7b", 6_738_415_616),
            ("llama3-8b", 8_030_261_248),
            ("llama3-70b", 70_553_706_496),
        ] {
            assert_eq!(preset(name).unwrap().numel().0, n, "{name}");
        }
    }

    #[test]
    fn every_preset_builds_and_unknown_lists_names() {
        for n in PRESET_NAMES {
            assert_eq!(preset(n).unwrap().name, n);
        }
        let e = preset("gpt5").unwrap_err().to_string();
        assert!(
            e.contains("gpt5") && e.contains("llama3-70b") && e.contains("tiny"),
            "{e}"
        );
    }

    #[test]
    fn llama_gqa_shapes() {
        let s = preset("llama3-8b").unwrap();
        let l0 = &s.units[1];
        assert_eq!(l0.name, "layers.0");
        let k = l0
            .params
            .iter()
            .find(|p| p.name.ends_with("k_proj.weight"))
            .unwrap();
        assert_eq!(k.shape, vec![1024, 4096]);
        assert_eq!(s.units.len(), 34);
    }
}

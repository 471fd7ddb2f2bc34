//! Built-in model families and presets.
//!
//! GPT-2 parameter names and shapes follow Hugging Face `transformers`' `GPT2LMHeadModel`
//! (Conv1D weights stored `[in, out]`), so a consolidated checkpoint loads there unchanged.

use crate::spec::{Architecture, Gpt2Config, ModelSpec, ParamSpec, UnitSpec};

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
/// `tiny` (d 128, 4 layers, 4 heads, ~0.9M params), `mini` (d 256, 4 layers, ~3.4M),
/// `small` (d 384, 6 layers, ~10.9M), `base` (d 768, 6 layers, ~43M).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_parameter_count() {
        let s = gpt2_spec("gpt2", &openai_gpt2_config("gpt2").unwrap());
        assert_eq!(s.numel().0, 124_439_808);
    }
}

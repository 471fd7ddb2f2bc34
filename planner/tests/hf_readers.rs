//! Readers: Hugging Face config.json (GPT-2, Llama, Mistral, Qwen2), safetensors headers via
//! memmap2 (single file and sharded index), and their error messages.

use fsdp_planner::hf::{parse_hf_config, parse_safetensors_header, read_safetensors_model};
use fsdp_planner::{preset, Architecture, PlanError};
use std::io::Write;
use std::path::Path;

const LLAMA3_8B: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama",
 "hidden_size":4096,"intermediate_size":14336,"num_attention_heads":32,"num_hidden_layers":32,
 "num_key_value_heads":8,"vocab_size":128256,"max_position_embeddings":8192,
 "tie_word_embeddings":false,"torch_dtype":"bfloat16","rope_theta":500000.0}"#;

#[test]
fn config_json_counts_match_published_sizes() {
    let s = parse_hf_config(LLAMA3_8B, "config.json", "Meta-Llama-3-8B").unwrap();
    assert_eq!(s.numel().0, 8_030_261_248);
    assert_eq!(s, {
        let mut p = preset("llama3-8b").unwrap();
        p.name = "Meta-Llama-3-8B".into();
        p
    });
    let gpt2 = r#"{"model_type":"gpt2","n_embd":768,"n_layer":12,"n_head":12,"vocab_size":50257,"n_positions":1024,"n_ctx":1024}"#;
    assert_eq!(
        parse_hf_config(gpt2, "c", "gpt2").unwrap().numel().0,
        124_439_808
    );
    let mistral = r#"{"model_type":"mistral","hidden_size":4096,"intermediate_size":14336,
      "num_attention_heads":32,"num_hidden_layers":32,"num_key_value_heads":8,"vocab_size":32000,
      "max_position_embeddings":32768,"tie_word_embeddings":false}"#;
    assert_eq!(
        parse_hf_config(mistral, "c", "m").unwrap().numel().0,
        7_241_732_096
    );
    let qwen = r#"{"model_type":"qwen2","hidden_size":896,"intermediate_size":4864,
      "num_attention_heads":14,"num_hidden_layers":24,"num_key_value_heads":2,"vocab_size":151936,
      "max_position_embeddings":32768,"tie_word_embeddings":true}"#;
    let q = parse_hf_config(qwen, "c", "qwen2-0.5b").unwrap();
    assert_eq!(q.numel().0, 494_032_768);
    assert_eq!(q.units.last().unwrap().name, "root");
    assert!(matches!(q.arch, Architecture::Llama(c) if c.qkv_bias && c.tied_head));
}

#[test]
fn config_json_missing_field_is_named() {
    let text = LLAMA3_8B.replace(r#""intermediate_size":14336,"#, "");
    match parse_hf_config(&text, "x/config.json", "m") {
        Err(PlanError::MissingField { field, file, .. }) => {
            assert_eq!(field, "intermediate_size");
            assert_eq!(file, "x/config.json");
        }
        other => panic!("{other:?}"),
    }
    let e = parse_hf_config(r#"{"model_type":"gpt2","n_embd":768}"#, "c.json", "g").unwrap_err();
    assert_eq!(
        e.to_string(),
        "c.json: missing field `n_layer` (gpt2 config)"
    );
    let e = parse_hf_config(r#"{"model_type":"bert"}"#, "c", "b")
        .unwrap_err()
        .to_string();
    assert!(e.contains("unsupported model_type `bert`"), "{e}");
    let e = parse_hf_config("{", "c", "b").unwrap_err().to_string();
    assert!(e.contains("not valid JSON"), "{e}");
}

/// Writes a safetensors file with the given (name, dtype, shape) tensors, zero data.
fn write_st(path: &Path, tensors: &[(&str, &str, Vec<u64>)]) {
    let mut off = 0u64;
    let mut hdr = serde_json::Map::new();
    hdr.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    for (n, d, s) in tensors {
        let size = fsdp_planner::hf::safetensors_dtype_size(d).unwrap() * s.iter().product::<u64>();
        hdr.insert(
            (*n).into(),
            serde_json::json!({"dtype": d, "shape": s, "data_offsets": [off, off + size]}),
        );
        off += size;
    }
    let h = serde_json::to_vec(&hdr).unwrap();
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
    f.write_all(&h).unwrap();
    f.write_all(&vec![0u8; off as usize]).unwrap();
}

fn tiny_gpt2_tensors(d: u64, layers: u64) -> Vec<(String, &'static str, Vec<u64>)> {
    let mut t = vec![
        ("wte.weight".to_string(), "F32", vec![64, d]),
        ("wpe.weight".to_string(), "F32", vec![16, d]),
    ];
    for i in 0..layers {
        for (n, s) in [
            ("ln_1.weight", vec![d]),
            ("ln_1.bias", vec![d]),
            ("attn.bias", vec![1, 1, 16, 16]),
            ("attn.c_attn.weight", vec![d, 3 * d]),
            ("attn.c_attn.bias", vec![3 * d]),
            ("mlp.c_fc.weight", vec![d, 4 * d]),
        ] {
            t.push((format!("h.{i}.{n}"), "F32", s));
        }
    }
    t.push(("ln_f.weight".into(), "F32", vec![d]));
    t.push(("ln_f.bias".into(), "F32", vec![d]));
    t
}

#[test]
fn safetensors_header_groups_units_and_detects_tied_head() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.safetensors");
    let t = tiny_gpt2_tensors(8, 3);
    let refs: Vec<(&str, &str, Vec<u64>)> = t
        .iter()
        .map(|(a, b, c)| (a.as_str(), *b, c.clone()))
        .collect();
    write_st(&p, &refs);
    let s = read_safetensors_model(&p).unwrap();
    assert_eq!(s.arch, Architecture::Generic);
    let names: Vec<&str> = s.units.iter().map(|u| u.name.as_str()).collect();
    assert_eq!(names, ["h.0", "h.1", "h.2", "root"]);
    // The causal-mask buffer is skipped; lm_head is added, tied to wte.
    assert!(s.units[0]
        .params
        .iter()
        .all(|p| !p.name.ends_with(".attn.bias")));
    let root = &s.units[3];
    let lm = root
        .params
        .iter()
        .find(|p| p.name == "lm_head.weight")
        .unwrap();
    assert_eq!(lm.tied_to.as_deref(), Some("wte.weight"));
    assert_eq!(lm.shape, vec![64, 8]);
    let block = 8 + 8 + 8 * 24 + 24 + 8 * 32;
    assert_eq!(s.numel().0, 64 * 8 + 16 * 8 + 3 * block + 16);
    fsdp_planner::plan(&s, &fsdp_planner::PlanConfig::new(3)).unwrap();

    // With a Llama config.json next to it saying untied, and an lm_head present: untied units.
    let d2 = tempfile::tempdir().unwrap();
    let p2 = d2.path().join("model.safetensors");
    write_st(
        &p2,
        &[
            ("model.embed_tokens.weight", "BF16", vec![32, 8]),
            ("model.layers.0.input_layernorm.weight", "BF16", vec![8]),
            ("model.layers.1.input_layernorm.weight", "BF16", vec![8]),
            ("model.layers.10.input_layernorm.weight", "BF16", vec![8]),
            ("model.norm.weight", "BF16", vec![8]),
            ("lm_head.weight", "BF16", vec![32, 8]),
        ],
    );
    std::fs::write(d2.path().join("config.json"), r#"{"model_type":"llama","hidden_size":8,"intermediate_size":16,"num_attention_heads":2,"num_hidden_layers":3,"vocab_size":32}"#).unwrap();
    let s2 = read_safetensors_model(&p2).unwrap();
    let names: Vec<&str> = s2.units.iter().map(|u| u.name.as_str()).collect();
    assert_eq!(
        names,
        ["embed", "layers.0", "layers.1", "layers.10", "head"]
    );
    assert!(matches!(s2.arch, Architecture::Llama(_)));
    assert_eq!(s2.units[0].params[0].dtype, fsdp_types::DType::BF16);
}

#[test]
fn sharded_index_reads_every_file_header() {
    let dir = tempfile::tempdir().unwrap();
    write_st(
        &dir.path().join("model-00001-of-00002.safetensors"),
        &[
            ("model.embed_tokens.weight", "F32", vec![32, 8]),
            ("model.layers.0.mlp.up_proj.weight", "F32", vec![16, 8]),
        ],
    );
    write_st(
        &dir.path().join("model-00002-of-00002.safetensors"),
        &[
            ("model.layers.1.mlp.up_proj.weight", "F32", vec![16, 8]),
            ("lm_head.weight", "F32", vec![32, 8]),
        ],
    );
    let idx = dir.path().join("model.safetensors.index.json");
    std::fs::write(
        &idx,
        r#"{"metadata":{"total_size":0},"weight_map":{
      "model.embed_tokens.weight":"model-00001-of-00002.safetensors",
      "model.layers.0.mlp.up_proj.weight":"model-00001-of-00002.safetensors",
      "model.layers.1.mlp.up_proj.weight":"model-00002-of-00002.safetensors",
      "lm_head.weight":"model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let s = read_safetensors_model(&idx).unwrap();
    assert_eq!(s.numel().0, 32 * 8 * 2 + 16 * 8 * 2);
    assert_eq!(s.units.len(), 4);
    std::fs::write(
        &idx,
        r#"{"weight_map":{"missing.weight":"model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let e = read_safetensors_model(&idx).unwrap_err().to_string();
    assert!(
        e.contains("missing.weight") && e.contains("model-00002-of-00002.safetensors"),
        "{e}"
    );
}

#[test]
fn safetensors_bad_headers_report_numbers() {
    let e = |b: &[u8], len: u64| {
        parse_safetensors_header(b, len, "f.safetensors")
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        e(&[1, 2, 3], 3),
        "f.safetensors: truncated safetensors file: 3 bytes, shorter than the 8-byte header length"
    );
    let mut b = 100u64.to_le_bytes().to_vec();
    b.extend_from_slice(b"{\"a\":");
    assert_eq!(
        e(&b, 13),
        "f.safetensors: truncated safetensors header: header length 100 needs 108 bytes but the file has 13"
    );
    let h = br#"{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}"#;
    let mut b = (h.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(h);
    let n = b.len() as u64;
    let msg = e(&b, n + 10);
    assert!(
        msg.contains("data_offsets [0, 24] outside the 10-byte data section"),
        "{msg}"
    );
    let h = br#"{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}}"#;
    let mut b = (h.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(h);
    let n = b.len() as u64;
    let msg = e(&b, n + 20);
    assert!(
        msg.contains("= 24 bytes but data_offsets span 20 bytes"),
        "{msg}"
    );
    // A real file cut short, through the memory-mapped reader.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("cut.safetensors");
    write_st(&p, &[("w", "F32", vec![4, 4])]);
    let full = std::fs::read(&p).unwrap();
    std::fs::write(&p, &full[..20]).unwrap();
    let msg = read_safetensors_model(&p).unwrap_err().to_string();
    assert!(
        msg.contains("truncated safetensors header") && msg.contains("the file has 20"),
        "{msg}"
    );
}

/// The numerics of Llama-family configs: transformers' defaults, Llama 3.1's rope scaling,
/// Mistral's window, Qwen2's window only when `use_sliding_window` is true, the
/// `rope_parameters` object of newer transformers releases, and refusals of what the planned
/// layout does not describe.
#[test]
fn llama_numerics_defaults_scaling_windows_and_refusals() {
    use fsdp_planner::hf::parse_llama_numerics;
    use fsdp_planner::{Llama3RopeScaling, LlamaNumerics};
    let n = parse_llama_numerics(LLAMA3_8B, "c").unwrap();
    assert_eq!(
        n,
        LlamaNumerics {
            rms_norm_eps: 1e-6,
            rope_theta: 500_000.0,
            rope_scaling: None,
            sliding_window: None
        }
    );
    let base = r#""hidden_size":64,"intermediate_size":128,"num_attention_heads":4,
      "num_hidden_layers":2,"num_key_value_heads":2,"vocab_size":300"#;
    let l31 = format!(
        r#"{{"model_type":"llama",{base},"rms_norm_eps":1e-5,"rope_theta":500000.0,
        "rope_scaling":{{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
        "high_freq_factor":4.0,"original_max_position_embeddings":8192}}}}"#
    );
    let n = parse_llama_numerics(&l31, "c").unwrap();
    assert_eq!(n.rms_norm_eps, 1e-5);
    assert_eq!(
        n.rope_scaling,
        Some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        })
    );
    let v5 = format!(
        r#"{{"model_type":"llama",{base},"rope_parameters":{{"rope_type":"default","rope_theta":1234.0}}}}"#
    );
    assert_eq!(parse_llama_numerics(&v5, "c").unwrap().rope_theta, 1234.0);
    let mistral = format!(r#"{{"model_type":"mistral",{base},"sliding_window":4096}}"#);
    assert_eq!(
        parse_llama_numerics(&mistral, "c").unwrap().sliding_window,
        Some(4096)
    );
    let qwen_off = format!(r#"{{"model_type":"qwen2",{base},"sliding_window":4096}}"#);
    assert_eq!(
        parse_llama_numerics(&qwen_off, "c").unwrap().sliding_window,
        None
    );
    let qwen_on =
        format!(r#"{{"model_type":"qwen2",{base},"sliding_window":64,"use_sliding_window":true}}"#);
    assert_eq!(
        parse_llama_numerics(&qwen_on, "c").unwrap().sliding_window,
        Some(64)
    );
    for (extra, needle) in [
        (r#""hidden_act":"gelu""#, "hidden_act"),
        (r#""attention_bias":true"#, "attention_bias"),
        (r#""head_dim":32"#, "head_dim 32"),
        (r#""rope_scaling":{"type":"yarn","factor":4.0}"#, "yarn"),
        (
            r#""rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0}"#,
            "original_max_position_embeddings",
        ),
    ] {
        let text = format!(r#"{{"model_type":"llama",{base},{extra}}}"#);
        let e = parse_llama_numerics(&text, "cfg.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cfg.json") && e.contains(needle), "{extra}: {e}");
    }
}

/// The generated `config.json` of a Llama-family model reads back to the same sizes and
/// numerics, for the Llama presets and for Qwen2 (biases, window) and Mistral variants.
#[test]
fn llama_hf_config_reads_back_to_the_same_model() {
    use fsdp_planner::hf::{llama_hf_config, parse_hf_arch, parse_llama_numerics};
    use fsdp_planner::presets::{llama_config, llama_numerics};
    use fsdp_planner::{Llama3RopeScaling, LlamaNumerics};
    let mut cases = Vec::new();
    for name in ["llama-tiny", "llama-mini", "llama3-8b"] {
        cases.push((llama_config(name).unwrap(), llama_numerics(name).unwrap()));
    }
    let mut qwen = llama_config("llama-tiny").unwrap();
    qwen.qkv_bias = true;
    qwen.tied_head = true;
    let windowed = LlamaNumerics {
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        rope_scaling: None,
        sliding_window: Some(64),
    };
    cases.push((qwen, windowed));
    cases.push((llama_config("llama-tiny").unwrap(), windowed));
    let scaled = LlamaNumerics {
        rope_scaling: Some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        }),
        ..LlamaNumerics::default()
    };
    cases.push((llama_config("llama-mini").unwrap(), scaled));
    for (cfg, n) in cases {
        let v = llama_hf_config(&cfg, &n);
        let text = v.to_string();
        assert_eq!(
            parse_hf_arch(&text, "gen").unwrap(),
            fsdp_planner::Architecture::Llama(cfg),
            "{text}"
        );
        assert_eq!(parse_llama_numerics(&text, "gen").unwrap(), n, "{text}");
        assert_eq!(v["torch_dtype"], "float32");
    }
    let tiny = llama_hf_config(
        &llama_config("llama-tiny").unwrap(),
        &llama_numerics("llama-tiny").unwrap(),
    );
    assert_eq!(tiny["model_type"], "llama");
    assert_eq!(tiny["architectures"][0], "LlamaForCausalLM");
    assert_eq!(tiny["hidden_size"], 128);
    assert_eq!(tiny["num_key_value_heads"], 2);
    assert_eq!(tiny["intermediate_size"], 352);
    assert_eq!(tiny["rms_norm_eps"], 1e-5);
}

/// `export_hf_config` refuses a config of another model than the checkpoint's and
/// normalises the dtype.
#[test]
fn export_hf_config_checks_the_model() {
    use fsdp_planner::hf::export_hf_config;
    use fsdp_planner::presets::llama_config;
    let cfg = llama_config("llama-tiny").unwrap();
    let arch = fsdp_planner::Architecture::Llama(cfg);
    let text = r#"{"model_type": "llama", "vocab_size": 256, "hidden_size": 128,
        "intermediate_size": 352, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "torch_dtype": "bfloat16"}"#;
    let v = export_hf_config(text, "c.json", &arch).unwrap();
    assert_eq!(v["torch_dtype"], "float32");
    assert_eq!(v["architectures"][0], "LlamaForCausalLM");
    let other = text.replace("\"num_hidden_layers\": 4", "\"num_hidden_layers\": 3");
    let e = export_hf_config(&other, "c.json", &arch)
        .unwrap_err()
        .to_string();
    assert!(e.contains("c.json") && e.contains("3 layers"), "{e}");
}

/// The generated `config.json` of a Llama-family model against the file transformers itself
/// writes for the same model (`tests/data/hf_configs/*.json`, made by `make_configs.py` there
/// with transformers 5.24): every key generated is one transformers writes, with the same value
/// (`rope_theta` and `rope_scaling` are the older spellings transformers reads into
/// `rope_parameters`, `torch_dtype` the older spelling of `dtype`); and the planner reads the
/// transformers-written file to the same model and numerics.
#[test]
fn llama_hf_config_agrees_with_the_config_transformers_writes() {
    use fsdp_planner::hf::{llama_hf_config, parse_hf_arch, parse_llama_numerics};
    use fsdp_planner::presets::{llama_config, llama_numerics};
    use fsdp_planner::{Llama3RopeScaling, LlamaNumerics};
    use serde_json::Value;
    let windowed = LlamaNumerics {
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        rope_scaling: None,
        sliding_window: Some(64),
    };
    let mut qwen = llama_config("llama-tiny").unwrap();
    qwen.qkv_bias = true;
    qwen.tied_head = true;
    let scaled = LlamaNumerics {
        rope_scaling: Some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        }),
        ..llama_numerics("llama-mini").unwrap()
    };
    let cases = [
        (
            "llama_tiny",
            llama_config("llama-tiny").unwrap(),
            llama_numerics("llama-tiny").unwrap(),
        ),
        (
            "llama_mini_llama3_rope",
            llama_config("llama-mini").unwrap(),
            scaled,
        ),
        ("qwen2_window", qwen, windowed),
        (
            "mistral_window",
            llama_config("llama-tiny").unwrap(),
            windowed,
        ),
    ];
    // JSON numbers compare as numbers (transformers writes 10000.0 where we may write 10000).
    let same = |a: &Value, b: &Value| match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    };
    for (name, cfg, n) in cases {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/hf_configs/").to_string()
            + name
            + ".json";
        let text = std::fs::read_to_string(&path).unwrap();
        let hf: Value = serde_json::from_str(&text).unwrap();
        let rope = &hf["rope_parameters"];
        let generated = llama_hf_config(&cfg, &n);
        for (k, v) in generated.as_object().unwrap() {
            match k.as_str() {
                "rope_theta" => assert!(same(v, &rope["rope_theta"]), "{name}: {k} {v} vs {rope}"),
                "rope_scaling" if v.is_null() => {
                    assert_eq!(rope["rope_type"], "default", "{name}: {k} {v} vs {rope}")
                }
                "rope_scaling" => {
                    for (kk, vv) in v.as_object().unwrap() {
                        assert!(same(vv, &rope[kk]), "{name}: {k}.{kk} {vv} vs {rope}");
                    }
                }
                "torch_dtype" => assert_eq!(v, &hf["dtype"], "{name}: {k}"),
                _ => {
                    let w = hf.get(k);
                    assert!(
                        w.is_some_and(|w| same(v, w)),
                        "{name}: generated {k} = {v}, transformers wrote {w:?}"
                    );
                }
            }
        }
        assert_eq!(
            parse_hf_arch(&text, &path).unwrap(),
            fsdp_planner::Architecture::Llama(cfg),
            "{name}"
        );
        assert_eq!(parse_llama_numerics(&text, &path).unwrap(), n, "{name}");
    }
}

//! `fsdp ckpt consolidate CK -o DIR` for Llama-family models, end to end through the binary:
//! a Hugging Face model directory (`config.json`, `model.safetensors` or shards with
//! `model.safetensors.index.json`) holding exactly the checkpoint's parameters, and the
//! refusals of outputs it cannot write (exit 2).
//!
//! The expected tensors do not come from the checkpoint code: each checkpoint is trained
//! (2 ranks, 2 steps) from weights this file writes, with a negligible learning rate, so its
//! parameters are those weights bit for bit, and the export is compared with them.

use fsdp::model::decoder::Decoder;
use fsdp::runtime::StagedModel;
use fsdp_checkpoints::{read_full, write_full, Checkpoint, FullTensor, StateKind, Verify};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn fsdp(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Writes seeded values for every non-tied parameter of `model` to `file` (the names
/// `--init-from` reads) and returns them by name. The initialisation's zero biases become
/// 0.01: a negligible update leaves a nonzero value's bits alone, but not a zero's.
fn start_weights(model: &Decoder, file: &Path) -> BTreeMap<String, FullTensor> {
    let values = StagedModel::init_params(model, 99);
    let tensors: Vec<FullTensor> = model
        .spec()
        .units
        .iter()
        .zip(&values)
        .flat_map(|(u, v)| {
            u.params
                .iter()
                .filter(|p| p.tied_to.is_none())
                .zip(v)
                .map(|(p, t)| FullTensor {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                    data: t.iter().map(|&x| if x == 0.0 { 0.01 } else { x }).collect(),
                })
        })
        .collect();
    write_full(file, &tensors, &[]).unwrap();
    tensors.into_iter().map(|t| (t.name.clone(), t)).collect()
}

/// One step of `fsdp train --init-from dir` (its config.json the model) at a learning rate of
/// 1e-30, saved into `ck`: the saved parameters are the directory's values. (exit code,
/// stdout, stderr).
fn one_step_from(dir: &Path, ck: &Path) -> (i32, String, String) {
    fsdp(&[
        "train",
        "--init-from",
        s(dir),
        "--steps",
        "1",
        "--micro-batch",
        "1",
        "--seq-len",
        "16",
        "--eval-batches",
        "1",
        "--lr",
        "1e-30",
        "--min-lr",
        "1e-30",
        "--warmup",
        "0",
        "--ckpt-dir",
        s(ck),
    ])
}

/// [`train`] from the weights file `init` with a learning rate of 1e-30: the checkpoint's
/// parameters are `init`'s values, bit for bit.
fn train_from(root: &Path, model_args: &[&str], init: &Path) {
    let mut args = model_args.to_vec();
    args.extend_from_slice(&["--init-from", s(init), "--lr", "1e-30", "--min-lr", "1e-30"]);
    train(root, &args);
}

/// Trains `model_args` for 2 steps on 2 ranks with a checkpoint at step 2 into `root`.
fn train(root: &Path, model_args: &[&str]) {
    let mut args = vec!["train"];
    args.extend_from_slice(model_args);
    args.extend_from_slice(&[
        "--world-size",
        "2",
        "--steps",
        "2",
        "--micro-batch",
        "1",
        "--seq-len",
        "16",
        "--eval-batches",
        "1",
        "--threads-per-rank",
        "1",
        "--ckpt-every",
        "2",
        "--ckpt-dir",
        s(root),
    ]);
    let (rc, out, err) = fsdp(&args);
    assert_eq!(rc, 0, "train failed:\n{out}\n{err}");
}

/// One `llama-tiny` checkpoint shared by the tests (trained once) and the weights it holds.
fn llama_tiny() -> &'static (tempfile::TempDir, BTreeMap<String, FullTensor>) {
    static DIR: OnceLock<(tempfile::TempDir, BTreeMap<String, FullTensor>)> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        let init = d.path().join("start.safetensors");
        let w = start_weights(&Decoder::from_preset("llama-tiny").unwrap(), &init);
        train_from(&d.path().join("ck"), &["--model", "llama-tiny"], &init);
        (d, w)
    })
}

/// The directory holding the shared `llama-tiny` checkpoint (`ck`).
fn llama_tiny_ckpt() -> &'static Path {
    llama_tiny().0.path()
}

/// The parameters of the shared `llama-tiny` checkpoint, as written before training.
fn llama_tiny_weights() -> &'static BTreeMap<String, FullTensor> {
    &llama_tiny().1
}

/// The checkpoint's consolidated fp32 parameters by name.
fn ckpt_tensors(root: &Path) -> BTreeMap<String, FullTensor> {
    let ck = Checkpoint::open(root, Verify::Checksums).unwrap();
    ck.consolidate(StateKind::Param)
        .unwrap()
        .into_iter()
        .map(|t| (t.name.clone(), t))
        .collect()
}

fn assert_same(found: &FullTensor, want: &FullTensor) {
    assert_eq!(found.shape, want.shape, "{}", want.name);
    let bits = |t: &FullTensor| t.data.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(bits(found) == bits(want), "values of {}", want.name);
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn config(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

#[test]
fn llama_tiny_exports_a_model_directory_with_the_checkpoint_tensors() {
    let (base, start) = (llama_tiny_ckpt(), llama_tiny_weights());
    let ck = base.join("ck");
    let out = base.join("exported");
    let (rc, stdout, err) = fsdp(&["ckpt", "consolidate", s(&ck), "-o", s(&out)]);
    assert_eq!(rc, 0, "{stdout}\n{err}");
    assert!(stdout.contains("39 tensors, 803,968 elements"), "{stdout}");
    assert_eq!(entries(&out), ["config.json", "model.safetensors"]);

    let c = config(&out);
    assert_eq!(c["architectures"], serde_json::json!(["LlamaForCausalLM"]));
    assert_eq!(c["model_type"], "llama");
    for (k, v) in [
        ("vocab_size", 256),
        ("hidden_size", 128),
        ("intermediate_size", 352),
        ("num_hidden_layers", 4),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 2),
        ("max_position_embeddings", 256),
    ] {
        assert_eq!(c[k], v, "{k}");
    }
    assert_eq!(c["rms_norm_eps"], 1e-5);
    assert_eq!(c["rope_theta"], 10000.0);
    assert_eq!(c["hidden_act"], "silu");
    assert_eq!(c["tie_word_embeddings"], false);
    assert_eq!(c["torch_dtype"], "float32");

    // The run recorded the preset's config.json in the manifest.
    let manifest = Checkpoint::open(&ck, Verify::Checksums).unwrap();
    let recorded: serde_json::Value =
        serde_json::from_str(&manifest.manifest().train.extra["hf_config"]).unwrap();
    assert_eq!(recorded["num_key_value_heads"], 2);
    assert_eq!(recorded["model_type"], "llama");

    let want = start;
    let found = read_full(&out.join("model.safetensors")).unwrap().tensors;
    assert_eq!(
        found.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    assert_eq!(found.len(), 39);
    for name in [
        "model.embed_tokens.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ] {
        assert!(found.contains_key(name), "{name}");
    }
    assert_eq!(
        found["model.layers.0.self_attn.k_proj.weight"].shape,
        [64, 128]
    );
    assert_eq!(
        found["model.layers.0.mlp.down_proj.weight"].shape,
        [128, 352]
    );
    for (name, w) in want {
        assert_same(&found[name], w);
    }

    // A path ending in .safetensors still writes one state-dict file, with the same tensors.
    let file = base.join("state.safetensors");
    let (rc, stdout, err) = fsdp(&["ckpt", "consolidate", s(&ck), "-o", s(&file)]);
    assert_eq!(rc, 0, "{stdout}\n{err}");
    assert!(err.contains("-o DIR"), "{err}");
    let single = read_full(&file).unwrap().tensors;
    assert_eq!(single.len(), want.len());
    for (name, w) in want {
        assert_same(&single[name], w);
    }
}

#[test]
fn sharded_export_puts_every_tensor_in_exactly_one_file() {
    let (base, start) = (llama_tiny_ckpt(), llama_tiny_weights());
    let ck = base.join("ck");
    let out = base.join("sharded");
    let limit = 400_000u64;
    let (rc, stdout, err) = fsdp(&[
        "ckpt",
        "consolidate",
        s(&ck),
        "-o",
        s(&out),
        "--max-shard-size",
        "400KB",
    ]);
    assert_eq!(rc, 0, "{stdout}\n{err}");
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let want = start;
    let total: u64 = want.values().map(|t| t.data.len() as u64 * 4).sum();
    assert_eq!(total, 803_968 * 4);
    assert_eq!(index["metadata"]["total_size"], total);
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(
        map.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );

    let files: Vec<String> = entries(&out)
        .into_iter()
        .filter(|f| f.starts_with("model-"))
        .collect();
    let n = files.len();
    assert!(n >= 8, "{files:?}");
    let names: Vec<String> = (1..=n)
        .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
        .collect();
    assert_eq!(files, names);
    assert_eq!(entries(&out).len(), n + 2, "config.json and the index");
    assert!(!out.join("model.safetensors").exists());

    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    for f in &files {
        let held = read_full(&out.join(f)).unwrap().tensors;
        let bytes: u64 = held.values().map(|t| t.data.len() as u64 * 4).sum();
        assert!(bytes <= limit || held.len() == 1, "{f}: {bytes} bytes");
        for (name, t) in held {
            assert_eq!(map[&name], f.as_str(), "{name}");
            assert_same(&t, &want[&name]);
            assert!(
                seen.insert(name.clone(), f.clone()).is_none(),
                "{name} twice"
            );
        }
    }
    assert_eq!(seen.len(), want.len());
    // The files' tensor bytes add up to the index's total_size.
    let sizes: Vec<u64> = files
        .iter()
        .map(|f| {
            read_full(&out.join(f))
                .unwrap()
                .tensors
                .values()
                .map(|t| t.data.len() as u64 * 4)
                .sum()
        })
        .collect();
    assert_eq!(sizes.iter().sum::<u64>(), total);
    let config = config(&out);
    assert_eq!(config["model_type"], "llama");
}

#[test]
fn outputs_that_cannot_be_written_are_refused() {
    let base = llama_tiny_ckpt();
    let ck = base.join("ck");
    let run = |extra: &[&str]| {
        let mut a = vec!["ckpt", "consolidate", s(&ck)];
        a.extend_from_slice(extra);
        fsdp(&a)
    };
    let full = base.join("occupied");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("keep.txt"), "mine").unwrap();
    let (rc, _, err) = run(&["-o", s(&full)]);
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.contains("not empty") && err.contains("occupied"),
        "{err}"
    );
    assert_eq!(entries(&full), ["keep.txt"]);

    let file = base.join("plainfile");
    std::fs::write(&file, "x").unwrap();
    let (rc, _, err) = run(&["-o", s(&file)]);
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.contains("is a file") && err.contains(".safetensors"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "x");

    let (rc, _, err) = run(&[
        "-o",
        s(&base.join("a.safetensors")),
        "--max-shard-size",
        "1GB",
    ]);
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("--max-shard-size"), "{err}");

    for bad in ["5XB", "0"] {
        let (rc, _, err) = run(&["-o", s(&base.join("never")), "--max-shard-size", bad]);
        assert_eq!(rc, 2, "{err}");
        assert!(err.contains("--max-shard-size"), "{err}");
    }
    let (rc, _, err) = run(&["-o", s(&base.join("missing/deeper"))]);
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("does not exist"), "{err}");

    // A config of another model is refused, naming the file.
    let other = base.join("other.json");
    std::fs::write(
        &other,
        r#"{"model_type": "llama", "vocab_size": 256, "hidden_size": 128,
            "intermediate_size": 352, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 256}"#,
    )
    .unwrap();
    let (rc, _, err) = run(&["-o", s(&base.join("never")), "--hf-config", s(&other)]);
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.contains("other.json") && err.contains("3 layers"),
        "{err}"
    );
    assert!(!base.join("never").exists());
}

/// A run from `--hf-config` records that file: the export keeps its family (Qwen2, tied head:
/// no `lm_head.weight`) with `torch_dtype` float32; without the record, `--hf-config` is asked
/// for by name.
#[test]
fn hf_config_run_exports_its_own_config() {
    let d = tempfile::tempdir().unwrap();
    let cfg_path: PathBuf = d.path().join("config.json");
    std::fs::write(
        &cfg_path,
        r#"{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256,
            "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": true,
            "use_sliding_window": false, "torch_dtype": "bfloat16", "bos_token_id": 1}"#,
    )
    .unwrap();
    let ck = d.path().join("ck");
    let init = d.path().join("start.safetensors");
    let want = start_weights(&Decoder::from_hf_config(&cfg_path).unwrap(), &init);
    train_from(&ck, &["--hf-config", s(&cfg_path)], &init);
    let out = d.path().join("out");
    let (rc, stdout, err) = fsdp(&["ckpt", "consolidate", s(&ck), "-o", s(&out)]);
    assert_eq!(rc, 0, "{stdout}\n{err}");
    assert!(stdout.contains("`lm_head.weight` is tied"), "{stdout}");
    let c = config(&out);
    assert_eq!(c["model_type"], "qwen2");
    assert_eq!(c["tie_word_embeddings"], true);
    assert_eq!(c["torch_dtype"], "float32");
    assert_eq!(c["bos_token_id"], 1);
    let found = read_full(&out.join("model.safetensors")).unwrap().tensors;
    assert!(!found.contains_key("lm_head.weight"));
    assert_eq!(found["model.layers.1.self_attn.q_proj.bias"].shape, [32]);
    assert_eq!(found.len(), want.len());
    for (name, w) in &want {
        assert_same(&found[name], w);
    }

    // A --hf-config with the same shapes but other math than the recorded one is refused.
    let other = d.path().join("other.json");
    let text = std::fs::read_to_string(&cfg_path)
        .unwrap()
        .replace("1000000.0", "1234.0");
    std::fs::write(&other, text).unwrap();
    let (rc, _, err) = fsdp(&[
        "ckpt",
        "consolidate",
        s(&ck),
        "-o",
        s(&d.path().join("o2")),
        "--hf-config",
        s(&other),
    ]);
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.contains("rope_theta 1234") && err.contains("rope_theta 1000000"),
        "{err}"
    );

    // A checkpoint without the recorded config (an older build) needs --hf-config.
    let step = Checkpoint::open(&ck, Verify::Checksums)
        .unwrap()
        .dir()
        .to_path_buf();
    let mpath = step.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
    m["train"]["extra"]
        .as_object_mut()
        .unwrap()
        .remove("hf_config")
        .expect("the run recorded its config.json");
    std::fs::write(&mpath, serde_json::to_string_pretty(&m).unwrap()).unwrap();
    let again = d.path().join("again");
    let (rc, _, err) = fsdp(&["ckpt", "consolidate", s(&ck), "-o", s(&again)]);
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.contains("--hf-config") && err.contains("manifest.json"),
        "{err}"
    );
    let (rc, stdout, err) = fsdp(&[
        "ckpt",
        "consolidate",
        s(&ck),
        "-o",
        s(&again),
        "--hf-config",
        s(&cfg_path),
    ]);
    assert_eq!(rc, 0, "{stdout}\n{err}");
    assert_eq!(config(&again)["model_type"], "qwen2");
}

/// A GPT-2 checkpoint exports as a model directory too (`GPT2LMHeadModel`'s config and
/// names), and that directory is a valid `--init-from`: a run started
/// from it with a negligible learning rate saves exactly the exported weights.
#[test]
fn gpt2_exports_a_model_directory_that_init_from_reads_back() {
    let t = tempfile::tempdir().unwrap();
    let ck = t.path().join("ck");
    let init = t.path().join("start.safetensors");
    let want = start_weights(&Decoder::from_preset("tiny").unwrap(), &init);
    train_from(&ck, &["--model", "tiny"], &init);
    let out = t.path().join("gpt2-out");
    let (rc, stdout, err) = fsdp(&["ckpt", "consolidate", s(&ck), "-o", s(&out)]);
    assert_eq!(rc, 0, "{stdout}\n{err}");
    assert_eq!(entries(&out), ["config.json", "model.safetensors"]);
    let c = config(&out);
    assert_eq!(c["model_type"], "gpt2");
    assert_eq!(c["architectures"][0], "GPT2LMHeadModel");
    assert_eq!(c["activation_function"], "gelu_new");
    // `tiny` has an untied head.
    assert_eq!(c["tie_word_embeddings"], false);
    let ck_arch = Checkpoint::open(&ck, Verify::Checksums)
        .unwrap()
        .manifest()
        .spec
        .arch;
    let text = std::fs::read_to_string(out.join("config.json")).unwrap();
    assert_eq!(
        fsdp_planner::hf::parse_hf_arch(&text, "config.json").unwrap(),
        ck_arch
    );
    let found = read_full(&out.join("model.safetensors")).unwrap().tensors;
    assert_eq!(found.len(), want.len());
    for (name, f) in &found {
        assert!(
            name.starts_with("transformer.") || name == "lm_head.weight",
            "{name}"
        );
        assert_same(f, &want[name]);
    }
    // Read back: the directory's config.json is the model, the weights its start.
    let (rc, o, err) = one_step_from(&out, &t.path().join("again"));
    assert_eq!(rc, 0, "{o}\n{err}");
    let again = ckpt_tensors(&t.path().join("again"));
    for (name, f) in &found {
        assert_same(f, &again[name]);
    }
    // A GPT-2 config this engine does not compute is refused, by plan and train alike.
    let bad = t.path().join("bad");
    std::fs::create_dir(&bad).unwrap();
    let mut v = c.clone();
    v["activation_function"] = "relu".into();
    std::fs::write(bad.join("config.json"), v.to_string()).unwrap();
    for cmd in [
        vec![
            "plan",
            "--hf-config",
            s(&bad.join("config.json")),
            "--world-size",
            "2",
        ],
        vec![
            "train",
            "--hf-config",
            s(&bad.join("config.json")),
            "--steps",
            "1",
        ],
    ] {
        let (rc, _, err) = fsdp(&cmd);
        assert_eq!(rc, 2, "{cmd:?}: {err}");
        assert!(
            err.contains("activation_function") && err.contains("relu"),
            "{err}"
        );
    }
}

/// The bytes of every file directly in `dir`, by name.
fn files_of(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

/// A small Mistral model directory as a Hub download holds it: `config.json` (with bos/eos
/// ids), `model.safetensors` (an export of a 1-step run of that config) and the tokenizer and
/// generation files, each with contents no export could produce by itself (the comparisons
/// below are against these bytes).
fn mistral_model_dir(base: &Path) -> PathBuf {
    let cfg_dir = base.join("cfg");
    std::fs::create_dir(&cfg_dir).unwrap();
    let cfg = cfg_dir.join("config.json");
    std::fs::write(
        &cfg,
        r#"{"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 260,
            "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 64,
            "tie_word_embeddings": false, "bos_token_id": 256, "eos_token_id": 257}"#,
    )
    .unwrap();
    let ck = base.join("seed-ck");
    train(&ck, &["--hf-config", s(&cfg)]);
    let dir = base.join("mistral");
    let (rc, out, err) = fsdp(&["ckpt", "consolidate", s(&ck), "-o", s(&dir)]);
    assert_eq!(rc, 0, "{out}\n{err}");
    // The published files replace whatever the export derived.
    let tokenizer_model: Vec<u8> = (0..=255u8).rev().chain([0, 0, 7]).collect();
    for (name, bytes) in [
        (
            "tokenizer.json",
            "{\"version\":\"1.0\",\"model\":{\"type\":\"BPE\",\"vocab\":{\"é\":3}},\"note\":\"no trailing newline\"}"
                .as_bytes()
                .to_vec(),
        ),
        (
            "tokenizer_config.json",
            b"{\n  \"bos_token\": \"<s>\",\n  \"eos_token\": \"</s>\"\n}\n".to_vec(),
        ),
        (
            "special_tokens_map.json",
            b"{\"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}\r\n".to_vec(),
        ),
        ("tokenizer.model", tokenizer_model),
        (
            "generation_config.json",
            b"{\"bos_token_id\": 256, \"eos_token_id\": [257, 258], \"max_new_tokens\": 7}"
                .to_vec(),
        ),
    ] {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    dir
}

/// `fsdp train --init-from DIR` carries the directory's tokenizer and generation files in every
/// checkpoint (listed in the manifest), through a reshard and a resume, and `fsdp ckpt
/// consolidate` writes them byte for byte beside `config.json`, which keeps the source's
/// bos/eos ids.
#[test]
fn init_from_a_model_directory_exports_its_tokenizer_files_byte_for_byte() {
    let t = tempfile::tempdir().unwrap();
    let src = mistral_model_dir(t.path());
    let published = files_of(&src);
    let carried = [
        "generation_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
    ];
    let ck = t.path().join("ck");
    // The fixture's tokenizer.json is not a working tokenizer, so the training data is the
    // built-in bytes: that needs the override.
    train(&ck, &["--init-from", s(&src), "--allow-tokenizer-mismatch"]);
    let step = Checkpoint::open(&ck, Verify::Checksums).unwrap();
    let listed: Vec<&str> = step.model_files().iter().map(|r| r.file.as_str()).collect();
    assert_eq!(listed, carried);
    for name in carried {
        assert_eq!(
            std::fs::read(step.dir().join("model-files").join(name)).unwrap(),
            published[name],
            "{name} in the checkpoint"
        );
    }

    let check_export = |ck: &Path, out: &Path| {
        let (rc, stdout, err) = fsdp(&["ckpt", "consolidate", s(ck), "-o", s(out)]);
        assert_eq!(rc, 0, "{stdout}\n{err}");
        assert!(
            stdout.contains(
                "tokenizer: special_tokens_map.json, tokenizer.json, tokenizer.model, \
                 tokenizer_config.json (copied"
            ),
            "{stdout}"
        );
        let exported = files_of(out);
        for name in carried {
            assert_eq!(
                exported[name],
                published[name],
                "{name} in {}",
                out.display()
            );
        }
        let c = config(out);
        assert_eq!(c["bos_token_id"], 256);
        assert_eq!(c["eos_token_id"], 257);
        assert_eq!(c["model_type"], "mistral");
    };
    check_export(&ck, &t.path().join("out"));

    // Resharded to 3 ranks: the files travel with the checkpoint.
    let ck3 = t.path().join("ck3");
    let (rc, stdout, err) = fsdp(&[
        "ckpt",
        "reshard",
        s(&ck),
        "--world-size",
        "3",
        "-o",
        s(&ck3),
    ]);
    assert_eq!(rc, 0, "{stdout}\n{err}");
    check_export(&ck3, &t.path().join("out3"));

    // A resumed run (its model from the config.json alone) keeps carrying them.
    // `fsdp train --resume` of the directory's model (its config.json alone) into `root` up to
    // `steps`, then `extra`.
    let resume = |root: &Path, steps: &str, extra: &[&str]| {
        let cfg = src.join("config.json");
        let mut a = vec![
            "train",
            "--hf-config",
            s(&cfg),
            "--world-size",
            "2",
            "--steps",
            steps,
            "--micro-batch",
            "1",
            "--seq-len",
            "16",
            "--eval-batches",
            "1",
            "--threads-per-rank",
            "1",
            "--ckpt-every",
            "2",
            "--ckpt-dir",
            s(root),
            "--resume",
        ];
        a.extend_from_slice(extra);
        fsdp(&a)
    };
    let (rc, o, err) = resume(&ck, "3", &[]);
    assert_eq!(rc, 0, "{o}\n{err}");
    let resumed = Checkpoint::open(&ck, Verify::Checksums).unwrap();
    assert_eq!(resumed.manifest().train.step, 3);
    check_export(&ck, &t.path().join("out-resumed"));

    // Resumed (in a copy of the checkpoints) on tokens of another tokenizer: the carried files
    // are not that tokenizer's, so none is carried on, with a note, and the export holds no
    // tokenizer.
    let ck_other = t.path().join("ck-other");
    let cp = std::process::Command::new("cp")
        .args(["-r", s(&ck), s(&ck_other)])
        .status()
        .unwrap();
    assert!(cp.success());
    let other = t.path().join("other.bin");
    let mut w = fsdp::data::tokens::TokenWriter::create(&other, 260, [0x12; 32]).unwrap();
    w.push(&(0..4000u32).map(|i| i * 7 % 250).collect::<Vec<_>>())
        .unwrap();
    w.finish().unwrap();
    let (rc, o, err) = resume(
        &ck_other,
        "4",
        &["--data", s(&other), "--allow-tokenizer-mismatch"],
    );
    assert_eq!(rc, 0, "{o}\n{err}");
    assert!(err.contains("tokenizer files are not carried"), "{err}");
    let step4 = Checkpoint::open(&ck_other, Verify::Checksums).unwrap();
    assert_eq!(step4.manifest().train.step, 4);
    assert!(step4.model_files().is_empty());
    let out = t.path().join("out-other");
    let (rc, stdout, err) = fsdp(&["ckpt", "consolidate", s(&ck_other), "-o", s(&out)]);
    assert_eq!(rc, 0, "{stdout}\n{err}");
    assert!(!out.join("tokenizer.json").exists(), "{stdout}");

    // A damaged carried file is refused by name, and nothing is exported.
    let victim = resumed.dir().join("model-files").join("tokenizer.json");
    let mut bytes = std::fs::read(&victim).unwrap();
    bytes[0] ^= 1;
    std::fs::write(&victim, bytes).unwrap();
    let bad = t.path().join("out-bad");
    let (rc, _, err) = fsdp(&["ckpt", "consolidate", s(&ck), "-o", s(&bad)]);
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.contains("tokenizer.json") && err.contains("SHA-256"),
        "{err}"
    );
    assert!(!bad.exists());
}

/// Every exported config states its special tokens: a GPT-2 vocabulary (50257) without ids in
/// its config gets GPT-2's `<|endoftext|>` = 50256 for both and a `generation_config.json`
/// holding them; a byte vocabulary gets `null` and the summary says that no tokenizer exists.
#[test]
fn exported_configs_state_bos_and_eos() {
    let t = tempfile::tempdir().unwrap();
    let cfg = t.path().join("gpt2-vocab.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "gpt2", "vocab_size": 50257, "n_positions": 64, "n_embd": 16,
            "n_layer": 1, "n_head": 2, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    let ck = t.path().join("ck");
    train(&ck, &["--hf-config", s(&cfg)]);
    let out = t.path().join("out");
    let (rc, stdout, err) = fsdp(&["ckpt", "consolidate", s(&ck), "-o", s(&out)]);
    assert_eq!(rc, 0, "{stdout}\n{err}");
    let c = config(&out);
    assert_eq!(c["bos_token_id"], 50256);
    assert_eq!(c["eos_token_id"], 50256);
    let g: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("generation_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        g,
        serde_json::json!({"bos_token_id": 50256, "eos_token_id": 50256})
    );
    assert!(stdout.contains("tokenizer: none written"), "{stdout}");

    // The byte-level llama-tiny preset: no token is reserved, none is invented.
    let base = llama_tiny_ckpt();
    let out = t.path().join("bytes");
    let (rc, stdout, err) = fsdp(&["ckpt", "consolidate", s(&base.join("ck")), "-o", s(&out)]);
    assert_eq!(rc, 0, "{stdout}\n{err}");
    let c = config(&out);
    assert!(
        c["bos_token_id"].is_null() && c["eos_token_id"].is_null(),
        "{c}"
    );
    assert!(c.as_object().unwrap().contains_key("eos_token_id"));
    assert_eq!(entries(&out), ["config.json", "model.safetensors"]);
    assert!(
        stdout.contains("tokenizer: none written") && stdout.contains("bytes of"),
        "{stdout}"
    );
}

/// `tie_word_embeddings: true` with a stored `lm_head.weight` equal to the embedding trains
/// tied; with one that differs the run is refused (exit 2) naming both tensors and the fix,
/// and after that fix (`false`) the run trains the file's own head.
#[test]
fn a_tied_config_with_a_different_stored_head_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let cfg_text = |tie: bool| {
        format!(
            r#"{{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256,
            "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": {tie},
            "use_sliding_window": false}}"#
        )
    };
    // An untied model's export: its head and embedding are two different random tensors.
    let cfg = t.path().join("untied.json");
    std::fs::write(&cfg, cfg_text(false)).unwrap();
    let ck = t.path().join("seed-ck");
    train(&ck, &["--hf-config", s(&cfg)]);
    let dir = t.path().join("qwen");
    let (rc, out, err) = fsdp(&["ckpt", "consolidate", s(&ck), "-o", s(&dir)]);
    assert_eq!(rc, 0, "{out}\n{err}");
    let stored = read_full(&dir.join("model.safetensors")).unwrap().tensors;
    let (head, embed) = (
        &stored["lm_head.weight"],
        &stored["model.embed_tokens.weight"],
    );
    assert_ne!(head.data, embed.data);
    std::fs::write(dir.join("config.json"), cfg_text(true)).unwrap();

    let run = |ck: &Path| one_step_from(&dir, ck);
    let (rc, o, err) = run(&t.path().join("refused"));
    assert_eq!(rc, 2, "{o}\n{err}");
    assert!(
        err.contains("`lm_head.weight` differs from `model.embed_tokens.weight`")
            && err.contains("\"tie_word_embeddings\": false")
            && err.contains("config.json"),
        "{err}"
    );
    assert!(!t.path().join("refused").join("latest").exists());

    // The fix the message names: untied, the run starts from the file's own head.
    std::fs::write(dir.join("config.json"), cfg_text(false)).unwrap();
    let untied = t.path().join("untied-ck");
    let (rc, o, err) = run(&untied);
    assert_eq!(rc, 0, "{o}\n{err}");
    let got = ckpt_tensors(&untied);
    assert_same(&got["lm_head.weight"], head);
    assert_same(&got["model.embed_tokens.weight"], embed);

    // A stored head equal to the embedding: tied, as before.
    std::fs::write(dir.join("config.json"), cfg_text(true)).unwrap();
    let mut same: Vec<FullTensor> = stored.values().cloned().collect();
    for x in &mut same {
        if x.name == "lm_head.weight" {
            x.data = embed.data.clone();
        }
    }
    fsdp_checkpoints::write_full(&dir.join("model.safetensors"), &same, &[]).unwrap();
    let tied = t.path().join("tied-ck");
    let (rc, o, err) = run(&tied);
    assert_eq!(rc, 0, "{o}\n{err}");
    let got = ckpt_tensors(&tied);
    assert!(!got.contains_key("lm_head.weight"));
    assert_same(&got["model.embed_tokens.weight"], embed);
}

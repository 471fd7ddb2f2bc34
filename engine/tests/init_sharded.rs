//! Initial weights built shard by shard: the seeded random initialisation and a load of
//! published weights (Hugging Face names, f32/bf16/f16 stored, one file or a sharded index)
//! give, at world sizes 1..4 under every strategy, exactly the model that holding the whole
//! model and sharding it gives; bad weight files are refused naming the tensor and the file.

use fsdp::init::{FileWeights, ParamSource};
use fsdp::model::decoder::Decoder;
use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::{EngineConfig, InitSync, Placement, RankEngine, StagedModel};
use fsdp::EngineError;
use fsdp_checkpoints::WeightFiles;
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{plan, PlanConfig, Strategy};
use safetensors::{Dtype, View};
use std::borrow::Cow;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn ecfg(sync: InitSync) -> EngineConfig {
    EngineConfig {
        optimizer: Optimizer::AdamW(AdamWConfig::default()),
        clip: None,
        init_sync: sync,
        enforce_memory_plan: true,
        nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    }
}

/// Every rank's full parameters after building the engine from `source`.
fn start_from(
    model: &Decoder,
    w: usize,
    strategy: Strategy,
    sync: InitSync,
    source: &dyn ParamSource,
) -> Result<Vec<Vec<Vec<Vec<f32>>>>, String> {
    let mut cfg = PlanConfig::new(w as u64);
    cfg.strategy = strategy;
    cfg.micro_batch = 1;
    cfg.seq_len = 16;
    let plan = plan(model.spec(), &cfg).unwrap();
    let s = plan.shard_size as usize;
    let res = run_threads(
        Topology::new(s, w / s).unwrap(),
        Duration::from_secs(60),
        |comm| -> Result<Vec<Vec<Vec<f32>>>, EngineError> {
            let mut e =
                RankEngine::new_from(model, &plan, &comm, ecfg(sync), source, Placement::Host)?;
            e.full_params()
        },
    );
    let mut out = Vec::new();
    for r in res {
        out.push(r.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?);
    }
    Ok(out)
}

fn topologies() -> Vec<(usize, Strategy)> {
    let mut v = Vec::new();
    for w in 1..=4 {
        v.push((w, Strategy::FullShard));
        v.push((w, Strategy::ShardGradOp));
        v.push((w, Strategy::NoShard));
    }
    v.push((4, Strategy::Hybrid { shard_size: 2 }));
    v
}

fn bits(v: &[Vec<Vec<f32>>]) -> Vec<Vec<Vec<u32>>> {
    v.iter()
        .map(|u| {
            u.iter()
                .map(|t| t.iter().map(|x| x.to_bits()).collect())
                .collect()
        })
        .collect()
}

#[test]
fn random_init_is_the_same_model_at_every_world_size() {
    for preset in ["tiny", "llama-tiny"] {
        let model = Decoder::from_preset(preset).unwrap();
        let whole = StagedModel::init_params(&model, 42);
        // The values follow the model's rules: a real spread, norm gains 1.
        let first = &whole[0][0];
        let std =
            (first.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / first.len() as f64).sqrt();
        assert!((std - 0.02).abs() < 0.002, "{preset}: std {std}");
        let source = model.random_init(42);
        for (w, strategy) in topologies() {
            for sync in [InitSync::Verify, InitSync::BroadcastFromRank0] {
                let ranks = start_from(&model, w, strategy, sync, &source).unwrap();
                for (r, p) in ranks.iter().enumerate() {
                    assert!(
                        bits(p) == bits(&whole),
                        "{preset} W={w} {strategy} {sync:?} rank {r}: differs from the whole model"
                    );
                }
            }
        }
        let other = StagedModel::init_params(&model, 43);
        assert_ne!(bits(&other), bits(&whole), "{preset}: the seed matters");
    }
}

/// Raw little-endian bytes of `v` in `dtype`.
fn encode(v: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::BF16 => v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect(),
        Dtype::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect(),
        _ => unreachable!(),
    }
}

/// The value `x` becomes when stored in `dtype` and read back as f32.
fn round_trip(x: f32, dtype: Dtype) -> f32 {
    match dtype {
        Dtype::F32 => x,
        Dtype::BF16 => half::bf16::from_f32(x).to_f32(),
        Dtype::F16 => half::f16::from_f32(x).to_f32(),
        _ => unreachable!(),
    }
}

struct Raw {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &Raw {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// `(name, tensor)` pairs of `model`'s non-tied parameters holding `values`, named as
/// published (`strip` drops GPT-2's `transformer.` prefix).
fn published(
    model: &Decoder,
    values: &[Vec<Vec<f32>>],
    dtype: Dtype,
    strip: bool,
) -> Vec<(String, Raw)> {
    let mut out = Vec::new();
    for (us, v) in model.spec().units.iter().zip(values) {
        for (p, t) in us.params.iter().filter(|p| p.tied_to.is_none()).zip(v) {
            let name = if strip {
                p.name.strip_prefix("transformer.").unwrap_or(&p.name)
            } else {
                &p.name
            };
            out.push((
                name.to_string(),
                Raw {
                    dtype,
                    shape: p.shape.iter().map(|&d| d as usize).collect(),
                    data: encode(t, dtype),
                },
            ));
        }
    }
    out
}

fn write(path: &Path, tensors: &[(String, Raw)]) {
    let refs: Vec<(&str, &Raw)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    safetensors::serialize_to_file(refs, None, path).unwrap();
}

/// Writes `tensors` as `model-0000k-of-00003.safetensors` files and their index in `dir`.
fn write_sharded(dir: &Path, tensors: Vec<(String, Raw)>) {
    let n = tensors.len();
    let mut map = serde_json::Map::new();
    let mut parts: Vec<Vec<(String, Raw)>> = vec![Vec::new(), Vec::new(), Vec::new()];
    for (i, t) in tensors.into_iter().enumerate() {
        parts[i * 3 / n].push(t);
    }
    for (k, part) in parts.iter().enumerate() {
        let f = format!("model-{:05}-of-00003.safetensors", k + 1);
        for (name, _) in part {
            map.insert(name.clone(), f.clone().into());
        }
        write(&dir.join(&f), part);
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index).unwrap(),
    )
    .unwrap();
}

#[test]
fn loading_published_weights_gives_the_shards_of_the_whole_model() {
    let tmp = tempfile::tempdir().unwrap();
    for (preset, strip) in [("tiny", true), ("tiny", false), ("llama-tiny", false)] {
        let model = Decoder::from_preset(preset).unwrap();
        let values = StagedModel::init_params(&model, 7);
        for dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
            let expect: Vec<Vec<Vec<f32>>> = values
                .iter()
                .map(|u| {
                    u.iter()
                        .map(|t| t.iter().map(|x| round_trip(*x, dtype)).collect())
                        .collect()
                })
                .collect();
            let mut tensors = published(&model, &values, dtype, strip);
            if preset == "tiny" {
                // GPT-2 checkpoints carry causal-mask buffers, which are not parameters.
                tensors.push((
                    format!("{}h.0.attn.bias", if strip { "" } else { "transformer." }),
                    Raw {
                        dtype: Dtype::F32,
                        shape: vec![1, 1, 4, 4],
                        data: vec![0; 64],
                    },
                ));
            }
            let sharded = dtype == Dtype::BF16;
            let dir = tmp.path().join(format!("{preset}-{strip}-{dtype:?}"));
            std::fs::create_dir(&dir).unwrap();
            if sharded {
                write_sharded(&dir, tensors);
            } else {
                write(&dir.join("model.safetensors"), &tensors);
            }
            let source = FileWeights::open(&dir, model.spec()).unwrap();
            assert_eq!(source.files().files().len(), if sharded { 3 } else { 1 });
            for (w, strategy) in topologies() {
                let ranks = start_from(&model, w, strategy, InitSync::Verify, &source).unwrap();
                for (r, p) in ranks.iter().enumerate() {
                    assert!(
                        bits(p) == bits(&expect),
                        "{preset} {dtype:?} W={w} {strategy} rank {r}: differs from the file"
                    );
                }
            }
        }
    }
}

/// A Llama whose embedding and head (8200 x 192 = 1,574,400 elements each) are larger than
/// the loader's read buffer (1 MiB: 262,144 f32 or 524,288 bf16 elements), also in one rank's
/// third: a load reads them in several positioned chunks with a short last one.
const WIDE_LLAMA: &str = r#"{"model_type": "llama", "vocab_size": 8200, "hidden_size": 192,
  "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
  "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0, "tie_word_embeddings": false}"#;

#[test]
fn tensors_larger_than_the_read_buffer_load_bitwise_across_chunks() {
    let model = Decoder::from_hf_config_text(WIDE_LLAMA, "config.json", "wide").unwrap();
    let chunk_elems = |bytes_per_elem: u64| fsdp_checkpoints::LOAD_CHUNK_BYTES / bytes_per_elem;
    let largest = model
        .spec()
        .units
        .iter()
        .flat_map(|u| &u.params)
        .map(|p| p.shape.iter().product::<u64>())
        .max()
        .unwrap();
    assert_eq!(largest, 8200 * 192);
    // At W=3 one rank's third of the largest tensor still crosses a chunk in both dtypes, and
    // no count is a whole number of chunks.
    for es in [4, 2] {
        let c = chunk_elems(es);
        assert!(largest / 3 > c && largest % c != 0 && (largest / 3) % c != 0);
    }
    let values = StagedModel::init_params(&model, 11);
    let tmp = tempfile::tempdir().unwrap();
    for dtype in [Dtype::F32, Dtype::BF16] {
        let expect: Vec<Vec<Vec<f32>>> = values
            .iter()
            .map(|u| {
                u.iter()
                    .map(|t| t.iter().map(|x| round_trip(*x, dtype)).collect())
                    .collect()
            })
            .collect();
        let dir = tmp.path().join(format!("{dtype:?}"));
        std::fs::create_dir(&dir).unwrap();
        write(
            &dir.join("model.safetensors"),
            &published(&model, &values, dtype, false),
        );
        let source = FileWeights::open(&dir, model.spec()).unwrap();
        for (w, strategy) in [
            (1, Strategy::FullShard),
            (3, Strategy::FullShard),
            (3, Strategy::NoShard),
        ] {
            let ranks = start_from(&model, w, strategy, InitSync::Verify, &source).unwrap();
            for (r, p) in ranks.iter().enumerate() {
                assert!(
                    bits(p) == bits(&expect),
                    "{dtype:?} W={w} {strategy} rank {r}: differs from the file"
                );
            }
        }
    }
}

fn tiny_files(dir: &Path) -> (Decoder, Vec<(String, Raw)>) {
    std::fs::create_dir_all(dir).unwrap();
    let model = Decoder::from_preset("llama-tiny").unwrap();
    let values = StagedModel::init_params(&model, 7);
    let t = published(&model, &values, Dtype::F32, false);
    (model, t)
}

fn open_err(path: &Path, model: &Decoder) -> String {
    FileWeights::open(path, model.spec())
        .unwrap_err()
        .to_string()
}

#[test]
fn bad_weight_files_are_refused_naming_the_tensor_and_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("m");
    let (model, tensors) = tiny_files(&d);
    let f = d.join("model.safetensors");

    // Missing tensor.
    let mut t: Vec<_> = tensors.iter().map(|(n, r)| (n.clone(), clone(r))).collect();
    let gone = t.remove(3).0;
    write(&f, &t);
    let e = open_err(&d, &model);
    assert!(e.contains(&format!("missing parameter `{gone}`")), "{e}");
    assert!(e.contains("model.safetensors"), "{e}");

    // Unexpected tensor.
    let mut t: Vec<_> = tensors.iter().map(|(n, r)| (n.clone(), clone(r))).collect();
    t.push((
        "model.layers.9.mlp.up_proj.weight".into(),
        Raw {
            dtype: Dtype::F32,
            shape: vec![1],
            data: vec![0; 4],
        },
    ));
    write(&f, &t);
    let e = open_err(&d, &model);
    assert!(
        e.contains("unexpected tensor `model.layers.9.mlp.up_proj.weight`")
            && e.contains("model.safetensors"),
        "{e}"
    );

    // Mis-shaped tensor (weights of another configuration).
    let mut t: Vec<_> = tensors.iter().map(|(n, r)| (n.clone(), clone(r))).collect();
    let (name, raw) = &mut t[0];
    raw.shape[0] -= 1;
    raw.data.truncate(raw.shape.iter().product::<usize>() * 4);
    let name = name.clone();
    write(&f, &t);
    let e = open_err(&d, &model);
    assert!(e.contains(&format!("tensor `{name}` has shape")), "{e}");

    // Truncated file.
    write(&f, &tensors);
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let e = open_err(&d, &model);
    assert!(
        e.contains("the file is truncated") && e.contains("model.safetensors"),
        "{e}"
    );

    // An unsupported dtype.
    let mut t: Vec<_> = tensors.iter().map(|(n, r)| (n.clone(), clone(r))).collect();
    t[1].1.dtype = Dtype::I32;
    write(&f, &t);
    let e = open_err(&d, &model);
    assert!(e.contains("has dtype I32") && e.contains(&t[1].0), "{e}");

    // An index naming a file that is not there.
    std::fs::remove_file(&f).unwrap();
    write_sharded(
        &d,
        tensors.iter().map(|(n, r)| (n.clone(), clone(r))).collect(),
    );
    std::fs::remove_file(d.join("model-00002-of-00003.safetensors")).unwrap();
    let e = open_err(&d, &model);
    assert!(
        e.contains("model.safetensors.index.json")
            && e.contains("model-00002-of-00003.safetensors")
            && e.contains("incomplete"),
        "{e}"
    );

    // Two tensors sharing bytes: the header is edited so the second starts inside the first.
    write(&f, &tensors[..2]);
    let bytes = std::fs::read(&f).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let second = &tensors[1].0;
    let len = header[second]["data_offsets"][1].as_u64().unwrap()
        - header[second]["data_offsets"][0].as_u64().unwrap();
    header[second]["data_offsets"] = serde_json::json!([0, len]);
    let first = &tensors[0].0;
    let flen = header[first]["data_offsets"][1].as_u64().unwrap()
        - header[first]["data_offsets"][0].as_u64().unwrap();
    header[first]["data_offsets"] = serde_json::json!([0, flen]);
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(&h);
    out.extend(&bytes[8 + n..]);
    std::fs::write(&f, out).unwrap();
    let e = WeightFiles::open(&f).unwrap_err().to_string();
    assert!(e.contains("overlap"), "{e}");
    std::fs::remove_file(&f).unwrap();

    // A FIFO (it would block forever), a path that does not exist, a sharded checkpoint.
    let fifo = tmp.path().join("fifo.safetensors");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let e = open_err(&fifo, &model);
    assert!(e.contains("not a regular file"), "{e}");
    let e = open_err(&tmp.path().join("nope"), &model);
    assert!(
        e.contains("does not exist") && !e.contains("os error"),
        "{e}"
    );
    let ck = tmp.path().join("ck");
    std::fs::create_dir(&ck).unwrap();
    std::fs::write(ck.join("latest"), "step-00000001").unwrap();
    let e = open_err(&ck, &model);
    assert!(
        e.contains("sharded fsdp-rs checkpoint") && e.contains("consolidate"),
        "{e}"
    );

    // A directory without weights, and one with PyTorch pickles only.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let e = open_err(&empty, &model);
    assert!(e.contains("without model.safetensors"), "{e}");
    std::fs::write(empty.join("pytorch_model.bin"), b"x").unwrap();
    let e = open_err(&empty, &model);
    assert!(
        e.contains("pytorch_model.bin") && e.contains("safetensors"),
        "{e}"
    );
}

fn clone(r: &Raw) -> Raw {
    Raw {
        dtype: r.dtype,
        shape: r.shape.clone(),
        data: r.data.clone(),
    }
}

#[test]
fn a_nonfinite_weight_fails_every_rank_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("m");
    let (model, mut tensors) = tiny_files(&d);
    // A value near the end of a tensor that only the last rank's shard holds at W=4.
    let k = tensors.len() - 2;
    let n = tensors[k].1.data.len() / 4;
    tensors[k].1.data[(n - 3) * 4..(n - 2) * 4].copy_from_slice(&f32::NAN.to_le_bytes());
    let name = tensors[k].0.clone();
    write(&d.join("model.safetensors"), &tensors);
    let source = FileWeights::open(&d, model.spec()).unwrap();
    for (w, strategy) in [
        (1, Strategy::FullShard),
        (4, Strategy::FullShard),
        (2, Strategy::NoShard),
    ] {
        let e = start_from(&model, w, strategy, InitSync::Verify, &source).unwrap_err();
        assert!(
            e.contains("initial weights")
                && e.contains(&name)
                && e.contains(&format!("NaN at element {}", n - 3))
                && e.contains("model.safetensors"),
            "W={w} {strategy}: {e}"
        );
    }
}

fn fsdp(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args)
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

const LLAMA_CONFIG: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "vocab_size": 256,
  "hidden_size": 32,
  "intermediate_size": 64,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "max_position_embeddings": 128,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "tie_word_embeddings": false
}"#;

#[test]
fn train_init_from_a_model_directory_uses_its_config_and_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("hf");
    std::fs::create_dir(&d).unwrap();
    std::fs::write(d.join("config.json"), LLAMA_CONFIG).unwrap();
    let cfg = d.join("config.json");
    let model = Decoder::resolve("tiny", Some(&cfg)).unwrap();
    let values = StagedModel::init_params(&model, 3);
    write_sharded(&d, published(&model, &values, Dtype::BF16, false));
    let base = [
        "train",
        "--steps",
        "2",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--eval-batches",
        "1",
        "--warmup",
        "1",
        "--world-size",
        "2",
        "--json",
    ];
    let mut a = base.to_vec();
    let ck = tmp.path().join("ck");
    a.extend([
        "--init-from",
        d.to_str().unwrap(),
        "--lr",
        "1e-30",
        "--min-lr",
        "1e-30",
        "--ckpt-dir",
        ck.to_str().unwrap(),
    ]);
    let (code, out, err) = fsdp(&a);
    assert_eq!(code, 0, "{err}");
    // The run started from the directory's weights: with a negligible learning rate the
    // saved parameters are bitwise what the directory holds (stored as bf16).
    let saved: std::collections::BTreeMap<String, Vec<f32>> =
        fsdp_checkpoints::Checkpoint::open(&ck, fsdp_checkpoints::Verify::Checksums)
            .unwrap()
            .consolidate(fsdp_checkpoints::StateKind::Param)
            .unwrap()
            .into_iter()
            .map(|t| (t.name, t.data))
            .collect();
    let mut compared = 0;
    for (us, v) in model.spec().units.iter().zip(&values) {
        for (p, t) in us.params.iter().filter(|p| p.tied_to.is_none()).zip(v) {
            let want: Vec<u32> = t
                .iter()
                .map(|x| round_trip(*x, Dtype::BF16).to_bits())
                .collect();
            let found: Vec<u32> = saved[&p.name].iter().map(|x| x.to_bits()).collect();
            assert!(
                found == want,
                "{}: saved differs from the directory",
                p.name
            );
            compared += 1;
        }
    }
    assert_eq!(compared, saved.len());
    // The model is the directory's config.json (its fingerprint is the one plan prints).
    let (pcode, plan_out, perr) = fsdp(&[
        "plan",
        "--hf-config",
        cfg.to_str().unwrap(),
        "--world-size",
        "2",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
    ]);
    assert_eq!(pcode, 0, "{perr}");
    let fp = plan_out
        .lines()
        .find_map(|l| l.strip_prefix("fingerprint "))
        .unwrap()
        .trim()
        .to_string();
    assert!(
        out.contains(&fp),
        "train did not run the directory's model {fp}: {out}"
    );

    // --model with weights of another shape: exit 2 naming the tensor and the fix.
    let mut a = base.to_vec();
    a.extend(["--model", "llama-mini", "--init-from", d.to_str().unwrap()]);
    let (code, _, err) = fsdp(&a);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("model.embed_tokens.weight") && err.contains("--hf-config"),
        "{err}"
    );
    // A path that does not exist.
    let (code, _, err) = fsdp(&["train", "--steps", "1", "--init-from", "/nonexistent/dir"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("/nonexistent/dir"), "{err}");
}

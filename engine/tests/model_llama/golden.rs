//! Golden values: three tiny models built from `config.json` files and random weights by
//! Hugging Face transformers in float64 (`engine/tests/data/llama_golden/make_golden.py`, run
//! by hand): `llama_gqa` (grouped-query attention 4/2 heads, untied head, Llama 3.1 rope
//! scaling), `qwen2_tied` (q/k/v biases, 4/1 heads, tied head) and `mistral_window` (Mistral:
//! 4/2 heads, an explicit `head_dim`, rope_theta 1e6, no biases, a sliding window of 16 tokens,
//! on sequences of 16 tokens: the longest the window leaves whole, and the longest fsdp-rs
//! computes for that config). The same weights in fsdp-rs give the
//! same logits, summed loss and parameter gradients: in f64 within 1e-6 relative to each
//! tensor's largest magnitude (measured at most 6.7e-7: transformers computes the rotary
//! cos/sin in f32 even in a float64 model, so the reference itself carries f32-sized errors in
//! the angles), in f32 within 5e-6 (measured at most 1.7e-6 on the fused CPU path, 1.5e-6 on
//! the composite (CUDA) path); both paths are checked.

use candle_core::{DType, Device, Tensor, Var};
use fsdp::model::decoder::Decoder;
use fsdp::model::llama::Llama;
use fsdp::model::{OpsPath, Stage};
use std::collections::HashMap;
use std::path::PathBuf;

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/llama_golden")
        .join(name)
}

/// Largest |a - b| over the largest |b| (a relative error of the whole tensor).
fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let num = (&a - &b)
        .unwrap()
        .abs()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    let den = b.abs().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap();
    num / den.max(1e-300)
}

/// The worst relative errors (logits, loss, gradients) of fsdp-rs in `dtype` on `path`.
fn errors(name: &str, dtype: DType, path: OpsPath) -> (f64, f64, f64) {
    let model = match Decoder::from_hf_config(&dir(name).join("config.json")).unwrap() {
        Decoder::Llama(l) => l.with_ops_path(path),
        Decoder::Gpt(_) => panic!("{name} is a Llama-family config"),
    };
    let g: HashMap<String, Tensor> =
        candle_core::safetensors::load(dir(name).join("golden.safetensors"), &Device::Cpu).unwrap();
    let (params, vars) = params_of(&model, &g, dtype);
    let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
    let targets = g["targets"].to_dtype(DType::U32).unwrap();
    let mut x = ids.clone();
    let mut logits = None;
    let mut loss = None;
    for (stage, unit) in model.stages() {
        if stage == Stage::Head {
            logits = Some(model.forward_stage(stage, &params[unit], &x).unwrap());
            loss = Some(model.head_loss(&params[unit], &x, &targets).unwrap());
        } else {
            x = model.forward_stage(stage, &params[unit], &x).unwrap();
        }
    }
    let (logits, loss) = (logits.unwrap(), loss.unwrap());
    let e_logits = rel_err(&logits, &g["logits"]);
    let e_loss = rel_err(&loss.reshape(1).unwrap(), &g["loss_sum"]);
    let grads = loss.backward().unwrap();
    let mut e_grad = 0f64;
    for (pname, v) in &vars {
        let gr = grads
            .get(v.as_tensor())
            .expect("every parameter gets a gradient");
        let e = rel_err(gr, &g[&format!("grad.{pname}")]);
        e_grad = e_grad.max(e);
    }
    println!(
        "{name} {dtype:?} {path:?}: logits {e_logits:.2e}, loss {e_loss:.2e}, gradients {e_grad:.2e}"
    );
    (e_logits, e_loss, e_grad)
}

/// Per unit, every parameter as a `Var` (a tied one as its target's tensor) from the golden
/// file, in `dtype`; also the non-tied `Var`s by name.
#[allow(clippy::type_complexity)]
fn params_of(
    model: &Llama,
    g: &HashMap<String, Tensor>,
    dtype: DType,
) -> (Vec<Vec<Tensor>>, Vec<(String, Var)>) {
    let mut vars = Vec::new();
    let mut out = Vec::new();
    for u in &model.spec.units {
        let mut ts: Vec<Tensor> = Vec::new();
        for p in &u.params {
            match &p.tied_to {
                Some(t) => {
                    let j = u.params.iter().position(|q| &q.name == t).unwrap();
                    ts.push(ts[j].clone());
                }
                None => {
                    let v = Var::from_tensor(&g[&p.name].to_dtype(dtype).unwrap()).unwrap();
                    ts.push(v.as_tensor().clone());
                    vars.push((p.name.clone(), v));
                }
            }
        }
        out.push(ts);
    }
    (out, vars)
}

fn check(name: &str) {
    for path in [OpsPath::Fused, OpsPath::Composite] {
        let (l, s, gr) = errors(name, DType::F64, path);
        assert!(
            l < 1e-6 && s < 1e-6 && gr < 1e-6,
            "{name} f64 {path:?}: {l:e} {s:e} {gr:e}"
        );
        let (l, s, gr) = errors(name, DType::F32, path);
        assert!(
            l < 5e-6 && s < 5e-6 && gr < 5e-6,
            "{name} f32 {path:?}: {l:e} {s:e} {gr:e}"
        );
    }
}

#[test]
fn golden_llama_gqa_untied_llama3_rope_matches_transformers() {
    check("llama_gqa");
}

#[test]
fn golden_qwen2_bias_tied_matches_transformers() {
    check("qwen2_tied");
}

#[test]
fn golden_mistral_within_its_sliding_window_matches_transformers() {
    check("mistral_window");
}

/// A sequence one token longer than Mistral's sliding window, where transformers' attention
/// would drop the first token from the last one's view, is refused, naming the window.
#[test]
fn mistral_sequence_longer_than_its_window_is_refused() {
    let model = match Decoder::from_hf_config(&dir("mistral_window").join("config.json")).unwrap() {
        Decoder::Llama(l) => l,
        Decoder::Gpt(_) => panic!("mistral_window is a Llama-family config"),
    };
    let g: HashMap<String, Tensor> = candle_core::safetensors::load(
        dir("mistral_window").join("golden.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let (params, _) = params_of(&model, &g, DType::F64);
    for t in [16u32, 17] {
        let ids = Tensor::arange(0u32, t, &Device::Cpu)
            .unwrap()
            .reshape((1, t as usize))
            .unwrap();
        let mut r = Ok(ids);
        for (stage, unit) in model.stages() {
            r = r.and_then(|x| model.forward_stage(stage, &params[unit], &x));
        }
        if t == 16 {
            r.unwrap();
        } else {
            let e = r.unwrap_err().to_string();
            assert!(
                e.contains("sequence length 17 exceeds the sliding window 16"),
                "{e}"
            );
        }
    }
}

//! `fsdp eval`: the loss of a model directory's or a checkpoint's weights on the held-out
//! split, the same at every world size bit for bit, equal to the validation loss `fsdp train`
//! reports for the same weights, and to transformers' loss on the same windows
//! (`tests/data/eval_golden/golden.json`, made by `make_eval_golden.py` there).

use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs `fsdp args`: (exit code, stdout, stderr).
fn fsdp(args: &[String]) -> (i32, String, String) {
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

fn fixture(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/eval_golden")
        .join(p)
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

fn golden() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("golden.json")).unwrap()).unwrap()
}

/// `fsdp eval ... --json`: (exit code, the JSON object, stderr).
fn eval(args: &[&str]) -> (i32, serde_json::Value, String) {
    let mut a = s(&["eval", "--json"]);
    a.extend(s(args));
    let (code, out, err) = fsdp(&a);
    let v = serde_json::from_str(out.trim()).unwrap_or(serde_json::Value::Null);
    (code, v, err)
}

#[test]
fn eval_of_a_model_directory_matches_transformers_at_every_world_size() {
    let g = golden();
    let (model, data) = (fixture("model"), fixture("tokens.bin"));
    let mut bits = Vec::new();
    for w in ["1", "2", "3", "4"] {
        let (code, v, err) = eval(&[
            "--model-dir",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--seq-len",
            "8",
            "--micro-batch",
            "2",
            "--eval-batches",
            "all",
            "--world-size",
            w,
        ]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(v["tokens"], g["tokens"], "{v}");
        assert_eq!(v["world_size"].as_u64().unwrap().to_string(), w);
        let loss = v["loss"].as_f64().unwrap();
        let want = g["loss"].as_f64().unwrap();
        println!("world size {w}: loss {loss:.12} (transformers {want:.12})");
        assert!((loss - want).abs() < 1e-6, "W={w}: {loss} vs {want}");
        assert!((v["perplexity"].as_f64().unwrap() - want.exp()).abs() < 1e-4);
        bits.push(loss.to_bits());
    }
    assert!(bits.iter().all(|b| *b == bits[0]), "{bits:?}");
}

#[test]
fn eval_of_a_checkpoint_equals_the_val_loss_train_reported() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let (model, data) = (fixture("model"), fixture("tokens.bin"));
    // Four ranks, the validation loss of the whole split (6 micro-batches of 2 windows: not a
    // multiple of the world size) after every step, a checkpoint after every step.
    let (code, out, err) = fsdp(&s(&[
        "train",
        "--init-from",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--world-size",
        "4",
        "--seq-len",
        "8",
        "--micro-batch",
        "2",
        "--eval-batches",
        "0",
        "--eval-every",
        "1",
        "--steps",
        "3",
        "--lr",
        "1e-2",
        "--warmup",
        "1",
        "--ckpt-dir",
        root.to_str().unwrap(),
        "--ckpt-every",
        "1",
        "--keep-last",
        "0",
        "--json",
    ]));
    assert_eq!(code, 0, "{err}");
    let val: Vec<f64> = out
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("step").is_some() && v.get("event").is_none())
        .map(|v| v["val_loss"].as_f64().unwrap())
        .collect();
    assert_eq!(val.len(), 3, "{out}");
    // The weights moved: each step's validation loss is another number.
    assert!(val[0] != val[1] && val[1] != val[2], "{val:?}");
    for (step, want) in [(2u64, val[1]), (3, val[2])] {
        // Step 3 is the newest: the root resolves to it.
        let ck = if step == 3 {
            root.clone()
        } else {
            root.join(format!("step-{step:08}"))
        };
        for w in ["1", "2", "3"] {
            let (code, v, err) = eval(&[
                "--ckpt",
                ck.to_str().unwrap(),
                "--data",
                data.to_str().unwrap(),
                "--eval-batches",
                "all",
                "--world-size",
                w,
            ]);
            assert_eq!(code, 0, "{err}");
            let loss = v["loss"].as_f64().unwrap();
            assert_eq!(
                loss.to_bits(),
                want.to_bits(),
                "step {step}, W={w}: eval {loss} vs train {want}"
            );
        }
    }
}

#[test]
fn eval_refuses_bad_input_with_names_and_fixes() {
    let (model, data) = (fixture("model"), fixture("tokens.bin"));
    let t = tempfile::tempdir().unwrap();
    // No weights.
    let (code, _, err) = eval(&["--data", data.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--model-dir") && err.contains("--ckpt"),
        "{err}"
    );
    // A directory without a model.
    let (code, _, err) = eval(&[
        "--model-dir",
        t.path().to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("holds no config.json"), "{err}");
    // More ranks than micro-batches: 6 batches of the held-out split.
    let (code, _, err) = eval(&[
        "--model-dir",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--seq-len",
        "8",
        "--micro-batch",
        "2",
        "--eval-batches",
        "all",
        "--world-size",
        "7",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--world-size 7 exceeds the 6 micro-batch"),
        "{err}"
    );
    // A token file of another tokenizer.
    let other = t.path().join("other.bin");
    let mut wr = fsdp::data::tokens::TokenWriter::create(&other, 64, [0x12; 32]).unwrap();
    wr.push(&(0..1000u32).map(|i| i % 60).collect::<Vec<_>>())
        .unwrap();
    wr.finish().unwrap();
    let args = [
        "--model-dir",
        model.to_str().unwrap(),
        "--data",
        other.to_str().unwrap(),
        "--seq-len",
        "8",
        "--micro-batch",
        "2",
    ];
    let (code, _, err) = eval(&args);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("sha256 121212121212.."), "{err}");
    assert!(err.contains("sha256 b16e28d7b485.."), "{err}");
    let mut allowed = args.to_vec();
    allowed.push("--allow-tokenizer-mismatch");
    let (code, v, err) = eval(&allowed);
    assert_eq!(code, 0, "{err}");
    assert!(v["loss"].as_f64().unwrap().is_finite());
    // A sequence longer than the split.
    let (code, _, err) = eval(&[
        "--model-dir",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--seq-len",
        "200",
    ]);
    assert_eq!(code, 2, "{err}");
}

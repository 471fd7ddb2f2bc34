//! Exact resume under mixed precision: an f16 run (dynamic loss scaling) and a bf16 run stopped
//! after a checkpoint and resumed continue bit for bit like the uninterrupted run; the manifest
//! records the compute/reduce dtypes and the loss scaler's state (scale, clean steps), and its
//! optimizer step counts AdamW updates (training steps minus steps skipped on overflow).

use fsdp_checkpoints::{list_checkpoints, Checkpoint, Verify};
use std::path::Path;
use std::process::Command;

fn args(root: &Path, steps: u64, every: u64, dtype: &str) -> Vec<String> {
    let mut v: Vec<String> = [
        "train",
        "--model",
        "tiny",
        "--world-size",
        "2",
        "--micro-batch",
        "1",
        "--seq-len",
        "16",
        "--warmup",
        "2",
        "--eval-batches",
        "1",
        "--threads-per-rank",
        "1",
        "--json",
        "--keep-last",
        "0",
        "--param-dtype",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push(dtype.into());
    v.extend([
        "--ckpt-every".into(),
        every.to_string(),
        "--ckpt-dir".into(),
        root.display().to_string(),
        "--steps".into(),
        steps.to_string(),
    ]);
    v
}

fn run(a: &[String]) -> (String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(a)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{a:?}: {err}");
    (String::from_utf8_lossy(&o.stdout).into_owned(), err)
}

/// `(step, loss bits, loss scale bits, skipped)` per JSON step line.
fn steps(out: &str) -> Vec<(u64, u64, Option<u64>, bool)> {
    out.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("step").is_some() && v.get("event").is_none())
        .map(|v| {
            (
                v["step"].as_u64().unwrap(),
                v["loss"].as_f64().unwrap().to_bits(),
                v["loss_scale"].as_f64().map(f64::to_bits),
                v["skipped"].as_bool().unwrap(),
            )
        })
        .collect()
}

fn resume_exact(dtype: &str) {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("a");
    let (out_a, _) = run(&args(&a, 6, 6, dtype));
    let sa = steps(&out_a);
    assert_eq!(sa.len(), 6);
    assert_eq!(
        sa[0].2.is_some(),
        dtype == "f16",
        "loss scale reported for f16 only"
    );
    let c = t.path().join("c");
    run(&args(&c, 6, 3, dtype));
    for (s, dir) in list_checkpoints(&c).unwrap() {
        if s != 3 {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
    std::fs::write(c.join("latest"), "step-00000003\n").unwrap();
    let ck = Checkpoint::open(&c, Verify::Checksums).unwrap();
    let tr = &ck.manifest().train;
    assert_eq!(tr.extra.get("param_dtype").map(String::as_str), Some(dtype));
    let skipped = sa[..3].iter().filter(|s| s.3).count() as u64;
    assert_eq!(tr.step, 3);
    assert_eq!(
        tr.optimizer.step,
        3 - skipped,
        "AdamW updates exclude skipped steps"
    );
    if dtype == "f16" {
        let scale: f64 = tr.extra["loss_scale"].parse().unwrap();
        // 16 tokens per micro-batch: 2^16 / 16, halved per skipped step.
        assert_eq!(scale, 4096.0 / 2f64.powi(skipped as i32));
        assert!(tr.extra.contains_key("loss_scale_clean_steps"));
    } else {
        assert!(!tr.extra.contains_key("loss_scale"));
    }
    let mut resume = args(&c, 6, 3, dtype);
    resume.push("--resume".into());
    let (out_c, err) = run(&resume);
    assert!(err.contains("step 3"), "{err}");
    assert_eq!(steps(&out_c), sa[3..].to_vec(), "steps 4..6 bit for bit");
}

#[test]
fn f16_resume_is_exact_with_the_loss_scaler_state() {
    resume_exact("f16");
}

#[test]
fn bf16_resume_is_exact() {
    resume_exact("bf16");
}

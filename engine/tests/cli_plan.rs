//! `fsdp plan` end to end: the binary on good and bad input. Bad input exits with code 2 and a
//! message naming the problem, never a panic.

use std::process::{Command, Output};

fn fsdp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .arg("plan")
        .args(args)
        .output()
        .expect("run fsdp")
}

fn bad(args: &[&str], needle: &str) {
    let o = fsdp(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert!(
        err.contains(needle),
        "{args:?}: expected `{needle}` in: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn cli_plan_unknown_preset() {
    bad(
        &["--model", "gpt5"],
        "unknown model preset `gpt5` (known: tiny, mini",
    );
}

#[test]
fn cli_plan_world_size_zero() {
    bad(
        &["--model", "gpt2", "--world-size", "0"],
        "invalid value '0' for '--world-size <WORLD_SIZE>': must be at least 1",
    );
}

#[test]
fn cli_plan_shard_size_not_dividing_world() {
    bad(
        &[
            "--model",
            "gpt2",
            "--world-size",
            "8",
            "--strategy",
            "hybrid",
            "--shard-size",
            "3",
        ],
        "shard size 3 does not divide world size 8",
    );
    bad(
        &[
            "--model",
            "gpt2",
            "--world-size",
            "8",
            "--strategy",
            "hybrid",
        ],
        "needs --shard-size",
    );
}

#[test]
fn cli_plan_config_json_missing_field() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("config.json");
    std::fs::write(&p, r#"{"model_type":"llama","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100}"#).unwrap();
    bad(
        &["--hf-config", p.to_str().unwrap()],
        "missing field `intermediate_size` (llama config)",
    );
    bad(
        &["--hf-config", "/nonexistent/config.json"],
        "/nonexistent/config.json",
    );
}

#[test]
fn cli_plan_truncated_safetensors_header() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("model.safetensors");
    let mut b = 4096u64.to_le_bytes().to_vec();
    b.extend_from_slice(br#"{"w":{"dtype":"F32""#);
    std::fs::write(&p, &b).unwrap();
    bad(
        &["--safetensors", p.to_str().unwrap()],
        "truncated safetensors header: header length 4096 needs 4104 bytes but the file has 27",
    );
}

#[test]
fn cli_plan_tied_parameters_split_across_units() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("spec.json");
    std::fs::write(&p, r#"{"name":"split","arch":{"family":"generic"},"units":[
      {"name":"embed","params":[{"name":"wte","shape":[10,4],"dtype":"f32","trainable":true,"weight_decay":true,"tied_to":null}]},
      {"name":"head","params":[{"name":"lm_head","shape":[10,4],"dtype":"f32","trainable":true,"weight_decay":true,"tied_to":"wte"}]}]}"#).unwrap();
    bad(
        &["--spec", p.to_str().unwrap(), "--world-size", "2"],
        "parameter `lm_head` in unit `head` is tied to `wte`, which is not in the same unit (it is in unit `embed`)",
    );
}

#[test]
fn cli_plan_bad_flags() {
    bad(
        &["--model", "gpt2", "--device-memory", "lots"],
        "--device-memory: cannot read byte size `lots`",
    );
    // A negative size after a space reaches the size parser (not clap's "unexpected argument").
    bad(
        &["--model", "gpt2", "--device-memory", "-5GiB"],
        "--device-memory: byte size `-5GiB` is negative",
    );
    bad(
        &["--model", "gpt2", "--param-dtype", "int8"],
        "invalid value 'int8' for '--param-dtype <PARAM_DTYPE>'",
    );
    bad(
        &["--model", "gpt2", "--micro-batch", "0"],
        "invalid value '0' for '--micro-batch <MICRO_BATCH>': must be at least 1",
    );
    bad(
        &["--model", "gpt2", "--seq-len", "0"],
        "invalid value '0' for '--seq-len <SEQ_LEN>': must be at least 1",
    );
    bad(
        &["--model", "gpt2", "--grad-accum", "0"],
        "invalid value '0' for '--grad-accum <GRAD_ACCUM>': must be at least 1",
    );
    bad(
        &[
            "--model",
            "tiny",
            "--strategy",
            "hybrid",
            "--world-size",
            "4",
            "--shard-size",
            "0",
        ],
        "invalid value '0' for '--shard-size <SHARD_SIZE>': must be at least 1",
    );
    bad(
        &["--model", "gpt2", "--prefetch", "-1"],
        "invalid value '-1' for '--prefetch <PREFETCH>': `-1` is negative; give a whole number >= 0",
    );
    // A negative number after a space is the flag's value, refused by the flag's rule.
    bad(
        &["--model", "gpt2", "--micro-batch", "-2"],
        "invalid value '-2' for '--micro-batch <MICRO_BATCH>': `-2` must be at least 1",
    );
    bad(
        &["--model", "gpt2", "--strategy", "auto"],
        "needs a device memory budget",
    );
    bad(
        &["--model", "gpt2", "--seq-len", "4096"],
        "sequence length 4096 exceeds the model's 1024 positions",
    );
    bad(&["--world-size", "2"], "--model");
    bad(&["--model", "gpt2", "--world-size", "-1"], "-1");
    bad(
        &["--model", "gpt2", "-o", "/nonexistent/dir/plan.txt"],
        "-o /nonexistent/dir/plan.txt: the directory /nonexistent/dir does not exist",
    );
}

#[test]
fn cli_plan_table_json_and_svg() {
    let o = fsdp(&[
        "--model",
        "llama3-8b",
        "--world-size",
        "8",
        "--device-memory",
        "80GiB",
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let t = String::from_utf8(o.stdout).unwrap();
    assert!(t.contains("8,030,261,248 parameters"), "{t}");
    assert!(t.contains("FITS"), "{t}");
    assert!(t.contains("smallest world size that fits 80.00 GiB"), "{t}");
    let o = fsdp(&[
        "--model",
        "gpt2",
        "--world-size",
        "4",
        "--param-dtype",
        "bf16",
        "--format",
        "json",
    ]);
    assert_eq!(o.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["schema"], "fsdp-plan/2");
    assert_eq!(v["model"]["numel"], 124_439_808u64);
    assert_eq!(v["strategy"]["shard_size"], 4);
    assert_eq!(v["ranks"].as_array().unwrap().len(), 4);
    assert_eq!(v["fingerprint"].as_str().unwrap().len(), 64);
    assert!(
        v["memory"]["phases"]["backward"]["max"]["unsharded_grads"]
            .as_u64()
            .unwrap()
            > 0
    );
    let d = tempfile::tempdir().unwrap();
    let svg = d.path().join("plan.svg");
    let o = fsdp(&[
        "--model",
        "gpt2",
        "--world-size",
        "4",
        "--device-memory",
        "4GiB",
        "--format",
        "svg",
        "-o",
        svg.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0));
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.starts_with("<svg") && s.contains("device memory 4.00 GiB"));
}

#[test]
fn cli_plan_shard_optimizer_zero1() {
    let args = |s: &'static str| {
        [
            "--model",
            "gpt2-xl",
            "--world-size",
            "8",
            "--strategy",
            s,
            "--param-dtype",
            "bf16",
            "--reduce-dtype",
            "bf16",
            "--format",
            "json",
        ]
    };
    let o = fsdp(&args("shard-optimizer"));
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["strategy"]["name"], "shard-optimizer");
    assert_eq!(v["config"]["strategy"]["kind"], "shard_optimizer");
    assert_eq!(v["strategy"]["shard_size"], 8);
    assert_eq!(v["schedule"]["replicated"], true);
    // Replicated bf16 parameters 2Psi, then f32 master, f32 gradient shard and Adam 16Psi/N,
    // over the padded elements (the paper's P_os holds a replicated 2-byte gradient instead of
    // the 4-byte shard: Rajbhandari et al. 2020, Figure 1).
    let padded: u64 = v["units"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|u| u["flat_params"].as_array().unwrap())
        .map(|f| f["padded_numel"].as_u64().unwrap())
        .sum();
    assert_eq!(
        v["memory"]["model_states"].as_u64().unwrap(),
        2 * padded + 16 * padded / 8
    );
    // The alias names the same plan.
    let z = fsdp(&args("zero1"));
    assert_eq!(z.status.code(), Some(0));
    assert_eq!(z.stdout, o.stdout);
    // The fit report lists it.
    let o = fsdp(&["--model", "gpt2-xl", "--device-memory", "40GiB"]);
    assert_eq!(o.status.code(), Some(0));
    let t = String::from_utf8(o.stdout).unwrap();
    assert!(t.contains("  shard-optimizer "), "{t}");
}

//! GPT-2 with a tied LM head: consolidation writes Hugging Face GPT-2 names, the tied
//! `lm_head.weight` once under `transformer.wte.weight` (as `save_pretrained` does), and a
//! full file with or without the tied copy loads strictly.

mod common;

use common::{save, Reference};
use fsdp_checkpoints::{
    consolidate_to_file, read_full, write_full, Checkpoint, CheckpointLayout, CkptError,
    TrainState, Verify,
};
use fsdp_planner::presets::gpt2_spec;
use fsdp_planner::Gpt2Config;

fn spec() -> fsdp_planner::ModelSpec {
    gpt2_spec(
        "gpt2-tied-test",
        &Gpt2Config {
            vocab_size: 11,
            n_positions: 5,
            d_model: 4,
            n_layer: 2,
            n_head: 2,
            bias: true,
            tied_head: true,
        },
    )
}

#[test]
fn tied_head_is_written_once_with_hf_names() {
    let spec = spec();
    let t = tempfile::tempdir().unwrap();
    let layout = CheckpointLayout::full_shard(spec.clone(), 3, 1).unwrap();
    let r = Reference::new(&spec);
    save(&t.path().join("ck"), &layout, &r, &TrainState::default());
    let ck = Checkpoint::open(&t.path().join("ck"), Verify::Checksums).unwrap();
    let out = t.path().join("model.safetensors");
    let rep = consolidate_to_file(&ck, &out).unwrap();
    assert_eq!(
        rep.tied_omitted,
        vec![(
            "lm_head.weight".to_string(),
            "transformer.wte.weight".to_string()
        )]
    );
    let f = read_full(&out).unwrap();
    assert!(!f.tensors.contains_key("lm_head.weight"));
    for k in [
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.1.mlp.c_proj.bias",
        "transformer.ln_f.weight",
    ] {
        assert!(
            f.tensors.contains_key(k),
            "{k} missing: {:?}",
            f.tensors.keys().collect::<Vec<_>>()
        );
    }
    assert_eq!(f.tensors["transformer.wte.weight"].shape, vec![11, 4]);
    f.check_strict(&spec).unwrap();
    assert_eq!(
        f.tensors["transformer.wte.weight"].data,
        r.param["transformer.wte.weight"]
    );
    // The tied name through the API reads the target.
    let head = ck
        .full_tensor("lm_head.weight", fsdp_checkpoints::StateKind::Param)
        .unwrap();
    assert_eq!(head.data, r.param["transformer.wte.weight"]);

    // A file that also carries lm_head.weight (as some exporters do) loads if it equals wte...
    let mut with_head: Vec<_> = f.tensors.values().cloned().collect();
    let mut h = f.tensors["transformer.wte.weight"].clone();
    h.name = "lm_head.weight".into();
    with_head.push(h.clone());
    let p = t.path().join("with_head.safetensors");
    write_full(&p, &with_head, &[]).unwrap();
    read_full(&p).unwrap().check_strict(&spec).unwrap();
    // ...and is refused if it differs (the tie would be silently broken).
    with_head.pop();
    h.data[3] += 1.0;
    with_head.push(h);
    write_full(&p, &with_head, &[]).unwrap();
    let e = read_full(&p).unwrap().check_strict(&spec).unwrap_err();
    assert!(
        matches!(
            &e,
            CkptError::TiedCopyDiffers(d)
                if d.tied == "lm_head.weight" && d.target == "transformer.wte.weight"
                    && d.index == 3
        ) && e.to_string().contains("\"tie_word_embeddings\": false"),
        "{e}"
    );

    // Python's safetensors reads it with the HF metadata transformers requires.
    let ok = std::process::Command::new("python3")
        .args(["-c", "import safetensors, numpy"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if ok {
        let script = format!(
            "from safetensors import safe_open\nwith safe_open({:?}, 'np') as f:\n    assert f.metadata()['format'] == 'pt'\n    ks = set(f.keys())\n    assert 'lm_head.weight' not in ks and 'transformer.wte.weight' in ks, ks\n    assert f.get_tensor('transformer.wte.weight').shape == (11, 4)\n",
            out.display().to_string()
        );
        let o = std::process::Command::new("python3")
            .args(["-c", &script])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    } else {
        assert!(
            !std::env::var("FSDP_REQUIRE_PYTHON").is_ok_and(|v| v == "1"),
            "FSDP_REQUIRE_PYTHON=1 but python3 with safetensors + numpy is not installed"
        );
        eprintln!("SKIPPED the Python part: python3 with safetensors + numpy not installed");
    }
}

//! The composite activation model (`ActivationModel::Composite`): the formulas of
//! `fsdp_planner::memory::composite_gpt2_activations` against hand counts, the plan's use of
//! them, and that default (fused) configs keep their plans and fingerprints.

use fsdp_planner::memory::{composite_gpt2_activations, use_activations};
use fsdp_planner::report::{render_json, render_table};
use fsdp_planner::{plan, preset, ActivationModel, Architecture, PlanConfig, UseRole};
use fsdp_types::DType;

fn cfg(dtype: DType, b: u64, s: u64, act: ActivationModel) -> PlanConfig {
    let mut c = PlanConfig::new(1);
    c.param_dtype = dtype;
    c.reduce_dtype = dtype;
    c.micro_batch = b;
    c.seq_len = s;
    c.activations = act;
    c
}

fn gpt2(name: &str) -> (Architecture, fsdp_planner::Gpt2Config) {
    let spec = preset(name).unwrap();
    match spec.arch {
        Architecture::Gpt2(c) => (spec.arch, c),
        _ => unreachable!(),
    }
}

/// mini (h 256, 4 heads) at B 4 x T 256, counted tensor by tensor from composite.rs; the
/// counting allocator measured 66,446,792 B (f32) and 79,572,904 B (bf16) held after the
/// block's forward (`engine/tests/engine_memory_composite.rs`, `stage_bytes`).
#[test]
fn block_forward_is_the_hand_count() {
    let (arch, _) = gpt2("mini");
    let (h, a, s, n) = (256u64, 4u64, 256u64, 1024u64);
    // f32: 39h kept elements per token (two LayerNorms 5h each, qkv product and bias 6h,
    // q/k/v copies 3h, probs @ v, transpose copy, projection and bias, residual 5h, fc product,
    // bias and GELU 12h, MLP projection, bias, residual 3h), 6 score copies, 14 + 3a per-row
    // scalars, the f32 mask.
    let f32_block = 4 * n * (39 * h + 6 * a * s + 14 + 3 * a) + 4 * s * s;
    let c = cfg(DType::F32, 4, 256, ActivationModel::Composite);
    let got = use_activations(&arch, UseRole::Block, &c);
    assert_eq!(got.live.0, f32_block);
    assert_eq!(got.live.0, 66_428_928);
    // bf16: 190h bytes per token of hidden-sized tensors (f32 inside the ops, widened inputs,
    // narrowed outputs), 28 bytes per score (bf16 scores, 6 f32 copies, bf16 probabilities),
    // 56 + 12a per-row bytes, the f32 mask, the widened LN weights and biases (f32).
    let widened = 4 * (4 * h + 3 * h + h + 4 * h + h);
    let bf16_block = n * (190 * h + 28 * a * s + 56 + 12 * a) + 4 * s * s + widened;
    let c = cfg(DType::BF16, 4, 256, ActivationModel::Composite);
    let got = use_activations(&arch, UseRole::Block, &c);
    assert_eq!(got.live.0, bf16_block);
    assert_eq!(got.live.0, 79_549_440);
    // The fused model of the same block (fused attention): 27 MiB f32, 13.5 MiB bf16.
    let fused = use_activations(
        &arch,
        UseRole::Block,
        &cfg(DType::F32, 4, 256, ActivationModel::Fused),
    );
    assert_eq!(fused.live.0, 4 * n * (23 * h + a * s));
    assert_eq!(fused.live.0, 28_311_552);
}

#[test]
fn embedding_and_head_follow_the_formulas() {
    // tiny: h 128, V 256, P 256, biases.
    let (arch, c) = gpt2("tiny");
    let (h, v, p) = (c.d_model, c.vocab_size, c.n_positions);
    let (b, s) = (2u64, 64u64);
    let n = b * s;
    for (dt, e, f, w) in [(DType::F32, 4u64, 4u64, 0u64), (DType::BF16, 2, 4, 1)] {
        let cc = cfg(dt, b, s, ActivationModel::Composite);
        let emb = use_activations(&arch, UseRole::Embedding, &cc);
        assert_eq!(emb.input.0, 4 * n);
        assert_eq!(emb.output.0, e * n * h);
        assert_eq!(emb.live.0, n * h * (2 * f + w * e) + f * h * (v + w * p));
        // P = V here: the wte branch (wpe's gradient kept + zeros + index_add) is the larger.
        assert_eq!(emb.backward.0, w * f * n * h + e * p * h + 2 * f * v * h);
        let head = use_activations(&arch, UseRole::Head, &cc);
        let ln_tok = h * (f * (w + 5) + w * e) + 7 * f;
        assert_eq!(
            head.live.0,
            n * (ln_tok + e * v + f * v * (w + 2) + 6 * f) + w * f * 2 * h + f
        );
        assert_eq!(head.output.0, 4);
        assert_eq!(
            head.backward.0,
            f * n * (8 * h + v + 1) + e * (v * h + 2 * h)
        );
        let block = use_activations(&arch, UseRole::Block, &cc);
        assert_eq!(
            block.backward.0,
            n * (64 * f * h + w * e * h) + e * (4 * h * h + h)
        );
    }
    // mini: P 1024 > V 256, the wpe branch (2 f P h) is the larger.
    let (arch, c) = gpt2("mini");
    let emb = use_activations(
        &arch,
        UseRole::Embedding,
        &cfg(DType::F32, 2, 64, ActivationModel::Composite),
    );
    assert_eq!(emb.backward.0, 2 * 4 * c.n_positions * c.d_model);
    // The public function is the same estimate.
    let cc = cfg(DType::BF16, 8, 128, ActivationModel::Composite);
    for role in [UseRole::Embedding, UseRole::Block, UseRole::Head] {
        assert_eq!(
            composite_gpt2_activations(&c, role, &cc),
            use_activations(&arch, role, &cc)
        );
    }
}

/// Measured on the CPU with the counting allocator (stage_bytes): the plan is within 0.6% of
/// every measured live and backward figure; here three of them, pinned.
#[test]
fn estimates_match_measured_bytes() {
    let cases = [
        // (preset, dtype, B, T, role, measured live, measured backward + output gradient)
        (
            "mini",
            DType::F32,
            8,
            128,
            UseRole::Block,
            53_667_272u64,
            69_214_116u64,
        ),
        (
            "small",
            DType::BF16,
            4,
            256,
            UseRole::Block,
            119_187_880,
            103_423_706,
        ),
        (
            "tiny",
            DType::BF16,
            2,
            256,
            UseRole::Head,
            3_575_292,
            2_693_892,
        ),
        (
            "mini",
            DType::F32,
            2,
            64,
            UseRole::Embedding,
            526_288,
            2_229_928,
        ),
    ];
    for (name, dt, b, t, role, live, bwd) in cases {
        let (arch, _) = gpt2(name);
        let est = use_activations(&arch, role, &cfg(dt, b, t, ActivationModel::Composite));
        let r_live = est.live.0 as f64 / live as f64;
        let r_bwd = (est.backward.0 + est.output.0) as f64 / bwd as f64;
        assert!(
            (0.994..=1.0).contains(&r_live),
            "{name} {dt} {role:?} live {r_live}"
        );
        assert!(
            (0.994..=1.0).contains(&r_bwd),
            "{name} {dt} {role:?} backward {r_bwd}"
        );
    }
}

/// Under recompute (activation checkpointing) forward step k holds the inputs of uses 0..=k
/// and use k's graph; the memory plan composes the composite estimates exactly as the fused
/// ones.
#[test]
fn plan_composes_composite_estimates() {
    let spec = preset("tiny").unwrap();
    let mut c = cfg(DType::BF16, 2, 64, ActivationModel::Composite);
    c.activation_checkpointing = Some(true);
    let p = plan(&spec, &c).unwrap();
    let emb = use_activations(&spec.arch, UseRole::Embedding, &c);
    let blk = use_activations(&spec.arch, UseRole::Block, &c);
    let t = &p.memory.timeline;
    assert_eq!(t[1].bytes.activations, emb.input + blk.input + blk.live);
    // Backward of the last block: inputs up to it, its recomputed graph, its backward, the
    // incoming gradient.
    let inputs = emb.input + fsdp_types::Bytes(blk.input.0 * 4);
    assert_eq!(
        t[7].bytes.activations,
        inputs + blk.live + blk.backward + blk.output
    );
    // The composite plan needs more than the fused one; ledger categories are the same.
    let f = plan(
        &spec,
        &PlanConfig {
            activations: ActivationModel::Fused,
            ..c.clone()
        },
    )
    .unwrap();
    assert!(p.memory.peak > f.memory.peak);
    let (ca, fa) = (
        t[7].bytes.activations.0,
        f.memory.timeline[7].bytes.activations.0,
    );
    assert!(ca > 2 * fa, "composite {ca} vs fused {fa}");
    for (a, b) in p.memory.timeline.iter().zip(&f.memory.timeline) {
        assert_eq!(a.bytes.ledger_total(), b.bytes.ledger_total());
    }
}

/// Llama (whose terms are those of its fused CPU ops) and generic specs plan the same bytes
/// under both models.
#[test]
fn only_gpt2_differs() {
    let spec = preset("llama2-7b").unwrap();
    let mut c = PlanConfig::new(8);
    c.seq_len = 512;
    let fused = plan(&spec, &c).unwrap();
    c.activations = ActivationModel::Composite;
    let comp = plan(&spec, &c).unwrap();
    assert_eq!(fused.memory, comp.memory);
    assert_ne!(fused.fingerprint, comp.fingerprint);
}

/// Default configs serialize without the field, so their fingerprints are those of plans made
/// before it existed (pinned from the `fsdp plan` of commit 6897a7b's planner). Those were
/// full-shard plans with unit-level recompute, which is no longer full shard's default: the
/// configs ask for it (`activation_checkpointing: Some(true)`), which leaves the fingerprint
/// as it was.
#[test]
fn default_fingerprints_are_unchanged() {
    let mut c = PlanConfig::new(2);
    c.micro_batch = 4;
    c.seq_len = 128;
    c.param_dtype = DType::BF16;
    c.activation_checkpointing = Some(true);
    let p = plan(&preset("mini").unwrap(), &c).unwrap();
    assert_eq!(
        p.fingerprint,
        "f998eadc69f55a3a9c7d6e14ff431d6cec410df2fb92189b52a14375aa7d9a25"
    );
    let mut c8 = PlanConfig::new(8);
    c8.activation_checkpointing = Some(true);
    let p = plan(&preset("gpt2").unwrap(), &c8).unwrap();
    assert_eq!(
        p.fingerprint,
        "deca9012aa5b517e969ab14d4e0b8e880b24946aa83910e3ecb1bf637edd11ff"
    );
    let json = serde_json::to_value(&p.config).unwrap();
    assert!(json.get("activations").is_none(), "{json}");
    // A composite plan says so in its config, its fingerprint, its JSON and its table.
    let mut c = c8.clone();
    c.activations = ActivationModel::Composite;
    let q = plan(&preset("gpt2").unwrap(), &c).unwrap();
    assert_ne!(q.fingerprint, p.fingerprint);
    let j = render_json(&q, None);
    assert_eq!(j["config"]["activations"], "composite");
    assert_eq!(j["memory"]["activation_model"], "composite");
    assert_eq!(render_json(&p, None)["memory"]["activation_model"], "fused");
    assert!(render_table(&q, None).contains("activations composite ops (CUDA"));
    assert!(render_table(&p, None).contains("activations fused ops (CPU"));
    // Round trip: a config without the field reads as fused.
    let back: PlanConfig = serde_json::from_value(json).unwrap();
    assert_eq!(back.activations, ActivationModel::Fused);
    let back: PlanConfig = serde_json::from_value(j["config"].clone()).unwrap();
    assert_eq!(back.activations, ActivationModel::Composite);
}

#[test]
fn names_parse() {
    assert_eq!(
        "fused".parse::<ActivationModel>().unwrap(),
        ActivationModel::Fused
    );
    assert_eq!(
        "composite".parse::<ActivationModel>().unwrap(),
        ActivationModel::Composite
    );
    let e = "cuda".parse::<ActivationModel>().unwrap_err().to_string();
    assert!(e.contains("unknown activation model `cuda`"), "{e}");
    assert_eq!(ActivationModel::default(), ActivationModel::Fused);
    assert_eq!(ActivationModel::Composite.to_string(), "composite");
}

//! FLOP counts of the time model against independent hand counts: per block for GPT-2 124M
//! and a small Llama with grouped-query attention and SwiGLU, the attention entries the fused
//! attention computes against a brute-force count, the 6·N·tokens + attention cross-check of
//! Kaplan et al. 2020 / Korthikanti et al. 2022, and PaLM's MFU formula.

use fsdp_planner::presets::{gpt2_spec, llama_spec, openai_gpt2_config};
use fsdp_planner::schedule::UseRole;
use fsdp_planner::time::flops::{
    attention_entries, backward_ops, forward_ops, palm_flops_per_token, total_flops,
    AttentionCount, Grads, OpKind, OpShape,
};
use fsdp_planner::{Architecture, LlamaConfig};
use fsdp_types::DType;

/// Brute force: entries (i, j), j <= the last row of i's 64-row block, i.e. block(j) <=
/// block(i).
fn block_causal_brute(t: u64) -> f64 {
    let mut n = 0u64;
    for i in 0..t {
        for j in 0..t {
            if j / 64 <= i / 64 {
                n += 1;
            }
        }
    }
    n as f64
}

const BLOCK: AttentionCount = AttentionCount::BlockCausal { block_rows: 64 };
const BOTH: Grads = Grads {
    input: true,
    weights: true,
};

#[test]
fn attention_entries_count_the_computed_blocks() {
    for t in [1u64, 37, 63, 64, 65, 128, 130, 200, 1024] {
        assert_eq!(attention_entries(t, BLOCK), block_causal_brute(t), "T={t}");
        assert_eq!(attention_entries(t, AttentionCount::Full), (t * t) as f64);
    }
    // T a multiple of 64: T^2/2 + 32 T.
    assert_eq!(attention_entries(1024, BLOCK), 524_288.0 + 32_768.0);
}

#[test]
fn gpt2_124m_block_equals_the_hand_count() {
    let c = openai_gpt2_config("gpt2").unwrap();
    let arch = Architecture::Gpt2(c);
    let (b, t, d, h) = (2.0f64, 1024.0f64, 768.0f64, 12.0f64);
    let n = b * t;
    let shape = OpShape {
        micro_batch: 2,
        seq_len: 1024,
        dtype: DType::BF16,
        attention: BLOCK,
    };
    let fwd = forward_ops(&arch, UseRole::Block, &shape).unwrap();
    let bwd = backward_ops(&arch, UseRole::Block, &shape, BOTH).unwrap();
    // Matmuls: qkv d x 3d, proj d x d, fc d x 4d, proj 4d x d: 2 N (3 + 1 + 4 + 4) d^2.
    let e = block_causal_brute(1024);
    let linear = 2.0 * n * 12.0 * d * d;
    // Scores and weighted sum: 2 hd E each per (sequence, head) pair.
    let attn = 2.0 * 2.0 * (d / h) * e * b * h;
    assert_eq!(total_flops(&fwd, Some(OpKind::Gemm)), linear + attn);
    // Backward: dX and dW per linear layer, four attention matmuls.
    assert_eq!(
        total_flops(&bwd, Some(OpKind::Gemm)),
        2.0 * linear + 2.0 * attn
    );
    // Elementwise, per element: LayerNorm 8 (x2), bias adds 1 (3d + d + d), residual adds 1
    // (x2), bias + GELU 11 over 4d; softmax 5 per computed entry.
    let elem_fwd = n * (2.0 * 8.0 * d + 5.0 * d + 2.0 * d + 11.0 * 4.0 * d) + 5.0 * e * b * h;
    assert_eq!(total_flops(&fwd, Some(OpKind::Elementwise)), elem_fwd);
    // Bytes of the forward's elementwise ops in bf16 (2 bytes): LayerNorm 2 elements moved
    // per element (x2), bias adds 2 (5d), residual 3 (x2), GELU 2 (4d), softmax 2 per entry.
    let moved =
        n * (2.0 * 2.0 * d + 2.0 * 5.0 * d + 2.0 * 3.0 * d + 2.0 * 4.0 * d) + 2.0 * e * b * h;
    let bytes: f64 = fwd.iter().map(|o| o.bytes).sum();
    assert_eq!(bytes, 2.0 * moved);
}

#[test]
fn gpt2_124m_model_matches_six_n_tokens_plus_attention() {
    // Kaplan et al. 2020 / Korthikanti et al. 2022: forward + backward matmuls = 6 x the
    // matmul parameters x tokens + the attention term (here with the entries computed).
    let c = openai_gpt2_config("gpt2").unwrap();
    let spec = gpt2_spec("gpt2", &c);
    let arch = spec.arch;
    let shape = OpShape {
        micro_batch: 1,
        seq_len: 1024,
        dtype: DType::F32,
        attention: BLOCK,
    };
    let tokens = 1024.0;
    let mut total = 0.0;
    for role in [UseRole::Embedding, UseRole::Block, UseRole::Head] {
        let count = if role == UseRole::Block { 12.0 } else { 1.0 };
        let grads = Grads {
            input: role != UseRole::Embedding,
            weights: true,
        };
        let f = forward_ops(&arch, role, &shape).unwrap();
        let b = backward_ops(&arch, role, &shape, grads).unwrap();
        total +=
            count * (total_flops(&f, Some(OpKind::Gemm)) + total_flops(&b, Some(OpKind::Gemm)));
    }
    // Matmul weights from the spec itself: every 2-D weight of the blocks, plus the head
    // (tied to wte: 50257 x 768).
    let block_matrices: u64 = spec
        .units
        .iter()
        .filter(|u| u.name.starts_with("h."))
        .flat_map(|u| &u.params)
        .filter(|p| p.shape.len() == 2)
        .map(|p| p.numel().0)
        .sum();
    let n_matmul = (block_matrices + 50257 * 768) as f64;
    let attention = 12.0 * 12.0 * 768.0 * block_causal_brute(1024);
    assert_eq!(total, 6.0 * n_matmul * tokens + attention);
}

fn small_llama() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 256,
        d_model: 256,
        n_layer: 2,
        n_head: 8,
        n_kv_head: 2,
        ffn_hidden: 688,
        max_seq: 1024,
        tied_head: false,
        qkv_bias: false,
    }
}

/// Elements of the first block's 2-D parameters (its weight matrices).
fn block_matrices(spec: &fsdp_planner::ModelSpec) -> u64 {
    spec.units[1]
        .params
        .iter()
        .filter(|p| p.shape.len() == 2)
        .map(|p| p.numel().0)
        .sum()
}

#[test]
fn llama_gqa_swiglu_block_equals_the_hand_count() {
    let c = small_llama();
    let spec = llama_spec("llama-gqa", &c);
    let arch = spec.arch;
    let (b, t) = (2u64, 130u64);
    let shape = OpShape {
        micro_batch: b,
        seq_len: t,
        dtype: DType::F32,
        attention: BLOCK,
    };
    let n = (b * t) as f64;
    let (d, hd, ffn) = (256.0, 32.0, 688.0);
    let (q, kv) = (8.0 * hd, 2.0 * hd);
    // q, k, v, o projections (k and v only 2 heads wide) and gate, up, down.
    let linear = 2.0 * n * (d * q + 2.0 * d * kv + q * d + 3.0 * d * ffn);
    // The block's matrices from the spec agree with that width count.
    let matrices = block_matrices(&spec);
    assert_eq!(2.0 * n * matrices as f64, linear);
    // Attention over all 8 query heads (k and v repeated), block-causal entries.
    let e = block_causal_brute(t);
    let attn = 2.0 * 2.0 * hd * e * b as f64 * 8.0;
    let fwd = forward_ops(&arch, UseRole::Block, &shape).unwrap();
    assert_eq!(total_flops(&fwd, Some(OpKind::Gemm)), linear + attn);
    // RMSNorm 4 per element (x2), residual 1 (x2), rotary 3 per rotated q and k element,
    // SwiGLU gate 6 over ffn, softmax 5 per entry.
    let elem =
        n * (2.0 * 4.0 * d + 2.0 * d + 3.0 * (q + kv) + 6.0 * ffn) + 5.0 * e * b as f64 * 8.0;
    assert_eq!(total_flops(&fwd, Some(OpKind::Elementwise)), elem);
    // Frozen weights, input gradient needed: dX only, so backward matmuls = forward + the
    // attention's extra half.
    let bwd = backward_ops(
        &arch,
        UseRole::Block,
        &shape,
        Grads {
            input: true,
            weights: false,
        },
    )
    .unwrap();
    assert_eq!(total_flops(&bwd, Some(OpKind::Gemm)), linear + 2.0 * attn);
    // Neither gradient: no backward at all.
    let none = backward_ops(
        &arch,
        UseRole::Block,
        &shape,
        Grads {
            input: false,
            weights: false,
        },
    )
    .unwrap();
    assert!(none.is_empty());
    // The composite path computes every T x T entry.
    let full = forward_ops(
        &arch,
        UseRole::Block,
        &OpShape {
            attention: AttentionCount::Full,
            ..shape
        },
    )
    .unwrap();
    let attn_full = 2.0 * 2.0 * hd * (t * t) as f64 * b as f64 * 8.0;
    assert_eq!(total_flops(&full, Some(OpKind::Gemm)), linear + attn_full);
}

#[test]
fn llama_head_and_embedding_hand_count() {
    let c = small_llama();
    let arch = Architecture::Llama(c);
    let shape = OpShape {
        micro_batch: 1,
        seq_len: 64,
        dtype: DType::F32,
        attention: BLOCK,
    };
    let n = 64.0;
    let head = forward_ops(&arch, UseRole::Head, &shape).unwrap();
    assert_eq!(
        total_flops(&head, Some(OpKind::Gemm)),
        2.0 * n * 256.0 * 256.0
    );
    // RMSNorm 4 per element, cross-entropy 4 per logit.
    assert_eq!(
        total_flops(&head, Some(OpKind::Elementwise)),
        4.0 * n * 256.0 + 4.0 * n * 256.0
    );
    let emb = forward_ops(&arch, UseRole::Embedding, &shape).unwrap();
    assert_eq!(total_flops(&emb, Some(OpKind::Gemm)), 0.0);
}

#[test]
fn palm_formula_of_gpt2_and_llama() {
    // GPT-2 124M: all parameters but the position table (the tied token table is the head).
    let c = openai_gpt2_config("gpt2").unwrap();
    let n = 124_439_808u64 - 1024 * 768;
    assert_eq!(
        palm_flops_per_token(&Architecture::Gpt2(c), 124_439_808, 1024).unwrap(),
        6.0 * n as f64 + 12.0 * 12.0 * 768.0 * 1024.0
    );
    // Untied Llama: the token table is a lookup, lm_head a matmul.
    let l = small_llama();
    let spec = llama_spec("l", &l);
    let numel = spec.numel().0;
    let n = numel - 256 * 256;
    assert_eq!(
        palm_flops_per_token(&spec.arch, numel, 512).unwrap(),
        6.0 * n as f64 + 12.0 * 2.0 * 256.0 * 512.0
    );
    let e = palm_flops_per_token(&Architecture::Generic, 10, 10).unwrap_err();
    assert!(e.to_string().contains("config.json"), "{e}");
}

/// Bytes of the ops whose name ends in `.dW.transpose`.
fn transpose_bytes(ops: &[fsdp_planner::time::flops::OpCost]) -> f64 {
    ops.iter()
        .filter(|o| o.name.ends_with(".dW.transpose"))
        .map(|o| {
            assert_eq!(o.kind, OpKind::Elementwise, "{}", o.name);
            assert_eq!(o.flops, 0.0, "{}", o.name);
            o.bytes
        })
        .sum()
}

#[test]
fn weights_stored_out_by_in_pay_a_transposed_gradient_copy() {
    // A Llama linear is `x W^T` with `W` stored `[out, in]`: its weight gradient comes out of
    // the matmul as `[in, out]` and is copied transposed into `W`'s layout, one read and one
    // write per weight element. GPT-2's block weights are stored `[in, out]` (no copy).
    let c = small_llama();
    let spec = llama_spec("llama-gqa", &c);
    let matrices = block_matrices(&spec);
    for (dtype, size) in [(DType::F32, 4.0), (DType::BF16, 2.0)] {
        let shape = OpShape {
            micro_batch: 2,
            seq_len: 64,
            dtype,
            attention: BLOCK,
        };
        let trainable = Grads {
            input: true,
            weights: true,
        };
        let bwd = backward_ops(&spec.arch, UseRole::Block, &shape, trainable).unwrap();
        assert_eq!(transpose_bytes(&bwd), 2.0 * size * matrices as f64);
        assert_eq!(
            bwd.iter()
                .filter(|o| o.name.ends_with(".dW.transpose"))
                .count(),
            7
        );
        let frozen = Grads {
            input: true,
            weights: false,
        };
        let bwd = backward_ops(&spec.arch, UseRole::Block, &shape, frozen).unwrap();
        assert_eq!(transpose_bytes(&bwd), 0.0);
        // The LM head `[V, D]` likewise.
        let head = backward_ops(&spec.arch, UseRole::Head, &shape, trainable).unwrap();
        assert_eq!(transpose_bytes(&head), 2.0 * size * 256.0 * 256.0);
        // No forward op copies.
        let fwd = forward_ops(&spec.arch, UseRole::Block, &shape).unwrap();
        assert_eq!(transpose_bytes(&fwd), 0.0);
    }
    let gpt = gpt2_spec("gpt2", &openai_gpt2_config("gpt2").unwrap()).arch;
    let shape = OpShape {
        micro_batch: 1,
        seq_len: 64,
        dtype: DType::F32,
        attention: BLOCK,
    };
    let g = Grads {
        input: true,
        weights: true,
    };
    let bwd = backward_ops(&gpt, UseRole::Block, &shape, g).unwrap();
    assert_eq!(transpose_bytes(&bwd), 0.0);
}

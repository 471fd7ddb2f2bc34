"""Shared arithmetic of the GPU check (gpu/check.sh): GPT-2 parameter counts, model FLOPs per
token, model FLOPs utilisation (MFU), the GPUs' peak FLOP/s, and `fsdp train`'s learning-rate
schedule. Standard library only, so it runs (and is unit-tested, gpu/test_gpu_tools.py) on a
machine without torch or a GPU; gpu/rows.py and gpu/pytorch_gpt2_eager.py import it.

Model FLOPs (Chowdhery et al. 2022, "PaLM", Appendix B): one training token of a decoder costs
    6 * N + 12 * L * H * Q * T  FLOPs  (forward 1/3, backward 2/3)
with N the parameters that take part in a matrix multiply for that token, L layers, H heads of
width Q (H * Q = d_model) and T the sequence length; the second term is the attention scores
q k^T and the weighted sum over values (2 matmuls of T x Q per head, 2 FLOPs per multiply-add,
times 3 for forward + backward), counted over the full T x T matrix, as PaLM does (no causal
halving). For GPT-2, N = every parameter except the position table `wpe` (a lookup, no matmul);
the token embedding `wte` is counted once, as the (tied) LM head's weight. Up to the biases and
LayerNorm gains (< 0.1 % of N) this equals Megatron-LM's count without activation recomputation
(Narayanan et al. 2021, section 5.1: 72 B s l h^2 (1 + s / (6 h) + V / (12 l h)) per batch).
MFU counts model FLOPs only: work an engine repeats (fsdp-rs recomputes each unit's forward in
backward) does not raise it.
"""

import math

# Dense (no sparsity) peak FLOP/s of the tensor cores (bf16) and of the FP32 CUDA cores (fp32
# without TF32: candle's f32 GEMM uses CUBLAS_COMPUTE_32F, PyTorch with
# `torch.set_float32_matmul_precision("highest")` likewise), in TFLOP/s, from NVIDIA's data
# sheets (the sheets print bf16 "with sparsity": halved here). Matched against the device name
# in order, first match wins: "H200 NVL" before "H200".
PEAK_TFLOPS = [
    ("H200 NVL", {"bf16": 835.5, "fp32": 60.0}),
    ("H200", {"bf16": 989.5, "fp32": 67.0}),  # H200 SXM (141 GB)
    ("H100 NVL", {"bf16": 835.5, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.5, "fp32": 51.2}),
    ("H100", {"bf16": 989.5, "fp32": 67.0}),  # H100 SXM
    ("A100", {"bf16": 312.0, "fp32": 19.5}),
]

# GPT-2 style presets of fsdp-rs (planner/src/presets.rs: byte_gpt_config, openai_gpt2_config):
# vocab, positions, d_model, layers, heads, bias, tied head.
PRESETS = {
    "tiny": dict(vocab=256, n_positions=256, d=128, n_layer=4, n_head=4, bias=True, tied=False),
    "mini": dict(vocab=256, n_positions=1024, d=256, n_layer=4, n_head=4, bias=True, tied=False),
    "small": dict(vocab=256, n_positions=1024, d=384, n_layer=6, n_head=6, bias=True, tied=False),
    "base": dict(vocab=256, n_positions=1024, d=768, n_layer=6, n_head=12, bias=True, tied=False),
    "gpt2": dict(vocab=50257, n_positions=1024, d=768, n_layer=12, n_head=12, bias=True, tied=True),
    "gpt2-medium": dict(vocab=50257, n_positions=1024, d=1024, n_layer=24, n_head=16, bias=True,
                        tied=True),
    "gpt2-large": dict(vocab=50257, n_positions=1024, d=1280, n_layer=36, n_head=20, bias=True,
                       tied=True),
    "gpt2-xl": dict(vocab=50257, n_positions=1024, d=1600, n_layer=48, n_head=25, bias=True,
                    tied=True),
}


def preset(name):
    """The configuration dict of preset `name`; ValueError naming the known presets."""
    try:
        return dict(PRESETS[name])
    except KeyError:
        raise ValueError("unknown preset %r; known: %s" % (name, ", ".join(PRESETS))) from None


def gpt2_param_count(vocab, n_positions, d, n_layer, n_head=None, bias=True, tied=True):
    """Parameters (elements; a tied LM head counted once) of the GPT-2 layout of
    planner/src/presets.rs::gpt2_spec: wte [vocab, d], wpe [n_positions, d]; per block ln_1,
    c_attn [d, 3d], attn.c_proj [d, d], ln_2, c_fc [d, 4d], mlp.c_proj [4d, d] (12 d^2 weights,
    13 d biases and gains with bias, 2 d gains without); ln_f; lm_head [vocab, d] unless tied.
    `n_head` does not change the count (accepted so a preset dict can be splatted)."""
    del n_head
    block = 12 * d * d + (13 * d if bias else 2 * d)
    ln_f = 2 * d if bias else d
    head = 0 if tied else vocab * d
    return vocab * d + n_positions * d + n_layer * block + ln_f + head


def matmul_params(total_params, n_positions, d):
    """N of the FLOP count: `total_params` (tied head once) minus the position table
    (n_positions * d), which is looked up, not multiplied."""
    return total_params - n_positions * d


def model_flops_per_token(n_matmul_params, n_layer, d, seq_len):
    """Training FLOPs per token, PaLM Appendix B: 6 N + 12 L d T (d = heads * head width)."""
    return 6 * n_matmul_params + 12 * n_layer * d * seq_len


def preset_flops_per_token(name, seq_len):
    """(total params, matmul params N, model FLOPs per token) of preset `name` at `seq_len`."""
    c = preset(name)
    total = gpt2_param_count(**c)
    n = matmul_params(total, c["n_positions"], c["d"])
    return total, n, model_flops_per_token(n, c["n_layer"], c["d"], seq_len)


def megatron_flops_per_token(n_layer, d, seq_len, vocab):
    """Megatron-LM's per-token training FLOPs without recomputation (Narayanan et al. 2021,
    section 5.1, divided by B s): 72 l h^2 (1 + s / (6 h) + V / (12 l h)). Cross-check only."""
    h = d
    return 72 * n_layer * h * h * (1 + seq_len / (6 * h) + vocab / (12 * n_layer * h))


def peak_tflops(device_name, dtype):
    """Dense peak TFLOP/s of `device_name` (e.g. "NVIDIA H200") for `dtype` ("bf16"/"fp32",
    also "f32"), or None for an unknown device."""
    dtype = {"f32": "fp32", "float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype)
    for key, peaks in PEAK_TFLOPS:
        if key.lower() in (device_name or "").lower():
            return peaks.get(dtype)
    return None


def mfu(tokens_per_s, flops_per_token, peak_tflops_value):
    """Model FLOPs utilisation in [0, 1]: tokens_per_s * flops_per_token / peak; None when the
    peak is unknown."""
    if not peak_tflops_value:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops_value * 1e12)


def lr_at(step, peak, min_lr, warmup, total):
    """`fsdp train`'s learning rate of 1-based `step` (engine/src/optim.rs::LrSchedule): linear
    warmup `peak * step / warmup` while step <= warmup, then cosine from peak to min_lr reached
    at `total` (Loshchilov & Hutter 2017, eq. 5, one cycle)."""
    if warmup > 0 and step <= warmup:
        return peak * step / warmup
    if total <= warmup:
        return peak
    t = min(max((step - warmup) / (total - warmup), 0.0), 1.0)
    return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))

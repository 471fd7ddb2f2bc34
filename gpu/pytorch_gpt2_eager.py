#!/usr/bin/env python3
"""GPT-2 124M training throughput in PyTorch eager mode on one GPU: the baseline that
gpu/check.sh divides fsdp-rs's `fsdp train --model gpt2 --device cuda` throughput by.

The model is the architecture of fsdp-rs's `gpt2` preset (planner/src/presets.rs,
engine/src/model.rs): vocabulary 50257, 1024 positions, d_model 768, 12 layers, 12 heads,
biases, pre-LayerNorm blocks (eps 1e-5), causal softmax(q k^T / sqrt(64)) attention, 4x MLP with
tanh-GELU, final LayerNorm, LM head tied to the token embedding, mean token cross-entropy;
124,439,808 parameters (checked at start). Initialisation as the engine's: N(0, 0.02) for
matrices and embeddings, N(0, 0.02 / sqrt(2 L)) for the two residual projections, zero biases,
unit LayerNorm gains. No dropout.

Training step as `fsdp train`'s defaults: AdamW (Loshchilov & Hutter 2019) lr 1e-3 peak with
20 linear warm-up steps then cosine to 1e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on
2-D tensors only (matrices and both embeddings; not biases or LayerNorm gains), global L2
gradient clipping at 1.0. `torch.optim.AdamW(fused=True)`, the fastest eager implementation.

Precision per config:
- fp32: fp32 everywhere, matmuls in IEEE fp32 (`torch.set_float32_matmul_precision("highest")`,
  no TF32), as candle's f32 GEMM (CUBLAS_COMPUTE_32F).
- bf16: `torch.autocast("cuda", torch.bfloat16)` over forward and loss, fp32 parameters,
  gradients and AdamW state. This is what matches `fsdp train --param-dtype bf16` best: the
  engine also keeps fp32 master weights, fp32 gradient shards and fp32 optimizer state and runs
  the matrix products in bf16 with LayerNorm / softmax / cross-entropy computed in fp32. (A
  model cast to bf16 would drop the fp32 master weights; that is not what the engine does.)

Attention per config: `sdpa` = `torch.nn.functional.scaled_dot_product_attention(is_causal=
True)` (fused flash / memory-efficient kernels: what a PyTorch user gets), `math` = scores
materialised as [B, H, T, T], masked, softmax, times V (the computation fsdp-rs performs).

Tokens: synthetic by default (uniform byte values 0..255, seeded), or `--data FILE` (bytes as
tokens, random windows), as `fsdp train` feeds bytes to the 50257-entry vocabulary. Token
values do not change the work per step.

Timing: `--warmup-steps` steps first (not counted: cuBLAS / kernel selection, allocator
growth), then `--steps` steps between two `torch.cuda.synchronize()` calls. Peak memory is
`torch.cuda.max_memory_allocated()` (and `..._reserved()`) over the config's steps, reset per
config. MFU: model FLOPs per token 6 N + 12 L d T (PaLM, Appendix B; gpu/gpt_metrics.py) times
tokens/s over the GPU's dense peak for the dtype.

Output: one JSON line per config on stdout (`"bench": "pytorch_eager_gpt2"`); a config that
fails (e.g. out of memory) prints a line with `"error"` and the script exits 1 after the others.

  python3 gpu/pytorch_gpt2_eager.py --configs fp32:sdpa,bf16:sdpa,fp32:math,bf16:math \
      --micro-batch 16 --seq-len 1024 --warmup-steps 3 --steps 10
"""

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_metrics as gm  # noqa: E402

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError as e:  # pragma: no cover - the build machine has no torch
    sys.exit("pytorch_gpt2_eager.py: needs PyTorch (%s); on the GPU machine run it with "
             "/opt/torch/.venv/bin/python" % e)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on x [B, T, D]: qkv = c_attn(x) split into H heads of
    D / H, softmax(q k^T / sqrt(D / H) + causal mask) v, heads concatenated, c_proj."""

    def __init__(self, d, n_head, n_positions, attention):
        super().__init__()
        self.n_head, self.attention = n_head, attention
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        if attention == "math":
            mask = torch.ones(n_positions, n_positions, dtype=torch.bool).triu(1)
            self.register_buffer("future", mask, persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.n_head
        qkv = self.c_attn(x).view(b, t, 3, self.n_head, hd).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # [B, H, T, hd]
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            scores = scores.masked_fill(self.future[:t, :t], float("-inf"))
            # Softmax in fp32 (autocast does so as well), probabilities back in v's dtype.
            probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
            y = torch.matmul(probs, v)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(.))."""

    def __init__(self, d, n_head, n_positions, attention):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=1e-5)
        self.attn = CausalSelfAttention(d, n_head, n_positions, attention)
        self.ln_2 = nn.LayerNorm(d, eps=1e-5)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        h = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
        return x + self.mlp_proj(h)


class GPT2(nn.Module):
    """GPT-2 with a tied LM head: ids [B, T] (int64) -> mean cross-entropy over B*T targets."""

    def __init__(self, vocab, n_positions, d, n_layer, n_head, attention):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(n_positions, d)
        self.blocks = nn.ModuleList(
            [Block(d, n_head, n_positions, attention) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d, eps=1e-5)
        self.init_weights(n_layer)

    @torch.no_grad()
    def init_weights(self, n_layer):
        resid_std = 0.02 / math.sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                # LayerNorm gains 1, every bias (and LayerNorm bias) 0.
                if name.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()
            elif name.endswith("attn.c_proj.weight") or name.endswith("mlp_proj.weight"):
                p.normal_(0.0, resid_std)
            else:
                p.normal_(0.0, 0.02)

    def forward(self, ids, targets):
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head: [B, T, V]
        return F.cross_entropy(logits.reshape(b * t, -1).float(), targets.reshape(b * t))


def param_groups(model, weight_decay):
    """AdamW groups: weight decay on tensors of 2 or more dims (matrices, embeddings), none on
    biases and LayerNorm gains, as fsdp-rs's plan marks its decayed spans."""
    decay, no_decay = [], []
    for p in model.parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def batches(args, device, n):
    """n (input, target) int64 pairs [B, T] on `device`: byte windows of --data or synthetic
    uniform bytes, from a seeded CPU generator."""
    g = torch.Generator().manual_seed(args.seed)
    b, t = args.micro_batch, args.seq_len
    if args.data:
        with open(args.data, "rb") as f:
            text = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        if text.numel() < t + 2:
            raise SystemExit("--data %s: %d bytes, fewer than one window of %d" % (
                args.data, text.numel(), t + 1))
        starts = torch.randint(0, text.numel() - t - 1, (n, b), generator=g)
        idx = starts[:, :, None] + torch.arange(t + 1)[None, None, :]
        win = text.long()[idx]
    else:
        win = torch.randint(0, 256, (n, b, t + 1), generator=g)
    win = win.to(device)
    return [(win[i, :, :-1].contiguous(), win[i, :, 1:].contiguous()) for i in range(n)]


def run_config(args, dtype, attention, device, device_name):
    """Trains --warmup-steps + --steps steps of one config; returns its JSON dict."""
    c = gm.preset("gpt2")
    torch.manual_seed(args.seed)
    model = GPT2(c["vocab"], c["n_positions"], c["d"], c["n_layer"], c["n_head"], attention)
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())  # the tied weight once
    want = gm.gpt2_param_count(**c)
    if n_params != want:
        raise RuntimeError("model has %d parameters, the gpt2 preset %d" % (n_params, want))
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr,
                            betas=(0.9, 0.95), eps=1e-8, fused=True)
    total_steps = args.warmup_steps + args.steps
    data = batches(args, device, total_steps)
    use_autocast = dtype == "bf16"

    def step(k):
        lr = gm.lr_at(k + 1, args.lr, args.min_lr, args.lr_warmup, total_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = data[k]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_autocast):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    losses = []
    for k in range(args.warmup_steps):
        losses.append(step(k))
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for k in range(args.warmup_steps, total_steps):
        losses.append(step(k))
    torch.cuda.synchronize(device)
    secs = time.perf_counter() - t0
    losses = [float(v) for v in torch.stack(losses).cpu()]
    if not all(math.isfinite(v) for v in losses):
        raise RuntimeError("non-finite loss: %s" % losses)
    tokens = args.steps * args.micro_batch * args.seq_len
    tps = tokens / secs
    _, n_mm, fpt = gm.preset_flops_per_token("gpt2", args.seq_len)
    peak = args.peak_tflops or gm.peak_tflops(device_name, dtype)
    out = {
        "bench": "pytorch_eager_gpt2", "torch": torch.__version__, "device": device_name,
        "dtype": dtype, "attention": attention,
        "precision": ("autocast bf16 compute, fp32 params/grads/AdamW state"
                      if use_autocast else "fp32, no TF32 (matmul precision %s)"
                      % torch.get_float32_matmul_precision()),
        "params": n_params, "matmul_params": n_mm, "model_flops_per_token": fpt,
        "micro_batch": args.micro_batch, "seq_len": args.seq_len,
        "warmup_steps": args.warmup_steps, "steps": args.steps,
        "tokens_per_s": tps, "step_ms": 1e3 * secs / args.steps,
        "peak_tflops": peak, "mfu": gm.mfu(tps, fpt, peak),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "loss_first": losses[0], "loss_last": losses[-1],
    }
    del model, opt, data
    return out


def parse_configs(text):
    out = []
    for item in text.split(","):
        dtype, _, attention = item.strip().partition(":")
        if dtype not in ("fp32", "bf16") or attention not in ("sdpa", "math"):
            raise argparse.ArgumentTypeError(
                "config %r: want DTYPE:ATTENTION with DTYPE fp32|bf16, ATTENTION sdpa|math"
                % item)
        out.append((dtype, attention))
    return out


def main():
    p = argparse.ArgumentParser(description="PyTorch eager GPT-2 124M training throughput")
    p.add_argument("--configs", type=parse_configs,
                   default=parse_configs("fp32:sdpa,bf16:sdpa,fp32:math,bf16:math"),
                   help="comma-separated DTYPE:ATTENTION (fp32|bf16 : sdpa|math)")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--lr-warmup", type=int, default=20, help="linear lr warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--data", help="text file, bytes as tokens (default: synthetic bytes)")
    p.add_argument("--peak-tflops", type=float,
                   help="dense peak TFLOP/s for MFU (default: from the device name)")
    p.add_argument("--device", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
    args = p.parse_args()
    if args.seq_len > gm.preset("gpt2")["n_positions"] or min(
            args.seq_len, args.micro_batch, args.steps) < 1 or args.warmup_steps < 0:
        p.error("need 1 <= --seq-len <= 1024, --micro-batch >= 1, --steps >= 1, "
                "--warmup-steps >= 0")
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "pytorch_eager_gpt2", "error": "no CUDA device visible to "
                          "torch %s" % torch.__version__}))
        return 1
    torch.set_float32_matmul_precision("highest")
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device)
    failed, notes = False, []
    for dtype, attention in args.configs:
        try:
            out = run_config(args, dtype, attention, device, name)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            failed = True
            out = {"bench": "pytorch_eager_gpt2", "torch": torch.__version__, "device": name,
                   "dtype": dtype, "attention": attention, "micro_batch": args.micro_batch,
                   "seq_len": args.seq_len, "error": str(e).splitlines()[0][:300]}
        torch.cuda.empty_cache()
        print(json.dumps(out, sort_keys=True), flush=True)
        if "error" in out:
            notes.append("%s/%s error" % (dtype, attention))
        else:
            notes.append("%s/%s %.0f tok/s%s" % (
                dtype, attention, out["tokens_per_s"],
                "" if out["mfu"] is None else " (MFU %.1f%%)" % (100 * out["mfu"])))
    # The table note of gpu/check.sh (gpu/rows.py note reads the last `check:` line).
    print("check: " + "; ".join(notes), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

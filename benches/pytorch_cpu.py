#!/usr/bin/env python3
"""CPU training throughput of the bench models in PyTorch: the reference figures that
`cargo bench -p fsdp-suite --bench train` and `benches/side_by_side.py` compare against.
Run by hand (CI does not need PyTorch).

Models (`--model`), each the same architecture `fsdp train` builds:
- `llama`: `transformers`' `LlamaForCausalLM` from benches/llama-bench/config.json, the
  config.json the Rust bench trains (`fsdp train --hf-config`): vocabulary 256 (bytes),
  d_model 512, 8 layers, 8 heads, 4 key/value heads (grouped-query attention), SwiGLU MLP 1376,
  RMSNorm eps 1e-5, rotary base 10000, untied head, no biases; 23,470,592 parameters.
- `mini`, `base`: `GPT2LMHeadModel` of the byte-level presets `fsdp train --model mini|base`
  trains: vocabulary 256, 1024 learned positions, d_model 256 / 768, 4 / 6 layers, 4 / 12
  heads, MLP 4 x d_model, tanh GELU, LayerNorm eps 1e-5, biases, untied head; 3,552,768 /
  43,708,416 parameters.
fp32, no dropout, `attn_implementation="sdpa"` (PyTorch's fused causal attention; what a user
gets).

Training step as `fsdp train`'s defaults: summed-over-tokens cross-entropy divided by the
global token count, AdamW lr 1e-3 (betas 0.9/0.95, eps 1e-8, weight decay 0.1; `foreach`
implementation, the CPU default), global L2 gradient clipping at 1.0. Tokens: bytes of
testdata/tinyshakespeare.txt, random windows of seq_len + 1 (inputs and shifted targets).

Modes:
- `fsdp2`: 2 ranks (processes, `torch.multiprocessing`), gloo, 1 intra-op thread each, FSDP2
  (`torch.distributed.fsdp.fully_shard` on every decoder layer, then on the root; full shard,
  reshard after forward), micro-batch `--micro-batch` per rank.
- `single`: one process, `--threads` intra-op threads (default 2), micro-batch 2 x
  `--micro-batch` (the same global batch).

Timing: `--warmup` steps, then `--steps` steps timed on rank 0 (wall clock, after a barrier).
Prints one JSON line per mode (`"bench": "pytorch_cpu"`, `model`, `mode`, `tokens_per_s`).

  python benches/pytorch_cpu.py --model llama --modes fsdp2,single --steps 6
"""

import argparse
import json
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


GPT_PRESETS = {"mini": (256, 4, 4), "base": (768, 6, 12)}


def build(name, threads):
    """The model `name` in training mode and its decoder blocks (the FSDP units)."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig.from_json_file(os.path.join(HERE, "llama-bench", "config.json"))
        cfg._attn_implementation = "sdpa"
        model = LlamaForCausalLM(cfg).float()
        blocks = list(model.model.layers)
    elif name in GPT_PRESETS:
        from transformers import GPT2Config, GPT2LMHeadModel

        d, layers, heads = GPT_PRESETS[name]
        cfg = GPT2Config(
            vocab_size=256,
            n_positions=1024,
            n_embd=d,
            n_layer=layers,
            n_head=heads,
            activation_function="gelu_new",
            layer_norm_epsilon=1e-5,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=False,
        )
        cfg._attn_implementation = "sdpa"
        model = GPT2LMHeadModel(cfg).float()
        blocks = list(model.transformer.h)
    else:
        raise SystemExit(f"unknown model {name}: use mini, base or llama")
    model.train()
    return model, blocks


def batches(seq_len, micro_batch, rank, steps):
    import torch

    data = open(os.path.join(ROOT, "testdata", "tinyshakespeare.txt"), "rb").read()
    data = torch.tensor(list(data), dtype=torch.long)
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (micro_batch,), generator=g)
        w = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
        out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return out


def train_steps(model, opt, data, global_tokens, clip, barrier=None):
    import torch
    import torch.nn.functional as F

    times = []
    for x, y in data:
        if barrier:
            barrier()
        t0 = time.perf_counter()
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
        ) / global_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def optimizer(model):
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def report(model, mode, times, warmup, tokens_per_step, extra):
    counted = times[warmup:]
    secs = sum(counted)
    print(
        json.dumps(
            {
                "bench": "pytorch_cpu",
                "model": model,
                "mode": mode,
                "global_tokens_per_step": tokens_per_step,
                "step_ms": 1e3 * secs / len(counted),
                "tokens_per_s": tokens_per_step * len(counted) / secs,
                "steps_counted": len(counted),
                **extra,
            }
        ),
        flush=True,
    )


def single(args):
    model, _ = build(args.model, args.threads)
    opt = optimizer(model)
    mb = 2 * args.micro_batch
    data = batches(args.seq_len, mb, 0, args.warmup + args.steps)
    times = train_steps(model, opt, data, mb * args.seq_len, 1.0)
    report(args.model, "single", times, args.warmup, mb * args.seq_len, {"threads": args.threads})


def fsdp2_rank(rank, world, args, port):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, blocks = build(args.model, 1)
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    opt = optimizer(model)
    data = batches(args.seq_len, args.micro_batch, rank, args.warmup + args.steps)
    global_tokens = world * args.micro_batch * args.seq_len
    times = train_steps(model, opt, data, global_tokens, 1.0, barrier=dist.barrier)
    if rank == 0:
        report(args.model, "fsdp2", times, args.warmup, global_tokens, {"world_size": world, "threads": 1})
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama", help="mini, base or llama")
    ap.add_argument("--modes", default="fsdp2,single")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4, help="per rank at W=2")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads of `single`")
    ap.add_argument("--port", type=int, default=29531)
    args = ap.parse_args()
    for mode in args.modes.split(","):
        if mode == "single":
            single(args)
        elif mode == "fsdp2":
            import torch.multiprocessing as mp

            mp.spawn(fsdp2_rank, args=(2, args, args.port), nprocs=2, join=True)
        else:
            raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()

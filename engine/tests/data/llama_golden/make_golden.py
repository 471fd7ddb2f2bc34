"""Golden values for engine/tests/model_llama.rs, computed by Hugging Face transformers.

Run by hand (CI never runs it; it needs PyTorch):

    pip install torch transformers safetensors
    python engine/tests/data/llama_golden/make_golden.py [NAME ...]

(without names: every directory; with names: only those, leaving the others' files as they are).

For each model directory next to this script (llama_gqa: Llama with grouped-query
attention, an untied head and Llama 3.1 rope scaling; qwen2_tied: Qwen2 with q/k/v biases
and a tied head; mistral_window: Mistral with grouped-query attention, rope_theta 1e6 and a
sliding window of 16 tokens, evaluated on 16-token sequences, the longest whose attention the
window does not cut) it reads config.json, builds the model in float64 with eager attention,
draws random weights from a fixed torch seed (projections N(0, 0.15^2), biases N(0, 0.1^2),
RMSNorm gains 1 + N(0, 0.1^2)), and evaluates one fixed batch of token ids and targets.
It writes golden.safetensors with, all float64:
  - every parameter under its Hugging Face name (a tied lm_head is stored once, as
    model.embed_tokens.weight);
  - "grad.<name>": the gradient of the summed loss with respect to that parameter;
  - "logits" [B, T, V], "loss_sum" [1] (sum over tokens of the cross-entropy in nats);
  - "input_ids" and "targets" [B, T] (stored as float64 holding small integers).
"""

import json
import os

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
B = 2
# Sequence length per directory.
MODELS = {"llama_gqa": (1234, 12), "qwen2_tied": (4321, 12), "mistral_window": (2468, 16)}


def make(name, seed, T):
    d = os.path.join(HERE, name)
    cfg = AutoConfig.from_pretrained(d)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    v = cfg.vocab_size
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, v, (B, T), generator=g)
    targets = torch.randint(0, v, (B, T), generator=g)
    out = model(input_ids=ids)
    logits = out.logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, v), targets.reshape(-1), reduction="sum"
    )
    loss.backward()
    tensors = {}
    for n, p in model.named_parameters():  # a tied lm_head is not listed twice
        tensors[n] = p.detach().clone().contiguous()
        tensors["grad." + n] = p.grad.detach().clone().contiguous()
    tensors["logits"] = logits.detach().contiguous()
    tensors["loss_sum"] = loss.detach().reshape(1)
    tensors["input_ids"] = ids.to(torch.float64)
    tensors["targets"] = targets.to(torch.float64)
    save_file(tensors, os.path.join(d, "golden.safetensors"))
    print(name, "loss_sum", float(loss.detach()), "params", sorted(k for k in tensors if not k.startswith("grad.")))


if __name__ == "__main__":
    import sys

    import transformers

    print("torch", torch.__version__, "transformers", transformers.__version__)
    for name in sys.argv[1:] or MODELS:
        seed, t = MODELS[name]
        make(name, seed, t)

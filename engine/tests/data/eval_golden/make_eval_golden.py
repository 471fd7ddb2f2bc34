"""The model directory and golden loss of engine/tests/cli_eval.rs, computed by Hugging Face
transformers.

Run by hand (CI never runs it; it needs PyTorch):

    pip install torch transformers safetensors
    python engine/tests/data/eval_golden/make_eval_golden.py

It writes, next to this script:
  - model/: a small Llama with grouped-query attention (config.json and model.safetensors from
    `save_pretrained`, float32 weights drawn from a fixed torch seed: projections
    N(0, 0.1^2), RMSNorm gains 1 + N(0, 0.1^2)) and a word-level tokenizer.json (words w0..w61,
    [UNK] and [PAD]);
  - tokens.bin: 1000 token ids drawn from a fixed generator, as an fsdp token file (format
    version 1: 64-byte header with the tokenizer.json's SHA-256 and the vocabulary size 64,
    then u16 ids);
  - golden.json: the mean cross-entropy (nats per target token, float64 forward of the float32
    weights, eager attention) over the validation windows `fsdp train` and `fsdp eval` cut from
    tokens.bin with seq_len T = 8: the validation split is the last len // 10 = 100 tokens;
    window w is its tokens w*T .. w*T + T + 1; there are (100 - 1) // T = 12 windows; inputs
    are a window's first T tokens, targets its last T.
"""

import hashlib
import json
import os
import struct

import torch
from transformers import LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB, N, T = 64, 1000, 8


def main():
    model_dir = os.path.join(HERE, "model")
    os.makedirs(model_dir, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    torch.manual_seed(2024)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(model_dir, safe_serialization=True)

    words = {f"w{i}": i for i in range(VOCAB - 2)}
    words["[UNK]"] = VOCAB - 2
    words["[PAD]"] = VOCAB - 1
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "[UNK]"},
    }
    tok_path = os.path.join(model_dir, "tokenizer.json")
    with open(tok_path, "w") as f:
        json.dump(tokenizer, f, indent=1)
    with open(tok_path, "rb") as f:
        sha = hashlib.sha256(f.read()).digest()

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB - 2, (N,), generator=g).tolist()
    header = b"FSDPTOK\0" + struct.pack("<IIQQ", 1, 2, N, VOCAB) + sha
    assert len(header) == 64
    with open(os.path.join(HERE, "tokens.bin"), "wb") as f:
        f.write(header + struct.pack(f"<{N}H", *ids))

    val = ids[N - N // 10 :]
    n_windows = (len(val) - 1) // T
    windows = torch.tensor([val[w * T : w * T + T + 1] for w in range(n_windows)])
    m64 = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64, attn_implementation="eager")
    m64.eval()
    with torch.no_grad():
        logits = m64(input_ids=windows[:, :T]).logits
        loss_sum = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), windows[:, 1:].reshape(-1), reduction="sum"
        )
    tokens = n_windows * T
    golden = {
        "seq_len": T,
        "val_windows": n_windows,
        "tokens": tokens,
        "loss_sum": float(loss_sum),
        "loss": float(loss_sum) / tokens,
        "tokenizer_sha256": sha.hex(),
    }
    with open(os.path.join(HERE, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    print(golden)


if __name__ == "__main__":
    import transformers

    print("torch", torch.__version__, "transformers", transformers.__version__)
    main()

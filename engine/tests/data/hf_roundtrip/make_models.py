"""Writes three small random Hugging Face model directories, as `save_pretrained` does, for the
by-hand round trip in `run.sh` (run by hand; CI never needs PyTorch):

- `llama-bf16`: a Llama 3.1-style model (grouped-query attention, `llama3` rope scaling,
  untied head) stored in bfloat16 and split into several files with an index;
- `qwen2-f32`: a Qwen2 model (q/k/v biases, tied head) in float32, one file;
- `gpt2-f16`: a GPT-2 model (tied head) in float16.

    pip install torch transformers safetensors
    python make_models.py OUT_DIR
"""

import os
import sys

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

out = sys.argv[1] if len(sys.argv) > 1 else "."
torch.manual_seed(0)
llama = LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
)
LlamaForCausalLM(llama).to(torch.bfloat16).save_pretrained(
    os.path.join(out, "llama-bf16"), safe_serialization=True, max_shard_size="100KB"
)
qwen = Qwen2Config(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    tie_word_embeddings=True,
)
Qwen2ForCausalLM(qwen).save_pretrained(os.path.join(out, "qwen2-f32"), safe_serialization=True)
torch.manual_seed(1)
gpt2 = GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4)
GPT2LMHeadModel(gpt2).to(torch.float16).save_pretrained(
    os.path.join(out, "gpt2-f16"), safe_serialization=True
)

"""Writes four small random Hugging Face model directories, as `save_pretrained` does, for the
by-hand round trip in `run.sh` (run by hand; CI never needs PyTorch):

- `llama-bf16`: a Llama 3.1-style model (grouped-query attention, `llama3` rope scaling,
  untied head) stored in bfloat16 and split into several files with an index;
- `qwen2-f32`: a Qwen2 model (q/k/v biases, tied head) in float32, one file;
- `mistral-f32`: a Mistral model (sliding-window attention, untied head) in float32;
- `gpt2-f16`: a GPT-2 model (tied head) in float16.

Each holds a byte-level tokenizer (`tokenizer.json`, `tokenizer_config.json`, ...) whose ids are
the bytes of the text (0..=255, what `fsdp train` trains on for a text file) plus `<s>` = 256
and `</s>` = 257, named by `bos_token_id` / `eos_token_id` in `config.json` and
`generation_config.json`: the files `fsdp ckpt consolidate` must copy for `AutoTokenizer` and
`generate` to work on the export.

    pip install torch transformers safetensors
    python make_models.py OUT_DIR
"""

import os
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB, BOS, EOS = 258, 256, 257


def bytes_to_unicode():
    """GPT-2's byte-to-character table of the byte-level pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_tokenizer():
    """A byte-level BPE without merges: token id = byte value; `<s>`, `</s>` after them."""
    vocab = {c: b for b, c in bytes_to_unicode().items()}
    vocab["<s>"], vocab["</s>"] = BOS, EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def save(model, name, **kw):
    d = os.path.join(out, name)
    model.save_pretrained(d, safe_serialization=True, **kw)
    byte_tokenizer().save_pretrained(d)


out = sys.argv[1] if len(sys.argv) > 1 else "."
special = dict(vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS)
torch.manual_seed(0)
llama = LlamaConfig(
    hidden_size=64, intermediate_size=160, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    **special,
)
save(LlamaForCausalLM(llama).to(torch.bfloat16), "llama-bf16", max_shard_size="100KB")
qwen = Qwen2Config(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    tie_word_embeddings=True, **special,
)
save(Qwen2ForCausalLM(qwen), "qwen2-f32")
mistral = MistralConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    sliding_window=128, tie_word_embeddings=False, **special,
)
save(MistralForCausalLM(mistral), "mistral-f32")
torch.manual_seed(1)
gpt2 = GPT2Config(n_positions=128, n_embd=64, n_layer=2, n_head=4, **special)
save(GPT2LMHeadModel(gpt2).to(torch.float16), "gpt2-f16")

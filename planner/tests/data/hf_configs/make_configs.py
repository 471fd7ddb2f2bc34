"""config.json files written by Hugging Face transformers itself, for planner/tests/hf_readers.rs.

Run by hand (CI never runs it; it needs transformers):

    pip install transformers
    python planner/tests/data/hf_configs/make_configs.py

Each file is `save_pretrained` of a transformers config class built with the sizes and
numerics of one case of the test (the `llama-tiny` and `llama-mini` presets, and variants of
`llama-tiny` as Qwen2 and Mistral), so the test can compare the config.json fsdp-rs generates
for the same model with what transformers writes, key by key.
"""

import json
import os
import shutil
import tempfile

import transformers
from transformers import LlamaConfig, MistralConfig, Qwen2Config

HERE = os.path.dirname(os.path.abspath(__file__))

TINY = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
MINI = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)

CASES = {
    # The llama-tiny preset.
    "llama_tiny": LlamaConfig(
        architectures=["LlamaForCausalLM"],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        dtype="float32",
        **TINY,
    ),
    # llama-mini with Llama 3.1 rope scaling.
    "llama_mini_llama3_rope": LlamaConfig(
        architectures=["LlamaForCausalLM"],
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
        dtype="float32",
        **MINI,
    ),
    # llama-tiny sizes as Qwen2: q/k/v biases, tied head, a sliding window of 64.
    "qwen2_window": Qwen2Config(
        architectures=["Qwen2ForCausalLM"],
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        use_sliding_window=True,
        sliding_window=64,
        tie_word_embeddings=True,
        dtype="float32",
        **TINY,
    ),
    # llama-tiny sizes as Mistral with a sliding window of 64.
    "mistral_window": MistralConfig(
        architectures=["MistralForCausalLM"],
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        sliding_window=64,
        tie_word_embeddings=False,
        dtype="float32",
        **TINY,
    ),
}

if __name__ == "__main__":
    print("transformers", transformers.__version__)
    for name, cfg in CASES.items():
        with tempfile.TemporaryDirectory() as d:
            cfg.save_pretrained(d)
            shutil.copy(os.path.join(d, "config.json"), os.path.join(HERE, name + ".json"))
        print(name, json.load(open(os.path.join(HERE, name + ".json")))["model_type"])

"""Checks that a model directory written by `fsdp ckpt consolidate CK -o DIR` loads in
Hugging Face transformers and computes the validation loss `fsdp train` reported.

Run by hand (CI never runs it; it needs PyTorch and transformers):

    pip install torch transformers safetensors
    fsdp train --model llama-tiny --data FILE --steps 2 --micro-batch 2 --seq-len 64 \
        --eval-batches 4 --ckpt-dir ck --ckpt-every 2 --json     # note the last val_loss
    fsdp ckpt consolidate ck -o exported
    python engine/tests/data/hf_export_check.py exported FILE --seq-len 64 \
        --micro-batch 2 --eval-batches 4 --world-size 1 --expect VAL_LOSS

With --generate it also loads DIR's tokenizer with `AutoTokenizer.from_pretrained` (the files
the export copied from the model directory the run started from), checks that it encodes text
to its bytes (the ids `fsdp train` trains on) and that `config.json` names the tokenizer's bos /
eos ids, and runs `generate` greedily from a prompt, printing the continuation; it exits 1 when
any of that fails.

It loads DIR with `AutoModelForCausalLM.from_pretrained` (eager attention), rebuilds the
validation batches of `fsdp train` from the same data file (byte tokens; the last
len // 10 bytes are the validation split, cut into windows of seq_len + 1 bytes at stride
seq_len, in file order; global validation batch v holds windows v*B .. (v+1)*B modulo the
window count, and all world_size * eval_batches of them are evaluated) and prints the mean
cross-entropy over every target token in float32 and float64, and the difference from
--expect. It exits 1 when the float32 loss differs from --expect by more than --tol.
"""

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def val_batches(data, seq_len, micro_batch, eval_batches, world_size):
    val = data[len(data) - len(data) // 10 :]
    n_val = (len(val) - 1) // seq_len if len(val) >= seq_len + 1 else 0
    assert n_val > 0, "validation split shorter than one window"
    per = max(1, min(n_val // (micro_batch * world_size), eval_batches or 10**9))
    out = []
    for j in range(per):
        for r in range(world_size):
            v = j * world_size + r
            ws = [(q % n_val) for q in range(v * micro_batch, (v + 1) * micro_batch)]
            x = [list(val[w * seq_len : w * seq_len + seq_len]) for w in ws]
            y = [list(val[w * seq_len + 1 : w * seq_len + seq_len + 1]) for w in ws]
            out.append((torch.tensor(x), torch.tensor(y)))
    return out


def mean_loss(model, batches, vocab):
    total, n = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, vocab).double(), y.reshape(-1), reduction="sum"
            )
            total += loss.item()
            n += y.numel()
    return total / n


def check_generate(model, model_dir, prompt, new_tokens):
    """AutoTokenizer on the export, its ids against the bytes, config bos/eos, greedy generate."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(prompt)["input_ids"]
    print(f"tokenizer {type(tok).__name__}: {len(tok)} tokens, bos {tok.bos_token_id}, "
          f"eos {tok.eos_token_id}")
    problems = []
    if ids != list(prompt.encode()):
        problems.append(f"encodes {prompt!r} to {ids}, not its bytes")
    cfg = model.config
    if (cfg.bos_token_id, cfg.eos_token_id) != (tok.bos_token_id, tok.eos_token_id):
        problems.append(
            f"config.json bos/eos {cfg.bos_token_id}/{cfg.eos_token_id}, tokenizer "
            f"{tok.bos_token_id}/{tok.eos_token_id}"
        )
    gen = model.generation_config
    print(f"generation_config: bos {gen.bos_token_id}, eos {gen.eos_token_id}")
    x = torch.tensor([ids])
    with torch.no_grad():
        y = model.generate(
            input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
            do_sample=False, pad_token_id=tok.eos_token_id,
        )
    cont = y[0, x.shape[1]:].tolist()
    print(f"generate({prompt!r}, {new_tokens} new tokens, greedy): {tok.decode(cont)!r}")
    if not 0 < len(cont) <= new_tokens:
        problems.append(f"generate returned {len(cont)} new tokens")
    for p in problems:
        print(f"FAIL: {p}")
    return not problems


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("data")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--micro-batch", type=int, required=True)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--expect", type=float)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--generate", action="store_true")
    ap.add_argument("--prompt", default="First Citizen:")
    ap.add_argument("--new-tokens", type=int, default=24)
    a = ap.parse_args()
    data = open(a.data, "rb").read()
    batches = val_batches(data, a.seq_len, a.micro_batch, a.eval_batches, a.world_size)
    # float32 whatever the files store (a bf16 checkpoint is upcast, as fsdp-rs's master is).
    model = AutoModelForCausalLM.from_pretrained(
        a.model_dir, attn_implementation="eager", dtype=torch.float32
    )
    model.eval()
    vocab = model.config.vocab_size
    l32 = mean_loss(model, batches, vocab)
    l64 = mean_loss(model.double(), batches, vocab)
    print(f"model {type(model).__name__} from {a.model_dir}: {len(batches)} batches")
    print(f"transformers loss float32 weights: {l32:.8f}")
    print(f"transformers loss float64 compute: {l64:.8f}")
    failed = False
    if a.expect is not None:
        print(f"fsdp-rs val_loss:                  {a.expect:.8f}")
        print(f"difference (float32 - fsdp-rs):    {l32 - a.expect:.3e}")
        if abs(l32 - a.expect) > a.tol:
            print(f"FAIL: differs by more than {a.tol}")
            failed = True
    if a.generate:
        failed |= not check_generate(model.float(), a.model_dir, a.prompt, a.new_tokens)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()

#!/bin/bash
# The by-hand round trip from published weights and back (needs PyTorch and transformers):
#   python make_models.py /tmp/hf && PYTHON=python bash run.sh /tmp/hf/llama-bf16
# 1. `fsdp train --init-from DIR` with a negligible learning rate: fsdp-rs's validation loss of
#    the loaded weights against transformers' on the same windows (hf_export_check.py);
# 2. 30 steps of training, `fsdp ckpt consolidate` to a model directory, and the validation
#    loss fsdp-rs reported against transformers' on the export;
# 3. the export is a complete model directory: the tokenizer and generation files of the
#    source, byte for byte (cmp), `AutoTokenizer.from_pretrained` and `generate` on it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../../.." && pwd)
fsdp=${FSDP:-$repo/target/release/fsdp}
data=$repo/testdata/tinyshakespeare.txt
model=$1
python=${PYTHON:-python3}   # one with torch and transformers
work=$(mktemp -d)
common=(--data "$data" --world-size 2 --seq-len 64 --micro-batch 2 --eval-batches 4 --json)
check() {
    "$python" "$here/../hf_export_check.py" "$1" "$data" --seq-len 64 --micro-batch 2 \
        --eval-batches 4 --world-size 2 --expect "$2" "${@:3}"
}
val() { tail -1 "$1" | "$python" -c 'import json,sys; print(json.load(sys.stdin)["final_val_loss"])'; }
"$fsdp" train --init-from "$model" "${common[@]}" --steps 1 --lr 1e-30 --min-lr 1e-30 \
    --warmup 0 > "$work/import.json"
check "$model" "$(val "$work/import.json")"
"$fsdp" train --init-from "$model" "${common[@]}" --steps 30 --lr 3e-3 --warmup 3 \
    --ckpt-dir "$work/ck" --ckpt-every 30 > "$work/train.json"
"$fsdp" ckpt consolidate "$work/ck" -o "$work/out"
for f in tokenizer.json tokenizer_config.json special_tokens_map.json generation_config.json \
    tokenizer.model vocab.json merges.txt; do
    if [ -f "$model/$f" ]; then
        cmp "$model/$f" "$work/out/$f" && echo "$f: byte-identical to the source"
    fi
done
check "$work/out" "$(val "$work/train.json")" --generate
echo "work files in $work"

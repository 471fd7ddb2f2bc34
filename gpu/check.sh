#!/usr/bin/env bash
# The one prepared GPU check, for the H200 test machine (see gpu/README.md).
# Runs from the repo root with target-gpu/ built by gpu/build.sh; writes one log per row to
# $OUT (default ./gpu-out), prints a short table last and writes $OUT/results.md (ready to
# commit under benches/results/). Budget: under 8 minutes (BUDGET_S, default 470 s: a row
# gets at most the time left, rows past it are NOT RUN).
#
#   . target-gpu/device-env.sh && gpu/check.sh
#
# Exit 0 only when every row passed. On a machine without a GPU (neither nvidia-smi nor torch
# sees one) every device row is SKIPPED and the script exits 1; rows the CPU can run (kernel
# unit tests, the CPU references of the tiny-GPT comparison) still run.
#
# Environment: OUT (log folder), BUDGET_S, FSDP_GPU_DIR (default target-gpu), TORCH_PYTHON
# (default /opt/torch/.venv/bin/python, else python3), FSDP_PEAK_TFLOPS_FP32 / _BF16 (MFU
# peaks when the GPU is not in gpu/gpt_metrics.py's table).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
BUDGET_S=${BUDGET_S:-470}
G=${FSDP_GPU_DIR:-target-gpu}
export PYTHONDONTWRITEBYTECODE=1
START=$(date +%s)
mkdir -p "$OUT"
# Files this script appends to or derives (row logs are overwritten by their rows).
rm -f "$OUT/metrics.jsonl" "$OUT/commands.txt" "$OUT/summary.txt" "$OUT/results.md" \
  "$OUT/pytorch_gpt2.jsonl" "$OUT/nccl_bandwidth.jsonl"
[ -f "$G/fsdp.xz" ] || { echo "check.sh: $G/fsdp.xz missing: run gpu/build.sh on the build machine" >&2; exit 2; }
# Unpack the xz-compressed executables (gpu/build.sh) into machine-local scratch (xz, else
# Python's lzma).
T=${TMPDIR:-/tmp}/fsdp-gpu-bin
mkdir -p "$T"
unxz_to() { # unxz_to FILE.xz OUT
  if command -v xz >/dev/null 2>&1; then xz -dc "$1" > "$2"
  else python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$1" > "$2"; fi
}
for f in "$G"/*.xz; do unxz_to "$f" "$T/$(basename "$f" .xz)" && chmod +x "$T/$(basename "$f" .xz)"; done
cp "$G/BUILD" "$T/BUILD"
ORIG_LD_LIBRARY_PATH=${LD_LIBRARY_PATH-}
# shellcheck disable=SC1091
. "$G/device-env.sh"
export RUST_BACKTRACE=1
TORCH_PY=${TORCH_PYTHON:-/opt/torch/.venv/bin/python}
[ -x "$TORCH_PY" ] || TORCH_PY=python3
ROWS=()
declare -A STATUS
FAILED=0
row() { # row NAME STATUS TIME NOTE
  ROWS+=("$(printf '%-34s %-9s %7s  %s' "$1" "$2" "$3" "$4")")
  STATUS[$1]=$2
  case $2 in PASS) ;; *) FAILED=1 ;; esac
}

# run NAME TIMEOUT_S CMD...: runs with a time limit (at most what is left of BUDGET_S), logs
# to $OUT/NAME.log, records the command in $OUT/commands.txt and a row in the table.
run() {
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then
    row "$name" "NOT RUN" "-" "time budget of ${BUDGET_S}s spent"
    echo "== $name: NOT RUN (time budget spent)"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  # Exact (shell-quoted) command, with the unpacked binaries and this run's log folder named
  # as in the README: target-gpu/NAME (unpacked) and $OUT.
  { printf '%q ' "$@"; echo; } | sed -e "s#$T/#target-gpu/#g" -e "s#$OUT/#\$OUT/#g" \
    -e "s#$PWD/gpu/#gpu/#g" >> "$OUT/commands.txt"
  local t0
  t0=$(date +%s.%N)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local secs
  secs=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
  local status=PASS
  [ $rc -eq 0 ] || status="FAIL($rc)"
  [ $rc -eq 124 ] && status=TIMEOUT
  # On the GPU machine a skipped CUDA test is a failed check (no device seen, library missing).
  [ $rc -eq 0 ] && grep -q "SKIPPED (no CUDA device)" "$OUT/$name.log" && status=SKIPPED
  local note
  note=$(python3 gpu/rows.py note "$OUT/$name.log" | cut -c1-90)
  row "$name" "$status" "${secs}s" "$note"
  echo "== $name: $status in ${secs}s (log $OUT/$name.log)"
}

# ran NAME...: every named row ran to completion (PASS).
ran() { local n; for n in "$@"; do [ "${STATUS[$n]-}" = PASS ] || return 1; done; }
# started NAME: the row ran at all (PASS, FAIL, TIMEOUT: its log may hold step lines).
started() { case ${STATUS[$1]-none} in PASS|FAIL*|TIMEOUT) return 0 ;; *) return 1 ;; esac; }
# needs NAME REASON...: records NAME as not run because of its inputs.
needs() { local name=$1; shift; row "$name" "NOT RUN" "-" "$*"; echo "== $name: NOT RUN ($*)"; }

# The GPU: nvidia-smi (on PATH or where the NVIDIA container runtime puts it), else torch.
SMI=
for s in nvidia-smi /usr/local/nvidia/bin/nvidia-smi /usr/bin/nvidia-smi; do
  command -v "$s" > /dev/null 2>&1 && { SMI=$s; break; }
done
if [ -n "$SMI" ]; then
  GPU_NAME=$("$SMI" --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
else
  GPU_NAME=$(env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" timeout 120 "$TORCH_PY" -c \
    'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' \
    2>/dev/null | tail -n 1)
fi
{ date -u +%FT%TZ; hostname; cat "$T/BUILD"
  if [ -n "$SMI" ]; then "$SMI" --query-gpu=name,driver_version,memory.total --format=csv
  else echo "no nvidia-smi; GPU by torch: ${GPU_NAME:-none}"; fi
  echo "torch python: $TORCH_PY"; } > "$OUT/machine.log" 2>&1
cat "$OUT/machine.log"
# The engine rows need a GPU and an fsdp binary with the engine's CUDA path (`train --device`).
ENGINE_GATE=
if [ -z "$GPU_NAME" ]; then
  ENGINE_GATE="SKIPPED|no CUDA device (neither nvidia-smi nor torch sees one)"
elif ! "$T/fsdp" train --help 2>/dev/null | grep -q -- '--device'; then
  ENGINE_GATE="NOT RUN|target-gpu/fsdp has no 'train --device': rebuild with gpu/build.sh"
fi
# engine NAME TIMEOUT_S CMD...: `run` for a row that needs the engine's CUDA path.
engine() {
  if [ -n "$ENGINE_GATE" ]; then
    row "$1" "${ENGINE_GATE%%|*}" "-" "${ENGINE_GATE#*|}"
    echo "== $1: ${ENGINE_GATE%%|*} (${ENGINE_GATE#*|})"
  else
    run "$@"
  fi
}

# A machine that lists a GPU must run every CUDA test: there a missing device, driver or library
# fails the test instead of skipping it (FSDP_REQUIRE_CUDA=1).
if [ -n "$GPU_NAME" ]; then export FSDP_REQUIRE_CUDA=1; fi

# 1. CUDA kernels against the CPU reference (bounds in each kernel's docstring).
run kernels_unit 60 "$T/kernels_unit" --nocapture
run cuda_kernels_vs_cpu 120 "$T/cuda_kernels" --skip cuda_tensor_kernels:: --nocapture --test-threads=1
run cuda_tensor_kernels_vs_cpu 120 "$T/cuda_kernels" cuda_tensor_kernels:: --nocapture --test-threads=1

# 2. NCCL: unit tests (NVRTC reduction source, codecs), conformance at world size 1
#    (rank-order and NCCL reductions) and the device-buffer calls.
run comm_unit 60 "$T/comm_unit" --nocapture
run nccl_conformance_w1 180 "$T/nccl_conformance" --exact nccl_conformance_world_size_1 --nocapture
run nccl_device_buffers_w1 60 "$T/nccl_conformance" --exact nccl_device_buffers_in_place --nocapture
run nccl_tensor_buffers_w1 60 "$T/nccl_conformance" --exact nccl_tensor_buffers_in_place --nocapture

# 3. NCCL conformance with 2 processes on the one GPU (distinct NCCL_HOSTID per process,
#    loopback sockets), started by `fsdp launch`.
NCCL2=(env NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 FSDP_NCCL_HOSTID_PER_RANK=fsdp)
run nccl_conformance_2proc 240 "${NCCL2[@]}" "$T/fsdp" launch --nproc 2 --master-port 29531 \
  --program "$T/nccl_conformance" -- --exact nccl_conformance_processes --nocapture --test-threads=1

# 4. Bandwidth: world size 1 up to 1 GiB buffers; 2 processes (loopback, ~2 GB/s) up to 16 MiB.
run nccl_bandwidth_w1 120 "$T/nccl_bandwidth"
run nccl_bandwidth_2proc 120 "${NCCL2[@]}" FSDP_BENCH_MAX_MB=16 "$T/fsdp" launch --nproc 2 \
  --master-port 29532 --program "$T/nccl_bandwidth"
grep -h '"bench":"nccl_bandwidth"' "$OUT"/nccl_bandwidth_*.log 2>/dev/null | sed 's/^\[rank 0\] //' \
  > "$OUT/nccl_bandwidth.jsonl"

# 5. The engine on CUDA against the CPU: tiny GPT (0.89M params), 10 steps, seed 1337, micro-batch
#    8 x 128 tokens of the embedded corpus, world size 1, full shard; the same binary and flags
#    with and without --device cuda. Per-step losses (`--json`) within 1e-3 nats in f32 (both
#    IEEE f32, no TF32: only summation order differs) and 1e-2 nats in bf16 (the bound the
#    CPU's bf16-vs-f32 test uses; CUDA and CPU round bf16 products at the same points but
#    accumulate in different orders).
TINY=(train --model tiny --steps 10 --micro-batch 8 --seq-len 128 --seed 1337 --eval-batches 1 --json)
M=$OUT/metrics.jsonl
run tiny_cpu_f32 120 "$T/fsdp" "${TINY[@]}"
run tiny_cpu_bf16 120 "$T/fsdp" "${TINY[@]}" --param-dtype bf16
engine tiny_cuda_f32 120 "$T/fsdp" "${TINY[@]}" --device cuda
engine tiny_cuda_bf16 120 "$T/fsdp" "${TINY[@]}" --device cuda --param-dtype bf16
for dt in f32 bf16; do
  tol=1e-3; [ $dt = bf16 ] && tol=1e-2
  if ran tiny_cuda_$dt tiny_cpu_$dt; then
    run tiny_cuda_vs_cpu_$dt 30 python3 gpu/rows.py losses tiny_cuda_vs_cpu_$dt \
      "$OUT/tiny_cuda_$dt.log" "$OUT/tiny_cpu_$dt.log" --tol $tol --steps 10 --metrics "$M"
  else
    needs tiny_cuda_vs_cpu_$dt "needs tiny_cuda_$dt and tiny_cpu_$dt to pass"
  fi
done

# 6. Two processes on the one GPU with the NCCL backend (as row 3; gpu/one_gpu_rank.sh puts
#    every rank on device 0 with its own NCCL_HOSTID): the same tiny run as tiny_cuda_f32 split
#    over 2 ranks (micro-batch 4 per rank: the sampler gives them exactly the 8 windows of the
#    world-size-1 step); losses within 1e-3 nats of tiny_cuda_f32.
engine tiny_nccl_2proc_f32 180 "${NCCL2[@]}" FSDP_BIN="$T/fsdp" "$T/fsdp" launch --nproc 2 \
  --master-port 29533 --program "$PWD/gpu/one_gpu_rank.sh" -- \
  train --model tiny --steps 10 --micro-batch 4 --seq-len 128 --seed 1337 --eval-batches 1 --json \
  --device cuda --backend nccl
if ran tiny_nccl_2proc_f32 tiny_cuda_f32; then
  run tiny_nccl_2proc_vs_w1 30 python3 gpu/rows.py losses tiny_nccl_2proc_vs_w1 \
    "$OUT/tiny_nccl_2proc_f32.log" "$OUT/tiny_cuda_f32.log" --tol 1e-3 --steps 10 --metrics "$M"
else
  needs tiny_nccl_2proc_vs_w1 "needs tiny_nccl_2proc_f32 and tiny_cuda_f32 to pass"
fi

# 7. PyTorch eager GPT-2 124M on the same GPU (gpu/pytorch_gpt2_eager.py): fp32 and autocast
#    bf16, fused SDPA attention and the materialised T x T attention fsdp-rs computes;
#    micro-batch 16 x 1024, 3 warm-up steps, 10 timed. Needs a GPU, not the engine.
if [ -n "$GPU_NAME" ]; then
  run pytorch_eager_gpt2 150 env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" "$TORCH_PY" \
    gpu/pytorch_gpt2_eager.py --configs fp32:sdpa,bf16:sdpa,fp32:math,bf16:math \
    --micro-batch 16 --seq-len 1024 --warmup-steps 3 --steps 10
  grep -h '"bench": "pytorch_eager_gpt2"' "$OUT/pytorch_eager_gpt2.log" > "$OUT/pytorch_gpt2.jsonl" 2>/dev/null
else
  row pytorch_eager_gpt2 SKIPPED "-" "no CUDA device (neither nvidia-smi nor torch sees one)"
fi

# 8. GPT-2 124M training throughput, fsdp-rs: full shard, world size 1, micro-batch 16 x 1024
#    tokens, 8 steps, the first 3 not timed; fp32 (IEEE, no TF32) and bf16 compute (fp32 master
#    weights, gradients and AdamW state). tokens/s and MFU (gpu/rows.py throughput).
GPT2=(train --model gpt2 --seq-len 1024 --micro-batch 16 --steps 8 --strategy full-shard
      --eval-batches 1 --json --device cuda)
engine gpt2_fsdp_fp32 150 "$T/fsdp" "${GPT2[@]}"
engine gpt2_fsdp_bf16 120 "$T/fsdp" "${GPT2[@]}" --param-dtype bf16
for dt in fp32 bf16; do
  if started gpt2_fsdp_$dt; then
    peak_var=FSDP_PEAK_TFLOPS_${dt^^}
    run gpt2_fsdp_${dt}_mfu 30 python3 gpu/rows.py throughput gpt2_fsdp_$dt "$OUT/gpt2_fsdp_$dt.log" \
      --model gpt2 --seq-len 1024 --dtype $dt --warmup-steps 3 --gpu-name "$GPU_NAME" \
      ${!peak_var:+--peak-tflops ${!peak_var}} --metrics "$M"
  else
    needs gpt2_fsdp_${dt}_mfu "needs gpt2_fsdp_$dt"
  fi
done
# (A PyTorch config that failed, e.g. out of memory, leaves the others' figures.)
if { ran gpt2_fsdp_fp32_mfu || ran gpt2_fsdp_bf16_mfu; } && started pytorch_eager_gpt2; then
  run gpt2_fsdp_vs_pytorch 30 python3 gpu/rows.py ratio gpt2_fsdp_vs_pytorch --metrics "$M" \
    --pytorch "$OUT/pytorch_gpt2.jsonl"
else
  needs gpt2_fsdp_vs_pytorch "needs a gpt2_fsdp_*_mfu figure and pytorch_eager_gpt2"
fi

# 9. The plan's device bytes against the measured device peak (the summary's `device memory:
#    plan P B, measured peak M B (r)` line): within 5% for both GPT-2 runs; the tiny runs'
#    ratios are printed for information (fixed device overheads dominate a 0.9M model).
if started gpt2_fsdp_fp32 || started gpt2_fsdp_bf16; then
  run plan_vs_device_memory 30 python3 gpu/rows.py memory plan_vs_device_memory \
    "$OUT/gpt2_fsdp_fp32.log" "$OUT/gpt2_fsdp_bf16.log" \
    --info "$OUT/tiny_cuda_f32.log" "$OUT/tiny_cuda_bf16.log" --tol 0.05 --metrics "$M"
else
  needs plan_vs_device_memory "needs gpt2_fsdp_fp32 / gpt2_fsdp_bf16"
fi

# 10. A measured hardware profile of this GPU (`fsdp calibrate --device cuda`: GEMM per dtype up
#     to 8192 x 8192, device copy, elementwise and host link rates; collectives not measured
#     with one device), printed in the log and kept as $OUT/h200-calibrated.json; `fsdp plan
#     --time --hardware` must accept it.
engine calibrate_cuda 120 "$T/fsdp" calibrate --device cuda --name h200-calibrated \
  --output "$OUT/h200-calibrated.json"
if ran calibrate_cuda; then
  cat "$OUT/h200-calibrated.json"
  run calibrate_cuda_plan 30 "$T/fsdp" plan --model gpt2 --micro-batch 16 --seq-len 1024 \
    --time --hardware "$OUT/h200-calibrated.json"
else
  needs calibrate_cuda_plan "needs calibrate_cuda"
fi

# 11. The step-time model on this GPU: each GPT-2 run of row 8 against `fsdp plan --time` for
#     the same flags, on the built-in h200 profile (vendor figures) and on the profile row 10
#     measured; within 25% (gpu/rows.py steptime: the run's median step, the first excluded).
#     Plans only: no device time beyond row 8's runs.
GPT2_PLAN=(plan --model gpt2 --seq-len 1024 --micro-batch 16 --strategy full-shard --device cuda
           --format json)
for dt in fp32 bf16; do
  flag=(); [ $dt = bf16 ] && flag=(--param-dtype bf16)
  for hw in h200 calibrated; do
    name=gpt2_step_time_${dt}_$hw
    profile=h200; [ $hw = calibrated ] && profile=$OUT/h200-calibrated.json
    if ! started gpt2_fsdp_$dt; then
      needs "$name" "needs gpt2_fsdp_$dt"
    elif [ $hw = calibrated ] && ! ran calibrate_cuda; then
      needs "$name" "needs calibrate_cuda"
    else
      run "$name" 60 bash -c 'n=$0 log=$1 plan=$2 m=$3; shift 3
        "$@" && python3 gpu/rows.py steptime "$n" "$log" "$plan" --metrics "$m"' \
        "$name" "$OUT/gpt2_fsdp_$dt.log" "$OUT/$name.plan.json" "$M" \
        "$T/fsdp" "${GPT2_PLAN[@]}" "${flag[@]}" --hardware "$profile" -o "$OUT/$name.plan.json"
    fi
  done
done

echo
{ printf '%-34s %-9s %7s  %s\n' "check" "status" "time" "last result line"
  printf '%s\n' "${ROWS[@]}"; } | tee "$OUT/summary.txt"
grep -E '"collective":"(all_gather|reduce_scatter)".*"bytes":(1073741824|16777216)' "$OUT/nccl_bandwidth.jsonl" \
  | python3 -c '
import json, sys
for l in sys.stdin:
    m = json.loads(l)
    w, c, r, d = m["world_size"], m["collective"], m["reduction"], m["dtype"]
    mib, alg, bus = m["bytes"] >> 20, m["algbw_gbs"], m["busbw_gbs"]
    print("bandwidth W=%d %-14s %-10s %-4s %5d MiB  algbw %8.1f GB/s  busbw %8.1f GB/s" % (w, c, r, d, mib, alg, bus))
' | tee -a "$OUT/summary.txt"
echo "total $(( $(date +%s) - START )) s of budget ${BUDGET_S} s" | tee -a "$OUT/summary.txt"
python3 gpu/rows.py report "$OUT"
echo "commit it: cp $OUT/results.md benches/results/$(date -u +%F)-gpu-check.md"
exit $FAILED

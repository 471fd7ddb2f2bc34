#!/usr/bin/env bash
# Builds everything gpu/check.sh runs, on a machine WITHOUT a GPU, and puts it in target-gpu/
# (git-ignored) for the GPU machine, which has no Rust toolchain:
# (each executable stripped and xz-compressed: target-gpu/NAME.xz)
#   target-gpu/fsdp              the CLI (--features cuda; `fsdp launch` starts the ranks)
#   target-gpu/cuda_kernels      kernels/tests/cuda_kernels.rs (CUDA kernels vs the CPU)
#   target-gpu/kernels_unit      fsdp-kernels' unit tests (span tiles, grids, device probe)
#   target-gpu/nccl_conformance  engine/comm/tests/nccl_conformance.rs
#   target-gpu/comm_unit         fsdp-comm's unit tests (NVRTC reduction source, codecs)
#   target-gpu/nccl_bandwidth    engine/comm/benches/nccl_bandwidth.rs
#   target-gpu/device-env.sh     library paths of the GPU machine (gpu/device-env.sh)
#   target-gpu/BUILD             commit, date, rustc of this build, whether `fsdp train` has
#                                the engine's CUDA path (`--device`)
# The engine rows of gpu/check.sh run target-gpu/fsdp itself (train --device cuda, launch
# --backend nccl) and the Python files beside this script (gpu/rows.py, gpu/gpt_metrics.py,
# gpu/pytorch_gpt2_eager.py: tracked files, they travel with the work tree); this script
# compiles those and runs their unit tests (gpu/test_gpu_tools.py), so a broken one is found
# here, not on the GPU machine.
# Usage (repo root): gpu/build.sh        (~35-40 min the first time on 2 cores, ~20 of them
# candle-kernels' nvcc; a few minutes after a change)
# Builds go to target-cuda/ under `nice -n 19` (the team's rule for --features cuda builds).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${FSDP_GPU_PACK:-1}" = 0 ] || command -v xz >/dev/null 2>&1 || { echo "gpu/build.sh: xz not found (it compresses target-gpu/): apt-get install xz-utils" >&2; exit 2; }
# The check's Python: syntax (torch is not needed to compile the PyTorch baseline) and tests.
PYTHONDONTWRITEBYTECODE=1 python3 - <<'PY'
import pathlib
for f in sorted(pathlib.Path("gpu").glob("*.py")):
    compile(f.read_text(), str(f), "exec")
PY
PYTHONDONTWRITEBYTECODE=1 python3 -m unittest discover -s gpu -p 'test_*.py'
# The CUDA 13 toolkit: gpu/cuda-toolkit.sh installs it from NVIDIA's wheels (first run ~1-3 min,
# cached) and prints its `export` lines; FSDP_CUDA_ENV names another script that prints them.
# The GPU machine's library paths: gpu/device-env.sh, or the file FSDP_DEVICE_ENV names; copied
# beside the executables. CARGO_TARGET_DIR: where to build (default target-cuda/).
CUDA_ENV=${FSDP_CUDA_ENV:-gpu/cuda-toolkit.sh}
DEVICE_ENV=${FSDP_DEVICE_ENV:-gpu/device-env.sh}
for f in "$CUDA_ENV" "$DEVICE_ENV"; do
  [ -f "$f" ] || { echo "gpu/build.sh: $f not found (FSDP_CUDA_ENV / FSDP_DEVICE_ENV, see gpu/README.md)" >&2; exit 2; }
done
exports=$(bash "$CUDA_ENV") || { echo "gpu/build.sh: $CUDA_ENV failed (its message above)" >&2; exit 2; }
eval "$exports"
command -v nvcc >/dev/null 2>&1 || { echo "gpu/build.sh: no nvcc on PATH after $CUDA_ENV" >&2; exit 2; }
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target-cuda}
# candle-kernels' build script runs nvcc on half the cores by default (1 of 2); while it runs,
# the rest of the build waits for it, so give it every core (its nvcc work is ~20 of the ~35
# minutes of a first build on 2 cores).
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}
# Every cargo command selects the same packages and features and builds test or bench targets,
# so cargo resolves the dependencies' features identically (dev-dependencies included) and
# compiles them once: the fsdp CLI, the integration tests and the bench in one command, the
# libraries' unit tests (kernels_unit, comm_unit) in a second. (Different selections differ
# in features of gemm, getrandom, syn, ...: a second copy of candle-core and its dependency
# tree, ~10 minutes.) The release profile throughout (test and bench executables: strip = true).
sel=(--release -p fsdp -p fsdp-kernels -p fsdp-comm --features fsdp/cuda
     --message-format=json-render-diagnostics)
json=$(nice -n 19 cargo build "${sel[@]}" --bin fsdp --test cuda_kernels --test nccl_conformance \
  --bench nccl_bandwidth)
json+=$'\n'$(nice -n 19 cargo test "${sel[@]}" --no-run --lib)
exe() { # exe TARGET_NAME KIND -> path of the executable
  printf '%s\n' "$json" | python3 -c '
import json, sys
name, kind = sys.argv[1], sys.argv[2]
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    t = m.get("target") or {}
    if m.get("reason") == "compiler-artifact" and m.get("executable") and t.get("name") == name and kind in t.get("kind", []):
        print(m["executable"])
' "$1" "$2" | tail -n 1
}
rm -rf target-gpu && mkdir -p target-gpu
cp "$(exe fsdp bin)" target-gpu/fsdp
cp "$(exe cuda_kernels test)" target-gpu/cuda_kernels
cp "$(exe fsdp_kernels lib)" target-gpu/kernels_unit
cp "$(exe nccl_conformance test)" target-gpu/nccl_conformance
cp "$(exe fsdp_comm lib)" target-gpu/comm_unit
cp "$(exe nccl_bandwidth bench)" target-gpu/nccl_bandwidth
cp "$DEVICE_ENV" target-gpu/device-env.sh
# What can be checked here without a GPU, against the toolkit's libraries and a libcuda.so.1
# that is the toolkit's link stub (every driver call fails with CUDA_ERROR_STUB_LIBRARY):
# - NVRTC compiles the kernel sources for sm_90 (cuda_kernels' and comm_unit's compile tests;
#   NVRTC needs no device), and the unit tests pass (launch arithmetic; device tests skip);
# - `fsdp train --device cuda` without a driver is bad input (exit 2) naming libcuda.so.1 and
#   the GPU, not a panic; without any libcuda.so.1 the dynamic loader refuses to start the
#   binary (exit 127), naming libcuda.so.1 (cudarc links the driver library: it cannot be
#   caught inside the program);
# - whether this fsdp has the engine's CUDA path (`train --device`; without it gpu/check.sh
#   marks the engine rows NOT RUN).
stub=$(mktemp -d)
trap 'rm -rf "$stub"' EXIT
ln -s "$CUDA_HOME/lib/stubs/libcuda.so" "$stub/libcuda.so.1"
host() { LD_LIBRARY_PATH="$stub:$LIBRARY_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"; }
fail() { echo "gpu/build.sh: FAILED: $*" >&2; exit 1; }
for t in kernels_unit comm_unit cuda_kernels; do
  log=$(host "target-gpu/$t" --test-threads=1 2>&1) || { echo "$log" >&2; fail "target-gpu/$t (no GPU needed)"; }
  echo "$log" | grep -E '^test result' | sed "s/^/$t: /"
done
log=$(host target-gpu/cuda_kernels --exact cuda_nvrtc_compiles_the_kernels 2>&1)
echo "$log" | grep -q '1 passed' || { echo "$log" >&2; fail "NVRTC compile of the fsdp-kernels source for compute_90"; }
log=$(host target-gpu/comm_unit --exact nccl::reduce::tests::reduction_kernels_compile_with_nvrtc 2>&1)
echo "$log" | grep -q '1 passed' || { echo "$log" >&2; fail "NVRTC compile of the rank-order reduction for compute_90"; }
rc=0
log=$(host target-gpu/fsdp train --model tiny --steps 1 --device cuda 2>&1) || rc=$?
if [ $rc -ne 2 ] || ! grep -q 'libcuda.so.1' <<<"$log" || ! grep -q 'GPU 0' <<<"$log"; then
  echo "$log" >&2; fail "fsdp train --device cuda against the stub driver: exit $rc, want 2 naming libcuda.so.1 and GPU 0"
fi
echo "no driver (stub): exit 2: $(grep -m1 error <<<"$log" | cut -c1-160)..."
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda.so.1 '; then
  rc=0
  log=$(LD_LIBRARY_PATH="$LIBRARY_PATH" target-gpu/fsdp --help 2>&1) || rc=$?
  if [ $rc -eq 0 ] || ! grep -q 'libcuda.so.1' <<<"$log"; then
    echo "$log" >&2; fail "fsdp without any libcuda.so.1: exit $rc, want the loader's error naming libcuda.so.1"
  fi
  echo "no libcuda.so.1 at all: exit $rc: $log"
fi
if host target-gpu/fsdp train --help 2>/dev/null | grep -q -- '--device'; then
  engine_cuda="yes (fsdp train --device)"
else
  engine_cuda="NO: fsdp train has no --device; gpu/check.sh's engine rows will be NOT RUN"
  echo "gpu/build.sh: WARNING: $engine_cuda" >&2
fi
BINS="fsdp cuda_kernels kernels_unit nccl_conformance comm_unit nccl_bandwidth"
# Stripped and xz-compressed: the device tool carries at most 64 MiB (the CUDA CLI alone is
# ~53 MB; gzip -9 made the six 65 MiB, xz -6 makes them ~37 MB); gpu/check.sh unpacks them.
# FSDP_GPU_PACK=0 (CI, where nothing travels) leaves them stripped but uncompressed.
for b in $BINS; do
  strip "target-gpu/$b" 2>/dev/null || true
  if [ "${FSDP_GPU_PACK:-1}" != 0 ]; then xz -T0 -6 "target-gpu/$b"; fi
done
{ echo "commit $(git rev-parse HEAD)$(git diff --quiet || echo ' (with uncommitted changes)')";
  echo "built $(date -u +%FT%TZ) on $(hostname)"; rustc --version
  echo "CUDA toolkit: $(nvcc --version | grep -m1 release) (CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-unset})"
  echo "checked without a GPU: NVRTC compiles the kernels for compute_90; unit tests pass; --device cuda without a driver exits 2"
  echo "engine CUDA path: $engine_cuda"; } > target-gpu/BUILD
ls -la target-gpu
du -sh target-gpu

#!/usr/bin/env bash
# Builds everything gpu/check.sh runs, on a machine WITHOUT a GPU, and puts it in target-gpu/
# (git-ignored) for the GPU machine, which has no Rust toolchain:
# (each executable stripped and gzipped: target-gpu/NAME.gz)
#   target-gpu/fsdp              the CLI (--features cuda; `fsdp launch` starts the ranks)
#   target-gpu/cuda_kernels      kernels/tests/cuda_kernels.rs (CUDA kernels vs the CPU)
#   target-gpu/kernels_unit      fsdp-kernels' unit tests (span tiles, grids, device probe)
#   target-gpu/nccl_conformance  engine/comm/tests/nccl_conformance.rs
#   target-gpu/comm_unit         fsdp-comm's unit tests (NVRTC reduction source, codecs)
#   target-gpu/nccl_bandwidth    engine/comm/benches/nccl_bandwidth.rs
#   target-gpu/device-env.sh     library paths of the GPU machine ($FSDP_DEVICE_ENV)
#   target-gpu/BUILD             commit, date, rustc of this build, whether `fsdp train` has
#                                the engine's CUDA path (`--device`)
# The engine rows of gpu/check.sh run target-gpu/fsdp itself (train --device cuda, launch
# --backend nccl) and the Python files beside this script (gpu/rows.py, gpu/gpt_metrics.py,
# gpu/pytorch_gpt2_eager.py: tracked files, they travel with the work tree); this script
# compiles those and runs their unit tests (gpu/test_gpu_tools.py), so a broken one is found
# here, not on the GPU machine.
# Usage (repo root): gpu/build.sh        (~25 min the first time on 2 cores: candle-kernels)
# Builds go to target-cuda/ under `nice -n 19` (the team's rule for --features cuda builds).
set -euo pipefail
cd "$(dirname "$0")/.."
# The check's Python: syntax (torch is not needed to compile the PyTorch baseline) and tests.
PYTHONDONTWRITEBYTECODE=1 python3 - <<'PY'
import pathlib
for f in sorted(pathlib.Path("gpu").glob("*.py")):
    compile(f.read_text(), str(f), "exec")
PY
PYTHONDONTWRITEBYTECODE=1 python3 -m unittest discover -s gpu -p 'test_*.py'
# The machine's CUDA toolkit: FSDP_CUDA_ENV names a script that prints the `export` lines
# (CUDA_HOME, PATH, LD_LIBRARY_PATH) of a CUDA 13 toolkit; FSDP_DEVICE_ENV a file with the GPU
# machine's library paths, copied beside the executables.
for v in FSDP_CUDA_ENV FSDP_DEVICE_ENV; do
  if [ -z "${!v:-}" ] || [ ! -f "${!v}" ]; then
    echo "gpu/build.sh: set $v to an existing file (see gpu/README.md)" >&2
    exit 2
  fi
done
eval "$(bash "$FSDP_CUDA_ENV")"
export CARGO_TARGET_DIR=$PWD/target-cuda
nice -n 19 cargo build --release --features cuda -p fsdp
# Test and bench executables (release profile: strip = true), found through cargo's JSON.
# (`cargo test --release --workspace --features fsdp/cuda,fsdp-kernels/cuda,fsdp-comm/cuda
# --no-run` builds every test of the workspace with the feature; only these two crates' tests
# run on the GPU today.)
json=$(nice -n 19 cargo test --release -p fsdp-kernels -p fsdp-comm --features fsdp-kernels/cuda,fsdp-comm/cuda --no-run --message-format=json)
bench=$(nice -n 19 cargo bench -p fsdp-comm --features cuda --bench nccl_bandwidth --no-run --message-format=json)
exe() { # exe TARGET_NAME KIND -> path of the executable
  printf '%s\n%s\n' "$json" "$bench" | python3 -c '
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
cp "$CARGO_TARGET_DIR/release/fsdp" target-gpu/fsdp
cp "$(exe cuda_kernels test)" target-gpu/cuda_kernels
cp "$(exe fsdp_kernels lib)" target-gpu/kernels_unit
cp "$(exe nccl_conformance test)" target-gpu/nccl_conformance
cp "$(exe fsdp_comm lib)" target-gpu/comm_unit
cp "$(exe nccl_bandwidth bench)" target-gpu/nccl_bandwidth
cp "$FSDP_DEVICE_ENV" target-gpu/device-env.sh
# Does this fsdp have the engine's CUDA path? (Run here against the toolkit's libcuda stub: no
# device is touched by --help.) Without it check.sh marks the engine rows NOT RUN.
stub=$(mktemp -d)
ln -s "$CUDA_HOME/lib/stubs/libcuda.so" "$stub/libcuda.so.1"
if LD_LIBRARY_PATH="$stub:$LIBRARY_PATH" target-gpu/fsdp train --help 2>/dev/null | grep -q -- '--device'; then
  engine_cuda="yes (fsdp train --device)"
else
  engine_cuda="NO: fsdp train has no --device; gpu/check.sh's engine rows will be NOT RUN"
  echo "gpu/build.sh: WARNING: $engine_cuda" >&2
fi
rm -rf "$stub"
BINS="fsdp cuda_kernels kernels_unit nccl_conformance comm_unit nccl_bandwidth"
# Stripped and gzipped: the device tool carries at most 64 MiB (the CUDA CLI alone is ~53 MB);
# gpu/check.sh unpacks them.
for b in $BINS; do strip "target-gpu/$b" 2>/dev/null || true; gzip -9 "target-gpu/$b"; done
{ echo "commit $(git rev-parse HEAD)$(git diff --quiet || echo ' (with uncommitted changes)')";
  echo "built $(date -u +%FT%TZ) on $(hostname)"; rustc --version
  echo "engine CUDA path: $engine_cuda"; } > target-gpu/BUILD
ls -la target-gpu
du -sh target-gpu

#!/usr/bin/env bash
# Installs the CUDA 13.0 toolkit that `--features cuda` builds against, without root and without
# a GPU, from NVIDIA's wheels on PyPI, and prints the `export` lines that select it:
#
#   eval "$(gpu/cuda-toolkit.sh)"
#   cargo build --release --features cuda
#
# What: nvcc, ptxas, NVVM, CUDA headers and CCCL, cudart, cuBLAS/cuBLASLt, cuRAND, NVRTC 13.0 and
# NCCL 2.28.9 (the versions of the GPU test machine: driver 580 = CUDA 13.0), every wheel pinned
# by version and sha256 (pip's hash-checking mode), plus a link stub for the driver library
# (libcuda.so, made from the driver API names in cuda.h) so executables link on machines
# without a driver. The stub is only for linking: at run time the real libcuda.so.1 is used.
#
# Where: ${FSDP_CUDA_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/fsdp-cuda-13.0} (about 2.3 GB). The
# install goes to a scratch folder next to it and is moved into place only when complete, with
# a marker file written last; an interrupted run leaves nothing half-installed behind, and the
# next run starts over. Concurrent runs wait for each other (flock).
#
# Time: first run ~1-3 minutes (about 900 MB of wheels; pip's cache makes a rerun faster);
# afterwards it only checks the marker and prints (instant).
#
# Needs: x86_64 Linux, python3 with pip, network access to PyPI (first run only), gcc and g++
# (the stub; nvcc's host compiler).
# Exit status 0 with the exports on stdout; 1 with a message on stderr naming what is missing.
set -euo pipefail

# Pinned wheels: name==version and the sha256 of the file PyPI serves (manylinux x86_64).
WHEELS=(
  "nvidia-cuda-nvcc==13.0.88 56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03"
  "nvidia-cuda-crt==13.0.88 2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4"
  "nvidia-nvvm==13.0.88 c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0"
  "nvidia-cuda-cccl==13.0.85 e0da7ad981f3a8aff08241b5bfc1af868742a63e2762f53a5171c492ef242649"
  "nvidia-cuda-runtime==13.0.96 7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548"
  "nvidia-cuda-nvrtc==13.0.88 ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575"
  "nvidia-curand==10.4.0.35 1aee33a5da6e1db083fe2b90082def8915f30f3248d5896bcec36a579d941bfc"
  "nvidia-cublas==13.1.0.3 ee8722c1f0145ab246bccb9e452153b5e0515fd094c3678df50b2a0888b8b171"
  "nvidia-nccl-cu13==2.28.9 e4553a30f34195f3fa1da02a6da3d6337d28f2003943aa0a3d247bbc25fefc42"
)
# Bump when the layout below changes: an older install is then replaced.
LAYOUT=1

ROOT=${FSDP_CUDA_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/fsdp-cuda-13.0}
MARKER=$ROOT/.fsdp-toolkit-complete
C=$ROOT/nvidia/cu13
N=$ROOT/nvidia/nccl
STAMP="layout $LAYOUT; $(printf '%s\n' "${WHEELS[@]}" | sha256sum | cut -c1-16)"

die() { echo "cuda-toolkit.sh: $*" >&2; exit 1; }

print_exports() {
  # CUDA_COMPUTE_CAP=90: the GPU test machine's H200 (sm_90); candle-kernels compiles for it only.
  cat <<EOF
export CUDA_HOME=$C CUDA_PATH=$C CUDA_ROOT=$C
export PATH=$C/bin\${PATH:+:\$PATH}
export CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-90}
export LIBRARY_PATH=$C/lib:$C/lib/stubs:$N/lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}
export CPATH=$N/include\${CPATH:+:\$CPATH}
export FSDP_CUDA_STUBS=$C/lib/stubs
EOF
}

installed() { [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$STAMP" ]; }

if installed; then print_exports; exit 0; fi

# --- prerequisites, each named when missing ---
[ "$(uname -s)/$(uname -m)" = Linux/x86_64 ] \
  || die "needs x86_64 Linux (NVIDIA's pinned wheels are manylinux x86_64); this is $(uname -s)/$(uname -m)"
command -v python3 >/dev/null 2>&1 || die "python3 not found: install Python 3 (e.g. apt-get install python3 python3-pip)"
python3 -m pip --version >/dev/null 2>&1 \
  || die "pip not found for python3: install it (e.g. apt-get install python3-pip, or python3 -m ensurepip)"
command -v gcc >/dev/null 2>&1 || die "gcc not found: it compiles the libcuda link stub (e.g. apt-get install gcc g++)"
command -v g++ >/dev/null 2>&1 || die "g++ not found: nvcc needs it as the host compiler (e.g. apt-get install g++)"
command -v sha256sum >/dev/null 2>&1 || die "sha256sum not found (coreutils)"

mkdir -p "$(dirname "$ROOT")"
exec 9>"$ROOT.lock"
command -v flock >/dev/null 2>&1 && flock 9
# Another run may have finished while this one waited for the lock.
if installed; then print_exports; exit 0; fi

echo "cuda-toolkit.sh: installing CUDA 13.0 + NCCL 2.28.9 from PyPI wheels into $ROOT" >&2
WORK=$(mktemp -d "$ROOT.partial.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
# Older scratch folders of interrupted runs (only those no other run holds: we have the lock).
for d in "$ROOT".partial.*; do [ "$d" != "$WORK" ] && rm -rf "$d"; done

req=$WORK/requirements.txt
for w in "${WHEELS[@]}"; do echo "${w% *} --hash=sha256:${w#* }"; done > "$req"
# Hash-checking mode: pip refuses a file whose sha256 differs from the pinned one.
if ! python3 -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
    --disable-pip-version-check --no-input -d "$WORK/wheels" -r "$req" >&2; then
  die "downloading the CUDA wheels failed (network access to PyPI, or a wheel whose hash changed; pip's message above)"
fi
# Belt and braces: the files on disk have the pinned hashes, one file per pinned wheel.
python3 - "$WORK/wheels" "${WHEELS[@]}" <<'PY' || die "a downloaded wheel is missing or has the wrong sha256"
import hashlib, pathlib, sys
folder, pins = pathlib.Path(sys.argv[1]), sys.argv[2:]
files = {hashlib.sha256(p.read_bytes()).hexdigest(): p.name for p in folder.glob("*.whl")}
bad = [pin for pin in pins if pin.split()[1] not in files]
for pin in bad:
    print(f"cuda-toolkit.sh: no wheel with the pinned hash for {pin.split()[0]}", file=sys.stderr)
sys.exit(1 if bad or len(files) != len(pins) else 0)
PY

# Unpack (zipfile keeps the executables' mode bits, which nvcc, ptxas and cicc need).
python3 - "$WORK/wheels" "$WORK/root" <<'PY' || die "unpacking the wheels failed (disk space? about 2.3 GB are needed)"
import os, pathlib, sys, zipfile
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for whl in sorted(src.glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            if ".dist-info/" in info.filename:
                continue
            path = z.extract(info, dst)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(path, mode)
PY
rm -rf "$WORK/wheels"
RC=$WORK/root/nvidia/cu13
RN=$WORK/root/nvidia/nccl
for f in "$RC/bin/nvcc" "$RC/include/cuda.h" "$RC/include/cccl/cuda/std/cstddef" "$RC/lib/libcudart.so.13" \
         "$RC/lib/libcublas.so.13" "$RC/lib/libcurand.so.10" "$RC/lib/libnvrtc.so.13" \
         "$RN/lib/libnccl.so.2" "$RN/include/nccl.h"; do
  [ -e "$f" ] || die "the wheels lack ${f#"$WORK/root/"}: the wheel layout changed; update this script"
done
# nvcc.profile looks for the headers and libraries under targets/x86_64-linux.
mkdir -p "$RC/targets" && ln -sfn .. "$RC/targets/x86_64-linux"
# The linker's unversioned names (-lcudart, -lcublas, ..., -lnccl).
for f in libcublas.so.13 libcublasLt.so.13 libcudart.so.13 libcurand.so.10 libnvrtc.so.13; do
  ln -sf "$f" "$RC/lib/${f%%.so.*}.so"
done
ln -sf libnccl.so.2 "$RN/lib/libnccl.so"

# libcuda link stub: every driver API name in cuda.h (the versioned ones, cuMemAlloc_v2 and so
# on, are in its #defines), each a function returning CUDA_ERROR_STUB_LIBRARY (34) so that a
# program that runs against the stub by mistake gets that error, not a crash.
mkdir -p "$RC/lib/stubs"
grep -ohE '\bcu[A-Z][A-Za-z0-9_]*' "$RC/include/cuda.h" | sort -u \
  | awk '{ print "int " $1 "(void) { return 34; }" }' > "$WORK/libcuda_stub.c"
gcc -shared -fPIC -O0 -o "$RC/lib/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$WORK/libcuda_stub.c" \
  || die "gcc failed to build the libcuda link stub"
cp "$WORK/libcuda_stub.c" "$RC/lib/stubs/libcuda_stub.c"
# A quick self-test: nvcc runs and emits sm_90 PTX.
printf '__global__ void k(float *x) { x[threadIdx.x] *= 2.0f; }\n' > "$WORK/t.cu"
CUDA_HOME=$RC "$RC/bin/nvcc" --ptx -arch=sm_90 -o "$WORK/t.ptx" "$WORK/t.cu" >&2 \
  || die "the installed nvcc does not compile a test kernel (its message above; a g++ nvcc 13.0 does not support? NVCC_CCBIN names another)"

echo "$STAMP" > "$WORK/root/.fsdp-toolkit-complete.tmp"
rm -rf "$ROOT"
mv "$WORK/root" "$ROOT"
# The marker last: only a complete install has it.
mv "$ROOT/.fsdp-toolkit-complete.tmp" "$MARKER"
echo "cuda-toolkit.sh: installed into $ROOT" >&2
print_exports

#!/usr/bin/env bash
# Long fuzz run of every reader of a file that comes from outside (tests/fuzz/mod.rs):
# N inputs per reader (default 1,000,000), every reader in its own thread. Writes the table to
# benches/results/<date>-fuzz-readers.md with the command and the machine, and the inputs that
# failed (if any) to target/fuzz-failures/<reader>/; exits non-zero when one failed.
#
#   benches/fuzz/run.sh [N] [reader,reader,...]   (FUZZ_REPORT=FILE: another report file)
#
# Built in the dev profile: its dependencies (serde_json, safetensors, tokenizers) are
# optimised at opt-level 3 as in release, and the readers keep their overflow checks.
set -euo pipefail
cd "$(dirname "$0")/../.."
n="${1:-1000000}"
readers="${2:-}"
day="$(date -u +%Y-%m-%d)"
out="${FUZZ_REPORT:-benches/results/${day}-fuzz-readers.md}"
cargo build -p fsdp-suite --example fuzz_readers
# Temporary files on a memory file system when there is one.
if [ -d /dev/shm ] && [ -w /dev/shm ]; then export TMPDIR=/dev/shm; fi
args=(--inputs "$n" --failures target/fuzz-failures --report "$out.table")
if [ -n "$readers" ]; then args+=(--readers "$readers"); fi
start=$(date -u +%H:%M:%S)
status=0
target/debug/examples/fuzz_readers "${args[@]}" || status=$?
{
  echo "# Fuzzing the readers of outside files, ${day}"
  echo
  echo "Command: \`benches/fuzz/run.sh $*\` (\`target/debug/examples/fuzz_readers ${args[*]}\`),"
  echo "started ${start} UTC, finished $(date -u +%H:%M:%S) UTC, exit status ${status}."
  echo "Machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)),"
  echo "shared with other builds; every reader in its own thread, so times are wall times."
  echo
  echo "Per input: no panic, at most 5 s, peak heap growth at most 128 x the input's bytes plus"
  echo "the reader's constant (1 MiB for header parsing, 4 MiB for the file readers, 16 MiB for"
  echo "tokenizer.json, 256 MiB for config.json: the spec of a 10,000-layer model), and an error"
  echo "that names the file. The ratio column is (peak - constant) / input bytes, 0 when the"
  echo "peak stayed under the constant."
  echo
  cat "$out.table"
} > "$out"
rm -f "$out.table"
echo "wrote $out"
exit "$status"

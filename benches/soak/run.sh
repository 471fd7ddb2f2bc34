#!/usr/bin/env bash
# Kill soak of `fsdp launch --max-restarts`: a training job whose rank processes are killed
# (SIGKILL) or stopped (SIGTERM) at seeded random points, at least 20 times: during start-up,
# mid-step and during checkpoint saves. The launcher restarts the job from the newest intact
# checkpoint each time. At the end the final checkpoint must equal an uninterrupted run's byte
# for byte (every file of the step directory and the `latest` pointer, compared with cmp).
# Prints each kill, then kills survived, steps recomputed and checkpoint bytes lost (0), and
# writes the report to benches/results/<date>-kill-soak.md (SOAK_REPORT=FILE: another file).
#
#   benches/soak/run.sh [SEED] [KILLS]      (defaults 2026 and 24; STEPS=N: steps, default 200)
#
# Ranks: 2 MPI processes (`fsdp train --backend mpi`) under `mpirun`, which `fsdp launch
# --nproc 1 --max-restarts` supervises (`fsdp launch` has no CPU process-per-rank backend of
# its own; `--backend nccl` needs GPUs): a killed rank makes mpirun end the job, the launcher
# restarts it, and `--resume` continues from the newest checkpoint. Needs Open MPI (mpirun,
# libopenmpi-dev) and builds `fsdp` with `--features mpi` (FSDP=PATH: use that binary). MODE=threads runs the one-process
# configuration instead (`fsdp launch --nproc 1 -- train --world-size 2`, the launcher adding
# `--resume-from latest-valid` on restarts): there the killed rank is that one process.
set -uo pipefail
cd "$(dirname "$0")/../.."
seed="${1:-2026}"
kills_wanted="${2:-24}"
steps="${STEPS:-200}"
every=5
day="$(date -u +%Y-%m-%d)"
report="${SOAK_REPORT:-benches/results/${day}-kill-soak.md}"
mode="${MODE:-mpi}"

die() { echo "kill soak: $*" >&2; exit 1; }
command -v pgrep > /dev/null || die "needs pgrep (procps)"
features=()
nranks=1
if [ "$mode" = mpi ]; then
  nranks=2
  command -v mpirun > /dev/null || die "mpirun not found: install openmpi-bin and libopenmpi-dev, or run MODE=threads $0"
  features=(--features mpi)
fi
bin="${FSDP:-}"
if [ -z "$bin" ]; then
  cargo build -p fsdp "${features[@]}" --bin fsdp || die "cannot build fsdp ${features[*]}"
  bin=target/debug/fsdp
fi
# A copy, so that another build of target/debug/fsdp cannot change it under the soak.
mkdir -p target
work="$(mktemp -d "$PWD/target/kill-soak.XXXXXX")"
cleanup() {
  local status=$?
  stop_job
  if [ "$status" = 0 ]; then rm -rf "$work"; else echo "kill soak: logs kept in $work" >&2; fi
}
trap cleanup EXIT
fsdp="$work/fsdp"
cp "$bin" "$fsdp"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Open MPI's own CPU binding would put both ranks on one core.
export OMPI_MCA_hwloc_base_binding_policy=none

train=(train --model tiny --steps "$steps" --seq-len 32 --micro-batch 2 --log-every 1
  --eval-batches 1 --threads-per-rank 1 --ckpt-every "$every" --keep-last 3)
# Sets `job` to the `fsdp launch` arguments for checkpoint root $1, restarts allowed $2,
# master port $3.
job_args() {
  if [ "$mode" = mpi ]; then
    job=(launch --nproc 1 --max-restarts "$2" --master-port "$3" --program mpirun --
      --oversubscribe -n 2 "$fsdp" "${train[@]}" --backend mpi --ckpt-dir "$1" --resume)
  else
    job=(launch --nproc 1 --max-restarts "$2" --master-port "$3" --
      "${train[@]}" --world-size 2 --ckpt-dir "$1")
  fi
}

launcher=""
stop_job() {
  if [ -n "$launcher" ] && kill -0 "$launcher" 2> /dev/null; then
    kill -TERM "$launcher" 2> /dev/null
    wait "$launcher" 2> /dev/null
  fi
}

# The rank processes of the running attempt (children of mpirun, or the launcher's child).
ranks() {
  local top
  top=$(pgrep -P "$launcher" | head -1)
  [ -n "$top" ] || return 0
  if [ "$mode" = mpi ]; then pgrep -P "$top" | sort -n; else echo "$top"; fi
}
# The log line where the running attempt starts (after the newest restart line), and the
# step it resumed at.
mark=0
resumed=0
# Last step the running attempt printed (empty before its first).
attempt_step() {
  tail -n +"$((mark + 1))" "$log" 2> /dev/null | sed -n 's|^\[rank 0\] step \([0-9]*\)/.*|\1|p' \
    | tail -1
}
# How far the job got: the running attempt's last step, else the step it resumed at.
progress() { local s; s=$(attempt_step); echo "${s:-$resumed}"; }
# Whether a save is in progress: a temporary directory of a step past the newest complete
# checkpoint and at most one past the last step printed (a killed save leaves its temporary
# directory behind until that step is saved again).
saving() {
  local d n now newest
  now=$(progress); newest=$(newest_step)
  for d in "$ck"/.tmp-step-*; do
    [ -d "$d" ] || continue
    n=$(basename "$d" | sed 's/^\.tmp-step-0*//; s/^$/0/')
    if [ "$n" -gt "$newest" ] && [ "$n" -le $((now + 1)) ]; then return 0; fi
  done
  return 1
}
restarts() { grep -c '^fsdp launch: restart ' "$log" || true; }
# The newest complete checkpoint (a step directory with its manifest, which a save writes
# last; `latest` may still name the previous one when a kill lands between the two).
newest_step() {
  local m
  m=$(compgen -G "$ck/step-*/manifest.json" | sort | tail -1)
  [ -n "$m" ] && basename "$(dirname "$m")" | sed 's/^step-0*//; s/^$/0/' || echo 0
}
# Bash's RANDOM, seeded: the same kill schedule for the same seed.
RANDOM="$seed"

ck="$work/ck"
log="$work/soak.log"
max_restarts=$((kills_wanted * 2))
job_args "$ck" "$max_restarts" 29711
"$fsdp" "${job[@]}" > "$log" 2>&1 &
launcher=$!
started=$(date +%s)
kills=0; kill_sigs=0; term_sigs=0; in_save=0; at_start=0; recomputed=0; lost=0
lines=()
while [ "$kills" -lt "$kills_wanted" ]; do
  kill -0 "$launcher" 2> /dev/null || break
  # Where this kill lands: during start-up, at a step, or during a save; its target step is
  # spread over the run so that the job still has steps left for every kill.
  where=$((RANDOM % 6))
  target=$(((kills + 1) * (steps - 2 * every) / (kills_wanted + 1) + RANDOM % 3))
  sig=KILL; [ $((RANDOM % 2)) = 1 ] && sig=TERM
  pick=$RANDOM
  before=$(restarts)
  # The attempt's rank processes, taken before the wait so that the kill follows its moment
  # at once.
  until [ "$(ranks | wc -l)" -ge "$nranks" ] || ! kill -0 "$launcher" 2> /dev/null; do
    sleep 0.01
  done
  mapfile -t pids < <(ranks)
  [ "${#pids[@]}" -gt 0 ] || continue
  victim=$((pick % ${#pids[@]}))
  during=""
  case $where in
    0) # start-up: 0-1.5 s after the attempt's processes exist
      sleep "0.$((RANDOM % 15))"
      saving && during=" during a save" ;;
    1 | 2) # during a save at or after the target step
      until { [ "$(progress)" -ge "$target" ] && saving; } || ! kill -0 "$launcher" 2> /dev/null; do
        sleep 0.002
      done
      during=" during a save" ;;
    *) # mid-run, once the target step is reached, after 0-0.5 s more
      until [ "$(progress)" -ge "$target" ] || ! kill -0 "$launcher" 2> /dev/null; do
        sleep 0.01
      done
      sleep "0.$((RANDOM % 5))"
      saving && during=" during a save" ;;
  esac
  kill "-$sig" "${pids[$victim]}" 2> /dev/null || continue
  # What the killed attempt left: the newest complete checkpoint and the last step printed.
  committed=$(newest_step)
  bytes=0; [ "$committed" -gt 0 ] && bytes=$(du -sb "$ck/$(printf 'step-%08d' "$committed")" | cut -f1)
  step=$(attempt_step)
  if [ -z "$step" ]; then during=" before its first step"; step=$resumed; fi
  kills=$((kills + 1))
  [ "$sig" = KILL ] && kill_sigs=$((kill_sigs + 1)) || term_sigs=$((term_sigs + 1))
  [ "$during" = " during a save" ] && in_save=$((in_save + 1))
  [ "$during" = " before its first step" ] && at_start=$((at_start + 1))
  # The restart, then where the new attempt resumes.
  until [ "$(restarts)" -gt "$before" ] || ! kill -0 "$launcher" 2> /dev/null; do sleep 0.01; done
  mark=$(grep -n '^fsdp launch: restart ' "$log" | tail -1 | cut -d: -f1)
  again=""
  until [ -n "$again" ] || ! kill -0 "$launcher" 2> /dev/null; do
    # A resume names its step; a fresh start says so, or (without --resume) just trains.
    again=$(tail -n +"$mark" "$log" \
      | grep -m1 -oE 'resuming from .*\(step [0-9]+|starting from step 0|^\[rank 0\] step [0-9]+/' \
      | sed -E 's|^\[rank 0\] step .*|0|; s|.* ([0-9]+)$|\1|' || true)
    sleep 0.01
  done
  resumed=${again:-$resumed}
  redo=$((step > resumed ? step - resumed : 0))
  recomputed=$((recomputed + redo))
  if [ "$resumed" -lt "$committed" ]; then lost=$((lost + bytes)); fi
  line=$(printf 'kill %2d: SIG%-4s rank %d of %d at step %3d%s; newest checkpoint step %3d, resumed at step %3d, %2d steps recomputed' \
    "$kills" "$sig" "$victim" "${#pids[@]}" "$step" "$during" "$committed" "$resumed" "$redo")
  echo "$line"; lines+=("$line")
done
wait "$launcher"; status=$?
launcher=""
elapsed=$(($(date +%s) - started))
[ "$status" = 0 ] || { tail -30 "$log"; die "the launcher exited with $status after $kills kills"; }
[ "$kills" -ge "$kills_wanted" ] || die "only $kills of $kills_wanted kills before the run ended (raise STEPS)"
leftover=$(compgen -G "$ck/.tmp-*" | wc -l)

# The uninterrupted run, the same way.
ref="$work/reference"
job_args "$ref" 0 29712
"$fsdp" "${job[@]}" > "$work/reference.log" 2>&1 || { tail -30 "$work/reference.log"; die "the uninterrupted run failed"; }
final=$(cat "$ck/latest")
[ "$final" = "$(cat "$ref/latest")" ] || die "latest: $final vs $(cat "$ref/latest")"
same=0; differ=0
for f in "$ref/$final"/*; do
  if cmp -s "$f" "$ck/$final/$(basename "$f")"; then same=$((same + 1)); else differ=$((differ + 1)); echo "differs: $(basename "$f")"; fi
done
[ "$(ls "$ck/$final" | wc -l)" = "$(ls "$ref/$final" | wc -l)" ] || differ=$((differ + 1))

summary=$(cat <<EOF
kills survived: $kills (SIGKILL $kill_sigs, SIGTERM $term_sigs; $in_save during a save, $at_start before an attempt's first step)
restarts: $(restarts) (by the launcher, each from the newest intact checkpoint)
steps recomputed: $recomputed (of $steps; the last step printed before each kill less the step resumed at)
bytes lost: $lost (bytes of complete checkpoints that a restart could not resume from)
temporary checkpoint directories left: $leftover
final checkpoint $final: $same files identical to the uninterrupted run's, $differ differ
soak time: ${elapsed} s
EOF
)
echo "$summary"
{
  echo "# Kill soak of \`fsdp launch --max-restarts\`, ${day}"
  echo
  echo "Command: \`MODE=$mode STEPS=$steps benches/soak/run.sh $seed $kills_wanted\`; the job:"
  echo
  echo '```'
  job_args CKPT "$max_restarts" 29711
  echo "fsdp ${job[*]}" | sed "s|$work/fsdp|fsdp|g"
  echo '```'
  echo
  echo "Machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)),"
  echo "shared with other builds; \`fsdp\` in the dev profile; exit status of the launcher: $status."
  echo
  if [ "$mode" = mpi ]; then
    echo "The ranks are 2 MPI processes under mpirun, which the launcher supervises as its one"
    echo "slot: a killed rank makes mpirun end the job (exit 128 + signal), the launcher"
    echo "restarts it and \`--resume\` continues from the newest complete checkpoint."
  else
    echo "The rank is one process training 2 rank threads: the launcher restarts it and adds"
    echo "\`--resume-from latest-valid\` once the job has saved a checkpoint."
  fi
  echo "Each kill picks a random rank and SIGKILL or SIGTERM (seeded), and a moment: 0-1.5 s"
  echo "into an attempt, while a checkpoint is being written, or 0-0.5 s after a target step."
  echo
  echo '```'
  printf '%s\n' "${lines[@]}"
  echo
  echo "$summary"
  echo '```'
} > "$report"
echo "report: $report"
[ "$differ" = 0 ] && [ "$lost" = 0 ] || die "the final checkpoint differs or bytes were lost"

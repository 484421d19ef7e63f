#!/usr/bin/env bash
# The GPU check on a lent H200, in two phases, each ONE device call of at most 8 minutes
# (each step has its own time limit; the limits of a phase add up to <= 480 s):
#
#   OUT=$OUT bash bench/gpu_check.sh phase1   # build for sm_90, every cuda test, kernel microbenchmarks
#   OUT=$OUT bash bench/gpu_check.sh phase2   # NCCL training (one rank), rank 0 of 8 simulated, e2e on GPU
#   OUT=/tmp/x bash bench/gpu_check.sh phase1 --dry-run   # the same plumbing on CPU, tiny sizes (CI)
#
# Run phase2 right after phase1, on the still-warm machine: its first step reuses
# phase1's build (and rebuilds, within its limit, on a fresh machine).
# Every step writes its output to $OUT/<step>.log as it runs (tee), and $OUT/summary.md
# (versions; per step: exit code, result, seconds, notes) is rewritten after every step,
# so a call killed at its limit still brings back everything done so far. A step's note
# is its last "[summary] ..." line, else its last line. At most 7 files per phase land in
# $OUT (the device tool brings back 8).
#
# Phase 1 runs every test marked `cuda` (tests/conftest.py, tests/gpu_marks.py; a CPU test
# fails when a GPU-guarded test lacks the marker). The benchmarks are built in a step of
# their own (bench/build.sh; the dry run compiles them too) and run only if it succeeded:
# otherwise they are listed as skipped, with the reason.
#
# Exit codes, of a step and of the script: 0 ok; 3 "below target" (a benchmark ran and
# was correct but missed a speed target: reported, not a failure); anything else failed
# (124/137: timed out). The script exits 1 when a step failed, else 3 when one was below
# target, else 0; 2 for a bad command line.
# GPU_CHECK_FAIL_STEP=<step>[:code][,<step>[:code]...] makes those steps exit with that
# code (default 97) instead of running (tests the plumbing).
# Commit the files under bench/results/h200/.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash bench/gpu_check.sh phase1|phase2 [--dry-run]"
phase=${1:-}
dry=0
case ${2:-} in --dry-run) dry=1 ;; "") ;; *) echo "$usage (got ${2})" >&2; exit 2 ;; esac
[[ $phase == phase1 || $phase == phase2 ]] || { echo "$usage (got '${phase}')" >&2; exit 2; }
OUT=${OUT:-bench/results/h200}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SUMMARY=$OUT/summary.md
cmdline="$phase$( ((dry)) && echo ' --dry-run')"
rows=()
failed=0
below=0

write_summary() {
  {
    echo "# GPU check $phase$( ((dry)) && echo ' (dry run, CPU)')"
    echo
    echo "Command: \`bash bench/gpu_check.sh $cmdline\`; $(date -u +%Y-%m-%dT%H:%MZ)."
    echo
    echo "Versions: $versions; device: $device."
    echo
    echo "| step | exit | result | seconds | notes |"
    echo "|---|---:|---|---:|---|"
    printf '%s\n' "${rows[@]}"
  } > "$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"
}

# The exit code GPU_CHECK_FAIL_STEP injects for step $1 (empty: run it).
injected() {
  local item items
  IFS=',' read -ra items <<< "${GPU_CHECK_FAIL_STEP:-}"
  for item in "${items[@]}"; do
    [[ ${item%%:*} == "$1" ]] || continue
    [[ $item == *:* ]] && echo "${item#*:}" || echo 97
    return
  done
}

# step NAME LIMIT_S CMD...: runs CMD under a time limit, its output teed into $OUT/NAME.log,
# then adds its summary row and rewrites the summary. Sets step_rc.
step() {
  local name=$1 limit=$2
  shift 2
  local log=$OUT/$name.log start=$SECONDS rc note result code
  echo "[gpu_check] $name (limit ${limit} s): $*"
  { echo "# $name"; echo; echo "Command: \`$*\` (limit ${limit} s)"; echo; } > "$log"
  code=$(injected "$name")
  if [[ -n $code ]]; then
    set -- bash -c "echo 'exiting $code on purpose: GPU_CHECK_FAIL_STEP=${GPU_CHECK_FAIL_STEP}'; exit $code"
  fi
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  note=$(grep -E '^\[summary\] ' "$log" | tail -n 1 | sed 's/^\[summary\] //')
  [[ -n $note ]] || note=$(grep -v '^\s*$' "$log" | tail -n 1)
  note=$(printf '%s' "$note" | tr '|' '/' | cut -c1-160)
  case $rc in
    0) result=ok ;;
    3) result="below target"; below=$((below + 1)) ;;
    124|137) result="timed out"; note="after ${limit} s; last: $note"; failed=$((failed + 1)) ;;
    *) result=failed; failed=$((failed + 1)) ;;
  esac
  rows+=("| $name | $rc | $result | $((SECONDS - start)) | $note |")
  step_rc=$rc
  write_summary
}

# skip NAME WHY: a step this run leaves out, listed as such.
skip() {
  echo "[gpu_check] $1: skipped ($2)"
  rows+=("| $1 | - | skipped | 0 | $2 |")
  write_summary
}

versions=$("$PY" -c "import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda or \"none\"} (torch.version.cuda)')" 2>&1 | tail -n 1)
if ((dry)); then
  device="cpu (dry run)"
  versions+=", driver none (dry run)"
else
  device=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | head -n 1)
  versions+=", driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1 | head -n 1)"
fi
# Whether the installed subnet_ext has CUDA kernels for sm_90 (a build to reuse).
have_build="import subnet_ext._build_info as b, sys; sys.exit(0 if b.WITH_CUDA and '9.0' in b.CUDA_ARCHS else 1)"
build=(env TORCH_CUDA_ARCH_LIST=9.0 SUBNET_EXT_CUDA=1 MAX_JOBS="${MAX_JOBS:-16}"
       "$PY" -m pip install -q --no-build-isolation --no-deps -e .)
info="import json, torch, subnet_ext._build_info as b
print(json.dumps({k: getattr(b, k) for k in ('TORCH_VERSION', 'CUDA_VERSION', 'CUDA_ARCHS', 'WITH_CUDA')}))
print('cuda visible:', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"

# bench_step NAME LIMIT BINARY: runs a benchmark binary if bench-build built it.
bench_step() {
  local name=$1 limit=$2 binary=$3
  if ((bench_build_rc != 0)); then
    skip "$name" "bench-build failed (exit $bench_build_rc): no benchmark binary to run"
  elif [[ ! -x $binary && -z $(injected "$name") ]]; then
    skip "$name" "$binary was not built (this build of subnet_ext has no CUDA kernels?)"
  elif ((dry)); then
    step "$name" 10 bash -c "echo '[summary] $binary built; not run (dry run: needs a GPU)'"
  else
    step "$name" "$limit" "$binary"
  fi
}

phase1() {
  local cuda_tests=(-m pytest -q -m cuda -p no:cacheprovider tests)
  if ((dry)); then
    skip build "dry run: reuses the installed package"
    step build-info 30 "$PY" -c "$info"
    # Every cuda-marked test is selected (on CPU they are skipped); the count is the note.
    step tests-cuda 120 "$PY" "${cuda_tests[@]}"
    step bench-build 400 env PY="$PY" bash bench/build.sh
  else
    # Limits: 180 + 15 + 130 + 90 + 30 + 30 = 475 s.
    step build 180 "${build[@]}"
    step build-info 15 "$PY" -c "$info; import sys; sys.exit(0 if b.WITH_CUDA and torch.cuda.is_available() else 1)"
    step tests-cuda 130 "$PY" "${cuda_tests[@]}"  # no -x: every failure is listed
    step bench-build 90 env PY="$PY" bash bench/build.sh
  fi
  bench_build_rc=$step_rc
  bench_step bench-masked-linear 30 bench/bin/masked_linear_cuda_bench
  bench_step bench-pack-segments 30 bench/bin/pack_segments_cuda_bench
}

phase2() {
  local dev=cuda backend=nccl steps=40 sim e2e dtype
  sim=(--preset 1b --world-size 8 --rank 0 --coverage 0.25 --batch-size 4 --seq-len 1024 --steps 5)
  e2e=(--models small --worlds 2 --coverages 0.5,1.0 --steps 3 --min-seconds 1 --methods ddp,sdp
       --sdp-variants block-forward,neuron-forward --skip-overlap)
  if ((dry)); then
    dev=cpu backend=gloo steps=3 dtype=fp32
    sim=(--preset tiny --world-size 8 --rank 0 --coverage 0.25 --batch-size 2 --seq-len 16 --steps 1 --warmup 1)
    e2e=(--models tiny --worlds 2 --coverages 0.5 --steps 1 --min-seconds 0 --warmup 1 --batch-size 2 --seq-len 16
         --methods sdp --sdp-variants block-forward --skip-overlap)
    skip build "dry run: reuses the installed package"
  else
    dtype=$("$PY" -c "import torch; print('bf16' if torch.cuda.is_bf16_supported() else 'fp32')" 2>/dev/null || echo fp32)
    step build 170 bash -c "if $PY -c \"$have_build\"; then echo 'reusing the sm_90 build of phase1'; else $(printf '%q ' "${build[@]}"); fi"
  fi
  local run=${TMPDIR:-/tmp}/gpu_check_train
  rm -rf "$run"
  step train-nccl 70 "$PY" -m subnet_ext.cli.train --method sdp --model llama --preset tiny --data synthetic \
    --steps "$steps" --eval-every "$steps" --nproc 1 --device "$dev" --backend "$backend" --out "$run"
  cp "$run/report.md" "$OUT/train-nccl-report.md" 2>/dev/null
  step simulated-rank-1b 110 "$PY" bench/simulated_rank.py --device "$dev" --dtype "$dtype" "${sim[@]}"
  step e2e-gpu 100 "$PY" bench/e2e.py --device "$dev" "${e2e[@]}" --out "$OUT/e2e-gpu.md"
}

"$phase"
echo
cat "$SUMMARY"
((failed == 0)) || { echo "[gpu_check] $failed step(s) failed" >&2; exit 1; }
((below == 0)) || { echo "[gpu_check] $below step(s) ran below their speed target (not failures)" >&2; exit 3; }

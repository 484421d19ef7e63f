#!/usr/bin/env bash
# Everything that needs a GPU, in ONE device call on a lent H200 (<= 480 s, the build included):
#
#   OUT=$OUT GPU_CHECK_COMMIT=<sha> bash bench/gpu_check.sh all    # build, tests, bench, e2e
#   OUT=$OUT bash bench/gpu_check.sh tests bench                    # some phases again, on a warm machine
#   OUT=/tmp/x bash bench/gpu_check.sh all --dry-run                # the same plumbing on CPU, tiny sizes (CI)
#
# Phases, in this order (`all` runs the four):
#   build  the package for sm_90 only (pip --no-build-isolation into $PY's torch), what it was
#          built with, and the benchmark binaries (bench/build.sh)
#   tests  every test marked `cuda` (pytest -m cuda, with --durations and a junit file), each
#          under a per-test limit of TEST_LIMIT seconds (pytest-timeout, which the GPU image
#          has; where it is missing, faulthandler_timeout dumps the stacks of a test that
#          overruns and the step's own limit ends the run)
#   bench  the kernel microbenchmarks (bench/bin/*_cuda_bench)
#   e2e    a one-rank NCCL training run (subnet-train), bench/e2e.py --device cuda (2 rounds),
#          and bench/memory_1b.py (one rank of K = 8 training the 1b LLaMA: peak memory and
#          step time of DDP, FSDP2 and SDP beside the memory model's predictions)
#
# Every step has its own time limit (GPU_LIMIT below: they add up to 470 s of the 480), so one slow
# step cannot eat the others. A step's output goes to $WORK/<phase>/<step>.log as it runs.
# What lands in $OUT fits the device tool's return limits (at most 8 files): summary.md,
# rewritten after every step (commit, torch/CUDA/driver versions, per step its exit code,
# verdict, seconds and a note), and one archive per phase, <phase>.tar.gz, rewritten after
# each of its steps, so a call killed at its limit still brings back everything done so
# far. A step's note is its last "[summary] ..." line, else its last line. The summary is
# written once more when the script exits, however it exits (a failed step, a bad phase,
# an interrupt), with its final exit code and time.
#
# Exit codes, of a step and of the script: 0 ok; 3 "below target" (a benchmark ran and was
# correct but missed a speed target: reported, not a failure); anything else failed
# (124/137: timed out). The script exits 1 when a step failed, else 3 when one was below
# target, else 0; 2 for a bad command line.
# GPU_CHECK_FAIL_STEP=<step>[:code][,<step>[:code]...] makes those steps exit with that
# code (default 97) instead of running (tests the plumbing).
# Commit what comes back under bench/results/h200/ (bench/README.md says how).
set -uo pipefail
cd "$(dirname "$0")/.."
PHASES=(build tests bench e2e)
# Seconds each step may take on the GPU machine (the sum stays inside the 480 s of one call,
# the build included) and in a dry run on 2 CPU cores (CI).
# At a6dbb0c on an H200 (bench/results/h200/all-a6dbb0c/summary.md) the steps took: build 36 s,
# build-info 4, bench-build 18, tests-cuda 58 (254 tests, 4 workers), the benchmarks 2 each,
# train-nccl 12, e2e-gpu 24; memory-1b is new (its own --time-limit keeps it inside).
# They add up to 470: the script's own work between steps (versions, archives) fits in the rest.
declare -A GPU_LIMIT=([build]=80 [build-info]=15 [bench-build]=30 [tests-cuda]=125 [bench-masked-linear]=20
                      [bench-pack-segments]=15 [train-nccl]=25 [e2e-gpu]=40 [memory-1b]=120)
declare -A DRY_LIMIT=([build]=0 [build-info]=30 [bench-build]=400 [tests-cuda]=240 [bench-masked-linear]=10
                      [bench-pack-segments]=10 [train-nccl]=120 [e2e-gpu]=120 [memory-1b]=120)
# Seconds one cuda-marked test may take (the slowest at a6dbb0c: 25 s, setup included; the
# one-GPU Lightning and Hugging Face runs are new, their scripts stop themselves at 85 s), under
# the step's own 125 s so that a stuck test fails alone and the step's summary line survives.
TEST_LIMIT=${GPU_CHECK_TEST_LIMIT:-90}
# bench/memory_1b.py starts no configuration after this many seconds (its step's limit is 120).
MEMORY_TIME_LIMIT=90
usage="usage: bash bench/gpu_check.sh all|{build|tests|bench|e2e}... [--dry-run]"
dry=0
phases=()
for arg in "$@"; do
  case $arg in
    --dry-run) dry=1 ;;
    all) phases+=("${PHASES[@]}") ;;
    build|tests|bench|e2e) phases+=("$arg") ;;
    *) echo "$usage (got '$arg')" >&2; exit 2 ;;
  esac
done
((${#phases[@]})) || { echo "$usage (no phase given)" >&2; exit 2; }
OUT=${OUT:-bench/results/h200}
PY=${PY:-python3}
WORK=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/gpu_check_work}
mkdir -p "$OUT"
rm -rf "$WORK"
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1
# pip's version check would try the network, which the device machine cannot reach.
export PIP_DISABLE_PIP_VERSION_CHECK=1
SUMMARY=$OUT/summary.md
cmdline="$*"
rows=()
failed=0
below=0
started=$SECONDS
phase=""
finished=""

commit=${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "unknown (no git here; pass GPU_CHECK_COMMIT)")}
# The device machine's copy of the tree may carry stale git data: the scripts' own provenance
# lines (bench/provenance.py) take the commit from here too.
export GPU_CHECK_COMMIT=$commit
versions=$("$PY" -c "import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda or \"none\"} (torch.version.cuda)')" 2>&1 | tail -n 1)
if ((dry)); then
  device="cpu (dry run)"
  versions+=", driver none (dry run)"
else
  device=$(nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | head -n 1)
  versions+=", driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1 | head -n 1)"
fi

write_summary() {
  {
    echo "# GPU check: ${cmdline}$( ((dry)) && echo ' (dry run, CPU)')"
    echo
    echo "Command: \`bash bench/gpu_check.sh $cmdline\`; $(date -u +%Y-%m-%dT%H:%MZ); commit $commit."
    echo
    echo "Versions: $versions; device: $device; $((SECONDS - started)) s so far.${finished:+ $finished}"
    echo
    echo "| phase | step | exit | result | seconds | notes |"
    echo "|---|---|---:|---|---:|---|"
    printf '%s\n' "${rows[@]}"
  } > "$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"
}

# The phase's logs, as one archive in $OUT (rewritten: it holds everything so far).
archive() {
  tar -czf "$OUT/$phase.tar.gz.tmp" -C "$WORK" "$phase" && mv "$OUT/$phase.tar.gz.tmp" "$OUT/$phase.tar.gz"
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

# step NAME CMD...: runs CMD under the step's time limit, its output teed into the phase's
# NAME.log, then adds its summary row, rewrites the summary and the phase's archive. Sets step_rc.
step() {
  local name=$1 limit
  shift
  if ((dry)); then limit=${DRY_LIMIT[$name]}; else limit=${GPU_LIMIT[$name]}; fi
  local log=$WORK/$phase/$name.log start=$SECONDS rc note result code
  mkdir -p "$WORK/$phase"
  echo "[gpu_check] $phase/$name (limit ${limit} s): $*"
  { echo "# $name"; echo; echo "Command: \`$*\` (limit ${limit} s)"; echo; } > "$log"
  code=$(injected "$name")
  if [[ -n $code ]]; then
    set -- bash -c "echo 'exiting $code on purpose: GPU_CHECK_FAIL_STEP=${GPU_CHECK_FAIL_STEP}'; exit $code"
  fi
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  note=$(grep -E '^\[summary\] ' "$log" | tail -n 1 | sed 's/^\[summary\] //')
  [[ -n $note ]] || note=$(grep -v '^\s*$' "$log" | tail -n 1)
  note=$(printf '%s' "$note" | tr '|' '/' | cut -c1-200)
  case $rc in
    0) result=ok ;;
    3) result="below target"; below=$((below + 1)) ;;
    124|137) result="timed out"; note="after ${limit} s; last: $note"; failed=$((failed + 1)) ;;
    *) result=failed; failed=$((failed + 1)) ;;
  esac
  rows+=("| $phase | $name | $rc | $result | $((SECONDS - start)) | $note |")
  step_rc=$rc
  write_summary
  archive
}

# skip NAME WHY: a step this run leaves out, listed as such.
skip() {
  echo "[gpu_check] $phase/$1: skipped ($2)"
  mkdir -p "$WORK/$phase"
  echo "skipped: $2" > "$WORK/$phase/$1.log"
  rows+=("| $phase | $1 | - | skipped | 0 | $2 |")
  write_summary
  archive
}

# The summary's last word, whatever ends the script (exit, a failed command, INT or TERM).
on_exit() {
  local rc=$?
  finished="Finished: exit $rc after $((SECONDS - started)) s."
  write_summary
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

info="import json, os, shutil, subprocess, torch, subnet_ext
b = subnet_ext.build_info()
print(json.dumps(b))
print('PIP_DISABLE_PIP_VERSION_CHECK=' + os.environ.get('PIP_DISABLE_PIP_VERSION_CHECK', 'unset'))
print('nvcc:', shutil.which('nvcc'))
print(subprocess.run(['nvidia-smi'], capture_output=True, text=True).stdout if shutil.which('nvidia-smi') else 'no nvidia-smi')
print('[summary] archs', b['cuda_archs'], 'CUDA kernels registered:', b['cuda_kernels_registered'], 'cuda visible:',
      torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"

phase_build() {
  # The toolkit's nvcc, where the image keeps it off PATH (setup.py finds it on PATH or at /usr/local/cuda).
  if ! command -v nvcc >/dev/null && [[ -z ${CUDA_HOME:-} ]]; then
    local found
    found=$(ls -d /usr/local/cuda/bin /usr/local/cuda-*/bin 2>/dev/null | head -n 1)
    [[ -n $found ]] && export PATH=$found:$PATH
  fi
  local pip=(env TORCH_CUDA_ARCH_LIST=9.0 SUBNET_EXT_CUDA=1 MAX_JOBS="${MAX_JOBS:-16}"
             "$PY" -m pip install -q --no-build-isolation --no-deps -e .)
  if ((dry)); then
    skip build "dry run: reuses the installed package"
    step build-info "$PY" -c "$info"
  else
    step build "${pip[@]}"  # again on a warm machine: ninja recompiles only what changed
    step build-info "$PY" -c "$info
import sys; sys.exit(0 if b['cuda_kernels_registered'] and torch.cuda.is_available() else 1)"
  fi
  step bench-build env PY="$PY" bash bench/build.sh
  bench_build_rc=$step_rc
}

# The per-test limit's pytest options: pytest-timeout where installed (with xdist its thread
# method, which ends the stuck worker and xdist replaces it, so a test stuck in a CUDA or
# NCCL call fails alone; without xdist its signal method, which fails the test and goes on),
# else pytest's own faulthandler_timeout (the stacks of a test that overruns, no stop).
per_test_limit() {
  local method=signal
  "$PY" -c "import xdist" 2>/dev/null && method=thread
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    echo "--timeout=$TEST_LIMIT --timeout-method=$method"  # the plugin loads itself (its entry point)
  else
    echo "-o faulthandler_timeout=$TEST_LIMIT"
  fi
}

phase_tests() {
  local dir=$WORK/tests parallel=() limit
  mkdir -p "$dir"
  # pytest-xdist where installed (the GPU image has it): 4 workers share the GPU.
  if "$PY" -c "import xdist" 2>/dev/null; then parallel=(-n 4 --dist loadfile); fi
  read -ra limit <<< "$(per_test_limit)"
  # No -x: every failure is listed. A module that fails to import on this machine (a package
  # its image lacks) is reported as an error without stopping the other modules' tests.
  local pytest=("$PY" -m pytest -q -m cuda -p no:cacheprovider "${parallel[@]}" "${limit[@]}" --durations=30
                --continue-on-collection-errors --junitxml="$dir/junit.xml" tests)
  # Every cuda-marked test is selected (on CPU they are skipped); the count is the note.
  step tests-cuda "${pytest[@]}"
}

# bench_step NAME BINARY: runs a benchmark binary if bench-build built it.
bench_step() {
  local name=$1 binary=$2
  if ((${bench_build_rc:-0} != 0)); then
    skip "$name" "bench-build failed (exit $bench_build_rc): no benchmark binary to run"
  elif [[ ! -x $binary && -z $(injected "$name") ]]; then
    skip "$name" "$binary was not built (no build phase run, or this build of subnet_ext has no CUDA kernels)"
  elif ((dry)); then
    step "$name" bash -c "echo '[summary] $binary built; not run (dry run: needs a GPU)'"
  else
    step "$name" "$binary"
  fi
}

phase_bench() {
  bench_step bench-masked-linear bench/bin/masked_linear_cuda_bench
  bench_step bench-pack-segments bench/bin/pack_segments_cuda_bench
}

phase_e2e() {
  local dev=cuda backend=nccl steps=30 e2e run=$WORK/e2e/train
  e2e=(--models small --worlds 2 --coverages 0.5 --rounds 2 --steps 3 --min-seconds 0.5 --methods ddp,sdp
       --sdp-variants block-forward,neuron-forward,neuron-backward --skip-overlap --fail-on-error)
  if ((dry)); then
    dev=cpu backend=gloo steps=3
    e2e=(--models tiny --worlds 2 --coverages 0.5 --rounds 1 --steps 1 --min-seconds 0 --warmup 1 --batch-size 2
         --seq-len 16 --methods sdp --sdp-variants block-forward --skip-overlap --fail-on-error)
  fi
  mkdir -p "$WORK/e2e"
  step train-nccl "$PY" -m subnet_ext.cli.train --method sdp --model llama --preset tiny --data synthetic \
    --steps "$steps" --eval-every "$steps" --nproc 1 --device "$dev" --backend "$backend" --out "$run"
  cp "$run/report.md" "$WORK/e2e/train-nccl-report.md" 2>/dev/null
  rm -rf "$run"  # checkpoints: not worth bringing back
  step e2e-gpu "$PY" bench/e2e.py --device "$dev" "${e2e[@]}" --out "$WORK/e2e/e2e-gpu.md"
  local memory=(--time-limit "$MEMORY_TIME_LIMIT")
  ((dry)) && memory=(--device cpu --size tiny --warmup 1 --steps 1)
  # Its own exit 3 (a prediction off by more than 10%, or rows left out) is a result, not a failure.
  step memory-1b "$PY" bench/memory_1b.py "${memory[@]}" --out "$WORK/e2e/memory-1b.md"
}

for phase in "${phases[@]}"; do
  "phase_$phase"
done
echo
cat "$SUMMARY"
((failed == 0)) || { echo "[gpu_check] $failed step(s) failed" >&2; exit 1; }
((below == 0)) || { echo "[gpu_check] $below step(s) ran below their speed target (not failures)" >&2; exit 3; }

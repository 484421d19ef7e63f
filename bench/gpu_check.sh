#!/usr/bin/env bash
# The GPU check on a lent H200, in two phases, each ONE device call of at most 8 minutes
# (each step has its own time limit; the limits of a phase add up to <= 450 s):
#
#   OUT=$OUT bash bench/gpu_check.sh phase1   # build for sm_90, CUDA tests, kernel microbenchmarks
#   OUT=$OUT bash bench/gpu_check.sh phase2   # NCCL training (one rank), rank 0 of 8 simulated, e2e on GPU
#   OUT=/tmp/x bash bench/gpu_check.sh phase1 --dry-run   # the same plumbing on CPU, tiny sizes (CI)
#
# Run phase2 right after phase1, on the still-warm machine: its first step reuses
# phase1's build (and rebuilds, within its limit, on a fresh machine).
# Every step writes its output to $OUT/<step>.log as it runs (tee), and $OUT/summary.md
# (step, exit code, seconds, notes) is rewritten after every step, so a call killed at
# its limit still brings back everything done so far. At most 7 files per phase land in
# $OUT (the device tool brings back 8). Exit status: non-zero when any step failed.
# GPU_CHECK_FAIL_STEP=<step> makes that step fail on purpose (tests the plumbing).
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

write_summary() {
  {
    echo "# GPU check $phase$( ((dry)) && echo ' (dry run, CPU)')"
    echo
    echo "Command: \`bash bench/gpu_check.sh $cmdline\`; $(date -u +%Y-%m-%dT%H:%MZ); device: $device."
    echo
    echo "| step | exit | seconds | notes |"
    echo "|---|---:|---:|---|"
    printf '%s\n' "${rows[@]}"
  } > "$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"
}

# step NAME LIMIT_S CMD...: runs CMD under a time limit, its output teed into $OUT/NAME.log,
# then adds its summary row and rewrites the summary.
step() {
  local name=$1 limit=$2
  shift 2
  local log=$OUT/$name.log start=$SECONDS rc note
  echo "[gpu_check] $name (limit ${limit} s): $*"
  { echo "# $name"; echo; echo "Command: \`$*\` (limit ${limit} s)"; echo; } > "$log"
  if [[ ${GPU_CHECK_FAIL_STEP:-} == "$name" ]]; then
    set -- bash -c "echo 'failing on purpose: GPU_CHECK_FAIL_STEP=$name'; exit 97"
  fi
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  note=$(grep -v '^\s*$' "$log" | tail -n 1 | tr '|' '/' | cut -c1-100)
  if ((rc == 124 || rc == 137)); then note="timed out after ${limit} s; last: $note"; fi
  ((rc != 0)) && failed=$((failed + 1))
  rows+=("| $name | $rc | $((SECONDS - start)) | $note |")
  write_summary
}

# skip NAME WHY: a step this run leaves out, listed as such.
skip() {
  echo "[gpu_check] $1: skipped ($2)"
  rows+=("| $1 | - | 0 | skipped ($2) |")
  write_summary
}

if ((dry)); then
  device="cpu (dry run)"
else
  device=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 1)
fi
# Whether the installed subnet_ext has CUDA kernels for sm_90 (a build to reuse).
have_build="import subnet_ext._build_info as b, sys; sys.exit(0 if b.WITH_CUDA and '9.0' in b.CUDA_ARCHS else 1)"
build=(env TORCH_CUDA_ARCH_LIST=9.0 SUBNET_EXT_CUDA=1 MAX_JOBS="${MAX_JOBS:-16}"
       "$PY" -m pip install -q --no-build-isolation --no-deps -e .)
info="import json, torch, subnet_ext._build_info as b
print(json.dumps({k: getattr(b, k) for k in ('TORCH_VERSION', 'CUDA_VERSION', 'CUDA_ARCHS', 'WITH_CUDA')}))
print('cuda visible:', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"

phase1() {
  if ((dry)); then
    skip build "dry run: reuses the installed package"
    step build-info 30 "$PY" -c "$info"
    # The CUDA-marked tests of the three files that hold them (on CPU they are skipped).
    step tests-cuda 60 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests/test_engine_cuda.py \
      tests/test_masked_linear.py tests/test_pack_segments.py
    skip bench-build "dry run: compiling the benchmarks takes minutes on CPU"
    skip bench-masked-linear "dry run: needs a GPU"
    skip bench-pack-segments "dry run: needs a GPU"
    return
  fi
  step build 230 "${build[@]}"
  step build-info 15 "$PY" -c "$info; import sys; sys.exit(0 if b.WITH_CUDA and torch.cuda.is_available() else 1)"
  # Every test marked cuda (tests/conftest.py marks the device='cuda' variants); no -x.
  step tests-cuda 95 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests
  step bench-build 50 env PY="$PY" bash bench/build.sh
  step bench-masked-linear 30 bench/bin/masked_linear_cuda_bench
  step bench-pack-segments 30 bench/bin/pack_segments_cuda_bench
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

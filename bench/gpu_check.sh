#!/usr/bin/env bash
# The GPU check, one call on a lent H200 (see README "Status"): build for sm_90, the test
# suite with its CUDA variants (kernels, engine with NCCL on one rank, simulated ranks),
# the CUDA microbenchmarks, subnet-train on the GPU (NCCL, one rank; and rank 0 of 8
# simulated), and the one-rank-of-K target of issue 5. Six files land in $OUT (the device
# tool brings back at most eight): log.md (every step's output), kernels.md,
# simulated-rank-1b.md, train-sdp-nccl.md, train-sdp-rank0-of-8.md and summary.md, whose
# table is also printed last. Commit them under bench/results/h200/. About 8 minutes.
#
#   OUT=/tmp/gpu bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/h200}
PY=${PY:-python3}
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=9.0 SUBNET_EXT_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
LOG=$OUT/log.md
: > "$LOG"
rows=()

# step NAME FILE TIMEOUT_S CMD...: runs CMD, appending its output to FILE (and to the log),
# and adds a summary row with its exit code, time and PASS/FAIL verdicts.
step() {
  local name=$1 file=$2 limit=$3
  shift 3
  local start=$SECONDS tmp
  tmp=$(mktemp)
  echo "[gpu_check] $name: $*"
  { echo "## $name"; echo; echo "Command: \`$*\`"; echo; } > "$tmp"
  timeout "$limit" "$@" >> "$tmp" 2>&1
  local rc=$?
  cat "$tmp" >> "$LOG"
  [[ $file != "$LOG" ]] && cat "$tmp" >> "$file"
  local passed failed
  passed=$(grep -c "PASS" "$tmp")
  failed=$(grep -c "FAIL" "$tmp")
  rows+=("| $name | $rc | $((SECONDS - start)) | $passed | $failed | $(grep -v '^\s*$' "$tmp" | tail -n 1 | cut -c1-90) |")
  rm -f "$tmp"
}

device=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 1)
: > "$OUT/kernels.md"
: > "$OUT/simulated-rank-1b.md"
step build "$LOG" 400 $PY -m pip install -q --no-build-isolation --no-deps -e .
step build-info "$LOG" 60 $PY -c "import subnet_ext, json; print(json.dumps(subnet_ext.build_info()))"
step tests "$LOG" 420 $PY -m pytest -q -x tests
step bench-build "$LOG" 300 env PY=$PY bash bench/build.sh
step masked-linear-bf16 "$OUT/kernels.md" 200 bench/bin/masked_linear_cuda_bench
step pack-segments "$OUT/kernels.md" 200 bench/bin/pack_segments_cuda_bench
for run in nccl rank0-of-8; do
  args=(--method sdp --model llama --preset small --data synthetic --steps 300 --eval-every 100 --device cuda)
  if [[ $run == nccl ]]; then args+=(--backend nccl --nproc 1); else args+=(--coverage 0.25 --simulate-rank 0 --world-size 8); fi
  step "train-sdp-$run" "$LOG" 300 $PY -m subnet_ext.cli.train "${args[@]}" --out "/tmp/train-sdp-$run"
  cp "/tmp/train-sdp-$run/report.md" "$OUT/train-sdp-$run.md" 2>/dev/null
done
step simulated-rank-1b "$OUT/simulated-rank-1b.md" 400 $PY bench/simulated_rank.py --preset 1b --dtype bf16 \
  --world-size 8 --rank 0 --coverage 0.25 --batch-size 4 --seq-len 1024

{
  echo "# GPU check summary"
  echo
  echo "Device: $device. Command: \`bash bench/gpu_check.sh\`, $(date -u +%Y-%m-%dT%H:%MZ)."
  echo
  echo "| step | exit | seconds | PASS | FAIL | last line |"
  echo "|---|---:|---:|---:|---:|---|"
  printf '%s\n' "${rows[@]}"
} | tee "$OUT/summary.md"

#!/usr/bin/env bash
# Runs the CPU microbenchmarks (the GPU ones run from bench/gpu_check.sh) and writes bench/results/cpu.md (command, machine, tables).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=bench/results/cpu.md
mkdir -p bench/results
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
{
  echo "# CPU microbenchmarks"
  echo
  echo "Command: \`make bench\` (bash bench/build.sh && bash bench/run_cpu.sh), $(date -u +%Y-%m-%dT%H:%MZ)."
  echo "Machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), OMP_NUM_THREADS=$OMP_NUM_THREADS," \
       "torch $($PY -c 'import torch; print(torch.__version__)')."
  echo
  echo "## Masked linear, forward + backward (fp32)"
  echo
  bench/bin/masked_linear_bench
  echo
  echo "## pack_segments + unpack_average_ (fp32)"
  echo
  bench/bin/pack_segments_bench
} | tee "$out"

#!/usr/bin/env bash
# Builds the standalone microbenchmarks into bench/bin/, linked against the library that
# `make build` built (subnet_ext/_C*.so, which holds every kernel and registers the ops
# when loaded; the benchmarks call them through the dispatcher) and libtorch, so no
# kernel source is compiled a second time. CPU binaries always; CUDA binaries when this
# build of subnet_ext has CUDA kernels. A binary is rebuilt only when its source, a shared
# header or the library is newer.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# torch's folder, found without importing torch (seconds saved); TORCH_DIR skips even that.
TORCH=${TORCH_DIR:-$($PY -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('torch').origin))")}
CXX=${CXX:-g++}
FLAGS=(-O3 -std=c++20 -fopenmp -fPIC -DNDEBUG -Icsrc -Ibench -I"$TORCH/include" -I"$TORCH/include/torch/csrc/api/include")
LIBS=(-L"$TORCH/lib" -Wl,-rpath,"$TORCH/lib" -Wl,--no-as-needed -ltorch -ltorch_cpu -lc10)
mkdir -p bench/bin

stale() {  # stale OUTPUT SOURCE...: OUTPUT is missing or older than a source, a shared header or this script
  local out=$1; shift
  [[ -f $out ]] || return 0
  local s
  for s in "$@" bench/build.sh csrc/*.h csrc/cuda/*.cuh csrc/kernels/*.h bench/*.h; do [[ $s -nt $out ]] && return 0; done
  return 1
}

# Background jobs: each PID is waited for by itself, so that a failed compile or link
# fails the script (a bare `wait` returns 0 whatever the jobs returned).
pids=()
spawn() {
  "$@" &
  pids+=($!)
}
wait_all() {
  local pid failed=0
  for pid in "${pids[@]}"; do
    wait "$pid" || failed=1
  done
  pids=()
  if ((failed)); then
    echo "bench/build.sh: a compile or link step failed (see above)" >&2
    exit 1
  fi
}

# The library itself, linked directly (rpath: its folder). Its one Python symbol
# (PyModule_Create2, used only by PyInit__C, which a benchmark never calls) stays
# unresolved: allowed at link time, and never bound at run time (lazy binding).
LIB=$(ls subnet_ext/_C*.so 2>/dev/null | head -n 1)
if [[ -z $LIB ]]; then
  echo "bench/build.sh: no subnet_ext/_C*.so; build the package first (make build)" >&2
  exit 1
fi
LIBDIR=$(cd "$(dirname "$LIB")" && pwd)
objs=("$LIB")
LIBS+=("$LIBDIR/$(basename "$LIB")" -Wl,-rpath,"$LIBDIR" -Wl,--allow-shlib-undefined -Wl,-z,lazy)

# With CUDA kernels in the library, every binary links the CUDA runtime libraries too:
# the library needs them (libc10_cuda, libcudart), and its own RUNPATH does not name their
# folders, so a binary must load them itself (its NEEDED entries are loaded first).
info=$($PY -c "
from subnet_ext import _build_info as b
print(int(b.WITH_CUDA), b.CUDA_HOME or '-')")  # a failed import stops the script (set -e)
read -r WITH_CUDA CUDA_HOME <<< "$info"
if [[ $WITH_CUDA == 1 ]]; then
  LIBS+=(-ltorch_cuda -lc10_cuda -L"$CUDA_HOME/lib64" -Wl,-rpath,"$CUDA_HOME/lib64" -lcudart)
fi

for main in masked_linear_bench pack_segments_bench; do
  if stale bench/bin/$main bench/$main.cpp "${objs[@]}"; then
    echo "build bench/bin/$main"
    spawn "$CXX" "${FLAGS[@]}" bench/$main.cpp -o bench/bin/$main "${LIBS[@]}"
  fi
done

# CUDA binaries: only when the installed subnet_ext was built with CUDA kernels. They need
# the host compiler and the CUDA headers only (no device code of their own).
if [[ $WITH_CUDA == 1 ]]; then
  for main in masked_linear_cuda_bench pack_segments_cuda_bench; do
    if stale bench/bin/$main bench/$main.cpp "${objs[@]}"; then
      echo "build bench/bin/$main"
      spawn "$CXX" "${FLAGS[@]}" -I"$CUDA_HOME/include" bench/$main.cpp -o bench/bin/$main "${LIBS[@]}"
    fi
  done
else
  echo "CUDA benchmarks not built: this build of subnet_ext has no CUDA kernels"
fi
wait_all

#!/usr/bin/env bash
# Builds the standalone microbenchmarks into bench/bin/ from the library's own kernel
# sources (csrc/*.cpp except the Python module, csrc/cpu/*.cpp; csrc/cuda/*.cu for the GPU
# binaries), linked against libtorch. CPU binaries always; CUDA binaries when this build
# of subnet_ext has CUDA kernels (then nvcc and CUDA_HOME are the ones setup.py resolved).
# Objects are rebuilt only when their source (or a shared header) is newer.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TORCH=${TORCH_DIR:-$($PY -c "import torch, os; print(os.path.dirname(torch.__file__))")}  # TORCH_DIR skips the import
CXX=${CXX:-g++}
FLAGS=(-O3 -std=c++20 -fopenmp -fPIC -DNDEBUG -Icsrc -Ibench -I"$TORCH/include" -I"$TORCH/include/torch/csrc/api/include")
LIBS=(-L"$TORCH/lib" -Wl,-rpath,"$TORCH/lib" -Wl,--no-as-needed -ltorch -ltorch_cpu -lc10)
mkdir -p bench/bin/obj

stale() {  # stale OUTPUT SOURCE...: OUTPUT is missing or older than a source or shared header
  local out=$1; shift
  [[ -f $out ]] || return 0
  local s
  for s in "$@" csrc/*.h csrc/cuda/*.cuh csrc/kernels/*.h bench/*.h; do [[ $s -nt $out ]] && return 0; done
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

objs=()
for src in csrc/*.cpp csrc/cpu/*.cpp; do
  [[ $src == csrc/python_module.cpp ]] && continue
  obj=bench/bin/obj/$(echo "${src%.cpp}" | tr / _).o
  if stale "$obj" "$src"; then
    echo "compile $src"
    spawn "$CXX" "${FLAGS[@]}" -c "$src" -o "$obj"
  fi
  objs+=("$obj")
done
wait_all

for main in masked_linear_bench pack_segments_bench; do
  if stale bench/bin/$main bench/$main.cpp "${objs[@]}"; then
    echo "build bench/bin/$main"
    spawn "$CXX" "${FLAGS[@]}" bench/$main.cpp "${objs[@]}" -o bench/bin/$main "${LIBS[@]}"
  fi
done
wait_all

# CUDA binaries: only when the installed subnet_ext was built with CUDA kernels.
read -r WITH_CUDA CUDA_HOME ARCHS < <($PY -c "
from subnet_ext import _build_info as b
print(int(b.WITH_CUDA), b.CUDA_HOME or '-', ','.join(b.CUDA_ARCHS) or '-')")
if [[ $WITH_CUDA != 1 ]]; then
  echo "CUDA benchmarks not built: this build of subnet_ext has no CUDA kernels"
  exit 0
fi
NVCC=$CUDA_HOME/bin/nvcc
GENCODE=()
for arch in ${ARCHS//,/ }; do
  a=${arch//./}
  GENCODE+=(-gencode "arch=compute_$a,code=sm_$a")
done
# The half/bfloat16 switches torch's extension build passes to nvcc, so the kernels
# compile here exactly as in the library.
NVFLAGS=(-O3 -std=c++20 --expt-relaxed-constexpr -DNDEBUG -Xcompiler -fPIC "${GENCODE[@]}"
         -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
         -D__CUDA_NO_HALF2_OPERATORS__ -Icsrc -I"$TORCH/include" -I"$TORCH/include/torch/csrc/api/include")
cuda_objs=()
for src in csrc/cuda/*.cu; do
  obj=bench/bin/obj/$(echo "${src%.cu}" | tr / _).o
  if stale "$obj" "$src"; then
    echo "compile $src"
    "$NVCC" "${NVFLAGS[@]}" -c "$src" -o "$obj"
  fi
  cuda_objs+=("$obj")
done
CUDA_LIBS=(-ltorch_cuda -lc10_cuda -L"$CUDA_HOME/lib64" -Wl,-rpath,"$CUDA_HOME/lib64" -lcudart)
for main in masked_linear_cuda_bench pack_segments_cuda_bench; do
  if stale bench/bin/$main bench/$main.cpp "${objs[@]}" "${cuda_objs[@]}"; then
    echo "build bench/bin/$main"
    spawn "$CXX" "${FLAGS[@]}" -I"$CUDA_HOME/include" bench/$main.cpp "${objs[@]}" "${cuda_objs[@]}" \
      -o bench/bin/$main "${LIBS[@]}" "${CUDA_LIBS[@]}"
  fi
done
wait_all

#!/usr/bin/env bash
# Builds the standalone CPU microbenchmarks into bench/bin/ from the library's own kernel
# sources (csrc/*.cpp except the Python module, csrc/cpu/*.cpp), linked against libtorch.
# Objects are rebuilt only when their source is newer. CUDA benchmark binaries are not
# built yet (see README: Status).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TORCH=$($PY -c "import torch, os; print(os.path.dirname(torch.__file__))")
CXX=${CXX:-g++}
FLAGS=(-O3 -std=c++20 -fopenmp -fPIC -DNDEBUG -Icsrc -Ibench -I"$TORCH/include" -I"$TORCH/include/torch/csrc/api/include")
mkdir -p bench/bin/obj
objs=()
for src in csrc/*.cpp csrc/cpu/*.cpp; do
  [[ $src == csrc/python_module.cpp ]] && continue
  obj=bench/bin/obj/$(echo "${src%.cpp}" | tr / _).o
  if [[ ! -f $obj || $src -nt $obj || csrc/ops.h -nt $obj ]]; then
    echo "compile $src"
    "$CXX" "${FLAGS[@]}" -c "$src" -o "$obj" &
  fi
  objs+=("$obj")
done
wait
for main in masked_linear_bench pack_segments_bench; do
  if [[ ! -f bench/bin/$main || bench/$main.cpp -nt bench/bin/$main ]]; then
    echo "build bench/bin/$main"
    "$CXX" "${FLAGS[@]}" bench/$main.cpp "${objs[@]}" -o bench/bin/$main \
      -L"$TORCH/lib" -Wl,-rpath,"$TORCH/lib" -Wl,--no-as-needed -ltorch -ltorch_cpu -lc10 &
  fi
done
wait

// Row loops of the masked linear's gathers and scatters, shared by the CPU kernels and
// the standalone benchmarks (the CUDA kernels use the same index contract per element).
#pragma once

#include <cstdint>

#include "kernels/device_macros.h"

namespace subnet_ext {

// Source column of output column c: cols[c], or c itself when no index is given.
SUBNET_HD int64_t gathered_index(const int64_t* idx, int64_t c) { return idx ? idx[c] : c; }

// dst[c] = src[cols[c]] for c < n (one row of a gather).
template <typename T>
void gather_row(const T* src, const int64_t* cols, int64_t n, T* dst) {
  if (!cols) {
    for (int64_t c = 0; c < n; ++c) dst[c] = src[c];
    return;
  }
  for (int64_t c = 0; c < n; ++c) dst[c] = src[cols[c]];
}

// dst[cols[c]] = src[c] for c < n (one row of a scatter; other entries untouched).
template <typename T>
void scatter_row(const T* src, const int64_t* cols, int64_t n, T* dst) {
  for (int64_t c = 0; c < n; ++c) dst[cols[c]] = src[c];
}

}  // namespace subnet_ext

// Validation shared by every op and device: clear errors that name the op and the values.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>

namespace subnet_ext {

constexpr int64_t kNoBound = std::numeric_limits<int64_t>::max();

// idx must be a 1-D int64 tensor on `device`, with distinct values in [0, bound).
// check_values=false checks dtype, dim and device only (no device sync): the caller
// guarantees the values. With check_values=true, on CUDA this synchronises once (the
// values are read back to report them).
void check_index(const char* op, const char* name, const at::Tensor& idx, int64_t bound, c10::Device device,
                 bool check_values = true);

}  // namespace subnet_ext

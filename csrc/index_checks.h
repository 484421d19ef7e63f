// Validation shared by every op and device: clear errors that name the op and the values.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>

namespace subnet_ext {

constexpr int64_t kNoBound = std::numeric_limits<int64_t>::max();

// idx must be a 1-D int64 tensor on `device`, with distinct values in [0, bound).
// check_values=true checks all of it; on CUDA this synchronises once (the values are read
// back to report them). check_values=false (no device sync; the caller guarantees the
// values) still checks dtype, dim and device, and on CPU the range in one pass over idx
// (O(|idx|) against the op's O(rows x |idx|) work: a bad index gets an error instead of
// an out-of-bounds access). On CUDA the kernels assert the range on the device instead.
// Distinctness is checked only with check_values=true.
void check_index(const char* op, const char* name, const at::Tensor& idx, int64_t bound, c10::Device device,
                 bool check_values = true);

}  // namespace subnet_ext

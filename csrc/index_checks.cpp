#include "index_checks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

namespace subnet_ext {
namespace {

// Host copy of a small index tensor (indices are at most a layer's width).
std::vector<int64_t> host_values(const at::Tensor& idx) {
  const at::Tensor cpu = idx.is_cpu() ? idx.contiguous() : idx.to(c10::kCPU).contiguous();
  const int64_t* p = cpu.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + cpu.numel());
}

// One pass, no copy, no sort: the range check of the unchecked path on CPU.
void check_range(const char* op, const char* name, const at::Tensor& idx, int64_t bound) {
  const at::Tensor dense = idx.contiguous();
  const int64_t* p = dense.const_data_ptr<int64_t>();
  const auto [lowest, highest] = std::minmax_element(p, p + dense.numel());
  TORCH_CHECK_VALUE(*lowest >= 0 && *highest < bound, op, ": ", name, " has values in [", *lowest, ", ", *highest,
                    "] but must lie in [0, ", bound, ") (check_indices=False checks only this range on CPU)");
}

}  // namespace

void check_index(const char* op, const char* name, const at::Tensor& idx, int64_t bound, c10::Device device,
                 bool check_values) {
  TORCH_CHECK_VALUE(idx.scalar_type() == c10::kLong, op, ": ", name, " must be an int64 tensor, got ",
                    idx.scalar_type());
  TORCH_CHECK_VALUE(idx.dim() == 1, op, ": ", name, " must be 1-D, got shape ", idx.sizes());
  TORCH_CHECK_VALUE(idx.device() == device, op, ": ", name, " is on ", idx.device(),
                    " but the operands are on ", device);
  if (idx.numel() == 0) return;
  if (!check_values) {
    if (idx.is_cpu() && bound != kNoBound) check_range(op, name, idx, bound);
    return;
  }
  std::vector<int64_t> values = host_values(idx);
  std::sort(values.begin(), values.end());
  TORCH_CHECK_VALUE(values.front() >= 0 && values.back() < bound, op, ": ", name, " has values in [",
                    values.front(), ", ", values.back(), "] but must lie in [0, ", bound, ")");
  const auto dup = std::adjacent_find(values.begin(), values.end());
  TORCH_CHECK_VALUE(dup == values.end(), op, ": ", name, " holds the index ", (dup == values.end() ? 0 : *dup),
                    " more than once; indices must be distinct");
}

}  // namespace subnet_ext

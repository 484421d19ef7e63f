// The CUDA kernels' launch settings and counters that tests use (ops.h): the index kernels'
// grid limit and the count of launches per kernel path, in a file of their own so that
// CPU-only builds define the ops that tests call too.
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <sstream>
#include <string>

#include "ops.h"

namespace subnet_ext {
namespace {
constexpr int64_t kHardwareGridLimit = 65535;  // gridDim.y; the kernels use it for x too
std::atomic<int64_t> grid_limit{kHardwareGridLimit};

// The names tests ask for, in the order of KernelPath.
constexpr std::array<const char*, static_cast<size_t>(KernelPath::kCount)> kPathNames{
    "gather_rows_vector", "gather_columns_vector", "gather_elements", "scatter_columns_vector",
    "scatter_columns_elements", "segments_vector", "segments_elements"};
std::array<std::atomic<int64_t>, static_cast<size_t>(KernelPath::kCount)> path_counts{};
}  // namespace

void count_kernel_path(KernelPath path, int64_t n) {
  path_counts[static_cast<size_t>(path)].fetch_add(n, std::memory_order_relaxed);
}

int64_t kernel_path_count(c10::string_view name) {
  for (size_t i = 0; i < kPathNames.size(); ++i) {
    if (name == kPathNames[i]) return path_counts[i].load(std::memory_order_relaxed);
  }
  std::ostringstream known;
  for (const char* n : kPathNames) known << " " << n;
  TORCH_CHECK_VALUE(false, "subnet_ext._kernel_path_count: unknown kernel path '", std::string(name),
                    "'; the paths are:", known.str());
  return 0;  // unreachable: TORCH_CHECK_VALUE(false, ...) throws
}

int64_t max_grid_blocks() { return grid_limit.load(std::memory_order_relaxed); }

int64_t set_max_grid_blocks(int64_t blocks) {
  TORCH_CHECK_VALUE(blocks >= 1 && blocks <= kHardwareGridLimit, "subnet_ext._set_max_grid_blocks: blocks must lie in [1, ",
                    kHardwareGridLimit, "], got ", blocks);
  return grid_limit.exchange(blocks);
}

}  // namespace subnet_ext

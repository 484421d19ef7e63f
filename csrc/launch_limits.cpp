// The CUDA index kernels' grid limit (ops.h), in a file of its own so that CPU-only builds
// define the op that tests call too.
#include <c10/util/Exception.h>

#include <atomic>

#include "ops.h"

namespace subnet_ext {
namespace {
constexpr int64_t kHardwareGridLimit = 65535;  // gridDim.y; the kernels use it for x too
std::atomic<int64_t> grid_limit{kHardwareGridLimit};
}  // namespace

int64_t max_grid_blocks() { return grid_limit.load(std::memory_order_relaxed); }

int64_t set_max_grid_blocks(int64_t blocks) {
  TORCH_CHECK_VALUE(blocks >= 1 && blocks <= kHardwareGridLimit, "subnet_ext._set_max_grid_blocks: blocks must lie in [1, ",
                    kHardwareGridLimit, "], got ", blocks);
  return grid_limit.exchange(blocks);
}

}  // namespace subnet_ext

// CPU kernels of the masked linear: row-parallel gathers and scatters around ATen GEMMs.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/mm.h>

#include <algorithm>

#include "kernels/gather.h"
#include "masked_linear_registration.h"
#include "ops.h"

namespace subnet_ext {
namespace {

// Rows are independent; a grain of rows keeps each task above ~32K elements.
int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width)); }

void gather_cpu(const at::Tensor& src, const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& dst) {
  const int64_t n_rows = dst.size(0), n_cols = dst.size(1), src_cols = src.size(1);
  const int64_t* row_idx = rows.defined() ? rows.data_ptr<int64_t>() : nullptr;
  const int64_t* col_idx = cols.defined() ? cols.data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "subnet_ext.gather_cpu", [&] {
    const scalar_t* s = src.const_data_ptr<scalar_t>();
    scalar_t* d = dst.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n_rows, row_grain(n_cols), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        gather_row(s + gathered_index(row_idx, r) * src_cols, col_idx, n_cols, d + r * n_cols);
      }
    });
  });
}

void scatter_columns_cpu(const at::Tensor& src, const at::Tensor& cols, const at::Tensor& dst) {
  const int64_t n_rows = src.size(0), n_cols = src.size(1), dst_cols = dst.size(1);
  const int64_t* col_idx = cols.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "subnet_ext.scatter_cpu", [&] {
    const scalar_t* s = src.const_data_ptr<scalar_t>();
    scalar_t* d = dst.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n_rows, row_grain(dst_cols), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = d + r * dst_cols;
        std::fill(row, row + dst_cols, scalar_t(0));
        scatter_row(s + r * n_cols, col_idx, n_cols, row);
      }
    });
  });
}

// IndexKernels::gemm_float_out. ATen's CPU GEMMs have no half-precision-in, fp32-out
// variant: the operands (already the gathered owned block) are widened to fp32, which is
// exact, so the sums are those of a GEMM accumulating in fp32.
void gemm_float_out_cpu(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  const at::Tensor a32 = a.to(at::kFloat), b32 = b.to(at::kFloat);
  at::Tensor& result = const_cast<at::Tensor&>(out);
  if (accumulate) {
    result.addmm_(a32, b32);
  } else {
    at::mm_out(result, a32, b32);
  }
}

constexpr IndexKernels kCpuKernels{gather_cpu, scatter_columns_cpu, gemm_float_out_cpu};

}  // namespace

SUBNET_EXT_REGISTER_MASKED_LINEAR(CPU, kCpuKernels)

}  // namespace subnet_ext

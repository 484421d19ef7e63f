// CPU kernels of the masked linear: row-parallel gathers and scatters around ATen GEMMs.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>

#include "kernels/gather.h"
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

constexpr IndexKernels kCpuKernels{gather_cpu, scatter_columns_cpu};

at::Tensor masked_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                             const OptTensor& out_idx, const OptTensor& in_idx, bool compact_weight,
                             int64_t scatter_width) {
  return masked_linear_impl("subnet_ext.masked_linear", x, weight, bias, out_idx, in_idx, compact_weight,
                            scatter_width, kCpuKernels);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_linear_forward_cpu(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, const OptTensor& out_idx,
    const OptTensor& in_idx, bool compact_weight, int64_t scatter_width) {
  return masked_linear_forward_impl(x, weight, bias, out_idx, in_idx, compact_weight, scatter_width, kCpuKernels);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_linear_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, const OptTensor& out_idx,
    const OptTensor& in_idx, bool compact_weight, bool grad_out_full, bool dense_grad_input,
    std::array<bool, 3> output_mask, const OptTensor& x_kept, const OptTensor& weight_block) {
  return masked_linear_backward_impl(grad_out, x, weight, out_idx, in_idx, compact_weight, grad_out_full,
                                     dense_grad_input, output_mask, x_kept, weight_block, kCpuKernels);
}

void masked_linear_grad_weight_cpu(const at::Tensor& out, const at::Tensor& grad_out, const at::Tensor& x,
                                   const OptTensor& out_idx, const OptTensor& in_idx, bool grad_out_full,
                                   bool accumulate) {
  masked_linear_grad_weight_impl(out, grad_out, x, out_idx, in_idx, grad_out_full, accumulate, kCpuKernels);
}

}  // namespace

TORCH_LIBRARY_IMPL(subnet_ext, CPU, m) {
  m.impl("masked_linear", &masked_linear_cpu);
  m.impl("masked_linear_forward", &masked_linear_forward_cpu);
  m.impl("masked_linear_backward", &masked_linear_backward_cpu);
  m.impl("masked_linear_grad_weight_", &masked_linear_grad_weight_cpu);
}

}  // namespace subnet_ext

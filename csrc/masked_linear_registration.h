// Registration of the five masked linear ops for one dispatch key. A device file defines
// its IndexKernels table (gather, scatter_columns, gemm_float_out) and calls
//   SUBNET_EXT_REGISTER_MASKED_LINEAR(CPU, kCpuKernels)
// once; the op bodies (validation, shapes, GEMMs) are the device-independent ones in
// masked_linear.cpp, so the devices cannot drift apart.
#pragma once

#include <torch/library.h>

#include "ops.h"

namespace subnet_ext {

template <const IndexKernels& kKernels>
struct MaskedLinearOps {
  static at::Tensor masked_linear(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                                  const OptTensor& out_idx, const OptTensor& in_idx, bool compact_weight,
                                  int64_t scatter_width, bool check_indices) {
    return masked_linear_impl("subnet_ext.masked_linear", x, weight, bias, out_idx, in_idx, compact_weight,
                              scatter_width, check_indices, kKernels);
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& weight,
                                                                const OptTensor& bias, const OptTensor& out_idx,
                                                                const OptTensor& in_idx, bool compact_weight,
                                                                int64_t scatter_width, bool check_indices) {
    return masked_linear_forward_impl(x, weight, bias, out_idx, in_idx, compact_weight, scatter_width,
                                      check_indices, kKernels);
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
      const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, const OptTensor& out_idx,
      const OptTensor& in_idx, bool compact_weight, bool grad_out_full, bool dense_grad_input,
      std::array<bool, 3> output_mask, const OptTensor& x_kept, const OptTensor& weight_block, bool check_indices) {
    return masked_linear_backward_impl(grad_out, x, weight, out_idx, in_idx, compact_weight, grad_out_full,
                                       dense_grad_input, output_mask, x_kept, weight_block, check_indices, kKernels);
  }

  static void grad_weight(const at::Tensor& out, const at::Tensor& grad_out, const at::Tensor& x,
                          const OptTensor& out_idx, const OptTensor& in_idx, bool grad_out_full, bool accumulate,
                          bool check_indices) {
    masked_linear_grad_weight_impl(out, grad_out, x, out_idx, in_idx, grad_out_full, accumulate, check_indices,
                                   kKernels);
  }

  static void grad_runs(const OptTensor& weight_out, const OptTensor& bias_out, const at::Tensor& grad_out,
                        const at::Tensor& x, c10::IntArrayRef out_runs, c10::IntArrayRef in_runs, bool accumulate) {
    masked_linear_grad_runs_impl(weight_out, bias_out, grad_out, x, out_runs, in_runs, accumulate, kKernels);
  }

  static void register_all(torch::Library& m) {
    m.impl("masked_linear_grad_runs_", &grad_runs);
    m.impl("masked_linear", &masked_linear);
    m.impl("masked_linear_forward", &forward);
    m.impl("masked_linear_backward", &backward);
    m.impl("masked_linear_grad_weight_", &grad_weight);
  }
};

}  // namespace subnet_ext

// kernels: a constexpr IndexKernels object with static storage (e.g. in an anonymous namespace).
#define SUBNET_EXT_REGISTER_MASKED_LINEAR(DISPATCH_KEY, kernels) \
  TORCH_LIBRARY_IMPL(subnet_ext, DISPATCH_KEY, m) { ::subnet_ext::MaskedLinearOps<kernels>::register_all(m); }

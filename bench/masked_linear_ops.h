// Typed handles on the masked-linear ops, and index sets, shared by the CPU and CUDA
// microbenchmarks (they call the ops through the dispatcher, as Python does).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <array>
#include <optional>
#include <tuple>

namespace bench {

using OptTensor = std::optional<at::Tensor>;
using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The benchmarks call the ops as the engine does: check_indices=false (indices validated
// once when they were made), so no index is copied to the host per call.
constexpr bool kCheckIndices = false;

// subnet_ext::masked_linear_forward: (y, x_kept, weight_block).
inline const auto& forward_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("subnet_ext::masked_linear_forward", "")
                       .typed<Triple(const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                                     const OptTensor&, bool, int64_t, bool)>();
  return op;
}

// subnet_ext::masked_linear_backward: (grad_x, grad_weight, grad_bias).
inline const auto& backward_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("subnet_ext::masked_linear_backward", "")
                       .typed<Triple(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                                     const OptTensor&, bool, bool, bool, std::array<bool, 3>, const OptTensor&,
                                     const OptTensor&, bool)>();
  return op;
}

// subnet_ext::masked_linear_grad_runs_: the owned weight / bias gradient on runs (no gather).
inline const auto& grad_runs_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("subnet_ext::masked_linear_grad_runs_", "")
                       .typed<void(const OptTensor&, const OptTensor&, const at::Tensor&, const at::Tensor&,
                                   c10::IntArrayRef, c10::IntArrayRef, bool)>();
  return op;
}

// Dense forward + backward of the full layer (the ideal's yardstick): y, grad_x, grad_W, grad_b.
inline std::array<at::Tensor, 4> dense_forward_backward(const at::Tensor& x, const at::Tensor& w,
                                                        const at::Tensor& b, const at::Tensor& grad_y) {
  return {at::addmm(b, x, w.t()), grad_y.mm(w), grad_y.t().mm(x), grad_y.sum(0)};
}

// The composed baseline: gather the operands once (index_select), three GEMMs, scatter
// grad_x back into a zero full-width tensor. Returns y, grad_x, grad_W (kept block), grad_b.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> composed_forward_backward(
    const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const at::Tensor& grad_y, const at::Tensor& out_idx,
    const at::Tensor& in_idx) {
  const at::Tensor xs = x.index_select(1, in_idx);
  const at::Tensor ws = w.index_select(0, out_idx).index_select(1, in_idx);
  return {at::addmm(b.index_select(0, out_idx), xs, ws.t()),
          at::zeros({x.size(0), x.size(1)}, x.options()).index_copy_(1, in_idx, grad_y.mm(ws)),
          grad_y.t().mm(xs), grad_y.sum(0)};
}

// round(n * f) (at least one) distinct indices of [0, n), sorted, with `options`' device.
inline at::Tensor kept_indices(int64_t n, double f, const at::TensorOptions& options = at::kLong) {
  const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(n * f + 0.5));
  return std::get<0>(at::randperm(n, at::kLong).narrow(0, 0, k).sort()).to(options);
}

}  // namespace bench

// Masked linear, device-independent part: validation, shapes, GEMMs.
//
// Notation: the full layer has weight W [O, I]; R = out_idx (kept outputs), S = in_idx
// (kept inputs). A weight is stored full [O, I] or compact [|R|, |S|]; an absent index
// means "all". x is [*, I_x] with I_x = I (full weight) or any width that S indexes into.
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "index_checks.h"
#include "ops.h"

namespace subnet_ext {
namespace {

// [*, width] viewed as [N, width], N the product of the leading sizes: reshape({-1, width})
// cannot infer N when width is 0 (no kept outputs, or an empty input).
at::Tensor as_rows(const at::Tensor& t, int64_t width) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return t.reshape({rows, width});
}

struct Shapes {
  int64_t kept_out;  // |R|
  int64_t kept_in;   // |S|
  int64_t x_width;   // I_x
};

at::Tensor defined_or_empty(const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); }

// Every device's kernels read an index densely through its data pointer: the one place
// that makes it so is here, at the top of each op body (a no-op for a dense index).
OptTensor dense_index(const OptTensor& idx) { return idx.has_value() ? OptTensor(idx->contiguous()) : idx; }

// Checks the operands shared by forward and backward and returns the block sizes.
Shapes check_operands(const char* op, const at::Tensor& x, const at::Tensor& weight, const OptTensor& out_idx,
                      const OptTensor& in_idx, bool compact_weight, int64_t out_bound, bool check_values) {
  TORCH_CHECK_VALUE(weight.dim() == 2, op, ": weight must be 2-D [out, in], got shape ", weight.sizes());
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x must have at least one dimension, got a scalar");
  TORCH_CHECK_VALUE(x.scalar_type() == weight.scalar_type(), op, ": x is ", x.scalar_type(), " but weight is ",
                    weight.scalar_type());
  TORCH_CHECK_VALUE(x.device() == weight.device(), op, ": x is on ", x.device(), " but weight is on ",
                    weight.device());
  TORCH_CHECK_VALUE(at::isFloatingType(weight.scalar_type()), op, ": weight must be floating point, got ",
                    weight.scalar_type());
  const int64_t x_width = x.size(-1);
  Shapes s{weight.size(0), weight.size(1), x_width};
  if (in_idx.has_value()) {
    check_index(op, "in_idx", *in_idx, x_width, weight.device(), check_values);
    if (compact_weight) {
      TORCH_CHECK_VALUE(in_idx->numel() == weight.size(1), op, ": compact weight has ", weight.size(1),
                        " input columns but in_idx has ", in_idx->numel(), " entries");
    } else {
      TORCH_CHECK_VALUE(x_width == weight.size(1), op, ": x has width ", x_width, " but the full weight has ",
                        weight.size(1), " input columns");
    }
    s.kept_in = in_idx->numel();
  } else {
    TORCH_CHECK_VALUE(x_width == weight.size(1), op, ": x has width ", x_width, " but weight has ",
                      weight.size(1), " input columns (pass in_idx to select inputs)");
  }
  if (out_idx.has_value()) {
    // Full weights: rows of W; and when the output is scattered, columns of the output too.
    const int64_t bound = compact_weight ? out_bound : std::min(weight.size(0), out_bound);
    check_index(op, "out_idx", *out_idx, bound, weight.device(), check_values);
    if (compact_weight) {
      TORCH_CHECK_VALUE(out_idx->numel() == weight.size(0), op, ": compact weight has ", weight.size(0),
                        " output rows but out_idx has ", out_idx->numel(), " entries");
    }
    s.kept_out = out_idx->numel();
  }
  return s;
}

// W[R][:, S] as a contiguous [|R|, |S|] tensor (the weight itself when nothing is selected).
at::Tensor gather_weight_block(const at::Tensor& weight, const OptTensor& out_idx, const OptTensor& in_idx,
                               bool compact_weight, const Shapes& s, const IndexKernels& k) {
  if (compact_weight || (!out_idx.has_value() && !in_idx.has_value())) return weight;
  const at::Tensor src = weight.contiguous();
  at::Tensor dst = at::empty({s.kept_out, s.kept_in}, weight.options());
  k.gather(src, defined_or_empty(out_idx), defined_or_empty(in_idx), dst);
  return dst;
}

// Columns `cols` of a 2-D tensor, contiguous (the tensor itself when cols is absent).
at::Tensor gather_columns(const at::Tensor& t2d, const OptTensor& cols, const IndexKernels& k) {
  if (!cols.has_value()) return t2d;
  const at::Tensor src = t2d.contiguous();
  at::Tensor dst = at::empty({src.size(0), cols->numel()}, src.options());
  k.gather(src, at::Tensor(), *cols, dst);
  return dst;
}

// [B, n] placed at columns `cols` of a zero [B, width] tensor. dst starts uninitialised:
// each device's scatter_columns writes every element once, zeros included (CPU: row by row
// while the row is in cache; CUDA: one pass through a per-column inverse map), so there
// is no separate zero-fill pass on either device.
at::Tensor scatter_columns(const at::Tensor& t2d, const OptTensor& cols, int64_t width, const IndexKernels& k) {
  if (!cols.has_value()) return t2d;
  at::Tensor dst = at::empty({t2d.size(0), width}, t2d.options());
  k.scatter_columns(t2d.contiguous(), *cols, dst);
  return dst;
}

// A saved operand of the forward, checked against the shape the backward expects; an
// absent or 1-D empty tensor means "not saved: gather it here".
bool use_saved(const char* op, const char* name, const OptTensor& saved, int64_t rows, int64_t cols,
               const at::Tensor& like) {
  if (!saved.has_value() || (saved->dim() == 1 && saved->numel() == 0)) return false;
  TORCH_CHECK_VALUE(saved->dim() == 2 && saved->size(0) == rows && saved->size(1) == cols, op, ": ", name,
                    " must have shape [", rows, ", ", cols, "] (as masked_linear_forward returns it), got ",
                    saved->sizes());
  TORCH_CHECK_VALUE(saved->scalar_type() == like.scalar_type() && saved->device() == like.device(), op, ": ",
                    name, " is ", saved->scalar_type(), " on ", saved->device(), " but x is ", like.scalar_type(),
                    " on ", like.device());
  return true;
}

std::vector<int64_t> with_last(c10::IntArrayRef sizes, int64_t last) {
  std::vector<int64_t> out(sizes.begin(), sizes.end());
  out.back() = last;
  return out;
}

}  // namespace

at::Tensor masked_linear_impl(const char* op, const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                              const OptTensor& out_idx_arg, const OptTensor& in_idx_arg, bool compact_weight,
                              int64_t scatter_width, bool check_indices, const IndexKernels& k,
                              GatheredOperands* gathered) {
  const OptTensor out_idx = dense_index(out_idx_arg), in_idx = dense_index(in_idx_arg);
  TORCH_CHECK_VALUE(scatter_width >= -1, op, ": scatter_width must be -1 (compact output) or a width, got ",
                    scatter_width);
  const int64_t out_bound = scatter_width >= 0 ? scatter_width : kNoBound;
  const Shapes s = check_operands(op, x, weight, out_idx, in_idx, compact_weight, out_bound, check_indices);
  if (scatter_width >= 0 && !out_idx.has_value()) {
    TORCH_CHECK_VALUE(scatter_width == s.kept_out, op, ": scatter_width ", scatter_width,
                      " without out_idx must equal the number of outputs ", s.kept_out);
  }
  at::Tensor bias_block;
  if (bias.has_value()) {
    const int64_t expected = weight.size(0);  // [O] for a full weight, [|R|] for a compact one
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == expected, op, ": bias must have shape [", expected,
                      "], got ", bias->sizes());
    TORCH_CHECK_VALUE(bias->scalar_type() == weight.scalar_type() && bias->device() == weight.device(), op,
                      ": bias is ", bias->scalar_type(), " on ", bias->device(), " but weight is ",
                      weight.scalar_type(), " on ", weight.device());
    bias_block = (!compact_weight && out_idx.has_value()) ? at::index_select(*bias, 0, *out_idx) : *bias;
  }
  const at::Tensor x2 = as_rows(x, s.x_width);
  const at::Tensor xs = gather_columns(x2, in_idx, k);
  const at::Tensor w = gather_weight_block(weight, out_idx, in_idx, compact_weight, s, k);
  const at::Tensor y = bias_block.defined() ? at::addmm(bias_block, xs, w.t()) : at::mm(xs, w.t());
  if (gathered != nullptr) {
    if (in_idx.has_value()) gathered->x_kept = xs;
    if (!w.is_same(weight)) gathered->weight_block = w;
  }
  if (scatter_width < 0) return y.view(with_last(x.sizes(), s.kept_out));
  return scatter_columns(y, out_idx, scatter_width, k).view(with_last(x.sizes(), scatter_width));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_linear_forward_impl(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, const OptTensor& out_idx,
    const OptTensor& in_idx, bool compact_weight, int64_t scatter_width, bool check_indices,
    const IndexKernels& k) {
  GatheredOperands gathered;
  at::Tensor y = masked_linear_impl("subnet_ext.masked_linear_forward", x, weight, bias, out_idx, in_idx,
                                    compact_weight, scatter_width, check_indices, k, &gathered);
  const auto or_empty = [&](const at::Tensor& t) { return t.defined() ? t : at::empty({0}, x.options()); };
  return {y, or_empty(gathered.x_kept), or_empty(gathered.weight_block)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_linear_backward_impl(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, const OptTensor& out_idx_arg,
    const OptTensor& in_idx_arg, bool compact_weight, bool grad_out_full, bool dense_grad_input,
    std::array<bool, 3> mask, const OptTensor& x_kept, const OptTensor& weight_block, bool check_indices,
    const IndexKernels& k) {
  const char* op = "subnet_ext.masked_linear_backward";
  const OptTensor out_idx = dense_index(out_idx_arg), in_idx = dense_index(in_idx_arg);
  const int64_t g_width = grad_out.dim() >= 1 ? grad_out.size(-1) : 0;
  const Shapes s = check_operands(op, x, weight, out_idx, in_idx, compact_weight,
                                  grad_out_full ? g_width : kNoBound, check_indices);
  TORCH_CHECK_VALUE(grad_out.scalar_type() == x.scalar_type() && grad_out.device() == x.device(), op,
                    ": grad_out is ", grad_out.scalar_type(), " on ", grad_out.device(), " but x is ",
                    x.scalar_type(), " on ", x.device());
  const int64_t expected_width = grad_out_full && out_idx.has_value() ? g_width : s.kept_out;
  TORCH_CHECK_VALUE(grad_out.dim() == x.dim() && grad_out.sizes().slice(0, x.dim() - 1) == x.sizes().slice(0, x.dim() - 1) &&
                        g_width == expected_width,
                    op, ": grad_out has shape ", grad_out.sizes(), " but x has shape ", x.sizes(), " and ",
                    expected_width, " output columns are expected");
  if (dense_grad_input && mask[0]) {
    TORCH_CHECK_VALUE(!compact_weight, op, ": dense_grad_input needs the full weight, got a compact one");
    TORCH_CHECK_VALUE(grad_out_full || !out_idx.has_value(), op,
                      ": dense_grad_input needs the full grad_out (grad_out_full=True)");
  }
  const at::Tensor g2 = as_rows(grad_out, g_width);
  const at::Tensor x2 = as_rows(x, s.x_width);
  const at::Tensor g_kept = grad_out_full ? gather_columns(g2, out_idx, k) : g2;
  const bool saved_x = use_saved(op, "x_kept", x_kept, x2.size(0), s.kept_in, x);
  const bool saved_w = use_saved(op, "weight_block", weight_block, s.kept_out, s.kept_in, x);

  at::Tensor grad_x, grad_w, grad_b;
  if (mask[0]) {
    if (dense_grad_input) {
      grad_x = at::mm(g2, weight).view(x.sizes());
    } else {
      const at::Tensor w =
          saved_w ? *weight_block : gather_weight_block(weight, out_idx, in_idx, compact_weight, s, k);
      grad_x = scatter_columns(at::mm(g_kept, w), in_idx, s.x_width, k).view(x.sizes());
    }
  }
  if (mask[1]) grad_w = at::mm(g_kept.t(), saved_x ? *x_kept : gather_columns(x2, in_idx, k));
  if (mask[2]) grad_b = at::sum(g_kept, {0});
  // Outputs not asked for are empty tensors (not undefined), as the fake kernel says.
  const auto empty = [&](at::Tensor& t) { if (!t.defined()) t = at::empty({0}, x.options()); };
  empty(grad_x), empty(grad_w), empty(grad_b);
  return {grad_x, grad_w, grad_b};
}

void masked_linear_grad_weight_impl(const at::Tensor& out, const at::Tensor& grad_out, const at::Tensor& x,
                                    const OptTensor& out_idx_arg, const OptTensor& in_idx_arg, bool grad_out_full,
                                    bool accumulate, bool check_indices, const IndexKernels& k) {
  const char* op = "subnet_ext.masked_linear_grad_weight_";
  const OptTensor out_idx = dense_index(out_idx_arg), in_idx = dense_index(in_idx_arg);
  TORCH_CHECK_VALUE(x.dim() >= 1 && grad_out.dim() == x.dim(), op, ": grad_out has shape ", grad_out.sizes(),
                    " but x has shape ", x.sizes());
  const bool half = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
  const bool mixed = half && out.scalar_type() == at::kFloat;  // half operands, fp32 gradient
  TORCH_CHECK_VALUE(grad_out.scalar_type() == x.scalar_type() && (out.scalar_type() == x.scalar_type() || mixed),
                    op, ": dtypes differ: out ", out.scalar_type(), ", grad_out ", grad_out.scalar_type(), ", x ",
                    x.scalar_type(), " (grad_out and x must share a dtype; out must have it too, or be float32 "
                    "when they are float16/bfloat16)");
  TORCH_CHECK_VALUE(grad_out.device() == x.device() && out.device() == x.device(), op, ": devices differ: out ",
                    out.device(), ", grad_out ", grad_out.device(), ", x ", x.device());
  const int64_t g_width = grad_out.size(-1);
  const int64_t x_width = x.size(-1);
  if (out_idx.has_value()) {
    check_index(op, "out_idx", *out_idx, grad_out_full ? g_width : kNoBound, x.device(), check_indices);
  }
  if (in_idx.has_value()) check_index(op, "in_idx", *in_idx, x_width, x.device(), check_indices);
  const int64_t kept_out = out_idx.has_value() ? out_idx->numel() : g_width;
  const int64_t kept_in = in_idx.has_value() ? in_idx->numel() : x_width;
  if (!grad_out_full && out_idx.has_value()) {
    TORCH_CHECK_VALUE(g_width == kept_out, op, ": compact grad_out has ", g_width, " columns but out_idx has ",
                      kept_out, " entries");
  }
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == kept_out && out.size(1) == kept_in, op,
                    ": out must have shape [", kept_out, ", ", kept_in, "], got ", out.sizes());
  const at::Tensor g2 = as_rows(grad_out, g_width);
  const at::Tensor x2 = as_rows(x, x_width);
  TORCH_CHECK_VALUE(g2.size(0) == x2.size(0), op, ": grad_out has ", g2.size(0), " rows but x has ", x2.size(0));
  const at::Tensor g_kept = grad_out_full ? gather_columns(g2, out_idx, k) : g2;
  const at::Tensor xs = gather_columns(x2, in_idx, k);
  if (mixed) {
    k.gemm_float_out(out, g_kept.t(), xs, accumulate);
  } else if (accumulate) {
    out.addmm_(g_kept.t(), xs);
  } else {
    at::mm_out(const_cast<at::Tensor&>(out), g_kept.t(), xs);
  }
}

namespace {

// [(start, length)] of a flat [start0, length0, ...] list over a dimension of `width`
// (empty: the whole dimension). Runs must be non-empty, in range and disjoint.
std::vector<std::pair<int64_t, int64_t>> checked_runs(const char* op, const char* name, c10::IntArrayRef flat,
                                                      int64_t width) {
  if (flat.empty()) return {{0, width}};
  TORCH_CHECK_VALUE(flat.size() % 2 == 0, op, ": ", name, " must list [start, length] pairs, got ", flat.size(),
                    " values");
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (size_t i = 0; i < flat.size(); i += 2) {
    const int64_t start = flat[i], length = flat[i + 1];
    TORCH_CHECK_VALUE(length >= 1 && start >= 0 && start <= width - length, op, ": ", name, " run ", i / 2,
                      " = [", start, ", ", start + length, ") must be non-empty and lie in [0, ", width, ")");
    runs.emplace_back(start, length);
  }
  std::vector<std::pair<int64_t, int64_t>> sorted = runs;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 1; i < sorted.size(); ++i) {
    TORCH_CHECK_VALUE(sorted[i - 1].first + sorted[i - 1].second <= sorted[i].first, op, ": ", name, " runs [",
                      sorted[i - 1].first, ", ", sorted[i - 1].first + sorted[i - 1].second, ") and [",
                      sorted[i].first, ", ", sorted[i].first + sorted[i].second, ") overlap");
  }
  return runs;
}

// One GEMM operand: `view` [N, length] holds the columns that go to [offset, offset + length)
// of the gradient block's rows (grad_out's runs) or columns (x's runs).
struct RunOperand {
  at::Tensor view;
  int64_t offset;
  int64_t length;
};

// The runs of t2 [N, width] as GEMM operands. When every run is a view cuBLAS reads at full
// speed (16-byte aligned data, row stride and width), one strided view per run: no copy.
// Otherwise the runs are copied side by side into one buffer with 16-byte padded rows, read
// by a single GEMM: a run starting or ending at an odd column misaligns its view, and the
// GEMMs on such views ran at 69% of the contiguous ideal on an H200, and still at 84% with
// each run copied alone (two smaller odd-shaped GEMMs; bench/results/h200/), where one
// memory pass over the kept columns costs about 1% of the GEMM.
std::vector<RunOperand> run_operands(const at::Tensor& t2, const std::vector<std::pair<int64_t, int64_t>>& runs) {
  const int64_t elem = t2.element_size(), lanes = std::max<int64_t>(1, 16 / elem);
  std::vector<RunOperand> views;
  int64_t offset = 0;
  bool aligned = true;
  for (const auto& [start, length] : runs) {
    at::Tensor view = t2.narrow(1, start, length);
    aligned = aligned && reinterpret_cast<uintptr_t>(view.const_data_ptr()) % 16 == 0 && view.stride(1) == 1 &&
              (view.stride(0) * elem) % 16 == 0 && length % lanes == 0;
    views.push_back({view, offset, length});
    offset += length;
  }
  if (aligned) return views;
  const int64_t padded = (offset + lanes - 1) / lanes * lanes;
  at::Tensor packed = at::empty({t2.size(0), padded}, t2.options()).narrow(1, 0, offset);
  for (const RunOperand& run : views) packed.narrow(1, run.offset, run.length).copy_(run.view);
  return {{packed, 0, offset}};
}

int64_t total_length(const std::vector<std::pair<int64_t, int64_t>>& runs) {
  int64_t n = 0;
  for (const auto& r : runs) n += r.second;
  return n;
}

}  // namespace

void masked_linear_grad_runs_impl(const OptTensor& weight_out, const OptTensor& bias_out, const at::Tensor& grad_out,
                                  const at::Tensor& x, c10::IntArrayRef out_runs, c10::IntArrayRef in_runs,
                                  bool accumulate, const IndexKernels& k) {
  const char* op = "subnet_ext.masked_linear_grad_runs_";
  TORCH_CHECK_VALUE(x.dim() >= 1 && grad_out.dim() == x.dim(), op, ": grad_out has shape ", grad_out.sizes(),
                    " but x has shape ", x.sizes());
  TORCH_CHECK_VALUE(grad_out.scalar_type() == x.scalar_type() && grad_out.device() == x.device(), op,
                    ": grad_out is ", grad_out.scalar_type(), " on ", grad_out.device(), " but x is ",
                    x.scalar_type(), " on ", x.device());
  const bool half = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
  for (const OptTensor* t : {&weight_out, &bias_out}) {
    if (!t->has_value()) continue;
    const at::ScalarType dtype = (*t)->scalar_type();
    TORCH_CHECK_VALUE(dtype == x.scalar_type() || (half && dtype == at::kFloat), op, ": ",
                      t == &weight_out ? "weight_out" : "bias_out", " is ", dtype, " but the operands are ",
                      x.scalar_type(), " (it must be their dtype, or float32 when they are float16/bfloat16)");
    TORCH_CHECK_VALUE((*t)->device() == x.device(), op, ": ", t == &weight_out ? "weight_out" : "bias_out",
                      " is on ", (*t)->device(), " but x is on ", x.device());
  }
  const int64_t g_width = grad_out.size(-1), x_width = x.size(-1);
  const auto rows = checked_runs(op, "out_runs", out_runs, g_width);
  const auto cols = checked_runs(op, "in_runs", in_runs, x_width);
  const int64_t kept_out = total_length(rows), kept_in = total_length(cols);
  if (weight_out.has_value()) {
    TORCH_CHECK_VALUE(weight_out->dim() == 2 && weight_out->size(0) == kept_out && weight_out->size(1) == kept_in,
                      op, ": weight_out must have shape [", kept_out, ", ", kept_in, "], got ", weight_out->sizes());
  }
  if (bias_out.has_value()) {
    TORCH_CHECK_VALUE(bias_out->dim() == 1 && bias_out->size(0) == kept_out, op, ": bias_out must have shape [",
                      kept_out, "], got ", bias_out->sizes());
  }
  const at::Tensor g2 = as_rows(grad_out, g_width);
  const at::Tensor x2 = as_rows(x, x_width);
  TORCH_CHECK_VALUE(g2.size(0) == x2.size(0), op, ": grad_out has ", g2.size(0), " rows but x has ", x2.size(0));
  if (weight_out.has_value()) {
    const std::vector<RunOperand> x_runs = run_operands(x2, cols);
    for (const RunOperand& g_run : run_operands(g2, rows)) {
      const at::Tensor g_operand = g_run.view.t();  // [rows, N], column-major for the GEMM
      for (const RunOperand& x_run : x_runs) {
        at::Tensor block = weight_out->narrow(0, g_run.offset, g_run.length).narrow(1, x_run.offset, x_run.length);
        if (weight_out->scalar_type() != x.scalar_type()) {
          k.gemm_float_out(block, g_operand, x_run.view, accumulate);
        } else if (accumulate) {
          block.addmm_(g_operand, x_run.view);
        } else {
          at::mm_out(block, g_operand, x_run.view);
        }
      }
    }
  }
  if (bias_out.has_value()) {
    int64_t row = 0;
    for (const auto& [r_start, r_len] : rows) {
      at::Tensor bias = bias_out->narrow(0, row, r_len);
      const at::Tensor sums = at::sum(g2.narrow(1, r_start, r_len), {0}, false, bias.scalar_type());
      accumulate ? bias.add_(sums) : bias.copy_(sums);
      row += r_len;
    }
  }
}

}  // namespace subnet_ext

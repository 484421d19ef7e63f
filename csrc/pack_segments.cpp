// Segment table validation for pack_segments / unpack_average_ (host side, every device).
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>

#include "ops.h"

namespace subnet_ext {
namespace {

int64_t rows_of(const at::Tensor& t) { return t.dim() == 0 ? 1 : t.size(0); }

int64_t cols_of(const at::Tensor& t) {
  int64_t cols = 1;
  for (int64_t d = 1; d < t.dim(); ++d) cols *= t.size(d);
  return cols;
}

bool rectangles_meet(const SegmentDesc& a, const SegmentDesc& b) {
  return a.row_begin < b.row_end && b.row_begin < a.row_end && a.col_begin < b.col_end && b.col_begin < a.col_end;
}

// unpack_average_ writes each rectangle: two rectangles of one tensor must not share an
// element, or the result would depend on the order of the writes.
void check_disjoint_in_tensors(const char* op, const std::vector<SegmentDesc>& segs) {
  std::vector<size_t> order(segs.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::tie(segs[a].tensor, segs[a].row_begin) < std::tie(segs[b].tensor, segs[b].row_begin);
  });
  for (size_t i = 0; i < order.size(); ++i) {
    const SegmentDesc& a = segs[order[i]];
    if (segment_numel(a) == 0) continue;
    // Sorted by row_begin: only rectangles starting before a ends can meet it.
    for (size_t j = i + 1; j < order.size(); ++j) {
      const SegmentDesc& b = segs[order[j]];
      if (b.tensor != a.tensor || b.row_begin >= a.row_end) break;
      TORCH_CHECK_VALUE(segment_numel(b) == 0 || !rectangles_meet(a, b), op, ": segments ", order[i], " and ",
                        order[j], " overlap inside tensor ", a.tensor, " (rows [", a.row_begin, ", ", a.row_end,
                        ") x cols [", a.col_begin, ", ", a.col_end, ") and rows [", b.row_begin, ", ", b.row_end,
                        ") x cols [", b.col_begin, ", ", b.col_end, "))");
    }
  }
}

}  // namespace

std::vector<SegmentDesc> checked_segments(const char* op, at::TensorList tensors, const at::Tensor& segments,
                                          const at::Tensor& buffer, const at::Tensor* scales) {
  TORCH_CHECK_VALUE(segments.scalar_type() == c10::kLong && segments.is_cpu(), op,
                    ": segments must be an int64 CPU tensor, got ", segments.scalar_type(), " on ", segments.device());
  TORCH_CHECK_VALUE(segments.dim() == 2 && segments.size(1) == 6, op,
                    ": segments must have shape [S, 6] (tensor, row_begin, row_end, col_begin, col_end, offset), got ",
                    segments.sizes());
  TORCH_CHECK_VALUE(buffer.dim() == 1 && buffer.is_contiguous(), op,
                    ": buffer must be a contiguous 1-D tensor, got shape ", buffer.sizes());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.scalar_type() == buffer.scalar_type() && t.device() == buffer.device(), op, ": tensor ", i,
                      " is ", t.scalar_type(), " on ", t.device(), " but the buffer is ", buffer.scalar_type(), " on ",
                      buffer.device());
    TORCH_CHECK_VALUE(t.is_contiguous(), op, ": tensor ", i, " (shape ", t.sizes(), ") must be contiguous");
  }
  const int64_t count = segments.size(0);
  if (scales != nullptr) {
    TORCH_CHECK_VALUE(scales->is_cpu() && at::isFloatingType(scales->scalar_type()) && scales->dim() == 1 &&
                          scales->size(0) == count,
                      op, ": scales must be a floating CPU tensor of shape [", count, "], got ", scales->scalar_type(),
                      " on ", scales->device(), " with shape ", scales->sizes());
  }
  const at::Tensor seg = segments.contiguous();
  const int64_t* v = seg.data_ptr<int64_t>();
  const at::Tensor scale_values = scales != nullptr ? scales->to(c10::kDouble).contiguous() : at::Tensor();
  std::vector<SegmentDesc> out(count);
  for (int64_t s = 0; s < count; ++s) {
    const int64_t* r = v + 6 * s;
    TORCH_CHECK_VALUE(r[0] >= 0 && r[0] < static_cast<int64_t>(tensors.size()), op, ": segment ", s,
                      " names tensor ", r[0], " but only ", tensors.size(), " tensors were given");
    const at::Tensor& t = tensors[r[0]];
    const int64_t rows = rows_of(t), cols = cols_of(t);
    TORCH_CHECK_VALUE(0 <= r[1] && r[1] <= r[2] && r[2] <= rows && 0 <= r[3] && r[3] <= r[4] && r[4] <= cols, op,
                      ": segment ", s, " rows [", r[1], ", ", r[2], ") x cols [", r[3], ", ", r[4],
                      ") lies outside tensor ", r[0], " viewed as [", rows, ", ", cols, "]");
    double scale = 1.0;
    if (scales != nullptr) {
      scale = scale_values.data_ptr<double>()[s];
      TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scales[", s, "] = ", scale, " is not finite");
    }
    out[s] = SegmentDesc{r[0], r[1], r[2], r[3], r[4], r[5], cols, scale};
    // Compared as offset <= numel - size: offset + size could overflow int64 for a hostile offset.
    TORCH_CHECK_VALUE(r[5] >= 0 && r[5] <= buffer.numel() - segment_numel(out[s]), op, ": segment ", s,
                      " occupies buffer elements from offset ", r[5], " (", segment_numel(out[s]),
                      " of them) but the buffer has ", buffer.numel(), " elements");
  }
  std::vector<size_t> by_offset(count);
  std::iota(by_offset.begin(), by_offset.end(), 0);
  std::sort(by_offset.begin(), by_offset.end(), [&](size_t a, size_t b) { return out[a].offset < out[b].offset; });
  int64_t end = 0;
  size_t last = 0;
  for (size_t i : by_offset) {
    if (segment_numel(out[i]) == 0) continue;
    TORCH_CHECK_VALUE(out[i].offset >= end, op, ": segments ", last, " and ", i, " overlap in the buffer (segment ",
                      i, " starts at ", out[i].offset, ", before segment ", last, " ends at ", end, ")");
    end = out[i].offset + segment_numel(out[i]);
    last = i;
  }
  if (scales != nullptr) check_disjoint_in_tensors(op, out);
  return out;
}

}  // namespace subnet_ext

// Segment table validation for pack_segments / unpack_average_ (host side, every device).
#include <c10/util/Exception.h>

#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
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

// Byte range [begin, end) of device memory.
struct ByteRange {
  uintptr_t begin = 0, end = 0;
  bool meets(const ByteRange& o) const { return begin < o.end && o.begin < end; }
};

ByteRange tensor_bytes(const at::Tensor& t) {  // t is contiguous
  const auto p = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  return {p, p + static_cast<uintptr_t>(t.numel() * t.element_size())};
}

// Bytes a rectangle touches: rows [row_begin, row_end) of its columns; one range per row,
// or one for the whole rectangle when it spans whole rows.
template <typename Fn>
void for_each_row_bytes(const SegmentDesc& s, uintptr_t base, int64_t elem, const Fn& fn) {
  const auto address = [&](int64_t row, int64_t col) {
    return base + static_cast<uintptr_t>((row * s.tensor_cols + col) * elem);
  };
  if (segment_width(s) == s.tensor_cols) {
    fn(ByteRange{address(s.row_begin, 0), address(s.row_end, 0)});
    return;
  }
  for (int64_t r = s.row_begin; r < s.row_end; ++r) fn(ByteRange{address(r, s.col_begin), address(r, s.col_end)});
}

std::string describe(const SegmentDesc& s) {
  return c10::str("tensor ", s.tensor, " rows [", s.row_begin, ", ", s.row_end, ") x cols [", s.col_begin, ", ",
                  s.col_end, ")");
}

// unpack_average_ writes every rectangle in one launch: rectangles must not share memory,
// whichever tensor-list entries they belong to (the same tensor listed twice, or views of
// one storage), and none may share memory with the buffer it reads. Entries whose memory
// ranges are apart are dismissed by their ranges; only entries whose ranges meet are
// compared rectangle by rectangle, by address.
void check_disjoint_in_memory(const char* op, at::TensorList tensors, const std::vector<SegmentDesc>& segs,
                              const at::Tensor& buffer) {
  const int64_t elem = buffer.element_size();
  const ByteRange buffer_bytes = tensor_bytes(buffer);
  std::vector<ByteRange> ranges(tensors.size());
  std::vector<char> written(tensors.size(), 0);
  for (size_t i = 0; i < segs.size(); ++i) {
    const SegmentDesc& s = segs[i];
    if (segment_numel(s) == 0) continue;
    const at::Tensor& t = tensors[s.tensor];
    ranges[s.tensor] = tensor_bytes(t);
    written[s.tensor] = 1;
    const uintptr_t base = ranges[s.tensor].begin;
    const ByteRange span{base + static_cast<uintptr_t>((s.row_begin * s.tensor_cols + s.col_begin) * elem),
                         base + static_cast<uintptr_t>(((s.row_end - 1) * s.tensor_cols + s.col_end) * elem)};
    TORCH_CHECK_VALUE(!span.meets(buffer_bytes), op, ": segment ", i, " (", describe(s),
                      ") writes memory of the buffer it reads (the tensor aliases the buffer); unpack into "
                      "tensors that do not share memory with the buffer");
  }
  // Tensor entries sorted by address; a run of entries whose ranges meet is one group.
  std::vector<int64_t> order;
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (written[t]) order.push_back(static_cast<int64_t>(t));
  }
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ranges[a].begin < ranges[b].begin; });
  std::vector<int64_t> group_of(tensors.size(), -1);
  std::vector<int64_t> group_size;
  uintptr_t group_end = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const ByteRange& r = ranges[order[k]];
    if (k == 0 || r.begin >= group_end) {
      group_size.push_back(0);
      group_end = r.end;
    }
    group_end = std::max(group_end, r.end);
    group_of[order[k]] = static_cast<int64_t>(group_size.size()) - 1;
    ++group_size.back();
  }
  struct Piece {
    ByteRange bytes;
    size_t segment;
  };
  std::vector<Piece> pieces;
  for (size_t i = 0; i < segs.size(); ++i) {
    const SegmentDesc& s = segs[i];
    if (segment_numel(s) == 0 || group_size[group_of[s.tensor]] < 2) continue;
    for_each_row_bytes(s, ranges[s.tensor].begin, elem, [&](const ByteRange& b) { pieces.push_back({b, i}); });
  }
  if (pieces.empty()) return;
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.bytes.begin < b.bytes.begin; });
  // Sorted by start: a piece meets an earlier one iff it starts before the furthest end so
  // far (that piece is then another segment's: one segment's rows never share bytes).
  size_t furthest = 0;
  for (size_t k = 1; k < pieces.size(); ++k) {
    const Piece& a = pieces[furthest];
    const Piece& b = pieces[k];
    TORCH_CHECK_VALUE(b.bytes.begin >= a.bytes.end, op, ": segments ", a.segment, " and ", b.segment,
                      " write the same memory: segment ", a.segment, " (", describe(segs[a.segment]), ") and segment ",
                      b.segment, " (", describe(segs[b.segment]), ") overlap in memory (tensors ",
                      segs[a.segment].tensor, " and ", segs[b.segment].tensor,
                      " share storage); each element may be written by one segment only");
    if (b.bytes.end > a.bytes.end) furthest = k;
  }
}

std::atomic<int64_t> table_builds{0};

}  // namespace

int64_t segment_table_builds() { return table_builds.load(); }

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
  if (scales != nullptr) {
    check_disjoint_in_tensors(op, out);
    check_disjoint_in_memory(op, tensors, out, buffer);
  }
  table_builds.fetch_add(1);
  return out;
}

}  // namespace subnet_ext

namespace subnet_ext {
namespace {

constexpr int64_t kPreparedMagic = 0x5355424e45545347;  // "SUBNETSG"

int64_t prepared_bytes(int64_t segments, int64_t tensors) {
  return static_cast<int64_t>(sizeof(PreparedHeader) + segments * sizeof(SegmentDesc) +
                              tensors * sizeof(PreparedTensor));
}

}  // namespace

at::Tensor prepared_host_table(at::TensorList tensors, const at::Tensor& buffer, const std::vector<SegmentDesc>& segs,
                               bool with_scales, const DeviceWork& work) {
  const auto n_segs = static_cast<int64_t>(segs.size());
  const auto n_tensors = static_cast<int64_t>(tensors.size());
  at::Tensor table = at::empty({prepared_bytes(n_segs, n_tensors)}, at::TensorOptions().dtype(at::kByte));
  uint8_t* p = table.mutable_data_ptr<uint8_t>();
  const PreparedHeader header{kPreparedMagic,
                              n_segs,
                              n_tensors,
                              with_scales ? 1 : 0,
                              static_cast<int64_t>(buffer.scalar_type()),
                              buffer.numel(),
                              reinterpret_cast<uint64_t>(buffer.const_data_ptr()),
                              work.device_bytes,
                              work.chunk_offset,
                              work.chunk_count};
  std::memcpy(p, &header, sizeof header);
  p += sizeof header;
  if (n_segs > 0) std::memcpy(p, segs.data(), n_segs * sizeof(SegmentDesc));
  p += n_segs * sizeof(SegmentDesc);
  for (const at::Tensor& t : tensors) {
    const PreparedTensor entry{reinterpret_cast<uint64_t>(t.const_data_ptr()), rows_of(t), cols_of(t)};
    std::memcpy(p, &entry, sizeof entry);
    p += sizeof entry;
  }
  return table;
}

PreparedView checked_prepared_table(const char* op, at::TensorList tensors, const at::Tensor& host_table,
                                    const at::Tensor& device_table, const at::Tensor& buffer, bool for_unpack) {
  TORCH_CHECK_VALUE(host_table.is_cpu() && host_table.scalar_type() == at::kByte && host_table.dim() == 1 &&
                        host_table.is_contiguous() && host_table.numel() >= static_cast<int64_t>(sizeof(PreparedHeader)),
                    op, ": host_table must be the uint8 CPU table prepare_segments returns, got ",
                    host_table.scalar_type(), " on ", host_table.device(), " with shape ", host_table.sizes());
  const auto* header = reinterpret_cast<const PreparedHeader*>(host_table.const_data_ptr<uint8_t>());
  TORCH_CHECK_VALUE(header->magic == kPreparedMagic &&
                        host_table.numel() == prepared_bytes(header->segment_count, header->tensor_count),
                    op, ": host_table is not a table prepare_segments returned");
  TORCH_CHECK_VALUE(!for_unpack || header->with_scales, op,
                    ": the table was prepared without scales (for pack_segments only); prepare it with scales to "
                    "unpack");
  TORCH_CHECK_VALUE(device_table.scalar_type() == at::kByte && device_table.numel() == header->device_bytes &&
                        (header->device_bytes == 0 || device_table.device() == buffer.device()),
                    op, ": device_table (", device_table.numel(), " bytes on ", device_table.device(),
                    ") is not the one prepared with this host_table (", header->device_bytes, " bytes on ",
                    buffer.device(), ")");
  TORCH_CHECK_VALUE(reinterpret_cast<uint64_t>(buffer.const_data_ptr()) == header->buffer_data &&
                        buffer.numel() == header->buffer_numel &&
                        static_cast<int64_t>(buffer.scalar_type()) == header->dtype && buffer.dim() == 1 &&
                        buffer.is_contiguous(),
                    op, ": the buffer (", buffer.numel(), " elements of ", buffer.scalar_type(),
                    ") is not the buffer the table was prepared for (", header->buffer_numel, " elements of ",
                    static_cast<c10::ScalarType>(header->dtype),
                    ", same memory); prepare the table again for this buffer");
  TORCH_CHECK_VALUE(static_cast<int64_t>(tensors.size()) == header->tensor_count, op, ": ", tensors.size(),
                    " tensors given but the table was prepared for ", header->tensor_count);
  const auto* segs = reinterpret_cast<const SegmentDesc*>(header + 1);
  const auto* prepared = reinterpret_cast<const PreparedTensor*>(segs + header->segment_count);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const PreparedTensor& e = prepared[i];
    TORCH_CHECK_VALUE(t.scalar_type() == buffer.scalar_type() && t.device() == buffer.device() && t.is_contiguous() &&
                          reinterpret_cast<uint64_t>(t.const_data_ptr()) == e.data && rows_of(t) == e.rows &&
                          cols_of(t) == e.cols,
                      op, ": tensor ", i, " (shape ", t.sizes(), ", ", t.scalar_type(), " on ", t.device(),
                      ") is not the tensor the table was prepared for (a contiguous [", e.rows, ", ", e.cols,
                      "] ", buffer.scalar_type(), " at the same address); prepare the table again for these tensors");
  }
  return {header, c10::ArrayRef<SegmentDesc>(segs, static_cast<size_t>(header->segment_count))};
}

}  // namespace subnet_ext

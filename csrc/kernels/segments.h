// Index math of packed rectangles, shared by the CPU loops, the CUDA kernel and the
// standalone benchmarks. A tensor is viewed 2-D as [rows, cols] (rows = size(0), cols =
// numel / rows; a 1-D tensor is [n, 1]); a segment is the rectangle
// [row_begin, row_end) x [col_begin, col_end) of one tensor, stored row-major at
// buffer[offset, offset + numel).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/device_macros.h"

namespace subnet_ext {

struct SegmentDesc {
  int64_t tensor;      // index into the tensor list
  int64_t row_begin;
  int64_t row_end;
  int64_t col_begin;
  int64_t col_end;
  int64_t offset;      // first buffer element of the rectangle
  int64_t tensor_cols; // row stride of the tensor's 2-D view
  double scale;        // applied on unpack (1/owner-count), cast to the accumulation type
};

SUBNET_HD int64_t segment_width(const SegmentDesc& s) { return s.col_end - s.col_begin; }

SUBNET_HD int64_t segment_numel(const SegmentDesc& s) {
  return (s.row_end - s.row_begin) * (s.col_end - s.col_begin);
}

// Storage offset inside the tensor of the rectangle's e-th element (row-major order).
SUBNET_HD int64_t segment_tensor_offset(const SegmentDesc& s, int64_t e) {
  const int64_t w = segment_width(s);
  return (s.row_begin + e / w) * s.tensor_cols + s.col_begin + e % w;
}

// Elements [e, e + n) of a rectangle are contiguous in the tensor when they stay in one
// row, or when the rectangle spans whole rows (then the rectangle is one run).
SUBNET_HD int64_t segment_contiguous_run(const SegmentDesc& s, int64_t e, int64_t limit) {
  const int64_t w = segment_width(s);
  const int64_t run = (w == s.tensor_cols) ? limit - e : w - e % w;
  return run < limit - e ? run : limit - e;
}

// Host loop over elements [begin, end) of one segment, in contiguous runs.
// Pack: buffer[offset + e] = tensor[...]; unpack: tensor[...] = buffer[offset + e] * scale.
template <typename T>
void pack_segment_range(const SegmentDesc& s, const T* tensor, T* buffer, int64_t begin, int64_t end) {
  for (int64_t e = begin; e < end;) {
    const int64_t run = segment_contiguous_run(s, e, end);
    std::memcpy(buffer + s.offset + e, tensor + segment_tensor_offset(s, e), run * sizeof(T));
    e += run;
  }
}

// dst[i] = src[i] * scale for i < n, computed in Acc (one contiguous run of an unpack).
template <typename T, typename Acc>
struct ScaleRun {
  void operator()(const T* src, T* dst, int64_t n, Acc scale) const {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<Acc>(src[i]) * scale);
  }
};

// scale_run(src, dst, n, scale) does the arithmetic of each run: a device may pass a
// faster one (the CPU kernel passes loops compiled for several vector ISAs).
template <typename T, typename Acc, typename Run = ScaleRun<T, Acc>>
void unpack_segment_range(const SegmentDesc& s, T* tensor, const T* buffer, int64_t begin, int64_t end,
                          const Run& scale_run = Run{}) {
  const Acc scale = static_cast<Acc>(s.scale);
  for (int64_t e = begin; e < end;) {
    const int64_t run = segment_contiguous_run(s, e, end);
    scale_run(buffer + s.offset + e, tensor + segment_tensor_offset(s, e), run, scale);
    e += run;
  }
}

}  // namespace subnet_ext

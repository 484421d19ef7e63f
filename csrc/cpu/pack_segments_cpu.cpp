// CPU pack / unpack: the packed element space of all segments is cut into equal chunks
// spread over threads, so one huge tensor and many small ones parallelise alike.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "kernels/segments.h"
#include "ops.h"

namespace subnet_ext {
namespace {

constexpr int64_t kChunk = 1 << 16;  // elements per task: large runs keep memcpy at full speed

// The unpack's multiply for fp32/fp64 runs, compiled for AVX-512, AVX2 and the baseline
// ISA and picked at load time (GCC function multi-versioning): unpacking from cache is
// bound by the multiply's vector width, not by memory. Other types use the generic loop.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SUBNET_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SUBNET_VECTOR_CLONES
#endif

SUBNET_VECTOR_CLONES void scale_run_f32(const float* src, float* dst, int64_t n,
                                        float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * scale;
}

SUBNET_VECTOR_CLONES void scale_run_f64(const double* src, double* dst, int64_t n,
                                        double scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * scale;
}

template <typename T, typename Acc>
struct CpuScaleRun : ScaleRun<T, Acc> {};
template <>
struct CpuScaleRun<float, float> {
  void operator()(const float* src, float* dst, int64_t n, float scale) const { scale_run_f32(src, dst, n, scale); }
};
template <>
struct CpuScaleRun<double, double> {
  void operator()(const double* src, double* dst, int64_t n, double scale) const {
    scale_run_f64(src, dst, n, scale);
  }
};

// Calls fn(segment, begin, end) for the pieces of every segment inside packed range [lo, hi).
template <typename Fn>
void for_each_piece(c10::ArrayRef<SegmentDesc> segs, const std::vector<int64_t>& starts, int64_t lo, int64_t hi,
                    const Fn& fn) {
  size_t s = std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin() - 1;
  for (; s < segs.size() && starts[s] < hi; ++s) {
    const int64_t n = segment_numel(segs[s]);
    const int64_t begin = std::max<int64_t>(lo - starts[s], 0), end = std::min<int64_t>(hi - starts[s], n);
    if (begin < end) fn(s, begin, end);
  }
}

template <typename Fn>
void parallel_over_segments(c10::ArrayRef<SegmentDesc> segs, const Fn& fn) {
  std::vector<int64_t> starts(segs.size() + 1, 0);
  for (size_t s = 0; s < segs.size(); ++s) starts[s + 1] = starts[s] + segment_numel(segs[s]);
  at::parallel_for(0, starts.back(), kChunk,
                   [&](int64_t lo, int64_t hi) { for_each_piece(segs, starts, lo, hi, fn); });
}

// The loops of both entry points: segs validated against tensors and buffer.
void pack_cpu(at::TensorList tensors, c10::ArrayRef<SegmentDesc> segs, const at::Tensor& buffer) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, buffer.scalar_type(), "subnet_ext.pack_cpu", [&] {
    scalar_t* buf = buffer.mutable_data_ptr<scalar_t>();
    parallel_over_segments(segs, [&](size_t s, int64_t begin, int64_t end) {
      pack_segment_range<scalar_t>(segs[s], tensors[segs[s].tensor].const_data_ptr<scalar_t>(), buf, begin, end);
    });
  });
}

void unpack_cpu(at::TensorList tensors, c10::ArrayRef<SegmentDesc> segs, const at::Tensor& buffer) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, buffer.scalar_type(), "subnet_ext.unpack_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* buf = buffer.const_data_ptr<scalar_t>();
    parallel_over_segments(segs, [&](size_t s, int64_t begin, int64_t end) {
      scalar_t* dst = tensors[segs[s].tensor].mutable_data_ptr<scalar_t>();
      unpack_segment_range<scalar_t, acc_t>(segs[s], dst, buf, begin, end, CpuScaleRun<scalar_t, acc_t>{});
    });
  });
}

void pack_segments_cpu(at::TensorList tensors, const at::Tensor& segments, const at::Tensor& buffer) {
  pack_cpu(tensors, checked_segments("subnet_ext.pack_segments", tensors, segments, buffer, nullptr), buffer);
}

void unpack_average_cpu(at::TensorList tensors, const at::Tensor& segments, const at::Tensor& buffer,
                        const at::Tensor& scales) {
  unpack_cpu(tensors, checked_segments("subnet_ext.unpack_average_", tensors, segments, buffer, &scales), buffer);
}

// The CPU kernels read the host table itself: device_table is empty.
std::tuple<at::Tensor, at::Tensor> prepare_segments_cpu(at::TensorList tensors, const at::Tensor& segments,
                                                        const at::Tensor& buffer, const OptTensor& scales) {
  const auto segs = checked_segments("subnet_ext.prepare_segments", tensors, segments, buffer,
                                     scales.has_value() ? &*scales : nullptr);
  return {prepared_host_table(tensors, buffer, segs, scales.has_value(), DeviceWork{}),
          at::empty({0}, at::TensorOptions().dtype(at::kByte))};
}

void pack_segments_prepared_cpu(at::TensorList tensors, const at::Tensor& host_table, const at::Tensor& device_table,
                                const at::Tensor& buffer) {
  const PreparedView table = checked_prepared_table("subnet_ext.pack_segments_prepared", tensors, host_table,
                                                    device_table, buffer, /*for_unpack=*/false);
  pack_cpu(tensors, table.segments, buffer);
}

void unpack_average_prepared_cpu(at::TensorList tensors, const at::Tensor& host_table, const at::Tensor& device_table,
                                 const at::Tensor& buffer) {
  const PreparedView table = checked_prepared_table("subnet_ext.unpack_average_prepared_", tensors, host_table,
                                                    device_table, buffer, /*for_unpack=*/true);
  unpack_cpu(tensors, table.segments, buffer);
}

}  // namespace

TORCH_LIBRARY_IMPL(subnet_ext, CPU, m) {
  m.impl("pack_segments", &pack_segments_cpu);
  m.impl("unpack_average_", &unpack_average_cpu);
  m.impl("prepare_segments", &prepare_segments_cpu);
  m.impl("pack_segments_prepared", &pack_segments_prepared_cpu);
  m.impl("unpack_average_prepared_", &unpack_average_prepared_cpu);
}

}  // namespace subnet_ext

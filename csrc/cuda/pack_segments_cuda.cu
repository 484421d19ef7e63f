// CUDA pack / unpack: one launch for every tensor and segment, in the structure of
// NVIDIA apex's multi_tensor_apply. The host cuts each segment into chunks of at most
// kChunkBytes and writes one table (per-segment descriptors, then per-chunk work) into
// pinned memory; one async H2D copy on the current stream moves it to the device, and
// block b of the kernel handles chunk b. Chunks never cross segments.
//
// A segment is moved in 16-byte vectors when its tensor and the buffer are 16-byte
// aligned and its runs start and end on vector boundaries (checked on the host, once per
// segment); otherwise element by element. Pack only copies bits, so it is instantiated per
// element size; unpack scales in at::opmath_type (fp32 for halves, fp64 for double).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cuda/storage.cuh"
#include "kernels/segments.h"
#include "ops.h"

namespace subnet_ext {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunkBytes = 64 * 1024;  // per block: 4096 vectors, 16 per thread
constexpr int kUnroll = 8;                  // units each thread has in flight (a 64 KiB chunk: 2 passes of 16-byte vectors)

// 16 bytes of T, loaded and stored as one 128-bit access.
template <typename T>
struct alignas(16) Lanes16 {
  T lane[16 / sizeof(T)];
};

// One non-empty segment as the kernel sees it. `rect` is in units: elements, or 16-byte
// vectors when `vectorised` (columns, row stride and buffer offset divided by the lanes).
struct DeviceSegment {
  SegmentDesc rect;
  void* data;  // base of the tensor
  int64_t vectorised;
};

// Units [begin, end) of one segment's rectangle, in row-major order.
struct DeviceChunk {
  int64_t segment;  // index into the DeviceSegment table
  int64_t begin;
  int64_t end;
};

// Walks a rectangle `stride` units at a time and yields segment_tensor_offset(rect, e)
// without a 64-bit division per unit: one division when the walk starts.
struct RectCursor {
  int64_t row, col, width, row_step, col_step;

  __device__ RectCursor(const SegmentDesc& s, int64_t e, int64_t stride) : width(segment_width(s)) {
    row = e / width;
    col = e % width;
    row_step = stride / width;
    col_step = stride % width;
  }
  __device__ int64_t tensor_offset(const SegmentDesc& s) const {
    return (s.row_begin + row) * s.tensor_cols + s.col_begin + col;
  }
  __device__ void advance() {
    row += row_step;
    col += col_step;
    if (col >= width) {
      col -= width;
      ++row;
    }
  }
};

struct CopyOp {
  template <typename U>
  __device__ U operator()(const U& v) const { return v; }
};

// Works on the storage bits of T, so that every access is a plain integer load or store
// (c10::Half's assignment would otherwise turn the stores into generic-space ones).
template <typename T>
struct ScaleOp {
  using acc_t = at::opmath_type<T>;
  using bits_t = storage_t<T>;
  acc_t scale;

  __device__ bits_t operator()(const bits_t& v) const {
    T x;
    std::memcpy(&x, &v, sizeof(T));
    const T y = static_cast<T>(static_cast<acc_t>(x) * scale);
    bits_t out;
    std::memcpy(&out, &y, sizeof(T));
    return out;
  }
  __device__ Lanes16<bits_t> operator()(const Lanes16<bits_t>& v) const {
    Lanes16<bits_t> out;
#pragma unroll
    for (int i = 0; i < static_cast<int>(16 / sizeof(T)); ++i) out.lane[i] = (*this)(v.lane[i]);
    return out;
  }
};

// Pack: buffer[offset + e] = tensor[segment_tensor_offset(e)]; unpack: the reverse, through op.
// The block's threads stride units [begin, end); loads of kUnroll units precede their stores.
template <bool kUnpack, typename Unit, typename Op>
__device__ void move_range(const SegmentDesc& s, Unit* __restrict__ tensor, Unit* __restrict__ buffer,
                           int64_t begin, int64_t end, const Op& op) {
  // The tensor pointer comes from the table, not a kernel argument: say it is global so
  // that the compiler emits global (not generic) accesses for every dtype.
  __builtin_assume(__isGlobal(tensor));
  const int64_t stride = blockDim.x;
  int64_t e = begin + threadIdx.x;
  if (e >= end) return;
  RectCursor cursor(s, e, stride);
  Unit* packed = buffer + s.offset;
  for (; e < end; e += kUnroll * stride) {
    Unit values[kUnroll];
    int64_t at[kUnroll];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      at[i] = cursor.tensor_offset(s);
      cursor.advance();
      if (e + i * stride >= end) continue;
      if constexpr (kUnpack) {
        values[i] = packed[e + i * stride];
      } else {
        values[i] = tensor[at[i]];
      }
    }
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      if (e + i * stride >= end) continue;
      if constexpr (kUnpack) {
        tensor[at[i]] = op(values[i]);
      } else {
        packed[e + i * stride] = op(values[i]);
      }
    }
  }
}

// Block b moves chunk b. T is the element type for unpack, its storage type for pack;
// data moves as storage bits (or 16-byte vectors of them).
template <typename T, bool kUnpack>
__global__ void __launch_bounds__(kThreads)
    segments_kernel(const DeviceSegment* __restrict__ segments, const DeviceChunk* __restrict__ chunks,
                    storage_t<T>* __restrict__ buffer) {
  using bits_t = storage_t<T>;
  const DeviceChunk chunk = chunks[blockIdx.x];
  const DeviceSegment seg = segments[chunk.segment];
  std::conditional_t<kUnpack, ScaleOp<T>, CopyOp> op{};
  if constexpr (kUnpack) op.scale = static_cast<typename ScaleOp<T>::acc_t>(seg.rect.scale);
  if (seg.vectorised) {
    move_range<kUnpack>(seg.rect, static_cast<Lanes16<bits_t>*>(seg.data), reinterpret_cast<Lanes16<bits_t>*>(buffer),
                        chunk.begin, chunk.end, op);
  } else {
    move_range<kUnpack>(seg.rect, static_cast<bits_t*>(seg.data), buffer, chunk.begin, chunk.end, op);
  }
}

bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A rectangle spanning whole rows is one run: describe it as a single row so that its
// vector test looks at the run, not at the (possibly odd) row width.
SegmentDesc as_runs(const SegmentDesc& s) {
  if (segment_width(s) != s.tensor_cols) return s;
  SegmentDesc r = s;
  r.row_begin = 0;
  r.row_end = 1;
  r.col_begin = s.row_begin * s.tensor_cols;
  r.col_end = s.row_end * s.tensor_cols;
  r.tensor_cols = r.col_end - r.col_begin;
  return r;
}

bool vector_aligned(const SegmentDesc& s, int64_t lanes) {
  return s.col_begin % lanes == 0 && s.col_end % lanes == 0 && s.tensor_cols % lanes == 0 && s.offset % lanes == 0;
}

SegmentDesc in_vectors(SegmentDesc s, int64_t lanes) {
  s.col_begin /= lanes;
  s.col_end /= lanes;
  s.tensor_cols /= lanes;
  s.offset /= lanes;
  return s;
}

// The kernel's work table on the device, or chunk_count == 0 when there is nothing to move.
struct DeviceTable {
  at::Tensor storage;  // holds both tables; freed in stream order after the launch
  const DeviceSegment* segments = nullptr;
  const DeviceChunk* chunks = nullptr;
  int64_t chunk_count = 0;
};

// The work table in host memory: DeviceSegment[] then DeviceChunk[] (both 8-byte aligned,
// so the chunk table follows directly at chunk_offset).
struct HostWork {
  std::vector<uint8_t> bytes;
  int64_t chunk_offset = 0;
  int64_t chunk_count = 0;
};

HostWork work_table(const char* op, c10::ArrayRef<SegmentDesc> segs, at::TensorList tensors,
                    const at::Tensor& buffer, bool write_tensors) {
  const int64_t elem = buffer.element_size();
  const int64_t lanes = 16 / elem;
  const bool buffer_aligned = is_aligned16(buffer.const_data_ptr());
  std::vector<DeviceSegment> device_segs;
  std::vector<DeviceChunk> chunks;
  device_segs.reserve(segs.size());
  for (const SegmentDesc& s : segs) {
    if (segment_numel(s) == 0) continue;
    const at::Tensor& t = tensors[s.tensor];
    void* data = write_tensors ? t.mutable_data_ptr() : const_cast<void*>(t.const_data_ptr());
    DeviceSegment d{as_runs(s), data, 0};
    if (buffer_aligned && is_aligned16(data) && vector_aligned(d.rect, lanes)) {
      d.rect = in_vectors(d.rect, lanes);
      d.vectorised = 1;
    }
    count_kernel_path(d.vectorised ? KernelPath::kSegmentsVector : KernelPath::kSegmentsElements);
    const int64_t units = segment_numel(d.rect);
    const int64_t per_chunk = kChunkBytes / (d.vectorised ? 16 : elem);
    const int64_t index = static_cast<int64_t>(device_segs.size());
    for (int64_t b = 0; b < units; b += per_chunk) chunks.push_back({index, b, std::min(b + per_chunk, units)});
    device_segs.push_back(d);
  }
  HostWork work;
  if (chunks.empty()) return work;
  TORCH_CHECK(chunks.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()), op, ": ", chunks.size(),
              " chunks of ", kChunkBytes, " bytes exceed the grid limit; split the call");
  const size_t seg_bytes = device_segs.size() * sizeof(DeviceSegment);
  const size_t chunk_bytes = chunks.size() * sizeof(DeviceChunk);
  work.bytes.resize(seg_bytes + chunk_bytes);
  std::memcpy(work.bytes.data(), device_segs.data(), seg_bytes);
  std::memcpy(work.bytes.data() + seg_bytes, chunks.data(), chunk_bytes);
  work.chunk_offset = static_cast<int64_t>(seg_bytes);
  work.chunk_count = static_cast<int64_t>(chunks.size());
  return work;
}

DeviceTable device_view(const at::Tensor& storage, int64_t chunk_offset, int64_t chunk_count) {
  DeviceTable table;
  if (chunk_count == 0) return table;
  table.storage = storage;
  const uint8_t* d = storage.const_data_ptr<uint8_t>();
  table.segments = reinterpret_cast<const DeviceSegment*>(d);
  table.chunks = reinterpret_cast<const DeviceChunk*>(d + chunk_offset);
  table.chunk_count = chunk_count;
  return table;
}

// Per call: the work table through pinned memory, one async H2D copy on the current stream.
DeviceTable upload_table(const char* op, c10::ArrayRef<SegmentDesc> segs, at::TensorList tensors,
                         const at::Tensor& buffer, bool write_tensors) {
  const HostWork work = work_table(op, segs, tensors, buffer, write_tensors);
  if (work.chunk_count == 0) return DeviceTable{};
  at::Tensor host = at::empty({static_cast<int64_t>(work.bytes.size())},
                              at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.mutable_data_ptr<uint8_t>(), work.bytes.data(), work.bytes.size());
  // Non-blocking from pinned memory: the copy is queued on the current stream and the
  // caching host allocator records an event, so `host` is not reused before the copy ends.
  return device_view(host.to(at::TensorOptions().dtype(at::kByte).device(buffer.device()), /*non_blocking=*/true),
                     work.chunk_offset, work.chunk_count);
}

// `buffer` is the buffer's data: written by pack, only read by unpack.
template <typename T, bool kUnpack>
void launch_segments(const DeviceTable& table, void* buffer) {
  segments_kernel<T, kUnpack><<<static_cast<unsigned>(table.chunk_count), kThreads, 0,
                                c10::cuda::getCurrentCUDAStream()>>>(table.segments, table.chunks,
                                                                     static_cast<storage_t<T>*>(buffer));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// tensors: contiguous, the buffer's dtype and device; segments: int64 CPU [S, 6]; buffer:
// contiguous 1-D. Overwrites buffer[offset_s, offset_s + numel_s) for every segment s.
void pack_segments_cuda(at::TensorList tensors, const at::Tensor& segments, const at::Tensor& buffer) {
  const char* op = "subnet_ext.pack_segments";
  const auto segs = checked_segments(op, tensors, segments, buffer, nullptr);
  c10::cuda::CUDAGuard guard(buffer.device());
  const DeviceTable table = upload_table(op, segs, tensors, buffer, /*write_tensors=*/false);
  if (table.chunk_count == 0) return;
  void* data = buffer.mutable_data_ptr();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, buffer.scalar_type(), "subnet_ext.pack_cuda",
                                  [&] { launch_segments<storage_t<scalar_t>, false>(table, data); });
}

// As pack_segments, plus scales: floating CPU [S]. Overwrites each rectangle with its
// buffer segment times scales[s] (computed in at::opmath_type); rectangles are disjoint.
void unpack_average_cuda(at::TensorList tensors, const at::Tensor& segments, const at::Tensor& buffer,
                         const at::Tensor& scales) {
  const char* op = "subnet_ext.unpack_average_";
  const auto segs = checked_segments(op, tensors, segments, buffer, &scales);
  c10::cuda::CUDAGuard guard(buffer.device());
  const DeviceTable table = upload_table(op, segs, tensors, buffer, /*write_tensors=*/true);
  if (table.chunk_count == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, buffer.scalar_type(), "subnet_ext.unpack_cuda",
                                  [&] {
                                    launch_segments<scalar_t, true>(table, const_cast<void*>(buffer.const_data_ptr()));
                                  });
}

// Validates once and uploads the work table once, with a synchronous copy: the prepared
// table is then ready for any stream (and for CUDA graph capture) without further syncs.
// The copy waits through c10::cuda::memcpy_and_sync, so torch.cuda.set_sync_debug_mode
// sees it (a preparation inside a training step is a bug the engine's tests look for:
// its tables keep their addresses, so it prepares each table once, before the first step).
std::tuple<at::Tensor, at::Tensor> prepare_segments_cuda(at::TensorList tensors, const at::Tensor& segments,
                                                         const at::Tensor& buffer, const OptTensor& scales) {
  const char* op = "subnet_ext.prepare_segments";
  const auto segs = checked_segments(op, tensors, segments, buffer, scales.has_value() ? &*scales : nullptr);
  c10::cuda::CUDAGuard guard(buffer.device());
  const HostWork work = work_table(op, segs, tensors, buffer, /*write_tensors=*/scales.has_value());
  at::Tensor device = at::empty({static_cast<int64_t>(work.bytes.size())},
                                at::TensorOptions().dtype(at::kByte).device(buffer.device()));
  if (!work.bytes.empty()) {
    c10::cuda::memcpy_and_sync(device.mutable_data_ptr(), work.bytes.data(), static_cast<int64_t>(work.bytes.size()),
                               cudaMemcpyHostToDevice, c10::cuda::getCurrentCUDAStream());
  }
  const DeviceWork summary{static_cast<int64_t>(work.bytes.size()), work.chunk_offset, work.chunk_count};
  return {prepared_host_table(tensors, buffer, segs, scales.has_value(), summary), device};
}

// A prepared table may be used on another stream than the one it was allocated on (a
// side stream, a communication hook's stream): tell the caching allocator, so that
// dropping the table (a layout rebuilt) does not hand its memory to other work while a
// launch on this stream may still read it. A no-op on the allocation stream.
void keep_alive_on_current_stream(const at::Tensor& device_table) {
  if (device_table.numel() == 0) return;
  c10::cuda::CUDACachingAllocator::recordStream(device_table.storage().data_ptr(),
                                                c10::cuda::getCurrentCUDAStream(device_table.device().index()));
}

void pack_segments_prepared_cuda(at::TensorList tensors, const at::Tensor& host_table, const at::Tensor& device_table,
                                 const at::Tensor& buffer) {
  const PreparedView table = checked_prepared_table("subnet_ext.pack_segments_prepared", tensors, host_table,
                                                    device_table, buffer, /*for_unpack=*/false);
  const DeviceTable work = device_view(device_table, table.header->chunk_offset, table.header->chunk_count);
  if (work.chunk_count == 0) return;
  c10::cuda::CUDAGuard guard(buffer.device());
  keep_alive_on_current_stream(device_table);
  void* data = buffer.mutable_data_ptr();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, buffer.scalar_type(), "subnet_ext.pack_cuda",
                                  [&] { launch_segments<storage_t<scalar_t>, false>(work, data); });
}

void unpack_average_prepared_cuda(at::TensorList tensors, const at::Tensor& host_table,
                                  const at::Tensor& device_table, const at::Tensor& buffer) {
  const PreparedView table = checked_prepared_table("subnet_ext.unpack_average_prepared_", tensors, host_table,
                                                    device_table, buffer, /*for_unpack=*/true);
  const DeviceTable work = device_view(device_table, table.header->chunk_offset, table.header->chunk_count);
  if (work.chunk_count == 0) return;
  c10::cuda::CUDAGuard guard(buffer.device());
  keep_alive_on_current_stream(device_table);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, buffer.scalar_type(), "subnet_ext.unpack_cuda", [&] {
    launch_segments<scalar_t, true>(work, const_cast<void*>(buffer.const_data_ptr()));
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(subnet_ext, CUDA, m) {
  m.impl("pack_segments", &pack_segments_cuda);
  m.impl("unpack_average_", &unpack_average_cuda);
  m.impl("prepare_segments", &prepare_segments_cuda);
  m.impl("pack_segments_prepared", &pack_segments_prepared_cuda);
  m.impl("unpack_average_prepared_", &unpack_average_prepared_cuda);
}

}  // namespace subnet_ext

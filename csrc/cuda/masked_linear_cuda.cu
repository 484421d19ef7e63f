// CUDA kernels of the masked linear: coalesced gathers and scatters around ATen GEMMs.
//
// The gathers and scatters only move bits, so each kernel is instantiated per element
// size (2, 4, 8 bytes; 16-byte vectors for whole-row copies), not per dtype: half and
// bfloat16 share one instantiation. Threads run along columns, so for a fixed row a warp
// writes (gather) or reads (scatter) consecutive addresses of the contiguous side.
//
// Every index a kernel reads is bounds-checked with a device assert, so that values the
// host did not validate (check_indices=False) stop the kernel instead of reading or
// writing outside the tensors: one unsigned compare per index load, in kernels bound by
// memory traffic. A tripped assert aborts the CUDA context (the next sync raises
// "device-side assert triggered"); validated indices never trip it.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdint>

#include "kernels/gather.h"
#include "cuda/storage.cuh"
#include "masked_linear_registration.h"
#include "ops.h"

namespace subnet_ext {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kRowsPerThread = 4;  // rows one thread copies per column: loads in flight
constexpr int64_t kMaxGrid = 65535;    // gridDim.y limit; also used for x (grid-stride loops cover the rest)

using Vector16 = uint4;  // 16-byte unit of the whole-row path (alignof == 16)

bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// 0 <= i < bound in one compare (a negative i wraps to a huge unsigned value).
__device__ __forceinline__ bool in_bounds(int64_t i, int64_t bound) {
  return static_cast<uint64_t>(i) < static_cast<uint64_t>(bound);
}

// dst[r, c] = src[rows ? rows[r] : r, cols ? cols[c] : c] for r < n_rows, c < n_cols.
// src is row-major [src_rows, src_cols], dst row-major [n_rows, n_cols]; both in Units.
// Overwrites dst. Indices outside src trip a device assert (see the top of the file).
template <typename Unit>
__global__ void gather_kernel(const Unit* __restrict__ src, int64_t src_rows, int64_t src_cols,
                              const int64_t* __restrict__ rows, const int64_t* __restrict__ cols,
                              Unit* __restrict__ dst, int64_t n_rows, int64_t n_cols) {
  const int64_t col_step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < n_cols; c += col_step) {
    const int64_t src_c = gathered_index(cols, c);
    CUDA_KERNEL_ASSERT_MSG(in_bounds(src_c, src_cols), "subnet_ext.masked_linear: a column index is out of range");
#pragma unroll 4
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < n_rows; r += row_step) {
      const int64_t src_r = gathered_index(rows, r);
      CUDA_KERNEL_ASSERT_MSG(in_bounds(src_r, src_rows), "subnet_ext.masked_linear: a row index is out of range");
      dst[r * n_cols + c] = src[src_r * src_cols + src_c];
    }
  }
}

// inverse[cols[c]] = c for c < n_cols, inverse [n_inverse] pre-filled with -1: the source
// column of each output column, or -1 where the output is zero. cols are distinct (the
// op's contract); a value outside [0, n_inverse) trips a device assert.
__global__ void inverse_map_kernel(const int64_t* __restrict__ cols, int64_t n_cols, int64_t* __restrict__ inverse,
                                   int64_t n_inverse) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < n_cols; c += step) {
    const int64_t w = cols[c];
    CUDA_KERNEL_ASSERT_MSG(in_bounds(w, n_inverse), "subnet_ext.masked_linear: an output index is out of range");
    inverse[w] = c;
  }
}

// dst[r, w] = inverse[w] >= 0 ? src[r, inverse[w]] : 0 for r < n_rows, w < dst_cols. src is
// row-major [n_rows, src_cols], dst row-major [n_rows, dst_cols]. Writes every element of
// dst exactly once (the zero-fill is fused: no memset, no partially written sectors), and
// a warp's stores are consecutive addresses of one row.
template <typename Unit>
__global__ void scatter_columns_kernel(const Unit* __restrict__ src, int64_t src_cols,
                                       const int64_t* __restrict__ inverse, Unit* __restrict__ dst,
                                       int64_t n_rows, int64_t dst_cols) {
  const int64_t col_step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < dst_cols; w += col_step) {
    const int64_t src_c = inverse[w];
#pragma unroll 4
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < n_rows; r += row_step) {
      dst[r * dst_cols + w] = src_c >= 0 ? src[r * src_cols + src_c] : Unit(0);
    }
  }
}

struct Launch {
  dim3 grid, block;
};

// Block of kThreads as tx columns x ty rows, tx the power of two covering n_cols (capped):
// narrow matrices keep all threads busy and a warp still touches one contiguous span.
Launch launch_shape(int64_t n_rows, int64_t n_cols) {
  int64_t tx = 1;
  while (tx < n_cols && tx < kThreads) tx *= 2;
  const int64_t ty = kThreads / tx;
  const int64_t gx = std::min<int64_t>((n_cols + tx - 1) / tx, kMaxGrid);
  const int64_t gy = std::min<int64_t>((n_rows + ty * kRowsPerThread - 1) / (ty * kRowsPerThread), kMaxGrid);
  return {dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)),
          dim3(static_cast<unsigned>(tx), static_cast<unsigned>(ty))};
}

template <typename Unit>
void launch_gather(const void* src, int64_t src_rows, int64_t src_cols, const int64_t* rows, const int64_t* cols,
                   void* dst, int64_t n_rows, int64_t n_cols, cudaStream_t stream) {
  const Launch l = launch_shape(n_rows, n_cols);
  gather_kernel<Unit><<<l.grid, l.block, 0, stream>>>(static_cast<const Unit*>(src), src_rows, src_cols, rows, cols,
                                                       static_cast<Unit*>(dst), n_rows, n_cols);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

const int64_t* index_pointer(const at::Tensor& idx) { return idx.defined() ? idx.const_data_ptr<int64_t>() : nullptr; }

// IndexKernels::gather. src [*, src_cols] and dst [R, C] contiguous on one device; rows
// ([R]) and cols ([C]) int64 on that device or undefined.
void gather_cuda(const at::Tensor& src, const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& dst) {
  TORCH_INTERNAL_ASSERT(src.dim() == 2 && dst.dim() == 2 && src.is_contiguous() && dst.is_contiguous());
  const int64_t n_rows = dst.size(0), n_cols = dst.size(1), src_rows = src.size(0), src_cols = src.size(1);
  if (n_rows == 0 || n_cols == 0) return;
  c10::cuda::CUDAGuard guard(dst.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Indices are dense (masked_linear.cpp makes them so before any kernel runs).
  const at::Tensor& row_idx = rows;
  const at::Tensor& col_idx = cols;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "subnet_ext.gather_cuda", [&] {
    constexpr int64_t elem = sizeof(scalar_t);
    const void* s = src.const_data_ptr();
    void* d = dst.mutable_data_ptr();
    // Whole rows: copy them in 16-byte vectors when every row start is 16-byte aligned.
    const bool whole_row_vectors = !col_idx.defined() && is_aligned16(s) && is_aligned16(d) &&
                                   (n_cols * elem) % 16 == 0 && (src_cols * elem) % 16 == 0;
    if (whole_row_vectors) {
      launch_gather<Vector16>(s, src_rows, src_cols * elem / 16, index_pointer(row_idx), nullptr, d, n_rows,
                              n_cols * elem / 16, stream);
    } else {
      launch_gather<storage_t<scalar_t>>(s, src_rows, src_cols, index_pointer(row_idx), index_pointer(col_idx), d,
                                         n_rows, n_cols, stream);
    }
  });
}

// IndexKernels::scatter_columns. src [R, C] and dst [R, W] contiguous; cols [C] int64,
// distinct, in [0, W). Two launches on the current stream, no host sync: the inverse map
// (W int64, filled with -1, then inverse[cols[c]] = c), then one pass that writes every
// element of dst once (kept column: its value; other columns: 0).
void scatter_columns_cuda(const at::Tensor& src, const at::Tensor& cols, const at::Tensor& dst) {
  TORCH_INTERNAL_ASSERT(src.dim() == 2 && dst.dim() == 2 && src.is_contiguous() && dst.is_contiguous() &&
                        cols.is_contiguous() && src.size(0) == dst.size(0) && cols.numel() == src.size(1));
  const int64_t n_rows = src.size(0), n_cols = src.size(1), dst_cols = dst.size(1);
  if (dst.numel() == 0) return;
  c10::cuda::CUDAGuard guard(dst.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor inverse = at::full({dst_cols}, -1, cols.options());
  if (n_cols > 0) {
    const int64_t blocks = std::min<int64_t>((n_cols + kThreads - 1) / kThreads, kMaxGrid);
    inverse_map_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        cols.const_data_ptr<int64_t>(), n_cols, inverse.mutable_data_ptr<int64_t>(), dst_cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "subnet_ext.scatter_cuda", [&] {
    using unit_t = storage_t<scalar_t>;
    const Launch l = launch_shape(n_rows, dst_cols);
    scatter_columns_kernel<unit_t><<<l.grid, l.block, 0, stream>>>(
        static_cast<const unit_t*>(src.const_data_ptr()), n_cols, inverse.const_data_ptr<int64_t>(),
        static_cast<unit_t*>(dst.mutable_data_ptr()), n_rows, dst_cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// IndexKernels::gemm_float_out: a half-precision GEMM with fp32 output and accumulation
// (cuBLAS on tensor cores), from the out_dtype overloads torch has had since 2.8; before
// that, the operands are widened to fp32 first (exact, but an fp32 GEMM).
void gemm_float_out_cuda(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  at::Tensor& result = const_cast<at::Tensor&>(out);
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  if (accumulate) {
    // addmm's out_dtype overload wants a half-precision `self`; baddbmm's adds into `out`.
    at::Tensor result3 = result.unsqueeze(0);
    at::baddbmm_out(result3, result3, a.unsqueeze(0), b.unsqueeze(0), at::kFloat, 1, 1);
  } else {
    at::mm_out(result, a, b, at::kFloat);
  }
#else
  const at::Tensor a32 = a.to(at::kFloat), b32 = b.to(at::kFloat);
  if (accumulate) {
    result.addmm_(a32, b32);
  } else {
    at::mm_out(result, a32, b32);
  }
#endif
}

constexpr IndexKernels kCudaKernels{gather_cuda, scatter_columns_cuda, gemm_float_out_cuda};

}  // namespace

SUBNET_EXT_REGISTER_MASKED_LINEAR(CUDA, kCudaKernels)

}  // namespace subnet_ext

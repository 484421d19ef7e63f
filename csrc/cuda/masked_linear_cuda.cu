// CUDA kernels of the masked linear: coalesced gathers and scatters around ATen GEMMs.
// (Index sets that are contiguous runs need none of them: masked_linear_grad_runs_ hands
// strided views to the GEMM; these serve arbitrary indices.)
//
// The gathers and scatters only move bits, so each kernel is instantiated per element
// size (2, 4, 8 bytes; 16-byte vectors for whole-row copies), not per dtype: half and
// bfloat16 share one instantiation. Threads run along columns, so for a fixed row a warp
// writes (gather) or reads (scatter) consecutive addresses of the contiguous side; where
// the output's rows are 16-byte aligned a thread writes 16 bytes at a time. Each thread
// loads and checks its indices once, then issues all of a pass's loads before its stores.
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
constexpr int kRows = 4;  // rows one thread moves per pass: its loads are all issued before its stores

using Vector16 = uint4;  // 16-byte unit (alignof == 16)

bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// 0 <= i < bound in one compare (a negative i wraps to a huge unsigned value).
__device__ __forceinline__ bool in_bounds(int64_t i, int64_t bound) {
  return static_cast<uint64_t>(i) < static_cast<uint64_t>(bound);
}

// The source row of output row r (rows given) or r itself; -1 past the last row. Checked
// once, when the thread loads it.
__device__ __forceinline__ int64_t source_row(const int64_t* __restrict__ rows, int64_t r, int64_t n_rows,
                                              int64_t src_rows) {
  if (r >= n_rows) return -1;
  const int64_t s = gathered_index(rows, r);
  CUDA_KERNEL_ASSERT_MSG(in_bounds(s, src_rows), "subnet_ext.masked_linear: a row index is out of range");
  return s;
}

// dst[r, c] = src[rows ? rows[r] : r, cols ? cols[c] : c] for r < n_rows, c < n_cols, one Unit
// per (r, c). src is row-major [src_rows, src_cols], dst row-major [n_rows, n_cols]; both in
// Units. Overwrites dst. Each thread owns one column and kRows rows per pass: it loads and
// checks its column index once, its row indices once per pass, then issues its kRows loads
// before its kRows stores. Grid-stride loops in both dimensions (any grid is correct).
template <typename Unit>
__global__ void gather_kernel(const Unit* __restrict__ src, int64_t src_rows, int64_t src_cols,
                              const int64_t* __restrict__ rows, const int64_t* __restrict__ cols,
                              Unit* __restrict__ dst, int64_t n_rows, int64_t n_cols) {
  const int64_t col_step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y * kRows;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < n_cols; c += col_step) {
    const int64_t src_c = gathered_index(cols, c);
    CUDA_KERNEL_ASSERT_MSG(in_bounds(src_c, src_cols), "subnet_ext.masked_linear: a column index is out of range");
    for (int64_t r0 = (static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y) * kRows; r0 < n_rows;
         r0 += row_step) {
      Unit values[kRows];
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int64_t s = source_row(rows, r0 + j, n_rows, src_rows);
        if (s >= 0) values[j] = src[s * src_cols + src_c];
      }
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        if (r0 + j < n_rows) dst[(r0 + j) * n_cols + c] = values[j];
      }
    }
  }
}

// The Units of one 16-byte vector of elements.
template <typename Unit>
struct alignas(16) Lanes {
  static constexpr int kCount = 16 / sizeof(Unit);
  Unit lane[kCount];
};

// As gather_kernel for a column gather whose output rows are 16-byte aligned (n_cols a
// multiple of Lanes<Unit>::kCount, dst aligned): each thread owns one 16-byte vector of
// output columns (kCount columns, their indices loaded and checked once) and kRows rows
// per pass; it issues its kRows x kCount element loads, then kRows 16-byte stores.
template <typename Unit>
__global__ void gather_columns_vector_kernel(const Unit* __restrict__ src, int64_t src_rows, int64_t src_cols,
                                             const int64_t* __restrict__ rows, const int64_t* __restrict__ cols,
                                             Unit* __restrict__ dst, int64_t n_rows, int64_t n_cols) {
  using Vec = Lanes<Unit>;
  constexpr int kLanes = Vec::kCount;
  const int64_t n_vectors = n_cols / kLanes;
  const int64_t vec_step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y * kRows;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < n_vectors; v += vec_step) {
    int64_t src_c[kLanes];
#pragma unroll
    for (int i = 0; i < kLanes; ++i) {
      src_c[i] = cols[v * kLanes + i];
      CUDA_KERNEL_ASSERT_MSG(in_bounds(src_c[i], src_cols), "subnet_ext.masked_linear: a column index is out of range");
    }
    for (int64_t r0 = (static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y) * kRows; r0 < n_rows;
         r0 += row_step) {
      Vec values[kRows];
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int64_t s = source_row(rows, r0 + j, n_rows, src_rows);
        if (s < 0) continue;
        const Unit* row = src + s * src_cols;
#pragma unroll
        for (int i = 0; i < kLanes; ++i) values[j].lane[i] = row[src_c[i]];
      }
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        if (r0 + j < n_rows) reinterpret_cast<Vec*>(dst + (r0 + j) * n_cols)[v] = values[j];
      }
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
// dst exactly once (the zero-fill is fused: no memset). Each thread owns `kLanes`
// consecutive output columns (their inverse entries loaded once) and kRows rows per pass:
// kRows x kLanes loads, then kRows stores of kLanes Units (one 16-byte store when Vec is a
// 16-byte vector, i.e. kLanes = 16 / sizeof(Unit) and the rows are 16-byte aligned).
template <typename Unit, int kLanes>
__global__ void scatter_columns_kernel(const Unit* __restrict__ src, int64_t src_cols,
                                       const int64_t* __restrict__ inverse, Unit* __restrict__ dst,
                                       int64_t n_rows, int64_t dst_cols) {
  struct alignas(sizeof(Unit) * kLanes) Vec {
    Unit lane[kLanes];
  };
  const int64_t n_groups = dst_cols / kLanes;
  const int64_t group_step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y * kRows;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < n_groups; v += group_step) {
    int64_t src_c[kLanes];
#pragma unroll
    for (int i = 0; i < kLanes; ++i) src_c[i] = inverse[v * kLanes + i];
    for (int64_t r0 = (static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y) * kRows; r0 < n_rows;
         r0 += row_step) {
      Vec values[kRows];
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const Unit* row = src + (r0 + j < n_rows ? r0 + j : 0) * src_cols;
#pragma unroll
        for (int i = 0; i < kLanes; ++i) values[j].lane[i] = src_c[i] >= 0 ? row[src_c[i]] : Unit(0);
      }
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        if (r0 + j < n_rows) reinterpret_cast<Vec*>(dst + (r0 + j) * dst_cols)[v] = values[j];
      }
    }
  }
}

struct Launch {
  dim3 grid, block;
};

// Blocks of kThreads as tx units x ty rows, tx the power of two covering `units` (capped):
// narrow matrices keep all threads busy and a warp still touches one contiguous span. Each
// thread moves kRows rows per pass; the grid is capped at max_grid_blocks() per dimension.
Launch launch_shape(int64_t n_rows, int64_t units) {
  int64_t tx = 1;
  while (tx < units && tx < kThreads) tx *= 2;
  const int64_t ty = kThreads / tx;
  const int64_t cap = max_grid_blocks();
  const int64_t gx = std::max<int64_t>(1, std::min<int64_t>((units + tx - 1) / tx, cap));
  const int64_t gy = std::max<int64_t>(1, std::min<int64_t>((n_rows + ty * kRows - 1) / (ty * kRows), cap));
  return {dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)),
          dim3(static_cast<unsigned>(tx), static_cast<unsigned>(ty))};
}

const int64_t* index_pointer(const at::Tensor& idx) { return idx.defined() ? idx.const_data_ptr<int64_t>() : nullptr; }

// IndexKernels::gather. src [*, src_cols] and dst [R, C] contiguous on one device; rows
// ([R]) and cols ([C]) dense int64 on that device or undefined (masked_linear.cpp makes
// indices dense before any kernel runs).
void gather_cuda(const at::Tensor& src, const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& dst) {
  TORCH_INTERNAL_ASSERT(src.dim() == 2 && dst.dim() == 2 && src.is_contiguous() && dst.is_contiguous());
  const int64_t n_rows = dst.size(0), n_cols = dst.size(1), src_rows = src.size(0), src_cols = src.size(1);
  if (n_rows == 0 || n_cols == 0) return;
  c10::cuda::CUDAGuard guard(dst.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* row_idx = index_pointer(rows);
  const int64_t* col_idx = index_pointer(cols);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "subnet_ext.gather_cuda", [&] {
    using unit_t = storage_t<scalar_t>;
    constexpr int64_t elem = sizeof(scalar_t), lanes = 16 / elem;
    const void* s = src.const_data_ptr();
    void* d = dst.mutable_data_ptr();
    if (col_idx == nullptr && is_aligned16(s) && is_aligned16(d) && (n_cols * elem) % 16 == 0 &&
        (src_cols * elem) % 16 == 0) {
      // Whole rows: copied in 16-byte vectors.
      count_kernel_path(KernelPath::kGatherRowsVector);
      const Launch l = launch_shape(n_rows, n_cols / lanes);
      gather_kernel<Vector16><<<l.grid, l.block, 0, stream>>>(static_cast<const Vector16*>(s), src_rows,
                                                               src_cols / lanes, row_idx, nullptr,
                                                               static_cast<Vector16*>(d), n_rows, n_cols / lanes);
    } else if (col_idx != nullptr && is_aligned16(d) && n_cols % lanes == 0) {
      // A column gather into 16-byte aligned output rows: 16-byte stores.
      count_kernel_path(KernelPath::kGatherColumnsVector);
      const Launch l = launch_shape(n_rows, n_cols / lanes);
      gather_columns_vector_kernel<unit_t><<<l.grid, l.block, 0, stream>>>(
          static_cast<const unit_t*>(s), src_rows, src_cols, row_idx, col_idx, static_cast<unit_t*>(d), n_rows,
          n_cols);
    } else {
      count_kernel_path(KernelPath::kGatherElements);
      const Launch l = launch_shape(n_rows, n_cols);
      gather_kernel<unit_t><<<l.grid, l.block, 0, stream>>>(static_cast<const unit_t*>(s), src_rows, src_cols,
                                                             row_idx, col_idx, static_cast<unit_t*>(d), n_rows,
                                                             n_cols);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// IndexKernels::scatter_columns. src [R, C] and dst [R, W] contiguous; cols [C] int64,
// distinct, in [0, W). Two launches on the current stream, no host sync: the inverse map
// (W int64, filled with -1, then inverse[cols[c]] = c), then one pass that writes every
// element of dst once (kept column: its value; other columns: 0), in 16-byte stores
// where dst's rows are 16-byte aligned.
void scatter_columns_cuda(const at::Tensor& src, const at::Tensor& cols, const at::Tensor& dst) {
  TORCH_INTERNAL_ASSERT(src.dim() == 2 && dst.dim() == 2 && src.is_contiguous() && dst.is_contiguous() &&
                        cols.is_contiguous() && src.size(0) == dst.size(0) && cols.numel() == src.size(1));
  const int64_t n_rows = src.size(0), n_cols = src.size(1), dst_cols = dst.size(1);
  if (dst.numel() == 0) return;
  c10::cuda::CUDAGuard guard(dst.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor inverse = at::full({dst_cols}, -1, cols.options());
  if (n_cols > 0) {
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((n_cols + kThreads - 1) / kThreads,
                                                                  max_grid_blocks()));
    inverse_map_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        cols.const_data_ptr<int64_t>(), n_cols, inverse.mutable_data_ptr<int64_t>(), dst_cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "subnet_ext.scatter_cuda", [&] {
    using unit_t = storage_t<scalar_t>;
    constexpr int lanes = 16 / sizeof(scalar_t);
    const auto* s = static_cast<const unit_t*>(src.const_data_ptr());
    auto* d = static_cast<unit_t*>(dst.mutable_data_ptr());
    const int64_t* inv = inverse.const_data_ptr<int64_t>();
    if (is_aligned16(d) && dst_cols % lanes == 0) {
      count_kernel_path(KernelPath::kScatterColumnsVector);
      const Launch l = launch_shape(n_rows, dst_cols / lanes);
      scatter_columns_kernel<unit_t, lanes><<<l.grid, l.block, 0, stream>>>(s, n_cols, inv, d, n_rows, dst_cols);
    } else {
      count_kernel_path(KernelPath::kScatterColumnsElements);
      const Launch l = launch_shape(n_rows, dst_cols);
      scatter_columns_kernel<unit_t, 1><<<l.grid, l.block, 0, stream>>>(s, n_cols, inv, d, n_rows, dst_cols);
    }
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

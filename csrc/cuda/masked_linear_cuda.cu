// CUDA kernels of the masked linear: coalesced gathers and scatters around ATen GEMMs.
//
// The gathers and scatters only move bits, so each kernel is instantiated per element
// size (2, 4, 8 bytes; 16-byte vectors for whole-row copies), not per dtype: half and
// bfloat16 share one instantiation. Threads run along columns, so for a fixed row a warp
// writes (gather) or reads (scatter) consecutive addresses of the contiguous side.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "kernels/gather.h"
#include "ops.h"

namespace subnet_ext {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kRowsPerThread = 4;  // rows one thread copies per column: loads in flight
constexpr int64_t kMaxGrid = 65535;    // gridDim.y limit; also used for x (grid-stride loops cover the rest)

template <size_t Bytes>
struct StorageOf;
template <>
struct StorageOf<2> { using type = uint16_t; };
template <>
struct StorageOf<4> { using type = uint32_t; };
template <>
struct StorageOf<8> { using type = uint64_t; };
template <typename T>
using storage_t = typename StorageOf<sizeof(T)>::type;

using Vector16 = uint4;  // 16-byte unit of the whole-row path (alignof == 16)

bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// dst[r, c] = src[rows ? rows[r] : r, cols ? cols[c] : c] for r < n_rows, c < n_cols.
// src is row-major with row stride src_cols, dst is row-major [n_rows, n_cols]; both in
// Units. Overwrites dst; indices are trusted (validated on the host by check_index).
template <typename Unit>
__global__ void gather_kernel(const Unit* __restrict__ src, int64_t src_cols, const int64_t* __restrict__ rows,
                              const int64_t* __restrict__ cols, Unit* __restrict__ dst, int64_t n_rows,
                              int64_t n_cols) {
  const int64_t col_step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < n_cols; c += col_step) {
    const int64_t src_c = gathered_index(cols, c);
#pragma unroll 4
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < n_rows; r += row_step) {
      dst[r * n_cols + c] = src[gathered_index(rows, r) * src_cols + src_c];
    }
  }
}

// dst[r, cols[c]] = src[r, c] for r < n_rows, c < n_cols. src is row-major [n_rows, n_cols],
// dst row-major with row stride dst_cols; other columns of dst are left as they are.
template <typename Unit>
__global__ void scatter_columns_kernel(const Unit* __restrict__ src, const int64_t* __restrict__ cols,
                                       Unit* __restrict__ dst, int64_t dst_cols, int64_t n_rows, int64_t n_cols) {
  const int64_t col_step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < n_cols; c += col_step) {
    const int64_t dst_c = cols[c];
#pragma unroll 4
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < n_rows; r += row_step) {
      dst[r * dst_cols + dst_c] = src[r * n_cols + c];
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
void launch_gather(const void* src, int64_t src_cols, const int64_t* rows, const int64_t* cols, void* dst,
                   int64_t n_rows, int64_t n_cols, cudaStream_t stream) {
  const Launch l = launch_shape(n_rows, n_cols);
  gather_kernel<Unit><<<l.grid, l.block, 0, stream>>>(static_cast<const Unit*>(src), src_cols, rows, cols,
                                                       static_cast<Unit*>(dst), n_rows, n_cols);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

const int64_t* index_pointer(const at::Tensor& idx) { return idx.defined() ? idx.const_data_ptr<int64_t>() : nullptr; }

// IndexKernels::gather. src [*, src_cols] and dst [R, C] contiguous on one device; rows
// ([R]) and cols ([C]) int64 on that device or undefined.
void gather_cuda(const at::Tensor& src, const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& dst) {
  TORCH_INTERNAL_ASSERT(src.dim() == 2 && dst.dim() == 2 && src.is_contiguous() && dst.is_contiguous());
  const int64_t n_rows = dst.size(0), n_cols = dst.size(1), src_cols = src.size(1);
  if (n_rows == 0 || n_cols == 0) return;
  c10::cuda::CUDAGuard guard(dst.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // The index tensors are 1-D but not necessarily dense; the kernels read them densely.
  const at::Tensor row_idx = rows.defined() ? rows.contiguous() : at::Tensor();
  const at::Tensor col_idx = cols.defined() ? cols.contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "subnet_ext.gather_cuda", [&] {
    constexpr int64_t elem = sizeof(scalar_t);
    const void* s = src.const_data_ptr();
    void* d = dst.mutable_data_ptr();
    // Whole rows: copy them in 16-byte vectors when every row start is 16-byte aligned.
    const bool whole_row_vectors = !col_idx.defined() && is_aligned16(s) && is_aligned16(d) &&
                                   (n_cols * elem) % 16 == 0 && (src_cols * elem) % 16 == 0;
    if (whole_row_vectors) {
      launch_gather<Vector16>(s, src_cols * elem / 16, index_pointer(row_idx), nullptr, d, n_rows, n_cols * elem / 16,
                              stream);
    } else {
      launch_gather<storage_t<scalar_t>>(s, src_cols, index_pointer(row_idx), index_pointer(col_idx), d, n_rows,
                                         n_cols, stream);
    }
  });
}

// IndexKernels::scatter_columns. src [R, C] and dst [R, W] contiguous; cols [C] int64.
// dst is zeroed first (one memset on the stream), then the kept columns are written.
void scatter_columns_cuda(const at::Tensor& src, const at::Tensor& cols, const at::Tensor& dst) {
  TORCH_INTERNAL_ASSERT(src.dim() == 2 && dst.dim() == 2 && src.is_contiguous() && dst.is_contiguous() &&
                        src.size(0) == dst.size(0));
  const int64_t n_rows = src.size(0), n_cols = src.size(1), dst_cols = dst.size(1);
  c10::cuda::CUDAGuard guard(dst.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (dst.numel() > 0) {
    C10_CUDA_CHECK(cudaMemsetAsync(dst.mutable_data_ptr(), 0, dst.numel() * dst.element_size(), stream));
  }
  if (n_rows == 0 || n_cols == 0) return;
  const at::Tensor col_idx = cols.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "subnet_ext.scatter_cuda", [&] {
    using unit_t = storage_t<scalar_t>;
    const Launch l = launch_shape(n_rows, n_cols);
    scatter_columns_kernel<unit_t><<<l.grid, l.block, 0, stream>>>(
        static_cast<const unit_t*>(src.const_data_ptr()), col_idx.const_data_ptr<int64_t>(),
        static_cast<unit_t*>(dst.mutable_data_ptr()), dst_cols, n_rows, n_cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

constexpr IndexKernels kCudaKernels{gather_cuda, scatter_columns_cuda};

at::Tensor masked_linear_cuda(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                              const OptTensor& out_idx, const OptTensor& in_idx, bool compact_weight,
                              int64_t scatter_width) {
  return masked_linear_impl("subnet_ext.masked_linear", x, weight, bias, out_idx, in_idx, compact_weight,
                            scatter_width, kCudaKernels);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_linear_forward_cuda(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, const OptTensor& out_idx,
    const OptTensor& in_idx, bool compact_weight, int64_t scatter_width) {
  return masked_linear_forward_impl(x, weight, bias, out_idx, in_idx, compact_weight, scatter_width, kCudaKernels);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_linear_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, const OptTensor& out_idx,
    const OptTensor& in_idx, bool compact_weight, bool grad_out_full, bool dense_grad_input,
    std::array<bool, 3> output_mask, const OptTensor& x_kept, const OptTensor& weight_block) {
  return masked_linear_backward_impl(grad_out, x, weight, out_idx, in_idx, compact_weight, grad_out_full,
                                     dense_grad_input, output_mask, x_kept, weight_block, kCudaKernels);
}

void masked_linear_grad_weight_cuda(const at::Tensor& out, const at::Tensor& grad_out, const at::Tensor& x,
                                    const OptTensor& out_idx, const OptTensor& in_idx, bool grad_out_full,
                                    bool accumulate) {
  masked_linear_grad_weight_impl(out, grad_out, x, out_idx, in_idx, grad_out_full, accumulate, kCudaKernels);
}

}  // namespace

TORCH_LIBRARY_IMPL(subnet_ext, CUDA, m) {
  m.impl("masked_linear", &masked_linear_cuda);
  m.impl("masked_linear_forward", &masked_linear_forward_cuda);
  m.impl("masked_linear_backward", &masked_linear_backward_cuda);
  m.impl("masked_linear_grad_weight_", &masked_linear_grad_weight_cuda);
}

}  // namespace subnet_ext

// Device-independent op bodies. Each dispatch key (cpu/, cuda/) supplies its own index
// kernels and registers the op; validation, shapes and the GEMMs live here once.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/segments.h"

namespace subnet_ext {

using OptTensor = std::optional<at::Tensor>;

// Gathers and scatters of the masked linear; src and dst are 2-D and contiguous, indices
// 1-D contiguous int64 on their device (the op bodies in masked_linear.cpp make them so).
struct IndexKernels {
  // dst[r, c] = src[rows ? rows[r] : r, cols ? cols[c] : c]; rows/cols may be undefined.
  void (*gather)(const at::Tensor& src, const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& dst);
  // dst[r, cols[c]] = src[r, c] and every other column of dst is zero; dst may be uninitialised.
  void (*scatter_columns)(const at::Tensor& src, const at::Tensor& cols, const at::Tensor& dst);
  // out (+)= a @ b for half-precision a [M, K], b [K, N] (one dtype, fp16 or bf16) and an
  // fp32 out [M, N]: products and sums in fp32, no fp32 copy of a or b where the device
  // has a half-precision GEMM with fp32 output (CUDA: tensor cores); accumulate adds to out.
  void (*gemm_float_out)(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate);
};

// Operands the forward gathered, handed to the backward so it need not gather them again.
// Undefined where nothing was gathered (no in_idx; a compact weight or no index).
struct GatheredOperands {
  at::Tensor x_kept;        // [N, |S|], N = x.numel() / x.size(-1)
  at::Tensor weight_block;  // [|R|, |S|]
};

// check_indices: true validates the index values (in range, distinct; on CUDA one device
// sync to read them back); false checks only dtype, dim and device, and the caller
// guarantees the values are valid (the engine, whose plan validated them once). With
// check_indices=false an index out of range is still caught (CPU: a ValueError from a
// one-pass range check; CUDA: a device assert in the kernels, which loses the context);
// repeated indices are the caller's to avoid.
at::Tensor masked_linear_impl(const char* op, const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                              const OptTensor& out_idx, const OptTensor& in_idx, bool compact_weight,
                              int64_t scatter_width, bool check_indices, const IndexKernels& kernels,
                              GatheredOperands* gathered = nullptr);

// masked_linear_forward: (y, x_kept, weight_block), the last two an empty [0] tensor when not gathered.
std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_linear_forward_impl(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, const OptTensor& out_idx,
    const OptTensor& in_idx, bool compact_weight, int64_t scatter_width, bool check_indices,
    const IndexKernels& kernels);

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_linear_backward_impl(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, const OptTensor& out_idx,
    const OptTensor& in_idx, bool compact_weight, bool grad_out_full, bool dense_grad_input,
    std::array<bool, 3> output_mask, const OptTensor& x_kept, const OptTensor& weight_block, bool check_indices,
    const IndexKernels& kernels);

// out may be float32 while grad_out and x are fp16/bf16 (mixed precision: the gradient of
// fp32 parameters, e.g. a communication bucket): the owned block is gathered in the half
// dtype and multiplied with fp32 output and accumulation (IndexKernels::gemm_float_out).
void masked_linear_grad_weight_impl(const at::Tensor& out, const at::Tensor& grad_out, const at::Tensor& x,
                                    const OptTensor& out_idx, const OptTensor& in_idx, bool grad_out_full,
                                    bool accumulate, bool check_indices, const IndexKernels& kernels);

// The weight (and bias) gradient of the owned block when the kept indices are unions of
// contiguous runs (the engine's: a rank owns runs of neurons, heads, channels): no gather,
// one GEMM per pair of runs on strided views of grad_out and x (cuBLAS on CUDA, reading
// them through their leading dimension). Where a run is not 16-byte aligned (it starts or
// ends at an odd column), the runs are first copied side by side into one padded buffer read
// by a single GEMM: a memory pass instead of slow GEMMs on misaligned views. out_runs / in_runs: flat host lists
// [start0, length0, start1, length1, ...] over grad_out's and x's last dimension, in the
// order of the block's rows / columns; empty: every column. weight_out [sum out lengths,
// sum in lengths] and bias_out [sum out lengths] are written (or added to, accumulate),
// either may be absent. Their dtype is the operands' or float32 for fp16/bf16 operands
// (products and sums in fp32, as masked_linear_grad_weight_). No device sync.
void masked_linear_grad_runs_impl(const OptTensor& weight_out, const OptTensor& bias_out, const at::Tensor& grad_out,
                                  const at::Tensor& x, c10::IntArrayRef out_runs, c10::IntArrayRef in_runs,
                                  bool accumulate, const IndexKernels& kernels);

// Largest number of blocks the CUDA index kernels launch along one grid dimension (the
// hardware's y limit, 65535, unless lowered). Their loops stride over the grid, so any
// limit >= 1 computes the same result; tests lower it so that small inputs take several
// passes (subnet_ext.testing.max_grid_blocks). Returns the previous limit.
int64_t max_grid_blocks();
int64_t set_max_grid_blocks(int64_t blocks);

// The CUDA kernels' paths, each counted when the host picks it (per launch; per segment for
// the packing kernels, when its work table is built), so tests can check which path ran, not
// only the values: the 16-byte vector paths need aligned operands, and a silent fall-back to
// the element path would still compute the right numbers. The op `_kernel_path_count(name)`
// reads a count by name (launch_limits.cpp holds the names).
enum class KernelPath : int {
  kGatherRowsVector,        // masked linear: whole rows copied in 16-byte vectors
  kGatherColumnsVector,     // a column gather into 16-byte aligned output rows
  kGatherElements,          // any other gather, element by element
  kScatterColumnsVector,    // a column scatter with 16-byte stores
  kScatterColumnsElements,  // a column scatter, element by element
  kSegmentsVector,          // pack / unpack: a segment moved in 16-byte vectors
  kSegmentsElements,        // pack / unpack: a segment moved element by element
  kCount
};
void count_kernel_path(KernelPath path, int64_t n = 1);
int64_t kernel_path_count(c10::string_view name);

// Validated segment table of pack_segments / unpack_average_ (host side). With scales
// (unpack), also checks that no two rectangles share memory and none aliases the buffer.
// Every call counts one build (segment_table_builds).
std::vector<SegmentDesc> checked_segments(const char* op, at::TensorList tensors, const at::Tensor& segments,
                                          const at::Tensor& buffer, const at::Tensor* scales);

// Number of segment tables validated so far in this process (for tests: the prepared path
// must not validate again).
int64_t segment_table_builds();

// ---- prepared segment tables: validated once per layout, reused by every call ----
//
// prepare_segments returns (host_table, device_table). host_table (uint8 CPU) holds a
// PreparedHeader, the validated SegmentDesc[segment_count] (scales inside) and one
// PreparedTensor per tensor: the data pointer and 2-D shape it was validated for. The
// table binds those pointers: the prepared ops check, on the host in O(#tensors) without a
// device sync, that they are given the same tensors and buffer. device_table is the
// device's own work table (CUDA: segment and chunk descriptors, uploaded once), or an
// empty tensor where the device reads the host table (CPU).
struct PreparedHeader {
  int64_t magic;
  int64_t segment_count;
  int64_t tensor_count;
  int64_t with_scales;   // validated for unpack_average_ too
  int64_t dtype;         // c10::ScalarType of the buffer
  int64_t buffer_numel;
  uint64_t buffer_data;
  int64_t device_bytes;  // numel of device_table
  int64_t chunk_offset;  // CUDA: byte offset of the chunk descriptors in device_table
  int64_t chunk_count;   // CUDA: blocks of the launch
};

struct PreparedTensor {
  uint64_t data;
  int64_t rows;
  int64_t cols;
};

struct DeviceWork {  // what a device's prepare_segments adds to the host table
  int64_t device_bytes = 0;
  int64_t chunk_offset = 0;
  int64_t chunk_count = 0;
};

at::Tensor prepared_host_table(at::TensorList tensors, const at::Tensor& buffer, const std::vector<SegmentDesc>& segs,
                               bool with_scales, const DeviceWork& work);

// The validated segments of a prepared table after checking that tensors, buffer and
// device_table are the ones it was prepared for (else a ValueError naming what changed).
struct PreparedView {
  const PreparedHeader* header;
  c10::ArrayRef<SegmentDesc> segments;
};
PreparedView checked_prepared_table(const char* op, at::TensorList tensors, const at::Tensor& host_table,
                                    const at::Tensor& device_table, const at::Tensor& buffer, bool for_unpack);

}  // namespace subnet_ext

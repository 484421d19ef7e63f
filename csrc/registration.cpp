// The op schemas of the `subnet_ext` namespace, defined once. cpu/ and cuda/ register
// their kernels for their own dispatch key; subnet_ext/ops/registration.py adds the fake
// kernels (ops/fake.py), the masked linear's autograd and its autocast kernels.
#include <torch/library.h>

#include "ops.h"

// check_indices (last, default True): False skips validating the VALUES of out_idx/in_idx
// (range, distinctness; the check that syncs the device), keeping the dtype/dim/device
// checks. The caller guarantees valid indices: the engine, whose plan checked them once,
// passes False so that a step never synchronises and can be captured in a CUDA graph.
TORCH_LIBRARY(subnet_ext, m) {
  m.def(
      "masked_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? out_idx, Tensor? in_idx, "
      "bool compact_weight, int scatter_width, bool check_indices=True) -> Tensor");
  // As masked_linear, plus what backward would otherwise gather again: x_kept = x[..., S] as
  // [N, |S|] and weight_block = W[R][:, S] (each an empty [0] tensor when nothing was gathered).
  m.def(
      "masked_linear_forward(Tensor x, Tensor weight, Tensor? bias, Tensor? out_idx, Tensor? in_idx, "
      "bool compact_weight, int scatter_width, bool check_indices=True) -> (Tensor, Tensor, Tensor)");
  m.def(
      "masked_linear_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor? out_idx, Tensor? in_idx, "
      "bool compact_weight, bool grad_out_full, bool dense_grad_input, bool[3] output_mask, "
      "Tensor? x_kept=None, Tensor? weight_block=None, bool check_indices=True) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "masked_linear_grad_weight_(Tensor(a!) out, Tensor grad_out, Tensor x, Tensor? out_idx, Tensor? in_idx, "
      "bool grad_out_full, bool accumulate, bool check_indices=True) -> ()");
  // The owned weight / bias gradient for indices that are contiguous runs (ops.h): no gather.
  m.def(
      "masked_linear_grad_runs_(Tensor(a!)? weight_out, Tensor(b!)? bias_out, Tensor grad_out, Tensor x, "
      "int[] out_runs, int[] in_runs, bool accumulate) -> ()");
  m.def("pack_segments(Tensor[] tensors, Tensor segments, Tensor(a!) buffer) -> ()");
  m.def("unpack_average_(Tensor(a!)[] tensors, Tensor segments, Tensor buffer, Tensor scales) -> ()");
  // A segment table validated once for these tensors and this buffer (and, with scales, for
  // unpack_average_): (host_table uint8 CPU, device_table uint8 on the buffer's device, empty
  // on CPU). The tables bind the tensors' and the buffer's addresses (see ops.h).
  m.def("prepare_segments(Tensor[] tensors, Tensor segments, Tensor buffer, Tensor? scales) -> (Tensor, Tensor)");
  // pack_segments / unpack_average_ from a prepared table: no validation and no upload per
  // call, only an O(#tensors) host check that tensors and buffer are the prepared ones.
  m.def("pack_segments_prepared(Tensor[] tensors, Tensor host_table, Tensor device_table, Tensor(a!) buffer) -> ()");
  m.def(
      "unpack_average_prepared_(Tensor(a!)[] tensors, Tensor host_table, Tensor device_table, Tensor buffer) "
      "-> ()");
  // Segment tables validated so far in this process (tests: the prepared path validates none).
  m.def("segment_table_builds() -> int", &subnet_ext::segment_table_builds);
  // Tests: lower the CUDA index kernels' grid limit (ops.h); returns the previous one.
  m.def("_set_max_grid_blocks(int blocks) -> int", &subnet_ext::set_max_grid_blocks);
  // Tests: how many times the CUDA kernels took a path ("gather_rows_vector", ...; ops.h).
  m.def("_kernel_path_count(str path) -> int", &subnet_ext::kernel_path_count);
}

// The op schemas of the `subnet_ext` namespace, defined once. cpu/ and cuda/ register
// their kernels for their own dispatch key; subnet_ext/ops.py adds fake and autograd.
#include <torch/library.h>

TORCH_LIBRARY(subnet_ext, m) {
  m.def(
      "masked_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? out_idx, Tensor? in_idx, "
      "bool compact_weight, int scatter_width) -> Tensor");
  // As masked_linear, plus what backward would otherwise gather again: x_kept = x[..., S] as
  // [N, |S|] and weight_block = W[R][:, S] (each an empty [0] tensor when nothing was gathered).
  m.def(
      "masked_linear_forward(Tensor x, Tensor weight, Tensor? bias, Tensor? out_idx, Tensor? in_idx, "
      "bool compact_weight, int scatter_width) -> (Tensor, Tensor, Tensor)");
  m.def(
      "masked_linear_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor? out_idx, Tensor? in_idx, "
      "bool compact_weight, bool grad_out_full, bool dense_grad_input, bool[3] output_mask, "
      "Tensor? x_kept=None, Tensor? weight_block=None) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "masked_linear_grad_weight_(Tensor(a!) out, Tensor grad_out, Tensor x, Tensor? out_idx, Tensor? in_idx, "
      "bool grad_out_full, bool accumulate) -> ()");
  m.def("pack_segments(Tensor[] tensors, Tensor segments, Tensor(a!) buffer) -> ()");
  m.def("unpack_average_(Tensor(a!)[] tensors, Tensor segments, Tensor buffer, Tensor scales) -> ()");
}

"""Fake (meta) kernels of every `subnet_ext` op: output shapes only, for torch.compile,
FakeTensor tracing and `torch.library.opcheck`. Registered when this module is imported
(by registration.py); the shapes follow the schemas in csrc/registration.cpp.
"""
from __future__ import annotations

import math

import torch

from .build_info import load_library

load_library()  # the schemas must exist before Python adds kernels to them


def _kept(idx, full):
    return full if idx is None else idx.shape[0]


@torch.library.register_fake("subnet_ext::masked_linear")
def _masked_linear_fake(x, weight, bias, out_idx, in_idx, compact_weight, scatter_width, check_indices=True):
    torch._check(weight.dim() == 2, lambda: "subnet_ext.masked_linear: weight must be 2-D")
    kept_out = weight.shape[0] if compact_weight else _kept(out_idx, weight.shape[0])
    width = kept_out if scatter_width < 0 else scatter_width
    return x.new_empty((*x.shape[:-1], width))


@torch.library.register_fake("subnet_ext::masked_linear_forward")
def _masked_linear_forward_fake(x, weight, bias, out_idx, in_idx, compact_weight, scatter_width, check_indices=True):
    y = _masked_linear_fake(x, weight, bias, out_idx, in_idx, compact_weight, scatter_width)
    x_kept = x.new_empty((math.prod(x.shape[:-1]), in_idx.shape[0])) if in_idx is not None else x.new_empty(0)
    gathered = not compact_weight and (out_idx is not None or in_idx is not None)
    block = (x.new_empty((_kept(out_idx, weight.shape[0]), _kept(in_idx, weight.shape[1]))) if gathered
             else x.new_empty(0))
    return y, x_kept, block


@torch.library.register_fake("subnet_ext::masked_linear_backward")
def _masked_linear_backward_fake(
    grad_out, x, weight, out_idx, in_idx, compact_weight, grad_out_full, dense_grad_input, output_mask,
    x_kept=None, weight_block=None, check_indices=True,
):
    kept_out = weight.shape[0] if compact_weight else _kept(out_idx, weight.shape[0])
    kept_in = weight.shape[1] if compact_weight else _kept(in_idx, weight.shape[1])
    return (
        x.new_empty(x.shape) if output_mask[0] else x.new_empty(0),
        x.new_empty((kept_out, kept_in)) if output_mask[1] else x.new_empty(0),
        x.new_empty((kept_out,)) if output_mask[2] else x.new_empty(0),
    )


@torch.library.register_fake("subnet_ext::masked_linear_grad_weight_")
def _masked_linear_grad_weight_fake(out, grad_out, x, out_idx, in_idx, grad_out_full, accumulate,
                                    check_indices=True):
    return None


@torch.library.register_fake("subnet_ext::masked_linear_grad_runs_")
def _masked_linear_grad_runs_fake(weight_out, bias_out, grad_out, x, out_runs, in_runs, accumulate):
    return None


@torch.library.register_fake("subnet_ext::pack_segments")
def _pack_segments_fake(tensors, segments, buffer):
    return None


@torch.library.register_fake("subnet_ext::unpack_average_")
def _unpack_average_fake(tensors, segments, buffer, scales):
    return None


@torch.library.register_fake("subnet_ext::prepare_segments")
def _prepare_segments_fake(tensors, segments, buffer, scales):
    ctx = torch.library.get_ctx()
    host = segments.new_empty((ctx.new_dynamic_size(),), dtype=torch.uint8)
    return host, buffer.new_empty((ctx.new_dynamic_size(),), dtype=torch.uint8)


@torch.library.register_fake("subnet_ext::pack_segments_prepared")
def _pack_segments_prepared_fake(tensors, host_table, device_table, buffer):
    return None


@torch.library.register_fake("subnet_ext::unpack_average_prepared_")
def _unpack_average_prepared_fake(tensors, host_table, device_table, buffer):
    return None

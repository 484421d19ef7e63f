"""Backward regime: the Conv2d layer (`OwnedConv2d`, a stand-in swapped in for the user's,
module_swaps.py) that computes the weight gradient of its owned channels only.

The forward is the full convolution (the backward regime runs the full model). The
backward computes the dense input gradient from the full weight, and the weight
gradient only for the owned runs of channels, each with one weight-only
`convolution_backward`:
  - output-channel runs (dim 0, e.g. a ResNet block's producer conv1):
    grad_weight[s:s+l] = conv2d_weight(x, [l, C_in, kh, kw], grad_y[:, s:s+l]);
  - input-channel runs (dim 1, the consumer conv2):
    grad_weight[:, s:s+l] = conv2d_weight(x[:, s:s+l], [C_out, l, kh, kw], grad_y).
So the weight-gradient FLOPs are the owned fraction of the full layer's, where the
generic path (a concatenation of detached and owned slices) computes the whole
gradient and keeps the owned slices.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.grad import conv2d_input, conv2d_weight

from .owned_slices import OwnedLayer


@dataclass(frozen=True)
class OwnedConvInputs:
    """What `_OwnedConv2dFunction` needs besides its tensors: the convolution's
    (stride, padding, dilation, groups), and the owned runs [(start, length)] of the weight
    along dim (0: output channels, 1: input channels), in the order of the views."""
    conv_args: tuple
    dim: int
    runs: tuple


class _OwnedConv2dFunction(torch.autograd.Function):
    """y = conv2d(x, W_full, b); gradients: dense grad_x, grad_b when b is a parameter,
    and one gradient per owned run (`views`, in `inputs.runs` order) of W along `inputs.dim`.

    Shapes: x [B, C_in, H, W]; W_full [C_out, C_in, kh, kw]; y [B, C_out, H', W']."""

    @staticmethod
    def forward(ctx, x, weight, bias, inputs: OwnedConvInputs, *views):
        ctx.save_for_backward(x, weight)
        ctx.inputs = inputs
        ctx.bias_is_param = bias is not None and bias.requires_grad
        return F.conv2d(x, weight, bias, *inputs.conv_args)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        inputs = ctx.inputs
        stride, padding, dilation, groups = inputs.conv_args
        grad_x = conv2d_input(x.shape, weight, grad_y, stride, padding, dilation, groups) \
            if ctx.needs_input_grad[0] else None
        grads = []
        for start, length in inputs.runs:
            if inputs.dim == 0:
                shape = (length,) + tuple(weight.shape[1:])
                g = conv2d_weight(x, shape, grad_y.narrow(1, start, length), stride, padding, dilation, groups)
            else:
                shape = (weight.shape[0], length) + tuple(weight.shape[2:])
                g = conv2d_weight(x.narrow(1, start, length), shape, grad_y, stride, padding, dilation, groups)
            grads.append(g)
        grad_bias = grad_y.sum((0, 2, 3)) if ctx.bias_is_param else None
        return (grad_x, None, grad_bias, None, *grads)


def conv_can_be_owned(module: nn.Module, sliced) -> bool:
    """True for a plain nn.Conv2d (zero padding given as numbers, one group) whose only sliced
    tensor is its weight (a bias, if any, held whole); other layers keep the generic path."""
    if type(module) is not nn.Conv2d or set(sliced) != {"weight"}:
        return False
    return module.padding_mode == "zeros" and not isinstance(module.padding, str) and module.groups == 1


class OwnedConv2d(OwnedLayer):
    """The backward regime's stand-in for a sliced nn.Conv2d (module docstring): holds
    `weight_full` [C_out, C_in, kh, kw] with its owned views `weight_owned{i}` and the user's
    bias Parameter (or None). x [B, C_in, H, W] -> y [B, C_out, H', W'], the user's layer's output."""

    def __init__(self, original: nn.Conv2d, sliced):
        super().__init__(original, sliced)
        for attr in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
                     "padding_mode"):
            setattr(self, attr, getattr(original, attr))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The full convolution; the backward computes the owned runs' weight gradients only."""
        inputs = OwnedConvInputs(conv_args=(self.stride, self.padding, self.dilation, self.groups),
                                 dim=self.dims["weight"],
                                 runs=tuple((r.start, r.length) for r in self.runs["weight"]))
        return _OwnedConv2dFunction.apply(x, self.weight_full, self.bias, inputs, *self.views("weight"))

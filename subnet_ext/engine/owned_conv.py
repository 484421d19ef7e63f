"""Backward regime: a Conv2d that computes the weight gradient of its owned channels only.

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

import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.grad import conv2d_input, conv2d_weight


class _OwnedConv2dFunction(torch.autograd.Function):
    """y = conv2d(x, W_full, b); gradients: dense grad_x, grad_b when b is a parameter,
    and one gradient per owned run (`views`, in `runs` order) of W along `dim`.

    Shapes: x [B, C_in, H, W]; W_full [C_out, C_in, kh, kw]; y [B, C_out, H', W'];
    runs [(start, length), ...] along dim (0: output channels, 1: input channels)."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv_args, dim, runs, *views):
        ctx.save_for_backward(x, weight)
        ctx.conv_args, ctx.dim, ctx.runs = conv_args, dim, runs
        ctx.bias_is_param = bias is not None and bias.requires_grad
        return F.conv2d(x, weight, bias, *conv_args)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conv_args
        grad_x = conv2d_input(x.shape, weight, grad_y, stride, padding, dilation, groups) \
            if ctx.needs_input_grad[0] else None
        grads = []
        for start, length in ctx.runs:
            if ctx.dim == 0:
                shape = (length,) + tuple(weight.shape[1:])
                g = conv2d_weight(x, shape, grad_y.narrow(1, start, length), stride, padding, dilation, groups)
            else:
                shape = (weight.shape[0], length) + tuple(weight.shape[2:])
                g = conv2d_weight(x.narrow(1, start, length), shape, grad_y, stride, padding, dilation, groups)
            grads.append(g)
        grad_bias = grad_y.sum((0, 2, 3)) if ctx.bias_is_param else None
        return (grad_x, None, grad_bias, None, None, None, *grads)


def _owned_conv_forward(module, x):
    views = [getattr(module, name) for _, _, name in module._sdp_conv_runs]
    runs = [(start, length) for start, length, _ in module._sdp_conv_runs]
    conv_args = (module.stride, module.padding, module.dilation, module.groups)
    return _OwnedConv2dFunction.apply(x, module.weight_full, module.bias, conv_args, module._sdp_conv_dim,
                                      runs, *views)


def install_owned_conv(module: nn.Module, attrs: dict) -> bool:
    """Give a backward-regime Conv2d the owned-weight-gradient forward, when it applies.

    Args:
        module: the layer, after prepare_backward moved `weight` to `weight_full`.
        attrs: {attribute: (dim, [(start, length, view name), ...])}, the owned runs.
    Returns:
        True if installed: a plain nn.Conv2d (zero padding given as numbers, one group)
        whose only sliced tensor is its weight (a bias, if any, held whole). Otherwise
        False and the caller keeps the generic path.
    """
    if type(module) is not nn.Conv2d or set(attrs) != {"weight"}:
        return False
    if module.padding_mode != "zeros" or isinstance(module.padding, str) or module.groups != 1:
        return False
    dim, runs = attrs["weight"]
    if not runs:
        return False
    module._sdp_conv_dim, module._sdp_conv_runs = dim, list(runs)
    module.forward = types.MethodType(_owned_conv_forward, module)
    return True

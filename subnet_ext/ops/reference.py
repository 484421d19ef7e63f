"""Pure-PyTorch references of every op, with the same signatures as `subnet_ext.ops`.

Written for clarity, not speed: the tests compare the kernels against these, and the
engine's semantics are defined by them. Half types are computed in fp32 and rounded once.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`[*, w]` as `[N, w]`, N the product of the leading sizes (reshape(-1, 0) is ambiguous)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _all(n: int, device) -> torch.Tensor:
    return torch.arange(n, device=device)


def _block(weight, out_idx, in_idx, compact_weight):
    if compact_weight:
        return weight
    w = weight if out_idx is None else weight[out_idx]
    return w if in_idx is None else w[:, in_idx]


def masked_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_idx: Optional[torch.Tensor] = None,
    in_idx: Optional[torch.Tensor] = None,
    *,
    compact_weight: bool = False,
    scatter_width: Optional[int] = None,
) -> torch.Tensor:
    """Reference of `ops.masked_linear`: `[*, |R|]` or `[*, scatter_width]`."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xs = x if in_idx is None else x[..., in_idx]
    w = _block(weight, out_idx, in_idx, compact_weight)
    y = xs.to(acc) @ w.to(acc).t()
    if bias is not None:
        b = bias if (compact_weight or out_idx is None) else bias[out_idx]
        y = y + b.to(acc)
    y = y.to(x.dtype)
    if scatter_width is None or out_idx is None:
        return y
    full = y.new_zeros((*x.shape[:-1], scatter_width))
    full[..., out_idx] = y
    return full


def masked_linear_forward(x, weight, bias=None, out_idx=None, in_idx=None, *, compact_weight=False,
                          scatter_width=None):
    """Reference of the `masked_linear_forward` op: `(y, x_kept [N, |S|] | [0], W_RS | [0])`."""
    y = masked_linear(x, weight, bias, out_idx, in_idx, compact_weight=compact_weight, scatter_width=scatter_width)
    x_kept = _rows(x)[:, in_idx] if in_idx is not None else x.new_empty(0)
    gathered = not compact_weight and (out_idx is not None or in_idx is not None)
    block = _block(weight, out_idx, in_idx, False) if gathered else x.new_empty(0)
    return y, x_kept, block


def _backward_operands(grad_out, x, out_idx, in_idx, grad_out_full):
    """`(accumulation dtype, g [N, W], x2 [N, I_x], g_R [N, |R|], x_S [N, |S|])` in that dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    g = _rows(grad_out).to(acc)
    x2 = _rows(x).to(acc)
    g_kept = g[:, out_idx] if (grad_out_full and out_idx is not None) else g
    xs = x2 if in_idx is None else x2[:, in_idx]
    return acc, g, x2, g_kept, xs


def masked_linear_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    out_idx: Optional[torch.Tensor] = None,
    in_idx: Optional[torch.Tensor] = None,
    *,
    compact_weight: bool = False,
    grad_out_full: bool = False,
    dense_grad_input: bool = False,
    output_mask: Sequence[bool] = (True, True, True),
):
    """Reference of `ops.masked_linear_backward`: (grad_x, compact grad_weight, grad_bias)."""
    acc, g, x2, g_kept, xs = _backward_operands(grad_out, x, out_idx, in_idx, grad_out_full)
    w = _block(weight, out_idx, in_idx, compact_weight).to(acc)
    gx = gw = gb = None
    if output_mask[0]:
        if dense_grad_input:
            gx = g @ weight.to(acc)
        else:
            gxs = g_kept @ w
            gx = gxs if in_idx is None else x2.new_zeros(x2.shape).index_copy_(1, in_idx, gxs)
        gx = gx.reshape(x.shape).to(x.dtype)
    if output_mask[1]:
        gw = (g_kept.t() @ xs).to(x.dtype)
    if output_mask[2]:
        gb = g_kept.sum(0).to(x.dtype)
    return gx, gw, gb


def masked_linear_grad_weight_(out, grad_out, x, out_idx=None, in_idx=None, *, grad_out_full=False, accumulate=False):
    """Reference of `ops.masked_linear_grad_weight_` (in place on out)."""
    acc, _, _, g_kept, xs = _backward_operands(grad_out, x, out_idx, in_idx, grad_out_full)
    block = g_kept.t() @ xs
    if accumulate:
        block = block + out.to(acc)
    out.copy_(block.to(out.dtype))


def runs_index(runs, width: int, device) -> torch.Tensor:
    """The indices `[start, start + length)` of each run, in order (no runs: all of `width`)."""
    if not runs:
        return _all(width, device)
    return torch.cat([torch.arange(start, start + length, device=device) for start, length in runs])


def masked_linear_grad_runs_(weight_out, bias_out, grad_out, x, out_runs=(), in_runs=(), *, accumulate=False):
    """Reference of `ops.masked_linear_grad_runs_` (in place on weight_out and bias_out)."""
    out_idx = runs_index(out_runs, grad_out.shape[-1], x.device)
    in_idx = runs_index(in_runs, x.shape[-1], x.device)
    acc, _, _, g_kept, xs = _backward_operands(grad_out, x, out_idx, in_idx, True)
    for out, value in ((weight_out, g_kept.t() @ xs), (bias_out, g_kept.sum(0))):
        if out is not None:
            out.copy_((value + out.to(acc) if accumulate else value).to(out.dtype))


def as_2d(t: torch.Tensor, view: bool = False) -> torch.Tensor:
    """The [size(0), numel // size(0)] view packing uses ([n] → [n, 1], scalar → [1, 1]).

    view=True: raise ValueError unless `t` is contiguous, so the result is a view that
    writes reach `t` through (otherwise a non-contiguous tensor gives a copy)."""
    if view and not t.is_contiguous():
        raise ValueError(f"expected a contiguous tensor, got shape {tuple(t.shape)} strides {t.stride()}")
    if t.dim() == 0:
        return t.reshape(1, 1)
    # Explicit column count: reshape(0, -1) is ambiguous for a tensor with no rows.
    return t.reshape(t.shape[0], math.prod(t.shape[1:])) if t.dim() > 1 else t.reshape(-1, 1)


def pack_segments(tensors, segments, buffer=None):
    """Reference of `ops.pack_segments`."""
    if buffer is None:
        sizes = (segments[:, 2] - segments[:, 1]) * (segments[:, 4] - segments[:, 3])
        n = int((segments[:, 5] + sizes).max()) if len(segments) else 0
        buffer = tensors[0].new_zeros(n)
    for t, r0, r1, c0, c1, off in segments.tolist():
        block = as_2d(tensors[t])[r0:r1, c0:c1].reshape(-1)
        buffer[off : off + block.numel()] = block
    return buffer


def unpack_average_(tensors, segments, buffer, scales):
    """Reference of `ops.unpack_average_`."""
    scales = [float(s) for s in (scales.tolist() if isinstance(scales, torch.Tensor) else scales)]
    for (t, r0, r1, c0, c1, off), scale in zip(segments.tolist(), scales):
        view = as_2d(tensors[t])
        n = (r1 - r0) * (c1 - c0)
        acc = torch.float64 if buffer.dtype == torch.float64 else torch.float32
        block = buffer[off : off + n].to(acc) * torch.tensor(scale, dtype=acc)
        view[r0:r1, c0:c1] = block.reshape(r1 - r0, c1 - c0).to(view.dtype)

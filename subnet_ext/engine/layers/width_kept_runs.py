"""The run path of a width-kept projection (width_keeping.py): owned heads as contiguous runs.

A rank owns whole heads, so a width-kept producer's owned rows and a consumer's owned input
columns are a few runs of head_dim (or more) consecutive indices, not scattered ones. Then
nothing needs gathering or scattering index by index: each run is a narrow view, and

- producer (`x [N, in] -> y [N, width]`): one GEMM per run writes its output columns straight
  into its column slice of y (cuBLAS and the CPU BLAS take the slice through its leading
  dimension), and only the columns of unowned heads are zeroed;
- consumer (`x [N, width] -> y [N, out]`): one GEMM per run reads its column slice of x and
  accumulates into y;
- backward: grad_x by the same GEMMs the other way (a producer's accumulates over the runs, a
  consumer's writes each run's columns and zeroes the rest); the compact weight's and bias's
  gradient by `ops.masked_linear_grad_runs_` (one GEMM per run on strided views, no gather).

Under autocast the operands run (and are saved) in autocast's dtype, as nn.Linear's are.
The masked op (gathers and scatters by index) stays the path for indices that are not runs.
"""
from __future__ import annotations

import torch

from ... import ops
from ...ops.autocast import autocast_dtype, cast_to

# Below this mean run length (indices per run) the masked op's index kernels do better
# than one GEMM per run (single heads are runs of head_dim, 64 or 128 in LLaMA models).
MIN_MEAN_RUN = 8


def index_runs(index: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, length)] of the maximal runs of consecutive values of a 1-D index, in its order
    (one read of the index to the host: call it once, at wrap time)."""
    runs: list[tuple[int, int]] = []
    for v in index.tolist():
        if runs and v == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((v, 1))
    return runs


def runs_worth_it(runs: list[tuple[int, int]]) -> bool:
    """True when the run path beats the index kernels: some runs, MIN_MEAN_RUN indices each on average."""
    return bool(runs) and sum(n for _, n in runs) >= MIN_MEAN_RUN * len(runs)


def _gaps(runs, width: int) -> list[tuple[int, int]]:
    """[(start, length)] of the columns of [0, width) outside the runs."""
    out, at = [], 0
    for start, length in sorted(runs):
        if start > at:
            out.append((at, start - at))
        at = start + length
    return out + ([(at, width - at)] if at < width else [])


class WidthKeptRuns(torch.autograd.Function):
    """Producer (width given): x [..., in], compact weight [kept, in], bias [kept] | None ->
    y [..., width], the kept outputs at the runs' columns, zeros elsewhere. Consumer (width
    None): x [..., width], compact weight [out, kept], bias [out] | None -> y [..., out] from
    the runs' columns of x. runs: [(start, length)] in the compact weight's order."""

    @staticmethod
    def forward(ctx, x, weight, bias, runs, width):
        """y from the runs' GEMMs (class docstring); under autocast in autocast's dtype."""
        dtype = autocast_dtype(weight)
        x, weight, bias = cast_to(x, dtype), cast_to(weight, dtype), cast_to(bias, dtype)
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.runs, ctx.width, ctx.x_shape, ctx.has_bias = runs, width, x.shape, bias is not None
        if width is not None:
            y = x2.new_empty((x2.shape[0], width))
            for start, length in _gaps(runs, width):
                y.narrow(1, start, length).zero_()
            at = 0
            for start, length in runs:
                out, w = y.narrow(1, start, length), weight.narrow(0, at, length)
                if bias is None:
                    torch.mm(x2, w.t(), out=out)
                else:
                    torch.addmm(bias.narrow(0, at, length), x2, w.t(), out=out)
                at += length
            return y.view(*x.shape[:-1], width)
        y, at = None, 0
        for start, length in runs:
            xs, w = x2.narrow(1, start, length), weight.narrow(1, at, length)
            if y is None:
                y = torch.mm(xs, w.t()) if bias is None else torch.addmm(bias, xs, w.t())
            else:
                y.addmm_(xs, w.t())
            at += length
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        """(grad_x [..., in or width], grad_weight (compact), grad_bias, None, None) for grad_y [..., width or out]."""
        x2, weight = ctx.saved_tensors
        runs, width = ctx.runs, ctx.width
        g2 = grad_y.reshape(-1, grad_y.shape[-1]).contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x, at = g2.new_empty(x2.shape), 0
            if width is None:  # consumer: each run's input columns, zeros elsewhere
                for start, length in _gaps(runs, x2.shape[1]):
                    grad_x.narrow(1, start, length).zero_()
            for i, (start, length) in enumerate(runs):
                if width is not None:  # producer: every run adds its rows' share
                    g, w = g2.narrow(1, start, length), weight.narrow(0, at, length)
                    if i == 0:
                        torch.mm(g, w, out=grad_x)
                    else:
                        grad_x.addmm_(g, w)
                else:
                    torch.mm(g2, weight.narrow(1, at, length), out=grad_x.narrow(1, start, length))
                at += length
            grad_x = grad_x.view(ctx.x_shape)
        out_runs, in_runs = (runs, []) if width is not None else ([], runs)
        if ctx.needs_input_grad[1]:
            grad_w = g2.new_empty(weight.shape)
        if ctx.needs_input_grad[2] and ctx.has_bias:
            grad_b = g2.new_empty(weight.shape[0])
        if grad_w is not None or (grad_b is not None and width is not None):
            ops.masked_linear_grad_runs_(grad_w, grad_b if width is not None else None, g2, x2, out_runs, in_runs)
        if grad_b is not None and width is None:
            torch.sum(g2, 0, out=grad_b)
        return grad_x, grad_w, grad_b, None, None

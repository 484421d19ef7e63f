"""Backward regime: the Linear layer that trains only this rank's owned runs.

`OwnedLinear` stands in for a sliced nn.Linear (module_swaps.py). Its forward is the full
layer, y = x W^T + b; its backward gives the dense input gradient but the weight (and bias)
gradient only for the owned runs of rows or columns, by the masked linear's formulas:
`ops.masked_linear_backward` for grad_x, `ops.masked_linear_grad_runs_` (strided views into
the GEMM: the owned indices are runs, so nothing is gathered) for each owned run. A run
with a `DirectGradient` has its weight gradient written straight into its communication
bucket instead of returned to autograd.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from ... import ops
from ...ops.autocast import autocast_dtype, cast_to
from ...comm.averaging import set_grad
from ...planning.pieces import Piece
from .owned_slices import OwnedLayer


class DirectGradient:
    """Where the masked kernel writes one owned run's weight gradient: a view of the
    run's place in its communication bucket, which becomes the run's `.grad` (so it is
    never packed); `ready(piece)` tells the engine the gradient is final."""

    def __init__(self, param: nn.Parameter, view: torch.Tensor, piece: Piece, ready):
        self.param, self.view, self.piece, self.ready = param, view.view(param.shape), piece, ready

    def write(self, g2: torch.Tensor, x2: torch.Tensor, out_runs, in_runs, last_use: bool = True) -> None:
        """Add one use's weight gradient into the bucket view, by the masked linear's gradient
        formula on runs (`ops.masked_linear_grad_runs_`: strided views into the GEMM, no
        gather, no host sync); readiness is reported only after the last use of this
        forward (weight sharing).

        g2 [N, out] and x2 [N, in] are the layer's output gradient and input; out_runs /
        in_runs the run's [(start, length)] (the other empty: every column). Under autocast
        g2 and x2 are fp16/bf16 and the bucket fp32: the formula multiplies them with fp32
        output and accumulation, with no fp32 copy of g2 or x2."""
        grad = self.param.grad
        if grad is not None and grad.data_ptr() != self.view.data_ptr():
            self.view.copy_(grad)  # a gradient put there by someone else: keep accumulating onto it
        mixed = x2.dtype in (torch.float16, torch.bfloat16) and self.view.dtype == torch.float32
        if x2.dtype != self.view.dtype and not mixed:  # any other pairing: the bucket's dtype
            g2, x2 = g2.to(self.view.dtype), x2.to(self.view.dtype)
        ops.masked_linear_grad_runs_(self.view, None, g2, x2, out_runs, in_runs, accumulate=grad is not None)
        set_grad(self.param, self.view)
        if last_use:
            self.ready(self.piece)


class _UseCount:
    """How many times one forward called an OwnedLinear (`uses`) and how many of those
    calls' backwards have run (`done`). Shared by the calls' autograd contexts and held
    by the layer only weakly, so a graph dropped without a backward takes its count
    with it and the next forward starts a fresh one."""

    __slots__ = ("uses", "done", "__weakref__")

    def __init__(self):
        self.uses, self.done = 0, 0

    def backward_ran(self) -> bool:
        """Count one use's backward; True when it was the last (the gradient is final)."""
        self.done += 1
        if self.done < self.uses:
            return False
        self.done = 0  # a retained graph may be backpropagated again
        return True


@dataclass(frozen=True)
class OwnedLinearInputs:
    """What `_OwnedLinearFunction` needs besides its tensors.

    dim: 0 (the owned runs are rows, output features) or 1 (columns, input features);
    runs: the owned runs [(start, length)] along dim, in the order of the weight views;
    direct: per run, a DirectGradient (written into its bucket) or None (returned to autograd);
    sliced_bias: the bias is sliced too (dim 0): one bias view per run follows the weight views;
    use_count: this forward's use count of the layer (None outside grad mode)."""
    dim: int
    runs: tuple
    direct: tuple
    sliced_bias: bool
    use_count: _UseCount | None


class _OwnedLinearFunction(torch.autograd.Function):
    """y = x W^T + b with the full W [out, in]; x [..., in], y [..., out]. Backward: grad_x
    dense, then one gradient per owned weight view [run length, in] or [out, run length],
    then (sliced_bias) one per bias view [run length]; an unsliced bias Parameter gets [out]."""

    @staticmethod
    def forward(ctx, x, weight, bias, inputs: OwnedLinearInputs, *views):
        # Under autocast run (and save) the operands in autocast's dtype, as nn.Linear does,
        # so the backward's operands share one dtype; autograd casts the gradients back.
        ctx.bias_is_param = bias is not None and bias.requires_grad  # before the cast (a non-leaf copy)
        dtype = autocast_dtype(weight)
        x, weight, bias = cast_to(x, dtype), cast_to(weight, dtype), cast_to(bias, dtype)
        ctx.save_for_backward(x, weight)
        ctx.inputs = inputs
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        inputs = ctx.inputs
        g2 = grad_y.reshape(-1, grad_y.shape[-1]).contiguous()
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        # A Linear called several times per forward (weight sharing) sums its uses' gradients
        # in the bucket; the bucket may be issued only after the last use's backward.
        last_use = inputs.use_count is None or inputs.use_count.backward_ran()
        grad_x = None
        if ctx.needs_input_grad[0]:
            gx = ops.masked_linear_backward(g2, x2, weight, dense_grad_input=True, output_mask=(True, False, False),
                                            check_indices=False)[0]
            grad_x = gx.reshape(x.shape)
        grads = []
        for d, run in zip(inputs.direct, inputs.runs):
            out_runs, in_runs = ([run], []) if inputs.dim == 0 else ([], [run])
            if d is not None:
                d.write(g2, x2, out_runs, in_runs, last_use)
                grads.append(None)
            else:
                gw = g2.new_empty((run[1], x2.shape[1]) if inputs.dim == 0 else (g2.shape[1], run[1]))
                ops.masked_linear_grad_runs_(gw, None, g2, x2, out_runs, in_runs)
                grads.append(gw)
        if inputs.sliced_bias:
            for run in inputs.runs:
                gb = g2.new_empty(run[1])
                ops.masked_linear_grad_runs_(None, gb, g2, x2, [run])
                grads.append(gb)
        grad_bias = None
        if ctx.bias_is_param:  # an unsliced bias: every output's sum
            grad_bias = g2.new_empty(g2.shape[1])
            ops.masked_linear_grad_runs_(None, grad_bias, g2, x2)
        return (grad_x, None, grad_bias, None, *grads)


class OwnedLinear(OwnedLayer):
    """The backward regime's stand-in for a sliced nn.Linear (module docstring): holds
    `weight_full` [out, in] with its owned views `weight_owned{i}`, and the bias either whole
    (the user's Parameter `bias`) or, rows sliced, as `bias_full` with views `bias_owned{i}`.
    `direct[i]` is set by the engine (attach_direct_gradients) for run i.

    x [..., in_features] -> y [..., out_features], equal to the user's layer's output."""

    def __init__(self, original: nn.Linear, sliced):
        super().__init__(original, sliced)
        self.in_features, self.out_features = original.in_features, original.out_features
        self.direct: list[DirectGradient | None] = []
        self._use_count_ref = None  # weakref to this forward's _UseCount

    def own(self, leaf: str, full: torch.Tensor, dim: int, owned: list[Piece], piece_params: dict) -> None:
        """OwnedLayer.own; the weight's runs start without a direct gradient (returned to autograd)."""
        super().own(leaf, full, dim, owned, piece_params)
        if leaf == "weight":
            self.direct = [None] * len(self.runs["weight"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The full layer's output; the backward trains the owned runs only."""
        runs = self.runs["weight"]
        sliced_bias = "bias" in self.runs
        inputs = OwnedLinearInputs(dim=self.dims["weight"], runs=tuple((r.start, r.length) for r in runs),
                                   direct=tuple(self.direct), sliced_bias=sliced_bias, use_count=self._use_count())
        bias = self.bias_full if sliced_bias else self.bias
        return _OwnedLinearFunction.apply(x, self.weight_full, bias, inputs, *self.views("weight"),
                                          *self.views("bias"))

    def _use_count(self) -> _UseCount | None:
        """This forward's use count (grad mode only: no backward follows otherwise)."""
        if not torch.is_grad_enabled():
            return None
        count = self._use_count_ref() if self._use_count_ref is not None else None
        if count is None or count.done > 0:  # none alive, or its backward began: a new forward
            count = _UseCount()
            self._use_count_ref = weakref.ref(count)
        count.uses += 1
        return count

    def extra_repr(self) -> str:
        """Features and the owned runs, for repr()."""
        runs = [(r.start, r.length) for r in self.runs["weight"]]
        return f"in_features={self.in_features}, out_features={self.out_features}, dim={self.dims['weight']}, " \
               f"owned_runs={runs}"


def attach_direct_gradients(model: nn.Module, piece_params: dict, averager) -> int:
    """Backward regime: route the owned weight runs of OwnedLinear layers straight into their
    communication buckets (the averager's direct_gradient_view); each run, once written, reports
    itself ready to the averager (report_directly). Returns how many runs."""
    by_param = {id(param): piece for piece, param in piece_params.items()}
    count = 0
    for module in model.modules():
        if not isinstance(module, OwnedLinear):
            continue
        direct = []
        for param in module.views("weight"):
            piece = by_param.get(id(param))
            view = averager.direct_gradient_view(piece, param.numel()) if piece is not None else None
            direct.append(DirectGradient(param, view, piece, averager.report_directly(piece))
                          if view is not None else None)
        module.direct = direct
        count += sum(d is not None for d in direct)
    return count

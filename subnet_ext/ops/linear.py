"""Typed wrappers of the masked-linear kernels (csrc/masked_linear.cpp).

`masked_linear_backward` is the one gradient formula of the masked linear: it is the
registered autograd backward of masked_linear (registered below, see registration.py),
and the backward regime's owned Linear layers (engine/regimes/surgery.py) compute their input and
owned weight gradients by calling it, the latter written straight into a communication
bucket (`grad_weight_out`). Notation: see the package docstring (W [O, I], R = out_idx,
S = in_idx).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import registration  # loads the library; fake kernels, autocast

_ops = torch.ops.subnet_ext
_HALF = (torch.float16, torch.bfloat16)


def masked_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_idx: Optional[torch.Tensor] = None,
    in_idx: Optional[torch.Tensor] = None,
    *,
    compact_weight: bool = False,
    scatter_width: Optional[int] = None,
    check_indices: bool = True,
) -> torch.Tensor:
    """y = x[..., S] @ W[R][:, S]^T + b[R]; differentiable in x, weight and bias.

    When a gradient is needed, the gathered `x[..., S]` (`[N, |S|]`) and, for a full weight
    with indices, `W[R][:, S]` (`[|R|, |S|]`) are kept for the backward instead of being
    gathered again (time for memory: `f·|x|` and `f²·|W|` more saved tensors).

    Args:
        x: `[*, I_x]`. I_x = I for a full weight; for a compact weight, any width S indexes.
        weight: [O, I] full, or `[|R|, |S|]` when compact_weight.
        bias: [O] for a full weight, `[|R|]` for a compact one; optional.
        out_idx, in_idx: R and S (int64, distinct).
        scatter_width: None → output `[*, |R|]`; an int W → output `[*, W]` with the kept
            outputs at columns R and zeros elsewhere.
        check_indices: True validates the index values (in range, distinct; on CUDA one
            device sync per call). False checks dtype/dim/device and, on CPU, the range
            (one pass, a ValueError); on CUDA an index out of range trips a device assert
            (the CUDA context is lost). The CALLER GUARANTEES distinct, in-range indices
            (the engine, whose plan validated them once), and the forward and its backward
            then never synchronise (CUDA-graph capturable).
    Returns:
        `[*, |R|]` or `[*, scatter_width]`, dtype of x.
    """
    width = -1 if scatter_width is None else int(scatter_width)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        # Training: the op that also returns the gathered operands, so backward reuses them
        # instead of gathering x[..., S] and W[R][:, S] a second time.
        return _ops.masked_linear_forward.default(
            x, weight, bias, out_idx, in_idx, compact_weight, width, check_indices
        )[0]
    return _ops.masked_linear.default(x, weight, bias, out_idx, in_idx, compact_weight, width, check_indices)


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
    x_kept: Optional[torch.Tensor] = None,
    weight_block: Optional[torch.Tensor] = None,
    check_indices: bool = True,
    grad_weight_out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
):
    """Gradients of the masked linear, weight gradient only for the owned block.

    grad_x = g_R @ W_RS placed at columns S (or g @ W, dense_grad_input), grad_weight =
    g_R^T @ x_S, grad_bias = Σ_rows g_R, where g_R = grad_out's columns R.

    Args:
        grad_out: `[*, |R|]`, or `[*, W]` full-width when grad_out_full (its columns R are used).
        x, weight, out_idx, in_idx, compact_weight: as in `masked_linear`.
        dense_grad_input: grad_x = grad_out @ W with the full weight and full grad_out
            (backward regime: the forward was the full layer, only weight gradients are
            masked). Otherwise grad_x = g_R @ W_RS placed at columns S, zeros elsewhere.
        output_mask: which of (grad_x, grad_weight, grad_bias) to compute.
        x_kept, weight_block: `x[..., S]` as `[N, |S|]` and `W[R][:, S]` as returned by
            `masked_linear_forward`; used instead of gathering them again (None or an
            empty [0] tensor: gather here).
        check_indices: as in `masked_linear` (False: the caller guarantees the indices).
        grad_weight_out: `[|R|, |S|]` (e.g. a view of a communication bucket): the weight
            gradient is written into it, in place, instead of into a new tensor, and it is
            returned as grad_weight. fp32 with fp16/bf16 operands: gathered in the half
            dtype and multiplied with fp32 output and accumulation (no fp32 copy of
            grad_out or x); any other dtype than the operands': they are cast to it. When
            it is the only gradient asked for, weight is neither read nor validated (the
            weight gradient does not depend on it).
        accumulate: with grad_weight_out, add to it instead of overwriting it.
    Returns:
        `(grad_x [*, I_x] | None, grad_weight [|R|, |S|] compact | None, grad_bias [|R|] | None)`.
    """
    into = grad_weight_out is not None and output_mask[1]
    mask = [output_mask[0], output_mask[1] and not into, output_mask[2]]
    gx = gw = gb = None
    if any(mask) or not into:  # with nothing asked, the op still validates the operands
        gx, gw, gb = _ops.masked_linear_backward.default(
            grad_out, x, weight, out_idx, in_idx, compact_weight, grad_out_full, dense_grad_input, mask,
            x_kept, weight_block, check_indices,
        )
    if into:
        mixed = x.dtype in _HALF and grad_weight_out.dtype == torch.float32
        if x.dtype != grad_weight_out.dtype and not mixed:  # any other pairing: the destination's dtype
            grad_out, x = grad_out.to(grad_weight_out.dtype), x.to(grad_weight_out.dtype)
        masked_linear_grad_weight_(grad_weight_out, grad_out, x, out_idx, in_idx, grad_out_full=grad_out_full,
                                   accumulate=accumulate, check_indices=check_indices)
        gw = grad_weight_out
    return tuple(t if keep else None for t, keep in zip((gx, gw, gb), output_mask))


def masked_linear_grad_weight_(
    out: torch.Tensor,
    grad_out: torch.Tensor,
    x: torch.Tensor,
    out_idx: Optional[torch.Tensor] = None,
    in_idx: Optional[torch.Tensor] = None,
    *,
    grad_out_full: bool = False,
    accumulate: bool = False,
    check_indices: bool = True,
) -> None:
    """`out (=|+=) g_R^T @ x_S`, in place: the owned weight-gradient block.

    Args:
        out: `[|R|, |S|]`; may be a view of a flat communication buffer
            (e.g. `flat[off:off + r * s].view(r, s)`). The dtype of grad_out and x, or
            float32 when they are fp16/bf16: the owned block is gathered in that dtype and
            multiplied with fp32 output and accumulation (no fp32 copy of grad_out or x).
        grad_out: `[*, |R|]`, or `[*, W]` when grad_out_full. x: `[*, I_x]`.
        accumulate: add to out instead of overwriting it.
        check_indices: as in `masked_linear` (False: the caller guarantees the indices).
    """
    _ops.masked_linear_grad_weight_.default(out, grad_out, x, out_idx, in_idx, grad_out_full, accumulate,
                                            check_indices)


def masked_linear_grad_runs_(
    weight_out: Optional[torch.Tensor],
    bias_out: Optional[torch.Tensor],
    grad_out: torch.Tensor,
    x: torch.Tensor,
    out_runs: Sequence[tuple[int, int]] = (),
    in_runs: Sequence[tuple[int, int]] = (),
    *,
    accumulate: bool = False,
) -> None:
    """The owned weight and bias gradient when R and S are unions of contiguous runs, in place:
    `weight_out (=|+=) g_R^T @ x_S`, `bias_out (=|+=) Σ_rows g_R`, with no gather: one GEMM per
    pair of runs on strided views of grad_out and x (cuBLAS reads them through their leading
    dimension). The engine's index sets are such runs (a rank owns runs of neurons, heads,
    channels); arbitrary indices take `masked_linear_grad_weight_`. Never synchronises.

    Args:
        weight_out: `[|R|, |S|]` or None; may be a view of a flat communication bucket. The
            operands' dtype, or float32 when they are fp16/bf16 (products and sums in fp32).
        bias_out: `[|R|]` or None; dtype as weight_out.
        grad_out: `[*, O]`, full width (R indexes its last dimension). x: `[*, I_x]`.
        out_runs, in_runs: `[(start, length), ...]` over grad_out's and x's last dimension,
            disjoint, in the order of the block's rows / columns; empty: every column.
        accumulate: add to the outputs instead of overwriting them.
    """
    flat = lambda runs: [v for run in runs for v in (int(run[0]), int(run[1]))]  # noqa: E731
    _ops.masked_linear_grad_runs_.default(weight_out, bias_out, grad_out, x, flat(out_runs), flat(in_runs),
                                          accumulate)


# The op's autograd backward is the formula above, the same one the engine calls.
registration.register_autograd(masked_linear_backward)

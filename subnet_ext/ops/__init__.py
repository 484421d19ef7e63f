"""Typed Python front end of the `subnet_ext` ops, their fake kernels and autograd.

Notation used throughout: a full linear layer has weight W [O, I]. `out_idx` = R (the
kept outputs) and `in_idx` = S (the kept inputs) are 1-D int64 tensors of distinct
indices on the operands' device; an absent index means "all". A weight is stored either
full [O, I] or compact [|R|, |S|] (`compact_weight=True`, the forward regime's storage).

Packed segments: every tensor is viewed 2-D as [size(0), numel // size(0)] (a 1-D tensor
[n] as [n, 1], a scalar as [1, 1]); a segment is a rectangle of one tensor, stored
row-major in a 1-D buffer. `segments` is an int64 CPU tensor [S, 6] with columns
(tensor_index, row_begin, row_end, col_begin, col_end, buffer_offset).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .build_info import load_library

load_library()  # the compiled library registers the kernels

__all__ = [
    "masked_linear",
    "masked_linear_backward",
    "masked_linear_grad_weight_",
    "segment_table",
    "PreparedSegments",
    "pack_segments",
    "unpack_average_",
]

_ops = torch.ops.subnet_ext


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

    When a gradient is needed, the gathered x[..., S] ([N, |S|]) and, for a full weight
    with indices, W[R][:, S] ([|R|, |S|]) are kept for the backward instead of being
    gathered again (time for memory: f·|x| and f²·|W| more saved tensors).

    Args:
        x: [*, I_x]. I_x = I for a full weight; for a compact weight, any width S indexes.
        weight: [O, I] full, or [|R|, |S|] when compact_weight.
        bias: [O] for a full weight, [|R|] for a compact one; optional.
        out_idx, in_idx: R and S (int64, distinct).
        scatter_width: None → output [*, |R|]; an int W → output [*, W] with the kept
            outputs at columns R and zeros elsewhere.
        check_indices: True validates the index values (in range, distinct; on CUDA one
            device sync per call). False checks dtype/dim/device and, on CPU, the range
            (one pass, a ValueError); on CUDA an index out of range trips a device assert
            (the CUDA context is lost). The CALLER GUARANTEES distinct, in-range indices
            (the engine, whose plan validated them once), and the forward and its backward
            then never synchronise (CUDA-graph capturable).
    Returns:
        [*, |R|] or [*, scatter_width], dtype of x.
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
):
    """Gradients of the masked linear, weight gradient only for the owned block.

    Args:
        grad_out: [*, |R|], or [*, W] full-width when grad_out_full (its columns R are used).
        x, weight, out_idx, in_idx, compact_weight: as in `masked_linear`.
        dense_grad_input: grad_x = grad_out @ W with the full weight and full grad_out
            (backward regime: the forward was the full layer, only weight gradients are
            masked). Otherwise grad_x = g_R @ W_RS placed at columns S, zeros elsewhere.
        output_mask: which of (grad_x, grad_weight, grad_bias) to compute.
        x_kept, weight_block: x[..., S] as [N, |S|] and W[R][:, S] as returned by
            `masked_linear_forward`; used instead of gathering them again (None or an
            empty [0] tensor: gather here).
        check_indices: as in `masked_linear` (False: the caller guarantees the indices).
    Returns:
        (grad_x [*, I_x] | None, grad_weight [|R|, |S|] compact | None, grad_bias [|R|] | None).
    """
    gx, gw, gb = _ops.masked_linear_backward.default(
        grad_out, x, weight, out_idx, in_idx, compact_weight, grad_out_full, dense_grad_input, list(output_mask),
        x_kept, weight_block, check_indices,
    )
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
    """out (=|+=) g_R^T @ x_S, in place: the owned weight-gradient block.

    Args:
        out: [|R|, |S|]; may be a view of a flat communication buffer
            (e.g. `flat[off:off + r * s].view(r, s)`). The dtype of grad_out and x, or
            float32 when they are fp16/bf16: the owned block is gathered in that dtype and
            multiplied with fp32 output and accumulation (no fp32 copy of grad_out or x).
        grad_out: [*, |R|], or [*, W] when grad_out_full. x: [*, I_x].
        accumulate: add to out instead of overwriting it.
        check_indices: as in `masked_linear` (False: the caller guarantees the indices).
    """
    _ops.masked_linear_grad_weight_.default(out, grad_out, x, out_idx, in_idx, grad_out_full, accumulate,
                                            check_indices)


def segment_table(rectangles: Sequence[Sequence[int]], start: int = 0, align: int = 1):
    """Segments for consecutive rectangles in a buffer.

    Args:
        rectangles: (tensor_index, row_begin, row_end, col_begin, col_end) each.
        start: buffer offset of the first rectangle.
        align: each rectangle starts at a multiple of this many elements (16 bytes //
            element size: the packing kernels' vector path); the gaps are never written.
    Returns:
        (segments int64 CPU [S, 6], end offset = where the last rectangle ends).
    """
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"segment_table: align must be an int >= 1 (elements), got {align!r}")
    rows = []
    offset = int(start)
    for rect in rectangles:
        if len(rect) != 5:
            raise ValueError(f"segment_table: a rectangle has 5 entries, got {tuple(rect)!r}")
        t, r0, r1, c0, c1 = (int(v) for v in rect)
        if r1 < r0 or c1 < c0:
            raise ValueError(f"segment_table: rectangle {tuple(rect)!r} has a negative extent")
        offset = -(-offset // align) * align
        rows.append((t, r0, r1, c0, c1, offset))
        offset += (r1 - r0) * (c1 - c0)
    table = torch.tensor(rows, dtype=torch.int64) if rows else torch.empty(0, 6, dtype=torch.int64)
    return table, offset


def _buffer_size(segments: torch.Tensor) -> int:
    if segments.numel() == 0:
        return 0
    sizes = (segments[:, 2] - segments[:, 1]) * (segments[:, 4] - segments[:, 3])
    return int((segments[:, 5] + sizes).max())


def _scales_tensor(scales) -> torch.Tensor:
    if isinstance(scales, torch.Tensor):
        return scales
    return torch.tensor([float(s) for s in scales], dtype=torch.float64)


class PreparedSegments:
    """A segment table validated once for fixed tensors and buffer, reused by every call.

    Pass it in place of `segments` to `pack_segments` / `unpack_average_`: the calls then
    skip the validation (sorting, overlap checks) and, on CUDA, the per-call table upload
    (no host-to-device copy, so a prepared call can be captured in a CUDA graph). Each call
    only checks on the host, in O(#tensors) and without a device sync, that it is given the
    tensors and buffer the table was prepared for (same addresses, shapes, dtype); other
    tensors or another buffer raise ValueError: prepare again for them.

    Changing `segments` (or a `scales` tensor) in place is noticed through the tensor's
    version counter and the table is prepared again at the next call, never served stale.

    Args:
        tensors: contiguous tensors of one dtype and device (as in `pack_segments`).
        segments: int64 CPU [S, 6] (see module docstring).
        buffer: the 1-D buffer every call will use.
        scales: None → the table serves `pack_segments` only; float CPU [S] or S floats →
            it also serves `unpack_average_` (validated for disjoint writes once).
    Attributes:
        preparations: how many times the table was validated (1 unless it changed).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], segments: torch.Tensor, buffer: torch.Tensor, scales=None):
        self.segments = segments
        self.scales = None if scales is None else _scales_tensor(scales)
        self.preparations = 0
        self._prepare(tensors, buffer)

    def _versions(self):
        return self.segments._version, None if self.scales is None else self.scales._version

    def _prepare(self, tensors, buffer):
        self.host_table, self.device_table = _ops.prepare_segments.default(
            list(tensors), self.segments, buffer, self.scales
        )
        self._prepared_versions = self._versions()
        self.preparations += 1

    def tables(self, tensors: Sequence[torch.Tensor], buffer: torch.Tensor):
        """(host_table, device_table) for the prepared ops, prepared again if the table changed."""
        if self._versions() != self._prepared_versions:
            self._prepare(tensors, buffer)
        return self.host_table, self.device_table


def pack_segments(
    tensors: Sequence[torch.Tensor], segments, buffer: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Gathers the rectangles of many tensors into one buffer (one launch on CUDA).

    Args:
        tensors: contiguous tensors of one dtype and device.
        segments: int64 CPU [S, 6] (see module docstring), or a `PreparedSegments` for
            these tensors and this buffer (validated once, no per-call upload).
        buffer: 1-D destination; when None a zero buffer just large enough is made
            (required with a PreparedSegments).
    Returns:
        the buffer. Elements outside every segment are left as they were.
    """
    tensors = list(tensors)
    if isinstance(segments, PreparedSegments):
        if buffer is None:
            raise ValueError("pack_segments: a PreparedSegments needs the buffer it was prepared for, got None")
        host_table, device_table = segments.tables(tensors, buffer)
        _ops.pack_segments_prepared.default(tensors, host_table, device_table, buffer)
        return buffer
    if buffer is None:
        if not tensors:
            raise ValueError("pack_segments: no tensors and no buffer given")
        buffer = tensors[0].new_zeros(_buffer_size(segments))
    _ops.pack_segments.default(tensors, segments, buffer)
    return buffer


def unpack_average_(
    tensors: Sequence[torch.Tensor], segments, buffer: torch.Tensor, scales=None
) -> None:
    """tensor[rectangle s] = buffer[segment s] * scales[s], in place (fp32 math for halves).

    Args:
        tensors, segments, buffer: as in `pack_segments`; no two rectangles may share
            memory (even across tensors that are views of one storage), and no tensor may
            share memory with the buffer.
        scales: float CPU tensor [S] or a sequence of S floats (typically 1/owner-count).
            Omitted with a PreparedSegments: its own scales are used.
    """
    tensors = list(tensors)
    if isinstance(segments, PreparedSegments):
        if scales is not None:
            raise ValueError("unpack_average_: scales are part of the PreparedSegments; pass scales=None "
                             "(or prepare a new table with the new scales)")
        if segments.scales is None:
            raise ValueError("unpack_average_: the PreparedSegments was prepared without scales (pack only); "
                             "prepare it with scales to unpack")
        host_table, device_table = segments.tables(tensors, buffer)
        _ops.unpack_average_prepared_.default(tensors, host_table, device_table, buffer)
        return
    if scales is None:
        raise ValueError("unpack_average_: scales are required with a plain segment table")
    _ops.unpack_average_.default(tensors, segments, buffer, _scales_tensor(scales))


# ---- fake (meta) kernels: shapes only, for torch.compile and FakeTensor tracing ----


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


# ---- autograd: the backward of masked_linear(_forward) is the masked_linear_backward op ----


def _setup_context(ctx, inputs, output):
    x, weight, bias, out_idx, in_idx, compact_weight, scatter_width, *rest = inputs
    if isinstance(output, tuple):  # masked_linear_forward: reuse what it gathered
        _, x_kept, block = output
        ctx.mark_non_differentiable(x_kept, block)
    else:
        x_kept = block = None
    ctx.save_for_backward(x, weight, out_idx, in_idx, x_kept, block)
    ctx.has_bias = bias is not None
    ctx.compact_weight = compact_weight
    ctx.scatter = scatter_width >= 0
    ctx.check_indices = bool(rest[0]) if rest else True


def _backward(ctx, grad_out, *_unused_grads):
    x, weight, out_idx, in_idx, x_kept, block = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
    gx, gw, gb = _ops.masked_linear_backward.default(
        grad_out.contiguous(), x, weight, out_idx, in_idx, ctx.compact_weight,
        ctx.scatter and out_idx is not None, False, [need_x, need_w, need_b], x_kept, block, ctx.check_indices,
    )
    if not ctx.compact_weight and (out_idx is not None or in_idx is not None):
        # A full weight's gradient has the weight's shape: the owned block, zeros elsewhere.
        rows = out_idx if out_idx is not None else torch.arange(weight.shape[0], device=weight.device)
        cols = in_idx if in_idx is not None else torch.arange(weight.shape[1], device=weight.device)
        if need_w:
            gw = weight.new_zeros(weight.shape).index_put_((rows[:, None], cols[None, :]), gw)
        if need_b:
            gb = weight.new_zeros(weight.shape[0]).index_put_((rows,), gb)
    return (
        gx if need_x else None,
        gw if need_w else None,
        gb if need_b else None,
        None, None, None, None, None,
    )


torch.library.register_autograd("subnet_ext::masked_linear", _backward, setup_context=_setup_context)
torch.library.register_autograd("subnet_ext::masked_linear_forward", _backward, setup_context=_setup_context)

from . import autocast  # noqa: E402,F401  (registers the ops' autocast kernels; needs the ops above)

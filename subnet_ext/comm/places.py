"""Where the pieces comm averages and refreshes live on this rank, as comm receives them.

The engine hands the averager (averaging.py) and the refresher (refresh.py) one
`HeldPiece` per piece this rank holds, built once by the rank's layout
(state/layout.py) at construction. Comm then reads and writes those tensors without
calling back into the layers above it: the addresses are fixed for the engine's life
(parameters, buffers and full tensors stay put; gradients live in the averager's own
gradient homes).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..ops import reference
from ..planning.pieces import Piece

Rect = tuple  # (row_begin, row_end, col_begin, col_end) in a tensor's 2-D view [size(0), numel // size(0)]
# Held pieces are written through their 2-D view, so it must be a view: the ops layer's as_2d,
# refusing non-contiguous tensors.
as_2d = functools.partial(reference.as_2d, view=True)


def area(rect: Rect) -> int:
    """Elements of a rectangle (row_begin, row_end, col_begin, col_end)."""
    return (rect[1] - rect[0]) * (rect[3] - rect[2])


@dataclass(frozen=True, eq=False)
class HeldPiece:
    """One piece of the full model held by this rank: the one type every layer uses for it (the
    averager and the refresher read and write it; the rank's layout, checkpoints, the EMA and a
    change of assignment read and write through it).

    Attributes:
        piece: the piece (planning/pieces.py).
        tensor: the local tensor holding it (a parameter, a buffer, a full tensor of the backward
            regime, or for an optimizer's piece the parameter it lives in); local: its rectangle
            in that tensor's 2-D view.
        full: the rectangle of the original tensor's 2-D view this rank holds (the whole piece,
            or a sharded parameter's local rows); None where no full coordinates are needed.
        param: the Parameter whose gradient (and optimizer state) carries the piece, for a
            parameter piece this rank owns; None otherwise (a buffer, e.g. norm statistics, is
            averaged as its value in the gradient pass too). grad_rect: the piece's rectangle
            in the 2-D view of a gradient shaped like `param`.
        trainable: `param` is one the engine trains: its gradient hook reports it and its
            `.grad` is made the averager's gradient home.
    """

    piece: Piece
    tensor: torch.Tensor
    local: Rect
    full: Rect | None = None
    param: torch.nn.Parameter | None = None
    grad_rect: Rect | None = None
    trainable: bool = False

    def read(self) -> torch.Tensor:
        """A contiguous copy of the piece, shape [rows, cols] of its rectangle."""
        r0, r1, c0, c1 = self.local
        return as_2d(self.tensor)[r0:r1, c0:c1].detach().clone()

    @torch.no_grad()
    def write_into_full(self, full: torch.Tensor, source: torch.Tensor | None = None) -> None:
        """Copy the piece into its place in `full` (a contiguous tensor of the original shape),
        from `tensor`, or from `source`: a tensor shaped like it (e.g. the parameter's
        optimizer state, or its local shard)."""
        r0, r1, c0, c1 = self.full
        l0, l1, m0, m1 = self.local
        src = self.tensor if source is None else source
        as_2d(full)[r0:r1, c0:c1].copy_(reference.as_2d(src)[l0:l1, m0:m1])

    @torch.no_grad()
    def read_from_full(self, full: torch.Tensor) -> None:
        """Overwrite the piece with its place in `full` (a tensor of the original shape)."""
        r0, r1, c0, c1 = self.full
        l0, l1, m0, m1 = self.local
        as_2d(self.tensor)[l0:l1, m0:m1].copy_(reference.as_2d(full.to(self.tensor.device))[r0:r1, c0:c1])

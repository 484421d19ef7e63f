"""Where the pieces comm averages and refreshes live on this rank, as comm receives them.

The engine hands the averager (averaging.py) and the refresher (refresh.py) one
`PiecePlace` per piece this rank holds, built once by the rank's layout
(state/layout.py) at construction. Comm then reads and writes those tensors without
calling back into the layers above it: the addresses are fixed for the engine's life
(parameters, buffers and full tensors stay put; gradients live in the averager's own
gradient homes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..planning.pieces import Piece

Rect = tuple  # (row_begin, row_end, col_begin, col_end) in a tensor's 2-D view [size(0), numel // size(0)]


def area(rect: Rect) -> int:
    """Elements of a rectangle (row_begin, row_end, col_begin, col_end)."""
    return (rect[1] - rect[0]) * (rect[3] - rect[2])


@dataclass(frozen=True, eq=False)
class PiecePlace:
    """One piece on this rank, as comm reads and writes it.

    Attributes:
        piece: the piece (planning/pieces.py).
        value: the local tensor holding the piece's value (a parameter, a buffer, or a
            full tensor of the backward regime); value_rect: the piece's rectangle in
            value's 2-D view.
        param: the Parameter whose gradient carries the piece, for a parameter piece this
            rank owns; None otherwise (a buffer, e.g. norm statistics, is averaged as its
            value in the gradient pass too). grad_rect: the piece's rectangle in the 2-D
            view of a gradient shaped like `param`.
        trainable: `param` is one the engine trains: its gradient hook reports it and its
            `.grad` is made the averager's gradient home.
    """

    piece: Piece
    value: torch.Tensor
    value_rect: Rect
    param: torch.nn.Parameter | None = None
    grad_rect: Rect | None = None
    trainable: bool = False

"""Where each piece of the full model lives on this rank, and copies between coordinates.

Every value SDP holds — a parameter slice or the optimizer state of one — is addressed
two ways:
- *full coordinates*: (state-dict name, rectangle of the original tensor's 2-D view
  [size(0), numel // size(0)]), the same for every plan;
- *local coordinates*: a rectangle of a contiguous local tensor's 2-D view (a compact
  tensor in the forward regime, a full tensor or an owned-slice parameter otherwise).

A `HeldPiece` pairs the two for one piece. Re-planning (another world size, coverage,
level or regime) is then a copy of rectangle overlaps: `copy_overlaps` writes into a
held piece whatever parts of some source rectangles (saved pieces of another plan, or
whole tensors) overlap it, and counts the elements written so gaps are caught.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..ops import reference
from ..planning.pieces import Piece

Rect = tuple  # (row_begin, row_end, col_begin, col_end)


# Held pieces are written through their 2-D view, so it must be a view: the ops layer's as_2d,
# refusing non-contiguous tensors.
as_2d = functools.partial(reference.as_2d, view=True)


def area(rect: Rect) -> int:
    """Elements of a rectangle (row_begin, row_end, col_begin, col_end)."""
    return (rect[1] - rect[0]) * (rect[3] - rect[2])


@dataclass(frozen=True, eq=False)
class HeldPiece:
    """One piece on this rank: `tensor` (contiguous) holds it at `local`; `full` is where it
    sits in the original tensor. `param` is the optimizer's parameter for it (None for
    model values)."""

    piece: Piece
    tensor: torch.Tensor
    local: Rect
    full: Rect
    param: torch.nn.Parameter | None = None

    def read(self) -> torch.Tensor:
        """A contiguous copy of the piece, shape [rows, cols] of its full rectangle."""
        r0, r1, c0, c1 = self.local
        return as_2d(self.tensor)[r0:r1, c0:c1].detach().clone()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a sharded shared parameter or its optimizer state),
    or `t` itself: what slots read and write."""
    return t.to_local() if hasattr(t, "to_local") else t


def writes(held_piece: "HeldPiece", layout) -> bool:
    """True when this rank writes the held piece into a full-coordinate result: the piece's
    leader, or every rank for its own shard of a sharded parameter."""
    return held_piece.piece.leader == layout.rank or layout.is_sharded(held_piece.piece)


def piece_key(piece: Piece) -> str:
    """A name for a piece that is unique within one plan: 'blocks.0.fc1.weight|0:32:16'."""
    return f"{piece.name}|{piece.dim}:{piece.start}:{piece.length}"


def held_values(layout) -> list[HeldPiece]:
    """Every piece whose value this rank holds (the owned ones in the forward regime; all of
    them in the backward regime, where every rank keeps full copies). `layout`: RankLayout."""
    out = []
    for p in layout.local_start:
        t, local = layout.resolve_value(p)
        out.append(HeldPiece(p, t, local, layout.held_rectangle(p)))
    return out


def held_optimizer_pieces(layout, optimizer) -> list[HeldPiece]:
    """Every owned parameter piece the optimizer updates, with the parameter it lives in
    (backward regime, neuron level: the owned-slice Parameter itself). `layout`: RankLayout."""
    in_optimizer = {id(q) for g in optimizer.param_groups for q in g["params"]}
    out = []
    for p in layout.pieces:
        if not p.is_param or not layout.owns(p):
            continue
        param, local = layout.optimizer_param(p)
        if id(param) in in_optimizer:
            out.append(HeldPiece(p, param, local, layout.held_rectangle(p), param))
    return out


def copy_overlaps(dst: torch.Tensor, local: Rect, full: Rect, sources) -> int:
    """Writes into `dst` (its 2-D view, at `local`) every part of `sources` overlapping
    `full`; returns the number of elements written.

    Args:
        dst: a contiguous tensor. local, full: the held piece's rectangles (same extent).
        sources: iterable of (rect in full coordinates, 2-D tensor of that rect's extent).
    """
    view = as_2d(dst)
    written = 0
    for rect, src in sources:
        r0, r1 = max(full[0], rect[0]), min(full[1], rect[1])
        c0, c1 = max(full[2], rect[2]), min(full[3], rect[3])
        if r0 >= r1 or c0 >= c1:
            continue
        view[r0 - full[0] + local[0]: r1 - full[0] + local[0], c0 - full[2] + local[2]: c1 - full[2] + local[2]] \
            .copy_(src[r0 - rect[0]: r1 - rect[0], c0 - rect[2]: c1 - rect[2]])
        written += (r1 - r0) * (c1 - c0)
    return written


def overlapping(full: Rect, rects) -> list:
    """The entries (rect, *rest) of `rects` whose rectangle overlaps `full`."""
    return [e for e in rects if max(full[0], e[0][0]) < min(full[1], e[0][1])
            and max(full[2], e[0][2]) < min(full[3], e[0][3])]

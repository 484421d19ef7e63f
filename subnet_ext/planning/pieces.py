"""Pieces: the plan cut into (tensor, slice, owner set) triples, in one global order.

A piece is a slice [start, start+length) along dim 0 or 1 of one state-dict tensor,
covering consecutive units with the same owner set (a whole tensor for shared and
block entries). The list is built from the plan alone, so every rank has the same
list in the same order; filtering it by owner set gives every owner of that set the
same pieces in the same order, which is what keeps their packed buffers aligned.

On a rank, a piece lives in the *local* tensor at `local_start`: the global start in
the backward regime (full tensors), and its offset inside the compact tensor in the
forward regime (the owned slices concatenated in global order).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .plan import SubnetPlan


@dataclass(frozen=True)
class Piece:
    """name: state-dict entry; units: global unit ids (() = shared); owners: ranks holding it."""

    name: str
    units: tuple
    dim: int
    start: int
    length: int
    owners: tuple
    is_param: bool
    sliced: bool = False  # a neuron-group slice (compacted in the forward regime), not a whole tensor

    @property
    def leader(self) -> int:
        """The lowest-ranked owner: it alone contributes when the full model is assembled."""
        return self.owners[0]


def _extent(shape) -> int:
    return shape[0] if len(shape) else 1


def global_pieces(plan: SubnetPlan) -> list[Piece]:
    """Every floating-point state-dict entry of the model cut into pieces, canonical order."""
    k = plan.world_size
    owner_sets = plan.unit_owner_sets()
    pieces = []
    for g, (a, b) in zip(plan.groups, plan.unit_ranges):
        if g.kind == "block":
            for n in g.params + g.buffers:
                if plan.is_float(n):
                    pieces.append(Piece(n, (a,), 0, 0, _extent(plan.tensor_shapes[n]), owner_sets[a],
                                        n in plan.param_names))
            continue
        for m in g.members:
            j = 0
            while j < g.size:
                e = j
                while e + 1 < g.size and owner_sets[a + e + 1] == owner_sets[a + j]:
                    e += 1
                pieces.append(Piece(m.name, tuple(range(a + j, a + e + 1)), m.dim, m.offset + j * m.width,
                                    (e - j + 1) * m.width, owner_sets[a + j], not m.buffer, sliced=True))
                j = e + 1
    everyone = tuple(range(k))
    for n in plan.shared:
        if plan.is_float(n):
            pieces.append(Piece(n, (), 0, 0, _extent(plan.tensor_shapes[n]), everyone, n in plan.param_names))
    return pieces


def rectangle(shape, dim: int, start: int, length: int) -> tuple[int, int, int, int]:
    """(row_begin, row_end, col_begin, col_end) of a slice in the 2-D view [shape[0], rest]."""
    if len(shape) == 0:
        return 0, 1, 0, 1
    rows = shape[0]
    cols = math.prod(shape[1:]) if len(shape) > 1 else 1
    if dim == 0:
        return start, start + length, 0, cols
    inner = math.prod(shape[2:]) if len(shape) > 2 else 1
    return 0, rows, start * inner, (start + length) * inner


def full_rectangle(plan: SubnetPlan, piece: Piece) -> tuple[int, int, int, int]:
    """The piece's rectangle in the 2-D view of its full (original-shape) tensor."""
    return rectangle(plan.tensor_shapes[piece.name], piece.dim, piece.start, piece.length)


def local_starts(pieces: list[Piece], rank: int, compact: bool) -> dict[Piece, int]:
    """Where each piece this rank holds starts in its local tensor."""
    out, next_start = {}, {}
    for p in pieces:
        if compact and rank not in p.owners:
            continue  # not materialised here; with full tensors every piece has a place
        if not (compact and p.sliced):
            out[p] = p.start
            continue
        out[p] = next_start.get(p.name, 0)
        next_start[p.name] = out[p] + p.length
    return out


def owned_indices(pieces: list[Piece], rank: int, name: str) -> tuple[int, torch.Tensor] | None:
    """(dim, global indices along dim) this rank keeps of a sliced tensor; None if not sliced."""
    mine = [p for p in pieces if p.name == name and rank in p.owners]
    if not mine:
        return None
    dim = mine[0].dim
    return dim, torch.cat([torch.arange(p.start, p.start + p.length) for p in mine])


def shard_rows(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first row, row count) of `rank`'s dim-0 shard of a tensor with `rows` rows, as
    FSDP2 and DTensor's Shard(0) cut it (torch.chunk: ceil(rows / K) rows each, the last
    ranks possibly fewer or none)."""
    chunk = -(-rows // world_size)
    begin = min(rank * chunk, rows)
    return begin, min(chunk, rows - begin)

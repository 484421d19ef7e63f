"""RankLayout: where every piece of the full model lives on one rank, and how to read or write it.

The engine's model surgery decides, once, which local tensor holds each piece: a
compact tensor (forward regime), a full tensor, an owned-slice Parameter that is a view
of a full tensor (backward regime, neuron level), or a DTensor shard (shared parameters
under FSDP2, `shard_shared`). This module is the one answer to "where does this piece
live here": values, gradients, optimizer state and shards. Everything that reads or
writes pieces (assembly of the full state, checkpoints, optimizer state, consistency
checks, clipping, and through `averaging_places` the averager and the refresh) asks it.

Every value is addressed two ways:
- *full coordinates*: (state-dict name, rectangle of the original tensor's 2-D view
  [size(0), numel // size(0)]), the same for every plan;
- *local coordinates*: a rectangle of a local tensor's 2-D view.
A `HeldPiece` pairs the two for one piece. Re-planning (another world size, coverage,
level or regime) is then a copy of rectangle overlaps (`copy_overlaps`).

Lookups never change anything: no gradient is created (the averager gives gradients
their homes), nothing is resharded (a caller that may find FSDP2's parameters gathered
reshards them first; `value_of` refuses a gathered one).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..comm.places import HeldPiece, Rect, area, as_2d
from ..ops.reference import as_2d as read_2d  # reads only: any strides (a copy where no view exists)
from ..planning.pieces import Piece, full_rectangle, global_pieces, local_starts, rectangle, shard_rows
from ..planning.plan import SubnetPlan
from ..measure.storage import local_tensor

__all__ = ["RankLayout", "HeldPiece", "Rect", "area", "as_2d", "copy_overlaps", "local_tensor", "overlapping",
           "piece_key"]

def piece_key(piece: Piece) -> str:
    """A name for a piece that is unique within one plan: 'blocks.0.fc1.weight|0:32:16'."""
    return f"{piece.name}|{piece.dim}:{piece.start}:{piece.length}"


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


class RankLayout:
    """One rank's placement of the plan's pieces. Built once, after the engine's surgery
    (and FSDP2's sharding); never changed afterwards.

    Args:
        plan: the SubnetPlan (the same on every rank).
        rank, world_size: this rank and the plan's K.
        device: where the local tensors live.
        module: the model after surgery (compact or with owned-slice parameters).
        compact: True in the forward regime (sliced tensors hold only owned rows/columns).
        piece_params: {piece: Parameter} owned-slice Parameters (backward regime, neuron level).
        value_refs: {state-dict name: (module, attribute)} for full tensors that are no
            longer reachable under their state-dict name (backward regime, neuron level).
        sharded: state-dict names held as DTensor shards along dim 0 (FSDP2, shard_shared).
        trainable: the Parameters this rank trains, in model order (what the optimizer holds).

    Attributes:
        pieces: global_pieces(plan), the same list on every rank.
        local_start: {piece: start along piece.dim in its local tensor} for held pieces.
        integer_entries: {non-float state-dict name: the rank that reports it}.
    """

    def __init__(self, plan: SubnetPlan, rank: int, world_size: int, device: torch.device, module: nn.Module,
                 compact: bool, piece_params: dict | None = None, value_refs: dict | None = None,
                 sharded=(), trainable: list | None = None):
        self.plan, self.rank, self.world_size, self.device = plan, rank, world_size, device
        self.module, self.compact = module, compact
        self.piece_params = dict(piece_params or {})
        self.value_refs = dict(value_refs or {})
        self.sharded = frozenset(sharded)
        self.trainable = list(trainable if trainable is not None else (p for p in module.parameters()
                                                                      if p.requires_grad))
        self._trainable_ids = frozenset(id(p) for p in self.trainable)
        self.pieces = global_pieces(plan)
        self._values = {}  # state-dict name -> its local tensor (not sharded ones), looked up once
        self.local_start = local_starts(self.pieces, rank, compact=compact)
        self.integer_entries = self._integer_entries()

    def _integer_entries(self) -> dict:
        """Non-float entries (e.g. BatchNorm's num_batches_tracked) -> the rank that reports them:
        the first owner of their block, or rank 0 when shared."""
        out = {}
        block_of = {n: a for g, (a, _) in zip(self.plan.groups, self.plan.unit_ranges) for n in g.params + g.buffers}
        for name in self.plan.tensor_shapes:
            if self.plan.is_float(name):
                continue
            unit = block_of.get(name)
            out[name] = 0 if unit is None else int(torch.nonzero(self.plan.owners[:, unit])[0])
        return out

    # ------------------------------------------------------------------ questions about a piece
    def is_sharded(self, piece: Piece) -> bool:
        """True when `piece` is a shared parameter this rank holds only a dim-0 shard of."""
        return piece.name in self.sharded

    def owns(self, piece: Piece) -> bool:
        """True when this rank is one of the piece's owners."""
        return self.rank in piece.owners

    def contributes(self, piece: Piece) -> bool:
        """True when this rank writes the piece into a full-coordinate result (assembled
        state, checkpoint, norm): the piece's leader, or every rank its own shard of a
        sharded parameter."""
        return piece.leader == self.rank or self.is_sharded(piece)

    def is_trainable(self, param: torch.Tensor) -> bool:
        """True when `param` is one of the Parameters this rank trains."""
        return id(param) in self._trainable_ids

    def held_rectangle(self, piece: Piece) -> Rect:
        """The rectangle of the piece's full 2-D view this rank holds: the whole piece, or
        for a sharded parameter the rows of its local shard (torch.chunk over dim 0)."""
        if piece.name not in self.sharded:
            return full_rectangle(self.plan, piece)
        shape = self.plan.tensor_shapes[piece.name]
        cols = math.prod(shape[1:]) if len(shape) > 1 else 1
        begin, rows = shard_rows(shape[0], self.rank, self.world_size)
        return (begin, begin + rows, 0, cols)

    # ------------------------------------------------------------------ where it lives
    def value_of(self, name: str) -> torch.Tensor:
        """The local tensor holding state-dict entry `name` (compact in the forward regime; a
        DTensor for a sharded parameter). Raises AttributeError/KeyError when this rank does
        not hold it (a skipped block), RuntimeError for a sharded parameter that a forward
        left gathered (the caller reshards first: FSDP2's `reshard()`)."""
        if name in self.value_refs:
            module, attr = self.value_refs[name]
            return getattr(module, attr)
        if name in self._values:
            return self._values[name]
        path, _, leaf = name.rpartition(".")
        module = self.module.get_submodule(path)
        t = module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]
        if name not in self.sharded:
            self._values[name] = t  # the tensors are fixed for the layout's life (FSDP2's gathers aside)
            return t
        if not hasattr(t, "to_local"):
            raise RuntimeError(f"the sharded shared parameter {name!r} is gathered (a forward ran without its "
                               "backward); reshard it (FSDP2's reshard()) before reading the layout")
        return t

    def holds_whole(self, name: str) -> bool:
        """True when this rank holds entry `name` as a local tensor."""
        try:
            self.value_of(name)
            return True
        except (AttributeError, KeyError):
            return False

    def value_place(self, piece: Piece) -> tuple[torch.Tensor, Rect]:
        """(local tensor holding the piece's value, its rectangle in that tensor's 2-D view);
        for a sharded parameter, this rank's shard (a plain tensor) and all of its rows."""
        t = self.value_of(piece.name)
        if piece.name in self.sharded:
            t = t.to_local()
            return t, rectangle(t.shape, 0, 0, t.shape[0])
        return t, rectangle(t.shape, piece.dim, self.local_start[piece], piece.length)

    def parameter_place(self, piece: Piece) -> tuple[nn.Parameter, Rect]:
        """(the Parameter that trains an owned parameter piece, the piece's rectangle in the
        2-D view of a tensor shaped like that Parameter's local tensor). Its gradient and its
        optimizer state are shaped like it, so the rectangle addresses the piece in them too:
        the owned-slice Parameter whole (backward regime, neuron level), this rank's shard
        (sharded), or the piece's place in a compact or full parameter."""
        own = self.piece_params.get(piece)
        if own is not None:
            return own, rectangle(own.shape, piece.dim, 0, piece.length)
        param = self.value_of(piece.name)
        if piece.name in self.sharded:
            rows = param.to_local().shape[0]
            return param, rectangle(param.to_local().shape, 0, 0, rows)
        return param, rectangle(param.shape, piece.dim, self.local_start[piece], piece.length)

    # ------------------------------------------------------------------ collections
    def held_values(self) -> list[HeldPiece]:
        """Every piece whose value this rank holds (the owned ones in the forward regime; all of
        them in the backward regime, where every rank keeps full copies)."""
        out = []
        for p in self.local_start:
            t, local = self.value_place(p)
            out.append(HeldPiece(p, t, local, self.held_rectangle(p)))
        return out

    def held_optimizer_pieces(self, optimizer) -> list[HeldPiece]:
        """Every owned parameter piece `optimizer` updates, with the parameter it lives in
        (backward regime, neuron level: the owned-slice Parameter itself); `local` addresses
        it in the parameter's (and so its optimizer state's) local tensor."""
        in_optimizer = {id(q) for g in optimizer.param_groups for q in g["params"]}
        out = []
        for p in self.pieces:
            if not p.is_param or not self.owns(p):
                continue
            param, local = self.parameter_place(p)
            if id(param) in in_optimizer:
                out.append(HeldPiece(p, param, local, self.held_rectangle(p), param))
        return out

    def held_gradients(self) -> list[tuple[Piece, torch.Tensor]]:
        """(piece, its gradient as a 2-D tensor [rows, cols] of its rectangle) for every owned
        parameter piece of a trainable parameter whose `.grad` exists (a sharded parameter's:
        this rank's rows of it). Reads only: a parameter without a gradient is left out."""
        out = []
        for piece in self.pieces:
            if not piece.is_param or not self.owns(piece):
                continue
            param, (r0, r1, c0, c1) = self.parameter_place(piece)
            if not self.is_trainable(param) or param.grad is None:
                continue
            out.append((piece, read_2d(local_tensor(param.grad))[r0:r1, c0:c1]))
        return out

    def averaging_places(self) -> dict[Piece, HeldPiece]:
        """{piece: HeldPiece} for every piece this rank holds that SDP communicates (all but
        FSDP2's shards): what the averager and the refresh receive (comm/places.py)."""
        out = {}
        for p in self.local_start:
            if self.is_sharded(p):
                continue  # FSDP2 communicates the sharded shared parameters
            value, value_rect = self.value_place(p)
            param = grad_rect = None
            if p.is_param and self.owns(p):
                param, grad_rect = self.parameter_place(p)
            out[p] = HeldPiece(p, value, value_rect, self.held_rectangle(p), param, grad_rect,
                               trainable=param is not None and self.is_trainable(param))
        return out

    def local_tensors(self) -> list[torch.Tensor]:
        """Full tensors held outside the module's parameters (backward regime's `*_full`)."""
        return [getattr(m, a) for m, a in self.value_refs.values()]

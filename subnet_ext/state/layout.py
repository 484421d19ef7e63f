"""RankLayout: where every piece of the full model lives on one rank.

The engine's model surgery decides, once, which local tensor holds each piece: a
compact tensor (forward regime), a full tensor, or an owned-slice Parameter that is a
view of a full tensor (backward regime, neuron level). Everything that reads or
writes pieces — assembly of the full state, checkpoints, optimizer state, consistency
checks, averaging — asks this object instead of the engine, so no layer below the
engine needs to know how the engine is built.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..planning.pieces import Piece, full_rectangle, global_pieces, local_starts, rectangle, shard_rows
from ..planning.plan import SubnetPlan


class RankLayout:
    """One rank's placement of the plan's pieces.

    Args:
        plan: the SubnetPlan (the same on every rank).
        rank, world_size: this rank and the plan's K.
        device: where the local tensors live.
        module: the model after surgery (compact or with owned-slice parameters).
        compact: True in the forward regime (sliced tensors hold only owned rows/columns).
        piece_params: {piece: Parameter} owned-slice Parameters (backward regime, neuron level).
        value_refs: {state-dict name: (module, attribute)} for full tensors that are no
            longer reachable under their state-dict name (backward regime, neuron level).

    Attributes:
        pieces: global_pieces(plan), the same list on every rank.
        local_start: {piece: start along piece.dim in its local tensor} for held pieces.
        integer_entries: {non-float state-dict name: the rank that reports it}.
    """

    def __init__(self, plan: SubnetPlan, rank: int, world_size: int, device: torch.device, module: nn.Module,
                 compact: bool, piece_params: dict | None = None, value_refs: dict | None = None):
        self.plan, self.rank, self.world_size, self.device = plan, rank, world_size, device
        self.module, self.compact = module, compact
        self.piece_params = dict(piece_params or {})
        self.value_refs = dict(value_refs or {})
        self.pieces = global_pieces(plan)
        self.local_start = local_starts(self.pieces, rank, compact=compact)
        self.integer_entries = self._integer_entries()
        self.sharded: set = set()  # state-dict names held as DTensor shards (FSDP2, shard_shared)
        self._reshard = None

    def mark_sharded(self, names, reshard=None) -> None:
        """Record that these shared parameters are now DTensors sharded along dim 0 (FSDP2).
        `reshard()` puts the shards back in the module if a forward left them gathered."""
        self.sharded, self._reshard = set(names), reshard

    def is_sharded(self, piece: Piece) -> bool:
        """True when `piece` is a shared parameter this rank holds only a dim-0 shard of."""
        return piece.name in self.sharded

    def held_rectangle(self, piece: Piece) -> tuple:
        """The rectangle of the piece's full 2-D view this rank holds: the whole piece, or
        for a sharded parameter the rows of its local shard (torch.chunk over dim 0)."""
        if piece.name not in self.sharded:
            return full_rectangle(self.plan, piece)
        shape = self.plan.tensor_shapes[piece.name]
        cols = math.prod(shape[1:]) if len(shape) > 1 else 1
        begin, rows = shard_rows(shape[0], self.rank, self.world_size)
        return (begin, begin + rows, 0, cols)

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

    def value_of(self, name: str) -> torch.Tensor:
        """The local tensor holding state-dict entry `name` (compact in the forward regime).
        Raises AttributeError/KeyError when this rank does not hold it (a skipped block)."""
        if name in self.sharded and self._reshard is not None:
            self._reshard()  # a forward without backward leaves the gathered tensors registered
        if name in self.value_refs:
            module, attr = self.value_refs[name]
            return getattr(module, attr)
        path, _, leaf = name.rpartition(".")
        module = self.module.get_submodule(path)
        if leaf in module._parameters:
            return module._parameters[leaf]
        return module._buffers[leaf]

    def holds_whole(self, name: str) -> bool:
        """True when this rank holds entry `name` as a local tensor."""
        try:
            self.value_of(name)
            return True
        except (AttributeError, KeyError):
            return False

    def owns(self, piece: Piece) -> bool:
        """True when this rank is one of the piece's owners."""
        return self.rank in piece.owners

    def optimizer_param(self, piece: Piece) -> tuple[nn.Parameter, tuple]:
        """(the Parameter an optimizer updates for an owned parameter piece, the piece's
        rectangle in that Parameter's 2-D view)."""
        own = self.piece_params.get(piece)
        if own is not None:
            return own, rectangle(own.shape, piece.dim, 0, piece.length)
        param = self.value_of(piece.name)
        if piece.name in self.sharded:
            return param, rectangle(param.to_local().shape, 0, 0, param.to_local().shape[0])
        return param, rectangle(param.shape, piece.dim, self.local_start[piece], piece.length)

    def resolve_value(self, piece: Piece) -> tuple[torch.Tensor, tuple]:
        """(local tensor holding the piece's value, rectangle of the piece in its 2-D view)."""
        t = self.value_of(piece.name)
        if piece.name in self.sharded:
            t = t.to_local()
            return t, rectangle(t.shape, 0, 0, t.shape[0])
        return t, rectangle(t.shape, piece.dim, self.local_start[piece], piece.length)

    def resolve_grad(self, piece: Piece) -> tuple[torch.Tensor, tuple]:
        """(gradient tensor of the piece's parameter, rectangle of the piece in its 2-D view).

        Creates a zero (contiguous) `.grad` when the parameter has none, so a piece whose
        parameter got no gradient this backward still takes part in the average. Buffers
        (norm statistics) are averaged as values."""
        if not piece.is_param:
            return self.resolve_value(piece)
        if piece in self.piece_params:
            param, rect_of = self.piece_params[piece], None
        else:
            param = self.value_of(piece.name)
            rect_of = (piece.dim, self.local_start[piece], piece.length)
        if param.grad is None:
            param.grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
        elif not param.grad.is_contiguous():
            param.grad = param.grad.contiguous()
        g = param.grad
        rect = rectangle(g.shape, 0, 0, g.shape[0] if g.dim() else 1) if rect_of is None else \
            rectangle(g.shape, *rect_of)
        return g, rect

    def pieces_by_parameter(self, trainable_ids: set) -> dict:
        """{id(trainable parameter): [held pieces whose gradient it carries]}."""
        out = {}
        for p in self.pieces:
            if not p.is_param or self.rank not in p.owners:
                continue
            param = self.piece_params.get(p)
            if param is None:
                param = self.value_of(p.name)
            if id(param) in trainable_ids:
                out.setdefault(id(param), []).append(p)
        return out

    def local_tensors(self) -> list[torch.Tensor]:
        """Full tensors held outside the module's parameters (backward regime's `*_full`)."""
        return [getattr(m, a) for m, a in self.value_refs.values()]

"""Backward regime: owners refresh the copies of units other ranks do not own.

After each optimizer step only the owners of a unit have updated it; the other ranks
hold a stale full copy (their forward runs the full model). CopyRefresher overwrites
those copies with the leader's values so every rank starts the next forward with
identical full parameters.
"""
from __future__ import annotations

from typing import Mapping

import torch

from .. import ops
from ..planning.buckets import align_elements
from ..planning.pieces import Piece
from .communicator import Communicator
from .places import PiecePlace
from .prepared import PreparedTables


class CopyRefresher:
    """Backward regime: after each optimizer step, each leader (lowest owner) broadcasts the
    pieces it leads that some rank lacks, and the ranks that do not own a piece overwrite
    their copy (exact, scale 1). One broadcast per (leader, dtype), in leader order; the
    layout is static, so it is built once. Simulated: the leader's packing and the bytes
    are kept, the copies are left as they are.

    One persistent buffer (zeroed once, allocated at the first refresh) serves every
    broadcast in turn, sized to the largest: the broadcasts run one after the other in
    stream order, and keeping every unit some rank lacks at once would be a second copy
    of most of the model. Its address never changes, so the segment tables are prepared
    once. Each piece starts at a 16-byte aligned offset (as in the buckets), so the
    packing kernels' vector path applies to every segment.
    """

    def __init__(self, pieces: list[Piece], rank: int, world_size: int, places: Mapping[Piece, PiecePlace],
                 comm: Communicator, quantity: str = "refresh"):
        self.rank, self.comm, self.quantity = rank, comm, quantity
        self.places = dict(places)  # where each piece's value lives (every piece: full copies on every rank)
        # (leader, one piece per tensor of the tensor list, table, rows to copy, their scales, total)
        self.broadcasts = []
        self.prepared = PreparedTables()  # segment tables validated once per layout
        self.buffer = None  # the persistent buffer, [max total] of the first dtype; see buffer_for
        self._views = {}  # broadcast index -> its [total] view of the buffer
        if world_size == 1:
            return
        for leader in range(world_size):
            by_dtype = {}
            for p in pieces:
                if p.owners[0] == leader and len(p.owners) < world_size:
                    tensor, rect = self._value(p)
                    by_dtype.setdefault(tensor.dtype, []).append((p, tensor, rect))
            for items in by_dtype.values():
                tensor_pieces, tensor_index, rects = [], {}, []
                for p, t, rect in items:
                    if id(t) not in tensor_index:
                        tensor_index[id(t)] = len(tensor_pieces)
                        tensor_pieces.append(p)
                    rects.append((tensor_index[id(t)], *rect))
                table, total = ops.segment_table(rects, align=align_elements(items[0][1].element_size()))
                if total == 0:
                    continue  # nothing to send (the cost model counts no collective either)
                keep = [i for i, (p, _, _) in enumerate(items) if rank not in p.owners]
                self.broadcasts.append((leader, tensor_pieces, table, table[keep],
                                        torch.ones(len(keep), dtype=torch.float32), total))

    def _value(self, piece: Piece) -> tuple[torch.Tensor, tuple]:
        """(the tensor holding the piece's value, its rectangle in that tensor's 2-D view)."""
        place = self.places[piece]
        return place.value, place.value_rect

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the persistent refresh buffer (0 before the first refresh)."""
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()

    def _view(self, i: int, total: int, like: torch.Tensor) -> torch.Tensor:
        """Broadcast i's [total] view of the persistent buffer, in `like`'s dtype, made once.
        The buffer is bytes (uint8, sized for the largest broadcast), so broadcasts of
        different dtypes share it."""
        view = self._views.get(i)
        if view is None:
            if self.buffer is None:
                nbytes = max(n * self._value(pieces[0])[0].element_size()
                             for _, pieces, _, _, _, n in self.broadcasts)
                self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=like.device)
            view = self.buffer.narrow(0, 0, total * like.element_size()).view(like.dtype)
            self._views[i] = view
        return view

    def __call__(self) -> None:
        """Broadcast each leader's pieces and overwrite the copies of ranks that do not own them."""
        for i, (leader, tensor_pieces, table, keep_table, ones, total) in enumerate(self.broadcasts):
            tensors = [self._value(p)[0] for p in tensor_pieces]
            buffer = self._view(i, total, tensors[0])
            if self.rank == leader:
                ops.pack_segments(tensors, self.prepared.get((i, "pack"), tensors, table, buffer), buffer)
            self.comm.broadcast(buffer, leader, self.quantity)
            if len(keep_table) and not self.comm.simulated:
                ops.unpack_average_(tensors, self.prepared.get((i, "unpack"), tensors, keep_table, buffer, ones),
                                    buffer)

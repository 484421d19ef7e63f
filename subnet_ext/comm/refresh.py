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
from ..planning.buckets import Bucket
from ..planning.pieces import Piece
from .communicator import Communicator
from .places import HeldPiece
from .prepared import PreparedTables, piece_table


class CopyRefresher:
    """Backward regime: after each optimizer step, each leader (lowest owner) broadcasts the
    pieces it leads that some rank lacks, and the ranks that do not own a piece overwrite
    their copy (exact, scale 1). One broadcast per (leader, dtype), in leader order, laid out
    by planning.buckets.refresh_broadcasts (the layout the cost and memory models read); it is
    static, so its tables are built once. Simulated: the leader's packing and the bytes
    are kept, the copies are left as they are.

    One persistent buffer (zeroed once, allocated at the first refresh) serves every
    broadcast in turn, sized to the largest: the broadcasts run one after the other in
    stream order, and keeping every unit some rank lacks at once would be a second copy
    of most of the model. Its address never changes, so the segment tables are prepared
    once. Each piece starts at a 16-byte aligned offset (as in the buckets), so the
    packing kernels' vector path applies to every segment.
    """

    def __init__(self, broadcasts: list[tuple[int, Bucket]], rank: int, places: Mapping[Piece, HeldPiece],
                 comm: Communicator, quantity: str = "refresh"):
        """broadcasts: planning.buckets.refresh_broadcasts(plan, pieces), (leader, bucket) in order;
        places: where each piece's value lives (every piece: full copies on every rank)."""
        self.rank, self.comm, self.quantity = rank, comm, quantity
        self.places = dict(places)
        # (leader, one piece per tensor of the tensor list, table, rows to copy, their scales, total)
        self.broadcasts = []
        self.prepared = PreparedTables()  # segment tables validated once per layout
        self.buffer = None  # the persistent buffer, [max total] of the first dtype; see buffer_for
        self._views = {}  # broadcast index -> its [total] view of the buffer
        for leader, bucket in broadcasts:
            tensor_pieces, table = piece_table([(p, *self._value(p), off) for p, off in zip(bucket.pieces,
                                                                                          bucket.offsets)])
            keep = [i for i, p in enumerate(bucket.pieces) if rank not in p.owners]
            self.broadcasts.append((leader, tensor_pieces, table, table[keep],
                                    torch.ones(len(keep), dtype=torch.float32), bucket.numel))

    def _value(self, piece: Piece) -> tuple[torch.Tensor, tuple]:
        """(the tensor holding the piece's value, its rectangle in that tensor's 2-D view)."""
        place = self.places[piece]
        return place.tensor, place.local

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

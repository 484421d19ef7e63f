"""Backward regime: owners refresh the copies of units other ranks do not own.

After each optimizer step only the owners of a unit have updated it; the other ranks
hold a stale full copy (their forward runs the full model). CopyRefresher overwrites
those copies with the leader's values so every rank starts the next forward with
identical full parameters.
"""
from __future__ import annotations

import torch

from .. import ops
from .prepared import PreparedTables
from .communicator import Communicator
from ..planning.pieces import Piece
from .averaging import Resolver


class CopyRefresher:
    """Backward regime: after each optimizer step, each leader (lowest owner) broadcasts the
    pieces it leads that some rank lacks, and the ranks that do not own a piece overwrite
    their copy (exact, scale 1). One broadcast per (leader, dtype), in leader order; the
    layout is static, so it is built once. Simulated: the leader's packing and the bytes
    are kept, the copies are left as they are.

    Buffers are allocated per call, not kept: they hold every unit some rank lacks, which in
    the backward regime (full parameters on every rank) would be a second copy of most of
    the model.
    """

    def __init__(self, pieces: list[Piece], rank: int, world_size: int, resolve: Resolver, comm: Communicator,
                 quantity: str = "refresh"):
        self.rank, self.resolve, self.comm, self.quantity = rank, resolve, comm, quantity
        self.broadcasts = []  # (leader, one piece per tensor of the tensor list, table, rows to copy, total)
        self.prepared = PreparedTables()  # segment tables validated once per layout
        if world_size == 1:
            return
        for leader in range(world_size):
            by_dtype = {}
            for p in pieces:
                if p.owners[0] == leader and len(p.owners) < world_size:
                    tensor, rect = resolve(p)
                    by_dtype.setdefault(tensor.dtype, []).append((p, tensor, rect))
            for items in by_dtype.values():
                tensor_pieces, tensor_index, rects = [], {}, []
                for p, t, rect in items:
                    if id(t) not in tensor_index:
                        tensor_index[id(t)] = len(tensor_pieces)
                        tensor_pieces.append(p)
                    rects.append((tensor_index[id(t)], *rect))
                table, total = ops.segment_table(rects)
                keep = [i for i, (p, _, _) in enumerate(items) if rank not in p.owners]
                self.broadcasts.append((leader, tensor_pieces, table, table[keep], total))

    def __call__(self) -> None:
        for i, (leader, tensor_pieces, table, keep_table, total) in enumerate(self.broadcasts):
            tensors = [self.resolve(p)[0] for p in tensor_pieces]
            buffer = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
            if self.rank == leader:
                ops.pack_segments(tensors, self.prepared.get((i, "pack"), tensors, table, buffer), buffer)
            self.comm.broadcast(buffer, leader, self.quantity)
            if len(keep_table) and not self.comm.simulated:
                ones = torch.ones(len(keep_table), dtype=torch.float32)
                ops.unpack_average_(tensors, self.prepared.get((i, "unpack"), tensors, keep_table, buffer, ones), buffer)

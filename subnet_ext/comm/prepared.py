"""Segment tables validated once per layout, not once per call.

The engine's layouts are fixed (buckets.py, refresh.py), so the table of every pack and
unpack is the same at every step; only the tensors it points into may move (a gradient
set to None and allocated again). `PreparedTables` keeps one `ops.PreparedSegments` per
(use, table) and prepares it again only when the tensors' or the buffer's addresses or
shapes changed: with stable storage (parameters, CUDA's caching allocator) a step does no
table validation and, on CUDA, no table upload.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .. import ops


def piece_table(entries) -> tuple[list, torch.Tensor]:
    """A segment table from pieces placed in a buffer: the one builder of the averager's and the
    refresher's tables.

    Args:
        entries: (piece, its local tensor, (r0, r1, c0, c1) in that tensor's 2-D view, buffer offset)
            each, in buffer order.
    Returns:
        (one piece per distinct tensor, in first-seen order: segment row i's tensor index points into
        it; the table int64 [S, 6] of (tensor index, r0, r1, c0, c1, offset)).
    """
    tensor_pieces, tensor_index, rows = [], {}, []
    for piece, tensor, (r0, r1, c0, c1), offset in entries:
        if id(tensor) not in tensor_index:
            tensor_index[id(tensor)] = len(tensor_pieces)
            tensor_pieces.append(piece)
        rows.append((tensor_index[id(tensor)], r0, r1, c0, c1, offset))
    return tensor_pieces, torch.tensor(rows, dtype=torch.int64) if rows else torch.empty(0, 6, dtype=torch.int64)


def _addresses(tensors: Sequence[torch.Tensor], buffer: torch.Tensor) -> tuple:
    return (buffer.data_ptr(), buffer.numel(), tuple((t.data_ptr(), tuple(t.shape)) for t in tensors))


class PreparedTables:
    """Cache of prepared segment tables, keyed by what they serve.

    Attributes:
        preparations: tables prepared so far (one per key while the storage stays put).
    """

    def __init__(self):
        self._cache = {}
        self.preparations = 0

    def get(self, key, tensors: Sequence[torch.Tensor], segments: torch.Tensor, buffer: torch.Tensor,
            scales=None) -> "ops.PreparedSegments":
        """The prepared table for `key`, prepared again if the tensors or buffer moved or
        `segments` is another table than the one prepared.

        Args:
            key: any hashable naming the use (e.g. (bucket index, "pack", "gradients")).
            tensors, segments, buffer: as for ops.pack_segments; segments int64 [S, 6].
            scales: None for a pack-only table; [S] floats for an unpack table.
        """
        where = _addresses(tensors, buffer)
        hit = self._cache.get(key)
        # Another table object for the same key (a layout rebuilt its table) is prepared anew too.
        if hit is None or hit[0] != where or hit[1].segments is not segments:
            hit = (where, ops.PreparedSegments(tensors, segments, buffer, scales))
            self._cache[key] = hit
            self.preparations += 1
        return hit[1]

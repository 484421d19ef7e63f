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

"""Per-rank batches of an in-memory dataset, deterministic from (seed, step, rank)."""
from __future__ import annotations

import torch


class ShardedBatches:
    """Each epoch one seeded permutation, shared by all ranks, cut into disjoint per-rank
    batches; batch_at(step) is a pure function of (seed, step, rank), so a resumed run
    sees the same data. x: [n, ...], y: [n]."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, rank: int, world_size: int, seed: int):
        if len(x) != len(y):
            raise ValueError(f"x and y have different lengths: {len(x)} vs {len(y)}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if batch_size < 1 or batch_size * world_size > len(x):
            raise ValueError(f"batch_size {batch_size} x world_size {world_size} must be between 1 and the "
                             f"dataset size {len(x)}")
        self.x, self.y, self.batch_size, self.rank, self.world_size, self.seed = x, y, batch_size, rank, world_size, seed
        self.per_epoch = len(x) // (batch_size * world_size)
        self._epoch, self._perm = None, None

    def batch_at(self, step: int):
        """(x[idx], y[idx]) of this rank's batch at `step`: batch_size rows of the epoch's permutation
        (x: [batch_size, ...], y: [batch_size])."""
        epoch, i = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))
        start = (i * self.world_size + self.rank) * self.batch_size
        idx = self._perm[start:start + self.batch_size]
        return self.x[idx], self.y[idx]

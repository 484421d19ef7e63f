"""allreduce_hook: the plain mean of a bucket among its ranks, in the gradients' dtype.

The same averages as the default reduction (divided by the group's size before the sum
instead of after, as DDP's hook does), written as a hook: the template for one's own.

    sdp.register_comm_hook(None, allreduce_hook)
"""
from __future__ import annotations

import torch

from ...planning.buckets import Bucket
from ..reduction import CommBucket


class AllreduceHook:
    """hook(state, bucket): the buffer times bucket.scale, summed over the group in place."""

    __name__ = "allreduce_hook"

    def __call__(self, state: None, bucket: CommBucket) -> torch.futures.Future:
        """Scale the buffer to its share of the mean and all-reduce it; the Future's value is [buffer]."""
        buffer = bucket.buffer()
        buffer.mul_(bucket.scale)
        return bucket.all_reduce(buffer)

    def collective_bytes(self, state: None, layout: Bucket) -> list[int]:
        """One all-reduce of the whole buffer."""
        return [layout.nbytes]


allreduce_hook = AllreduceHook()

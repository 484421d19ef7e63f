"""fp16_compress_hook, bf16_compress_hook: a bucket sent in half precision (torch DDP's hooks of
the same names; `SDPConfig.reduce_dtype` is this hook at that dtype, as FSDP2's reduce_dtype).

The buffer (the gradients' dtype) is divided by the group's size and cast to the wire
dtype in one operation, so the sum over the group is already the mean and an fp16 sum
cannot overflow where the mean would not; it is all-reduced in the wire dtype and the
averager casts the result back into the buffer, where the gradients accumulate in their
own dtype. Bytes on the wire: the buffer's elements times the wire dtype's size.

    sdp.register_comm_hook(None, bf16_compress_hook)
"""
from __future__ import annotations

import torch

from ...planning.buckets import Bucket
from ..reduction import CommBucket
from ...vocabulary import dtype_size


class CastCompressHook:
    """hook(state, bucket): the bucket's mean over its group, carried in `dtype`.

    Args:
        dtype: the wire dtype (torch.float16, torch.bfloat16, or any floating dtype).
    """

    def __init__(self, dtype: torch.dtype):
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"a wire dtype must be a floating torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.__name__ = f"{str(dtype).replace('torch.', '')}_compress_hook"

    def __call__(self, state: None, bucket: CommBucket) -> torch.futures.Future:
        """All-reduce buffer * scale in the wire dtype; the Future's value is [the wire tensor]."""
        buffer = bucket.buffer()
        if buffer.dtype == self.dtype:
            wire = buffer.mul_(bucket.scale)
        else:
            wire = torch.empty(buffer.shape, dtype=self.dtype, device=buffer.device)
            torch.mul(buffer, bucket.scale, out=wire)
        return bucket.all_reduce(wire)

    def collective_bytes(self, state: None, layout: Bucket) -> list[int]:
        """One all-reduce of the whole buffer (alignment gaps included) in the wire dtype."""
        return [layout.numel * dtype_size(self.dtype)]


fp16_compress_hook = CastCompressHook(torch.float16)
bf16_compress_hook = CastCompressHook(torch.bfloat16)

"""Built-in comm hooks for `SubnetDataParallel.register_comm_hook(state, hook)`, one file each,
as torch DDP's `ddp_comm_hooks`:

- `allreduce_hook` (allreduce.py): the plain mean, in the gradients' dtype; a template.
- `fp16_compress_hook`, `bf16_compress_hook` (cast.py): the bucket sent in half precision
  and cast back (DDP's hooks of those names; `SDPConfig.reduce_dtype` uses the same code).
- `low_rank_hook` with a `LowRankState` (low_rank.py): PowerSGD's rank-r compression with
  error feedback, per owner group.

A hook is `hook(state, bucket: CommBucket)` returning the mean of `bucket.buffer()` over the
bucket's group (comm/reduction.py); each built-in one also has
`collective_bytes(state, layout)`, what it hands to collectives per bucket, so that
`comm_stats()` predicts its bytes.
"""
from .allreduce import AllreduceHook, allreduce_hook
from .cast import CastCompressHook, bf16_compress_hook, fp16_compress_hook
from .low_rank import LowRankHook, LowRankState, low_rank_hook

__all__ = ["allreduce_hook", "AllreduceHook", "CastCompressHook", "fp16_compress_hook", "bf16_compress_hook",
           "LowRankHook", "LowRankState", "low_rank_hook"]

"""Shard the plan's shared parameters with torch's FSDP2 (`shard_shared=True`).

After SDP's surgery, `fully_shard` is applied to the root module with every unit
parameter in `ignored_params`, so FSDP2 manages exactly the shared parameters: they are
DTensors sharded along dim 0 over the engine's group between uses, all-gathered before
the forward and kept full-size until the end of the backward (FSDP2's default for a root
module, planning/sharding.RESHARD_AFTER_FORWARD; then resharded: full-size only
transiently), and their gradients are reduce-scattered as the mean over
the world (SDP's rule for shared parameters, c = K). The optimizer sees the DTensor
shards, so their state is sharded too. SDP's buckets leave these parameters out
(planning/sharding.py); units keep their owner averaging.
"""
from __future__ import annotations

import contextlib

import torch.distributed as dist
import torch.nn as nn

from ..planning.sharding import RESHARD_AFTER_FORWARD, sharded_names


def check_shard_shared(simulated: bool) -> None:
    """ValueError where shard_shared cannot run: a simulated rank, or no torch.distributed
    (sync_every > 1 is refused by SDPConfig itself)."""
    if simulated:
        raise ValueError("shard_shared=True shards the shared parameters over the real ranks with FSDP2; it cannot "
                         "be combined with simulate_rank (one rank alone). Drop one of the two.")
    if not dist.is_initialized():
        raise ValueError("shard_shared=True needs torch.distributed initialised (FSDP2 shards over a process group)")


class SharedShards:
    """FSDP2 over the shared parameters of `model` (already through SDP's surgery).

    Args:
        model: the wrapped model; `fully_shard` changes its class in place.
        plan: the engine's plan (sharded_names: which parameters are shared).
        process_group: the engine's group (None: the world).
        device: where the model lives (the mesh's device type).

    Attributes:
        names: the sharded parameters' state-dict names (the rank's layout is told them).
        module: the `fully_shard`ed model (FSDP2's FSDPModule).
    """

    def __init__(self, model: nn.Module, plan, process_group, device):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        self.names = sharded_names(plan)
        shared_ids = {id(model.get_parameter(n)) for n in self.names}
        ignored = {p for p in model.parameters() if id(p) not in shared_ids}
        group = process_group if process_group is not None else dist.group.WORLD
        self.mesh = DeviceMesh.from_group(group, device.type)
        self.module = fully_shard(model, mesh=self.mesh, reshard_after_forward=RESHARD_AFTER_FORWARD,
                                  ignored_params=ignored)

    def reshard(self) -> None:
        """Put the shards back in the model where a forward without its backward (evaluation,
        a no-grad forward) left the parameters gathered; nothing when they are sharded. The
        engine calls it before it reads the shared parameters through its layout."""
        self.module.reshard()

    def parameters(self) -> list:
        """The sharded Parameters (DTensors), in plan order (call reshard() first after a forward
        without backward)."""
        return [self.module.get_parameter(n) for n in self.names]

    def set_gradient_sync(self, enabled: bool) -> None:
        """False: gradients accumulate unsharded, without communication; True: the next backward
        reduce-scatters the accumulated sum (FSDP2's set_requires_gradient_sync)."""
        self.module.set_requires_gradient_sync(enabled)

    def local_bytes(self) -> int:
        """Bytes of this rank's shards of the shared parameters."""
        return sum(p.to_local().numel() * p.to_local().element_size() for p in self.parameters())


@contextlib.contextmanager
def fsdp_no_sync(module):
    """FSDP2's equivalent of DDP's no_sync() on a `fully_shard`ed module: gradients stay
    unsharded and unreduced inside, and the next synchronised backward reduce-scatters the sum."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)

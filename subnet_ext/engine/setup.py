"""Small pieces of SubnetDataParallel's set-up: argument checks, the (world size, rank) the
engine runs as, and hooks that hold the engine weakly."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..planning.plan import SubnetPlan
from .sharding import check_shard_shared


def world_and_rank(plan: SubnetPlan, process_group, simulate_rank) -> tuple[int, int]:
    """(world size, rank) this engine runs as: the simulated rank, the group's, or (1, 0)."""
    if simulate_rank is not None:
        if process_group is not None:
            raise ValueError("simulate_rank runs one rank alone; it takes no process_group")
        if not isinstance(simulate_rank, int) or isinstance(simulate_rank, bool) or \
                not 0 <= simulate_rank < plan.world_size:
            raise ValueError(f"simulate_rank must be a rank of the plan's world size {plan.world_size}, "
                             f"got {simulate_rank!r}")
        return plan.world_size, simulate_rank
    if dist.is_initialized():
        return dist.get_world_size(process_group), dist.get_rank(process_group)
    if process_group is not None:
        raise ValueError("a process_group was given but torch.distributed is not initialised")
    return 1, 0


def weak_call(engine_ref, fn):
    """A hook calling fn(engine, *args) while the engine lives, and nothing after."""

    def hook(*args):
        engine = engine_ref()
        if engine is not None:
            return fn(engine, *args)
        return None

    return hook


REGIMES = ("forward", "backward")
SCALES = ("none", "inverse")


def check_arguments(plan, regime: str, sync_every: int, scale: str, bucket_cap_mb: float, shard_shared: bool = False,
                    simulated: bool = False) -> None:
    """ValueError naming the argument of SubnetDataParallel that is out of range, or a
    combination shard_shared does not support."""
    if not isinstance(plan, SubnetPlan):
        raise ValueError(f"plan must be a SubnetPlan, got {type(plan).__name__}")
    if regime not in REGIMES:
        raise ValueError(f"regime must be 'forward' or 'backward', got {regime!r}")
    if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
    if scale not in SCALES:
        raise ValueError(f"scale must be 'none' or 'inverse', got {scale!r}")
    if scale == "inverse" and (plan.level != "neuron" or regime != "forward"):
        raise ValueError(f"scale='inverse' applies to the neuron level in the forward regime; this plan is "
                         f"level={plan.level!r} and regime={regime!r}")
    if not (isinstance(bucket_cap_mb, (int, float)) and 0 < bucket_cap_mb < float("inf")):
        raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
    if shard_shared:
        check_shard_shared(simulated, sync_every)

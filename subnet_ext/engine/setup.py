"""Small pieces of SubnetDataParallel's set-up: the (world size, rank) the engine runs as,
the checks of where it runs, hooks that hold the engine weakly, and the reduction of gradients."""
from __future__ import annotations

import torch.distributed as dist

from ..comm.hooks.cast import CastCompressHook
from ..comm.reduction import AllReduce, HookReduction, Reduction
from ..planning.plan import SubnetPlan
from .config import SDPConfig
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


def check_placement(config: SDPConfig, plan: SubnetPlan, simulated: bool) -> None:
    """ValueError unless `config` applies to `plan` and to where the engine runs (shard_shared
    needs real ranks under torch.distributed)."""
    config.check_plan(plan)
    if config.shard_shared:
        check_shard_shared(simulated)


def gradient_reduction(config: SDPConfig) -> Reduction:
    """How gradient buckets are averaged (comm/reduction.py): one all-reduce in the gradients'
    dtype, or with reduce_dtype the cast hook at that dtype (comm/hooks/cast.py)."""
    if config.reduce_dtype is None:
        return AllReduce()
    return HookReduction(None, CastCompressHook(config.reduce_dtype))

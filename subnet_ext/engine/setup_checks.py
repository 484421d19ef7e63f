"""Small pieces of SubnetDataParallel's set-up: the (world size, rank) the engine runs as,
the checks of where it runs, hooks that hold the engine weakly, and the reduction of gradients."""
from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from ..comm import collectives

from ..comm.hooks.cast import CastCompressHook
from ..comm.reduction import AllReduce, HookReduction, Reduction
from ..planning.plan import SubnetPlan
from .config import SDPConfig
from .shared_shards import check_shard_shared


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


def check_world(plan: SubnetPlan, world_size: int, simulated: bool) -> None:
    """ValueError unless the engine runs with as many ranks as the plan was made for, saying what
    to do: initialise torch.distributed first (a plan for K > 1 ranks in a process that runs
    alone), or plan for the group's world size."""
    if plan.world_size == world_size:
        return
    if not simulated and not dist.is_initialized():
        raise ValueError(
            f"the plan is for {plan.world_size} ranks, but torch.distributed is not initialised, so this process "
            f"would train alone. Call torch.distributed.init_process_group() before wrapping, in every process of "
            f"the job (started with e.g. `torchrun --nproc-per-node {plan.world_size} train.py`, which sets the "
            f"environment it reads), or pass simulate_rank=r to run rank r of the plan alone on this process "
            f"(its collectives are no-ops)")
    raise ValueError(f"the plan was made for world size {plan.world_size}, but the process group has "
                     f"{world_size} ranks; make the plan with world_size={world_size}")


def broadcast_initial_state(model: nn.Module, process_group, timeout: float | None) -> None:
    """Overwrite every rank's parameters and buffers with the group's rank 0's (as torch DDP does)."""
    if not dist.is_initialized():
        return
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    collectives.broadcast_by_dtype(list(model.state_dict(keep_vars=True).values()), src, process_group, timeout)


def refuse_if_simulated(what: str, simulated: bool, rank: int, world_size: int) -> None:
    """ValueError when `what` needs every rank's share of the model but the engine simulates one rank."""
    if simulated:
        raise ValueError(f"{what} needs every rank's share of the model, but this engine simulates rank "
                         f"{rank} of {world_size} alone; use evaluate(modes=('ensemble',)) for this rank's subnetwork")


def weak_call(engine_ref, fn):
    """A hook calling fn(engine, *args) while the engine lives, and nothing after."""

    def hook(*args):
        engine = engine_ref()
        if engine is not None:
            return fn(engine, *args)
        return None

    return hook


def check_placement(config: SDPConfig, plan: SubnetPlan, simulated: bool) -> None:
    """ValueError unless `config` applies to `plan` and to where the engine runs (shard_shared and
    eval_forward="full" need real ranks under torch.distributed)."""
    config.check_plan(plan)
    if config.shard_shared:
        check_shard_shared(simulated)
    if simulated and config.eval_forward == "full":
        raise ValueError("eval_forward='full' assembles the model from every rank's share, but simulate_rank runs one "
                         "rank alone; use eval_forward='subnetwork' (this rank's subnetwork)")


def gradient_reduction(config: SDPConfig) -> Reduction:
    """How gradient buckets are averaged (comm/reduction.py): one all-reduce in the gradients'
    dtype, or with reduce_dtype the cast hook at that dtype (comm/hooks/cast.py)."""
    if config.reduce_dtype is None:
        return AllReduce()
    return HookReduction(None, CastCompressHook(config.reduce_dtype))

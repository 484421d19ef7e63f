"""The engine's communication, built once from the plan, the config and this rank's layout.

The gradient reduction (setup.gradient_reduction: an all-reduce, or reduce_dtype's cast
hook) is fixed first, and the cost model picks the strategy with its wire bytes; the buckets (planning/buckets.py) fix what is averaged
together; the Communicator makes the owner-set process groups (or a SimulatedCommunicator
stands in for them); the averager, the backward regime's refresh and, with
buffer_sync="broadcast", the leader's buffers (comm/buffer_sync.py) are each handed the
typed places of this rank's pieces, nothing of the engine.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.averaging import BucketedAverager
from ..comm.buffer_sync import LeaderBuffers
from ..comm.communicator import CommCounter, Communicator, SimulatedCommunicator
from ..comm.refresh import CopyRefresher
from ..planning.buckets import build_buckets
from ..planning.costs import choose_strategy
from ..planning.plan import SubnetPlan
from ..planning.sharding import communicated_pieces
from ..state.layout import RankLayout
from .config import SDPConfig
from .wrapping import gradient_reduction


@dataclass
class EngineCommunication:
    """What the engine communicates with. counter: its `steps` is the engine's one count of
    optimizer steps. refresh: backward regime only. leader_buffers: buffer_sync="broadcast"
    with several real ranks and floating buffers only."""

    strategy: str
    strategy_costs: dict
    counter: CommCounter
    comm: Communicator
    averager: BucketedAverager
    refresh: CopyRefresher | None
    leader_buffers: LeaderBuffers | None


def build_communication(plan: SubnetPlan, layout: RankLayout, config: SDPConfig,
                        process_group: dist.ProcessGroup | None, simulated: bool, sharded: bool,
                        device: torch.device, module_sets=()) -> EngineCommunication:
    """The engine's EngineCommunication (process groups made here: every rank calls it in the same order).
    sharded: FSDP2 communicates the shared parameters (shard_shared). module_sets: owner sets whose
    group a module needs (SyncBatchNorm: sync_norm.py)."""
    rank, world_size = layout.rank, layout.world_size
    reduction = gradient_reduction(config)  # parameters (sync_every > 1) always go in their own dtype
    strategy, costs = choose_strategy(plan, config.strategy, config.latency_bytes, config.bucket_cap_bytes,
                                      shard_shared=sharded, wire=reduction if config.sync_every == 1 else None)
    counter = CommCounter()
    pieces = communicated_pieces(plan, sharded)
    broadcast_buffers = config.buffer_sync == "broadcast" and any(not p.is_param for p in pieces)
    if broadcast_buffers:  # buffers take their leader's values before the forward instead of being averaged
        pieces = [p for p in pieces if p.is_param]
    buckets = build_buckets(plan, pieces, strategy, config.bucket_cap_bytes)
    world = tuple(range(world_size))
    owner_sets = [b.owners for b in buckets] + ([world] if broadcast_buffers else [])  # the refresh: the world
    comm = SimulatedCommunicator(world_size, rank, counter) if simulated else \
        Communicator(owner_sets, world_size, rank, process_group, counter, config.timeout, module_sets)
    places = layout.averaging_places()
    averager = BucketedAverager(buckets, rank, comm, device, places, overlap=config.overlap,
                                average_gradients=config.sync_every == 1, reduction=reduction)
    refresh = CopyRefresher(layout.pieces, rank, world_size, places, comm) if config.regime == "backward" else None
    leader_buffers = LeaderBuffers(plan, layout.pieces, places, rank, comm, device) \
        if broadcast_buffers and world_size > 1 and not simulated else None
    return EngineCommunication(strategy, costs, counter, comm, averager, refresh, leader_buffers)

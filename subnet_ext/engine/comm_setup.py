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
from ..planning.buckets import build_buckets, refresh_broadcasts
from ..planning.costs.comm_costs import choose_strategy
from ..planning.plan import SubnetPlan
from ..planning.sharding import communicated_pieces
from ..state.drift_check import DriftCheck
from ..state.layout import RankLayout
from .config import SDPConfig
from .setup_checks import gradient_reduction


@dataclass
class EngineCommunication:
    """What the engine communicates with. counter: its `steps` is the engine's one count of
    optimizer steps. refresh: backward regime only. leader_buffers: buffer_sync="broadcast"
    with several real ranks and floating buffers only. drift: the owners' periodic comparison
    (state/drift_check.py; off for one rank or a simulated one)."""

    strategy: str
    strategy_costs: dict
    counter: CommCounter
    comm: Communicator
    averager: BucketedAverager
    refresh: dict  # {period: CopyRefresher} (backward regime: the pieces of each synchronisation period)
    leader_buffers: LeaderBuffers | None
    drift: DriftCheck


def piece_periods(plan: SubnetPlan, config: SDPConfig):
    """piece -> its synchronisation period (config.sync_every: the shared parameters', or its unit group's)."""
    def period(piece) -> int:
        return config.period_of(plan.units[piece.units[0]].group if piece.units else None)

    return period


def build_communication(plan: SubnetPlan, layout: RankLayout, config: SDPConfig,
                        process_group: dist.ProcessGroup | None, simulated: bool, sharded: bool,
                        device: torch.device, module_sets=(), comm: Communicator | None = None,
                        counter: CommCounter | None = None, strategy: tuple | None = None) -> EngineCommunication:
    """The engine's EngineCommunication (process groups made here: every rank calls it in the same order).
    sharded: FSDP2 communicates the shared parameters (shard_shared). module_sets: owner sets whose
    group a module needs (SyncBatchNorm: sync_norm.py). comm, counter: the communicator and counter of
    an earlier assignment of the same plan (a schedule's assignments share its owner sets: schedule.py),
    kept with their process groups and counts; strategy: (name, costs) chosen for an earlier assignment
    (the same owner sets and sizes: the same choice)."""
    rank, world_size = layout.rank, layout.world_size
    reduction = gradient_reduction(config)  # parameters (sync_every > 1) always go in their own dtype
    strategy, costs = strategy or choose_strategy(plan, config.strategy, config.latency_bytes, config.bucket_cap_bytes,
                                                  shard_shared=sharded, wire=reduction if config.every_step else None)
    counter = counter if counter is not None else CommCounter()
    pieces = communicated_pieces(plan, sharded)
    broadcast_buffers = config.buffer_sync == "broadcast" and any(not p.is_param for p in pieces)
    if broadcast_buffers:  # buffers take their leader's values before the forward instead of being averaged
        pieces = [p for p in pieces if p.is_param]
    period = piece_periods(plan, config)
    buckets = build_buckets(plan, pieces, strategy, config.bucket_cap_bytes, period)
    world = tuple(range(world_size))
    owner_sets = [b.owners for b in buckets] + ([world] if broadcast_buffers else [])  # the refresh: the world
    if comm is None:
        comm = SimulatedCommunicator(world_size, rank, counter) if simulated else \
            Communicator(owner_sets, world_size, rank, process_group, counter, config.timeout, module_sets)
    places = layout.averaging_places()
    averager = BucketedAverager(buckets, rank, comm, device, places, overlap=config.overlap, reduction=reduction)
    refresh = {}
    if config.regime == "backward":
        for h in sorted({period(p) for p in layout.pieces}):
            refresh[h] = CopyRefresher(refresh_broadcasts(plan, [p for p in layout.pieces if period(p) == h]), rank,
                                       places, comm)
    leader_buffers = LeaderBuffers(plan, layout.pieces, places, rank, comm, device) \
        if broadcast_buffers and world_size > 1 and not simulated else None
    # Compared where every synchronisation period ends (the least common multiple of the periods).
    drift = DriftCheck(layout, comm, config.drift_check_every, config.longest_period,
                       communicate=world_size > 1 and not simulated, timeout=config.timeout)
    return EngineCommunication(strategy, costs, counter, comm, averager, refresh, leader_buffers, drift)

"""Averaging among owners: packed buffers, one collective per owner set, one global order.

`OwnerGroups` makes one process group per distinct owner set (|S| > 1) once, every rank
calling `new_group` for the same sets in the same sorted order. `PackedAverager` then
averages a set of tensors piece by piece: for each owner set in that order, the ranks
of the set pack their pieces (same pieces, same order on each of them), all-reduce the
buffer and unpack it in place times 1/|S|. The zero-filled strategy instead packs every
piece at its global offset of one world-sized buffer (zeros where this rank holds
nothing) and unpacks each piece times 1/owner-count.

Every collective this rank issues is counted in `CommCounter`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from . import ops
from .collectives import as_timedelta, describe_group, wait
from .pieces import Piece, rectangle


@dataclass
class CommCounter:
    """Bytes handed to collectives and their number, over `steps` synchronised steps."""

    bytes: int = 0
    collectives: int = 0
    steps: int = 0
    by_kind: dict = field(default_factory=dict)

    def add(self, kind: str, buffer: torch.Tensor) -> None:
        n = buffer.numel() * buffer.element_size()
        self.bytes += n
        self.collectives += 1
        b, c = self.by_kind.get(kind, (0, 0))
        self.by_kind[kind] = (b + n, c + 1)


class OwnerGroups:
    """Process groups of the owner sets, in terms of ranks of `process_group`."""

    def __init__(self, owner_sets, world_size: int, process_group=None, timeout: float | None = None):
        self.world_size = world_size
        self.process_group = process_group
        self.timeout = timeout  # seconds each collective may take (None: the process group's own)
        self.groups = {}
        if world_size == 1 or not dist.is_initialized():
            return
        world_pg = process_group if process_group is not None else dist.group.WORLD
        default = process_group is None or process_group == dist.group.WORLD
        for s in sorted(set(owner_sets)):
            if len(s) < 2:
                continue
            if len(s) == world_size:
                self.groups[s] = world_pg
                continue
            ranks = list(s) if default else [dist.get_global_rank(world_pg, r) for r in s]
            # Every rank of the default group calls new_group for every set, in one order;
            # inside a user group only its members can take part, so they sync locally.
            self.groups[s] = dist.new_group(ranks, use_local_synchronization=not default,
                                            timeout=as_timedelta(timeout))

    def get(self, owner_set):
        return self.groups[owner_set]

    @property
    def world(self):
        return self.process_group

    def describe(self, owner_set) -> str:
        """How a collective error names this set: 'owner set (0, 2)' or 'world (4 ranks)'."""
        return describe_group(owner_set, self.world_size)


Resolver = Callable[[Piece], tuple]  # piece -> (tensor, rectangle) on this rank


class PackedAverager:
    """Averages pieces among their owners with packed collectives.

    pieces: the global piece list (pieces.global_pieces); only pieces with more than one
    owner take part. rank: this rank in the plan's numbering.
    """

    def __init__(self, pieces: list[Piece], rank: int, world_size: int, groups: OwnerGroups, strategy: str,
                 counter: CommCounter, plan, device: torch.device):
        self.rank, self.world_size, self.groups, self.strategy = rank, world_size, groups, strategy
        self.counter, self.plan, self.device = counter, plan, device
        self.pieces = [p for p in pieces if len(p.owners) > 1]
        self.by_set = {}
        for p in self.pieces:
            if rank in p.owners:
                self.by_set.setdefault(p.owners, []).append(p)
        self.order = sorted(self.by_set)

    def average(self, resolve: Resolver, kind: str, pieces_filter=None) -> None:
        """In place: each held piece's tensor slice becomes the mean over its owners."""
        if self.world_size == 1 or not dist.is_initialized():
            return
        if self.strategy == "zero_filled":
            return self._average_zero_filled(resolve, kind, pieces_filter)
        pending = []
        for s in self.order:
            items = [(p, *resolve(p)) for p in self.by_set[s] if pieces_filter is None or pieces_filter(p)]
            for dtype_items in _by_dtype(items):
                tensors, table, total = _table(dtype_items, offsets=None)
                buffer = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
                ops.pack_segments(tensors, table, buffer)
                self.counter.add(kind, buffer)
                work = dist.all_reduce(buffer, group=self.groups.get(s), async_op=True)
                scales = torch.full((table.shape[0],), 1.0 / len(s), dtype=torch.float32)
                pending.append((s, (work, tensors, table, buffer, scales)))
        for s, (work, tensors, table, buffer, scales) in pending:
            wait(work, "all_reduce", self.groups.describe(s), self.groups.timeout)
            ops.unpack_average_(tensors, table, buffer, scales)

    def _average_zero_filled(self, resolve, kind, pieces_filter):
        chosen = [p for p in self.pieces if pieces_filter is None or pieces_filter(p)]
        layout = {}  # dtype -> (pieces in global order, global offsets, total)
        for p in chosen:
            dt = getattr(torch, self.plan.tensor_dtypes[p.name])
            pl, offs, total = layout.get(dt, ([], [], 0))
            pl.append(p)
            offs.append(total)
            r0, r1, c0, c1 = rectangle(self.plan.tensor_shapes[p.name], p.dim, p.start, p.length)
            layout[dt] = (pl, offs, total + (r1 - r0) * (c1 - c0))
        for dt, (pl, offs, total) in layout.items():
            mine = [(p, *resolve(p)) for p in pl if self.rank in p.owners]
            my_offsets = [o for p, o in zip(pl, offs) if self.rank in p.owners]
            tensors, table, _ = _table(mine, offsets=my_offsets)
            device = tensors[0].device if tensors else self.device
            buffer = torch.zeros(total, dtype=dt, device=device)
            if tensors:
                ops.pack_segments(tensors, table, buffer)
            self.counter.add(kind, buffer)
            wait(dist.all_reduce(buffer, group=self.groups.world, async_op=True), "all_reduce",
                 self.groups.describe(range(self.world_size)), self.groups.timeout)
            if tensors:
                scales = torch.tensor([1.0 / len(p.owners) for p, _, _ in mine], dtype=torch.float32)
                ops.unpack_average_(tensors, table, buffer, scales)


def _by_dtype(items):
    groups = {}
    for it in items:
        groups.setdefault(it[1].dtype, []).append(it)
    return list(groups.values())


def _table(items, offsets):
    """(tensors, int64 [S, 6] segment table, total elements) for (piece, tensor, rect) items."""
    tensors, index, rects = [], {}, []
    for p, t, (r0, r1, c0, c1) in items:
        if id(t) not in index:
            index[id(t)] = len(tensors)
            tensors.append(t)
        rects.append((index[id(t)], r0, r1, c0, c1))
    if offsets is None:
        table, total = ops.segment_table(rects)
        return tensors, table, total
    rows = [(*r, o) for r, o in zip(rects, offsets)]
    table = torch.tensor(rows, dtype=torch.int64) if rows else torch.empty(0, 6, dtype=torch.int64)
    return tensors, table, None


def broadcast_pieces(pieces: list[Piece], rank: int, world_size: int, resolve: Resolver, counter: CommCounter,
                     process_group, kind: str = "refresh", timeout: float | None = None) -> None:
    """Backward regime refresh: each leader broadcasts the pieces it leads that some rank
    lacks; the ranks that do not own a piece overwrite their copy (scale 1, exact)."""
    if world_size == 1 or not dist.is_initialized():
        return
    for leader in range(world_size):
        led = [p for p in pieces if p.owners[0] == leader and len(p.owners) < world_size]
        for dtype_items in _by_dtype([(p, *resolve(p)) for p in led]):
            tensors, table, total = _table(dtype_items, offsets=None)
            buffer = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
            if rank == leader:
                ops.pack_segments(tensors, table, buffer)
            counter.add(kind, buffer)
            src = leader if process_group is None else dist.get_global_rank(process_group, leader)
            wait(dist.broadcast(buffer, src=src, group=process_group, async_op=True), f"broadcast from rank {leader}",
                 describe_group(range(world_size), world_size), timeout)
            keep = [i for i, (p, _, _) in enumerate(dtype_items) if rank not in p.owners]
            if keep:
                sub = table[keep]
                ops.unpack_average_(tensors, sub, buffer, torch.ones(len(keep), dtype=torch.float32))

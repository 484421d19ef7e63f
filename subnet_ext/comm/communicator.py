"""Collectives among owner sets, counted: real (torch.distributed) or simulated (no-ops).

`Communicator` makes one process group per distinct owner set (|S| > 1) once, every rank
calling `new_group` for the same sets in the same sorted order, and issues the engine's
all-reduces and broadcasts on them. `SimulatedCommunicator` runs one rank of a K-rank
job alone: every collective is a local no-op that still counts its bytes, so the memory
and time of that rank can be measured on one device.

Owner sets and ranks are in the plan's numbering (ranks of `process_group`).

The groups made here are released when the interpreter begins to exit (`release_groups`,
an atexit handler), before it tears its objects down: a gloo group that an engine still
holds after `destroy_process_group()` would otherwise be destroyed during that teardown,
where its threads can abort the process ("terminate called without an active exception")
after a run that succeeded.
"""
from __future__ import annotations

import atexit
import gc
import weakref
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist

from . import collectives
from ..vocabulary import Quantity


@dataclass
class CommCounter:
    """Bytes handed to collectives and their number, over `steps` synchronised steps."""

    bytes: int = 0
    collectives: int = 0
    steps: int = 0
    by_quantity: dict = field(default_factory=dict)

    def add(self, quantity: Quantity | str, buffer: torch.Tensor) -> None:
        """Count one collective on `buffer`: its numel x element size bytes, under `quantity` in by_quantity."""
        n = buffer.numel() * buffer.element_size()
        self.bytes += n
        self.collectives += 1
        key = str(quantity)
        b, c = self.by_quantity.get(key, (0, 0))
        self.by_quantity[key] = (b + n, c + 1)


class PendingCollective:
    """An issued asynchronous collective of the training step; `wait()` orders the current
    stream after it without blocking the host (collectives.wait_in_stream_order) and raises
    collectives.CollectiveError naming the operation and the group when it fails or
    outlasts its group's timeout."""

    def __init__(self, work: dist.Work | None, operation: str, group: str, timeout: float | None,
                 tensor: torch.Tensor | None = None):
        self.work, self.operation, self.group, self.timeout = work, operation, group, timeout
        self.tensor = tensor  # what the collective writes (a simulated one leaves it as it is)

    def wait(self) -> None:
        """Order the current stream after the collective (gloo: block until it completes);
        raise collectives.CollectiveError on failure or after the group's timeout."""
        if self.work is not None:
            collectives.wait_in_stream_order(self.work, self.operation, self.group, self.timeout)

    def future(self) -> torch.futures.Future:
        """The collective as a torch Future whose value is [tensor], as `work.get_future()`
        gives (a simulated one: already completed); what a comm hook returns or chains."""
        if self.work is not None:
            return self.work.get_future()
        done = torch.futures.Future()
        done.set_result([self.tensor])
        return done


class Communicator:
    """Issues the engine's collectives on per-owner-set process groups.

    Args:
        owner_sets: every owner set the engine may communicate in (tuples of ranks).
        world_size, rank: the plan's world size and this rank.
        process_group: the group the plan's ranks live in (None: the default group).
        counter: where bytes and collectives are counted.
        timeout: seconds any collective may wait for its peers before
            collectives.CollectiveError (None: the process group's own timeout). It is
            the timeout of the groups made here: one per owner set, and, when a timeout
            is given and the plan's ranks are the default group's, one of all of them for
            the world-wide buckets and the refresh (so that the default group's own timeout
            does not apply; a `process_group` given is used as it is, with its timeout). The waits
            themselves pass no timeout: a host-side deadline would make the CPU wait for
            every bucket on NCCL.
        module_sets: owner sets whose group a module needs (a SyncBatchNorm's), made even
            for one rank (`group_for`).
    """

    simulated = False

    def __init__(self, owner_sets: Iterable[tuple], world_size: int, rank: int,
                 process_group: dist.ProcessGroup | None, counter: CommCounter, timeout: float | None = None,
                 module_sets: Iterable[tuple] = ()):
        self.world_size, self.rank, self.process_group, self.counter = world_size, rank, process_group, counter
        self.timeout = timeout
        self.groups = {}
        self.world_group = process_group
        if world_size == 1:
            return
        world_pg = process_group if process_group is not None else dist.group.WORLD
        default = process_group is None or process_group == dist.group.WORLD
        kwargs = {} if timeout is None else {"timeout": collectives.as_timedelta(timeout)}
        world = tuple(range(world_size))
        module_sets = set(module_sets)
        sets = set(owner_sets) | module_sets | ({world} if timeout is not None else set())
        for s in sorted(sets):
            if len(s) < 2 and s not in module_sets:
                continue
            # All of a given group's ranks: that group itself. A group made inside it would be made by
            # its members only (below), which advances torch's count of groups on them alone, so the
            # next new_group of the whole world would hang (distributed_c10d._process_group_name);
            # the world-wide collectives then keep the given group's own timeout.
            if len(s) == world_size and (timeout is None or not default):
                self.groups[s] = world_pg
                continue
            ranks = list(s) if default else [dist.get_global_rank(world_pg, r) for r in s]
            # Every rank of the default group calls new_group for every set, in one order;
            # inside a user group only its members can take part, so they sync locally.
            self.groups[s] = dist.new_group(ranks, use_local_synchronization=not default, **kwargs)
        self.world_group = self.groups.get(world, process_group)
        _LIVE.add(self)

    def group_for(self, owners: tuple) -> dist.ProcessGroup | None:
        """The process group of plan ranks `owners` (one of the sets this communicator was made
        with; all the plan's ranks: the engine's world group, None meaning the default group)."""
        return self.world_group if len(owners) == self.world_size else self.groups[tuple(owners)]

    def release(self) -> None:
        """Drop this communicator's references to the process groups it made (at exit)."""
        self.groups, self.world_group = {}, self.process_group

    def _global(self, rank: int) -> int:
        return rank if self.process_group is None else dist.get_global_rank(self.process_group, rank)

    def group_of(self, owners: tuple) -> dist.ProcessGroup | None:
        """The process group of owner set `owners` (None on a simulated rank)."""
        return self.groups.get(owners)

    def all_reduce(self, buffer: torch.Tensor, owners: tuple, quantity: Quantity | str) -> PendingCollective:
        """Asynchronous sum of `buffer` over `owners` (in place)."""
        self.counter.add(quantity, buffer)
        work = dist.all_reduce(buffer, group=self.groups[owners], async_op=True)
        return PendingCollective(work, f"all_reduce of {quantity}",
                                 collectives.describe_group(owners, self.world_size), self.timeout, buffer)

    def broadcast(self, buffer: torch.Tensor, src: int, quantity: Quantity | str) -> None:
        """Broadcast of `buffer` from plan rank `src` to every rank; the current stream is
        ordered after it (NCCL: the host does not wait)."""
        self.counter.add(quantity, buffer)
        work = dist.broadcast(buffer, src=self._global(src), group=self.world_group, async_op=True)
        collectives.wait_in_stream_order(work, f"broadcast of {quantity} from rank {src}",
                                         collectives.describe_group(range(self.world_size), self.world_size),
                                         self.timeout)


    def exchange(self, ops: list, quantity: Quantity | str) -> None:
        """Point-to-point messages: ops = [("send" | "recv", contiguous tensor, plan rank of the peer)],
        posted together (torch's batch_isend_irecv) and waited for; the sends' bytes are counted.
        Every rank lists its messages to and from each peer in one agreed order."""
        if not ops:
            return
        p2p = []
        for kind, tensor, peer in ops:
            if kind == "send":
                self.counter.add(quantity, tensor)
            p2p.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, self._global(peer),
                                  group=self.process_group))
        for work in dist.batch_isend_irecv(p2p):
            collectives.wait(work, f"{quantity} exchange", collectives.describe_group(range(self.world_size),
                                                                                       self.world_size), self.timeout)


_LIVE: "weakref.WeakSet[Communicator]" = weakref.WeakSet()  # communicators that made process groups


def release_groups() -> None:
    """Release every live communicator's process groups, then collect: run at interpreter exit
    (atexit runs before the teardown, while destroying a gloo group is still safe). The
    engines cannot communicate afterwards; nothing does once the program has ended."""
    for communicator in list(_LIVE):
        communicator.release()
    gc.collect()


atexit.register(release_groups)


class SimulatedCommunicator(Communicator):
    """Rank `rank` of a `world_size`-rank job, alone: collectives count bytes and do nothing.

    Buffers keep this rank's values, so an average among owners becomes "every owner held
    what this rank holds" (the engine unpacks with scale 1).
    """

    simulated = True

    def __init__(self, world_size: int, rank: int, counter: CommCounter):
        self.world_size, self.rank, self.process_group, self.counter = world_size, rank, None, counter
        self.timeout, self.groups, self.world_group = None, {}, None

    def group_of(self, owners):
        """None: a simulated rank has no process groups."""
        return None

    def all_reduce(self, buffer, owners, quantity):
        """Count the bytes of `buffer`; no communication (the buffer keeps this rank's values)."""
        self.counter.add(quantity, buffer)
        return PendingCollective(None, f"all_reduce of {quantity}", "", None, buffer)

    def broadcast(self, buffer, src, quantity):
        """Count the bytes of `buffer`; no communication (the buffer keeps this rank's values)."""
        self.counter.add(quantity, buffer)

    def exchange(self, ops, quantity):
        """Count the sends' bytes; no communication (a received buffer keeps what it held)."""
        for kind, tensor, _ in ops:
            if kind == "send":
                self.counter.add(quantity, tensor)

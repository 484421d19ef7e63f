"""Collective methods called in the same order on every rank, or an error that says who called what.

A DDP script often does its evaluation and checkpointing under `if master_process:`. With
SDP, `full_state_dict()`, `evaluate()` and the like are collectives: called on rank 0 alone,
their all-reduce meets the other ranks' gradient all-reduce on the same group, and gloo
aborts the process ("Received data size doesn't match expected size") while NCCL hangs or
mixes the two buffers.

`CallLedger.collective(name)` runs before each such method (not on the per-step gradient
path). The agreement goes through the c10d store, never through a process group, so a call
that only some ranks make cannot meet a data collective of another size:

- each rank sets `call/<rank>/<n>` = the method of its n-th collective-method call;
- the group's rank 0 waits for every rank's key n, compares them and sets `verdict/<n>`
  (empty: go on; else what each rank called); every other rank waits for that verdict.
  O(K) store requests per call, none per training step;
- a rank that does not come (it is training, or stuck): rank 0's wait times out. A rank
  whose own collective fails meanwhile (`CollectiveError`, e.g. the gradient all-reduce
  waiting for the rank that went elsewhere) writes what it was doing to `failure/<rank>`
  (`describe_failure`, run for every failed collective), so both sides name both calls:
  "rank 0 called full_state_dict (#3); rank 1 was in all_reduce of gradients on world
  (2 ranks), after 17 optimizer steps". Both raise CallOrderError: the rank whose data
  collective failed because a peer went into a collective method raises it instead of the
  plain CollectiveError, so one `except CallOrderError` catches it on every rank.

Calls nest (evaluate() assembles the full state): only the outermost is checked. Without a
c10d store (torch.distributed not initialised, one rank, a simulated rank) calls are only
counted.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import time
import weakref

import torch.distributed as dist

from . import collectives
from .communicator import CommCounter

_LEDGERS: "weakref.WeakSet[CallLedger]" = weakref.WeakSet()  # live ledgers, told of failed collectives
_NAMESPACES: dict = {}  # group name -> ledgers made on it in this process (the same order on every rank)
_POLL_SECONDS = 0.05


class CallOrderError(collectives.CollectiveError):
    """The ranks did not call the same collective method at the same point.

    Attributes: calls (one line per rank: what it called or was doing), timed_out
    (True when some rank did not come), operation, group, timeout.
    """

    def __init__(self, calls: list[str], timeout: float, timed_out: bool,
                 operation: str = "collective-method order check", group: str = "the engine's ranks"):
        self.calls, self.timed_out, self.timeout = calls, timed_out, timeout
        self.operation, self.group = operation, group
        how = (f"a collective method was not called by every rank within {timeout:g} s" if timed_out
               else "the ranks called different collective methods")
        RuntimeError.__init__(
            self, f"SubnetDataParallel: {how}: {'; '.join(calls)}. full_state_dict, full_optimizer_state_dict, "
            "full_model, evaluate, verify_consistency, close and checkpoint saves and loads are collectives: every "
            "rank must call them, in the same order. Call them on every rank (not only under `if master_process:`) "
            "and use rank 0's result.")


def _call_text(seq: int, name: str) -> str:
    return f"{name} (#{seq})"


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None  # no side channel: calls are only counted


class CallLedger:
    """This rank's count of collective-method calls, the order check, and the failure notes.

    Args:
        process_group: the engine's group (None: the world). Every rank of it must make its
            ledgers in the same order (they are told apart by that order).
        world_size, rank: the group's size and this rank in it (world_size 1: nothing is exchanged).
        timeout: seconds rank 0 waits for the others' calls (None: the store's timeout).
        communicate: False for a simulated rank (counts calls, exchanges nothing).
        counter: the engine's CommCounter; its `steps` say where this rank is in training
            ("after 17 optimizer steps") in the failure notes.
    """

    def __init__(self, process_group: dist.ProcessGroup | None, world_size: int, rank: int, timeout: float | None,
                 communicate: bool = True, counter: CommCounter | None = None):
        self.world_size, self.rank, self.counter = world_size, rank, counter
        self.seq, self.depth, self.last, self.closed = 0, 0, "", False
        store = _default_store() if communicate and world_size > 1 and dist.is_initialized() else None
        self.store = None
        if store is None:
            return
        self.timeout = timeout if timeout is not None else store.timeout.total_seconds()
        group = "world" if process_group is None or process_group == dist.group.WORLD else process_group.group_name
        index = _NAMESPACES[group] = _NAMESPACES.get(group, -1) + 1
        self.store = dist.PrefixStore(f"subnet_ext/calls/{group}/{index}/", store)
        _LEDGERS.add(self)

    @contextlib.contextmanager
    def collective(self, name: str):
        """Context around a collective method `name`: checked on entry unless nested in another
        (or the ledger was closed: the engine then refuses the call itself)."""
        if self.depth == 0 and not self.closed:
            self.check(name)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def close(self) -> None:
        """Stop checking and taking part in failure notes (the engine was closed)."""
        self.closed = True
        _LEDGERS.discard(self)

    def check(self, name: str) -> None:
        """Raise CallOrderError on every rank unless every rank is calling `name` as its
        collective-method call number `seq` (see the module docstring)."""
        self.seq += 1
        self.last = name
        if self.store is None:
            return
        self._set(f"call/{self.rank}/{self.seq}", name)
        if self.seq > 2:  # every rank has read the keys of call seq - 2 before writing those of seq - 1
            self._delete(f"call/{self.rank}/{self.seq - 2}")
            if self.rank == 0:
                self._delete(f"verdict/{self.seq - 2}")
        verdict = self._decide(name) if self.rank == 0 else self._await_verdict(name)
        if verdict:
            kind, _, lines = verdict.partition("|")
            raise CallOrderError(lines.split("\n"), self.timeout, timed_out=kind == "timeout")

    def _decide(self, name: str) -> str:
        """Rank 0: wait for every rank's call, compare, publish the verdict ('' = agreed)."""
        keys = [f"call/{r}/{self.seq}" for r in range(self.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
            calls = [v.decode(errors="replace") for v in self.store.multi_get(keys)]
            verdict = "" if all(c == name for c in calls) else "mismatch|" + "\n".join(
                f"rank {r} called {_call_text(self.seq, c)}" for r, c in enumerate(calls))
        except RuntimeError:  # DistStoreError on timeout: somebody did not come
            verdict = "timeout|" + "\n".join(self._report(name))
        self._set(f"verdict/{self.seq}", verdict)
        return verdict

    def _await_verdict(self, name: str) -> str:
        """Other ranks: rank 0's verdict, or, when rank 0 reports a failed collective of its own
        (it is training, not here) or never answers, a report of our own."""
        deadline = time.monotonic() + 2 * self.timeout + 5  # rank 0 waits `timeout`, then up to as long for notes
        key = f"verdict/{self.seq}"
        while time.monotonic() < deadline:
            try:  # the store answers when the key is set: one request a second while rank 0 is away
                self.store.wait([key], datetime.timedelta(seconds=1))
                return self.store.get(key).decode(errors="replace")
            except RuntimeError:
                if self._get("failure/0") is not None:
                    break
                time.sleep(_POLL_SECONDS)  # a store that fails at once (its host is gone) is not asked in a loop
        return "timeout|" + "\n".join(self._report(name, grace=0.0))

    # ------------------------------------------------------------------ store helpers
    def _set(self, key: str, value: str) -> None:
        try:
            self.store.set(key, value)
        except RuntimeError:
            pass  # the store's host is gone: the notes are a courtesy, the errors are raised anyway

    def _delete(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except RuntimeError:
            pass

    def _get(self, key: str) -> str | None:
        try:
            return self.store.get(key).decode(errors="replace") if self.store.check([key]) else None
        except RuntimeError:
            return None

    def _report(self, name: str, grace: float | None = None) -> list[str]:
        """One line per rank after the wait for call `seq` timed out: each peer's call seq, or the
        note it left when its own collective failed (waited for up to `grace`, default the
        timeout), or that it said nothing."""
        grace = self.timeout if grace is None else grace
        lines = [f"rank {self.rank} called {_call_text(self.seq, name)}"]
        deadline = time.monotonic() + grace
        for peer in (r for r in range(self.world_size) if r != self.rank):
            called = self._get(f"call/{peer}/{self.seq}")
            note = None
            while called is None and note is None:
                note = self._get(f"failure/{peer}")
                if note is None and time.monotonic() >= deadline:
                    break
                if note is None:
                    time.sleep(_POLL_SECONDS)
            if note is not None:
                self._set(f"seen/{peer}/{self.rank}", "1")  # its writer may now go (and take the store with it)
            lines.append(f"rank {peer} called {_call_text(self.seq, called)}" if called is not None else note or
                         f"rank {peer} did not call {name} (#{self.seq}) and reported no failed collective (still "
                         "computing, stuck elsewhere, or gone)")
        return lines

    def describe_failure(self, error: collectives.CollectiveError) -> CallOrderError | None:
        """Record, for the other ranks, that this rank's collective `error` failed; return the
        CallOrderError to raise instead, naming what the ranks were doing, when some peer called a
        collective method this rank did not (None otherwise: the failure has another cause)."""
        progress = f"after {self.counter.steps} optimizer steps" if self.counter is not None else None
        mine = f"rank {self.rank} was in {error.operation} on {error.group}" + (f", {progress}" if progress else "")
        called = {p: self._get(f"call/{p}/{self.seq + 1}") for p in range(self.world_size) if p != self.rank}
        ahead = {p: c for p, c in called.items() if c is not None}
        self._set(f"failure/{self.rank}", mine)
        if not ahead:
            return None
        try:  # the ranks waiting in a collective method read this note; this process may host the store
            self.store.wait([f"seen/{self.rank}/{p}" for p in ahead], datetime.timedelta(seconds=min(self.timeout, 10)))
        except RuntimeError:
            pass
        lines = [f"rank {p} called {_call_text(self.seq + 1, c)}" for p, c in sorted(ahead.items())]
        last = _call_text(self.seq, self.last) if self.seq else "none yet"
        return CallOrderError(lines + [f"{mine} (this rank; its last collective method: {last})"], self.timeout,
                              timed_out=True, operation=error.operation, group=error.group)


def describe_failure(error: collectives.CollectiveError) -> CallOrderError | None:
    """The CallOrderError a live ledger gives for a failed collective, or None (collectives.py calls
    this for every failure; each ledger also leaves its note for the other ranks)."""
    found = [e for e in (ledger.describe_failure(error) for ledger in list(_LEDGERS)) if e is not None]
    return found[0] if found else None


collectives.add_failure_note(describe_failure)


def collective_method(method=None, *, agree: tuple = ()):
    """Decorator for a method of an object with a `_call_ledger` (CallLedger): the method is a
    collective, checked on entry (see CallLedger.collective). Named by its own name and, for
    the arguments listed in `agree` that differ from their defaults, their values (e.g.
    `full_state_dict(rank0_only=True)`): ranks that pass different values would issue
    different collectives, so they must agree."""
    if method is None:
        return functools.partial(collective_method, agree=agree)
    name = method.__name__
    signature = inspect.signature(method) if agree else None

    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        call = name
        if signature is not None:
            given = signature.bind(self, *args, **kwargs).arguments
            options = [f"{k}={given[k]!r}" for k in agree
                       if k in given and given[k] != signature.parameters[k].default]
            call += f"({', '.join(options)})" if options else ""
        with self._call_ledger.collective(call):
            return method(self, *args, **kwargs)

    return checked

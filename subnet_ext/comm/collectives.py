"""Collectives that fail with a named error instead of hanging when a peer is gone.

A gloo or NCCL collective whose peer died or never arrives blocks until the process
group's timeout (30 minutes by default) and then fails with a message that names
neither the operation nor the ranks. Here every collective the engine issues is
started asynchronously and waited on with a deadline; on timeout or failure the error
says which operation, on which group of ranks, and what to do. Off the training step
the deadline is a host wait (`wait(..., timeout=)`); in the step it is the process
group's own timeout (`wait_in_stream_order`), so NCCL collectives never block the host.

    work = dist.all_reduce(buffer, group=g, async_op=True)
    wait(work, "all_reduce", "owner set (0, 2)", timeout=60.0)

After a `CollectiveError` the process group is unusable (the peers disagree on what
was exchanged): stop the job and restart it from the last checkpoint
(`torchrun --max-restarts N ... --resume auto` does that by itself).
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective did not complete: timed out or failed because a peer is gone.

    Attributes: operation ("all_reduce", ...), group (a description of its ranks),
    timeout (seconds, or None for the process group's own timeout).
    """

    def __init__(self, operation: str, group: str, timeout: float | None, cause: BaseException):
        self.operation, self.group, self.timeout = operation, group, timeout
        timed_out = "timed out" in str(cause).lower() or "timeout" in str(cause).lower()
        if timed_out:
            limit = f"{timeout:g} s" if timeout is not None else "the process group's timeout"
            what = f"did not complete within {limit}"
        else:
            what = f"failed ({type(cause).__name__}: {cause})"
        super().__init__(
            f"{operation} on {group} {what}. A rank of that group "
            "is gone, stuck or issuing different collectives. Check the other ranks' logs; the process group cannot "
            "be used any more, so restart the job from its last checkpoint (torchrun --max-restarts with "
            "--resume auto does this), or raise the timeout if steps are legitimately this slow.")


_FAILURE_NOTES: list = []  # callables (CollectiveError) -> str | CollectiveError | None, see add_failure_note


def add_failure_note(note) -> None:
    """Have note(error) run for every failed collective (`failure`): a text it returns is appended
    to the error's message; a CollectiveError it returns is raised instead, when the note knows
    the cause better (call_check.py: a peer called a collective method this rank did not, so
    this rank raises the CallOrderError its peer raises). Registered once."""
    if note not in _FAILURE_NOTES:
        _FAILURE_NOTES.append(note)


def failure(operation: str, group: str, timeout: float | None, cause: BaseException) -> CollectiveError:
    """The error to raise for a collective that failed: a CollectiveError naming `operation` and
    `group` with the registered notes appended, or the error a note gives instead."""
    error = CollectiveError(operation, group, timeout, cause)
    texts = []
    for note in list(_FAILURE_NOTES):
        try:
            result = note(error)
        except Exception as e:  # a note must never hide the failure it annotates
            result = f"(could not tell what the other ranks were doing: {type(e).__name__}: {e})"
        if isinstance(result, CollectiveError):
            return result
        if result:
            texts.append(result)
    if texts:
        error.args = (f"{error.args[0]} {' '.join(texts)}",)
    return error


def as_timedelta(timeout: float | None) -> datetime.timedelta | None:
    """Seconds -> timedelta (None stays None); rejects values that are not positive and finite."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"a collective timeout must be a positive, finite number of seconds, got {timeout!r}")
    return datetime.timedelta(seconds=float(timeout))


def describe_group(ranks, world_size: int | None = None) -> str:
    """'world (4 ranks)' or 'owner set (0, 2)': how errors name a group of plan ranks."""
    ranks = tuple(int(r) for r in ranks)
    if world_size is not None and len(ranks) == world_size:
        return f"world ({world_size} ranks)"
    return f"owner set {ranks}"


def group_ranks(group=None) -> str:
    """A description of a process group by its global ranks (the world when None)."""
    if group is None or group == dist.group.WORLD:
        return f"world ({dist.get_world_size()} ranks)"
    return f"group of global ranks {tuple(dist.get_process_group_ranks(group))}"


def staging_device(group, device: torch.device) -> torch.device:
    """Where a small tensor the host builds and reads (hashes, step counts) takes part in a
    collective on `group` (None: the default group): the CPU where the group's backend takes
    CPU tensors (gloo, or "cpu:gloo,cuda:nccl"), else `device`, the engine's GPU (NCCL takes
    CUDA tensors only, and a CPU tensor fails with "No backend type associated with device type cpu")."""
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
        takes_cpu = any(pair.split(":")[0].strip() == "cpu" for pair in backend.split(","))
    else:
        takes_cpu = "cpu" in dist.Backend.backend_capability.get(backend, ("cpu",))
    return torch.device("cpu") if takes_cpu else torch.device(device)


def wait(work, operation: str, group: str, timeout: float | None = None) -> None:
    """Wait for an async collective; CollectiveError after `timeout` seconds or on failure.

    For collectives off the training step (checkpoints, evaluation, consistency checks):
    with a timeout, the host blocks until the collective ends (on NCCL too). The step's
    own collectives use `wait_in_stream_order` instead.

    Args:
        work: what `dist.<collective>(..., async_op=True)` returned.
        operation, group: how the error names the collective and its ranks.
        timeout: seconds; None waits for the process group's own timeout.
    """
    _wait(work, operation, group, timeout, host_deadline=timeout is not None)


def wait_in_stream_order(work, operation: str, group: str, group_timeout: float | None = None) -> None:
    """Wait for a collective of the training step without a host deadline.

    `work.wait()` with no argument: on NCCL the current stream waits for the collective
    and the host goes on queueing work (no synchronisation); on gloo the host waits. The
    deadline is the process group's own timeout, set when the group was made (the engine
    makes its groups with its `timeout`), so a peer that is gone is still an error, not a
    hang: gloo raises here (turned into a CollectiveError naming `operation` and
    `group`), NCCL's watchdog aborts the communicator.

    Args:
        work, operation, group: as `wait`.
        group_timeout: the seconds the group was created with (None: torch's default),
            named in the error message only.
    """
    _wait(work, operation, group, group_timeout, host_deadline=False)


def _wait(work, operation: str, group: str, timeout: float | None, host_deadline: bool) -> None:
    try:
        done = work.wait(as_timedelta(timeout)) if host_deadline else work.wait()
    except RuntimeError as e:  # DistBackendError and gloo's "Operation timed out!" are RuntimeErrors
        raise failure(operation, group, timeout, e) from e
    if done is False:  # some backends report a timeout by returning False
        raise failure(operation, group, timeout, TimeoutError("wait returned False"))


def all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM, timeout: float | None = None,
               label: str | None = None, operation: str = "all_reduce") -> torch.Tensor:
    """In-place all_reduce with a deadline; returns `tensor`. `operation` names it in errors."""
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    wait(work, operation, label or group_ranks(group), timeout)
    return tensor


def reduce(tensor: torch.Tensor, dst: int, group=None, op=dist.ReduceOp.SUM, timeout: float | None = None,
           label: str | None = None, operation: str = "reduce") -> torch.Tensor:
    """In-place reduce onto global rank `dst` with a deadline; returns `tensor` (the result on
    `dst` only: other ranks' tensors are left undefined, as torch's reduce leaves them)."""
    work = dist.reduce(tensor, dst=dst, op=op, group=group, async_op=True)
    wait(work, operation, label or group_ranks(group), timeout)
    return tensor


def broadcast(tensor: torch.Tensor, src: int, group=None, timeout: float | None = None,
              label: str | None = None) -> torch.Tensor:
    """In-place broadcast from global rank `src` with a deadline; returns `tensor`."""
    work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    wait(work, "broadcast", label or group_ranks(group), timeout)
    return tensor


def all_gather(tensor: torch.Tensor, group=None, timeout: float | None = None, label: str | None = None
               ) -> torch.Tensor:
    """[group size, *tensor.shape]: every rank's `tensor`, with a deadline."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(parts, tensor.contiguous(), group=group, async_op=True)
    wait(work, "all_gather", label or group_ranks(group), timeout)
    return torch.stack(parts)


def _by_dtype(tensors: list[torch.Tensor]) -> dict:
    """{dtype: [indices into tensors]}, in first-seen order (the same on every rank when
    every rank passes the same list of shapes and dtypes)."""
    out = {}
    for i, t in enumerate(tensors):
        out.setdefault(t.dtype, []).append(i)
    return out


def all_reduce_by_dtype(tensors: list[torch.Tensor], group=None, op=dist.ReduceOp.SUM, timeout: float | None = None,
                        label: str | None = None, operation: str = "all_reduce") -> list[torch.Tensor]:
    """All-reduce a list of tensors with one collective per dtype (flattened and concatenated).

    Args:
        tensors: any shapes; every rank passes the same shapes and dtypes in the same order.
        op, timeout: as `all_reduce`. label: the group's description in errors;
            operation: the collective's name in errors (e.g. "all_reduce (full state)").
    Returns:
        the reduced tensors, same shapes and order (views of the per-dtype flat buffers;
        the inputs are left as they were).
    """
    out = list(tensors)
    for indices in _by_dtype(tensors).values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        work = dist.all_reduce(flat, op=op, group=group, async_op=True)
        wait(work, operation, label or group_ranks(group), timeout)
        for i, part in zip(indices, flat.split([tensors[i].numel() for i in indices])):
            out[i] = part.view(tensors[i].shape)
    return out


def broadcast_by_dtype(tensors: list[torch.Tensor], src: int, group=None, timeout: float | None = None,
                       label: str | None = None) -> None:
    """Overwrite every tensor of the list with global rank `src`'s values, one broadcast per
    dtype (flattened and concatenated). Every rank passes the same shapes and dtypes."""
    with torch.no_grad():
        for indices in _by_dtype(tensors).values():
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in indices])
            broadcast(flat, src, group, timeout, label)
            for i, part in zip(indices, flat.split([tensors[i].numel() for i in indices])):
                tensors[i].copy_(part.view(tensors[i].shape))

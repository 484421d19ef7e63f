"""The seam of averaging: how one bucket's packed gradients become their average.

The averager (averaging.py) packs a bucket's gradients into its flat buffer, in the
gradients' own dtype, and hands the bucket to a `Reduction`, which issues the collectives;
at the end of the backward it waits for the reduction and unpacks the buffer into the
gradients times each piece's scale. Two reductions:

- `AllReduce` (the default): the buffer summed in place, in its own dtype, by one
  all-reduce on the bucket's process group; the unpack multiplies by 1/owner-count.
- `HookReduction(state, hook)`, torch DDP's `register_comm_hook(state, hook)`:
  `hook(state, bucket)` receives a `CommBucket` and returns the mean of the buffer over
  the bucket's group, as DDP's hooks do: a Tensor, or anything whose wait() gives one (a
  torch.futures.Future, also of [tensor] as `work.get_future()` gives, or an object that
  finishes the work when waited for: the engine waits for its buckets at the end of the
  backward, in the one global bucket order); the averager copies it into the buffer
  when it is another tensor (a wire dtype is cast back there), and the unpack multiplies
  each piece by group size / owner-count (1 in a bucket of one owner set). What goes on
  the wire is the hook's: the built-in ones are in comm/hooks/, one file each, and
  `SDPConfig.reduce_dtype` is the cast hook (hooks/cast.py).

So the gradient's dtype (the buffer's) and the wire's are separate, and a new compression
is one file: a hook, with its `collective_bytes(state, bucket)` for the cost model
(planning/costs/comm_costs.py, WireModel). Parameters (sync_every > 1) and the refresh always go by
AllReduce in their own dtype: rounding the parameters themselves would lose them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..planning.buckets import Bucket
from . import collectives
from .communicator import Communicator, PendingCollective
from ..vocabulary import Quantity


@dataclass(frozen=True)
class BucketPiece:
    """One piece in a bucket's buffer: buffer[offset : offset + rows * columns] is its
    rectangle stored row-major, a [rows, columns] matrix. owners: the ranks that average it;
    held: this rank holds it (in a zero-filled bucket the others are zeros here)."""

    name: str
    offset: int
    rows: int
    columns: int
    owners: tuple
    held: bool


class CommBucket:
    """One bucket as a comm hook sees it (torch DDP's GradBucket): the flat buffer holding this
    rank's packed gradients, the group that averages it, and its pieces.

    Attributes:
        owners: the plan ranks that take part: the bucket's owner set, or every rank for a
            zero-filled bucket (strategy "zero_filled").
        process_group: their process group; None on a simulated rank.
        group_size: how many ranks' values the collectives sum: len(owners), or 1 on a
            simulated rank (alone: its collectives count their bytes and change nothing).
        scale: 1 / group_size, the averaging scale a hook applies (the sum over the group
            times scale is the mean it returns). In a zero-filled bucket the engine then
            multiplies each piece by group_size / its owner count.
        pieces: the BucketPiece of each piece, in buffer order.
    """

    def __init__(self, layout: Bucket, index: int, rank: int, buffer: torch.Tensor, comm: Communicator):
        self.layout, self._index, self._buffer, self._comm = layout, index, buffer, comm
        self.owners = layout.owners
        self.group_size = 1 if comm.simulated else len(layout.owners)
        self.scale = 1.0 / self.group_size
        self.pieces = tuple(BucketPiece(p.name, off, rows, cols, p.owners, rank in p.owners)
                            for p, off, (rows, cols) in zip(layout.pieces, layout.offsets, layout.shapes))
        self._matrices = None

    @property
    def process_group(self):
        """The owners' process group, asked of the communicator at each use (it holds the
        groups alone, so that releasing them at exit leaves no reference here)."""
        return self._comm.group_of(self.owners)

    def buffer(self) -> torch.Tensor:
        """The flat buffer [numel] in the gradients' dtype: this rank's packed gradients (zeros in
        the alignment gaps and, zero-filled, where it holds nothing). A hook may work in it."""
        return self._buffer

    def index(self) -> int:
        """The bucket's position in the one global launch order: the same on every rank and at
        every step, the key for a hook's per-bucket state."""
        return self._index

    def matrices(self) -> list[torch.Tensor]:
        """Each piece's [rows, columns] view of the buffer, in buffer order."""
        if self._matrices is None:
            self._matrices = [self._buffer.narrow(0, p.offset, p.rows * p.columns).view(p.rows, p.columns)
                              for p in self.pieces]
        return list(self._matrices)

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Sum `tensor` over the bucket's group, in place, asynchronously: the collective a hook
        issues (counted as gradients in comm_stats()). Returns a Future whose value is [tensor]."""
        return self.issue(tensor, Quantity.GRADIENTS).future()

    def issue(self, tensor: torch.Tensor, quantity: Quantity) -> PendingCollective:
        """The counted all-reduce (sum) of `tensor` over the bucket's group, filed under `quantity`."""
        return self._comm.all_reduce(tensor, self.owners, quantity)


class CommHook(Protocol):
    """hook(state, bucket) -> the mean of bucket.buffer() over the bucket's group: a Tensor, or an
    object whose wait() returns one (a torch.futures.Future, also of [tensor]). A hook may also have
    collective_bytes(state, layout: planning.buckets.Bucket) -> [bytes of each collective],
    for comm_stats()'s prediction."""

    def __call__(self, state: Any, bucket: CommBucket) -> torch.Tensor | torch.futures.Future:
        """Issue the bucket's collectives; return its mean over the group (or a Future of it)."""


class PendingReduction(Protocol):
    """A reduction in flight; wait() returns once the bucket's buffer holds its result."""

    def wait(self) -> None:
        """Wait (in stream order) until the bucket's buffer holds the result."""


class Reduction:
    """How one bucket's buffer becomes its average among the bucket's ranks.

    averages_over_group: False when the buffer afterwards holds the sum over the group (the
    unpack scales each piece by 1/owner-count), True when it holds the mean (by
    group size/owner-count). start() issues the collectives; collective_bytes() is the cost
    model's view of them (planning/costs/comm_costs.py WireModel)."""

    averages_over_group = False
    name = "reduction"

    def start(self, bucket: CommBucket) -> PendingReduction:
        """Issue the collectives of `bucket` (its buffer packed); the averager waits on the result."""
        raise NotImplementedError

    def collective_bytes(self, bucket: Bucket) -> list[int] | None:
        """Bytes of each collective start() issues for a bucket of this layout (None: unknown)."""
        raise NotImplementedError


class AllReduce(Reduction):
    """The default: one all-reduce (sum) of the whole buffer, in its own dtype, filed under `quantity`."""

    name = "all_reduce"

    def __init__(self, quantity: Quantity = Quantity.GRADIENTS):
        self.quantity = quantity

    def start(self, bucket: CommBucket) -> PendingCollective:
        """The buffer's all-reduce, in place."""
        return bucket.issue(bucket.buffer(), self.quantity)

    def collective_bytes(self, bucket: Bucket) -> list[int]:
        """The whole buffer, alignment gaps included."""
        return [bucket.nbytes]


class HookReduction(Reduction):
    """A comm hook as the reduction of gradient buckets: hook(state, bucket) per bucket."""

    averages_over_group = True

    def __init__(self, state: Any, hook: CommHook):
        self.state, self.hook = state, hook
        self.name = getattr(hook, "__name__", type(hook).__name__)

    def start(self, bucket: CommBucket) -> PendingReduction:
        """Call the hook; its result is copied into the buffer when waited for."""
        return _HookResult(self.hook(self.state, bucket), bucket, self.name)

    def collective_bytes(self, bucket: Bucket) -> list[int] | None:
        """The hook's own `collective_bytes(state, bucket)`, or None when it has none."""
        predict = getattr(self.hook, "collective_bytes", None)
        return None if predict is None else predict(self.state, bucket)


class _HookResult:
    """A hook's result until the averager needs it in the bucket's buffer."""

    def __init__(self, result, bucket: CommBucket, name: str):
        self.result, self.bucket, self.name = result, bucket, name

    def wait(self) -> None:
        """Wait for the hook's result (a failure there is a CollectiveError naming the hook and the
        group), then put its mean into the buffer, cast to the buffer's dtype."""
        value = self.result
        if not isinstance(value, torch.Tensor) and hasattr(value, "wait"):  # a Future, or deferred work
            try:
                value = value.wait()
            except RuntimeError as e:  # gloo's timeouts and DistBackendError are RuntimeErrors
                raise collectives.CollectiveError(f"comm hook {self.name}", collectives.describe_group(
                    self.bucket.owners), None, e) from e
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        buffer = self.bucket.buffer()
        if not isinstance(value, torch.Tensor) or value.numel() != buffer.numel():
            what = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(type(value))
            raise TypeError(f"comm hook {self.name} returned {what} for bucket {self.bucket.index()}; it must "
                            f"return the bucket's mean over its group, a tensor of {buffer.numel()} elements (or a "
                            "torch.futures.Future of one), as bucket.buffer() is")
        if value.data_ptr() != buffer.data_ptr():
            buffer.copy_(value.reshape(-1))


"""Averaging among owners: bucketed packed collectives, overlapped with the backward.

The buckets (buckets.py) fix which pieces share a buffer and the one global order in
which buckets are issued. During the backward the engine reports each parameter whose
gradient is ready (`grad_ready`, from a post-accumulate-grad hook); a bucket whose pieces
are all ready is packed and its all-reduce issued asynchronously, as soon as every
earlier bucket of this rank has been issued (torch DDP's reducer does the same), so the
communication runs while the rest of the backward computes. `finish()`, queued at the end
of the backward, issues what is left, waits in order and unpacks each bucket in place
times 1/owner-count. With overlap off every bucket is issued by `finish()`: the same
buffers and the same sums, only later, so both paths give bit-identical results.

Each bucket has one persistent buffer (like DDP's), reused for gradients and, with
sync_every > 1, for parameters. Where each piece lives is handed over once, at
construction, as PiecePlace tables (places.py): the averager calls nothing above comm.

Gradients keep their addresses for the life of the engine, so the prepared segment
tables are built once and a step neither validates nor uploads one (no host work, no
device synchronisation, capturable in a CUDA graph). When gradients are averaged every
step, each parameter with pieces in a bucket gets an engine-owned gradient, its "home",
that becomes its `.grad` when its bucket is issued (as torch DDP's
`gradient_as_bucket_view`): a parameter that is one whole piece in one bucket has its
home in the bucket itself (its gradient is neither packed nor unpacked, only scaled in
place, and needs no memory of its own); any other (several pieces, or a zero-filled
bucket) has a standalone home that the fixed tables pack from and unpack into. A
gradient that autograd allocated afresh (after `zero_grad(set_to_none=True)`, or
accumulated under `no_sync()`) is copied into its home once, at issue, and the home
replaces it; a parameter without a gradient gets a zero home.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch.autograd import Variable

from .. import ops
from ..planning.buckets import Bucket
from ..planning.pieces import Piece
from .communicator import Communicator
from .places import PiecePlace, area
from .prepared import PreparedTables


class _BucketState:
    """One bucket on this rank: the pieces it holds there, their tables and the buffer."""

    def __init__(self, bucket: Bucket, rank: int, simulated: bool):
        self.bucket = bucket
        self.held = [(p, off) for p, off in zip(bucket.pieces, bucket.offsets) if rank in p.owners]
        # Zero-filled buckets carry pieces this rank does not hold: zeros stand for them.
        self.zero_fill = len(self.held) < len(bucket.pieces)
        self.simulated = simulated
        self.param_pieces = sum(1 for p, _ in self.held if p.is_param)
        self.buffer = None
        self.tables = {}  # quantity -> (one piece per tensor of the tensor list, segment table, scales)
        self.pending = 0
        # piece -> (buffer offset, numel): its parameter's gradient lives in the buffer itself
        # (the parameter's .grad is a view of it; the masked kernel may write it there directly).
        self.in_place = {}
        self.gradient_params = []  # the trainable parameters of the held pieces (whose .grad is made a home)
        self._scaled = None  # ([1-D views of the in-place pieces], [their 1/owner-count]), made once

    def table(self, quantity: str, source):
        """Which local tensors the held pieces live in, where, and the unpack scale of each
        (1/owner-count; 1 when simulated: "as if every owner held this rank's values").
        Static per quantity, so built once."""
        if quantity not in self.tables:
            tensor_pieces, tensor_index, rows, scales = [], {}, [], []
            for p, off in self.held:
                if quantity == "gradients" and p in self.in_place:
                    continue  # already in the buffer: neither packed nor copied back
                tensor, (r0, r1, c0, c1) = source(p)
                if id(tensor) not in tensor_index:
                    tensor_index[id(tensor)] = len(tensor_pieces)
                    tensor_pieces.append(p)
                rows.append((tensor_index[id(tensor)], r0, r1, c0, c1, off))
                scales.append(1.0 if self.simulated else 1.0 / len(p.owners))
            table = torch.tensor(rows, dtype=torch.int64) if rows else torch.empty(0, 6, dtype=torch.int64)
            self.tables[quantity] = (tensor_pieces, table, torch.tensor(scales, dtype=torch.float32))
        return self.tables[quantity]

    def tensors(self, quantity: str, source):
        """(local tensors, segment table, scales) of the held pieces; `source(piece)` ->
        (the tensor holding the piece's `quantity`, its rectangle) is the averager's."""
        tensor_pieces, table, scales = self.table(quantity, source)
        return [source(p)[0] for p in tensor_pieces], table, scales

    def ensure_buffer(self, device) -> torch.Tensor:
        """The bucket's persistent buffer [numel], allocated (zeroed) at its first use."""
        if self.buffer is None:
            # Zeroed once: the alignment gaps between pieces (buckets.py) are never packed,
            # so they stay zero through every all-reduce instead of summing garbage.
            self.buffer = torch.zeros(self.bucket.numel, dtype=getattr(torch, self.bucket.dtype), device=device)
        return self.buffer

    def scale_in_place(self) -> None:
        """Multiply every in-place gradient by its 1/owner-count (one multi-tensor launch)."""
        if self._scaled is None:
            views = [self.buffer.narrow(0, off, n) for off, n in self.in_place.values()]
            self._scaled = (views, [1.0 / len(p.owners) for p in self.in_place])
        if self._scaled[0]:
            torch._foreach_mul_(*self._scaled)


class BucketedAverager:
    """Averages this rank's pieces among their owners, bucket by bucket.

    Args:
        buckets: buckets.build_buckets(...) for the plan (the same list on every rank).
        rank: this rank in the plan's numbering.
        communicator: issues (or simulates) the collectives and counts them.
        device: where the buffers live.
        places: {piece: PiecePlace} for every piece this rank holds (places.py; the engine
            builds it from the rank's layout): where each piece's value lives, and for an
            owned parameter piece the Parameter whose gradient carries it.
        overlap: issue a bucket during the backward as soon as it is ready.
        average_gradients: False with sync_every > 1 (parameters are averaged after
            optimizer steps instead): gradient reports then do nothing.

    The engine reports gradients (`on_param_grad_ready`, `on_grad_ready`) only in
    backward passes that average (not under no_sync()). One backward's state lives here:
    whether the end-of-backward callback is queued, which buckets were issued, how many
    gradients each bucket still waits for.
    """

    def __init__(self, buckets: list[Bucket], rank: int, communicator: Communicator, device: torch.device,
                 places: Mapping[Piece, PiecePlace], overlap: bool = True, average_gradients: bool = True):
        self.comm, self.device, self.overlap = communicator, device, overlap
        self.average_gradients = average_gradients
        self.places = dict(places)
        self._queued = False  # the end-of-backward callback is queued on the autograd engine
        self._pieces_of_param = {}  # id(trainable parameter) -> the held pieces its gradient carries
        for place in self.places.values():
            if place.trainable:
                self._pieces_of_param.setdefault(id(place.param), []).append(place.piece)
        self.states = [_BucketState(b, rank, communicator.simulated) for b in buckets if rank in b.owners]
        self.buckets_of_piece = {}
        for i, s in enumerate(self.states):
            for p, _ in s.held:
                self.buckets_of_piece.setdefault(p, []).append(i)
        self._issued = []
        self._next = 0
        self.issued_during_backward = 0  # buckets issued before the backward ended (overlap)
        self.prepared = PreparedTables()  # segment tables validated once per layout
        self._homes = {}  # id(parameter) -> its gradient home (made at its first issue)
        self._bucket_places = {}  # id(parameter) -> (bucket state, offset) of a home inside a bucket
        self._direct = set()  # pieces whose gradient the masked kernel writes into the bucket
        if average_gradients:
            self._place_gradients()

    def _place_gradients(self) -> None:
        """Decide each communicated parameter's gradient home: in its bucket when the
        parameter is one whole piece in one bucket that is not zero-filled, else standalone."""
        for s in self.states:
            seen = set()
            for p, off in s.held:
                place = self.places[p]
                if not place.trainable or id(place.param) in seen:
                    continue
                param = place.param
                seen.add(id(param))
                s.gradient_params.append(param)
                whole = area(place.grad_rect) == param.numel()
                if self._pieces_of_param[id(param)] == [p] and whole and not s.zero_fill and \
                        len(self.buckets_of_piece[p]) == 1:
                    s.in_place[p] = (off, param.numel())
                    self._bucket_places[id(param)] = (s, off)

    def _home(self, param) -> torch.Tensor:
        """The parameter's gradient home: its place in its bucket, or a standalone zero tensor
        (also for a parameter the engine does not train: it stays zero, this rank's share)."""
        home = self._homes.get(id(param))
        if home is None:
            place = self._bucket_places.get(id(param))
            if place is not None:
                state, offset = place
                home = state.ensure_buffer(self.device).narrow(0, offset, param.numel()).view(param.shape)
            else:
                home = torch.zeros_like(param, memory_format=torch.contiguous_format)
            self._homes[id(param)] = home
        return home

    def _source(self, quantity: str):
        """piece -> (tensor holding its `quantity`, its rectangle): a parameter piece's gradient
        lives in its parameter's home, anything else (values, buffers) where the value lives."""
        def value(piece):
            place = self.places[piece]
            return place.value, place.value_rect

        def gradient(piece):
            place = self.places[piece]
            if place.param is None:
                return place.value, place.value_rect  # a buffer (norm statistics) is averaged as its value
            return self._home(place.param), place.grad_rect

        return gradient if quantity == "gradients" else value

    def _adopt_gradients(self, s: _BucketState) -> None:
        """Make each parameter's home its .grad: copy a gradient autograd allocated afresh
        into it, or zero it for a parameter that got no gradient this backward."""
        for param in s.gradient_params:
            home = self._home(param)
            grad = param.grad
            if grad is not None and grad.data_ptr() == home.data_ptr():
                continue
            if grad is None:
                home.zero_()
            else:
                home.copy_(grad)
            param.grad = home

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the bucket buffers allocated so far on this rank (alignment gaps included)."""
        return sum(s.buffer.numel() * s.buffer.element_size() for s in self.states if s.buffer is not None)

    def buffer_storages(self) -> set:
        """Data pointers of the allocated bucket buffers' storages."""
        return {s.buffer.untyped_storage().data_ptr() for s in self.states if s.buffer is not None}

    def direct_gradient_view(self, piece: Piece, numel: int) -> torch.Tensor | None:
        """A 1-D view [numel] of `piece`'s place in its bucket buffer, for a kernel to write
        the gradient into directly (the piece is then neither packed nor unpacked; its view
        is averaged in place). None unless the piece's gradient lives in a bucket here."""
        s = next((s for s in self.states if piece in s.in_place), None)
        if s is None or s.in_place[piece][1] != numel:
            return None
        self._direct.add(piece)
        # Its readiness now comes from the kernel's call (on_grad_ready), not from the
        # parameter's accumulate hook, which would report it a second time.
        for pieces in self._pieces_of_param.values():
            if piece in pieces:
                pieces.remove(piece)
        return s.ensure_buffer(self.device).narrow(0, s.in_place[piece][0], numel)

    def direct_gradient_pieces(self) -> set:
        """The pieces whose gradient a kernel writes straight into a bucket buffer."""
        return set(self._direct)

    def on_param_grad_ready(self, param) -> None:
        """A post-accumulate-grad hook's report: `param`'s gradient is final for this backward."""
        self.on_grad_ready(self._pieces_of_param.get(id(param), ()))

    def on_grad_ready(self, pieces) -> None:
        """The gradients of these held pieces are final for this backward. The first report
        of a backward queues `finish` on the autograd engine for when the backward ends."""
        if not self.average_gradients:
            return  # local SGD: parameters are averaged after optimizer steps instead
        if not self._queued:
            self._queued = True
            self._start_backward()
            Variable._execution_engine.queue_callback(self._after_backward)
        with torch.no_grad():
            self._grad_ready(pieces)

    def _after_backward(self) -> None:
        self._queued = False
        with torch.no_grad():
            self.finish("gradients")

    def _start_backward(self) -> None:
        """Called when the first gradient of a backward is ready."""
        for s in self.states:
            s.pending = s.param_pieces
        self._issued, self._next = [], 0

    def _grad_ready(self, pieces) -> None:
        """Count these pieces ready and issue, in order, every bucket that is complete."""
        for p in pieces:
            for i in self.buckets_of_piece.get(p, ()):
                self.states[i].pending -= 1
                if self.states[i].pending < 0:  # a bucket issued before all its gradients were final
                    raise RuntimeError(f"subnet_ext: the gradient of {p.name} was reported ready twice in one "
                                       "backward; this is a bug in the engine's hooks")
        if self.overlap:
            while self._next < len(self.states) and self.states[self._next].pending <= 0:
                self._issue(self.states[self._next], "gradients")
                self._next += 1
                self.issued_during_backward += 1

    def finish(self, quantity: str = "gradients") -> None:
        """Issue every bucket not issued yet (in order), wait, unpack times 1/owner-count."""
        while self._next < len(self.states):
            self._issue(self.states[self._next], quantity)
            self._next += 1
        for s, quantity_issued, pending in self._issued:
            pending.wait()
            tensors, table, scales = s.tensors(quantity_issued, self._source(quantity_issued))
            if tensors:
                key = (id(s), "unpack", quantity_issued)
                ops.unpack_average_(tensors, self.prepared.get(key, tensors, table, s.buffer, scales), s.buffer)
            if quantity_issued == "gradients" and not self.comm.simulated:
                s.scale_in_place()
        self._issued, self._next = [], 0

    def average_now(self, quantity: str) -> None:
        """Average every held piece's `quantity` ("parameters" or "gradients") right away."""
        self._issued, self._next = [], 0
        self.finish(quantity)

    def _issue(self, s: _BucketState, quantity: str) -> None:
        buffer = s.ensure_buffer(self.device)
        if quantity == "gradients":
            self._adopt_gradients(s)
        if s.zero_fill:
            buffer.zero_()
        tensors, table, _ = s.tensors(quantity, self._source(quantity))
        if tensors:
            ops.pack_segments(tensors, self.prepared.get((id(s), "pack", quantity), tensors, table, buffer), buffer)
        self._issued.append((s, quantity, self.comm.all_reduce(buffer, s.bucket.owners, quantity)))

"""Averaging among owners: bucketed packed collectives, overlapped with the backward.

The buckets (buckets.py) fix which pieces share a buffer and the one global order in
which buckets are issued. During the backward the engine reports each parameter whose
gradient is ready (`on_grad_ready`, from a post-accumulate-grad hook); a bucket whose
pieces are all ready is packed into its buffer and handed to the reduction
(reduction.py: the all-reduce, or a comm hook) as soon as every earlier bucket of this
rank has been issued (torch DDP's reducer does the same), so the communication runs
while the rest of the backward computes. At the end of the backward a queued callback
issues what is left, waits for each bucket in order and unpacks it in place times its
scale (1/owner-count). With overlap off every bucket is issued by that callback: the same
buffers and the same sums, only later, so both paths give bit-identical results. One
backward's state (which buckets still wait for gradients, which were issued) is one
`_AveragingPass` object, alive from the first gradient to the callback.

Each bucket has one persistent buffer (like DDP's) in the dtype of its pieces, reused for
gradients and, with sync_every > 1, for parameters. Where each piece lives is handed over
once, at construction, as HeldPiece tables (places.py): the averager calls nothing above
comm.

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

import weakref
from typing import Mapping

import torch
from torch.autograd import Variable

from .. import ops
from ..planning.buckets import Bucket
from ..planning.pieces import Piece
from .communicator import Communicator
from ..vocabulary import Quantity
from .places import HeldPiece, area
from .prepared import PreparedTables, piece_table
from .reduction import AllReduce, CommBucket, Reduction


def set_grad(param: torch.Tensor, home: torch.Tensor) -> None:
    """Make `home` the gradient of `param` (its `.grad`): the one place the engine assigns a gradient,
    whether the averager adopts it at issue or the masked kernel wrote it into its bucket."""
    param.grad = home


class _ParamReady:
    """A parameter's post-accumulate-grad hook: its gradient is final, tell the averager (held weakly: a
    tensor's hooks live in C++, where the garbage collector cannot see the cycle parameter -> hook ->
    averager -> places -> parameter, and an averager kept alive keeps its process groups)."""

    def __init__(self, averager: "BucketedAverager"):
        self.averager = weakref.ref(averager)

    def __call__(self, param: torch.Tensor) -> None:
        averager = self.averager()
        if averager is not None:
            averager.on_grad_ready(param=param)


class PiecesReady(_ParamReady):
    """What the masked kernel calls once it wrote a piece's gradient into its bucket (owned_linear.py)."""

    def __call__(self, piece: Piece) -> None:
        averager = self.averager()
        if averager is not None:
            averager.on_grad_ready(pieces=(piece,))


class _BucketState:
    """One bucket on this rank: the pieces it holds there, its buffer, their tables and the
    CommBucket a reduction is handed."""

    def __init__(self, bucket: Bucket, index: int, rank: int):
        self.bucket, self.index, self.rank = bucket, index, rank
        self.held = [(p, off) for p, off in zip(bucket.pieces, bucket.offsets) if rank in p.owners]
        # Zero-filled buckets carry pieces this rank does not hold: zeros stand for them.
        self.zero_fill = len(self.held) < len(bucket.pieces)
        self.param_pieces = sum(1 for p, _ in self.held if p.is_param)
        self.buffer = None
        self.comm_bucket = None
        # (quantity, averaged over the group) -> (one piece per tensor of the tensor list, segment table, scales)
        self.tables = {}
        # piece -> (buffer offset, numel): its parameter's gradient lives in the buffer itself
        # (the parameter's .grad is a view of it; the masked kernel may write it there directly).
        self.in_place = {}
        self.gradient_params = []  # the trainable parameters of the held pieces (whose .grad is made a home)
        self._scaled = {}  # averaged over the group -> ([1-D views of the in-place pieces], [their scales])

    def ensure_buffer(self, device: torch.device, comm: Communicator) -> torch.Tensor:
        """The bucket's persistent buffer [numel], allocated (zeroed) at its first use."""
        if self.buffer is None:
            # Zeroed once: the alignment gaps between pieces (buckets.py) are never packed,
            # so they stay zero through every all-reduce instead of summing garbage.
            self.buffer = torch.zeros(self.bucket.numel, dtype=getattr(torch, self.bucket.dtype), device=device)
            self.comm_bucket = CommBucket(self.bucket, self.index, self.rank, self.buffer, comm)
        return self.buffer

    def scale(self, piece: Piece, averaged: bool, simulated: bool) -> float:
        """What the buffer's value of `piece` is multiplied by when unpacked: 1/owner-count after
        a sum over the group, group size/owner-count after a mean over it; 1 when simulated
        ("as if every owner held this rank's values")."""
        if simulated:
            return 1.0
        return (len(self.bucket.owners) if averaged else 1) / len(piece.owners)

    def scale_in_place(self, averaged: bool, simulated: bool) -> None:
        """Multiply every in-place gradient by its scale (one multi-tensor launch; none when all are 1)."""
        if averaged not in self._scaled:
            views = [self.buffer.narrow(0, off, n) for off, n in self.in_place.values()]
            scales = [self.scale(p, averaged, simulated) for p in self.in_place]
            self._scaled[averaged] = (views, scales) if any(s != 1.0 for s in scales) else ([], [])
        if self._scaled[averaged][0]:
            torch._foreach_mul_(*self._scaled[averaged])


class _AveragingPass:
    """One synchronisation: the averaging of one backward's gradients, or of the parameters.

    states: the buckets it averages (those of the quantity's period), in the one global order;
    waiting[i]: gradients bucket i still waits for (a backward's); next: the first bucket not
    issued yet (they are issued in that order); issued: (bucket state, its reduction in flight),
    in issue order."""

    def __init__(self, quantity: Quantity, states: list[_BucketState]):
        self.quantity, self.states = quantity, states
        self.waiting = [s.param_pieces for s in states]
        self.next = 0
        self.issued = []


class BucketedAverager:
    """Averages this rank's pieces among their owners, bucket by bucket.

    Args:
        buckets: buckets.build_buckets(...) for the plan (the same list on every rank).
        rank: this rank in the plan's numbering.
        communicator: issues (or simulates) the collectives and counts them.
        device: where the buffers live.
        places: {piece: HeldPiece} for every piece this rank holds (places.py; the engine
            builds it from the rank's layout): where each piece's value lives, and for an
            owned parameter piece the Parameter whose gradient carries it.
        overlap: issue a bucket during the backward as soon as it is ready.
        Each bucket's period (buckets.py; the engine's sync_every): period 1 averages its gradients
        in every synchronising backward; H > 1 averages its parameters when asked at a step that
        is a multiple of H (`average_now`), its gradient reports doing nothing (local SGD).
        reduction: how gradient buckets are averaged (reduction.py; default AllReduce);
            `set_reduction` changes it (a comm hook). Parameters always go by AllReduce.

    The engine reports gradients (`on_grad_ready`) only in backward passes that average
    (not under no_sync()).
    """

    def __init__(self, buckets: list[Bucket], rank: int, communicator: Communicator, device: torch.device,
                 places: Mapping[Piece, HeldPiece], overlap: bool = True, reduction: Reduction | None = None):
        self.comm, self.device, self.overlap = communicator, device, overlap
        self.enabled = True  # False inside no_sync(): backward passes only accumulate
        self.listeners = []  # called at each report of a synchronising backward (the leader's buffers)
        self.reduction = reduction if reduction is not None else AllReduce(Quantity.GRADIENTS)
        self._parameter_reduction = AllReduce(Quantity.PARAMETERS)
        self.places = dict(places)
        self._backward = None  # the _AveragingPass of the backward in progress (its end-of-backward callback is queued)
        self._pieces_of_param = {}  # id(trainable parameter) -> the held pieces its gradient carries
        for place in self.places.values():
            if place.trainable:
                self._pieces_of_param.setdefault(id(place.param), []).append(place.piece)
        self.states = [_BucketState(b, i, rank) for i, b in enumerate(buckets) if rank in b.owners]
        self.gradient_states = [s for s in self.states if s.bucket.period == 1]  # averaged in each backward
        self.buckets_of_piece = {}  # piece -> its gradient buckets' positions in gradient_states
        for i, s in enumerate(self.gradient_states):
            for p, _ in s.held:
                self.buckets_of_piece.setdefault(p, []).append(i)
        self.issued_during_backward = 0  # buckets issued before the backward ended (overlap)
        self.prepared = PreparedTables()  # segment tables validated once per layout
        self._homes = {}  # id(parameter) -> its gradient home (made at its first issue)
        self._bucket_places = {}  # id(parameter) -> (bucket state, offset) of a home inside a bucket
        self._place_gradients()

    @property
    def average_gradients(self) -> bool:
        """True when some bucket's gradients are averaged in each synchronising backward (period 1)."""
        return bool(self.gradient_states) or not self.states

    def watch(self, params) -> list:
        """Register the post-accumulate-grad hook of each of `params` (the engine's trainable parameters):
        each reports its gradient straight to on_grad_ready. Returns the hooks' handles."""
        return [p.register_post_accumulate_grad_hook(_ParamReady(self)) for p in params]

    def set_reduction(self, reduction: Reduction) -> None:
        """Average gradient buckets by `reduction` from the next backward on (a comm hook)."""
        if self._backward is not None:
            raise RuntimeError("the reduction of gradients cannot change during a backward pass")
        self.reduction = reduction

    # ------------------------------------------------------------------ gradient homes
    def _place_gradients(self) -> None:
        """Decide each communicated parameter's gradient home: in its bucket when the
        parameter is one whole piece in one bucket that is not zero-filled, else standalone."""
        for s in self.gradient_states:
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
                home = state.ensure_buffer(self.device, self.comm).narrow(0, offset, param.numel()).view(param.shape)
            else:
                home = torch.zeros_like(param, memory_format=torch.contiguous_format)
            self._homes[id(param)] = home
        return home

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
            set_grad(param, home)

    def _where(self, piece: Piece, quantity: Quantity) -> tuple[torch.Tensor, tuple]:
        """(the tensor holding `piece`'s `quantity`, its rectangle): a parameter piece's gradient
        lives in its parameter's home, anything else (values, buffers) where the value lives;
        a buffer (norm statistics) is averaged as its value in the gradient pass too."""
        place = self.places[piece]
        if quantity is Quantity.GRADIENTS and place.param is not None:
            return self._home(place.param), place.grad_rect
        return place.tensor, place.local

    def _segments(self, s: _BucketState, quantity: Quantity, averaged: bool):
        """(local tensors, segment table, unpack scales) of the held pieces' `quantity`. Static
        per (quantity, whether the reduction leaves the group's mean), so built once."""
        key = (quantity, averaged)
        if key not in s.tables:
            # Already in the buffer (gradients written in place): neither packed nor copied back.
            held = [(p, off) for p, off in s.held if not (quantity is Quantity.GRADIENTS and p in s.in_place)]
            tensor_pieces, table = piece_table([(p, *self._where(p, quantity), off) for p, off in held])
            scales = [s.scale(p, averaged, self.comm.simulated) for p, _ in held]
            s.tables[key] = (tensor_pieces, table, torch.tensor(scales, dtype=torch.float32))
        tensor_pieces, table, scales = s.tables[key]
        return [self._where(p, quantity)[0] for p in tensor_pieces], table, scales

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the bucket buffers allocated so far on this rank (alignment gaps included)."""
        return sum(s.buffer.numel() * s.buffer.element_size() for s in self.states if s.buffer is not None)

    def gradient_homes(self) -> dict:
        """{id(parameter): its gradient home (a tensor shaped like the parameter)}, for the
        parameters whose gradient was issued at least once (a copy: the averager owns them)."""
        return dict(self._homes)

    def buffer_storages(self) -> set:
        """Data pointers of the allocated bucket buffers' storages."""
        return {s.buffer.untyped_storage().data_ptr() for s in self.states if s.buffer is not None}

    def direct_gradient_view(self, piece: Piece, numel: int) -> torch.Tensor | None:
        """A 1-D view [numel] of `piece`'s place in its bucket buffer, for a kernel to write
        the gradient into directly (the piece is then neither packed nor unpacked; its view
        is averaged in place). None unless the piece's gradient lives in a bucket here."""
        s = next((s for s in self.gradient_states if piece in s.in_place), None)
        if s is None or s.in_place[piece][1] != numel:
            return None
        return s.ensure_buffer(self.device, self.comm).narrow(0, s.in_place[piece][0], numel)

    def report_directly(self, piece: Piece) -> PiecesReady:
        """From now on `piece`'s readiness comes from the kernel that writes it into its bucket (the returned
        callable), not from its parameter's accumulate hook, which would report it a second time."""
        for pieces in self._pieces_of_param.values():
            if piece in pieces:
                pieces.remove(piece)
        return PiecesReady(self)

    # ------------------------------------------------------------------ the backward
    def on_grad_ready(self, pieces=(), param=None) -> None:
        """These held pieces' gradients, or those `param`'s carries (its post-accumulate-grad
        hook's report), are final for this backward: count them, and issue in order every
        bucket that is complete. The first report of a backward starts its _AveragingPass and queues
        the end-of-backward callback on the autograd engine."""
        if not self.enabled:
            return  # inside no_sync(): accumulate only
        for listener in self.listeners:
            listener()
        if param is not None:
            pieces = self._pieces_of_param.get(id(param), ())
        if not self.gradient_states:
            return  # local SGD: parameters are averaged after optimizer steps instead
        run = self._backward
        if run is None:
            run = self._backward = _AveragingPass(Quantity.GRADIENTS, self.gradient_states)
            Variable._execution_engine.queue_callback(self._after_backward)
        for p in pieces:
            for i in self.buckets_of_piece.get(p, ()):
                run.waiting[i] -= 1
                if run.waiting[i] < 0:  # a bucket issued before all its gradients were final
                    raise RuntimeError(f"subnet_ext: the gradient of {p.name} was reported ready twice in one "
                                       "backward; this is a bug in the engine's hooks")
        if self.overlap:
            with torch.no_grad():
                while run.next < len(run.states) and run.waiting[run.next] <= 0:
                    self._issue(run)
                    self.issued_during_backward += 1

    def _after_backward(self) -> None:
        run, self._backward = self._backward, None
        with torch.no_grad():
            self._finish(run)

    def average_now(self, quantity: Quantity | str, step: int | None = None) -> None:
        """Average held pieces' `quantity` right away: "gradients" of the period-1 buckets, or "parameters"
        of every bucket (step None), or at optimizer step `step` of the buckets whose period H > 1 divides it."""
        quantity = Quantity(quantity)
        if quantity is Quantity.GRADIENTS:
            states = self.gradient_states
        elif step is None:
            states = self.states
        else:
            states = [s for s in self.states if s.bucket.period > 1 and step % s.bucket.period == 0]
        with torch.no_grad():
            self._finish(_AveragingPass(quantity, states))

    def _issue(self, run: _AveragingPass) -> None:
        """Pack the next bucket of `run` into its buffer and start its reduction."""
        s = run.states[run.next]
        run.next += 1
        buffer = s.ensure_buffer(self.device, self.comm)
        gradients = run.quantity is Quantity.GRADIENTS
        reduction = self.reduction if gradients else self._parameter_reduction
        if gradients:
            self._adopt_gradients(s)
        if s.zero_fill:
            buffer.zero_()
        tensors, table, _ = self._segments(s, run.quantity, reduction.averages_over_group)
        if tensors:
            ops.pack_segments(tensors, self.prepared.get((s.index, "pack", run.quantity), tensors, table, buffer),
                              buffer)
        run.issued.append((s, reduction, reduction.start(s.comm_bucket)))

    def _finish(self, run: _AveragingPass) -> None:
        """Issue what is left of `run` (in order), wait for each bucket in turn and unpack it
        into the pieces' tensors times their scales."""
        while run.next < len(run.states):
            self._issue(run)
        for s, reduction, pending in run.issued:
            pending.wait()
            averaged = reduction.averages_over_group
            tensors, table, scales = self._segments(s, run.quantity, averaged)
            if tensors:
                prepared = self.prepared.get((s.index, "unpack", run.quantity), tensors, table, s.buffer, scales)
                ops.unpack_average_(tensors, prepared, s.buffer)
            if run.quantity is Quantity.GRADIENTS:
                s.scale_in_place(averaged, self.comm.simulated)

"""Buffers (BatchNorm's running statistics) as torch DDP keeps them: the leader's values.

By default the engine averages each floating buffer piece among its owners with the
gradients (buffer_sync="average": every owner's statistics count). torch DDP instead
broadcasts rank 0's buffers at the start of the forward that follows a synchronising one
(`broadcast_buffers`), so its ranks train each step from rank 0's statistics, evaluate with
them, and its checkpoint holds them. `LeaderBuffers` gives SDP the same values
(buffer_sync="broadcast"): when a synchronising backward ends (after the gradients'
averaging), every floating buffer piece takes its leader's value (its lowest-ranked owner's:
rank 0's for shared buffers and at coverage 1, where SDP then equals DDP bit for bit). That
is the value DDP's next forward would broadcast; doing it at the end of the backward keeps
every collective inside the training step, so an evaluation on one rank alone issues none.

One all-reduce per dtype over all the plan's ranks: the leader of each piece writes it into
its slot of a zeroed buffer laid out in the global piece order, the sum is the leaders'
values, and every rank that holds a piece copies it back. Buffers are small (two numbers per
BatchNorm channel), so one collective over every rank costs less than one per owner set.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch.autograd import Variable

from ..planning.pieces import Piece, full_rectangle
from ..planning.plan import SubnetPlan
from .communicator import Communicator
from .places import HeldPiece, area


class LeaderBuffers:
    """Gives every held floating buffer piece its leader's value (one all-reduce per dtype).

    Args:
        plan: the SubnetPlan (the slots are laid out from it alone, the same on every rank).
        pieces: the plan's pieces in the global order (global_pieces(plan)).
        places: {piece: HeldPiece} of the pieces this rank holds (RankLayout.averaging_places()).
        rank: this rank; comm: the engine's Communicator (its group of all the plan's ranks).
        device: where the collective's buffer lives.
    """

    def __init__(self, plan: SubnetPlan, pieces: list[Piece], places: Mapping[Piece, HeldPiece], rank: int,
                 comm: Communicator, device: torch.device):
        self.rank, self.world, self.comm, self.device = rank, tuple(range(plan.world_size)), comm, device
        self.slots = {}  # dtype name -> [(piece, offset, numel)] in the global piece order
        self.places = {p: places[p] for p in pieces if not p.is_param and p in places}
        self._queued = False
        for p in pieces:
            if not p.is_param:
                entries = self.slots.setdefault(plan.tensor_dtypes[p.name], [])
                offset = entries[-1][1] + entries[-1][2] if entries else 0
                entries.append((p, offset, area(full_rectangle(plan, p))))

    def __bool__(self) -> bool:
        return bool(self.slots)

    def on_backward(self) -> None:
        """A gradient of a synchronising backward is ready: have the leaders' values taken when
        that backward ends (once per backward, after the callbacks queued before it: the averager's)."""
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._queued = False
        self()

    @torch.no_grad()
    def __call__(self) -> None:
        """Overwrite each held buffer piece with its leader's value (collective over every rank)."""
        for dtype, entries in self.slots.items():
            flat = torch.zeros(entries[-1][1] + entries[-1][2], dtype=getattr(torch, dtype), device=self.device)
            for piece, offset, numel in entries:
                if piece.leader == self.rank and piece in self.places:
                    flat.narrow(0, offset, numel).copy_(self._view(piece).reshape(-1))
            self.comm.all_reduce(flat, self.world, "buffers (leader's values)").wait()
            for piece, offset, numel in entries:
                if piece in self.places:
                    view = self._view(piece)
                    view.copy_(flat.narrow(0, offset, numel).view(view.shape))

    def _view(self, piece: Piece) -> torch.Tensor:
        """The piece's rectangle of its local tensor's 2-D view (a view: buffers are contiguous)."""
        place = self.places[piece]
        r0, r1, c0, c1 = place.local
        rows = place.tensor.shape[0] if place.tensor.dim() else 1
        return place.tensor.view(rows, -1)[r0:r1, c0:c1]

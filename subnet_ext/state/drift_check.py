"""The engine's own drift check: owners that stopped agreeing are caught within a bounded number
of steps, by default, for the cost of one small all-reduce every N optimizer steps.

Owners of a piece hold bit-identical values after each synchronisation (consistency.py). A
per-rank edit of the gradients breaks that silently: the DDP habit
`torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` clips each rank by the norm of its
own subnetwork, so the shared parameters drift apart while every step, `full_state_dict()` and
the loss curve look fine. `DriftCheck` finds it without the user asking:

- every `every` optimizer steps, right after a synchronisation point (with sync_every = H > 1,
  every ceil(every / H) x H steps, an averaging step: between averaging points local SGD
  legitimately diverges), each rank sums the bit patterns of every parameter piece with two or
  more owners that it owns (the values as integers of their width, summed modulo 2**32: exact,
  so the order of the sum, the device and the layout do not matter) into its row of a
  [K, pieces] int64 table, zeros elsewhere;
- one all-reduce (sum) of that table on the engine's world group gives every rank every
  owner's checksum: the same table everywhere, so every rank decides alike;
- owners whose checksums differ raise `ConsistencyError` on every rank, at the same step,
  naming the pieces and which ranks hold which value, and the likely cause (torch's clipping).

Nothing is read or written in the steps between checks; a check step reads the table to the
host once (the all-reduce is waited for there). The parameters are only read, so training
is bit for bit what it is without the check. FSDP2's shards (shard_shared) have one holder
each and are not compared; a simulated rank has nobody to compare with.
"""
from __future__ import annotations

import torch

from ..comm import collectives
from ..comm.communicator import Communicator
from ..ops.reference import as_2d as read_2d  # reads: a copy where no 2-D view exists
from .consistency import describe_piece, raise_on_mismatch
from .layout import RankLayout, local_tensor

# The integer type of each float width: a value's bits, read as a signed integer.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements summed at once: bounds the temporary of a widening sum (2-byte floats on the CPU)


def checksum(values: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 on values' device: the sum of the bit patterns of a 2-D floating tensor (any
    strides), modulo 2**32 (2**64 for 8-byte floats). Exact and free of order: equal tensors give
    equal sums on any device and layout; a changed value changes it unless other changes cancel
    it exactly. 4-byte values are summed as int32 (modular, no widened copy: as fast as a float
    sum), the chunk sums then reduced modulo 2**32, so how a piece is chunked does not matter."""
    size = values.element_size()
    bits = values.detach().view(_BITS[size])
    wide = torch.int64 if size == 8 else torch.int32
    rows = max(1, _CHUNK // max(1, bits.shape[1]))
    total = torch.zeros((), dtype=torch.int64, device=values.device)
    for start in range(0, bits.shape[0], rows):
        total += bits[start:start + rows].sum(dtype=wide)
    return total if size == 8 else total & 0xFFFFFFFF


class DriftCheck:
    """Compares the owners' copies of every multi-owner parameter piece every `every` steps.

    Args:
        layout: this rank's RankLayout (its pieces, where their parameters live).
        comm: the engine's Communicator: its world group (the group of all the engine's ranks
            it made, or the process group it was given) is asked for at each check, never kept
            (the communicator alone holds its groups, so that they are released at exit:
            comm/communicator.py); timeout: the engine's deadline, in the error.
        every: N, optimizer steps between checks (0 or None: never).
        sync_every: H: only steps that H divides are checked (the engine passes the least common
            multiple of its synchronisation periods: a step where every piece was just averaged).
        communicate: False for one rank or a simulated rank (nothing to compare).
    """

    def __init__(self, layout: RankLayout, comm: Communicator, every: int | None, sync_every: int, communicate: bool,
                 timeout: float | None = None):
        self.layout, self.comm, self.every, self.sync_every = layout, comm, every or 0, sync_every
        self.timeout = timeout
        self.pieces = [p for p in layout.pieces if p.is_param and len(p.owners) > 1 and not layout.is_sharded(p)]
        self.on = bool(self.every) and communicate and bool(self.pieces) and layout.world_size > 1
        # Checked at every multiple of this: the first multiple of H at or past `every` steps. A count of
        # the steps alone, so a check rebuilt for a new assignment (engine/reassignment) keeps the rhythm.
        self.period = sync_every * -(-self.every // sync_every) if self.every else 0
        self.checks = 0  # checks made (each one all-reduce)

    def after_step(self, steps: int) -> None:
        """Called after optimizer step `steps` (the engine's count) and its synchronisation: check
        at every multiple of `period` (every `every` steps; with H > 1 every ceil(every / H) x H)."""
        if self.on and steps % self.period == 0:
            self.check(steps)

    @torch.no_grad()
    def check(self, steps: int) -> None:
        """One comparison now (collective over the group); ConsistencyError on every rank when
        some owners disagree."""
        layout, group = self.layout, self.comm.world_group
        device = collectives.staging_device(group, layout.device)
        sums = [checksum(self._view(p)) for p in self.pieces if layout.owns(p)]
        table = torch.zeros(layout.world_size, len(self.pieces), dtype=torch.int64, device=device)
        mine = torch.tensor([i for i, p in enumerate(self.pieces) if layout.owns(p)], dtype=torch.long)
        if sums:
            table[layout.rank, mine.to(device)] = torch.stack(sums).to(device)
        collectives.all_reduce(table, group, timeout=self.timeout, operation="all_reduce (drift check)")
        self.checks += 1
        mismatches = []
        values = table.cpu().tolist()
        for i, p in enumerate(self.pieces):
            seen = {}
            for r in p.owners:
                seen.setdefault(values[r][i] & (2**64 - 1), []).append(r)
            if len(seen) > 1:
                mismatches.append((describe_piece(layout.plan, p), seen))
        raise_on_mismatch(mismatches, what=f"owners (found by the engine's drift check after optimizer step {steps}, "
                                           f"run every {self.every} steps: SDPConfig.drift_check_every)")

    def _view(self, piece) -> torch.Tensor:
        """The piece's [rows, cols] values in the Parameter this rank trains it in. Read only, so any
        strides will do: in the backward regime at neuron level that Parameter is an owned slice, a
        view of the full tensor with the full row stride (a copy is made where no view exists)."""
        param, (r0, r1, c0, c1) = self.layout.parameter_place(piece)
        return read_2d(local_tensor(param).detach())[r0:r1, c0:c1]

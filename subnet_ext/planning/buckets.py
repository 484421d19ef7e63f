"""Buckets: the pieces that need communication, cut into packed buffers in launch order.

Built from the plan alone, so every rank computes the same list. A bucket holds pieces of
one dtype that are averaged by one collective: with the per-group strategy, pieces of one
owner set (all-reduced in that set's group); with the zero-filled strategy, pieces of any
owner set, all-reduced over the world with zeros where a rank holds nothing.

Order: gradients become ready roughly in reverse order of the model's parameters
(the last layer's first), as torch DDP assumes. Pieces are visited in that order and
added to the open bucket of their key; a bucket closes when it reaches the size cap, and
the global launch order is the order in which buckets close (the rest close at the end,
in order of their last piece). Every rank launches its buckets in this one global order,
so two ranks never wait on each other in a cycle, and the layout (hence every sum) is the
same whether communication overlaps the backward or not.

Alignment: every piece starts at a buffer offset that is a multiple of 16 bytes
(PIECE_ALIGN_BYTES), so the packing kernels' 16-byte vector path applies to every
segment, not only to those before the first piece of an odd size. The gaps are part of
the bucket (numel counts them, so they are handed to the collective and counted by the
cost model) but are never packed or unpacked; the averager allocates buffers zeroed, so
the gaps hold zeros and sum to zeros.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .pieces import Piece, full_rectangle
from ..vocabulary import dtype_size

DEFAULT_BUCKET_CAP_MB = 25.0  # torch DDP's default
PIECE_ALIGN_BYTES = 16  # the packing kernels' vector width (one 128-bit load/store)


def align_elements(element_size: int) -> int:
    """Elements per PIECE_ALIGN_BYTES: where a packed piece of this element size may start."""
    return max(1, PIECE_ALIGN_BYTES // element_size)


def aligned_offset(offset: int, element_size: int) -> int:
    """The first offset >= `offset` (elements) at a multiple of PIECE_ALIGN_BYTES bytes."""
    align = align_elements(element_size)
    return -(-offset // align) * align


@dataclass
class Bucket:
    """One packed collective.

    owners: the ranks that take part (an owner set, or every rank for zero-filled buckets).
    period: its synchronisation period (1: gradients averaged every step; H: parameters every H steps).
    pieces / offsets: the pieces in buffer order and the first buffer element of each
        (offset * element size is a multiple of PIECE_ALIGN_BYTES).
    shapes: each piece's (rows, columns), its full rectangle: the piece is stored
        row-major at its offset, so buffer[offset : offset + rows * columns] viewed
        [rows, columns] is the piece as a matrix (what a low-rank reduction compresses).
    numel: elements of the 1-D buffer [numel], alignment gaps included.
    dtype: a torch dtype name ("float32", ...).
    """

    owners: tuple
    dtype: str
    period: int = 1
    pieces: list = field(default_factory=list)
    offsets: list = field(default_factory=list)
    shapes: list = field(default_factory=list)
    numel: int = 0
    last_position: int = 0  # visiting position of its last piece (for the closing order)

    @property
    def element_size(self) -> int:
        """Bytes per element of the bucket's dtype."""
        return dtype_size(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer, alignment gaps included (what a collective is handed)."""
        return self.numel * self.element_size

    def append(self, piece: Piece, shape: tuple[int, int]) -> None:
        """Add `piece`, a (rows, columns) rectangle, at the next offset aligned to PIECE_ALIGN_BYTES."""
        offset = aligned_offset(self.numel, self.element_size)
        self.pieces.append(piece)
        self.offsets.append(offset)
        self.shapes.append(tuple(shape))
        self.numel = offset + shape[0] * shape[1]


def piece_shape(plan, piece: Piece) -> tuple[int, int]:
    """(rows, columns) of `piece`'s full rectangle in `plan`."""
    r0, r1, c0, c1 = full_rectangle(plan, piece)
    return r1 - r0, c1 - c0


def piece_numel(plan, piece: Piece) -> int:
    """Elements of `piece` in `plan`: the area of its full rectangle."""
    rows, cols = piece_shape(plan, piece)
    return rows * cols


def refresh_broadcasts(plan, pieces: list[Piece]) -> list[tuple[int, Bucket]]:
    """Backward regime: the leaders' refresh broadcasts, as (leader, bucket) in leader order, one per
    (leader, dtype) with dtypes in the order their first piece comes: the pieces a leader (lowest
    owner) leads that some rank lacks, at aligned offsets (Bucket.append). The one layout the
    engine's CopyRefresher packs, the cost model counts and the memory model sizes its buffer from.

    Args:
        pieces: pieces.global_pieces(plan) (or those of one synchronisation period), in that order.
    """
    world = tuple(range(plan.world_size))
    out = []
    for leader in world if plan.world_size > 1 else ():
        by_dtype = {}
        for p in pieces:
            if p.owners[0] == leader and len(p.owners) < plan.world_size:
                dtype = plan.tensor_dtypes[p.name]
                by_dtype.setdefault(dtype, Bucket(world, dtype)).append(p, piece_shape(plan, p))
        out += [(leader, b) for b in by_dtype.values() if b.numel]
    return out


def build_buckets(plan, pieces: list[Piece], strategy: str, cap_bytes: float, period_of=None) -> list[Bucket]:
    """Buckets in global launch order (see the module docstring).

    Args:
        pieces: pieces.global_pieces(plan); those with a single owner need no collective.
        strategy: "groups" (one owner set per bucket) or "zero_filled" (world buckets).
        cap_bytes: a bucket closes once it holds at least this many bytes (> 0).
        period_of: piece -> its synchronisation period (default 1 for all): buckets are keyed by
            owner set, dtype and period.
    """
    if strategy not in ("groups", "zero_filled"):
        raise ValueError(f"strategy must be 'groups' or 'zero_filled', got {strategy!r}")
    if not (cap_bytes > 0 and math.isfinite(cap_bytes)):
        raise ValueError(f"the bucket cap must be a positive number of bytes, got {cap_bytes!r}")
    world = tuple(range(plan.world_size))
    position = {name: i for i, name in enumerate(plan.tensor_shapes)}
    shared = [p for p in pieces if len(p.owners) > 1]
    shared.sort(key=lambda p: (-position[p.name], p.start))
    open_buckets, closed = {}, []
    for visit, p in enumerate(shared):
        dtype = plan.tensor_dtypes[p.name]
        owners = p.owners if strategy == "groups" else world
        period = period_of(p) if period_of is not None else 1
        key = (owners, dtype, period)
        b = open_buckets.setdefault(key, Bucket(owners, dtype, period))
        b.append(p, piece_shape(plan, p))
        b.last_position = visit
        if b.nbytes >= cap_bytes:
            closed.append(open_buckets.pop(key))
    closed += sorted(open_buckets.values(), key=lambda b: b.last_position)
    return closed

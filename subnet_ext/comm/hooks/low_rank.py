"""low_rank_hook: PowerSGD (Vogels et al., 2019) for owner groups, with error feedback and warm start.

    state = LowRankState(matrix_rank=2)
    sdp.register_comm_hook(state, low_rank_hook)      # one state per engine, as DDP's PowerSGDState

Each piece of a bucket is a [rows, columns] matrix in its buffer (CommBucket.matrices()).
A piece large enough (rows * columns > min_compression_rate * r * (rows + columns), r =
min(matrix_rank, rows, columns)) is sent as two thin factors; the others (biases, norms,
small matrices) are sent whole. Per bucket, on each owner k with the piece's gradient G_k:

1. M_k = G_k + e_k (error feedback: e_k is what the last compression left out);
2. P_k = M_k Q, with Q [columns, r] the same on every owner (drawn from a generator seeded
   by (seed, bucket index, piece index) at the first step, then the last step's Q, warm
   start), orthogonalised; one all-reduce of [the whole pieces | every P_k]: P = sum P_k;
3. P^ = orthonormal columns of P (Gram-Schmidt, the same on every owner: same input);
   Q_k = M_k^T P^, and e_k = M_k - P^ Q_k^T (the part of M_k outside span(P^));
4. one all-reduce of [every Q_k]: Q = sum Q_k; the mean is P^ Q^T / group size, written
   into the buffer by every owner from the same P^ and Q, so owners stay bit-identical
   (given the same hardware and libraries, as any deterministic replica).

Two collectives per bucket (one when nothing in it is compressed): bytes on the wire
(whole pieces + sum of rows * r) and (sum of columns * r) elements of the gradients'
dtype, against the bucket's numel for the plain all-reduce (`collective_bytes`). Steps 1
and 2 run when the bucket is issued, during the backward, and the first all-reduce
overlaps the rest of it; steps 3 and 4 run when the engine waits for the bucket at the
end of the backward. Every rank waits for its buckets in the global bucket order, so the
second all-reduces are issued in one order on every rank (never from a callback thread).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...planning.buckets import Bucket
from ..reduction import CommBucket


def approximation_rank(rows: int, columns: int, matrix_rank: int, min_compression_rate: float) -> int:
    """r for a [rows, columns] piece, or 0 when it is sent whole (too small to gain
    `min_compression_rate`: rows * columns must exceed that times r * (rows + columns))."""
    r = min(matrix_rank, rows, columns)
    return r if rows * columns > min_compression_rate * r * (rows + columns) else 0


@dataclass
class LowRankState:
    """The low-rank hook's options and memory: one per engine (torch DDP's PowerSGDState).

    Attributes:
        matrix_rank: r, the rank of each compressed piece's approximation (>= 1).
        min_compression_rate: compress a piece only when it shrinks at least this much.
        seed: the first Q [columns, r] of piece i of bucket b is torch.randn from a CPU
            generator seeded with draw_seed(seed, b, i, 0): the same on every owner.
        warm_start: start each step from the piece's last Q (PowerSGD's warm start); False
            draws a new Q per step (seeded by the step too).
        error_feedback: add what the last compression left out to the next gradient.
        memory: {bucket index: _BucketMemory}, made at the bucket's first use.
    """

    matrix_rank: int = 1
    min_compression_rate: float = 2.0
    seed: int = 0
    warm_start: bool = True
    error_feedback: bool = True
    memory: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if isinstance(self.matrix_rank, bool) or not isinstance(self.matrix_rank, int) or self.matrix_rank < 1:
            raise ValueError(f"matrix_rank must be an int >= 1, got {self.matrix_rank!r}")
        if not self.min_compression_rate > 0:
            raise ValueError(f"min_compression_rate must be > 0, got {self.min_compression_rate!r}")


class _BucketMemory:
    """One bucket's split into compressed and whole pieces, its wire buffers and errors.

    first: [whole pieces' elements | each compressed piece's P], the first collective;
    q: [each compressed piece's Q], the second; errors: each compressed piece's e_k."""

    def __init__(self, state: LowRankState, bucket: CommBucket):
        buffer, matrices = bucket.buffer(), bucket.matrices()
        ranks = [approximation_rank(p.rows, p.columns, state.matrix_rank, state.min_compression_rate)
                 for p in bucket.pieces]
        self.whole = [m for m, r in zip(matrices, ranks) if r == 0]
        self.compressed = [m for m, r in zip(matrices, ranks) if r > 0]
        self.ids = [i for i, r in enumerate(ranks) if r > 0]  # piece indices, for the seeds
        ranks = [r for r in ranks if r > 0]
        whole = sum(m.numel() for m in self.whole)
        p_sizes = [m.shape[0] * r for m, r in zip(self.compressed, ranks)]
        q_sizes = [m.shape[1] * r for m, r in zip(self.compressed, ranks)]
        self.first = buffer.new_zeros(whole + sum(p_sizes))
        self.q = buffer.new_zeros(sum(q_sizes))
        self.whole_part = self.first.narrow(0, 0, whole)
        self.ps = [v.view(m.shape[0], r) for v, m, r in
                   zip(self.first.narrow(0, whole, sum(p_sizes)).split(p_sizes), self.compressed, ranks)]
        self.qs = [v.view(m.shape[1], r) for v, m, r in zip(self.q.split(q_sizes), self.compressed, ranks)]
        self.errors = [torch.zeros_like(m) for m in self.compressed] if state.error_feedback else []
        self.steps = 0

    def draw_qs(self, state: LowRankState, index: int) -> None:
        """Every Q from its seeded generator (on the CPU, then copied: the same values on any device)."""
        for i, q in zip(self.ids, self.qs):
            step = 0 if state.warm_start else self.steps
            g = torch.Generator().manual_seed(draw_seed(state.seed, index, i, step))
            q.copy_(torch.randn(q.shape, generator=g, dtype=torch.float32))


def draw_seed(*numbers: int) -> int:
    """The generator seed of a first Q: draw_seed(seed, bucket index, piece index, step), the
    same in every process (step 0 with warm start)."""
    out = 0
    for n in numbers:
        out = (out * 1_000_003 + n) % 2**63
    return out


def orthogonalise_(matrix: torch.Tensor) -> None:
    """Gram-Schmidt on the columns of `matrix` [n, r], in place (a zero column stays zero)."""
    tiny = torch.finfo(matrix.dtype).tiny
    for i in range(matrix.shape[1]):
        col = matrix[:, i:i + 1]
        col /= torch.linalg.vector_norm(col) + tiny
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1:]
            rest -= col * (col * rest).sum(0, keepdim=True)


class LowRankHook:
    """hook(state: LowRankState, bucket): PowerSGD's rank-r mean of the bucket over its group."""

    __name__ = "low_rank_hook"

    def __call__(self, state: LowRankState, bucket: CommBucket) -> torch.futures.Future | "_SecondHalf":
        """Steps 1 and 2 of the module docstring, the first all-reduce issued; the rest runs when
        the engine waits (at the end of the backward, bucket after bucket)."""
        memory = state.memory.get(bucket.index())
        if memory is None:
            memory = state.memory[bucket.index()] = _BucketMemory(state, bucket)
            memory.draw_qs(state, bucket.index())
        elif not state.warm_start:
            memory.draw_qs(state, bucket.index())
        memory.steps += 1
        if not memory.compressed:  # nothing worth compressing: the plain mean
            return bucket.all_reduce(bucket.buffer().mul_(bucket.scale))
        if memory.errors:
            torch._foreach_add_(memory.compressed, memory.errors)
        if memory.whole:
            torch.cat([m.reshape(-1) for m in memory.whole], out=memory.whole_part)
        for m, p, q in zip(memory.compressed, memory.ps, memory.qs):
            orthogonalise_(q)
            torch.matmul(m, q, out=p)
        return _SecondHalf(bucket, memory, bucket.all_reduce(memory.first))

    def collective_bytes(self, state: LowRankState, layout: Bucket) -> list[int]:
        """[whole pieces + sum rows * r, sum columns * r] elements of the bucket's dtype, in
        bytes; [the buffer] when no piece is compressed."""
        whole = p = q = 0
        for rows, columns in layout.shapes:
            r = approximation_rank(rows, columns, state.matrix_rank, state.min_compression_rate)
            if r:
                p, q = p + rows * r, q + columns * r
            else:
                whole += rows * columns
        if not p:
            return [layout.nbytes]
        return [(whole + p) * layout.element_size, q * layout.element_size]


class _SecondHalf:
    """Steps 3 and 4 of one bucket, run when the engine waits for it. Every rank waits for its
    buckets in the one global order, so the second all-reduces are issued in one order too."""

    def __init__(self, bucket: CommBucket, memory: _BucketMemory, first: torch.futures.Future):
        self.bucket, self.memory, self.first = bucket, memory, first

    def wait(self) -> torch.Tensor:
        """Orthogonalise P, form Q and the errors, sum Q, write the mean; returns the buffer."""
        memory, scale = self.memory, self.bucket.scale
        matrices, ps, qs = memory.compressed, memory.ps, memory.qs
        self.first.wait()
        for m, p, q in zip(matrices, ps, qs):
            orthogonalise_(p)
            torch.matmul(m.t(), p, out=q)
        for m, p, q, e in zip(matrices, ps, qs, memory.errors):
            torch.addmm(m, p, q.t(), alpha=-1, out=e)  # e = M - P^ Q_k^T, before Q is summed
        self.bucket.all_reduce(memory.q).wait()
        for m, p, q in zip(matrices, ps, qs):
            torch.matmul(p, q.t(), out=m)
        torch._foreach_mul_(matrices, scale)
        if memory.whole:
            for m, part in zip(memory.whole, memory.whole_part.split([m.numel() for m in memory.whole])):
                torch.mul(part.view(m.shape), scale, out=m)
        return self.bucket.buffer()


low_rank_hook = LowRankHook()

"""Full tensors summed from the ranks' contributions, one bounded chunk at a time.

Every full tensor (a model entry, or one optimizer-state entry) is built the same way on
every rank: zeros, into which this rank writes what it contributes (the pieces it leads,
or its rows of a sharded parameter), then a sum over the group. Summing with zeros is
exact (x + 0 = x), so the result holds the contributors' values bit for bit.

Tensors are packed per dtype into chunks of at most CHUNK_BYTES (a larger tensor forms a
chunk of its own) and each chunk is summed before the next one is filled. With
`rank0_only` the sum is a reduce onto rank 0 and the other ranks fill one reused buffer
per dtype, chunk after chunk: their extra memory is one chunk (or the largest tensor),
never the whole model, as FSDP's `rank0_only` full state dict promises. With `cpu_offload` the kept chunks move
to the CPU as they arrive, so the device holds one chunk at a time too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

import torch
import torch.distributed as dist

from ..comm import collectives
from ..vocabulary import dtype_size

CHUNK_BYTES = 16 * 2**20  # one collective per chunk; a rank that keeps nothing holds one chunk at most


@dataclass(frozen=True)
class FullEntry:
    """One full tensor to build: its key in the result, shape and dtype."""

    key: Hashable
    shape: tuple
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Elements of the full tensor."""
        n = 1
        for s in self.shape:
            n *= s
        return n


def plan_chunks(entries: list[FullEntry], chunk_bytes: int) -> list[list[FullEntry]]:
    """Consecutive same-dtype entries packed into chunks of at most `chunk_bytes` (a larger
    entry alone). Deterministic from the entries, so every rank issues the same collectives."""
    chunks, open_chunks = [], {}
    for e in entries:
        size = e.numel * dtype_size(e.dtype)
        members, used = open_chunks.get(e.dtype, ([], 0))
        if members and used + size > chunk_bytes:
            chunks.append(members)
            members, used = [], 0
        open_chunks[e.dtype] = (members + [e], used + size)
    chunks.extend(members for members, _ in open_chunks.values())
    return chunks


def check_options(what: str, rank0_only, cpu_offload) -> None:
    """ValueError unless both options are bools (a truthy string would silently mean True)."""
    for name, value in (("rank0_only", rank0_only), ("cpu_offload", cpu_offload)):
        if not isinstance(value, bool):
            raise ValueError(f"{what}: {name} must be True or False, got {value!r}")


def sum_gather(entries: list[FullEntry], write: Callable, device: torch.device, process_group=None,
               timeout: float | None = None, rank0_only: bool = False, cpu_offload: bool = False,
               communicate: bool = True, label: str | None = None, what: str = "full state") -> dict:
    """{entry key: full tensor}, in the order of `entries`; see the module docstring.

    Args:
        entries: the tensors to build, the same list on every rank.
        write: write(key, target) copies this rank's contribution into `target` (zeros of the
            entry's shape and dtype, on `device`); it must leave the rest at zero.
        communicate: False (one rank) sums nothing: the contributions are the result.
        rank0_only: only group rank 0 gets the tensors; the others get {}.
        cpu_offload: the kept tensors are on the CPU (views of one CPU buffer per chunk).
        label, what: how collective errors name the group and the operation.
    Collective over `process_group` when `communicate` (one collective per chunk).
    """
    rank = dist.get_rank(process_group) if communicate else 0
    keep = not rank0_only or rank == 0
    dst = dist.get_global_rank(process_group, 0) if communicate and process_group is not None else 0
    chunks = plan_chunks(entries, CHUNK_BYTES)
    scratch = {}  # a rank that keeps nothing reuses one buffer per dtype (freed chunks could linger in the backend)
    if not keep:
        for chunk in chunks:
            numel = sum(e.numel for e in chunk)
            if numel > scratch.get(chunk[0].dtype, 0):
                scratch[chunk[0].dtype] = numel
        scratch = {dtype: torch.empty(numel, dtype=dtype, device=device) for dtype, numel in scratch.items()}
    out = {}
    for chunk in chunks:
        sizes = [e.numel for e in chunk]
        flat = scratch[chunk[0].dtype][:sum(sizes)] if not keep else \
            torch.empty(sum(sizes), dtype=chunk[0].dtype, device=device)
        _contributions(chunk, sizes, write, flat)
        if communicate and rank0_only:
            collectives.reduce(flat, dst, process_group, timeout=timeout, label=label,
                               operation=f"reduce to rank 0 ({what})")
        elif communicate:
            collectives.all_reduce(flat, process_group, timeout=timeout, label=label, operation=f"all_reduce ({what})")
        if keep:
            flat = flat.cpu() if cpu_offload else flat
            out.update((e.key, part.view(e.shape)) for e, part in zip(chunk, flat.split(sizes)))
    return {e.key: out[e.key] for e in entries if e.key in out}


@torch.no_grad()
def _contributions(chunk: list[FullEntry], sizes: list[int], write: Callable, flat: torch.Tensor) -> None:
    """Zero `flat` (one chunk's buffer) and write this rank's contributions into it."""
    flat.zero_()
    for e, part in zip(chunk, flat.split(sizes)):
        write(e.key, part.view(e.shape))

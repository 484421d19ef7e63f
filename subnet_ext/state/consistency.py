"""Prove that owners agree: every rank holding a unit holds it bit for bit the same.

SDP's correctness rests on one invariant: after each synchronisation the owners of a
unit hold identical values (they average the same gradients and apply the same update).
A silent divergence — a bit flip, a rank that skipped a step alone, a kernel bug —
would otherwise only show up as a slowly worse model. `verify_consistency(layout, group)`
checks the invariant exactly:

- each rank hashes the bytes of every piece it owns (pieces.py: a slice of one tensor
  with one owner set) into 63 bits (BLAKE2b), 0 where it does not own the piece;
- one all_gather of that fixed-layout int64 vector [num_pieces] over the group;
- for each piece, the owners' hashes must be equal; otherwise ConsistencyError names
  the unit(s), the tensor slice and which ranks hold which value.

Call it at a synchronisation point (with sync_every = H > 1, right after a step that
is a multiple of H). Hashing copies each owned piece to host memory once.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ..comm import collectives
from .layout import RankLayout


class ConsistencyError(RuntimeError):
    """Owners of a unit hold different values. `mismatches`: [(description, {hash: ranks})]."""

    def __init__(self, message: str, mismatches: list):
        super().__init__(message)
        self.mismatches = mismatches


def tensor_hash(t: torch.Tensor) -> int:
    """A 63-bit hash of a tensor's dtype, shape and bytes (exact: any changed bit changes it
    with overwhelming probability); never 0, so 0 can mean 'not held'."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.dtype}:{tuple(t.shape)};".encode())
    h.update(data)
    return (int.from_bytes(h.digest(), "little") >> 1) or 1


def describe_piece(plan, piece) -> str:
    """'block unit 3 (blocks.1), blocks.1.fc1.weight' / 'neuron units 0-7 of blocks.0.mlp, ...'."""
    if not piece.units:
        where = f"shared tensor {piece.name!r}"
    elif len(piece.units) == 1:
        u = piece.units[0]
        unit = plan.units[u]
        label = unit.group if unit.index is None else f"{unit.group}[{unit.index}]"
        where = f"{unit.kind} unit {u} ({label}), tensor {piece.name!r}"
    else:
        first, last = plan.units[piece.units[0]], plan.units[piece.units[-1]]
        where = (f"{first.kind} units {piece.units[0]}-{piece.units[-1]} ({first.group}[{first.index}.."
                 f"{last.index}]), tensor {piece.name!r}")
    if piece.sliced:
        axis = "rows" if piece.dim == 0 else "columns"
        where += f" {axis} [{piece.start}, {piece.start + piece.length})"
    return where


def _local_hashes(layout: RankLayout, pieces) -> torch.Tensor:
    """[len(pieces)] int64: the hash of each piece this rank owns (its [rows, cols] values), 0 elsewhere."""
    held = {h.piece: h for h in layout.held_values()}
    out = torch.zeros(len(pieces), dtype=torch.int64)
    for i, p in enumerate(pieces):
        if layout.owns(p):
            out[i] = tensor_hash(held[p].read())
    return out


def compare_hashes(table: torch.Tensor, holders: list[tuple], labels: list[str]) -> list:
    """[(label, {hash: [ranks]})] for each column of `table` [ranks, items] whose holders disagree."""
    bad = []
    for i, ranks in enumerate(holders):
        values = {}
        for r in ranks:
            values.setdefault(int(table[r, i]), []).append(r)
        if len(values) > 1:
            bad.append((labels[i], values))
    return bad


def raise_on_mismatch(mismatches: list, what: str = "owners") -> None:
    """Raise ConsistencyError listing (up to 5 of) `mismatches`, each (label, {hash: ranks});
    return when there are none. `what` names who disagrees."""
    if not mismatches:
        return
    lines = []
    for label, values in mismatches[:5]:
        by_size = sorted(values.items(), key=lambda kv: -len(kv[1]))
        lines.append(f"{label}: " + " vs ".join(f"ranks {tuple(r)} (hash {h:016x})" for h, r in by_size))
    more = f" (and {len(mismatches) - 5} more)" if len(mismatches) > 5 else ""
    raise ConsistencyError(
        f"{what} disagree on {len(mismatches)} piece(s){more}; they must hold identical values after each "
        "synchronisation:\n  " + "\n  ".join(lines) +
        "\nA rank diverged. The usual cause is a per-rank gradient edit between backward and optimizer.step(): "
        "torch.nn.utils.clip_grad_norm_ over sdp.parameters() (it sees one rank's share; use "
        "sdp.clip_grad_norm_), loss scaling whose skip decision the ranks do not agree on (torch.amp.GradScaler; "
        "use subnet_ext.GradScaler), or gradients edited by hand on some ranks. Otherwise: a skipped or "
        "repeated step, corrupted memory, a bug. Restart from the last good checkpoint.", mismatches)


def verify_consistency(layout: RankLayout, process_group=None, timeout: float | None = None, due=None) -> None:
    """Raise ConsistencyError unless every unit's owners hold bit-identical values.

    Args:
        layout: this rank's RankLayout. process_group, timeout: the engine's.
        due: piece -> True when its owners must agree now (a synchronisation period per unit group: the
            pieces averaged at this step); default: every piece.
    Collective over `process_group` (one all_gather of [num_pieces] int64).
    """
    if layout.world_size == 1 or not dist.is_initialized():
        return
    pieces = [p for p in layout.pieces if len(p.owners) > 1 and not layout.is_sharded(p)  # FSDP shards: one holder
              and (due is None or due(p))]
    local = _local_hashes(layout, pieces).to(collectives.staging_device(process_group, layout.device))
    table = collectives.all_gather(local, process_group, timeout).cpu()
    labels = [describe_piece(layout.plan, p) for p in pieces]
    raise_on_mismatch(compare_hashes(table, [p.owners for p in pieces], labels))


def verify_replicas(named_tensors: dict, group=None, timeout: float | None = None) -> None:
    """Raise ConsistencyError unless every rank of `group` holds the same values for every
    entry of `named_tensors` (data parallelism: all ranks are replicas). Collective."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    names = sorted(named_tensors)
    device = next((t.device for t in named_tensors.values()), torch.device("cpu"))
    local = torch.tensor([tensor_hash(named_tensors[n]) for n in names], dtype=torch.int64)
    table = collectives.all_gather(local.to(collectives.staging_device(group, device)), group, timeout).cpu()
    everyone = tuple(range(dist.get_world_size(group)))
    raise_on_mismatch(compare_hashes(table, [everyone] * len(names), [f"tensor {n!r}" for n in names]),
                      what="replicas")

"""Full-model state from the ranks' pieces, and pieces from a full state.

`assemble` builds every entry of the original state dict: each piece is written by its
leader (its lowest-ranked owner) into zeros and one all-reduce per dtype sums them, so
the result is bit-exact (x + 0 = x) and identical on every rank. With `reduce=False`
every held piece is written into a NaN-filled tensor instead: this rank's own view.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import all_reduce_by_dtype, describe_group
from ..ops.reference import as_2d


def _narrow(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    return t.view(1) if t.dim() == 0 else t.narrow(dim, start, length)


def assemble(layout, reduce: bool = True, process_group=None, timeout: float | None = None) -> dict:
    """{original name: tensor of the original shape}; see the module docstring.

    Args:
        layout: this rank's RankLayout.
        reduce: True sums the leaders' pieces over `process_group` (collective); False
            returns this rank's own view (NaN where it holds nothing), no communication.
        timeout: seconds the all-reduce may take (None: the group's own timeout).
    """
    plan, rank = layout.plan, layout.rank
    out = {}
    for name, shape in plan.tensor_shapes.items():
        dtype = getattr(torch, plan.tensor_dtypes[name])
        fill = float("nan") if (not reduce and plan.is_float(name)) else 0
        out[name] = torch.full(shape, fill, dtype=dtype, device=layout.device)
    with torch.no_grad():
        for p in layout.pieces:
            if layout.is_sharded(p):  # every rank writes its own rows (disjoint): the sum is exact
                _write_shard(layout, p, out[p.name])
                continue
            if not layout.owns(p) or (reduce and p.leader != rank):
                continue
            local = layout.value_of(p.name)
            _narrow(out[p.name], p.dim, p.start, p.length).copy_(
                _narrow(local, p.dim, layout.local_start[p], p.length))
        for name, leader in layout.integer_entries.items():
            if leader == rank or (not reduce and layout.holds_whole(name)):
                out[name].copy_(layout.value_of(name))
    if reduce and layout.world_size > 1 and dist.is_initialized():
        names = list(out)
        reduced = all_reduce_by_dtype([out[n] for n in names], process_group, timeout=timeout,
                                      label=describe_group(range(layout.world_size), layout.world_size),
                                      operation="all_reduce (full state)")
        out = dict(zip(names, reduced))
    return out


def _write_shard(layout, piece, full: torch.Tensor) -> None:
    """Copy this rank's dim-0 shard of a sharded shared parameter into `full` (its place)."""
    local, rect = layout.resolve_value(piece)
    r0, r1, c0, c1 = layout.held_rectangle(piece)
    as_2d(full)[r0:r1, c0:c1].copy_(as_2d(local)[rect[0]:rect[1], rect[2]:rect[3]])


def _read_shard(layout, piece, full: torch.Tensor) -> None:
    """Copy this rank's rows of `full` into its shard of a sharded shared parameter."""
    local, rect = layout.resolve_value(piece)
    r0, r1, c0, c1 = layout.held_rectangle(piece)
    as_2d(local, view=True)[rect[0]:rect[1], rect[2]:rect[3]].copy_(as_2d(full.to(local.device))[r0:r1, c0:c1])


def check_full_state_dict(plan, state_dict) -> None:
    """ValueError naming the missing, unexpected or mis-shaped entries of a full state dict."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"load_full_state_dict needs a dict of tensors, got {type(state_dict).__name__}")
    missing = [n for n in plan.tensor_shapes if n not in state_dict]
    unexpected = [n for n in state_dict if n not in plan.tensor_shapes]
    shapes = [f"{n}: checkpoint {tuple(state_dict[n].shape)} vs model {plan.tensor_shapes[n]}"
              for n in plan.tensor_shapes if n in state_dict and tuple(state_dict[n].shape) != plan.tensor_shapes[n]]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} entries (first: {missing[:3]})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} entries (first: {unexpected[:3]})")
        if shapes:
            parts.append(f"{len(shapes)} shape mismatch(es) (first: {shapes[:2]})")
        raise ValueError("the state dict does not belong to this model: " + "; ".join(parts))


def load_pieces(layout, state_dict) -> None:
    """Copy this rank's share of a full state dict (original names and shapes) into the
    local tensors of `layout` (a RankLayout). Not collective."""
    check_full_state_dict(layout.plan, state_dict)
    with torch.no_grad():
        for p in layout.pieces:
            if layout.is_sharded(p):
                _read_shard(layout, p, state_dict[p.name])
        if not layout.compact:  # full tensors on every rank (backward regime)
            for name in layout.plan.tensor_shapes:
                if name not in layout.sharded:
                    layout.value_of(name).copy_(state_dict[name])
            return
        for p in layout.pieces:
            if layout.owns(p) and not layout.is_sharded(p):
                src = state_dict[p.name].to(layout.device)
                _narrow(layout.value_of(p.name), p.dim, layout.local_start[p], p.length).copy_(
                    _narrow(src, p.dim, p.start, p.length))
        for name in layout.integer_entries:
            if layout.holds_whole(name):
                layout.value_of(name).copy_(state_dict[name])

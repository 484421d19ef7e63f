"""Full-model state from the ranks' pieces, and pieces from a full state.

`assemble` builds every entry of the original state dict: each piece is written by its
leader (its lowest-ranked owner) into zeros and the ranks' contributions are summed
(full_gather.py: one collective per bounded chunk), so the result is bit-exact (x + 0 = x)
and identical on every rank — or, with `rank0_only`, held by rank 0 alone while the other
ranks never hold more than one chunk. With `reduce=False` every held piece is written into
a NaN-filled tensor instead: this rank's own view.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import describe_group
from .full_gather import FullEntry, check_options, sum_gather
from .layout import RankLayout


def assemble(layout: RankLayout, reduce: bool = True, process_group=None, timeout: float | None = None,
             rank0_only: bool = False, cpu_offload: bool = False) -> dict:
    """{original name: tensor of the original shape}; see the module docstring.

    Args:
        layout: this rank's RankLayout.
        reduce: True sums the leaders' pieces over `process_group` (collective); False
            returns this rank's own view (NaN where it holds nothing), no communication.
        timeout: seconds each collective may take (None: the group's own timeout).
        rank0_only, cpu_offload (reduce only): group rank 0 alone gets the state (every other
            rank {}); the returned tensors are on the CPU. As FSDP's full state dict options.
    """
    check_options("full_state_dict", rank0_only, cpu_offload)
    plan = layout.plan
    by_name = {}
    for held in layout.held_values():
        by_name.setdefault(held.piece.name, []).append(held)
    if reduce:
        entries = [FullEntry(n, shape, getattr(torch, plan.tensor_dtypes[n]))
                   for n, shape in plan.tensor_shapes.items()]
        return sum_gather(entries, lambda name, target: _write_held(layout, by_name.get(name, ()), name, target, True),
                          layout.device, process_group, timeout, rank0_only, cpu_offload,
                          communicate=layout.world_size > 1 and dist.is_initialized(),
                          label=describe_group(range(layout.world_size), layout.world_size))
    out = {}
    with torch.no_grad():
        for name, shape in plan.tensor_shapes.items():
            dtype = getattr(torch, plan.tensor_dtypes[name])
            out[name] = torch.full(shape, float("nan") if plan.is_float(name) else 0, dtype=dtype,
                                   device=layout.device)
            _write_held(layout, by_name.get(name, ()), name, out[name], False)
    return out


def _write_held(layout: RankLayout, held_pieces, name: str, target: torch.Tensor, leaders_only: bool) -> None:
    """Write this rank's values of entry `name` into `target` (full shape): the pieces it owns
    (only those it leads when `leaders_only`), its rows of a sharded parameter (every rank
    writes its own rows, disjoint, so the sum is exact), and an integer entry it reports
    (or, not `leaders_only`, any it holds)."""
    for held in held_pieces:
        mine = layout.contributes(held.piece) if leaders_only else layout.owns(held.piece) or \
            layout.is_sharded(held.piece)
        if mine:
            held.write_into_full(target)
    leader = layout.integer_entries.get(name)
    if leader is not None and (leader == layout.rank or (not leaders_only and layout.holds_whole(name))):
        target.copy_(layout.value_of(name))


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


def load_pieces(layout: RankLayout, state_dict) -> None:
    """Copy this rank's share of a full state dict (original names and shapes) into the
    local tensors of `layout`. Not collective."""
    check_full_state_dict(layout.plan, state_dict)
    with torch.no_grad():
        for held in layout.held_values():
            # Forward regime: the owned pieces of compact tensors; either regime: shard rows.
            if layout.compact or layout.is_sharded(held.piece):
                held.read_from_full(state_dict[held.piece.name])
        if not layout.compact:  # full tensors on every rank (backward regime)
            for name in layout.plan.tensor_shapes:
                if name not in layout.sharded:
                    layout.value_of(name).copy_(state_dict[name])
            return
        for name in layout.integer_entries:
            if layout.holds_whole(name):
                layout.value_of(name).copy_(state_dict[name])

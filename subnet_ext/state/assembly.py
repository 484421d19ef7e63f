"""Full-model state from the ranks' pieces, and pieces from a full state.

`assemble` builds every entry of the original state dict: each piece is written by its
leader (its lowest-ranked owner) into zeros and one all-reduce per dtype sums them, so
the result is bit-exact (x + 0 = x) and identical on every rank. With `reduce=False`
every held piece is written into a NaN-filled tensor instead: this rank's own view.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import describe_group, wait

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _narrow(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    return t.view(1) if t.dim() == 0 else t.narrow(dim, start, length)


def assemble(engine, reduce: bool = True) -> dict:
    """{original name: tensor of the original shape}; see the module docstring."""
    plan, rank = engine.plan, engine.rank
    out = {}
    for name, shape in plan.tensor_shapes.items():
        dtype = getattr(torch, plan.tensor_dtypes[name])
        fill = float("nan") if (not reduce and dtype in FLOATS) else 0
        out[name] = torch.full(shape, fill, dtype=dtype, device=engine.device)
    with torch.no_grad():
        for p in engine.pieces:
            if rank not in p.owners or (reduce and p.leader != rank):
                continue
            local = engine.value_of(p.name)
            _narrow(out[p.name], p.dim, p.start, p.length).copy_(
                _narrow(local, p.dim, engine.local_start[p], p.length))
        for name, leader in engine.integer_entries.items():
            if leader == rank or (not reduce and engine.holds_whole(name)):
                out[name].copy_(engine.value_of(name))
    if reduce and engine.world_size > 1 and dist.is_initialized():
        by_dtype = {}
        for name, t in out.items():
            by_dtype.setdefault(t.dtype, []).append(name)
        for dtype, names in by_dtype.items():
            flat = torch.cat([out[n].reshape(-1) for n in names])
            wait(dist.all_reduce(flat, group=engine.process_group, async_op=True), "all_reduce (full state)",
                 describe_group(range(engine.world_size), engine.world_size), getattr(engine, "timeout", None))
            for n, part in zip(names, flat.split([out[n].numel() for n in names])):
                out[n] = part.view(out[n].shape)
    return out


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


def load_pieces(engine, state_dict) -> None:
    """Copy this rank's share of a full state dict into its local tensors."""
    check_full_state_dict(engine.plan, state_dict)
    with torch.no_grad():
        if engine.regime == "backward":
            for name in engine.plan.tensor_shapes:
                engine.value_of(name).copy_(state_dict[name])
            return
        for p in engine.pieces:
            if engine.rank in p.owners:
                src = state_dict[p.name].to(engine.device)
                _narrow(engine.value_of(p.name), p.dim, engine.local_start[p], p.length).copy_(
                    _narrow(src, p.dim, p.start, p.length))
        for name in engine.integer_entries:
            if engine.holds_whole(name):
                engine.value_of(name).copy_(state_dict[name])

"""Slicing one neuron/head group to the units this rank owns (the forward regime's compact tensors).

Each member tensor of the group is replaced by its owned rows or columns, in global
order (a fused qkv tensor keeps its q, k, v layout: the owned q heads, then k, then v),
and the attributes code reads as widths follow: nn.Linear/Conv/norm widths, transformers'
Conv1D nx/nf, and an attention's head count (`num_heads`, `n_head`) with the widths
derived from it (`split_size`, `attn_dim`, `n_embd` where they equal heads x head_dim).
restore.py puts every one of these attributes back on close().
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..planning.pieces import Piece, owned_indices

WIDTH_ATTRS = {0: ("out_features", "out_channels", "num_features", "normalized_shape"),
               1: ("in_features", "in_channels")}
CONV1D_ATTRS = ("nx", "nf")  # transformers' Conv1D: inputs, outputs
HEAD_COUNT_ATTRS = ("num_heads", "n_head")
HEAD_WIDTH_ATTRS = ("split_size", "attn_dim", "n_embd")


def split_name(name: str) -> tuple[str, str]:
    """('a.b', 'c') for 'a.b.c': the module path and the leaf attribute of a dotted name."""
    path, _, leaf = name.rpartition(".")
    return path, leaf


def replace_tensor(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` where parameter or buffer `name` (relative to root) was, as a Parameter
    with the old requires_grad when it was one."""
    path, leaf = split_name(name)
    module = root.get_submodule(path)
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=old.requires_grad)
    else:
        module._buffers[leaf] = tensor


def _fix_width_attrs(module: nn.Module, dim: int, width: int) -> None:
    for attr in WIDTH_ATTRS[dim]:
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, width)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def fix_head_attrs(attn: nn.Module, units: int, kept: int, unit_width: int) -> None:
    """An attention whose forward reshapes by its head count must see the kept heads.

    units: units of the head group (heads, or kv heads with their query heads); kept: those
    this rank holds; unit_width: one unit's width at the output projection's input (head_dim,
    or query heads per kv head x head_dim)."""
    for attr in HEAD_COUNT_ATTRS:
        heads = getattr(attn, attr, None)
        if _is_int(heads) and heads % units == 0:
            setattr(attn, attr, kept * (heads // units))
    for attr in HEAD_WIDTH_ATTRS:
        if _is_int(getattr(attn, attr, None)) and getattr(attn, attr) == units * unit_width:
            setattr(attn, attr, kept * unit_width)


def consumer_member(group):
    """The member of a head group at its output projection's input (one unit's width there)."""
    return next(m for m in group.members if split_name(m.name)[0] in group.consumers and not m.buffer)


def slice_group(root: nn.Module, prefix: str, group, pieces: list[Piece], rank: int, kept: int) -> None:
    """Slice `group`'s members in `root` to this rank's units, in place.

    root: the model (prefix "") or a copy of the group's module (prefix: its path in the
    model, stripped from the members' names). kept: units of the group this rank owns."""
    strip = len(prefix) + 1 if prefix else 0
    for name in dict.fromkeys(m.name for m in group.members):  # a fused tensor is listed once per block
        dim, idx = owned_indices(pieces, rank, name)
        buffer = not any(m.name == name and not m.buffer for m in group.members)
        local = name[strip:]
        full = root.get_parameter(local) if not buffer else root.get_buffer(local)
        with torch.no_grad():
            compact = full.detach().index_select(dim, idx.to(full.device)).contiguous()
        replace_tensor(root, local, compact)
        module = root.get_submodule(split_name(local)[0])
        if type(module).__name__ == "Conv1D":  # weight [in, out]: nf outputs, nx inputs
            module.nx, module.nf = module.weight.shape
        else:
            _fix_width_attrs(module, dim, compact.shape[dim])
    if group.kind == "head":
        attn = root.get_submodule(group.path[strip:])
        fix_head_attrs(attn, group.size, kept, consumer_member(group).width)

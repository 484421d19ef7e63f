"""Slicing one neuron/head group to the units this rank owns (the forward regime's compact tensors).

Each member tensor of the group is replaced by its owned rows or columns, in global order (a
fused qkv tensor keeps its q, k, v layout: the owned q heads, then k, then v), on the engine's
stand-in for its layer (sliced_layers.py, swapped in and recorded by module_swaps.py, the user's
layer set aside with that tensor released), and the stand-in's attributes code reads as widths
follow: nn.Linear/Conv/norm widths, transformers' Conv1D nx/nf. A head group's attention is
swapped for its twin, whose head count (`num_heads`, `n_head`) and the widths derived from it
(`split_size`, `attn_dim`, `n_embd` where they equal heads x head_dim) become the kept heads'.
torch's nn.MultiheadAttention is swapped for a SlicedMultiheadAttention (sliced_attention.py):
its own forward cannot run with its heads sliced. The user's modules keep their attributes;
close() swaps them back and loads the trained values.
A tensor of the root module itself cannot be swapped out: it is sliced in place, the change
and its module's widths recorded in the same swap record (ModuleSwaps.put_tensor / put).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...planning.pieces import Piece, owned_indices
from .module_swaps import ModuleSwaps
from ..layers.sliced_attention import SlicedMultiheadAttention, attention_stand_in
from ..layers.sliced_layers import Sliced, sliced_stand_in

WIDTH_ATTRS = {0: ("out_features", "out_channels", "num_features", "normalized_shape"),
               1: ("in_features", "in_channels")}
CONV1D_ATTRS = ("nx", "nf")  # transformers' Conv1D: inputs, outputs
HEAD_COUNT_ATTRS = ("num_heads", "n_head")
HEAD_WIDTH_ATTRS = ("split_size", "attn_dim", "n_embd")


def split_name(name: str) -> tuple[str, str]:
    """('a.b', 'c') for 'a.b.c': the module path and the leaf attribute of a dotted name."""
    path, _, leaf = name.rpartition(".")
    return path, leaf


def _fix_width_attrs(module: nn.Module, dim: int, width: int, swaps: ModuleSwaps) -> None:
    for attr in WIDTH_ATTRS[dim]:
        if isinstance(getattr(module, attr, None), int):
            swaps.put(module, attr, width)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def fix_head_attrs(attn: nn.Module, units: int, kept: int, unit_width: int, swaps: ModuleSwaps) -> None:
    """An attention whose forward reshapes by its head count must see the kept heads.

    units: units of the head group (heads, or kv heads with their query heads); kept: those
    this rank holds; unit_width: one unit's width at the output projection's input (head_dim,
    or query heads per kv head x head_dim)."""
    for attr in HEAD_COUNT_ATTRS:
        heads = getattr(attn, attr, None)
        if _is_int(heads) and heads % units == 0:
            swaps.put(attn, attr, kept * (heads // units))
    for attr in HEAD_WIDTH_ATTRS:
        if _is_int(getattr(attn, attr, None)) and getattr(attn, attr) == units * unit_width:
            swaps.put(attn, attr, kept * unit_width)


def consumer_member(group):
    """The member of a head group at its output projection's input (one unit's width there)."""
    return next(m for m in group.members if split_name(m.name)[0] in group.consumers and not m.buffer)


def compact_copy(full: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    """The rows (dim 0) or columns (dim 1) `idx` of `full`, in that order, as a new contiguous tensor."""
    with torch.no_grad():
        return full.detach().index_select(dim, idx.to(full.device)).contiguous()


def slice_group(root: nn.Module, prefix: str, group, pieces: list[Piece], rank: int, kept: int,
                swaps: ModuleSwaps) -> None:
    """Slice `group`'s members in `root` to this rank's units, swapping the engine's stand-ins in
    for their modules (recorded in `swaps`; module docstring).

    root: the model (prefix "") or a copy of the group's module (prefix: its path in the
    model, stripped from the members' names). kept: units of the group this rank owns."""
    strip = len(prefix) + 1 if prefix else 0
    if group.kind == "head":
        attn = swaps.stand_in(root, group.path[strip:], attention_stand_in)
        out = consumer_member(group)
        fix_head_attrs(attn, group.size, kept, out.width, swaps)
        if isinstance(attn, SlicedMultiheadAttention):  # which heads it holds, for a per-head attention mask
            attn.kept_heads = torch.unique(owned_indices(pieces, rank, out.name)[1] // out.width)
    for name in dict.fromkeys(m.name for m in group.members):  # a fused tensor is listed once per block
        dim, idx = owned_indices(pieces, rank, name)
        path, leaf = split_name(name[strip:])
        layer = swaps.stand_in(root, path, sliced_stand_in)
        registry = layer._parameters if leaf in layer._parameters else layer._buffers
        swaps.put_tensor(layer, leaf, compact_copy(registry[leaf], dim, idx))
        if isinstance(layer, Sliced):
            layer.owned[leaf] = (dim, idx)
        if type(layer).__name__ == "Conv1D":  # weight [in, out]: nf outputs, nx inputs
            swaps.put(layer, "nx", layer.weight.shape[0])
            swaps.put(layer, "nf", layer.weight.shape[1])
        else:
            _fix_width_attrs(layer, dim, registry[leaf].shape[dim], swaps)

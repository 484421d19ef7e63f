"""Forward regime: the engine's compact layers, standing in for the user's sliced ones.

The forward regime runs only this rank's subnetwork, so a sliced layer holds only the owned
rows or columns of its tensors (compact, in global order). slicing.py swaps a stand-in in for
the user's layer (module_swaps.py) and slices the stand-in's tensors, never the user's module:
`SlicedLinear` for an nn.Linear, `SlicedConv2d` for an nn.Conv2d, and for any other sliced
layer (a norm, transformers' Conv1D, a subclass with its own forward) its twin, the same class.
A stand-in is its original's twin (the same attributes, hooks and forward, registries of its
own), so it computes what the user's layer computes on the kept units, bit for bit.

The user's module is set aside with its sliced tensors released to the meta device (no
memory: what this rank does not own is freed); `close()` swaps it back and re-creates its
tensors with the assembled values (restore.py). Its class, attributes and forward never change.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .module_swaps import twin


class _Sliced:
    """What the engine's compact layers share: `owned`, {tensor name: (dim, global indices of the
    rows or columns it holds, in order)}, filled by slicing.py."""

    owned: dict

    def extra_repr(self) -> str:
        """The layer's own repr, with the units it holds per sliced tensor."""
        held = ", ".join(f"{name}[dim {dim}]: {len(idx)}" for name, (dim, idx) in self.owned.items())
        return f"{super().extra_repr()}, owned=({held})"


class SlicedLinear(_Sliced, nn.Linear):
    """An nn.Linear holding the owned rows of its weight [kept out, in] (and bias [kept out]), or
    its owned columns [out, kept in]: x [..., in_features] -> [..., out_features], the widths kept."""


class SlicedConv2d(_Sliced, nn.Conv2d):
    """An nn.Conv2d holding its owned output channels (weight [kept out, in/groups, kh, kw], bias)
    or input channels (weight [out, kept in, kh, kw]): x [B, in_channels, H, W] -> [B, out_channels, H', W']."""


_STAND_INS = {nn.Linear: SlicedLinear, nn.Conv2d: SlicedConv2d}


def sliced_stand_in(module: nn.Module) -> nn.Module:
    """The engine's layer for the user's `module` before slicing: a SlicedLinear / SlicedConv2d
    for an nn.Linear / nn.Conv2d (exactly those classes: a subclass keeps its own forward), else
    its twin; holding `module`'s tensors until slicing.py replaces the sliced ones."""
    cls = _STAND_INS.get(type(module))
    layer = twin(module, cls)
    if cls is not None:
        layer.owned = {}
    return layer


def release(module: nn.Module, leaf: str) -> None:
    """Drop `module`'s tensor `leaf` (a parameter or buffer) for a meta tensor of its shape, dtype
    and requires_grad: its memory is freed (unless the caller holds it) and close() re-creates it."""
    if leaf in module._parameters:
        p = module._parameters[leaf]
        if not p.is_meta:
            module._parameters[leaf] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    elif module._buffers.get(leaf) is not None and not module._buffers[leaf].is_meta:
        module._buffers[leaf] = torch.empty_like(module._buffers[leaf], device="meta")

"""Forward regime: the engine's compact layers, standing in for the user's sliced ones.

The forward regime runs only this rank's subnetwork, so a sliced layer holds only the owned
rows or columns of its tensors (compact, in global order). slicing.py swaps a stand-in in for
the user's layer (module_swaps.py) and slices the stand-in's tensors, never the user's module:
`SlicedLinear` for an nn.Linear, `SlicedConv2d` for an nn.Conv2d, and for any other sliced
layer (a norm, transformers' Conv1D, a subclass with its own forward) its twin, the same class.
A stand-in is its original's twin (the same attributes, hooks and forward, registries of its
own), so it computes what the user's layer computes on the kept units, bit for bit.

The user's module is set aside with its sliced tensors released to the meta device (no
memory: what this rank does not own is freed; ModuleSwaps.release); `close()` swaps it back,
gives those tensors memory again and loads the trained values. Its class, attributes and
forward never change.
"""
from __future__ import annotations

import torch.nn as nn

from ..regimes.module_swaps import twin


class Sliced:
    """What the engine's compact layers share: `owned`, {tensor name: (dim, global indices of the
    rows or columns it holds, in order)}, filled by slicing.py."""

    owned: dict

    def extra_repr(self) -> str:
        """The layer's own repr, with the units it holds per sliced tensor."""
        held = ", ".join(f"{name}[dim {dim}]: {len(idx)}" for name, (dim, idx) in self.owned.items())
        return f"{super().extra_repr()}, owned=({held})"


class SlicedLinear(Sliced, nn.Linear):
    """An nn.Linear holding the owned rows of its weight [kept out, in] (and bias [kept out]), or
    its owned columns [out, kept in]: x [..., in_features] -> [..., out_features], the widths kept."""


class SlicedConv2d(Sliced, nn.Conv2d):
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


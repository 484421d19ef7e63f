"""Module swaps: the engine's layers stand in for the user's, and step aside at close().

The surgery replaces a sliced layer (an nn.Linear or nn.Conv2d of the backward regime, a
width-kept projection of the forward regime) by a module of the engine's own (owned_linear.py,
owned_conv.py, width_keeping.py) in every parent that holds it, instead of patching the
user's module: the user's module keeps its class, its `forward` and its attributes, and
`undo()` puts the very same object back, so a reference the user kept to it stays valid.

A replacement registers the user's unsliced parameters and buffers under their own names
(`adopt_tensors`), so `named_parameters()` and state-dict names do not move with the swap.
"""
from __future__ import annotations

import torch.nn as nn


def adopt_tensors(replacement: nn.Module, original: nn.Module, skip=()) -> None:
    """Register `original`'s parameters and buffers (the same tensor objects, persistence kept)
    on `replacement` under their own names, in their order, except the names in `skip`."""
    for name, param in original._parameters.items():
        if name not in skip:
            replacement.register_parameter(name, param)
    for name, buffer in original._buffers.items():
        if name not in skip:
            replacement.register_buffer(name, buffer, persistent=name not in original._non_persistent_buffers_set)
    replacement.train(original.training)


class ModuleSwaps:
    """The swaps made in one model, in order, so they can be undone in reverse order."""

    def __init__(self):
        self._done: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, child name, original)

    def swap(self, root: nn.Module, path: str, replacement: nn.Module) -> nn.Module:
        """Put `replacement` where `root.get_submodule(path)` is, in every parent module holding
        that object (a module shared by two parents is replaced in both); returns the original."""
        if not path:
            raise ValueError(f"ModuleSwaps.swap: cannot replace the root module itself by a "
                             f"{type(replacement).__name__}; wrap a model that contains the layer")
        original = root.get_submodule(path)
        for parent in root.modules():
            for name, child in list(parent._modules.items()):
                if child is original:
                    parent._modules[name] = replacement
                    self._done.append((parent, name, original))
        return original

    def undo(self) -> None:
        """Put every original module back in its parents, last swap first."""
        for parent, name, original in reversed(self._done):
            parent._modules[name] = original
        self._done.clear()

    def __len__(self) -> int:
        return len(self._done)

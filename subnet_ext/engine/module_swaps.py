"""Module swaps: the engine's layers stand in for the user's, and step aside at close().

The surgery replaces a sliced layer (an nn.Linear or nn.Conv2d of the backward regime, a
width-kept projection of the forward regime) by a module of the engine's own (owned_linear.py,
owned_conv.py, width_keeping.py) in every parent that holds it, instead of patching the
user's module: the user's module keeps its class, its `forward` and its attributes, and
`undo()` puts the very same object back, so a reference the user kept to it stays valid.

A replacement registers the user's unsliced parameters and buffers under their own names
(`adopt_tensors`), so `named_parameters()` and state-dict names do not move with the swap.
A layer the engine has no class for (a norm, a grouped convolution) is replaced by its `twin`:
the same class and tensors, but registries of its own, so what the surgery changes on the twin
(owned views, a pre-hook) never reaches the user's module.
"""
from __future__ import annotations

import copy

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


def twin(module: nn.Module, cls: type | None = None) -> nn.Module:
    """A shallow copy of `module`: the same class (or `cls`, a subclass of it that adds no state),
    attributes, tensors and submodules, with its own registries (parameters, buffers, submodules,
    hooks: every dict and set in its __dict__) and its instance methods bound to itself, so
    registering or removing on the twin leaves `module` as it was and the twin computes with
    what it holds."""
    if cls is None:
        twin_module = copy.copy(module)
    else:
        if not issubclass(cls, type(module)):
            raise TypeError(f"twin: a {cls.__name__} cannot be the twin of a {type(module).__name__} "
                            "(it must be a subclass of the module's class)")
        twin_module = cls.__new__(cls)
        twin_module.__dict__.update(vars(module))
    for key, value in vars(module).items():
        if isinstance(value, (dict, set)):
            twin_module.__dict__[key] = value.copy()
        elif getattr(value, "__self__", None) is module and hasattr(value, "__func__"):
            # A method bound to the module in its __dict__ (e.g. a patched forward) must run on the twin.
            twin_module.__dict__[key] = value.__func__.__get__(twin_module, type(twin_module))
    return twin_module


class ModuleSwaps:
    """The swaps made in one model, in order, so they can be undone in reverse order."""

    def __init__(self):
        self._done: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, child name, original)
        self._originals: dict[int, nn.Module] = {}  # id(replacement) -> the module it stands in for

    def original_of(self, module: nn.Module) -> nn.Module | None:
        """The user's module `module` stands in for, or None when `module` is not a replacement."""
        return self._originals.get(id(module))

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
        self._originals[id(replacement)] = original
        return original

    def undo(self) -> None:
        """Put every original module back in its parents, last swap first, in the train or eval
        mode its replacement was left in (sdp.train()/eval() reached only the replacement)."""
        for parent, name, original in reversed(self._done):
            original.train(parent._modules[name].training)
            parent._modules[name] = original
        self._done.clear()
        self._originals.clear()

"""Undo the model surgery: give the user back the model as it was before wrapping.

surgery.py changes the user's modules in place only where no module swap can: in the forward
regime, skipped blocks (SkippedBlock) and a sliced root module (compact Parameters, widths), and
the sliced tensors of the layers it swapped out, released to the meta device; in the backward
regime, Parameters' requires_grad (block level) and a sliced root module (owned-slice Parameters,
`*_full` buffers, an instance attribute shadowing a parameter's name). The layers it swapped for
its own (module_swaps.py: sliced layers and attentions of the forward regime, width-kept
projections, sliced layers of the backward regime) are put back by `ModuleSwaps.undo()` before
this runs. `restore_structure` puts back,
module by module, what the engine's meta skeleton (a copy of the model taken before
the surgery) says was there: the same submodule types, parameter and buffer names,
shapes, dtypes, requires_grad and order, and the same width and head-count attributes. The values of
re-created tensors are left uninitialised: the caller loads the assembled full state.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..planning.model_copy import copy_model
from .slicing import CONV1D_ATTRS, HEAD_COUNT_ATTRS, HEAD_WIDTH_ATTRS, WIDTH_ATTRS

# Integer attributes slicing.py may change: layer widths, an attention's head count and head widths.
_WIDTHS = tuple(a for attrs in WIDTH_ATTRS.values() for a in attrs) + CONV1D_ATTRS + HEAD_COUNT_ATTRS \
    + HEAD_WIDTH_ATTRS


def materialise(skeleton: nn.Module, device: torch.device, tensors: torch.device | str | None = None) -> nn.Module:
    """A copy of a (meta) skeleton module with uninitialised tensors on `tensors` (default `device`);
    its non-persistent buffers (real in the skeleton, e.g. rotary tables) keep their values, on
    `device`. (nn.Module.to_empty would leave those uninitialised too.)"""
    tensors = device if tensors is None else tensors
    module = copy_model(skeleton)
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = nn.Parameter(torch.empty_like(p, device=tensors),
                                                     requires_grad=p.requires_grad)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = torch.empty_like(b, device=tensors) if b.is_meta else b.to(device)
    return module


def materialise_meta(model: nn.Module, device: torch.device) -> int:
    """Give every meta parameter and buffer of `model` uninitialised memory on `device` (a Parameter
    keeps its requires_grad; one tensor reached under several names stays one); returns how many.
    What a change of assignment hands this rank arrives there (engine/reassignment.py)."""
    made = {}
    for sub in model.modules():
        for registry in (sub._parameters, sub._buffers):
            for name, t in list(registry.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    real = torch.empty_like(t, device=device)
                    made[id(t)] = nn.Parameter(real, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                        else real
                registry[name] = made[id(t)]
    return len(made)


def _restore_module(module: nn.Module, original: nn.Module, device: torch.device, tensors) -> None:
    """Make `module`'s own tensors and attributes match `original` (its skeleton twin); tensors it must
    re-create go to `tensors` (a device), real non-persistent buffers to `device`."""
    params = {}
    for name, ref in original._parameters.items():
        module.__dict__.pop(name, None)  # an instance attribute shadowing the parameter's name
        current = module._parameters.get(name)
        if ref is None:
            params[name] = None
        elif current is None or current.is_meta or current.shape != ref.shape or current.dtype != ref.dtype:
            params[name] = nn.Parameter(torch.empty(ref.shape, dtype=ref.dtype, device=tensors),
                                        requires_grad=ref.requires_grad)
        else:
            params[name] = current.requires_grad_(ref.requires_grad)
    module._parameters.clear()
    module._parameters.update(params)  # the original names, in the original order
    buffers = {}
    for name, ref in original._buffers.items():
        current = module._buffers.get(name)
        if ref is None or (current is not None and not current.is_meta and current.shape == ref.shape
                           and current.dtype == ref.dtype):
            buffers[name] = current
        else:
            buffers[name] = torch.empty_like(ref, device=tensors) if ref.is_meta else ref.to(device)
    module._buffers.clear()
    module._buffers.update(buffers)
    module._non_persistent_buffers_set.clear()
    module._non_persistent_buffers_set.update(original._non_persistent_buffers_set)
    for attr in _WIDTHS:
        if isinstance(getattr(original, attr, None), int):
            setattr(module, attr, getattr(original, attr))


def restore_structure(model: nn.Module, skeleton: nn.Module, device: torch.device, missing: str = "empty") -> None:
    """In place: every submodule of `model` gets back the type, tensors (names, shapes,
    dtypes, requires_grad, order) and width attributes of its twin in `skeleton`.

    Submodules whose type differs (SkippedBlock) are replaced by a materialised copy of
    the skeleton's; tensors that are re-created are uninitialised on `device` (missing="empty"),
    or on the meta device (missing="meta": no memory, what a change of assignment undoes to).
    """
    tensors = device if missing == "empty" else torch.device("meta")
    replaced = []
    for path, original in skeleton.named_modules():
        if not path or any(path.startswith(r + ".") for r in replaced):
            continue
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        current = parent._modules.get(leaf)
        if current is None or type(current) is not type(original):
            parent._modules[leaf] = materialise(original, device, tensors)
            replaced.append(path)
    for path, original in skeleton.named_modules():
        if not any(path == r or path.startswith(r + ".") for r in replaced):
            _restore_module(model.get_submodule(path), original, device, tensors)


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of the model whose parameters and persistent buffers live on the meta device
    (no memory); non-persistent buffers (e.g. rotary tables) are real copies."""
    memo = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for m in model.modules():
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                memo[id(b)] = torch.empty_like(b, device="meta")
    return copy_model(model, memo)

"""The model without the memory of what this rank does not hold: meta tensors.

`meta_skeleton` is a copy of the model as it was before the surgery, its parameters and
persistent buffers on the meta device: the names, shapes and classes the full model is rebuilt
from (`full_model()`, `evaluate()`'s "full" mode, residual scaling). `materialise_meta` gives
memory back to the meta tensors of a model: the ones a change of assignment hands this rank
(reassignment.py fills them), and at `close()` the ones the swap record released
(module_swaps.py), before the trained values are loaded into them.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...planning.discovery.model_copy import copy_model


def materialise_meta(model: nn.Module, device: torch.device) -> int:
    """Give every meta parameter and buffer of `model` uninitialised memory on `device` (a Parameter
    keeps its requires_grad; one tensor reached under several names stays one); returns how many."""
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

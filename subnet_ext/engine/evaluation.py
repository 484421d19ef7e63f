"""Evaluation of the union of the ranks' subnetworks ("full") and of their ensemble.

"full" runs the original, unmasked model (the engine's meta skeleton) on the assembled
full state; "ensemble" runs each rank's own subnetwork and averages the logits with one
all-reduce. Tied weights stay tied: only canonical names are loaded, and the skeleton
resolves each alias to its canonical tensor.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..comm import collectives
from ..state.aliases import retie, without_aliases


def full_model(skeleton: nn.Module, plan, full_state: dict) -> nn.Module:
    """A new model built from the meta `skeleton` holding `full_state` (ties re-made)."""
    model = copy.deepcopy(skeleton)
    canonical = without_aliases(plan, full_state)
    missing, unexpected = model.load_state_dict(canonical, assign=True, strict=False)
    if sorted(missing) != sorted(plan.aliases) or unexpected:  # assign=True would untie an alias
        raise RuntimeError(f"subnet_ext: full_model() could not load missing {missing} / unexpected {unexpected}")
    retie(plan, model)
    return model


def evaluate(module: nn.Module, skeleton: nn.Module, plan, inputs: tuple, modes, full_state_fn,
             mean_over: tuple) -> dict:
    """{"ensemble": mean of every rank's module(*inputs), "full": skeleton(*inputs) on the full
    state}, as float32, for the requested modes.

    Args:
        module: this rank's subnetwork; skeleton: the unmasked model on the meta device.
        full_state_fn: () -> the full state dict (collective on every rank).
        mean_over: (communicate, process group, world size, timeout); communicate False (one
            rank, or a simulated rank) keeps this rank's own logits as the ensemble.
    """
    communicate, group, world_size, timeout = mean_over
    was_training = module.training
    module.eval()
    out = {}
    try:
        if "ensemble" in modes:
            y = module(*inputs).float()
            if communicate:
                collectives.all_reduce(y, group, timeout=timeout)
                y /= world_size
            out["ensemble"] = y
        if "full" in modes:
            # Canonical names only: functional_call ties an alias to its canonical value.
            canonical = without_aliases(plan, full_state_fn())
            out["full"] = torch.func.functional_call(skeleton.eval(), canonical, inputs).float()
    finally:
        module.train(was_training)
    return out

"""Owner-fraction residual scaling of the assembled model: stochastic depth's test-time rule
applied to SDP's union of subnetworks (block level).

In the forward regime each rank trains only the blocks it owns, so block u's residual
branch was present in a fraction c_u / K of the ranks' forwards, as a block of stochastic
depth is present with its survival probability. The assembled model runs every block; the
rule multiplies each block's residual branches by c_u / K (blocks every rank owns are left
alone). The scale lives in the weights (planning/discovery/branch_ends.py: every direct parameter of
each branch's last affine operation times the factor), so the scaled state dict loads into
the original, unwrapped model class.
"""
from __future__ import annotations

import torch.nn as nn

from ...planning.discovery.branch_ends import branch_ends

RESIDUAL_SCALES = ("none", "owner_fraction")


def check_residual_scale(residual_scale) -> str:
    """The option's value ("none" for None); ValueError naming the choices otherwise."""
    value = "none" if residual_scale is None else residual_scale
    if value not in RESIDUAL_SCALES:
        raise ValueError(f"residual_scale must be one of {RESIDUAL_SCALES} (or None), got {residual_scale!r}")
    return value


def owner_fractions(plan) -> dict[str, float]:
    """{block path: owners / K} of every block unit of the plan, in plan order."""
    return {u.group: int(plan.owner_count[i]) / plan.world_size
            for i, u in enumerate(plan.units) if u.kind == "block"}


def scaled_names(plan, skeleton: nn.Module) -> dict[str, float]:
    """{state-dict name: factor} of the parameters the owner-fraction rule scales (factor < 1 only).

    Raises:
        ValueError: a neuron-level plan (no block units), a branch whose end cannot hold the
            scale (planning/discovery/branch_ends.py), or a scaled parameter tied to another tensor.
    """
    fractions = owner_fractions(plan)
    if not fractions:
        raise ValueError(f"residual_scale='owner_fraction' scales residual blocks; this plan is at the "
                         f"{plan.level} level and has none (use residual_scale=None)")
    tied = set(plan.aliases) | set(plan.aliases.values())
    names = {}
    for block, factor in fractions.items():
        if factor == 1.0:
            continue
        for end in branch_ends(skeleton, block):
            for leaf, _ in skeleton.get_submodule(end).named_parameters(recurse=False):
                name = f"{end}.{leaf}"
                if name in tied:
                    raise ValueError(f"residual_scale: {name} is tied to another tensor; scaling it would scale "
                                     "that one too")
                names[name] = factor
    return names


def scale_full_state(state: dict, plan, skeleton: nn.Module, residual_scale) -> dict:
    """`state` (a full state dict) with the residual branches scaled per `residual_scale`
    ("none"/None: `state` itself; "owner_fraction": a new dict, the scaled entries new tensors)."""
    if check_residual_scale(residual_scale) == "none":
        return state
    out = dict(state)
    for name, factor in scaled_names(plan, skeleton).items():
        out[name] = state[name] * factor
    return out

"""What a plan reads of a model at one level, before any unit has an owner.

`model_units(model, level, ...)` finds the unit groups (blocks.py, units.py), the shared
entries, tied aliases, the state dict's shapes and dtypes and, from a sample input, the FLOPs:
everything of a plan that does not depend on the world size, the coverage or the seed.
`plan.plan_from_units` plans it at any of those without reading the model again
(plan_for_memory plans every owner count from one ModelUnits per level);
`plan.plan_subnetworks` is the two in one.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import torch.nn as nn

from .aliases import find_aliases
from .blocks import find_blocks
from ...vocabulary import LEVELS
from .flops import trace_unit_flops
from .units import check_no_chained, find_neuron_groups
from .unsplit import no_units_error


def model_fingerprint(model: nn.Module) -> str:
    """Hash of the names, shapes and dtypes of every state-dict entry (structure, not values)."""
    h = hashlib.sha256()
    for name, t in model.state_dict(keep_vars=True).items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


@dataclass
class ModelUnits:
    """What a plan reads of a model at one level, before any unit has an owner: the unit groups,
    the shared entries, the state dict's shapes and dtypes (by name), the parameter names in
    model order, tied aliases, the traced FLOPs ({"unit", "shared", "source"}, or None) and the
    structure fingerprint. One model's ModelUnits plans it at any world size and coverage
    (plan_from_units) without reading the model again, as plan_for_memory does for every owner count."""

    level: str
    groups: list
    shared: list
    shapes: dict
    dtypes: dict
    param_names: list
    aliases: dict
    flops: dict | None
    fingerprint: str
    unsplit: dict  # {module path: why it is no unit}: modules left whole that could have been units (summary())


def model_units(model: nn.Module, level: str = "block", blocks=None, neuron_groups=None,
                sample_input=None) -> ModelUnits:
    """The units of `model` at `level` (declarations and sample_input as plan_subnetworks'), its
    shared entries and costs; ValueError when it has no unit at that level."""
    if level not in LEVELS:
        raise ValueError(f"level must be 'block' or 'neuron', got {level!r}")
    unsplit = {}  # {module path: why it is no unit}, for summary()
    groups = find_blocks(model, blocks, sample_input, unsplit) if level == "block" else \
        find_neuron_groups(model, neuron_groups, unsplit)
    if not groups:
        raise no_units_error(model, level, unsplit)
    check_no_chained(groups)
    sd = model.state_dict(keep_vars=True)
    in_units = {m.name for g in groups for m in g.members} | {n for g in groups for n in g.params + g.buffers}
    aliases = find_aliases(model, groups)
    in_units -= set(aliases)  # a block's own tied pair: the canonical name carries it
    groups = [dataclasses.replace(g, params=[n for n in g.params if n not in aliases],
                                  buffers=[n for n in g.buffers if n not in aliases]) for g in groups]
    flops = None
    if sample_input is not None:
        unit_flops, shared_flops, source = trace_unit_flops(model, groups, sample_input)
        flops = {"unit": unit_flops.tolist(), "shared": shared_flops, "source": source}
    return ModelUnits(level, groups, [n for n in sd if n not in in_units and n not in aliases],
                      {n: tuple(t.shape) for n, t in sd.items()},
                      {n: str(t.dtype).replace("torch.", "") for n, t in sd.items()},
                      [n for n, _ in model.named_parameters()], aliases, flops, model_fingerprint(model), unsplit)

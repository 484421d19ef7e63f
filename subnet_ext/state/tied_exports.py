"""Tied weights in exports: the plan's aliases (planning/discovery/aliases.py) written back.

A state dict the engine exports holds each alias under its own name as the very tensor of
its canonical name (saved once by torch.save, loads strict into a fresh tied model); one
it loads may hold the alias too, which must then equal the canonical value.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def with_aliases(plan, state_dict: dict) -> dict:
    """state_dict in the model's own order, each alias the same tensor as its canonical name."""
    if not plan.aliases:
        return state_dict
    out = {}
    for name, _, _ in plan.entries:
        source = plan.aliases.get(name, name)
        if source in state_dict:
            out[name] = state_dict[source]
    out.update((k, v) for k, v in state_dict.items() if k not in out)  # unknown keys: left for the loader to name
    return out


def without_aliases(plan, state_dict: dict) -> dict:
    """state_dict with alias entries dropped.

    Raises:
        ValueError: an alias whose value differs from its canonical entry's (a checkpoint of
            an untied model loaded into a tied one would silently lose one of the two).
    """
    if not plan.aliases:
        return state_dict
    for alias, canonical in plan.aliases.items():
        if alias in state_dict and canonical in state_dict and torch.is_tensor(state_dict[alias]) and \
                not torch.equal(state_dict[alias].detach().cpu(), state_dict[canonical].detach().cpu()):
            raise ValueError(f"{alias!r} is tied to {canonical!r} in this model, but the state dict holds different "
                             "values for them (a checkpoint of an untied model?); drop one or untie the model")
    return {k: v for k, v in state_dict.items() if k not in plan.aliases}


def retie(plan, model: nn.Module) -> None:
    """Make each alias of `model` the same Parameter (or buffer) as its canonical entry again."""
    for alias, canonical in plan.aliases.items():
        path, _, leaf = alias.rpartition(".")
        module = model.get_submodule(path)
        c_path, _, c_leaf = canonical.rpartition(".")
        c_module = model.get_submodule(c_path)
        if c_leaf in c_module._parameters:
            module._parameters[leaf] = c_module._parameters[c_leaf]
        else:
            module._buffers[leaf] = c_module._buffers[c_leaf]

"""Modules the planner left whole, and why: for the plan's summary and its errors.

A module that is no unit is held whole by every rank, so a plan that misses one holds more
than the coverage on every rank; the summary names each such module with the reason:

- block level: the candidate blocks (children of a ModuleList or Sequential) that neither
  torch.fx nor a traced call could read (blocks.py), e.g. without a sample input;
- neuron level: every layer holding parameters of a kind the planner splits (Linear and
  convolution layers, transformers' Conv1D, attention modules) outside every neuron group:
  an attention it does not recognise, an nn.MultiheadAttention it cannot split (units.py
  says why), and any other such layer (nothing pairs its outputs with the layer consuming
  them: an LM head, a stem, a classifier).

Layers of one kind left whole for one reason (a model's 12 blocks) are listed as one line.
"""
from __future__ import annotations

import re

import torch.nn as nn

_SPLIT_KINDS = (nn.Linear, nn.modules.conv._ConvNd)
UNRECOGNISED_ATTENTION = ("an attention layout the planner does not recognise (it splits q_proj/k_proj/v_proj/o_proj, "
                          "a fused c_attn or qkv projection with a head count, and nn.MultiheadAttention); declare "
                          "its heads with neuron_groups=[(producers, consumer)]")
NO_CONSUMER = "no neuron group pairs its outputs with the layer that consumes them"


def _is_attention(m: nn.Module) -> bool:
    name = type(m).__name__.lower()
    return isinstance(m, nn.MultiheadAttention) or "attention" in name or name.endswith("attn")


def neuron_level_unsplit(model: nn.Module, groups, noted: dict) -> dict[str, str]:
    """{module path: "Class: why"} of the splittable layers outside every group (module
    docstring); `noted`: {path: why} the group finder gave for modules it refused."""
    in_groups = {m.name for g in groups for m in g.members} | {n for g in groups for n in g.params}
    out, reported = {}, []
    for path, module in model.named_modules():
        if any(path.startswith(r + ".") for r in reported):
            continue
        own = [f"{path}.{n}" if path else n for n, _ in module.named_parameters()]
        if not own or any(n in in_groups for n in own):
            continue
        direct = any(True for _ in module.parameters(recurse=False))
        if path in noted or _is_attention(module):
            why = noted.get(path, UNRECOGNISED_ATTENTION)
        elif direct and (isinstance(module, _SPLIT_KINDS) or type(module).__name__ == "Conv1D"):
            why = NO_CONSUMER
        else:
            continue
        out[path] = f"{type(module).__name__}: {why}"
        reported.append(path)
    return out


def _shown(paths: list[str]) -> str:
    """The paths, or where indices repeat (a model's 12 blocks) the first with the count and the
    patterns (indices as *)."""
    patterns = list(dict.fromkeys(re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", p) for p in paths))
    if len(patterns) == len(paths):
        return ", ".join(repr(p) for p in paths)
    return f"{paths[0]!r} and {len(paths) - 1} more ({', '.join(patterns)})"


def grouped(unsplit: dict[str, str]) -> list[str]:
    """["paths: Class: why"], one line per distinct reason, in model order."""
    by_why: dict[str, list[str]] = {}
    for path, why in unsplit.items():
        by_why.setdefault(why, []).append(path)
    return [f"{_shown(paths)} ({why.split(': ', 1)[0]}): {why.split(': ', 1)[1]}" for why, paths in by_why.items()]


def unsplit_lines(unsplit: dict[str, str]) -> list[str]:
    """The summary's lines for the modules left whole ([] when none)."""
    if not unsplit:
        return []
    return ["not split (held whole by every rank):"] + [f"- {line}" for line in grouped(unsplit)]


def no_units_error(model: nn.Module, level: str, unsplit: dict[str, str]) -> ValueError:
    """The error of a model with no unit at `level`, naming what was left whole and why first."""
    hint = "blocks=[...]" if level == "block" else "neuron_groups=[(producer, consumer), ...]"
    if not unsplit:
        return ValueError(f"{type(model).__name__} has no {level}-level unit the planner recognises; "
                          f"declare them with {hint}")
    kind = "candidate block" if level == "block" else "layer"
    shown = "; ".join(grouped(unsplit))
    return ValueError(f"{type(model).__name__} has no {level}-level unit the planner could read. {kind} {shown}. "
                      f"(Or declare the units with {hint}.)")

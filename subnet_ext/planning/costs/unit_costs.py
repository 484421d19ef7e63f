"""The plan's cost tables: bytes, parameters and FLOPs of each unit and of the shared part.

A pure function of the model's structure (groups, state-dict shapes and dtypes, which names
are parameters) and, when traced, its FLOPs: the plan computes them once it is built, and the
assignment computes them before, to balance the units it hands out (plan.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..discovery.units import UnitGroup, slice_numel
from ...vocabulary import dtype_size

FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")  # the dtype names plans record for floats

_NO_TRACE = "2 x parameters per sample position (no sample_input given, so a convolution's spatial size and " \
            "attention's length are not counted)"


@dataclass(frozen=True)
class PlanCosts:
    """Per unit (float64 tensors [units]): unit_bytes (parameter bytes), unit_buffer_bytes (floating
    buffers), unit_params (parameter count), unit_flops. Shared part: shared_params (names),
    shared_bytes, shared_buffer_bytes, shared_param_count, shared_flops; flops_source says how
    the FLOPs were counted."""
    unit_bytes: torch.Tensor
    unit_buffer_bytes: torch.Tensor
    unit_params: torch.Tensor
    unit_flops: torch.Tensor
    shared_params: list
    shared_bytes: float
    shared_buffer_bytes: float
    shared_param_count: int
    shared_flops: float
    flops_source: str


def plan_costs(groups: list[UnitGroup], unit_ranges: list, tensor_shapes: dict, tensor_dtypes: dict, shared: list,
               param_names, flops: dict | None = None) -> PlanCosts:
    """The cost tables of the units (groups[g]'s units are unit_ranges[g] = (first, end)): bytes
    from the shapes and dtypes; FLOPs from `flops` ({"unit": [units], "shared", "source"}) or
    2 x the parameters. Buffers count only when floating point (integers are not averaged)."""
    n_units = unit_ranges[-1][1] if unit_ranges else 0
    param_names = set(param_names)

    def nbytes(name, numel=None):
        return (math.prod(tensor_shapes[name]) if numel is None else numel) * dtype_size(tensor_dtypes[name])

    def is_float(name):
        return tensor_dtypes[name] in FLOAT_DTYPES

    ub, ubuf, uparams = np.zeros(n_units), np.zeros(n_units), np.zeros(n_units)
    for g, (a, b) in zip(groups, unit_ranges):
        if g.kind == "block":
            ub[a] = sum(nbytes(p) for p in g.params)
            ubuf[a] = sum(nbytes(p) for p in g.buffers if is_float(p))
            uparams[a] = sum(math.prod(tensor_shapes[p]) for p in g.params)
            continue
        for m in g.members:
            numel = slice_numel(tensor_shapes[m.name], m)
            if not m.buffer:
                ub[a:b] += nbytes(m.name, numel)
                uparams[a:b] += numel
            elif is_float(m.name):
                ubuf[a:b] += nbytes(m.name, numel)
    shared_params = [n for n in shared if n in param_names]
    if flops is None:
        unit_flops = torch.from_numpy(2.0 * uparams)
        shared_flops, source = 2.0 * sum(math.prod(tensor_shapes[n]) for n in shared_params), _NO_TRACE
    else:
        unit_flops = torch.tensor([float(f) for f in flops["unit"]], dtype=torch.float64)
        shared_flops, source = float(flops["shared"]), str(flops["source"])
    return PlanCosts(
        unit_bytes=torch.from_numpy(ub), unit_buffer_bytes=torch.from_numpy(ubuf), unit_params=torch.from_numpy(uparams),
        unit_flops=unit_flops, shared_params=shared_params, shared_bytes=float(sum(nbytes(n) for n in shared_params)),
        shared_buffer_bytes=float(sum(nbytes(n) for n in shared if n not in param_names and is_float(n))),
        shared_param_count=sum(math.prod(tensor_shapes[n]) for n in shared_params), shared_flops=shared_flops,
        flops_source=source)

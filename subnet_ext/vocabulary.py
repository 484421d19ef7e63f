"""The package's closed sets of names and its dtype sizes, each defined here and only here.

Every other module, the command line's choices and the integrations' options read them from
this module, so adding a level, a regime or a quantity is one edit (and the architecture
test checks that no other module spells them out as a literal tuple).

- LEVELS: what a unit is ("block": a residual block; "neuron": neurons, heads, channels).
- KINDS: the kinds of unit group a plan holds (a block level plan has "block" groups; a neuron
  level plan "neuron", "head" and "channel" groups).
- REGIMES: what a rank runs ("forward": its subnetwork only; "backward": the full model
  forward, gradients of its own units only).
- ASSIGNMENTS: how ownership moves in time (planning/assignment/schedule.py); BLOCK_ASSIGNMENTS: how
  blocks are dealt to ranks (planning/assignment/assign.py).
- Quantity: what a collective carries, as the communication counter files it.
- dtype_of / dtype_size: a dtype from its name ("float32", "torch.bfloat16") and its size in
  bytes, one function where six modules used to build a tensor to ask.
"""
from __future__ import annotations

import enum

import torch

LEVELS = ("block", "neuron")
KINDS = ("block", "neuron", "head", "channel")
REGIMES = ("forward", "backward")
ASSIGNMENTS = ("static", "redraw", "rolling")
BLOCK_ASSIGNMENTS = ("balanced", "contiguous")


class Quantity(str, enum.Enum):
    """What a collective carries, as the counter files it (its value is the key of
    CommCounter.by_quantity and comm_stats()["by_quantity"])."""

    GRADIENTS = "gradients"  # averaged in every synchronising backward (a period of 1)
    PARAMETERS = "parameters"  # averaged after optimizer steps (a period > 1)
    REFRESH = "refresh"  # the backward regime's broadcasts of the leaders' values
    REASSIGN = "reassign"  # what changes hands at a change of assignment (engine/reassignment.py)

    def __str__(self) -> str:
        return self.value


def dtype_of(dtype: torch.dtype | str) -> torch.dtype:
    """The torch.dtype named by `dtype` ("float32", "torch.float32" or a torch.dtype itself).

    Raises ValueError naming the string when torch has no such dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"{dtype!r} is not a torch dtype (for example 'float32' or 'bfloat16')")
    return found


def dtype_size(dtype: torch.dtype | str) -> int:
    """Bytes per element of `dtype` (a torch.dtype or its name, as dtype_of takes)."""
    return dtype_of(dtype).itemsize

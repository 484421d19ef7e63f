"""The planner's arguments, and coverage in whole owners: what a plan gives each unit when C x K is not whole.

Each unit gets r = max(1, round(C*K)) owners (halves rounded up), so the effective coverage
is r / K. When that differs from the coverage asked for, the planner says so once.

A coverage may also be one value per rank (ranks with unequal memory, as HeteroFL's clients):
rank k then owns about c_k of each group's units (assign.py), and a unit's owner count varies.
"""
from __future__ import annotations

import math
import warnings

from .rank_graph import on_first_rank
from ...vocabulary import LEVELS


def owners_per_unit(world_size: int, coverage: float) -> int:
    """r = max(1, round(C*K)), rounding halves up (not Python's banker's rounding)."""
    return max(1, min(world_size, int(math.floor(coverage * world_size + 0.5))))


def check_arguments(world_size, coverage, level, seed: int = 0) -> None:
    """TypeError for a world size, coverage or seed of the wrong type, ValueError for one out of range."""
    if not isinstance(world_size, int) or isinstance(world_size, bool):
        raise TypeError(f"world_size must be an int (the number of ranks), got {type(world_size).__name__} "
                        f"{world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(coverage, (list, tuple)):
        check_per_rank(world_size, coverage)
    else:
        if not isinstance(coverage, (int, float)) or isinstance(coverage, bool):
            raise TypeError(f"coverage must be a number in (0, 1] (the fraction of ranks owning each unit), or a list "
                            f"of one per rank, got {type(coverage).__name__} {coverage!r}")
        if not (0.0 < coverage <= 1.0):
            raise ValueError(f"coverage must be in (0, 1], got {coverage!r}")
    if level not in LEVELS:
        raise ValueError(f"level must be 'block' or 'neuron', got {level!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")


def check_per_rank(world_size: int, coverage) -> None:
    """A coverage per rank: K numbers in (0, 1] whose sum is at least 1 (every unit needs an owner)."""
    if len(coverage) != world_size:
        raise ValueError(f"a coverage per rank needs {world_size} values (one per rank), got {len(coverage)}: "
                         f"{list(coverage)}")
    for r, c in enumerate(coverage):
        if not isinstance(c, (int, float)) or isinstance(c, bool) or not 0.0 < c <= 1.0:
            raise ValueError(f"coverage of rank {r} must be a number in (0, 1], got {c!r}")
    if sum(coverage) < 1.0 - 1e-9:
        raise ValueError(f"the coverages per rank {list(coverage)} sum to {sum(coverage):g} < 1: some units would have "
                         "no owner; raise them so that together the ranks hold the whole model at least once")


def is_per_rank(coverage) -> bool:
    """True for a coverage given as one value per rank."""
    return isinstance(coverage, (list, tuple))


def describe(coverage) -> str:
    """'0.5', or '[1, 0.5, 0.5, 0.25] (per rank)'."""
    return f"[{', '.join(f'{c:g}' for c in coverage)}] (per rank)" if is_per_rank(coverage) else f"{coverage:g}"


def warn_if_rounded(coverage: float, world_size: int, owners: int) -> None:
    """Say (once across ranks) when whole owners make the effective coverage owners / K differ
    from the coverage asked for, e.g. 0.1 at K=4 raised to one owner per unit (0.25)."""
    effective = owners / world_size
    if abs(effective - coverage) <= 1e-9 or not on_first_rank():
        return
    why = (f"below 1/(2K) = {0.5 / world_size:g}, raised to one owner per unit" if coverage * world_size < 0.5
           else f"round({coverage:g} x {world_size}) = {owners} owner(s) per unit")
    # stacklevel: warn_if_rounded < plan._plan < plan_subnetworks (or plan_from_units) < its caller
    warnings.warn(f"SubnetPlan: coverage {coverage:g} at world size {world_size} is {why}: each unit gets "
                  f"{owners} owner(s), an effective coverage of {owners}/{world_size} = {effective:g}. Ask for a "
                  f"multiple of 1/{world_size} to get exactly what you ask for.", stacklevel=4)

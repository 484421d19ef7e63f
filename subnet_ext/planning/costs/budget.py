"""Fit a memory budget: the configuration with the most owners per unit whose predicted
per-rank peak (planning/costs/memory_model.py) fits. The order is one of memory, not a promise of
quality: on nanoGPT's Tiny Shakespeare no SDP setting measured so far matched DDP at equal
tokens (docs/study-schedules.md), and a smaller dense model of the same memory per rank may
train better than any subnetwork; which quality a configuration gives is the user's to measure.

    fit = sx.plan_for_memory(model, world_size=4, budget="8GiB", sample_input=x, optimizer="adamw")
    if fit.activation_checkpointing:
        ...  # checkpoint the blocks (subnet_ext.jobs.training.apply_activation_checkpointing) first
    sdp = sx.SubnetDataParallel(model, fit.plan, **fit.sdp_kwargs)

Every owner count from K down to 1 is tried (`owner_counts`): each coverage of PREFERENCE stands
for the counts from its own down to the next lower one's, with its (level, regime) entries in
PREFERENCE order (at K = 8: C = 1's entry at 8, 7, 6 and 5 owners, the C = 0.5 entries at 4, 3
and 2, C = 1/K's at 1); within one, the variants that change only where tensors live (not the
updates) go from cheapest in time to cheapest in memory: as is, shared parameters sharded by
FSDP2, activation checkpointing, both. The model is read and traced once per level, so the
1B preset at K = 8 takes about as long as a few plain plans (bench/results/plan-for-memory-cpu.md).
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field

import torch.nn as nn

from .activation_trace import trace_activations
from .memory_model import worst_rank_memory
from ..assignment.coverage import owners_per_unit
from ..plan import SubnetPlan, model_units, plan_from_units
from .sizes import format_size, parse_size

# (level, regime, coverage) from most to least preferred, i.e. from most to fewest owners per unit:
# C = 1 first (DDP's updates, every unit trained on every rank's data), one owner per unit (C = 1/K)
# last, so a budget gets the least partitioning that fits it. At C = 0.5 the neuron level's forward
# regime comes before the block level's: on Tiny Shakespeare its static full model is the better of
# the two (docs/study-schedules.md; the block level's full model stacks blocks no rank trained
# together); the backward regime, which holds the full model's activations, after them.
# tests/planning/test_memory_budget.py checks the order against docs/study-schedules/summary.json.
PREFERENCE = (("block", "forward", 1.0), ("neuron", "forward", 0.5), ("block", "forward", 0.5),
              ("block", "backward", 0.5), ("block", "forward", "1/K"))
# Printed beside a choice that partitions the model: the planner orders by memory, not by loss.
QUALITY_NOTE = ("note: this is the configuration with the most owners per unit that fits, not a promise of "
                "quality; on Tiny Shakespeare no SDP setting measured so far matched DDP at equal tokens "
                "(docs/study-schedules.md): compare it with a smaller dense model of the same memory per rank")
# A candidate fits when its predicted peak plus this fraction of it is within the budget: the
# memory model is checked within 10% of measured peaks (tests/planning/test_memory_model.py).
MARGIN = 0.10
# (shard_shared, activation_checkpointing): the same updates as the run without them (the
# study's fsdp and *-ac runs train DDP's and SDP's model), less memory, more time.
VARIANTS = ((False, False), (True, False), (False, True), (True, True))


class NoConfigurationFits(ValueError):
    """No candidate's predicted per-rank peak fits the budget (the message names both).
    Attributes: budget (bytes), candidates (every Candidate tried), table (their markdown table)."""

    def __init__(self, message: str, budget: int, candidates: list, table: str):
        super().__init__(message)
        self.budget, self.candidates, self.table = budget, candidates, table


@dataclass
class Candidate:
    """One configuration and its predicted worst-rank step memory (bytes, memory_model's dict)."""

    level: str
    regime: str
    coverage: float
    shard_shared: bool
    activation_checkpointing: bool
    predicted: dict
    plan: SubnetPlan = field(repr=False)

    @property
    def name(self) -> str:
        """"block/forward C=0.5 +shard +ac"-style label."""
        extra = (" +shard-shared" if self.shard_shared else "") + (" +checkpointing" if self.activation_checkpointing
                                                                    else "")
        return f"{self.level}/{self.regime} C={self.coverage:g}{extra}"


@dataclass
class MemoryFit:
    """plan_for_memory's answer.

    Attributes:
        plan: the chosen SubnetPlan. sdp_kwargs: {"regime", "shard_shared"} for SubnetDataParallel.
        activation_checkpointing: whether the blocks must be checkpointed (before wrapping).
        predicted: the chosen candidate's predicted worst-rank step memory (bytes).
        budget: bytes per rank. candidates: every candidate tried, in preference order.
        choice: the chosen Candidate (its `name` says the configuration).
    """

    plan: SubnetPlan
    sdp_kwargs: dict
    activation_checkpointing: bool
    predicted: dict
    budget: int
    candidates: list
    choice: Candidate = field(repr=False, default=None)

    def table(self) -> str:
        """Markdown table of the candidates: predicted peak and its parts per rank, fits or not."""
        return candidates_table(self.candidates, self.budget, chosen=self.predicted)


def candidates_table(candidates: list, budget: int, chosen: dict | None = None, margin: float = MARGIN) -> str:
    """Markdown table: one row per candidate, with the predicted worst rank's model state,
    activations, transient and peak (MiB) and whether it fits `budget` (bytes) with `margin`."""
    mib = 2 ** 20
    lines = ["| configuration | model state MiB | activations MiB | transient MiB | peak MiB/rank | "
             f"fits {format_size(budget)} |",
             "|---|---:|---:|---:|---:|---|"]
    for c in candidates:
        p = c.predicted
        mark = "chosen" if p is chosen else ("yes" if _fits(p, budget, margin) else "no")
        lines.append(f"| {c.name} | {p['model_state'] / mib:.2f} | {p['activations'] / mib:.2f} | "
                     f"{p['transient'] / mib:.2f} | {p['total'] / mib:.2f} | {mark} |")
    return "\n".join(lines)


def _fits(predicted: dict, budget: int, margin: float) -> bool:
    return predicted["total"] * (1 + margin) <= budget


def _coverage(value, world_size: int) -> float:
    return 1.0 / world_size if value == "1/K" else float(value)


def owner_counts(world_size: int) -> list[tuple[int, list[tuple[str, str]]]]:
    """[(owners per unit, [(level, regime), ...])] in the order plan_for_memory tries them: every
    owner count from K down to 1. Each coverage of PREFERENCE (in its order) stands for the
    owner counts from its own down to the next lower one's, excluded, tried with its
    (level, regime) entries in PREFERENCE order: at K = 8, block/forward at 8, 7, 6 and 5 owners;
    neuron/forward, block/forward and block/backward at 4, 3 and 2; block/forward at 1."""
    tiers = {}  # owner count -> [(level, regime)], in PREFERENCE order
    for level, regime, cov in PREFERENCE:
        coverage = _coverage(cov, world_size)
        if world_size == 1 and coverage < 1.0:
            continue  # one rank holds everything
        entries = tiers.setdefault(owners_per_unit(world_size, coverage), [])
        if (level, regime) not in entries:
            entries.append((level, regime))
    out = []
    for n, entries in tiers.items():
        lower = max((m for m in tiers if m < n), default=0)
        out += [(count, entries) for count in range(n, lower, -1)]
    return out


def _candidates(model, world_size, sample_input, optimizer, seed, progress):
    """Every (configuration, prediction) in the order owner_counts gives, each with every VARIANT.
    The model is read once per level (model_units) and traced once per level: a plan at another
    owner count differs only in its owners."""
    out, units, traces, plans = [], {}, {}, {}
    order = owner_counts(world_size)
    for step, (count, entries) in enumerate(order, 1):
        coverage = count / world_size
        for level, regime in entries:
            if level not in units:
                units[level] = model_units(model, level, sample_input=sample_input)
            if (level, count) not in plans:
                with warnings.catch_warnings():
                    # One owner per unit (or ranks tied by the shared parameters alone) makes the planner
                    # warn; here it is one candidate among many, and the table says what it costs.
                    warnings.simplefilter("ignore", UserWarning)
                    plans[level, count] = plan_from_units(units[level], world_size, coverage, seed)
            plan = plans[level, count]
            if level not in traces:  # what a unit saves depends on its level, not on its owners
                traces[level] = trace_activations(model, plan, sample_input) if sample_input is not None else None
            trace = traces[level]
            for shard, ac in VARIANTS:
                if (shard and world_size == 1) or (ac and (trace is None or not trace.block_inputs)):
                    continue  # nothing to shard over / no residual block to checkpoint
                predicted = worst_rank_memory(plan, trace, regime=regime, optimizer=optimizer, shard_shared=shard,
                                              activation_checkpointing=ac)
                out.append(Candidate(level, regime, coverage, shard, ac, predicted, plan))
        if progress:
            print(f"plan_for_memory: {step}/{len(order)} owner counts tried ({count} of {world_size} owners per "
                  f"unit, C = {coverage:g}: {', '.join(f'{lv}/{rg}' for lv, rg in entries)})", file=sys.stderr,
                  flush=True)
    return out


def plan_for_memory(model: nn.Module, world_size: int, budget, sample_input=None, optimizer="adamw",
                    seed: int = 0, margin: float = MARGIN, verbose: bool = True) -> MemoryFit:
    """The most preferred configuration (owner_counts' order, then VARIANTS) whose predicted
    worst-rank peak of one training step fits `budget` per rank.

    Args:
        model: the full model (any device, meta included). world_size: K ranks.
        budget: bytes per rank, an int or a size such as "8GiB" or "1.5GB" (sizes.parse_size).
        sample_input: one rank's batch (a tensor, or (shape, dtype)): activations scale with it.
            None counts model state only (and says so).
        optimizer: as memory_model.optimizer_moments ("adamw", "sgd", "sgd_momentum", an optimizer).
        margin: a candidate fits when predicted peak x (1 + margin) <= budget (MARGIN: the model's
            tested accuracy).
        verbose: print a progress line per owner count (stderr), the candidates' table and the choice.
    Raises:
        NoConfigurationFits: nothing fits; the message names the budget and the smallest peak.
    """
    budget = parse_size(budget)
    candidates = _candidates(model, world_size, sample_input, optimizer, seed, verbose)
    chosen = next((c for c in candidates if _fits(c.predicted, budget, margin)), None)
    table = candidates_table(candidates, budget, chosen.predicted if chosen else None, margin)
    if verbose:
        print(table if sample_input is not None else table + "\n(no sample_input: activations not counted)")
    if chosen is None:
        smallest = min(candidates, key=lambda c: c.predicted["total"])
        raise NoConfigurationFits(
            f"plan_for_memory: nothing fits a budget of {format_size(budget)} per rank at world size {world_size}: "
            f"the smallest predicted peak is {format_size(smallest.predicted['total'])} ({smallest.name}; it needs "
            f"{format_size(smallest.predicted['total'] * (1 + margin))} with the {margin:.0%} margin); raise "
            "the budget, add ranks, or shrink the batch (sample_input)", budget, candidates, table)
    if verbose:
        print(f"chosen: {chosen.name}, predicted peak {format_size(chosen.predicted['total'])} per rank "
              f"(budget {format_size(budget)})")
        if chosen.plan.owners.sum(0).min() < world_size:
            print(QUALITY_NOTE)
    return MemoryFit(chosen.plan, {"regime": chosen.regime, "shard_shared": chosen.shard_shared},
                     chosen.activation_checkpointing, chosen.predicted, budget, candidates, chosen)

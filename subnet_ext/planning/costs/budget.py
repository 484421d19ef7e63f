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
from .memory_model import rank_memories, worst_of
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
    coverage: float | tuple  # one value, or one per rank (a budget per rank)
    shard_shared: bool
    activation_checkpointing: bool
    predicted: dict
    plan: SubnetPlan = field(repr=False)
    rank_totals: tuple = ()  # predicted peak bytes of every rank, rank order

    @property
    def name(self) -> str:
        """"block/forward C=0.5 +shard +ac"-style label (C=[1,0.5,...] with a coverage per rank)."""
        extra = (" +shard-shared" if self.shard_shared else "") + (" +checkpointing" if self.activation_checkpointing
                                                                    else "")
        cov = f"[{','.join(f'{c:g}' for c in self.coverage)}]" if isinstance(self.coverage, tuple) else \
            f"{self.coverage:g}"
        return f"{self.level}/{self.regime} C={cov}{extra}"

    @property
    def mean_coverage(self) -> float:
        """The fraction of the model a rank trains, averaged over the ranks: what plan_for_memory maximises."""
        return sum(self.coverage) / len(self.coverage) if isinstance(self.coverage, tuple) else self.coverage


@dataclass
class MemoryFit:
    """plan_for_memory's answer.

    Attributes:
        plan: the chosen SubnetPlan. sdp_kwargs: {"regime", "shard_shared"} for SubnetDataParallel.
        activation_checkpointing: whether the blocks must be checkpointed (before wrapping).
        predicted: the chosen candidate's predicted worst-rank step memory (bytes).
        budget: bytes per rank (an int), or one per rank (a list). candidates: every candidate
            tried, in preference order.
        choice: the chosen Candidate (its `name` says the configuration).
    """

    plan: SubnetPlan
    sdp_kwargs: dict
    activation_checkpointing: bool
    predicted: dict
    budget: int | list
    candidates: list
    choice: Candidate = field(repr=False, default=None)

    def table(self) -> str:
        """Markdown table of the candidates: predicted peak and its parts per rank, fits or not."""
        return candidates_table(self.candidates, self.budget, chosen=self.predicted)


def candidates_table(candidates: list, budget, chosen: dict | None = None, margin: float = MARGIN) -> str:
    """Markdown table: one row per candidate, with the predicted worst rank's model state,
    activations, transient and peak (MiB) and whether it fits `budget` (bytes, or one per rank:
    every rank its own) with `margin`."""
    mib = 2 ** 20
    budgets = budget if isinstance(budget, list) else None
    head = "fits each rank's budget" if budgets else f"fits {format_size(budget)}"
    lines = ["| configuration | model state MiB | activations MiB | transient MiB | peak MiB/rank (worst) | "
             f"{head} |",
             "|---|---:|---:|---:|---:|---|"]
    for c in candidates:
        p = c.predicted
        fits = _fits(c, budgets or [budget] * max(1, len(c.rank_totals)), margin)
        mark = "chosen" if p is chosen else ("yes" if fits else "no")
        lines.append(f"| {c.name} | {p['model_state'] / mib:.2f} | {p['activations'] / mib:.2f} | "
                     f"{p['transient'] / mib:.2f} | {p['total'] / mib:.2f} | {mark} |")
    return "\n".join(lines)


def _fits(candidate: Candidate, budgets: list[int], margin: float) -> bool:
    """Every rank's predicted peak, with the margin, within its own budget."""
    totals = candidate.rank_totals or (candidate.predicted["total"],)
    return all(t * (1 + margin) <= b for t, b in zip(totals, budgets))


def _budgets(budget, world_size: int) -> list[int]:
    """One budget in bytes per rank from one size for all or a list of one per rank."""
    if isinstance(budget, (list, tuple)):
        if len(budget) != world_size:
            raise ValueError(f"plan_for_memory: {len(budget)} budgets for world size {world_size}: give one size "
                             "for every rank, or one per rank")
        return [parse_size(b) for b in budget]
    return [parse_size(budget)] * world_size


def _predict(plan, trace, **config) -> tuple[dict, tuple]:
    """(the worst rank's predicted step memory with "rank" added, as memory_model.worst_rank_memory,
    and every rank's predicted total: what a budget per rank is checked against)."""
    per_rank = rank_memories(plan, trace, **config)
    return worst_of(per_rank), tuple(p["total"] for p in per_rank)


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


def _candidates(model, world_size, sample_input, optimizer, seed, progress, units: dict, traces: dict):
    """Every (configuration, prediction) in the order owner_counts gives, each with every VARIANT.
    The model is read once per level (model_units) and traced once per level: a plan at another
    owner count differs only in its owners. `units` and `traces` ({level: ...}) keep what was read
    for the caller (the per-rank candidates plan from the same)."""
    out, plans = [], {}
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
                predicted, totals = _predict(plan, trace, regime=regime, optimizer=optimizer, shard_shared=shard,
                                             activation_checkpointing=ac)
                out.append(Candidate(level, regime, coverage, shard, ac, predicted, plan, totals))
        if progress:
            print(f"plan_for_memory: {step}/{len(order)} owner counts tried ({count} of {world_size} owners per "
                  f"unit, C = {coverage:g}: {', '.join(f'{lv}/{rg}' for lv, rg in entries)})", file=sys.stderr,
                  flush=True)
    return out


def _per_rank_candidates(uniform: list, budgets: list[int], margin: float, optimizer, seed, units: dict,
                         traces: dict) -> list:
    """Budgets that differ between ranks: for each configuration (level, regime, variant), rank r
    gets the largest coverage whose uniform plan fits r's own budget (its prediction for r), and
    the plan with those coverages is predicted again (units are dealt anew, so a rank's share of the
    shared buckets may move): a candidate where it has ranks of more than one coverage."""
    by_config = {}
    for c in uniform:
        by_config.setdefault((c.level, c.regime, c.shard_shared, c.activation_checkpointing), []).append(c)
    out = []
    for (level, regime, shard, ac), group in by_config.items():
        coverages = []
        for r, b in enumerate(budgets):
            fitting = [c.coverage for c in group if c.rank_totals[r] * (1 + margin) <= b]
            coverages.append(max(fitting) if fitting else None)
        if None in coverages or len(set(coverages)) == 1:
            continue  # a rank fits no coverage, or every rank the same one (a uniform candidate)
        with warnings.catch_warnings():  # units, traces: what _candidates read for this level's uniform ones
            warnings.simplefilter("ignore", UserWarning)  # as _candidates: the table says what it costs
            plan = plan_from_units(units[level], len(budgets), list(coverages), seed)
        predicted, totals = _predict(plan, traces[level], regime=regime, optimizer=optimizer, shard_shared=shard,
                                     activation_checkpointing=ac)
        out.append(Candidate(level, regime, tuple(coverages), shard, ac, predicted, plan, totals))
    return out


def plan_for_memory(model: nn.Module, world_size: int, budget, sample_input=None, optimizer="adamw",
                    seed: int = 0, margin: float = MARGIN, verbose: bool = True) -> MemoryFit:
    """The most preferred configuration (owner_counts' order, then VARIANTS) whose predicted
    worst-rank peak of one training step fits `budget` per rank.

    Args:
        model: the full model (any device, meta included). world_size: K ranks.
        budget: bytes per rank, an int or a size such as "8GiB" or "1.5GB" (sizes.parse_size), or a
            list of one per rank (ranks with unequal memory): each rank's predicted peak must fit its
            own, and configurations with a coverage per rank (the largest whose uniform plan fits
            that rank) are tried beside the uniform ones, the most of the model per rank first.
        sample_input: one rank's batch (a tensor, or (shape, dtype)): activations scale with it.
            None counts model state only (and says so).
        optimizer: as memory_model.optimizer_moments ("adamw", "sgd", "sgd_momentum", an optimizer).
        margin: a candidate fits when predicted peak x (1 + margin) <= budget (MARGIN: the model's
            tested accuracy).
        verbose: print a progress line per owner count (stderr), the candidates' table and the choice.
    Raises:
        NoConfigurationFits: nothing fits; the message names the budget and the smallest peak.
    """
    budgets = _budgets(budget, world_size)
    per_rank = len(set(budgets)) > 1
    shown = budgets if per_rank else budgets[0]  # what the table, the messages and MemoryFit.budget show
    units, traces = {}, {}  # {level: what was read of the model / its activation trace}, read once
    candidates = _candidates(model, world_size, sample_input, optimizer, seed, verbose, units, traces)
    if per_rank:
        # Most of the model trained per rank first; a uniform candidate before a per-rank one of the same mean.
        candidates = sorted(candidates + _per_rank_candidates(candidates, budgets, margin, optimizer, seed, units,
                                                              traces),
                            key=lambda c: -c.mean_coverage)
    chosen = next((c for c in candidates if _fits(c, budgets, margin)), None)
    table = candidates_table(candidates, shown, chosen.predicted if chosen else None, margin)
    if verbose:
        print(table if sample_input is not None else table + "\n(no sample_input: activations not counted)")
    described = ", ".join(format_size(b) for b in budgets) + " (rank order)" if per_rank else \
        f"{format_size(budgets[0])} per rank"
    if chosen is None:
        smallest = min(candidates, key=lambda c: c.predicted["total"])
        raise NoConfigurationFits(
            f"plan_for_memory: nothing fits a budget of {described} at world size {world_size}: "
            f"the smallest predicted peak is {format_size(smallest.predicted['total'])} ({smallest.name}; it needs "
            f"{format_size(smallest.predicted['total'] * (1 + margin))} with the {margin:.0%} margin); raise "
            "the budget, add ranks, or shrink the batch (sample_input)", shown, candidates, table)
    if verbose:
        print(f"chosen: {chosen.name}, predicted peak {format_size(chosen.predicted['total'])} on its worst rank "
              f"(budget {described})")
        if chosen.plan.owners.sum(0).min() < world_size:
            print(QUALITY_NOTE)
    return MemoryFit(chosen.plan, {"regime": chosen.regime, "shard_shared": chosen.shard_shared},
                     chosen.activation_checkpointing, chosen.predicted, shown, candidates, chosen)

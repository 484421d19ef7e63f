"""Fit a memory budget: the configuration the study found best in loss among those whose
predicted per-rank peak (planning/memory_model.py) fits.

    fit = sx.plan_for_memory(model, world_size=4, budget="8GiB", sample_input=x, optimizer="adamw")
    if fit.activation_checkpointing:
        ...  # checkpoint the blocks (subnet_ext.cli.training.apply_activation_checkpointing) first
    sdp = sx.SubnetDataParallel(model, fit.plan, **fit.sdp_kwargs)

The candidates are tried in PREFERENCE order; within one, the variants that change only where
tensors live (not the updates) go from cheapest in time to cheapest in memory: as is, shared
parameters sharded by FSDP2, activation checkpointing, both.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch.nn as nn

from .activation_trace import trace_activations
from .memory_model import worst_rank_memory
from .plan import SubnetPlan, plan_subnetworks
from .sizes import format_size, parse_size

# (level, regime, coverage) from most to least preferred. Where the order comes from: the CPU
# study (docs/study-cpu.md, docs/study-cpu/summary.json; K = 4, text task). C = 1 first: it
# computes DDP's updates (every unit trained on every rank's data), the study's baseline and its
# best at equal tokens (2.767 nats/char against 2.770 for the best SDP run). Then the C = 0.5
# variants by their loss at equal FLOPs, the protocol of the study's recommendation
# (`recommended`: neuron level, forward regime, 2.596; block level forward 2.652; block level
# backward 2.730); then one owner per unit (C = 1/K; block level forward at C = 0.25: 2.988).
# tests/planning/test_memory_budget.py checks this order against summary.json.
PREFERENCE = (("block", "forward", 1.0), ("neuron", "forward", 0.5), ("block", "forward", 0.5),
              ("block", "backward", 0.5), ("block", "forward", "1/K"))
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


def _candidates(model, world_size, sample_input, optimizer, seed):
    """Every (configuration, prediction) in preference order; each plan traced once."""
    out, plans = [], {}
    for level, regime, cov in PREFERENCE:
        coverage = _coverage(cov, world_size)
        if world_size == 1 and coverage < 1.0:
            continue  # one rank holds everything
        key = (level, coverage)
        if key not in plans:
            with warnings.catch_warnings():
                # C = 1/K gives every unit one owner, which the planner rightly warns about; here
                # it is one candidate among many, and the table says what it costs.
                warnings.simplefilter("ignore", UserWarning)
                plan = plan_subnetworks(model, world_size, coverage, level, seed, sample_input=sample_input)
            plans[key] = (plan, trace_activations(model, plan, sample_input) if sample_input is not None else None)
        plan, trace = plans[key]
        for shard, ac in VARIANTS:
            if (shard and world_size == 1) or (ac and (trace is None or not trace.block_inputs)):
                continue  # nothing to shard over / no residual block to checkpoint
            predicted = worst_rank_memory(plan, trace, regime=regime, optimizer=optimizer, shard_shared=shard,
                                          activation_checkpointing=ac)
            out.append(Candidate(level, regime, coverage, shard, ac, predicted, plan))
    return out


def plan_for_memory(model: nn.Module, world_size: int, budget, sample_input=None, optimizer="adamw",
                    seed: int = 0, margin: float = MARGIN, verbose: bool = True) -> MemoryFit:
    """The most preferred configuration (PREFERENCE, then VARIANTS) whose predicted worst-rank
    peak of one training step fits `budget` per rank.

    Args:
        model: the full model (any device, meta included). world_size: K ranks.
        budget: bytes per rank, an int or a size such as "8GiB" or "1.5GB" (sizes.parse_size).
        sample_input: one rank's batch (a tensor, or (shape, dtype)): activations scale with it.
            None counts model state only (and says so).
        optimizer: as memory_model.optimizer_moments ("adamw", "sgd", "sgd_momentum", an optimizer).
        margin: a candidate fits when predicted peak x (1 + margin) <= budget (MARGIN: the model's
            tested accuracy).
        verbose: print the candidates' table (and the choice).
    Raises:
        NoConfigurationFits: nothing fits; the message names the budget and the smallest peak.
    """
    budget = parse_size(budget)
    candidates = _candidates(model, world_size, sample_input, optimizer, seed)
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
    return MemoryFit(chosen.plan, {"regime": chosen.regime, "shard_shared": chosen.shard_shared},
                     chosen.activation_checkpointing, chosen.predicted, budget, candidates, chosen)

"""Every comparison the report makes, computed once from the results and labelled once.

A comparison is run a minus run b (each with the model read: the full model, or another a user
could keep), paired over seeds, at one protocol's mark. It belongs to exactly one family, the
first below that asks for it; wherever it is shown (report, README, summary.json) it carries
that family's interval and label (stats.py: simultaneous Bonferroni intervals, labels read off
the interval). A run that is another run by construction at a protocol (FSDP2, or activation
checkpointing at equal tokens: the same updates, read at the same step) is compared as that run.

Families, in order:
- "decision": at every memory budget per rank, the best SDP run that fits against the best
  run that fits without SDP (DDP, FSDP2, checkpointing, stochastic depth, the smaller dense
  models): what the README's recommendation rests on;
- "vs ddp": every other run against DDP;
- "vs smaller dense": every SDP run against the dense model of its per-rank size (block level:
  fewer blocks; neuron level: narrower blocks; at the same coverage);
- "which model to keep": the owner-fraction-scaled model, the ensemble of the K subnetworks
  and the best single subnetwork, each against the SDP run's full model, at equal tokens.
"""
from __future__ import annotations

import math

from .results import Results
from .runs import DENSE_CONTROLS
from .stats import Family

PROTOCOLS_DECIDED = ("tokens", "flops")
KEEP_MODES = (("full_scaled", "owner-fraction scaling"), ("ensemble", "the ensemble of the K subnetworks"),
              ("best_subnetwork", "the best single subnetwork"))
FAMILY_QUESTIONS = {
    "decision": "at each memory budget, is the best SDP run no worse than the best run without SDP?",
    "vs ddp": "how far is each run from DDP?",
    "vs smaller dense": "is SDP better than training the smaller dense model of its per-rank size?",
    "which model to keep": "which of an SDP run's models is best?"}


class Comparisons:
    """The registry: each comparison (a, b, protocol) in the first family that adds it."""

    def __init__(self, res: Results, task: str, k: int, margin: float):
        self.res, self.task, self.k = res, task, k
        self.families = {name: Family(name, margin, question) for name, question in FAMILY_QUESTIONS.items()}
        self.owner = {}  # key -> family name
        self.resolved = {}

    def canonical(self, name: str, protocol: str) -> str:
        """The run `name` is at `protocol`: its base run when it is that run by construction there."""
        base = self.res.config(self.task, self.k, name).get("derived_from")
        if base and self.res.steps_at(self.task, self.k, name, protocol) == \
                self.res.steps_at(self.task, self.k, base, protocol):
            return base
        return name

    def key(self, a: tuple, b: tuple, protocol: str) -> tuple | None:
        """(run a, model a, run b, model b, protocol), canonical; None when a is b by construction."""
        a = (self.canonical(a[0], protocol), a[1])
        b = (self.canonical(b[0], protocol), b[1])
        return None if a == b else (a[0], a[1], b[0], b[1], protocol)

    def add(self, family: str, a: tuple, b: tuple, protocol: str) -> tuple | None:
        """Ask for a minus b at `protocol` in `family` (kept in the family that asked first); returns its key."""
        key = self.key(a, b, protocol)
        if key is None or key in self.owner:
            return key
        diffs = self.res.diffs(self.task, self.k, key[:2], key[2:4], protocol)
        if not diffs:
            return None
        self.owner[key] = family
        self.families[family].add(key, diffs)
        return key

    def resolve(self) -> None:
        """Intervals and labels of every family."""
        for family in self.families.values():
            self.resolved.update(family.resolve())

    def get(self, a: tuple, b: tuple, protocol: str) -> dict | None:
        """The resolved comparison of a minus b at `protocol` (None: not made, or identical by construction)."""
        key = self.key(a, b, protocol)
        return None if key is None else self.resolved.get(key)

    def summaries(self) -> list[dict]:
        """Each family's name, question, size, confidence, seeds, median sd, detectable difference, margin."""
        return [f.summary for f in self.families.values() if f.summary["m"]]


def _run_entry(res: Results, task, k, name, protocols) -> dict:
    cfg, cost, ddp = res.config(task, k, name), res.cost(task, k, name), res.cost(task, k, "ddp")
    entry = {"config": {key: cfg.get(key) for key in ("method", "level", "regime", "coverage", "assignment", "preset",
                                                      "reassign_every", "block_assignment",
                                                      "activation_checkpointing", "stochastic_depth",
                                                      "batch_size_factor", "derived_from")},
             "memory": cost["peak"] / ddp["peak"], "peak_mib": cost["peak"] / 2 ** 20,
             "split": {key: cost[key] / ddp["peak"] for key in ("model_state", "activations", "transient")},
             "protocols": {}}
    for p in protocols:
        s = res.summary(task, k, name, p)
        if s["n"]:
            entry["protocols"][p] = {"loss": s["mean"], "std": s["std"], "n": s["n"],
                                     "tokens_x": res.relative(task, k, name, p, "tokens"),
                                     "steps_x": res.relative(task, k, name, p, "step")}
    return entry


def is_sdp(name: str) -> bool:
    """True for the SDP runs (their names start with "sdp-")."""
    return name.startswith("sdp-")


def budget_rows(a: dict) -> list[dict]:
    """The memory budgets worth a row (DDP's, and each run's peak on a loss-memory Pareto front at some
    protocol), largest first: {"budget", protocol: {"sdp": run, "other": run}} with the lowest-mean-loss
    SDP run and non-SDP run that fit each (None where none fits)."""
    names = ["ddp", *a["runs"]]
    entry = lambda n: a["ddp"] if n == "ddp" else a["runs"][n]  # noqa: E731
    memory = {n: entry(n)["memory"] for n in names}
    levels = {1.0}
    for p in PROTOCOLS_DECIDED:
        points = [(memory[n], entry(n)["protocols"][p]["loss"]) for n in names if p in entry(n)["protocols"]]
        levels |= {m for m, loss in points if not any(m2 <= m and l2 < loss for m2, l2 in points)}
    rows = []
    for budget in sorted(levels, reverse=True):
        row = {"budget": budget}
        for p in PROTOCOLS_DECIDED:
            fits = [n for n in names if memory[n] <= budget * (1 + 1e-9) and p in entry(n)["protocols"]]
            best = lambda group: min(group, key=lambda n: entry(n)["protocols"][p]["loss"]) if group else None  # noqa
            row[p] = {"sdp": best([n for n in fits if is_sdp(n)]), "other": best([n for n in fits if not is_sdp(n)])}
        if not rows or any(row[p] != rows[-1][p] for p in PROTOCOLS_DECIDED):
            rows.append(row)
    return rows


def dense_control_of(cfg: dict, names) -> str | None:
    """The smaller dense run of an SDP configuration's per-rank size (runs.DENSE_CONTROLS), if it ran."""
    for controls in DENSE_CONTROLS.values():
        for name, _, setting in controls:
            if setting == (cfg.get("level"), cfg.get("coverage")) and name in names:
                return name
    return None


def analyse(res: Results, task: str, k: int, margin: float) -> dict:
    """{"ddp", "runs", "protocols", "rows", "comparisons" (Comparisons), "families", "margin"} of one task and
    world size (see the module docstring)."""
    protocols = res.protocols(task, k)
    names = res.verdict_runs(task, k)
    out = {"margin": margin, "protocols": protocols, "ddp": _run_entry(res, task, k, "ddp", protocols),
           "runs": {n: _run_entry(res, task, k, n, protocols) for n in names}}
    comps = Comparisons(res, task, k, margin)
    out["rows"] = budget_rows(out)
    for row in out["rows"]:
        for p in PROTOCOLS_DECIDED:
            pick = row[p]
            if pick["sdp"] and pick["other"]:
                comps.add("decision", (pick["sdp"], "full"), (pick["other"], "full"), p)
    for name in names:
        for p in protocols:
            comps.add("vs ddp", (name, "full"), ("ddp", "full"), p)
    trained = [n for n in names if is_sdp(n) and not res.config(task, k, n).get("derived_from")]
    for name in trained:
        control = dense_control_of(res.config(task, k, name), names)
        for p in protocols if control else ():
            comps.add("vs smaller dense", (name, "full"), (control, "full"), p)
    for name in trained:
        for mode, _ in KEEP_MODES:
            comps.add("which model to keep", (name, mode), (name, "full"), "tokens")
    comps.resolve()
    out["comparisons"], out["families"] = comps, comps.summaries()
    out["controls"] = {n: dense_control_of(res.config(task, k, n), names) for n in trained}
    return out


def nan_to_none(value):
    """JSON-friendly: nan -> None, recursively through dicts and lists."""
    if isinstance(value, dict):
        return {k: nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nan_to_none(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value

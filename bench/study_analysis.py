"""Every comparison the verdict makes, computed once per task from the results, with Holm's
correction applied per family (study_stats.py). The report (study_verdict.py) and the summary
file the README and the results page are generated from (study_decision.py) both read this.

Families (each corrected on its own; the report gives each family's size m):
- "vs ddp": every run a user could choose against DDP, at every protocol (a derived run at
  equal tokens is DDP's or its base run's loss by construction: no comparison);
- "vs baselines, <protocol>": each SDP run against FSDP2, checkpointing, the half-batch
  dense control and both stochastic depths;
- "design": the questions the study was built to answer: SDP against the dense control at
  equal FLOPs, the contiguous block assignment against the default, block-level SDP against
  stochastic depth, and the linear stochastic depth schedule against the uniform one;
- "which model to keep": what closes the assembled block-level model's gap.
"""
from __future__ import annotations

from study_results import Results
from study_stats import Family

BASELINES = ("fsdp", "ddp-ac", "ddp-halfbatch", "ddp-sd-c0.5", "ddp-sdlin-c0.5")
KEEP_MODES = (("full_scaled", "owner-fraction scaling"), ("ensemble", "the ensemble of the K subnetworks"))


def _run_entry(res: Results, task, k, name, protocols) -> dict:
    cfg, cost, ddp = res.config(task, k, name), res.cost(task, k, name), res.cost(task, k, "ddp")
    entry = {"config": {key: cfg.get(key) for key in ("method", "level", "regime", "coverage", "assignment",
                                                      "activation_checkpointing", "stochastic_depth", "sd_schedule",
                                                      "batch_size_factor", "derived_from", "phase_of")},
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


def _identical_by_construction(res, task, k, name, protocol) -> bool:
    """A derived run whose mark is its base run's (always at equal tokens; at equal FLOPs when their FLOPs
    per step agree) reads the same point of the same trajectory: the same loss, nothing to test."""
    base = res.config(task, k, name).get("derived_from")
    return bool(base) and res.steps_at(task, k, name, protocol) == res.steps_at(task, k, base, protocol)


def analyse(res: Results, task: str, k: int, margin: float) -> dict:
    """{"ddp", "runs", "vs_ddp", "versus", "design", "keep", "families", "margin"} of one task and world
    size (see the module docstring); comparisons are study_stats.compare dicts, resolved."""
    protocols = res.protocols(task, k)
    names = res.verdict_runs(task, k)
    out = {"margin": margin, "protocols": protocols, "families": {},
           "ddp": _run_entry(res, task, k, "ddp", protocols),
           "runs": {n: _run_entry(res, task, k, n, protocols) for n in names + _phases(res, task, k)}}
    family = Family("vs ddp", margin)
    for name in names:
        for p in protocols:
            if not _identical_by_construction(res, task, k, name, p):
                family.add((name, p), res.diffs(task, k, (name, "full"), ("ddp", "full"), p))
    out["vs_ddp"] = _resolved(out, family)
    out["versus"] = {}
    sdp = [n for n in names if n.startswith("sdp-") and not res.config(task, k, n).get("derived_from")]
    for p in protocols:
        family = Family(f"vs baselines, {p}", margin)
        for name in sdp:
            for base in [b for b in BASELINES if b in names]:
                family.add((name, base), res.diffs(task, k, (name, "full"), (base, "full"), p))
        out["versus"][p] = _resolved(out, family)
    out["design"] = _design(res, task, k, names, margin, out)
    out["keep"] = _keep(res, task, k, names, margin, out)
    return out


def _resolved(out: dict, family: Family) -> dict:
    resolved = family.resolve()
    out["families"][family.name] = max((c["m"] for c in resolved.values()), default=0)
    return resolved


def _phases(res, task, k) -> list[str]:
    return [n for n in res.names(task, k) if res.config(task, k, n).get("phase_of")]


def _design(res, task, k, names, margin, out) -> dict:
    """The design questions: {(question, a, b, protocol): comparison of a minus b}."""
    family = Family("design", margin)
    present = set(names)
    if "ddp-halfbatch" in present:
        for name in [n for n in names if n.startswith("sdp-") and n.endswith("-c0.5") and "-ac-" not in n]:
            family.add(("dense control", name, "ddp-halfbatch", "flops"),
                       res.diffs(task, k, (name, "full"), ("ddp-halfbatch", "full"), "flops"))
    rolling, contiguous = "sdp-block-forward-c0.5", "sdp-block-forward-contig-c0.5"
    for p in [p for p in out["protocols"] if {rolling, contiguous} <= present]:
        family.add(("assignment", contiguous, rolling, p), res.diffs(task, k, (contiguous, "full"), (rolling, "full"), p))
    for sd in [s for s in ("ddp-sd-c0.5", "ddp-sdlin-c0.5") if s in present]:
        for p in [p for p in out["protocols"] if rolling in present]:
            family.add(("stochastic depth", rolling, sd, p), res.diffs(task, k, (rolling, "full"), (sd, "full"), p))
    if {"ddp-sd-c0.5", "ddp-sdlin-c0.5"} <= present:
        for p in out["protocols"]:
            family.add(("stochastic depth schedule", "ddp-sdlin-c0.5", "ddp-sd-c0.5", p),
                       res.diffs(task, k, ("ddp-sdlin-c0.5", "full"), ("ddp-sd-c0.5", "full"), p))
    return _resolved(out, family)


def _keep(res, task, k, names, margin, out) -> dict:
    """Block-level forward runs at equal tokens: {run: {"union": vs DDP, option: {"vs_ddp", "vs_union"}}}."""
    family = Family("which model to keep", margin)
    runs = [n for n in names if n.startswith("sdp-block-forward") and "-ac-" not in n]
    options = {}
    for name in runs:
        family.add((name, "union", "ddp"), res.diffs(task, k, (name, "full"), ("ddp", "full"), "tokens"))
        choices = {label: (name, mode) for mode, label in KEEP_MODES}
        choices.update({"a final phase in the backward regime": (p, "full") for p in _phases(res, task, k)
                        if res.config(task, k, p).get("phase_of") == name})
        for label, run in choices.items():
            union = res.diffs(task, k, run, (name, "full"), "tokens")
            if union:
                family.add((name, label, "union"), union)
                family.add((name, label, "ddp"), res.diffs(task, k, run, ("ddp", "full"), "tokens"))
                options.setdefault(name, {})[label] = run[0]
    resolved = _resolved(out, family)
    return {"comparisons": resolved, "options": options}

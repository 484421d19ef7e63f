"""The study's results, loaded and read the way the tables need them.

`Results(out)` holds every configuration's JSON (worker.py) keyed by (task, K, seed,
run). A run is read at a protocol's mark ("tokens": equal tokens, "flops": equal FLOPs,
"seconds": equal wall time, CUDA only), each the end of a cooldown branch. Differences are
paired: per seed, the run minus the other run of that seed (stats.compare).
Memory is the StepMemoryMeter's peak of one whole step (subnet_ext.measure.step_memory),
the worst rank over every seed.
"""
from __future__ import annotations

import glob
import json
import math
import os
import statistics

PROTOCOLS = ("tokens", "flops", "seconds")
PROTOCOL_TITLES = {"tokens": "equal tokens", "flops": "equal FLOPs", "seconds": "equal wall time"}
MIB = 2 ** 20


def mean_std(values: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation; nan for a single value)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else math.nan)


class Results:
    """Every result JSON under <out>/results, with lookups by (task, K, seed, run)."""

    def __init__(self, out: str):
        self.runs = {}
        for path in sorted(glob.glob(os.path.join(out, "results", "*", "K*", "seed*", "*.json"))):
            with open(path) as f:
                r = json.load(f)
            c = r["config"]
            self.runs[(c["task"], c["K"], c["seed"], c["name"])] = r
        from .runs import all_configs

        self.order = {}  # (task, K) -> run names in the study's order (runs.jobs), then any others
        for (task, k, seed, name), r in self.runs.items():
            if (task, k) not in self.order:
                sizes = r["profile"]["tasks"][task]
                canonical = [c["name"] for c in all_configs(task, [0], sizes.get("runs", "main"))]
                self.order[(task, k)] = [n for n in canonical
                                         if any(key[:2] == (task, k) and key[3] == n for key in self.runs)]
            if name not in self.order[(task, k)]:
                self.order[(task, k)].append(name)

    def cpu_seconds(self) -> float:
        """Process time of every rank over every configuration (0 for results that lack it)."""
        return sum(x.get("cpu_seconds", 0.0) for r in self.runs.values() for x in r["per_rank"])

    def tasks(self) -> list[str]:
        """Tasks with results, in the study's order (runs.TASKS first)."""
        from .runs import TASKS

        found = {t for t, *_ in self.runs}
        return [t for t in TASKS if t in found] + sorted(found - set(TASKS))

    def worlds(self, task: str) -> list[int]:
        """World sizes with results for `task`, largest first."""
        return sorted({k for t, k, *_ in self.runs if t == task}, reverse=True)

    def names(self, task: str, k: int) -> list[str]:
        """Run names of (task, K) in the order they ran."""
        return list(self.order.get((task, k), []))

    def config(self, task, k, name) -> dict:
        """The configuration of a run (its first seed's)."""
        return self.get(task, k, self.seeds(task, k, name)[0], name)["config"]

    def verdict_runs(self, task, k) -> list[str]:
        """Every run but DDP and the anchor (the recipe's own schedule): the methods a user could choose."""
        return [n for n in self.names(task, k) if n != "ddp" and self.config(task, k, n).get("schedule") != "cosine"]

    def protocols(self, task, k) -> list[str]:
        """The protocols DDP was read at (equal wall time on CUDA profiles only)."""
        seeds = self.seeds(task, k, "ddp")
        marks = self.get(task, k, seeds[0], "ddp")["marks"] if seeds else {}
        return [p for p in PROTOCOLS if p in marks]

    def seeds(self, task: str, k: int, name: str) -> list[int]:
        """Seeds that ran (task, K, name)."""
        return sorted(s for t, kk, s, n in self.runs if (t, kk, n) == (task, k, name))

    def get(self, task, k, seed, name) -> dict | None:
        """One configuration's result JSON, or None."""
        return self.runs.get((task, k, seed, name))

    def point(self, task, k, seed, name, protocol: str) -> dict | None:
        """The point a run was read at for a protocol (the end of its cooldown branch), or None."""
        r = self.get(task, k, seed, name)
        return None if r is None else r["marks"].get(protocol)

    def value(self, task, k, seed, name, protocol, mode="full", metric="loss"):
        """A run's metric for one model (mode: full, full_scaled, ensemble, full_unscaled,
        subnetworks (their mean), best_subnetwork (the rank whose subnetwork has the lowest loss))
        at a protocol's mark; None where that model or mark is absent."""
        p = self.point(task, k, seed, name, protocol)
        if p is None:
            return None
        if mode in ("subnetworks", "best_subnetwork"):
            per_rank = p.get("subnetworks", {}).get(metric)
            if not per_rank:
                return None
            if mode == "subnetworks":
                return statistics.fmean(per_rank)
            best = min(range(len(per_rank)), key=lambda r: p["subnetworks"]["loss"][r])
            return per_rank[best]
        return p.get(metric, {}).get(mode)

    def diffs(self, task, k, a: tuple, b: tuple, protocol: str, metric: str = "loss",
              protocol_b: str | None = None) -> list[float]:
        """Per seed, run a's metric minus run b's, each (run name, model mode); a read at `protocol`,
        b at `protocol_b` (default the same); seeds where either is missing are left out."""
        out = []
        for seed in self.seeds(task, k, a[0]):
            va = self.value(task, k, seed, a[0], protocol, a[1], metric)
            vb = self.value(task, k, seed, b[0], protocol_b or protocol, b[1], metric)
            if va is not None and vb is not None:
                out.append(va - vb)
        return out

    def summary(self, task, k, name, protocol, mode="full", metric="loss") -> dict:
        """{"mean", "std", "n"} of a run's metric over seeds at a protocol's mark."""
        values = [v for s in self.seeds(task, k, name)
                  if (v := self.value(task, k, s, name, protocol, mode, metric)) is not None]
        m, sd = mean_std(values)
        return {"mean": m, "std": sd, "n": len(values)}

    def relative(self, task, k, name, protocol, field: str) -> float:
        """A run's `field` ("tokens" or "step") at a protocol's mark over DDP's at equal tokens, the mean
        over seeds (tokens x DDP's, optimizer steps x DDP's)."""
        ratios = []
        for s in self.seeds(task, k, name):
            p, base = self.point(task, k, s, name, protocol), self.point(task, k, s, "ddp", "tokens")
            if p is not None and base is not None and base[field]:
                ratios.append(p[field] / base[field])
        return statistics.fmean(ratios) if ratios else math.nan

    def subnetwork_losses(self, task, k, name, protocol) -> list[float]:
        """Each rank's subnetwork loss (rank order), the mean over seeds; [] where none was evaluated."""
        per_rank = [p["subnetworks"]["loss"] for s in self.seeds(task, k, name)
                    if (p := self.point(task, k, s, name, protocol)) and p.get("subnetworks")]
        if not per_rank:
            return []
        return [statistics.fmean(r[i] for r in per_rank) for i in range(len(per_rank[0]))]

    def cost(self, task, k, name) -> dict:
        """Per-rank costs: the metered peak and its split (the worst rank over every seed), the model
        state held (parameters, gradients, optimizer state), peak RSS, communication, FLOPs and step time."""
        seeds = self.seeds(task, k, name)
        results = [self.get(task, k, s, name) for s in seeds]
        ranks = [x for r in results for x in r["per_rank"]]
        metered = [x for x in ranks if x.get("meter")]
        worst = max(metered, key=lambda x: x["meter"]["total"]) if metered else {"meter": {}}
        held = lambda key: max((x["memory"] or {}).get(key, 0) or 0 for x in ranks)  # noqa: E731
        first = results[0]
        return {"peak": worst["meter"].get("total", math.nan),
                **{key: worst["meter"].get(key, math.nan) for key in ("model_state", "activations", "transient")},
                "peak_phase": worst["meter"].get("peak_phase"), "meter_source": worst["meter"].get("source"),
                "held_model_state": held("model_state"), "parameters": held("parameters"),
                "gradients": held("gradients"), "optimizer_state": held("optimizer_state"),
                "peak_rss": max(x["peak_rss_bytes"] for x in ranks),
                "rss_added": max(x["peak_rss_bytes"] - x.get("rss_at_start_bytes", x["peak_rss_bytes"]) for x in ranks),
                "comm_bytes_per_step": first["comm"].get("bytes_per_step"),
                "collectives_per_step": first["comm"].get("collectives_per_step"),
                "comm_source": first["comm"].get("source", ""),
                "step_flops": first["step_flops"], "reference_rank_flops": first["reference"]["rank_flops"],
                "step_time_s": statistics.median(max(x["step_time_s"] for x in r["per_rank"]) for r in results),
                "capped": any(r["capped"] for r in results)}

    def memory_ratio(self, task, k, name, other: str = "ddp") -> float:
        """A run's metered peak per rank over another's (DDP's by default)."""
        return self.cost(task, k, name)["peak"] / self.cost(task, k, other)["peak"]

    def steps_at(self, task, k, name, protocol) -> list[int]:
        """The step of each seed's mark for a protocol."""
        return [p["step"] for s in self.seeds(task, k, name)
                if (p := self.point(task, k, s, name, protocol)) is not None]

    def mean_curve(self, task, k, name, x: str = "step", mode: str = "full", metric: str = "loss"):
        """([x], [metric]) of the stable trajectory (constant rate, no cooldown), averaged over seeds at
        the steps every seed evaluated; empty for runs without their own trajectory (derived runs)."""
        curves = [{p["step"]: p for p in self.get(task, k, s, name)["curve"]} for s in self.seeds(task, k, name)]
        if not curves or not all(curves):
            return [], []
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        xs = [statistics.fmean(c[step][x] for c in curves) for step in steps]
        ys = [statistics.fmean(c[step][metric][mode] for c in curves) for step in steps]
        return xs, ys

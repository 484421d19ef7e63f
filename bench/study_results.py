"""The study's results, loaded and read the way the tables need them.

`Results(out)` holds every configuration's JSON (study_worker.py) keyed by (task, K,
seed, run). A run is read at a protocol's mark: "tokens" (its `steps`-th step: equal
iterations), "flops" (where its FLOPs reach DDP's at `steps`) and "seconds" (where its
training time reaches DDP's); DDP itself is read at "tokens" for all three. Differences
to DDP are paired: per seed, the run minus the DDP run of that seed, then mean and
sample standard deviation over seeds.
"""
from __future__ import annotations

import glob
import json
import math
import os
import statistics

PROTOCOLS = ("tokens", "flops", "seconds")
PROTOCOL_TITLES = {"tokens": "equal iterations (tokens)", "flops": "FLOP-matched", "seconds": "equal wall time"}


def mean_std(values: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation; nan for a single value)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else math.nan)


def _flops_per_step(result: dict) -> float:
    """FLOPs of a step summed over ranks: the counted first step, or for stochastic depth (whose
    steps differ) the run's mean."""
    if result["config"].get("stochastic_depth"):
        return result["curve"][-1]["flops"] / max(1, result["steps_done"])
    return result["step_flops"]


class Results:
    """Every result JSON under <out>/results, with lookups by (task, K, seed, run)."""

    def __init__(self, out: str):
        self.runs = {}
        for path in sorted(glob.glob(os.path.join(out, "results", "*", "K*", "seed*", "*.json"))):
            with open(path) as f:
                r = json.load(f)
            c = r["config"]
            self.runs[(c["task"], c["K"], c["seed"], c["name"])] = r
        from study_runs import jobs

        self.order = {}  # (task, K) -> run names in the study's order (study_runs.jobs), then any others
        for (task, k, seed, name) in self.runs:
            if (task, k) not in self.order:
                canonical = [c["name"] for j in jobs(task, [seed], k) for c in [j["config"], *j["phases"]]]
                self.order[(task, k)] = [n for n in canonical
                                         if any(key[:2] == (task, k) and key[3] == n for key in self.runs)]
            if name not in self.order[(task, k)]:
                self.order[(task, k)].append(name)

    def cpu_seconds(self) -> float:
        """Process time of every rank over every configuration (0 for results that lack it)."""
        return sum(x.get("cpu_seconds", 0.0) for r in self.runs.values() for x in r["per_rank"])

    def tasks(self) -> list[str]:
        """Tasks with results, in the study's order (pysrc first)."""
        found = {t for t, *_ in self.runs}
        return [t for t in ("pysrc", "digits") if t in found] + sorted(found - {"pysrc", "digits"})

    def worlds(self, task: str) -> list[int]:
        """World sizes with results for `task`, largest first."""
        return sorted({k for t, k, *_ in self.runs if t == task}, reverse=True)

    def names(self, task: str, k: int) -> list[str]:
        """Run names of (task, K) in the order they ran."""
        return list(self.order.get((task, k), []))

    def seeds(self, task: str, k: int, name: str) -> list[int]:
        """Seeds that ran (task, K, name)."""
        return sorted(s for t, kk, s, n in self.runs if (t, kk, n) == (task, k, name))

    def get(self, task, k, seed, name) -> dict | None:
        """One configuration's result JSON, or None."""
        return self.runs.get((task, k, seed, name))

    def point(self, task, k, seed, name, protocol: str) -> dict | None:
        """The curve point of a run at a protocol's mark (DDP, the reference, at "tokens")."""
        r = self.get(task, k, seed, name)
        if r is None:
            return None
        mark = "tokens" if name == r["config"]["baseline"] else protocol
        found = next((p for p in r["curve"] if mark in p["marks"]), None)
        if found is None and protocol == "seconds":  # stopped before DDP's time (study_worker.TIME_EXTENSION)
            found = next((p for p in r["curve"] if "seconds_not_reached" in p["marks"]), None)
        return found

    def not_reached(self, task, k, name, protocol) -> bool:
        """True when some seed stopped before reaching the protocol's mark (read at its last point)."""
        return any(self.point(task, k, s, name, protocol) is not None
                   and f"{protocol}_not_reached" in self.point(task, k, s, name, protocol)["marks"]
                   for s in self.seeds(task, k, name))

    def value(self, task, k, seed, name, protocol, mode="full", metric="loss"):
        """A run's metric for one model (mode: full, full_scaled, ensemble, full_unscaled,
        subnetworks (their mean)) at a protocol's mark; None where that model or mark is absent."""
        p = self.point(task, k, seed, name, protocol)
        if p is None:
            return None
        if mode == "subnetworks":
            per_rank = p.get("subnetworks", {}).get(metric)
            return statistics.fmean(per_rank) if per_rank else None
        return p.get(metric, {}).get(mode)

    def summary(self, task, k, name, protocol, mode="full", metric="loss") -> dict:
        """{"mean", "std", "delta", "delta_std", "n"}: a run's metric over seeds and its paired
        difference to DDP's full model (the baseline of its world size) at the same protocol."""
        values, deltas = [], []
        for seed in self.seeds(task, k, name):
            v = self.value(task, k, seed, name, protocol, mode, metric)
            if v is None:
                continue
            values.append(v)
            base = self.value(task, k, seed, "ddp", protocol, "full", metric)
            if base is not None:
                deltas.append(v - base)
        m, s = mean_std(values)
        dm, ds = mean_std(deltas)
        return {"mean": m, "std": s, "delta": dm, "delta_std": ds, "n": len(values)}

    def subnetwork_losses(self, task, k, name, protocol) -> list[float]:
        """Each rank's subnetwork loss (rank order), the mean over seeds; [] where none was evaluated."""
        per_rank = []
        for seed in self.seeds(task, k, name):
            p = self.point(task, k, seed, name, protocol)
            if p and p.get("subnetworks"):
                per_rank.append(p["subnetworks"]["loss"])
        if not per_rank:
            return []
        return [statistics.fmean(r[i] for r in per_rank) for i in range(len(per_rank[0]))]

    def cost(self, task, k, name) -> dict:
        """Per-rank costs (worst rank, seed 0 or the first seed that ran) and per-step figures."""
        seeds = self.seeds(task, k, name)
        r = self.get(task, k, seeds[0], name)
        ranks = r["per_rank"]
        mem = lambda key: max((x["memory"] or {}).get(key, 0) or 0 for x in ranks)  # noqa: E731
        times = [self.get(task, k, s, name)["per_rank"] for s in seeds]
        return {"model_state": mem("model_state"), "parameters": mem("parameters"), "gradients": mem("gradients"),
                "optimizer_state": mem("optimizer_state"),
                "activations": max(x["activation_bytes_max"] for x in ranks),
                "activations_mean": max(x["activation_bytes_mean"] for x in ranks),
                "peak_rss": max(x["peak_rss_bytes"] for x in ranks),
                "comm_bytes_per_step": r["comm"].get("bytes_per_step"),
                "collectives_per_step": r["comm"].get("collectives_per_step"),
                "comm_source": r["comm"].get("source", ""),
                "step_flops": _flops_per_step(r), "reference_rank_flops": r["reference"]["rank_flops"],
                "step_time_s": statistics.median(max(x["step_time_s"] for x in pr) for pr in times),
                "steps_done": [self.get(task, k, s, name)["steps_done"] for s in seeds],
                "capped": any(self.get(task, k, s, name)["capped"] for s in seeds)}

    def steps_at(self, task, k, name, protocol) -> list[int]:
        """The step of each seed's mark for a protocol."""
        return [p["step"] for s in self.seeds(task, k, name)
                if (p := self.point(task, k, s, name, protocol)) is not None]

    def mean_curve(self, task, k, name, x: str = "step", mode: str = "full", metric: str = "loss"):
        """([x], [metric]) averaged over seeds at the steps every seed evaluated (protocol marks
        fall at different steps per seed; the evaluation grid is common)."""
        curves = [{p["step"]: p for p in self.get(task, k, s, name)["curve"]} for s in self.seeds(task, k, name)]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        xs = [statistics.fmean(c[step][x] for c in curves) for step in steps]
        ys = [statistics.fmean(c[step][metric][mode] for c in curves) for step in steps]
        return xs, ys


def paired(res: Results, task: str, k: int, a: tuple, b: tuple, protocol: str = "tokens", metric: str = "loss"):
    """(mean, std, n) over seeds of run a's metric minus run b's, each (run name, model mode), both read at
    `protocol`'s mark; seeds where either is missing are left out."""
    diffs = []
    for seed in res.seeds(task, k, a[0]):
        va = res.value(task, k, seed, a[0], protocol, a[1], metric)
        vb = res.value(task, k, seed, b[0], protocol, b[1], metric)
        if va is not None and vb is not None:
            diffs.append(va - vb)
    m, s = mean_std(diffs)
    return m, s, len(diffs)


def significant(mean: float, std: float, n: int) -> bool:
    """A paired t-test at the 5% level, two-sided: |mean| larger than Student's t quantile (n - 1
    degrees of freedom; 4.30 for 3 seeds) times its standard error. False with fewer than 2 seeds."""
    from scipy.stats import t

    if n < 2 or math.isnan(std):
        return False
    return abs(mean) > t.ppf(0.975, n - 1) * std / math.sqrt(n)

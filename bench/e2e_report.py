"""Tables and verdicts of the end-to-end step benchmark, from the per-round figures.

Step times: a configuration's time in one round is its slowest rank's median step; its
reported step time is the median over rounds. Every ratio between two configurations
(×ddp, ×fsdp) is taken per round, between windows of the same round, and reported as the
median over rounds with its range [min-max]; every verdict uses that median. Memory and
communication figures do not depend on the machine's load: the worst rank's median.
"""
from __future__ import annotations

import statistics

from e2e_worker import Config

# Figures that do not depend on the machine's load (peak growth barely does).
FIXED_KEYS = ("model_state", "peak_growth", "comm_bytes", "collectives", "predicted_model_state", "flops_share")


def combine(configs: list[Config], per_rank: list[dict]) -> list[tuple[Config, dict]]:
    """Per-rank results of one group (run_group's) -> [(config, figures or {"error"})]."""
    out = []
    for cfg in configs:
        entries = [rank[cfg.label] for rank in per_rank]
        errors = [e["error"] for e in entries if "error" in e]
        if errors or not entries[0]["rounds"]:
            out.append((cfg, {"error": errors[0] if errors else "no round ran"}))
            continue
        rounds = [max(e["rounds"][i]["step_s"] for e in entries) for i in range(len(entries[0]["rounds"]))]
        figures = {"step_s": statistics.median(rounds), "round_steps": rounds}
        for key in FIXED_KEYS:
            figures[key] = max(statistics.median(r[key] for r in e["rounds"]) for e in entries)
        profile = entries[0]["rounds"][-1].get("profile")
        if profile is not None:
            figures["profile"] = profile
        out.append((cfg, figures))
    return out


def round_ratios(a: dict, b: dict) -> list[float]:
    """Step-time ratios a/b, one per round (windows of the same round)."""
    return [x / y for x, y in zip(a["round_steps"], b["round_steps"]) if y > 0]


def ratio_cell(a: dict, b: dict | None) -> str:
    """"median [min-max]" of the per-round step-time ratios, or "n/a"."""
    if not b or "error" in b:
        return "n/a"
    r = round_ratios(a, b)
    return f"{statistics.median(r):.3f} [{min(r):.3f}-{max(r):.3f}]" if r else "n/a"


def _mib(b):
    return f"{b / 2**20:.2f}"


def _ratio(a, b):
    return f"{a / b:.3f}" if b else "n/a"


def main_table(results: list[tuple[Config, dict]]) -> list[str]:
    """One row per configuration; ratios against DDP of the same model and world size."""
    from subnet_ext.planning.plan import owners_per_unit

    lines = ["| model | K | run | owners/unit | step ms | ×ddp, median [range] over rounds | FLOPs/rank ×ddp (plan) "
             "| model state MiB/rank | ×ddp | peak RSS growth MiB | ×ddp | comm MiB/step | ×ddp | collectives/step |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ddp = {(c.model, c.world): r for c, r in results if c.method == "ddp" and "error" not in r}
    for c, r in results:
        owners = owners_per_unit(c.world, c.coverage) if c.method == "sdp" else "-"
        if "error" in r:
            lines.append(f"| {c.model} | {c.world} | {c.label} | {owners} | refused or failed: {r['error']} "
                         "| | | | | | | | | |")
            continue
        d = ddp.get((c.model, c.world), {})
        lines.append(
            f"| {c.model} | {c.world} | {c.label} | {owners} | {1e3 * r['step_s']:.1f} | {ratio_cell(r, d)} "
            f"| {r['flops_share']:.3f} | {_mib(r['model_state'])} | {_ratio(r['model_state'], d.get('model_state'))} "
            f"| {_mib(r['peak_growth'])} | {_ratio(r['peak_growth'], d.get('peak_growth'))} "
            f"| {_mib(r['comm_bytes'])} | {_ratio(r['comm_bytes'], d.get('comm_bytes'))} | {r['collectives']:.1f} |")
    return lines


def growth_tables(results: list[tuple[Config, dict]], models, worlds) -> list[str]:
    """How step time and model-state memory grow with model size and world size, per run."""
    cols = [(m, k) for m in models for k in worlds]
    out = []
    for key, name, fmt in (("step_s", "step ms", lambda v: f"{1e3 * v:.1f}"),
                           ("model_state", "model state MiB/rank", _mib)):
        out += ["", f"{name} by model (columns: preset/K):", "",
                "| run | " + " | ".join(f"{m}/{k}" for m, k in cols) + " |",
                "|---|" + "---:|" * len(cols)]
        for label in dict.fromkeys(c.label for c, _ in results):
            cells = []
            for m, k in cols:
                r = next((r for c, r in results if c.label == label and c.model == m and c.world == k), None)
                cells.append("-" if r is None or "error" in r else fmt(r[key]))
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def overlap_lines(res: dict, description: str) -> list[str]:
    """The overlap experiment's table: {variant: figures} (overlap, no overlap, no communication)."""
    lines = [description, "", "| variant | step ms | comm MiB/step | collectives/step |", "|---|---:|---:|---:|"]
    for name, r in res.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | |")
        else:
            lines.append(f"| {name} | {1e3 * r['step_s']:.1f} | {_mib(r['comm_bytes'])} | {r['collectives']:.1f} |")
    return lines


def _find(results, **kw):
    return next((r for c, r in results if all(getattr(c, k) == v for k, v in kw.items()) and "error" not in r), None)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _step_verdict(a: dict, b: dict, name: str, target: float) -> str:
    r = round_ratios(a, b)
    med = statistics.median(r)
    return (f"step time {med:.3f}× {name} (rounds {min(r):.3f}-{max(r):.3f}; target ≤ {target:g}): "
            f"{_verdict(med <= target)}")


def sdp_targets(results, overlap_res: dict, small_model: str, device: str) -> list[str]:
    """SDP's step-time and memory targets without sharding, plus overlap (rows only when they ran)."""
    out = []
    ddp = _find(results, model=small_model, world=2, method="ddp")
    sdp = _find(results, model=small_model, world=2, method="sdp", level="block", regime="forward", coverage=0.5,
                shard_shared=False)
    if ddp and sdp:
        m = sdp["model_state"] / ddp["model_state"]
        out.append(f"- llama {small_model}, 2 ranks, SDP block forward c0.5: {_step_verdict(sdp, ddp, 'DDP', 0.7)}; "
                   f"model state {m:.3f}× DDP (target ≤ 0.6): {_verdict(m <= 0.6)}")
    on, off, none = (overlap_res.get(k) for k in ("overlap", "no overlap", "no communication"))
    if all(r and "error" not in r for r in (on, off, none)):
        comm = [f - n for f, n in zip(off["round_steps"], none["round_steps"])]
        share = statistics.median(c / f for c, f in zip(comm, off["round_steps"]))
        hidden = [(f - o) / c for f, o, c in zip(off["round_steps"], on["round_steps"], comm) if c > 0]
        h = statistics.median(hidden) if hidden else float("nan")
        out.append(f"- overlap: communication is {100 * share:.0f}% of the non-overlapped step (setting needs ≥ 20%: "
                   f"{'yes' if share >= 0.2 else 'no'}); overlap hides {100 * h:.0f}% of it (target ≥ 50%): "
                   f"{_verdict(h >= 0.5 and share >= 0.2)}")
    for model in dict.fromkeys(c.model for c, _ in results):
        for world in dict.fromkeys(c.world for c, _ in results):
            d = _find(results, model=model, world=world, method="ddp")
            s = _find(results, model=model, world=world, method="sdp", level="block", regime="forward", coverage=1.0,
                      shard_shared=False)
            if d and s:
                out.append(f"- llama {model}, K={world}: SDP at coverage 1.0 {_step_verdict(s, d, 'DDP', 1.10)}")
    return ["", f"Targets, SDP ({device.upper()}; medians over rounds):", *out] if out else []


def shard_targets(results, small_model: str, device: str) -> list[str]:
    """Targets of SDP with sharded shared parameters (rows only when they ran)."""
    sdp = dict(model=small_model, method="sdp", level="block", regime="forward", shard_shared=True)
    out = []
    ddp2, shard2 = _find(results, model=small_model, world=2, method="ddp"), _find(results, world=2, coverage=0.5, **sdp)
    if ddp2 and shard2:
        m = shard2["model_state"] / ddp2["model_state"]
        out.append(f"- llama {small_model}, 2 ranks, sdp block forward c0.5 shard: {_step_verdict(shard2, ddp2, 'DDP', 0.6)}; "
                   f"model state {m:.3f}× DDP (target ≤ 0.52): {_verdict(m <= 0.52)}")
    ddp4, fsdp4 = _find(results, model=small_model, world=4, method="ddp"), _find(results, model=small_model, world=4,
                                                                                   method="fsdp")
    shard4 = _find(results, world=4, coverage=0.25, **sdp)
    if ddp4 and shard4:
        m = shard4["model_state"] / ddp4["model_state"]
        fsdp_state = f"; FSDP2 {fsdp4['model_state'] / ddp4['model_state']:.3f}" if fsdp4 else ""
        out.append(f"- llama {small_model}, 4 ranks, sdp block forward c0.25 shard: "
                   f"{_step_verdict(shard4, ddp4, 'DDP', 0.30)} (compute floor: the busiest rank's share of the "
                   f"forward FLOPs, {shard4['flops_share']:.3f}); "
                   f"model state {m:.3f}× DDP (target ≤ 0.28{fsdp_state}): {_verdict(m <= 0.28)}")
        if fsdp4:
            out.append(f"- llama {small_model}, 4 ranks, sdp block forward c0.25 shard against FSDP2: "
                       f"{_step_verdict(shard4, fsdp4, 'FSDP2', 0.6)}")
    for c, r in results:
        if c.shard_shared and "error" not in r:
            e = r["predicted_model_state"] / r["model_state"] - 1
            out.append(f"- {c.model} K={c.world} {c.label}: subnet-plan's model state "
                       f"{_mib(r['predicted_model_state'])} MiB vs measured {_mib(r['model_state'])} MiB "
                       f"({100 * e:+.1f}%, target within 5%): {_verdict(abs(e) <= 0.05)}")
    return ["", f"Targets, sharded shared parameters ({device.upper()}; medians over rounds):", *out] if out else []


def profile_section(results: list[tuple[Config, dict]]) -> list[str]:
    """Where one step's time goes, per configuration (rank 0, torch.profiler, top ops by self CPU time)."""
    rows = [(c, r) for c, r in results if "profile" in r]
    if not rows:
        return []
    out = ["", "## Profile of one step", "",
           "Rank 0, one step after the last round's window, under torch.profiler; the ops with the most self CPU "
           "time (time inside the op itself, not its children); share: of that step's wall time (ops that wait "
           "for a collective count their waiting; other threads' ops can add up to more than 100%)."]
    for c, r in rows:
        p = r["profile"]
        out += ["", f"{c.model} K={c.world} {c.label}: step {p['wall_ms']:.1f} ms; matrix products "
                f"{p['matmul_ms']:.1f} ms, collectives (c10d, waiting included) {p['comm_ms']:.1f} ms, optimizer step "
                f"{p['optimizer_ms']:.1f} ms.", "", "| op | self CPU ms | share of step | calls |", "|---|---:|---:|---:|"]
        out += [f"| `{o['op']}` | {o['self_ms']:.2f} | {100 * o['share']:.1f}% | {o['calls']} |" for o in p["ops"]]
    return out

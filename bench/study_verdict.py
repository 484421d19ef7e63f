"""The verdict, written from the numbers: every sentence below is computed from the results
(study_results.py), so a reader can check each against a table. What numbers cannot
settle is listed apart, for a person to judge.

Rules: a difference is "significant" when a paired t-test over seeds rejects zero at the 5%
level (study_results.significant); otherwise the runs are "indistinguishable" at this
number of seeds. Memory is the worst rank's model state plus saved activations.
An SDP run "wins" (W) against a baseline when it needs less memory per rank and its loss
is not significantly worse; it "loses" (L) when the baseline needs no more memory and is
significantly better.
"""
from __future__ import annotations

from study_plots import memory_points, pareto_front
from study_results import PROTOCOL_TITLES, Results, paired, significant

MIB = 2 ** 20
BASELINES = ("ddp", "fsdp", "ddp-ac", "ddp-sd-c0.5", "ddp-sd-c0.25")


def _memory(res, task, k, name) -> float:
    c = res.cost(task, k, name)
    return c["model_state"] + c["activations"]


def _diff(m, s, n) -> str:
    word = ("worse" if m > 0 else "better") if significant(m, s, n) else "indistinguishable"
    return f"Δ {m:+.3f} ± {s:.3f} ({word}, n={n})"


def _run_line(res, task, k, name) -> str:
    base_mem = _memory(res, task, k, "ddp")
    parts = []
    for protocol in ("tokens", "flops", "seconds"):
        m, s, n = paired(res, task, k, (name, "full"), ("ddp", "full"), protocol)
        if n:
            parts.append(f"{PROTOCOL_TITLES[protocol]} {_diff(m, s, n)}")
    return f"`{name}`: " + "; ".join(parts) + f"; memory {_memory(res, task, k, name) / base_mem:.2f}× DDP's."


def _versus_table(res, task, k, protocol) -> list[str]:
    """SDP runs (rows) against each baseline (columns): W (wins), L (loses) or · (neither), the paired
    Δ of the SDP run's loss minus the baseline's, and the SDP run's memory relative to the baseline's."""
    sdp = [n for n in res.names(task, k) if n.startswith("sdp-") and "+" not in n]
    baselines = [b for b in BASELINES if b in res.names(task, k)]
    if not sdp or not baselines:
        return []
    lines = ["| SDP run | " + " | ".join(f"vs {b}" for b in baselines) + " |", "|---" * (len(baselines) + 1) + "|"]
    for name in sdp:
        mem, cells = _memory(res, task, k, name), []
        for b in baselines:
            m, s, n = paired(res, task, k, (name, "full"), (b, "full"), protocol)
            b_mem = _memory(res, task, k, b)
            worse = significant(m, s, n) and m > 0
            mark = "W" if mem < b_mem and not worse else ("L" if b_mem <= mem and worse else "·")
            cells.append(f"{mark} {m:+.3f} ± {s:.3f}, {mem / b_mem:.2f}× mem")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _losers(res, task, k, protocol) -> list[str]:
    """"`sdp run` (to baseline, ...)" for every L cell of _versus_table."""
    out = []
    for name in [n for n in res.names(task, k) if n.startswith("sdp-") and "+" not in n]:
        beaten_by = []
        for b in [b for b in BASELINES if b in res.names(task, k)]:
            m, s, n = paired(res, task, k, (name, "full"), (b, "full"), protocol)
            if _memory(res, task, k, b) <= _memory(res, task, k, name) and significant(m, s, n) and m > 0:
                beaten_by.append(b)
        if beaten_by:
            out.append(f"`{name}` (to {', '.join(beaten_by)})")
    return out


def _best(res, task, k, protocol) -> str:
    """The SDP run with the lowest loss at a protocol, with its Δ to DDP and memory."""
    sdp = [n for n in res.names(task, k) if n.startswith("sdp-") and "+" not in n]
    if not sdp:
        return ""
    best = min(sdp, key=lambda n: res.summary(task, k, n, protocol)["mean"])
    m, s, n = paired(res, task, k, (best, "full"), ("ddp", "full"), protocol)
    return (f"lowest-loss SDP run at {PROTOCOL_TITLES[protocol]}: `{best}`, {_diff(m, s, n)}, at "
            f"{_memory(res, task, k, best) / _memory(res, task, k, 'ddp'):.2f}× DDP's memory per rank.")


def _union_gap(res, task, k) -> list[str]:
    """The block-level forward runs: the assembled model's gap to DDP and what closes it."""
    lines = []
    for name in [n for n in res.names(task, k) if n.startswith("sdp-block-forward") and "+" not in n]:
        full = paired(res, task, k, (name, "full"), ("ddp", "full"))
        options = {"owner-fraction scaling": (name, "full_scaled"), "ensemble": (name, "ensemble")}
        for phase in sorted({n.split("+", 1)[1] for n in res.names(task, k) if n.startswith(name + "+")}):
            options[f"final {phase}"] = (f"{name}+{phase}", "full")
        parts = [f"`{name}` assembled model {_diff(*full)}"]
        best, best_gain = None, 0.0
        for label, run in options.items():
            to_ddp = paired(res, task, k, run, ("ddp", "full"))
            gain = paired(res, task, k, run, (name, "full"))
            if not to_ddp[2]:
                continue
            # A share of the gap only where there is one: the union significantly worse than DDP.
            closes = f", closes {100 * -gain[0] / full[0]:.0f}% of the gap" if significant(*full) and full[0] > 0 else ""
            cost = ""
            if label.startswith("final"):
                c, base = res.cost(task, k, run[0]), res.cost(task, k, "ddp")
                cost = (f"; the phase holds {c['model_state'] / base['model_state']:.2f}× DDP's model state and "
                        f"{c['step_time_s'] / base['step_time_s']:.2f}× its step time")
            parts.append(f"{label}: {_diff(*to_ddp)}, change vs the unscaled union {gain[0]:+.3f} ± {gain[1]:.3f}"
                         f"{' (significant)' if significant(*gain) else ''}{closes}{cost}")
            if significant(*gain) and gain[0] < best_gain:
                best, best_gain = label, gain[0]
        parts.append(f"largest significant improvement: {best or 'none'}")
        lines.append("; ".join(parts) + ".")
    return lines


def _recommendations(res, task, k) -> list[str]:
    lines = []
    ddp_mem = _memory(res, task, k, "ddp")
    budgets = [("0.5× DDP's", 0.5 * ddp_mem), ("0.75× DDP's", 0.75 * ddp_mem)]
    if "fsdp" in res.names(task, k):
        budgets.insert(0, ("FSDP2's", _memory(res, task, k, "fsdp")))
    for protocol in ("tokens", "flops"):
        points = memory_points(res, task, k, protocol)
        for label, budget in budgets:
            fits = [p for p in points if p[0] * MIB <= budget * (1 + 1e-9)]
            if fits:
                mem, loss, std, name = min(fits, key=lambda p: p[1])
                lines.append(f"{PROTOCOL_TITLES[protocol]}, memory at most {label} ({budget / MIB:.2f} MiB): lowest "
                             f"loss `{name}` {loss:.3f} ± {std:.3f} at {mem:.2f} MiB.")
        front = pareto_front([(m, l, n) for m, l, _, n in points])
        lines.append(f"{PROTOCOL_TITLES[protocol]}: Pareto front (memory, loss) "
                     + ", ".join(f"`{n}` ({m:.2f} MiB, {l:.3f})" for m, l, n in front) + ".")
    return lines


def _union_best(res, task, k, name) -> str:
    """The union fix with the largest significant improvement for one block-forward run, in words."""
    best, best_gain = None, 0.0
    options = {"owner-fraction scaling": (name, "full_scaled"), "the ensemble": (name, "ensemble")}
    for phase in sorted({n.split("+", 1)[1] for n in res.names(task, k) if n.startswith(name + "+")}):
        options[f"a final {phase}"] = (f"{name}+{phase}", "full")
    for label, run in options.items():
        gain = paired(res, task, k, run, (name, "full"))
        if gain[2] and significant(*gain) and gain[0] < best_gain:
            best, best_gain = label, gain[0]
    return f"{best} ({best_gain:+.3f})" if best else "none (no fix changes it significantly)"


def summary_section(res: Results) -> str:
    """A few generated sentences for the top of the report: per task at the largest world size, the best
    SDP run at each protocol, SDP against stochastic depth at the same coverage, the union fix, and the
    lowest loss within FSDP2's memory."""
    out = ["## Summary (generated)", ""]
    for task in res.tasks():
        k = res.worlds(task)[0]
        if "ddp" not in res.names(task, k):
            continue
        s = res.summary(task, k, "ddp", "tokens")
        lines = [f"DDP's loss {s['mean']:.3f} ± {s['std']:.3f}"]
        lines += [_best(res, task, k, p) for p in ("tokens", "flops")]
        for c in ("0.5", "0.25"):
            sd, sdp = f"ddp-sd-c{c}", f"sdp-block-forward-c{c}"
            if sd in res.names(task, k) and sdp in res.names(task, k):
                for p in ("tokens", "flops"):
                    m, sd_std, n = paired(res, task, k, (sdp, "full"), (sd, "full"), p)
                    lines.append(f"`{sdp}` minus `{sd}` ({PROTOCOL_TITLES[p]}) {_diff(m, sd_std, n)} at "
                                 f"{_memory(res, task, k, sdp) / _memory(res, task, k, sd):.2f}× its memory")
                lines.append(f"for `{sdp}`'s assembled model the largest significant improvement is "
                             f"{_union_best(res, task, k, sdp)}")
        for protocol in ("tokens", "flops"):
            losers = _losers(res, task, k, protocol)
            lines.append(f"SDP runs that lose to a baseline ({PROTOCOL_TITLES[protocol]}): "
                         + (", ".join(losers) if losers else "none"))
        if "fsdp" in res.names(task, k):
            points = memory_points(res, task, k, "flops")
            budget = _memory(res, task, k, "fsdp") / MIB
            fits = [p for p in points if p[0] <= budget * (1 + 1e-9)]
            if fits:
                mem, loss, std, name = min(fits, key=lambda p: p[1])
                lines.append(f"within FSDP2's memory per rank ({budget:.2f} MiB) the lowest FLOP-matched loss is "
                             f"`{name}`'s, {loss:.3f} ± {std:.3f} at {mem:.2f} MiB")
        out.append(f"- **{task}, K = {k}**:")
        out += [f"  - {x.rstrip('.')}." for x in lines if x]
    out.append("")
    return "\n".join(out)


def verdict_section(res: Results) -> str:
    """The "Verdict" section: generated sentences per task and world size, then what is left to judge."""
    out = ["## Verdict (generated from the tables below)", ""]
    for task in res.tasks():
        for k in res.worlds(task):
            if "ddp" not in res.names(task, k):
                continue
            s = res.summary(task, k, "ddp", "tokens")
            c = res.cost(task, k, "ddp")
            out += [f"### {task}, K = {k}", "",
                    f"- DDP: loss {s['mean']:.3f} ± {s['std']:.3f} (n={s['n']}); per rank "
                    f"{(c['model_state'] + c['activations']) / MIB:.2f} MiB (model state {c['model_state'] / MIB:.2f}"
                    f" + activations {c['activations'] / MIB:.2f})."]
            out += [f"- {line}" for line in (_run_line(res, task, k, n) for n in res.names(task, k)
                                              if n != "ddp" and "+" not in n)]
            out += [f"- {line}" for line in (_best(res, task, k, p) for p in ("tokens", "flops", "seconds")) if line]
            for protocol in ("tokens", "flops"):
                table = _versus_table(res, task, k, protocol)
                if table:
                    out += ["", f"SDP against each baseline, {PROTOCOL_TITLES[protocol]} (W: less memory per rank "
                            "and not significantly worse; L: no less memory and significantly worse; Δ: SDP minus "
                            "the baseline, paired):", "", *table, ""]
            out += [f"- Which model to keep: {line}" for line in _union_gap(res, task, k)]
            out += [f"- Recommended by memory budget: {line}" for line in _recommendations(res, task, k)]
            out.append("")
    out += ["### Left for judgement", "",
            "The sentences above are computed; these are not, and need a reader of the tables:",
            "- the short verdict in words (where SDP wins, where it loses, what to recommend), written from the "
            "Summary and the tables, and the README's Results summary copied from it;",
            "- which union fix to make the documented default (the rule: the one with the largest significant "
            "improvement on both tasks and both coverages, if one clearly helps everywhere);",
            "- whether the regularities hold beyond these sizes (a 4-layer model, a few hundred steps, one "
            "learning rate for every method, no tuning per method);",
            "- how much the wall-time protocol says on a machine shared with other work (see the load averages "
            "in Setup).", ""]
    return "\n".join(out)

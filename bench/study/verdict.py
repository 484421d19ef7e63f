"""The verdict, written from the numbers: every sentence below is computed from the analysis
(analysis.py), so a reader can check each against a table. What numbers cannot settle is
listed apart, for a person to judge.

Δ is a paired difference in validation loss (run minus reference, per seed, then the mean);
[lo, hi] its simultaneous interval within the comparison's family and the label read off it
(stats.py). Memory is the metered peak of one whole step per rank.
"""
from __future__ import annotations

import math

from .analysis import KEEP_MODES, is_sdp
from .decision import fmt_delta, seeds_word
from .results import PROTOCOL_TITLES
from .stats import describe


def _counts(pe: dict) -> str:
    return f"{pe['tokens_x']:.2f}× DDP's tokens, {pe['steps_x']:.2f}× its optimizer steps"


def _split(e: dict) -> str:
    s = e["split"]
    return (f"model state {s['model_state']:.2f} + activations {s['activations']:.2f} + transient "
            f"{s['transient']:.2f}")


def families_section(a: dict) -> list[str]:
    """The families, their correction and what their seeds can detect, stated once."""
    lines = ["| family | question | comparisons m | interval (simultaneous, Bonferroni) | seeds | median sd of the "
             "paired differences | smallest difference detectable (80% power) | equivalence margin |",
             "|---|---|---|---|---|---|---|---|"]
    for f in a["families"]:
        margin = (f"{f['margin']:.3f} (tested)" if f["equivalence_tested"] else
                  f"not tested: the seeds cannot support {f['margin']:.3f}")
        lines.append(f"| {f['name']} | {f['question']} | {f['m']} | {100 * f['confidence']:.2f}% | {f['seeds']} | "
                     f"{_num(f['median_sd'])} | {_num(f['detectable'])} | {margin} |")
    return lines


def _num(v, digits=3) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def run_line(a: dict, name: str) -> str:
    """One run against DDP at every protocol, with its tokens, steps and memory."""
    e, parts = a["runs"][name], []
    for p in a["protocols"]:
        pe = e["protocols"].get(p)
        if pe is None:
            continue
        c = a["comparisons"].get((name, "full"), ("ddp", "full"), p)
        base = a["comparisons"].canonical(name, p)
        what = describe(c) if c else f"the loss of `{base}` (the same updates, the same mark)"
        parts.append(f"{PROTOCOL_TITLES[p]} {what}, {_counts(pe)}")
    return (f"`{name}`: " + "; ".join(parts) + f". Peak memory per rank {e['memory']:.2f}× DDP's ({_split(e)}, "
            "as shares of DDP's peak).")


def dense_lines(a: dict) -> list[str]:
    """Each SDP run against the smaller dense model of its per-rank size."""
    lines = []
    for name, control in a["controls"].items():
        if control is None:
            continue
        parts = []
        for p in a["protocols"]:
            c = a["comparisons"].get((name, "full"), (control, "full"), p)
            if c:
                parts.append(f"{PROTOCOL_TITLES[p]} {describe(c)}")
        ratio = a["runs"][name]["memory"] / a["runs"][control]["memory"]
        lines.append(f"`{name}` minus `{control}`: " + "; ".join(parts) + f" (memory {ratio:.2f}× the dense model's).")
    return lines


def keep_lines(a: dict, costs: dict) -> list[str]:
    """For each SDP run: every model a user could keep against its full model, with its inference cost."""
    lines = []
    for name in a["controls"]:
        parts = []
        for mode, title in KEEP_MODES:
            c = a["comparisons"].get((name, mode), (name, "full"), "tokens")
            if c:
                cost = costs.get(name, {}).get(mode)
                parts.append(f"{title} {describe(c)}" + (f" (inference {cost})" if cost else ""))
        if parts:
            lines.append(f"`{name}`, against its full model at equal tokens: " + "; ".join(parts) + ".")
    return lines


def decision_lines(rows: list[dict]) -> list[str]:
    """One sentence per budget row: SDP used, or which run instead and why."""
    lines = []
    for row in rows:
        if row["sdp_setting"]:
            lines.append(f"within {row['budget']:.2f}× DDP's memory: SDP, `{row['sdp_setting']}` (better or no worse "
                         "than the best option without SDP at equal tokens and at equal FLOPs).")
            continue
        if row["only_sdp"]:
            lines.append(f"within {row['budget']:.2f}× DDP's memory only SDP runs fit (`{row['use']}` is the best at "
                         "equal FLOPs); no run without SDP was measured at this memory, so nothing shows its quality "
                         "against an alternative: no recommendation.")
            continue
        why = []
        for p in ("tokens", "flops"):
            c = row[p]
            if c["sdp"] is None:
                why.append(f"at {PROTOCOL_TITLES[p]} no SDP run fits")
            elif c["delta"] is not None:
                why.append(f"at {PROTOCOL_TITLES[p]} the best SDP run `{c['sdp']['run']}` minus `{c['other']['run']}` "
                           f"Δ {fmt_delta(c['delta'])}")
        lines.append(f"within {row['budget']:.2f}× DDP's memory: use `{row['use']}`; " + "; ".join(why) + ".")
    return lines


def anchor_lines(anchor: dict) -> list[str]:
    """The recipe as published against nanoGPT's figure, and the study's DDP beside it."""
    lines = []
    for label, e in anchor.get("runs", {}).items():
        if e.get("n"):
            lines.append(f"{label}: {e['mean']:.3f} ± {_num(e['std'])} over {seeds_word(e['n'])} (range {e['min']:.3f}-"
                         f"{e['max']:.3f}); the mean is {e['mean'] - anchor['published']:+.3f} from nanoGPT's "
                         f"{anchor['published']:.2f}: {'within' if e['within'] else 'outside'} "
                         f"{anchor['tolerance']:.2f}.")
    return lines


def verdict_section(analyses: dict, summary: dict, costs: dict) -> str:
    """The "Verdict" section: the anchor, then per task the families, each run against DDP and its smaller dense
    model, which model to keep, the decision; then what is left to judge."""
    out = ["## Verdict (generated from the tables below)", "", "### The anchor: nanoGPT's recipe reproduced", ""]
    out += [f"- {line}" for line in anchor_lines(summary.get("anchor", {}))] or ["- not run in this profile"]
    out.append("")
    for (task, k), a in analyses.items():
        pe = a["ddp"]["protocols"]["tokens"]
        out += [f"### {task}, K = {k}", "", "Families of comparisons (each comparison belongs to one and carries its "
                "interval and label wherever it is shown; labels are read off the interval: better / worse when it "
                "excludes 0, no worse when it lies below the margin, else inconclusive):", "", *families_section(a), "",
                f"- DDP: loss {pe['loss']:.3f} ± {_num(pe['std'])} (mean ± sample std over {seeds_word(pe['n'])}); peak "
                f"memory per rank {a['ddp']['peak_mib']:.2f} MiB ({_split(a['ddp'])}, as shares of it)."]
        out += [f"- {run_line(a, n)}" for n in a["runs"]]
        out += [f"- Smaller dense model: {line}" for line in dense_lines(a)]
        out += [f"- Which model to keep: {line}" for line in keep_lines(a, costs.get(task, {}))]
        out += [f"- Decision, {line}" for line in decision_lines(summary["tasks"][task]["decision"])]
        out.append("")
    out += ["### Left for judgement", "",
            "The sentences above are computed; these are not, and need a reader of the tables:",
            "- whether the regularities hold beyond this benchmark (a 0.8 M-parameter GPT, 2,000 iterations, one "
            "learning rate for every method, no tuning per method);",
            "- whether a difference within the margin matters for a given use;",
            "- step times: measured with the ranks sharing the machine's cores, one configuration at a time, so they "
            "are reported but no protocol or verdict uses them on the CPU.", ""]
    return "\n".join(out)


def sdp_runs(a: dict) -> list[str]:
    """The SDP runs of an analysis that trained a trajectory of their own."""
    return [n for n, e in a["runs"].items() if is_sdp(n) and not e["config"].get("derived_from")]

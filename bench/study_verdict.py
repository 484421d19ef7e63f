"""The verdict, written from the numbers: every sentence below is computed from the analysis
(study_analysis.py), so a reader can check each against a table. What numbers cannot settle
is listed apart, for a person to judge.

Δ is a paired difference in validation loss (run minus reference, per seed, then the mean);
[lo, hi] its 95% confidence interval (Student's t over the seeds); the label comes from the
tests after Holm's correction over the comparison's family (study_stats.py): "worse" or
"better" (the difference is not zero), "no worse" (worse by less than the stated margin),
"inconclusive" (neither). Memory is the metered peak of one whole step per rank.
"""
from __future__ import annotations

from study_results import PROTOCOL_TITLES
from study_stats import describe

MARKS = {"better": "W", "no worse": "W", "worse": "L"}


def _counts(pe: dict) -> str:
    return f"{pe['tokens_x']:.2f}× DDP's tokens, {pe['steps_x']:.2f}× its optimizer steps"


def _split(e: dict) -> str:
    s = e["split"]
    return (f"model state {s['model_state']:.2f} + activations {s['activations']:.2f} + transient "
            f"{s['transient']:.2f}")


def run_line(a: dict, name: str) -> str:
    """One run against DDP at every protocol, with its tokens, steps and memory."""
    e, parts = a["runs"][name], []
    for p in a["protocols"]:
        pe = e["protocols"].get(p)
        if pe is None:
            continue
        c = a["vs_ddp"].get((name, p))
        what = describe(c) if c else f"the loss of `{e['config']['derived_from']}` (the same updates, the same mark)"
        parts.append(f"{PROTOCOL_TITLES[p]} {what}, {_counts(pe)}")
    return (f"`{name}`: " + "; ".join(parts) + f". Peak memory per rank {e['memory']:.2f}× DDP's ({_split(e)}, "
            "as shares of DDP's peak).")


def versus_table(a: dict, protocol: str) -> list[str]:
    """SDP runs (rows) against each baseline (columns): W (less memory and better or no worse),
    L (no less memory and worse) or · (neither), Δ [95% CI] of the SDP run minus the baseline, and
    the SDP run's memory relative to the baseline's."""
    cells = a["versus"].get(protocol, {})
    rows = list(dict.fromkeys(n for n, _ in cells))
    bases = list(dict.fromkeys(b for _, b in cells))
    if not rows:
        return []
    lines = ["| SDP run | " + " | ".join(f"vs {b}" for b in bases) + " |", "|---" * (len(bases) + 1) + "|"]
    for name in rows:
        out = []
        for b in bases:
            c, ratio = cells[(name, b)], a["runs"][name]["memory"] / a["runs"][b]["memory"]
            mark = MARKS.get(c["label"], "·") if (ratio < 1) == (c["label"] != "worse") else "·"
            out.append(f"{mark} {describe(c)}, {ratio:.2f}× mem")
        lines.append(f"| {name} | " + " | ".join(out) + " |")
    return lines


def design_lines(a: dict) -> list[str]:
    """The design questions (dense control, block assignment, stochastic depth), one sentence each."""
    lines = []
    for (question, x, y, p), c in a["design"].items():
        px, py = a["runs"][x]["protocols"].get(p), a["runs"][y]["protocols"].get(p)
        counts = "" if not (px and py) else (f" ({x}: {_counts(px)}; {y}: {_counts(py)}; memory "
                                             f"{a['runs'][x]['memory'] / a['runs'][y]['memory']:.2f}× {y}'s)")
        lines.append(f"{question}: `{x}` minus `{y}` at {PROTOCOL_TITLES[p]} {describe(c)}{counts}.")
    return lines


def assignment_sentence(a: dict) -> str | None:
    """Whether the evidence moves the planner's default block assignment (rolling) to contiguous."""
    found = {p: c for (q, *_, p), c in a["design"].items() if q == "assignment"}
    if not found:
        return None
    better = [p for p, c in found.items() if c["label"] == "better"]
    worse = [p for p, c in found.items() if c["label"] == "worse"]
    if better and not worse:
        return ("the contiguous block assignment is better than the default at " + ", ".join(
            PROTOCOL_TITLES[p] for p in better) + " and worse at none: the evidence favours it.")
    if worse and not better:
        return "the contiguous block assignment is worse than the default: the default (rolling) stands."
    return "the block assignment changes no loss detectably: the default (rolling) stands."


def keep_lines(a: dict) -> list[str]:
    """The assembled block-level model's gap to DDP and what each option changes, with its memory."""
    comps, lines = a["keep"]["comparisons"], []
    for name, options in a["keep"]["options"].items():
        parts = [f"`{name}`'s assembled model vs DDP {describe(comps[(name, 'union', 'ddp')])}"]
        for label, run in options.items():
            gain, to_ddp = comps[(name, label, "union")], comps[(name, label, "ddp")]
            part = f"{label}: change {describe(gain)}, vs DDP {describe(to_ddp)}"
            if run != name:
                e, fwd = a["runs"][run], a["runs"][name]
                part += (f"; its peak memory per rank is {e['memory']:.2f}× DDP's, {e['memory'] / fwd['memory']:.2f}×"
                         f" the forward run's")
            parts.append(part)
        lines.append("; ".join(parts) + ".")
    return lines


def checkpointing_lines(a: dict) -> list[str]:
    """What activation checkpointing adds to each SDP run: memory and FLOPs, the loss unchanged."""
    lines = []
    for name, e in a["runs"].items():
        base = e["config"].get("derived_from")
        if not (base and e["config"].get("activation_checkpointing") and base in a["runs"]):
            continue
        b = a["runs"][base]
        flops = e["protocols"].get("flops", {})
        lines.append(f"`{name}` (`{base}` with checkpointing): peak memory {e['memory']:.2f}× DDP's against "
                     f"{b['memory']:.2f}× without; the same loss at equal tokens; at equal FLOPs it takes "
                     f"{flops.get('steps_x', float('nan')):.2f}× DDP's steps (recomputation costs FLOPs).")
    return lines


def verdict_section(analyses: dict) -> str:
    """The "Verdict" section from {(task, K): analysis}: generated sentences, then what is left to judge."""
    out = ["## Verdict (generated from the tables below)", ""]
    for (task, k), a in analyses.items():
        d = a["ddp"]
        pe = d["protocols"]["tokens"]
        out += [f"### {task}, K = {k}", "",
                f"Families and their sizes (Holm's correction within each): "
                + ", ".join(f"{f} m = {m}" for f, m in a["families"].items())
                + f"; \"no worse\" means worse by less than {a['margin']} (declared before the runs).", "",
                *([f"**{pe['n']} seeds only: the verdict needs at least 5; read this report as a check of the "
                   "pipeline, not as evidence.**", ""] if pe["n"] < 5 else []),
                f"- DDP: loss {pe['loss']:.3f} ± {pe['std']:.3f} (mean ± sample std over {pe['n']} seeds); peak "
                f"memory per rank {d['peak_mib']:.2f} MiB ({_split(d)}, as shares of it)."]
        out += [f"- {run_line(a, n)}" for n in a["runs"] if not a["runs"][n]["config"].get("phase_of")]
        for p in a["protocols"]:
            table = versus_table(a, p)
            if table:
                out += ["", f"SDP against each baseline, {PROTOCOL_TITLES[p]} (W: less memory per rank and better or "
                        "no worse; L: no less memory and worse; ·: neither; Δ: SDP minus the baseline, paired, "
                        "[95% CI]):", "", *table, ""]
        out += [f"- {line}" for line in design_lines(a)]
        sentence = assignment_sentence(a)
        if sentence:
            out.append(f"- Block assignment: {sentence}")
        out += [f"- Which model to keep: {line}" for line in keep_lines(a)]
        out += [f"- Checkpointing with SDP: {line}" for line in checkpointing_lines(a)]
        out.append("")
    out += ["### Left for judgement", "",
            "The sentences above are computed; these are not, and need a reader of the tables:",
            "- whether the regularities hold beyond these sizes (a 16-block model of 0.8 M parameters, a few hundred "
            "steps, far less than one epoch, one learning rate for every method, no tuning per method);",
            "- whether a difference within the margin matters for a given use;",
            "- step times: measured with the ranks sharing the machine's cores, one configuration at a time, so they "
            "are reported but no protocol or verdict uses them on the CPU.", ""]
    return "\n".join(out)

"""The study's report: Markdown tables, plots and the generated verdict, from the results.

Every number in the report is read from the result JSONs (study_results.py) through the
analysis (study_analysis.py); nothing is typed in. Loss is validation cross-entropy in nats
(per character on pysrc, per sample on digits), of the full model unless a column says
otherwise. Beside the report goes summary.json (study_decision.py), which the README's and
the results page's generated blocks are rendered from.
"""
from __future__ import annotations

import glob
import json
import math
import os

from study_analysis import analyse
from study_results import PROTOCOL_TITLES, Results
from study_runs import EQUIVALENCE_MARGIN
from study_stats import describe

MIB = 2 ** 20
TASK_TITLES = {"pysrc": "Python sources, character-level GPT", "digits": "digits, residual MLP (the demo's task)"}


def fmt(v, digits=3, sign=False) -> str:
    """A number for a table ("n/a" for None or nan)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}"


def pm(mean, std, digits=3) -> str:
    """mean ± sample standard deviation over seeds."""
    return f"{fmt(mean, digits)} ± {fmt(std, digits)}"


def _span(steps: list[int]) -> str:
    return "n/a" if not steps else (str(steps[0]) if min(steps) == max(steps) else f"{min(steps)}-{max(steps)}")


def quality_table(res: Results, a: dict, task: str, k: int) -> str:
    """Full-model loss (mean ± std over seeds), Δ to DDP [95% CI] (label), tokens and steps x DDP's at each
    protocol's mark."""
    head = "| run | " + " | ".join(f"{PROTOCOL_TITLES[p]}: loss | Δ vs ddp [95% CI] | tokens, steps ×ddp | mark step"
                                   for p in a["protocols"]) + " | seeds |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name in ["ddp", *a["runs"]]:
        e = a["ddp"] if name == "ddp" else a["runs"][name]
        cells = []
        for p in a["protocols"]:
            pe = e["protocols"].get(p)
            if pe is None:
                cells.append("n/a | n/a | n/a | n/a")
                continue
            c = a["vs_ddp"].get((name, p))
            delta = "reference" if name == "ddp" else (describe(c) if c else f"= `{e['config']['derived_from']}`")
            cells.append(f"{pm(pe['loss'], pe['std'])} | {delta} | {pe['tokens_x']:.2f}, {pe['steps_x']:.2f} | "
                         f"{_span(res.steps_at(task, k, name, p))}")
        n = e["protocols"].get("tokens", {}).get("n", 0)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {n} |")
    lines += ["", "Δ: the run's loss minus DDP's, per seed, its mean and 95% confidence interval; the label after "
              f"Holm's correction over the \"vs ddp\" family (m = {a['families'].get('vs ddp', 0)}). \"= run\": a "
              "derived run, the same updates as that run (the same loss). Mark step: where each seed's mark fell."]
    return "\n".join(lines)


def keep_table(res: Results, task: str, k: int) -> str:
    """SDP runs at equal tokens: loss (mean ± std) of every model a user could keep."""
    modes = [("full", "full (union)"), ("full_scaled", "full, scaled by owner fraction"), ("ensemble", "ensemble"),
             ("subnetworks", "each rank's subnetwork: their mean; by rank 0 / 1 / ...")]
    sdp = [n for n in res.verdict_runs(task, k) if n.startswith("sdp-") and not res.config(task, k, n).get("derived_from")]
    head = "| run | " + " | ".join(t for _, t in modes) + " | final backward phase: full |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    phases = {res.config(task, k, n).get("phase_of"): n for n in res.names(task, k) if res.config(task, k, n).get("phase_of")}
    for name in sdp:
        cells = []
        for mode, _ in modes:
            s = res.summary(task, k, name, "tokens", mode)
            cells.append("n/a" if s["n"] == 0 else pm(s["mean"], s["std"]))
        cells[-1] += "; " + " / ".join(fmt(v) for v in res.subnetwork_losses(task, k, name, "tokens"))
        s = res.summary(task, k, phases[name], "tokens") if name in phases else {"n": 0}
        cells.append("—" if s["n"] == 0 else pm(s["mean"], s["std"]))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cost_table(res: Results, task: str, k: int) -> str:
    """The metered peak per rank and its split, the model state held, communication, FLOPs and step time."""
    base = res.cost(task, k, "ddp")
    head = ("| run | peak MiB/rank | ×ddp | at the peak: model state / activations / transient MiB | peak during "
            "| model state held MiB (params / grads / optimizer) | peak RSS MiB | comm MiB/step | collectives/step "
            "| FLOPs/step ×ddp | step ms (not a protocol) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name in res.names(task, k):
        c = res.cost(task, k, name)
        lines.append(
            f"| {name} | {c['peak'] / MIB:.3f} | {c['peak'] / base['peak']:.2f} "
            f"| {c['model_state'] / MIB:.3f} / {c['activations'] / MIB:.3f} / {c['transient'] / MIB:.3f} "
            f"| {c['peak_phase']} | {c['held_model_state'] / MIB:.3f} ({c['parameters'] / MIB:.3f} / "
            f"{c['gradients'] / MIB:.3f} / {c['optimizer_state'] / MIB:.3f}) | {c['peak_rss'] / MIB:.0f} "
            f"| {(c['comm_bytes_per_step'] or 0) / MIB:.3f} | {fmt(c['collectives_per_step'], 1)} "
            f"| {c['step_flops'] / base['step_flops']:.2f} | {1e3 * c['step_time_s']:.1f} |")
    sources = sorted({res.cost(task, k, n)["comm_source"] for n in res.names(task, k)})
    lines += ["", "Peak: StepMemoryMeter's peak of live tensor storage over one whole step, the worst rank over every "
              "seed (see Setup), split at that moment; \"peak during\" says which part of the step it fell in. Model "
              "state held: parameters, gradients and optimizer state after the step (the largest over the run). Peak "
              "RSS: the process's high-water mark over the configuration (torch's own footprint included). "
              "Communication: bytes handed to collectives per step (" + "; ".join(sources) + "). Step time: the "
              "slowest rank's median, measured with four ranks sharing the cores; reported, used by no protocol."]
    return "\n".join(lines)


def assignment_table(res: Results, task: str, k: int) -> str:
    """Which blocks each rank trains in every block-level SDP run, and what that covers together."""
    from subnet_ext.planning.assign import block_pairs_covered
    import torch

    lines = ["| run | blocks of rank 0 / 1 / 2 / 3 | adjacent pairs trained together | pairs trained together |",
             "|---|---|---|---|"]
    for name in res.names(task, k):
        plan = res.get(task, k, res.seeds(task, k, name)[0], name).get("plan")
        if not plan or plan["level"] != "block" or res.config(task, k, name).get("derived_from"):
            continue
        cover = block_pairs_covered(torch.tensor(plan["owners"], dtype=torch.bool))
        ranks = " / ".join("{" + ",".join(map(str, r)) + "}" for r in cover["per_rank"])
        lines.append(f"| {name} | {ranks} | {cover['adjacent']} of {cover['adjacent_total']} | {cover['pairs']} of "
                     f"{cover['pairs_total']} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def accuracy_table(res: Results, task: str, k: int) -> str:
    """Classification tasks: accuracy at equal tokens of the full model and the ensemble (mean ± std)."""
    lines = ["| run | test acc % (full) | test acc % (ensemble) |", "|---|---|---|"]
    for name in res.names(task, k):
        s = res.summary(task, k, name, "tokens", "full", "accuracy")
        e = res.summary(task, k, name, "tokens", "ensemble", "accuracy")
        lines.append(f"| {name} | {pm(100 * s['mean'], 100 * s['std'], 2)} "
                     f"| {'n/a' if e['n'] == 0 else pm(100 * e['mean'], 100 * e['std'], 2)} |")
    return "\n".join(lines)


def _task_sections(res: Results, analyses: dict, folder: str, doc: str) -> tuple[list[str], list[str]]:
    from study_plots import plot_curves, plot_memory_vs_loss

    parts, written = [], []
    for (task, k), a in analyses.items():
        parts += [f"## {task}: {TASK_TITLES.get(task, task)}", "", f"### {task}, K = {k} ranks", "",
                  "Quality (full model) at each protocol's mark:", "", quality_table(res, a, task, k), "",
                  "Which model to keep (SDP runs, equal tokens; loss, mean ± std):", "", keep_table(res, task, k), ""]
        table = assignment_table(res, task, k)
        if table:
            parts += ["Which blocks each rank trains (the plan of seed 0; ranks relabelled by the seed):", "", table, ""]
        if task == "digits":
            parts += ["Accuracy at equal tokens:", "", accuracy_table(res, task, k), ""]
        parts += ["Costs per rank:", "", cost_table(res, task, k), ""]
        for path in plot_curves(res, task, k, folder) + plot_memory_vs_loss(res, a, task, k, folder):
            written.append(path)
            parts.append(f"![{os.path.basename(path)}]({os.path.relpath(path, os.path.dirname(doc) or '.')})")
        parts.append("")
    return parts, written


def write_report(out: str, doc: str, record_path: str, blocks: dict | None = None) -> list[str]:
    """Write `doc`, its plots and summary.json (in a folder named after it) from <out>/results; with
    `blocks` ({path of a Markdown file: link to the report from it}), rewrite their generated blocks
    (and the README example's SDP setting). Returns the paths written."""
    import study_decision as decision
    from study_verdict import verdict_section

    res = Results(out)
    record = json.load(open(record_path)) if os.path.exists(record_path) else {}
    folder = os.path.splitext(doc)[0]
    os.makedirs(folder, exist_ok=True)
    analyses = {(t, k): analyse(res, t, k, EQUIVALENCE_MARGIN.get(t, 0.02)) for t in res.tasks() for k in res.worlds(t)
                if "ddp" in res.names(t, k)}
    summary = decision.summary(analyses, record, doc)
    summary_path = os.path.join(folder, "summary.json")
    decision.write_summary(summary_path, summary)
    title = os.path.basename(folder)
    parts = [f"# The study: when SDP beats DDP, FSDP2, activation checkpointing and stochastic depth ({title})", "",
             "Generated by `bench/study.py` from its results; every number below is measured in the run this file "
             "records. Loss: validation cross-entropy (nats per character on pysrc, per sample on digits) of the full "
             "model unless a column says otherwise.", "", "## Should I use SDP? (generated)", "",
             decision.render_block(summary, os.path.basename(doc), os.path.relpath(summary_path, os.path.dirname(doc)
                                                                                  or ".")), ""]
    from study_setup import setup_section

    parts += [setup_section(res, record), verdict_section(analyses)]
    sections, written = _task_sections(res, analyses, folder, doc)
    with open(doc, "w") as f:
        f.write("\n".join(parts + sections) + "\n")
    written = [doc, summary_path, *written]
    for stale in glob.glob(os.path.join(folder, "*.png")):  # plots of runs this report no longer has
        if stale not in written:
            os.remove(stale)
    for path, link in (blocks or {}).items():
        written.append(update_block(path, summary, link, os.path.relpath(summary_path, os.path.dirname(path) or ".")))
    return written


def update_block(path: str, summary: dict, report_link: str, source: str) -> str:
    """Rewrite the generated block of the Markdown file `path` from `summary` (and in a README, the example's
    SDP setting: the recommendation of the first task)."""
    import study_decision as decision

    with open(path) as f:
        text = f.read()
    readme = os.path.basename(path) == "README.md"  # the README is short: the main task only
    text = decision.replace_block(text, decision.render_block(summary, report_link, source, first_task_only=readme))
    rec = next(iter(summary["tasks"].values()), {}).get("recommended")
    if rec and readme:
        text = decision.rewrite_example(text, rec)
    with open(path, "w") as f:
        f.write(text)
    return path

"""The study's report: Markdown tables, plots and the generated verdict, from the results.

Every number in the report is read from the result JSONs (results.py) through the analysis
(analysis.py); nothing is typed in. Loss is validation cross-entropy in nats per character over
every window of Tiny Shakespeare's validation split, of the full model unless a column says
otherwise. Beside the report goes summary.json (decision.py), which the README's and the results
page's generated blocks are rendered from. Its parts: the setup (setup_section), the anchor
(anchor_summary, anchor_table), the verdict (verdict.py), and per task the quality, which-model,
assignment and cost tables, the plots (plots.py).
"""
from __future__ import annotations

import glob
import json
import math
import os
import statistics

from .analysis import analyse, nan_to_none
from .results import PROTOCOL_TITLES, Results
from .runs import (EQUIVALENCE_MARGIN, LEVELS, MAIN_K, MAIN_TASK, MEMORY_TASK, SCHEDULES, best_schedules,
                   schedule_name, seed_mean)
from .stats import describe

MIB = 2 ** 20
TASK_TITLES = {"shakespeare": "Tiny Shakespeare, nanoGPT's CPU recipe (4 blocks)",
               "shakespeare-deep": "Tiny Shakespeare, the same recipe with 8 blocks"}
PUBLISHED, TOLERANCE = 1.88, 0.05  # nanoGPT's README: "about 1.88"; the acceptance: within 0.05


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


def _task_line(task: str, sizes: dict) -> str:
    from subnet_ext.data.shakespeare import load_tiny_shakespeare
    from subnet_ext.models.gpt import GPT_PRESETS

    d = load_tiny_shakespeare().describe()
    cfg = GPT_PRESETS[sizes["preset"]]
    held_out = (f"every window of {sizes['seq_len']} characters of the validation split" if not sizes["eval_sequences"]
                else f"{sizes['eval_sequences']} windows evenly spaced over the validation split")
    return (f"- **{task}**: GPT `{sizes['preset']}` preset (subnet_ext/models/gpt.py: {cfg.n_layer} pre-LN blocks x "
            f"{cfg.n_embd}, {cfg.n_head} heads, context {cfg.block_size}, no biases, tied embedding, GPT-2 "
            f"initialisation, {cfg.num_parameters() / 1e6:.2f} M parameters); Tiny Shakespeare "
            f"({d['characters']['train']:,} training / {d['characters']['val']:,} validation characters, nanoGPT's "
            f"split, vocabulary {d['vocab_size']}, SHA-256 {d['sha256'][:16]}…); held out: {held_out}. "
            f"{sizes['batch_size']} sequences of {sizes['seq_len']} characters per rank per iteration "
            f"({MAIN_K * sizes['batch_size']} over the ranks, the recipe's); DDP's equal-tokens mark at "
            f"{sizes['steps']} iterations; AdamW (betas 0.9, {sizes['beta2']}), peak lr {sizes['lr']} (linear warmup "
            f"{sizes['warmup_steps']} iterations), weight decay {sizes['weight_decay']} on {sizes['decay']}, gradient "
            f"clipping {sizes['grad_clip']} (SDP: the synchronised gradient's norm); the stable trajectory evaluated "
            f"every {sizes['eval_every']} iterations (full model), every model a user could keep at each mark.")


def setup_section(res: Results, record: dict) -> str:
    """Commit, command, machine, seeds, corpus, sizes, protocols and the meter of the run the report comes from."""
    profile = record.get("profile", {})
    start, end = record.get("machine_at_start", {}), record.get("machine_at_end", {})
    lines = ["## Setup", "",
             f"- Command: `{record.get('command', 'python -m bench.study')}` (profile `{profile.get('name')}`), commit "
             f"`{start.get('commit')}`{' (with uncommitted changes)' if start.get('dirty') else ''}; wall time of "
             f"this invocation {record.get('seconds', 0) / 60:.1f} min.",
             f"- Machine: {start.get('cpu')}, {start.get('cores')} cores, {start.get('platform')}; Python "
             f"{start.get('python')}, torch {start.get('torch')}; load average at start {start.get('load_average')}, "
             f"at end {end.get('load_average')}.",
             f"- CPU time of the configurations (every rank's process time, summed): {res.cpu_seconds() / 60:.1f} "
             "core-minutes.",
             f"- Seeds: {_seeds(record.get('seeds'))}, K = {MAIN_K} ranks. \"a ± b\" is a mean over seeds ± the sample standard "
             "deviation of the per-seed values; Δ is the mean paired difference (per seed, the run minus the "
             "reference of that seed) with its simultaneous interval [lo, hi] within its family (Verdict)."]
    lines += [_task_line(task, sizes) for task, sizes in profile.get("tasks", {}).items() if task in res.tasks()]
    lines += [
        "- Protocols (bench/study/runs.py): *equal tokens* reads a run at the step where its training tokens "
        "reach DDP's; *equal FLOPs* at the first step where its FLOPs (counted by torch's FlopCounterMode on a real "
        "step, summed over ranks) reach DDP's. Every mark is read after a cooldown: a branch from the stable "
        f"trajectory {profile.get('cooldown', 0):.0%} of the mark's steps before it, the learning rate decaying "
        "linearly from the peak to 1/d of it over those d steps (warmup-stable-decay), for every method alike. The "
        "anchor runs the recipe's own cosine schedule instead. Wall time is not a protocol on these CPUs (the ranks "
        "share the cores).",
        "- Derived runs (`fsdp`, `ddp-ac`, `sdp-*-ac-*`) compute the same updates as the run named in their row "
        "(FSDP2 and checkpointing change where tensors live, not the arithmetic; the CI test checks that they train "
        "DDP's model): their loss is that run's trajectory read at their own marks (equal FLOPs differs: "
        "checkpointing recomputes), and their memory, FLOPs and communication are measured on "
        f"{profile.get('measure_steps')} steps of their own.",
        "- Memory: subnet_ext.measure.step_memory.StepMemoryMeter over one whole step (forward, backward, "
        "optimizer) of every run, the same code for every method: live tensor storage followed through the "
        "dispatcher (allocations, frees, FSDP2's storage resizes), its peak split into model state (parameters, "
        "gradients, optimizer state, buffers), activations (tensors autograd saved for backward, never a "
        "parameter or a view of one) and transient (gathered parameters, gradient and communication buffers, "
        "recomputed activations, temporaries). The worst rank, metered on its third step (stochastic depth: on the "
        "step that keeps the most blocks before its first mark). Not counted: memory that is not a tensor "
        "(allocator overhead, torch's own footprint: see peak RSS, and the bf16 measurement).", ""]
    return "\n".join(lines)


def _seeds(seeds) -> str:
    if isinstance(seeds, dict):
        return "; ".join(f"{task}: {v}" for task, v in seeds.items())
    return str(seeds)


def anchor_summary(res: Results) -> dict:
    """The recipe as published (one process, and MAIN_K ranks) and the study's DDP, each against nanoGPT's
    figure: {"published", "tolerance", "runs": {label: {"mean", "std", "n", "min", "max", "within"}}}."""
    out = {"published": PUBLISHED, "tolerance": TOLERANCE, "runs": {}}
    for label, k, name in ((f"the recipe in one process ({MAIN_K * 3} sequences per iteration)", 1, "recipe"),
                           (f"the recipe on {MAIN_K} ranks (3 sequences each)", MAIN_K, "recipe"),
                           (f"the study's DDP (warmup-stable-decay, {MAIN_K} ranks)", MAIN_K, "ddp")):
        values = [v for s in res.seeds(MAIN_TASK, k, name)
                  if (v := res.value(MAIN_TASK, k, s, name, "tokens")) is not None]
        if values:
            mean = statistics.fmean(values)
            out["runs"][label] = {"mean": mean, "std": statistics.stdev(values) if len(values) > 1 else math.nan,
                                  "n": len(values), "min": min(values), "max": max(values),
                                  "within": abs(mean - PUBLISHED) <= TOLERANCE, "k": k, "run": name}
    return nan_to_none(out)


def per_seed_values(res: Results) -> dict:
    """{task: {"K<k>/<run>": {protocol: {model: [value per seed]}}}} for summary.json."""
    out = {}
    for (task, k, seed, name), r in sorted(res.runs.items()):
        for protocol, point in r["marks"].items():
            models = dict(point.get("loss", {}))
            if point.get("subnetworks"):
                models["subnetworks"] = point["subnetworks"]["loss"]
            slot = out.setdefault(task, {}).setdefault(f"K{k}/{name}", {}).setdefault(protocol, {})
            for model, value in models.items():
                slot.setdefault(model, {})[str(seed)] = value
    return out


def quality_table(res: Results, a: dict, task: str, k: int) -> str:
    """Full-model loss (mean ± std over seeds), Δ to DDP [interval] (label), tokens and steps x DDP's at each
    protocol's mark."""
    head = "| run | " + " | ".join(f"{PROTOCOL_TITLES[p]}: loss | Δ vs ddp | tokens, steps ×ddp | mark step"
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
            c = None if name == "ddp" else a["comparisons"].get((name, "full"), ("ddp", "full"), p)
            delta = ("reference" if name == "ddp" else
                     describe(c) if c else f"= `{a['comparisons'].canonical(name, p)}`")
            cells.append(f"{pm(pe['loss'], pe['std'])} | {delta} | {pe['tokens_x']:.2f}, {pe['steps_x']:.2f} | "
                         f"{_span(res.steps_at(task, k, name, p))}")
        n = e["protocols"].get("tokens", {}).get("n", 0)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {n} |")
    lines += ["", "Δ: the run's loss minus DDP's, per seed, its mean and simultaneous interval, labelled in its family "
              "(Verdict). \"= run\": the same updates as that run, read at the same step (the same loss). Mark step: "
              "where each seed's mark fell."]
    return "\n".join(lines)


def inference_costs(res: Results, task: str, k: int) -> dict:
    """{SDP run: {model: "P× parameters, F× FLOPs of the full model"}} from the plan of its first seed (each
    subnetwork's share of the full model's parameters and forward FLOPs, as the planner traced them)."""
    out = {}
    for name in res.verdict_runs(task, k):
        r = res.get(task, k, res.seeds(task, k, name)[0], name)
        plan = r.get("plan") or {}
        if not plan.get("flops_fraction") or res.config(task, k, name).get("derived_from"):
            continue
        flops, params = plan["flops_fraction"], plan["params_fraction"]
        losses = res.subnetwork_losses(task, k, name, "tokens")
        best = min(range(len(losses)), key=losses.__getitem__) if losses else 0
        out[name] = {"full": "1.00× parameters, 1.00× FLOPs", "full_scaled": "1.00× parameters, 1.00× FLOPs",
                     "ensemble": f"1.00× parameters (the subnetworks share them), {sum(flops):.2f}× FLOPs",
                     "best_subnetwork": f"{params[best]:.2f}× parameters, {flops[best]:.2f}× FLOPs (rank {best})"}
    return out


def keep_table(res: Results, task: str, k: int, costs: dict) -> str:
    """SDP runs at equal tokens: loss (mean ± std) of every model a user could keep, and its inference cost."""
    modes = [("full", "full (union)"), ("full_scaled", "full, scaled by owner fraction"), ("ensemble", "ensemble"),
             ("best_subnetwork", "best single subnetwork"), ("subnetworks", "each rank's subnetwork: mean; rank 0 / 1 / ...")]
    sdp = [n for n in res.verdict_runs(task, k) if n.startswith("sdp-") and not res.config(task, k, n).get("derived_from")]
    head = "| run | " + " | ".join(t for _, t in modes) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name in sdp:
        cells = []
        for mode, _ in modes:
            s = res.summary(task, k, name, "tokens", mode)
            cells.append("n/a" if s["n"] == 0 else pm(s["mean"], s["std"]))
        cells[-1] += "; " + " / ".join(fmt(v) for v in res.subnetwork_losses(task, k, name, "tokens"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Cost at inference, as a share of the full model's parameters and forward FLOPs (from the plan):", "",
              "| run | full, scaled | ensemble of the K subnetworks | best single subnetwork |", "|---|---|---|---|"]
    for name, c in costs.items():
        lines.append(f"| {name} | {c['full']} | {c['ensemble']} | {c['best_subnetwork']} |")
    lines += ["", "The best single subnetwork is chosen on the validation loss it is reported on (a slight optimism)."]
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
    from subnet_ext.planning.assignment.assign import block_pairs_covered
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


def memory_table(res: Results, task: str) -> str:
    """The bf16 measurement: each method's metered peak per rank and its model-state share, beside the process's
    peak RSS and the RSS it added over the configuration, all against DDP's."""
    from .runs import PROFILES

    sizes = PROFILES["full"]["tasks"][task]
    base = res.cost(task, MAIN_K, "ddp")
    lines = [f"GPT `{sizes['preset']}` preset, micro-batch {sizes['batch_size']} x {sizes['seq_len']} per rank, "
             f"{sizes['precision']} autocast (fp32 parameters and AdamW state), K = {MAIN_K}; a few metered steps per "
             "method (no training run).", "",
             "| run | metered peak MiB/rank | ×ddp | model state share of its peak | peak RSS MiB | ×ddp | RSS added "
             "over the configuration MiB | ×ddp |", "|---|---|---|---|---|---|---|---|"]
    for name in res.names(task, MAIN_K):
        c = res.cost(task, MAIN_K, name)
        added, base_added = c["rss_added"], base["rss_added"]
        lines.append(f"| {name} | {c['peak'] / MIB:.2f} | {c['peak'] / base['peak']:.2f} | "
                     f"{c['model_state'] / c['peak']:.2f} | {c['peak_rss'] / MIB:.0f} | "
                     f"{c['peak_rss'] / base['peak_rss']:.2f} | {fmt(added / MIB, 1)} | "
                     f"{fmt(added / base_added if base_added else math.nan, 2)} |")
    lines += ["", "Peak RSS is the process's high-water mark while the configuration ran (torch's own libraries "
              "included, the same in every process); the RSS added is that mark minus the process's resident size "
              "when the configuration started: the memory this method took on top of what was there."]
    return "\n".join(lines)


def schedules_table(per_seed: dict) -> str:
    """The ownership schedules of the sweep beside their level's static run: full-model loss at equal tokens
    (mean ± std over seeds) and its difference to the static run's mean; the best of each level, when it
    beats the static run, marked (runs.best_schedules: what BEST_SCHEDULES must be)."""
    chosen = {schedule_name(*e) for e in best_schedules(per_seed)}
    lines = ["| level | run | assignment | full model loss | − static | seeds | chosen |", "|---|---|---|---|---|---|---|"]
    for level in LEVELS:
        static = f"sdp-{level}-forward-c0.5"
        rows = [(static, "static, balanced")] + [(schedule_name(*e), f"{e[1]} every {e[2]}, {e[3]}" if e[1] != "static"
                                                  else f"static, {e[3]}") for e in SCHEDULES if e[0] == level]
        base = per_seed.get(f"K{MAIN_K}/{static}", {}).get("tokens", {}).get("full", {})
        base_mean = statistics.mean(base.values()) if base else None
        for name, what in rows:
            values = list(per_seed.get(f"K{MAIN_K}/{name}", {}).get("tokens", {}).get("full", {}).values())
            if not values:
                continue
            sd = statistics.stdev(values) if len(values) > 1 else float("nan")
            delta = "—" if name == static or base_mean is None else f"{statistics.mean(values) - base_mean:+.3f}"
            lines.append(f"| {level} | `{name}` | {what} | {pm(statistics.mean(values), sd)} | {delta} | {len(values)} | "
                         f"{'**yes**' if name in chosen else ''} |")
    return "\n".join(lines)


def schedules_distance(per_seed: dict, margin: float) -> list[str]:
    """Sentences on how far each level's best SDP run (static or moving, lowest mean full-model loss at equal
    tokens) stays from DDP, against `margin`, and where the loss is lost: its full model beside the mean of
    the ranks' own subnetworks and their ensemble (what each rank trained, and the K of them together)."""
    ddp = seed_mean(per_seed, "ddp")
    if ddp is None:
        return []
    out = []
    for level in LEVELS:
        names = [f"sdp-{level}-forward-c0.5"] + [schedule_name(*e) for e in SCHEDULES if e[0] == level]
        measured = {n: loss for n in names if (loss := seed_mean(per_seed, n)) is not None}
        if not measured:
            continue
        best = min(measured, key=measured.get)
        gap = measured[best] - ddp
        subs, ens = seed_mean(per_seed, best, "subnetworks"), seed_mean(per_seed, best, "ensemble")
        verdict = "within" if gap <= margin else "not within"
        line = (f"- {level} level: the best run, `{best}`, is {gap:+.3f} from DDP's full model at equal tokens, "
                f"{verdict} the {margin:.2f} goal")
        if subs is not None and ens is not None:
            line += f"; its ranks' own subnetworks reach {subs:.3f} on average and their ensemble {ens:.3f}"
            if max(subs, ens) < measured[best]:  # each part is better than the whole the ranks never ran
                line += (": the loss is lost where the full model puts together units that each rank trained only "
                         "inside its own subnetwork (no rank runs the full model)")
        out.append(line + ".")
    return out


def anchor_table(anchor: dict) -> str:
    """The recipe as published and the study's DDP against nanoGPT's figure."""
    lines = ["| run | validation loss (mean ± std) | seeds | range | mean minus nanoGPT's | within the tolerance |",
             "|---|---|---|---|---|---|",
             f"| nanoGPT's README (CPU quick start) | about {anchor['published']:.2f} | — | — | — | — |"]
    for label, e in anchor["runs"].items():
        lines.append(f"| {label} | {pm(e['mean'], e['std'])} | {e['n']} | {e['min']:.3f}-{e['max']:.3f} | "
                     f"{e['mean'] - anchor['published']:+.3f} | {'yes' if e['within'] else 'no'} "
                     f"(±{anchor['tolerance']:.2f}) |")
    return "\n".join(lines)


def _task_sections(res: Results, analyses: dict, folder: str, doc: str, costs: dict) -> tuple[list[str], list[str]]:
    from .plots import plot_curves, plot_memory_vs_loss

    parts, written = [], []
    for (task, k), a in analyses.items():
        parts += [f"## {task}: {TASK_TITLES.get(task, task)}", "", f"### {task}, K = {k} ranks", "",
                  "Quality (full model) at each protocol's mark:", "", quality_table(res, a, task, k), "",
                  "Which model to keep (SDP runs, equal tokens; loss, mean ± std):", "",
                  keep_table(res, task, k, costs.get(task, {})), ""]
        table = assignment_table(res, task, k)
        if table:
            parts += ["Which blocks each rank trains (the plan of seed 0; ranks relabelled by the seed):", "", table, ""]
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
    from . import decision as decision
    from .verdict import verdict_section

    res = Results(out)
    record = json.load(open(record_path)) if os.path.exists(record_path) else {}
    folder = os.path.splitext(doc)[0]
    os.makedirs(folder, exist_ok=True)
    trained = [t for t in res.tasks() if not res.config(t, MAIN_K, "ddp").get("measure_only")] if res.runs else []
    analyses = {(t, MAIN_K): analyse(res, t, MAIN_K, EQUIVALENCE_MARGIN) for t in trained
                if "ddp" in res.names(t, MAIN_K)}
    anchor = anchor_summary(res)
    costs = {t: inference_costs(res, t, k) for t, k in analyses}
    summary = decision.summary(analyses, anchor, per_seed_values(res), record, doc)
    summary_path = os.path.join(folder, "summary.json")
    decision.write_summary(summary_path, summary)
    title = os.path.basename(folder)
    parts = [f"# The study on Tiny Shakespeare: which method to train with ({title})", "",
             "Generated by `python -m bench.study` from its results; every number below is measured in the run this "
             "file records. Loss: validation cross-entropy in nats per character over every window of the validation "
             "split, of the full model unless a column says otherwise.", "", "## Should I use SDP? (generated)", "",
             decision.render_block(summary, os.path.basename(doc), os.path.relpath(summary_path, os.path.dirname(doc)
                                                                                  or ".")), ""]
    parts += [setup_section(res, record)]
    if anchor["runs"]:
        parts += ["## The anchor: nanoGPT's published recipe", "", anchor_table(anchor), ""]
        path = _plot_anchor(res, folder)
        if path:
            parts += [f"![{os.path.basename(path)}]({os.path.relpath(path, os.path.dirname(doc) or '.')})", ""]
    parts += [verdict_section(analyses, summary, costs)]
    if res.runs and any(schedule_name(*e) in res.names(MAIN_TASK, MAIN_K) for e in SCHEDULES):
        per_seed = summary["tasks"].get(MAIN_TASK, {}).get("per_seed", {})
        parts += ["## Ownership that moves: the best schedule of each level", "",
                  "Equal tokens, forward regime, C = 0.5. A level's best schedule is kept (bench/study/runs.py "
                  "BEST_SCHEDULES, which a test checks against this file's summary.json) when its mean beats the "
                  "level's static run; the full study then trains it on every seed.", "", schedules_table(per_seed), "",
                  *schedules_distance(per_seed, EQUIVALENCE_MARGIN), ""]
    if MEMORY_TASK in res.tasks():
        parts += [f"## Memory a user would recognise ({MEMORY_TASK})", "", memory_table(res, MEMORY_TASK), ""]
    sections, written = _task_sections(res, analyses, folder, doc, costs)
    with open(doc, "w") as f:
        f.write("\n".join(parts + sections) + "\n")
    written = [doc, summary_path, *written]
    for stale in glob.glob(os.path.join(folder, "*.png")):  # plots of runs this report no longer has
        if stale not in written and not stale.endswith("anchor-curves.png"):
            os.remove(stale)
    for path, link in (blocks or {}).items():
        written.append(update_block(path, summary, link, os.path.relpath(summary_path, os.path.dirname(path) or ".")))
    return written


def _plot_anchor(res: Results, folder: str) -> str | None:
    from .plots import plot_anchor

    return plot_anchor(res, MAIN_TASK, folder, PUBLISHED)


def update_block(path: str, summary: dict, report_link: str, source: str) -> str:
    """Rewrite the generated block of the Markdown file `path` from `summary` (and in a README, the example's
    SDP setting: the recommendation of the first task, or the SDP run closest to one when there is none, which
    the README's text then says)."""
    from . import decision as decision

    with open(path) as f:
        text = f.read()
    readme = os.path.basename(path) == "README.md"  # the README is short: the main task only
    text = decision.replace_block(text, decision.render_block(summary, report_link, source, first_task_only=readme))
    task = next(iter(summary["tasks"].values()), {})
    chosen = task.get("recommended") or task.get("closest")  # the closest when the evidence supports none
    if chosen and readme:
        text = decision.rewrite_example(text, chosen)
    with open(path, "w") as f:
        f.write(text)
    return path

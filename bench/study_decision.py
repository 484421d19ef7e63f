"""The decision a user takes from the study, and the generated text that carries it outside the
report: the README's "Should I use SDP?" section, the study section of docs/results.md, and the
README example's SDP setting.

`decision(analysis)` reads the per-task analysis (study_analysis.py): for each memory budget per
rank (the peaks of the runs on a Pareto front, as multiples of DDP's), the lowest-loss run that
fits at equal tokens and at equal FLOPs, with its Δ to DDP, tokens and steps. `summary(...)` is
what `bench/study.py` writes beside the report (summary.json); every generated block is a pure
function of it (`render_block`), so a test regenerates them from the committed file and compares.
"""
from __future__ import annotations

import json
import math
import re

BEGIN, END = "<!-- study:begin", "<!-- study:end -->"
DECISION_PROTOCOLS = ("tokens", "flops")
TASK_WORDS = {"pysrc": "a 16-block GPT on the Python standard library's sources (characters)",
              "digits": "a residual MLP on scikit-learn's digits"}


def _delta(a: dict, name: str, protocol: str) -> dict:
    """{"mean", "lo", "hi", "label"} of a run's loss minus DDP's at a protocol (zero for DDP; a derived
    run at equal tokens has its base run's)."""
    if name == "ddp":
        return {"mean": 0.0, "lo": 0.0, "hi": 0.0, "label": "reference"}
    c = a["vs_ddp"].get((name, protocol))
    if c is None:  # a derived run read at its base run's mark: the base run's difference
        base = a["runs"][name]["config"]["derived_from"]
        return dict(_delta(a, base, protocol), via=base)
    return {key: c[key] for key in ("mean", "lo", "hi", "label")}


def _entry(a, name):
    return a["ddp"] if name == "ddp" else a["runs"][name]


def decision(a: dict) -> list[dict]:
    """Budget rows, largest first: {"budget": peak x DDP's, protocol: {"run", "memory", "loss", "delta",
    "tokens_x", "steps_x"}} with the lowest-loss run of at most that memory at each protocol."""
    names = ["ddp"] + [n for n, e in a["runs"].items() if not e["config"].get("phase_of")]
    memory = {n: (1.0 if n == "ddp" else a["runs"][n]["memory"]) for n in names}
    levels = {1.0}  # DDP's own memory first: what to use when memory is no constraint
    for p in DECISION_PROTOCOLS:
        points = [(memory[n], _entry(a, n)["protocols"][p]["loss"], n) for n in names if p in _entry(a, n)["protocols"]]
        levels |= {m for m, loss, _ in points if not any(m2 <= m and l2 < loss for m2, l2, _ in points)}
    rows = []
    for budget in sorted(levels, reverse=True):
        row = {"budget": budget}
        for p in DECISION_PROTOCOLS:
            fits = [n for n in names if memory[n] <= budget * (1 + 1e-9) and p in _entry(a, n)["protocols"]]
            if fits:
                best = min(fits, key=lambda n: _entry(a, n)["protocols"][p]["loss"])
                pe = _entry(a, best)["protocols"][p]
                row[p] = {"run": best, "memory": memory[best], "loss": pe["loss"], "delta": _delta(a, best, p),
                          "tokens_x": pe["tokens_x"], "steps_x": pe["steps_x"]}
        if not rows or any(row.get(p, {}).get("run") != rows[-1].get(p, {}).get("run") for p in DECISION_PROTOCOLS):
            rows.append(row)
    return rows


def recommended(a: dict, rows: list[dict]) -> dict:
    """The SDP setting to recommend: the SDP run chosen at the largest budget where one is chosen
    (equal FLOPs first, then equal tokens); if none is, the SDP run with the lowest loss at equal tokens."""
    def setting(name, why):
        cfg = a["runs"][name]["config"]
        return {"run": name, "why": why, "level": cfg["level"], "regime": cfg["regime"], "coverage": cfg["coverage"],
                "assignment": cfg.get("assignment") or "rolling",
                "activation_checkpointing": bool(cfg.get("activation_checkpointing"))}

    for row in rows:
        for p in ("flops", "tokens"):
            name = row.get(p, {}).get("run", "")
            if name.startswith("sdp-"):
                title = {"flops": "equal FLOPs", "tokens": "equal tokens"}[p]
                return setting(name, f"the lowest loss at {title} within {row['budget']:.2f}× DDP's memory")
    sdp = [n for n, e in a["runs"].items() if n.startswith("sdp-") and not e["config"].get("phase_of")
           and "tokens" in e["protocols"]]
    if not sdp:
        return {}
    best = min(sdp, key=lambda n: a["runs"][n]["protocols"]["tokens"]["loss"])
    return setting(best, "no SDP run is the lowest loss within any budget; this one is the closest at equal tokens")


def _jsonable(value):
    if isinstance(value, dict):
        return {("|".join(map(str, k)) if isinstance(k, tuple) else k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def summary(analyses: dict, record: dict, doc: str) -> dict:
    """What summary.json holds: the run's setup, and per task its analysis, decision rows and recommendation."""
    tasks = {}
    for (task, k), a in analyses.items():
        rows = decision(a)
        tasks[task] = {"K": k, "decision": rows, "recommended": recommended(a, rows), "analysis": a}
    start = record.get("machine_at_start", {})
    return _jsonable({"doc": doc, "profile": record.get("profile", {}).get("name"), "seeds": record.get("seeds"),
                      "minutes": record.get("seconds", 0) / 60, "commit": start.get("commit"),
                      "dirty": start.get("dirty"), "cores": start.get("cores"), "tasks": tasks})


def _fmt_delta(d: dict) -> str:
    if d.get("label") == "reference":
        return "0 (the reference)"
    if d.get("lo") is None or d["lo"] != d["lo"]:  # one seed: no interval
        return f"{d['mean']:+.3f} (one seed)" + (f", as `{d['via']}`" if d.get("via") else "")
    text = f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] ({d['label']})"
    return text + (f", as `{d['via']}`" if d.get("via") else "")


def decision_table(rows: list[dict]) -> list[str]:
    """The budget rows as a Markdown table."""
    lines = ["| memory per rank at most | same tokens as DDP: use (its memory) | its Δ loss | same FLOPs as DDP: use "
             "(its memory) | its Δ loss | its tokens, steps × DDP's (same FLOPs) |", "|---|---|---|---|---|---|"]
    for row in rows:
        cells = [f"{row['budget']:.2f}× DDP's"]
        for p in DECISION_PROTOCOLS:
            c = row.get(p)
            cells += [f"`{c['run']}` ({c['memory']:.2f}×)", _fmt_delta(c["delta"])] if c else ["—", "—"]
        f = row.get("flops")
        cells.append(f"{f['tokens_x']:.2f}, {f['steps_x']:.2f}" if f else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_block(summary_data: dict, report_link: str | None, source: str, first_task_only: bool = False) -> str:
    """The generated block (markers included): where the numbers come from, then per task (the first
    only, for the README) the budget table and the SDP setting it recommends."""
    lines = [f"{BEGIN}: generated by bench/study.py from {source}; do not edit by hand -->", ""]
    where = f"[the study]({report_link})" if report_link else f"the study (`{summary_data['doc']}`)"
    lines.append(f"From {where} (profile `{summary_data['profile']}`, {len(summary_data['seeds'])} "
                 f"seeds, {summary_data['minutes']:.1f} minutes on {summary_data['cores']} CPU cores). Memory is the "
                 "peak of one whole training step per rank (parameters, gradients, optimizer state and every tensor "
                 "alive at that moment) as a multiple of DDP's. For each budget: the method with the lowest mean loss "
                 "among those that fit, read at the same tokens as DDP and at the same FLOPs, each after a "
                 "learning-rate cooldown. Δ: its validation loss minus DDP's, with a 95% confidence interval over "
                 "seeds and the label of a test corrected for the number of comparisons (\"no worse\": within the "
                 "report's margin); the label compares it with DDP, not with the other methods that fit.")
    if summary_data["profile"] != "full":
        lines += ["", f"*Profile `{summary_data['profile']}` is a smaller check of the pipeline (fewer seeds, shorter "
                  "runs) than `make study`: not a basis for the decision.*"]
    for task, t in list(summary_data["tasks"].items())[:1 if first_task_only else None]:
        lines += ["", f"**{task}** ({TASK_WORDS.get(task, task)}, K = {t['K']} ranks):", ""]
        lines += decision_table(t["decision"])
        rec = t.get("recommended")
        if rec:
            extra = ", with activation checkpointing" if rec["activation_checkpointing"] else ""
            assign = f', block_assignment="{rec["assignment"]}"' if rec["assignment"] != "rolling" else ""
            lines += ["", f"SDP setting on this evidence: `level=\"{rec['level']}\", regime=\"{rec['regime']}\", "
                      f"coverage={rec['coverage']:g}{assign}`{extra} (`{rec['run']}`: {rec['why']})."]
    lines += ["", END]
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """`text` with its generated block replaced (ValueError when the markers are missing)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no generated block ({BEGIN} ... {END}) to replace")
    return text[:start] + block + text[end + len(END):]


def current_block(text: str) -> str | None:
    """The generated block of `text` (markers included), or None."""
    start, end = text.find(BEGIN), text.find(END)
    return None if start < 0 or end < start else text[start:end + len(END)]


def block_source(block: str) -> str:
    """The summary file a block names as its source."""
    return re.search(r"from (\S+); do not edit", block).group(1)


def rewrite_example(readme: str, rec: dict) -> str:
    """The README with its example's SDP setting (the plan's coverage and level, the wrapper's regime and
    the command line's flags) set to `rec`."""
    readme = re.sub(r'coverage=[0-9.]+, level="\w+"', f'coverage={rec["coverage"]:g}, level="{rec["level"]}"', readme)
    readme = re.sub(r'SubnetDataParallel\(model, plan, regime="\w+"\)',
                    f'SubnetDataParallel(model, plan, regime="{rec["regime"]}")', readme)
    return re.sub(r"--method sdp --level \w+ --regime \w+(\s+)--coverage [0-9.]+",
                  lambda m: f"--method sdp --level {rec['level']} --regime {rec['regime']}{m.group(1)}--coverage "
                            f"{rec['coverage']:g}", readme)


def example_setting(readme: str) -> dict:
    """{"level", "regime", "coverage"} the README example uses (plan call, wrapper, command line agree)."""
    plan = re.search(r'coverage=([0-9.]+), level="(\w+)"', readme)
    regime = re.search(r'SubnetDataParallel\(model, plan, regime="(\w+)"\)', readme)
    cli = re.search(r"--method sdp --level (\w+) --regime (\w+)\s+--coverage ([0-9.]+)", readme)
    return {"level": plan.group(2), "regime": regime.group(1), "coverage": float(plan.group(1)),
            "cli": (cli.group(1), cli.group(2), float(cli.group(3)))}


def write_summary(path: str, data: dict) -> None:
    """summary.json (tasks in the study's order: the generated blocks follow it)."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")

"""The decision a user takes from the study, and the generated text that carries it outside the
report: the README's "Should I use SDP?" section, the study section of docs/results.md, and the
README example's SDP setting.

`decision(analysis)` reads the per-task analysis (analysis.py): for each memory budget per rank
(multiples of DDP's peak), the best run without SDP and the best SDP run that fit, and their
comparison at equal tokens and at equal FLOPs (the "decision" family). SDP is recommended at a
budget only where its best run is better or no worse than the best option without SDP at both
protocols (the smaller dense models included); elsewhere the row says which run to use instead.
`summary(...)` is what the study writes beside the report (summary.json); every generated block is
a pure function of it (`render_block`), so a test regenerates them from the committed file.
"""
from __future__ import annotations

import json
import math
import re

from .analysis import PROTOCOLS_DECIDED, is_sdp

BEGIN, END = "<!-- study:begin", "<!-- study:end -->"
ACCEPT = ("better", "no worse")
# What a profile other than "full" leaves out, said where its block stands in for the study's.
PROFILE_NOTES = {"quick": "is a smaller check of the pipeline (fewer seeds, far shorter runs)",
                 "schedules": "is a narrower sweep, of ownership schedules (the recipe's length, but DDP, the "
                              "half-size dense models and SDP at C = 0.5 only: no FSDP2, checkpointing or "
                              "C = 0.25; fewer seeds)",
                 "cuda": "runs on GPUs, other machines"}
TASK_WORDS = {"shakespeare": "nanoGPT's Tiny Shakespeare at its published CPU recipe: a 4-block GPT, 0.8 M parameters",
              "shakespeare-deep": "the same recipe with 8 blocks"}


def _pick(a: dict, name: str | None, protocol: str) -> dict | None:
    if name is None:
        return None
    e = a["ddp"] if name == "ddp" else a["runs"][name]
    pe = e["protocols"][protocol]
    return {"run": name, "memory": e["memory"], "loss": pe["loss"], "std": pe["std"], "tokens_x": pe["tokens_x"],
            "steps_x": pe["steps_x"]}


def decision(a: dict) -> list[dict]:
    """Budget rows, largest first: {"budget", "use": run, "sdp_setting": run or None, "only_sdp": bool, protocol:
    {"other", "sdp" (each {"run", "memory", "loss", ...} or None), "delta" (SDP minus other: mean, lo, hi,
    label, family) or None}}. "sdp_setting" is the SDP run where it is better or no worse than the best run
    without SDP at both protocols; where no run without SDP fits ("only_sdp"), SDP is what fits but nothing
    shows its quality against an alternative, so it is not a recommendation; else "use" is the best run
    without SDP at equal FLOPs."""
    rows = []
    for budget_row in a["rows"]:
        row = {"budget": budget_row["budget"]}
        accepted, others = True, False
        for p in PROTOCOLS_DECIDED:
            pick = budget_row[p]
            c = a["comparisons"].get((pick["sdp"], "full"), (pick["other"], "full"), p) \
                if pick["sdp"] and pick["other"] else None
            delta = None if c is None else {k: c[k] for k in ("mean", "lo", "hi", "label", "family", "m")}
            row[p] = {"other": _pick(a, pick["other"], p), "sdp": _pick(a, pick["sdp"], p), "delta": delta}
            accepted &= delta is not None and delta["label"] in ACCEPT
            others |= pick["other"] is not None
        sdp_runs = {budget_row[p]["sdp"] for p in PROTOCOLS_DECIDED}
        row["sdp_setting"] = next(iter(sdp_runs)) if accepted and len(sdp_runs) == 1 else None
        row["only_sdp"] = not others
        row["use"] = row["sdp_setting"] or budget_row["flops"]["other"] or budget_row["tokens"]["other"] or \
            budget_row["flops"]["sdp"]
        rows.append(row)
    return rows


def recommended(a: dict, rows: list[dict]) -> dict:
    """The SDP setting the evidence supports: the one used at the largest budget where SDP is accepted
    ({} when SDP is accepted at no budget)."""
    for row in rows:
        if row["sdp_setting"]:
            cfg = a["runs"][row["sdp_setting"]]["config"]
            return {"run": row["sdp_setting"], "budget": row["budget"], "level": cfg["level"],
                    "regime": cfg["regime"], "coverage": cfg["coverage"],
                    "assignment": cfg.get("assignment") or "static",
                    "activation_checkpointing": bool(cfg.get("activation_checkpointing"))}
    return {}


def closest(a: dict) -> dict:
    """The SDP run with the lowest mean loss at equal FLOPs (what the README example may show when no SDP
    setting is supported): {"run", "level", "regime", "coverage", "label" vs DDP at equal FLOPs}."""
    sdp = [n for n, e in a["runs"].items() if is_sdp(n) and "flops" in e["protocols"]
           and not e["config"].get("derived_from")]
    if not sdp:
        return {}
    best = min(sdp, key=lambda n: a["runs"][n]["protocols"]["flops"]["loss"])
    cfg, c = a["runs"][best]["config"], a["comparisons"].get((best, "full"), ("ddp", "full"), "flops")
    return {"run": best, "level": cfg["level"], "regime": cfg["regime"], "coverage": cfg["coverage"],
            "label": c["label"] if c else None}


def _jsonable(value):
    if isinstance(value, dict):
        return {("|".join(map(str, k)) if isinstance(k, tuple) else k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _comparisons(a: dict) -> list[dict]:
    """Every comparison of the analysis, flat: {"a", "a_model", "b", "b_model", "protocol", "family", "m",
    "mean", "sd", "n", "lo", "hi", "confidence", "label"}."""
    out = []
    for key, c in a["comparisons"].resolved.items():
        out.append({"a": key[0], "a_model": key[1], "b": key[2], "b_model": key[3], "protocol": key[4],
                    **{f: c[f] for f in ("family", "m", "mean", "sd", "n", "lo", "hi", "confidence", "label")}})
    return out


def summary(analyses: dict, anchors: dict, per_seed: dict, record: dict, doc: str) -> dict:
    """What summary.json holds: the run's setup; per task its runs, comparisons (each once, with its family),
    families, decision rows and recommendation; the anchor; every run's per-seed losses (`per_seed`)."""
    tasks = {}
    for (task, k), a in analyses.items():
        rows = decision(a)
        tasks[task] = {"K": k, "decision": rows, "recommended": recommended(a, rows), "closest": closest(a),
                       "families": a["families"], "margin": a["margin"], "ddp": a["ddp"], "runs": a["runs"],
                       "comparisons": _comparisons(a), "per_seed": per_seed.get(task, {})}
    start = record.get("machine_at_start", {})
    return _jsonable({"doc": doc, "profile": record.get("profile", {}).get("name"), "seeds": record.get("seeds"),
                      "minutes": record.get("seconds", 0) / 60, "commit": start.get("commit"),
                      "dirty": start.get("dirty"), "cores": start.get("cores"), "anchor": anchors, "tasks": tasks})


def fmt_delta(d: dict | None) -> str:
    """"+0.052 [+0.030, +0.074] (worse)", or "—" for no comparison."""
    if d is None:
        return "—"
    if d.get("lo") is None or d["lo"] != d["lo"]:  # one seed: no interval
        return f"{d['mean']:+.3f} (one seed)"
    return f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] ({d['label']})"


def _run_cell(pick: dict | None) -> str:
    return "—" if pick is None else f"`{pick['run']}` ({pick['memory']:.2f}×) {pick['loss']:.3f}"


def decision_table(rows: list[dict]) -> list[str]:
    """The budget rows as a Markdown table."""
    lines = ["| memory per rank at most | equal tokens: best without SDP (memory) loss | best SDP | SDP − best without"
             " | equal FLOPs: best without SDP | best SDP | SDP − best without | use |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [f"{row['budget']:.2f}× DDP's"]
        for p in PROTOCOLS_DECIDED:
            c = row[p]
            cells += [_run_cell(c["other"]), _run_cell(c["sdp"]), fmt_delta(c["delta"])]
        cells.append(f"**SDP** `{row['use']}`" if row["sdp_setting"] else
                     f"`{row['use']}` (only SDP fits)" if row["only_sdp"] else f"`{row['use']}`")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def seeds_word(n: int) -> str:
    """"1 seed", "3 seeds"."""
    return f"{n} seed" if n == 1 else f"{n} seeds"


def _seeds_text(seeds, tasks) -> str:
    if isinstance(seeds, dict):
        return ", ".join(f"{seeds_word(len(v))} on {t}" for t, v in seeds.items() if t in tasks)
    if seeds is None:  # a report of results whose run did not finish (no study-run.json yet)
        return "the seeds of its results"
    return seeds_word(len(seeds))


def render_block(summary_data: dict, report_link: str | None, source: str, first_task_only: bool = False) -> str:
    """The generated block (markers included): where the numbers come from, then per task (the first
    only, for the README) the budget table and the SDP setting the evidence supports, if any."""
    lines = [f"{BEGIN}: generated by python -m bench.study from {source}; do not edit by hand -->", ""]
    where = f"[the study]({report_link})" if report_link else f"the study (`{summary_data['doc']}`)"
    lines.append(f"From {where} (profile `{summary_data['profile']}`, {_seeds_text(summary_data['seeds'], summary_data['tasks'])}, "
                 f"{summary_data['minutes']:.1f} minutes on {summary_data['cores']} CPU cores). Memory is the peak of "
                 "one whole training step per rank (parameters, gradients, optimizer state and every tensor alive at "
                 "that moment) as a multiple of DDP's. For each budget: the run with the lowest mean validation loss "
                 "among those that fit without SDP (DDP, FSDP2, checkpointing, stochastic depth, smaller dense models) "
                 "and with SDP, read at the same tokens as DDP and at the same FLOPs, each after a learning-rate "
                 "cooldown; SDP minus the best without it, paired over seeds, with its simultaneous interval and "
                 "label (\"no worse\": worse by less than the report's margin at most). SDP is used at a budget only "
                 "where it is better or no worse at both.")
    if summary_data["profile"] != "full":
        lines += ["", f"*Profile `{summary_data['profile']}` {PROFILE_NOTES.get(summary_data['profile'], PROFILE_NOTES['quick'])} "
                  "than `make study`: not a basis for the decision.*"]
    for task, t in list(summary_data["tasks"].items())[:1 if first_task_only else None]:
        lines += ["", f"**{task}** ({TASK_WORDS.get(task, task)}, K = {t['K']} ranks):", ""]
        lines += decision_table(t["decision"])
        rec, near = t.get("recommended"), t.get("closest") or {}
        if rec:
            assign = f', assignment="{rec["assignment"]}"' if rec["assignment"] != "static" else ""
            lines += ["", f"SDP setting on this evidence: `level=\"{rec['level']}\", regime=\"{rec['regime']}\", "
                      f"coverage={rec['coverage']:g}{assign}` (`{rec['run']}`, the best option within "
                      f"{rec['budget']:.2f}× DDP's memory)."]
        else:
            lines += ["", "SDP setting on this evidence: none. At no memory budget is an SDP run better or no worse "
                      "than the best option without SDP at both protocols" + (
                          f"; the closest at equal FLOPs is `{near['run']}` ({near['label']} against DDP)" if near
                          else "") + "."]
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

"""Gradient compression under SDP, measured: fp32 averaging against bf16 on the wire
(SDPConfig.reduce_dtype) and the low-rank comm hook (PowerSGD with error feedback,
subnet_ext/comm/hooks/low_rank.py) at two approximation ranks, on two small tasks.

    .venv/bin/python bench/compression.py       # bench/results/compression-cpu.md (about 10 min on 2 cores)
    .venv/bin/python bench/compression.py --seeds 2 --steps 10 --rounds 2 --out /tmp/c.md   # a quick look

What runs, for each task (compression_worker.TASK_SIZES, the former study's quick sizes): pysrc, the
character-level GPT on the Python standard library's sources, and digits, the residual MLP:
- K = 4 ranks: SDP at neuron level, forward regime, C = 0.5 (two owners per unit; the study's
  best variant), buckets per owner set for every reduction (the same buffers compared), one
  run per seed and reduction (fp32, bf16, low-rank r = 1 and r = 4), the same model, batches
  and optimizer. Per run: the gradient bytes handed to collectives per step (counted by the
  communicator) beside the cost model's prediction, the full model's held-out loss at the
  end (the study's evaluation), the slowest rank's median step time.
- K = 2 ranks, step time: one engine per reduction, built once, then `--rounds` rounds of
  `--window` steps of each in turn (order rotated per round), so a change of the machine's
  load hits all alike; the slowest rank's median per round, then the median over rounds and
  the ratio to fp32 taken in each round.
Loss is compared to fp32 for the same seed: the paired difference's mean and 95% confidence
interval (Student's t over the seeds).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # study/, provenance; also in spawned ranks

import provenance  # noqa: E402
from compression_worker import REDUCTIONS, VARIANT, run_group, sizes_of  # noqa: E402

TASK_TITLES = {"pysrc": "Python sources, character-level GPT", "digits": "digits, residual MLP"}


def build_parser() -> argparse.ArgumentParser:
    """Seeds, sizes, rounds, tasks and where the report goes."""
    p = argparse.ArgumentParser(prog="bench/compression.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 of the K=4 runs (default 5)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: the quick profile's)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds at K=2 (default 7)")
    p.add_argument("--window", type=int, default=5, help="steps per reduction per round (default 5)")
    p.add_argument("--tasks", type=lambda v: v.split(","), default=["pysrc", "digits"])
    p.add_argument("--out", default=os.path.join("bench", "results", "compression-cpu.md"))
    p.add_argument("--work", default=os.path.join("runs", "compression"), help="the runs' JSON files")
    return p


def interval(diffs: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% confidence interval) of paired differences (nan with < 2)."""
    from scipy.stats import t

    if len(diffs) < 2:
        return (diffs[0] if diffs else math.nan), math.nan
    return statistics.mean(diffs), t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))


def _records(work: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(work, "train", "*.json"))):
        with open(path) as f:
            out.append(json.load(f))
    return out


def training_table(records: list[dict], task: str) -> list[str]:
    """The K=4 table of one task: bytes, prediction, loss and its paired difference, step time."""
    runs = {(r["reduction"], r["seed"]): r for r in records if r["task"] == task}
    seeds = sorted({s for _, s in runs})
    base = {s: runs[("fp32", s)] for s in seeds if ("fp32", s) in runs}
    lines = ["| reduction | bytes/step (counted) | predicted | ×fp32 | collectives/step | loss (mean ± sd) | "
             "Δ loss vs fp32 [95% CI] | step ms (median) | ×fp32 | seeds |", "|---|" + "---:|" * 9]
    fp32_bytes = statistics.mean(r["bytes_per_step"] for r in base.values()) if base else math.nan
    fp32_ms = statistics.median(r["step_seconds"] for r in base.values()) * 1e3 if base else math.nan
    for name in REDUCTIONS:
        mine = [runs[(name, s)] for s in seeds if (name, s) in runs]
        if not mine:
            continue
        counted = statistics.mean(r["bytes_per_step"] for r in mine)
        predicted = {r["predicted_bytes"] for r in mine}
        exact = "= counted" if all(r["predicted_bytes"] == r["bytes_per_step"] for r in mine) else \
            f"{statistics.mean(predicted):,.0f} (≠)"
        losses = [r["loss"] for r in mine]
        sd = statistics.stdev(losses) if len(losses) > 1 else math.nan
        mean, half = interval([runs[(name, s)]["loss"] - base[s]["loss"] for s in seeds
                               if (name, s) in runs and s in base])
        ms = statistics.median(r["step_seconds"] for r in mine) * 1e3
        delta = "—" if name == "fp32" else f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]"
        lines.append(f"| {name} | {counted:,.0f} | {exact} | {counted / fp32_bytes:.3f} | "
                     f"{statistics.mean(r['collectives_per_step'] for r in mine):.0f} | "
                     f"{statistics.mean(losses):.4f} ± {sd:.4f} | {delta} | {ms:.1f} | {ms / fp32_ms:.2f} | "
                     f"{len(mine)} |")
    return lines


def timing_table(timing: dict) -> list[str]:
    """The K=2 interleaved timing: median step ms over rounds and the per-round ratio to fp32."""
    lines = ["| task | reduction | step ms (median over rounds) | ×fp32, median [min-max] over rounds |",
             "|---|---|---:|---:|"]
    for task, per_round in timing.items():
        for name, seconds in per_round.items():
            ratios = [s / f for s, f in zip(seconds, per_round["fp32"])]
            lines.append(f"| {task} | {name} | {statistics.median(seconds) * 1e3:.1f} | "
                         f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] |")
    return lines


def write_report(opts, command: str, started: float, load_before: str, records: list[dict], timing: dict) -> None:
    """The Markdown results file (every figure read from the runs' JSON)."""
    when = datetime.datetime.fromtimestamp(started, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    steps = {t: sizes_of(t, opts.steps)["steps"] for t in opts.tasks}
    lines = ["# Gradient compression under SDP (CPU, gloo)", "",
             f"Command: `{command}`, {when}, commit {provenance.commit()}, wall time {time.time() - started:.0f} s.",
             f"Machine: {provenance.machine()}. Load average (1, 5, 15 min): {load_before} before, "
             f"{provenance.load()} after (the machine is shared: step times are comparable within a table, "
             "taken in the same minutes, not across files).",
             f"SDP {VARIANT['level']} level, {VARIANT['regime']} regime, C = {VARIANT['coverage']}, buckets per "
             "owner set (strategy \"groups\", 25 MiB cap), AdamW; the sizes of compression_worker.TASK_SIZES "
             f"({', '.join(f'{t}: {n} steps' for t, n in steps.items())}). fp32: the default all-reduce; bf16: "
             "`reduce_dtype=torch.bfloat16`; low-rank r: `register_comm_hook(LowRankState(matrix_rank=r), "
             "low_rank_hook)`. Bytes: gradient bytes handed to collectives per step on one rank (the same on "
             "every rank here), counted by the communicator, beside the cost model's prediction. Loss: the full "
             "model's held-out cross-entropy (nats per character on pysrc, per sample on digits) after the last "
             "step; Δ: paired difference to fp32 of the same seed, mean and 95% CI over seeds (Student's t). "
             "Step ms: the slowest rank's median step of each run, median over seeds.", ""]
    for task in opts.tasks:
        lines += [f"## {TASK_TITLES.get(task, task)}, K = 4", ""] + training_table(records, task) + [""]
    if timing:
        lines += ["## Step time at K = 2, interleaved", "",
                  f"{opts.rounds} rounds × {opts.window} steps per reduction, order rotated per round; the "
                  "slowest rank's median step per round.", ""] + timing_table(timing) + [""]
    os.makedirs(os.path.dirname(opts.out) or ".", exist_ok=True)
    with open(opts.out, "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> int:
    """Train, time and write the report; returns the exit code."""
    from subnet_ext.jobs.launch import spawn_local

    opts = build_parser().parse_args(argv)
    if opts.seeds < 1 or opts.rounds < 1 or opts.window < 1:
        print("bench/compression.py: --seeds, --rounds and --window must be at least 1", file=sys.stderr)
        return 2
    command = " ".join(["python bench/compression.py", *(argv if argv is not None else sys.argv[1:])])
    started, load_before = time.time(), provenance.load()
    shutil.rmtree(opts.work, ignore_errors=True)
    os.makedirs(opts.work)
    jobs = [{"task": t, "seed": s, "reduction": r} for t in opts.tasks for s in range(opts.seeds) for r in REDUCTIONS]
    spawn_local(run_group, {"mode": "train", "work": opts.work, "steps": opts.steps, "jobs": jobs}, 4)
    spawn_local(run_group, {"mode": "time", "work": opts.work, "steps": None, "tasks": opts.tasks,
                            "rounds": opts.rounds, "window": opts.window}, 2)
    with open(os.path.join(opts.work, "timing-K2.json")) as f:
        timing = json.load(f)
    write_report(opts, command, started, load_before, _records(opts.work), timing)
    print(f"[compression] wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

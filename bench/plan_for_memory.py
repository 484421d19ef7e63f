"""How long `subnet-plan --memory-budget` takes, against a baseline commit and the plain plan.

    python bench/plan_for_memory.py --baseline 9667095 --out bench/results/plan-for-memory-cpu.md

Each command runs as its own process (`python -m subnet_ext.cli.plan ...`, imports included,
as a user runs it), on the checked-out tree and on the baseline commit (extracted with `git
archive` into a temporary folder, the built extension copied beside it), in
interleaved rounds so that a drift of the machine's speed hits both alike. Reported: the
median wall time and CPU time over rounds, their ratios to the baseline's, how many candidate
configurations the budget's table lists (one row each) and the one chosen.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAIN = ["--model", "llama", "--preset", "1b", "--world-size", "8"]
BUDGET = PLAIN + ["--memory-budget", "8GiB"]


def run_plan(tree: str, args: list[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, stdout) of `python -m subnet_ext.cli.plan args` with `tree` first
    on the path. CPU: the child's user + system time (what a busy machine does not inflate)."""
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "subnet_ext.cli.plan", *args], cwd=tree, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise RuntimeError(f"subnet-plan {' '.join(args)} in {tree} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return seconds, cpu, done.stdout


def budget_outcome(stdout: str) -> tuple[int, str]:
    """(rows of the candidates' table, the chosen configuration) of a --memory-budget run's output."""
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and line.rstrip().endswith(
        ("| yes |", "| no |", "| chosen |"))]
    chosen = next((line.split("|")[1].strip() for line in rows if line.rstrip().endswith("| chosen |")), "none")
    return len(rows), chosen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="the commit to compare with (e.g. the one before the change)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    p.add_argument("--out", default=None, help="write the Markdown report here (default: print it)")
    opts = p.parse_args(argv)
    started, load_before = time.time(), provenance.load()
    base_commit = subprocess.run(["git", "rev-parse", "--short", opts.baseline], cwd=ROOT, check=True,
                                 capture_output=True, text=True).stdout.strip()
    folder = tempfile.mkdtemp(prefix="plan-bench-")
    trees = {}
    try:
        trees = {f"baseline {base_commit}": provenance.baseline_tree(opts.baseline, folder), "this tree": ROOT}
        times, cpus, outcome = {}, {}, {}
        for r in range(opts.rounds):
            for label, tree in trees.items():
                for name, args in (("plain plan", PLAIN), ("--memory-budget 8GiB", BUDGET)):
                    seconds, cpu, out = run_plan(tree, args)
                    times.setdefault((label, name), []).append(seconds)
                    cpus.setdefault((label, name), []).append(cpu)
                    if name != "plain plan":
                        outcome[label] = budget_outcome(out)
                    print(f"round {r + 1}: {label}, {name}: {seconds:.1f} s ({cpu:.1f} s CPU)", file=sys.stderr,
                          flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    base_label = f"baseline {base_commit}"
    command = f"python bench/plan_for_memory.py --baseline {opts.baseline} --rounds {opts.rounds}" + \
        (f" --out {opts.out}" if opts.out else "")
    lines = provenance.header("`subnet-plan --memory-budget` on the 1B preset (CPU)", command, started,
                              load_before) + [
        f"Each cell: `python -m subnet_ext.cli.plan {' '.join(PLAIN)} [--memory-budget 8GiB]` as its own process "
        f"(imports included, OMP_NUM_THREADS=1), median wall time over {opts.rounds} interleaved rounds "
        "[min-max], and its CPU time (user + system, which other work on the machine does not inflate); "
        "×baseline: the ratio of the medians.", "",
        "| tree | command | wall s, median [range] | ×baseline | CPU s, median [range] | ×baseline | "
        "candidates listed | chosen |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for label in trees:
        for name in ("plain plan", "--memory-budget 8GiB"):
            cells = []
            for table in (times, cpus):
                xs = table[(label, name)]
                median = statistics.median(xs)
                cells.append(f"{median:.1f} [{min(xs):.1f}-{max(xs):.1f}] | "
                             f"{median / statistics.median(table[(base_label, name)]):.3f}")
            rows, chosen = outcome[label] if name != "plain plan" else ("", "")
            lines.append(f"| {label} | {name} | {cells[0]} | {cells[1]} | {rows} | {chosen} |")
    provenance.emit(lines, opts.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

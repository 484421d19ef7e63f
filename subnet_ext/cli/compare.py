"""`subnet-train compare`: DDP and the four SDP variants on the same data, one table.

Each run is a fresh group of local workers with the same seed, steps and per-rank batch;
the table's ratios are against the DDP run of the same invocation. With --seeds N every
variant runs N times (seeds --seed .. --seed+N-1) and a second table gives the mean ±
standard deviation of the quality and of the paired per-seed difference to DDP.
"""
from __future__ import annotations

import argparse
import json
import os
import time

VARIANTS = [
    ("ddp", None, None),
    ("sdp", "block", "forward"),
    ("sdp", "block", "backward"),
    ("sdp", "neuron", "forward"),
    ("sdp", "neuron", "backward"),
]


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def build_parser():
    """The argparse parser of `subnet-train compare` (workers, steps, coverage, model, data, output folder)."""
    from ..jobs.arguments import HelpFormatter

    p = argparse.ArgumentParser(prog="subnet-train compare", formatter_class=HelpFormatter, description=(
        "Train DDP and the four SDP variants (block/neuron level x forward/backward regime) with the same\n"
        "settings, one after another, and write one comparison table and plots (make demo runs it)."))
    p.add_argument("--nproc", type=_positive_int, default=2, help="local workers of every run")
    p.add_argument("--steps", type=_positive_int, default=400, help="optimizer steps of every run")
    p.add_argument("--coverage", type=float, default=0.5, help="the SDP runs' coverage, in (0, 1]")
    p.add_argument("--model", default="mlp", help="as subnet-train --model")
    p.add_argument("--preset", default=None, help="as subnet-train --preset (default: tiny)")
    p.add_argument("--data", default="digits", help="as subnet-train --data")
    p.add_argument("--batch-size", type=_positive_int, default=32, help="examples per rank")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--seeds", type=_positive_int, default=1, help="repeat every run over N seeds (mean ± std)")
    p.add_argument("--with-fsdp", action="store_true", help="also run torch FSDP2 (fully_shard)")
    p.add_argument("--out", default="runs/compare", help="folder for compare.md, compare.json and the plots")
    return p


def run_variants(opts, variants, seed: int) -> list[dict]:
    """One report per variant at `seed`, each from training_args(...) -> run (no command lines)."""
    from ..jobs.arguments import training_args
    from ..jobs.runner import run

    reports = []
    for method, level, regime in variants:
        label = method if method != "sdp" else f"sdp-{level}-{regime}"
        overrides = dict(method=method, model=opts.model, preset=opts.preset, data=opts.data, steps=opts.steps,
                         batch_size=opts.batch_size, lr=opts.lr, seed=seed, nproc=opts.nproc,
                         out=os.path.join(opts.out, f"seed{seed}", label))
        if method == "sdp":
            overrides.update(level=level, regime=regime, coverage=opts.coverage)
        args = training_args(**overrides)
        print(f"[compare] {label} seed {seed}: {opts.nproc} workers, {opts.steps} steps ...", flush=True)
        reports.append(run(args))
    return reports


def main(argv=None) -> int:
    """Train every method/variant with the same settings (over --seeds seeds), one after another,
    and write the comparison table and plots under --out; returns the process exit code (0 on success)."""
    from ..jobs.report import markdown_table, plot_runs, seeds_table

    opts = build_parser().parse_args(argv)
    variants = list(VARIANTS) + ([("fsdp", None, None)] if opts.with_fsdp else [])
    started = time.time()
    by_seed = {seed: run_variants(opts, variants, seed) for seed in range(opts.seed, opts.seed + opts.seeds)}
    first = by_seed[opts.seed]
    table = markdown_table(first, baseline_label="ddp")
    seeds = list(by_seed)
    header = (f"Command: `subnet-train compare --nproc {opts.nproc} --steps {opts.steps} --coverage {opts.coverage} "
              f"--model {opts.model} --data {opts.data} --batch-size {opts.batch_size} --lr {opts.lr} "
              f"--seed {opts.seed} --seeds {opts.seeds}`; {opts.nproc} gloo workers, wall time "
              f"{time.time() - started:.0f} s.\n\n")
    body = f"Seed {opts.seed}:\n\n{table}\n"
    if len(seeds) > 1:
        body = (f"Over {len(seeds)} seeds ({seeds[0]}..{seeds[-1]}):\n\n{seeds_table(by_seed, 'ddp')}\n\n" + body)
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "compare.md"), "w") as f:
        f.write(header + body)
    with open(os.path.join(opts.out, "compare.json"), "w") as f:
        json.dump({str(s): reps for s, reps in by_seed.items()}, f, indent=2, default=str)
    plots = plot_runs(first, os.path.join(opts.out, "compare-"))
    print(header + body)
    print(f"\nwrote {os.path.join(opts.out, 'compare.md')}, compare.json, " + ", ".join(os.path.basename(p) for p in plots))
    return 0


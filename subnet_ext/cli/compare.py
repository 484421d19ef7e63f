"""`subnet-train compare`: DDP and the four SDP variants on the same data, one table.

Each run is a fresh group of local workers with the same seed, steps and per-rank batch;
the table's ratios are against the DDP run of the same invocation.
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


def build_parser():
    """The argparse parser of `subnet-train compare` (workers, steps, coverage, model, data, output folder)."""
    p = argparse.ArgumentParser(prog="subnet-train compare", description=__doc__)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--coverage", type=float, default=0.5)
    p.add_argument("--model", default="mlp")
    p.add_argument("--preset", default=None)
    p.add_argument("--data", default="digits")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--with-fsdp", action="store_true", help="also run torch FSDP2 (fully_shard)")
    p.add_argument("--out", default="runs/compare")
    return p


def main(argv=None) -> int:
    """Train every method/variant with the same settings, one after another, and write the comparison
    table and plots under --out; returns the process exit code (0 on success)."""
    from .train import build_parser as train_parser, check_args, run
    from .report import markdown_table, plot_runs

    opts = build_parser().parse_args(argv)
    variants = list(VARIANTS) + ([("fsdp", None, None)] if opts.with_fsdp else [])
    reports, started = [], time.time()
    for method, level, regime in variants:
        label = method if method != "sdp" else f"sdp-{level}-{regime}"
        argv = ["--method", method, "--model", opts.model, "--data", opts.data, "--steps", str(opts.steps),
                "--batch-size", str(opts.batch_size), "--lr", str(opts.lr), "--seed", str(opts.seed),
                "--nproc", str(opts.nproc), "--coverage", str(opts.coverage),
                "--out", os.path.join(opts.out, label)]
        if opts.preset:
            argv += ["--preset", opts.preset]
        if method == "sdp":
            argv += ["--level", level, "--regime", regime]
        parser = train_parser()
        args = parser.parse_args(argv)
        check_args(parser, args)
        print(f"[compare] {label}: {opts.nproc} workers, {opts.steps} steps ...", flush=True)
        reports.append(run(args))
    table = markdown_table(reports, baseline_label="ddp")
    header = (f"Command: `subnet-train compare --nproc {opts.nproc} --steps {opts.steps} --coverage {opts.coverage} "
              f"--model {opts.model} --data {opts.data} --batch-size {opts.batch_size} --lr {opts.lr} "
              f"--seed {opts.seed}`; {opts.nproc} gloo workers, wall time {time.time() - started:.0f} s.\n\n")
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "compare.md"), "w") as f:
        f.write(header + table + "\n")
    with open(os.path.join(opts.out, "compare.json"), "w") as f:
        json.dump(reports, f, indent=2, default=str)
    plots = plot_runs(reports, os.path.join(opts.out, "compare-"))
    print(header + table)
    print(f"\nwrote {os.path.join(opts.out, 'compare.md')}, compare.json, " + ", ".join(os.path.basename(p) for p in plots))
    return 0

"""What a change of assignment costs (planning/assignment/schedule.py, engine/reassignment.py): the bytes that change
hands and the step time with and without changes, on the study's Tiny Shakespeare GPT at K = 4.

    python bench/reassignment.py                         # bench/results/reassignment-cpu.md
    python bench/reassignment.py --rounds 3 --steps 6    # a quick look

For each level (block, neuron; forward and backward regime, C = 0.5) four engines train in interleaved
rounds on the same 4 gloo ranks: static, and the redraw schedule changing every step, every 10 and every
50 steps; each round times `--steps` optimizer steps of each engine (the changes falling inside them),
and the table gives the medians over rounds of the mean step time, with the ratio to the static engine
of the same round. The bytes per change are those the engine's sends handed to point-to-point messages
(comm_stats()["by_quantity"]["reassign"], every rank summed) beside its cost model's prediction
(comm_stats()["reassignments"]), per change.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from subnet_ext.vocabulary import LEVELS, REGIMES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # provenance; also in spawned ranks

EVERY = (0, 1, 10, 50)  # 0: static


def _worker(rank, world, level, regime, rounds, steps, data):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import subnet_ext as sx
    from subnet_ext.jobs.tasks import build_task

    task = build_task(f"shakespeare:{data}", "gpt", "shakespeare", 3, 64, seed=0)
    engines = {}
    for every in EVERY:
        torch.manual_seed(0)
        model = task.make_model()
        plan = sx.plan_subnetworks(model, world, 0.5, level)
        kw = dict(assignment="redraw", reassign_every=every) if every else {}
        sdp = sx.SubnetDataParallel(model, plan, regime=regime, **kw)
        engines[every] = (sdp, torch.optim.AdamW(sdp.parameters(), lr=1e-3), [0])
    times = {every: [] for every in EVERY}
    for _ in range(rounds):
        for every, (sdp, opt, step) in engines.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                x, y = task.batch(step[0], rank, world)
                logits, _ = sdp(x)
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                step[0] += 1
            elapsed = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
            times[every].append(float(elapsed))
    out = {}
    for every, (sdp, _, step) in engines.items():
        stats = sdp.comm_stats()
        sent = stats["by_quantity"].get("reassign", (0, 0))[0]
        predicted = sum(r["predicted_bytes"] for r in stats["reassignments"])
        totals = torch.tensor([sent, predicted, len(stats["reassignments"])], dtype=torch.float64)
        dist.all_reduce(totals)
        out[every] = {"times": times[every], "sent": float(totals[0]), "predicted": float(totals[1]),
                      "changes": float(totals[2]) / world, "steps": step[0]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (medians over them)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per engine per round")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "reassignment-cpu.md"))
    p.add_argument("--data", default=None, help="Tiny Shakespeare's input.txt (default as the study's)")
    opts = p.parse_args(argv)
    import provenance
    from subnet_ext.testing import run_distributed

    sys.path.insert(0, ROOT)
    from bench.study.runs import data_path

    data = data_path(opts.data)
    started, load_before = time.time(), provenance.load()
    rows = []
    for level in LEVELS:
        for regime in REGIMES:
            found = run_distributed(_worker, 4, level, regime, opts.rounds, opts.steps, data, timeout=3600)[0]
            static = found[0]["times"]
            for every in EVERY:
                r = found[every]
                ratio = statistics.median(t / s for t, s in zip(r["times"], static))
                per_change = (r["sent"] / r["changes"] / 2**20) if r["changes"] else 0.0
                predicted = (r["predicted"] / r["changes"] / 2**20) if r["changes"] else 0.0
                rows.append(f"| {level} | {regime} | {'static' if not every else f'redraw every {every}'} | "
                            f"{1e3 * statistics.median(r['times']):.1f} | {ratio:.2f} | {int(r['changes'])} | "
                            f"{per_change:.3f} | {predicted:.3f} |")
            print(rows[-1], flush=True)
    command = "python bench/reassignment.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n".join([
        "# What a change of assignment costs (CPU, gloo, K = 4)", "",
        f"Command: `{command.strip()}`, commit {provenance.commit()}, wall time {time.time() - started:.0f} s.",
        f"Machine: {provenance.machine()}. Load average (1, 5, 15 min): {load_before} before, {provenance.load()} "
        "after (step times are comparable within a table, taken in the same minutes, not across files).",
        f"Model: the study's Tiny Shakespeare GPT (4 blocks x 128), 3 sequences of 64 characters per rank, C = 0.5, "
        f"AdamW; {opts.rounds} interleaved rounds of {opts.steps} steps per engine (module docstring).", "",
        "| level | regime | assignment | step ms (median of rounds) | × static (median of same-round ratios) | "
        "changes | MiB sent per change (all ranks, counted) | MiB per change (cost model) |",
        "|---|---|---|---:|---:|---:|---:|---:|", *rows, ""])
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    with open(opts.out, "w") as f:
        f.write(text)
    print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

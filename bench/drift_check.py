"""What the engine's drift check costs a training step (CPU, 2 gloo ranks).

    python bench/drift_check.py --out bench/results/drift-check-cpu.md

SubnetDataParallel compares the owners' copies every `drift_check_every` steps
(state/drift_check.py). Here the same training window runs with the check off, at its default
period and at every step (the worst case), in interleaved rounds (each round builds every
configuration afresh from seed 0, in an order rotated by one each round): LLaMA small on
random tokens, AdamW, at the neuron level with coverage 1 (every piece has two owners: the
most the check reads) and at the block level with coverage 0.5 (the shared parameters only).
Reported per configuration: the median over rounds of the slower rank's mean step time over
the window (a window spans a whole number of default periods), its ratio to the run without
the check (taken per round, median [range]), and the time of one check alone.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = (("neuron", 1.0), ("block", 0.5))


def _window(rank: int, level: str, coverage: float, every, steps: int, warmup: int) -> tuple[float, float]:
    """(mean step seconds over `steps` timed steps after `warmup`, seconds of one check alone)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import subnet_ext as sx
    from subnet_ext.models import build_model

    torch.manual_seed(0)
    model = build_model("llama", preset="small")
    plan = sx.plan_subnetworks(model, dist.get_world_size(), coverage, level, sample_input=((1, 64), torch.long))
    sdp = sx.SubnetDataParallel(model, plan, drift_check_every=every)
    opt = torch.optim.AdamW(sdp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)

    def step():
        x = torch.randint(0, 2048, (8, 64), generator=gen)
        logits = sdp(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    mean = (time.perf_counter() - started) / steps
    dist.barrier()
    began = time.perf_counter()
    for _ in range(5):
        sdp.drift_check.check(0)
    one_check = (time.perf_counter() - began) / 5
    return mean, one_check


def _rank(rank: int, world: int, rounds: int, steps: int, warmup: int) -> dict:
    from subnet_ext.engine.config import DEFAULT_DRIFT_CHECK_EVERY

    torch.set_num_threads(1)
    configs = [(level, cov, every) for level, cov in MODELS for every in (0, DEFAULT_DRIFT_CHECK_EVERY, 1)]
    out = {}
    for r in range(rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for cfg in order:
            out.setdefault(cfg, []).append(_window(rank, *cfg, steps, warmup))
    return out


def main(argv=None) -> int:
    from subnet_ext.engine.config import DEFAULT_DRIFT_CHECK_EVERY
    from subnet_ext.testing import run_distributed

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: 5)")
    p.add_argument("--periods", type=int, default=2, help="default check periods per timed window (default: 2)")
    p.add_argument("--out", default=None, help="write the Markdown report here (default: print it)")
    opts = p.parse_args(argv)
    n = DEFAULT_DRIFT_CHECK_EVERY
    steps, warmup = opts.periods * n, 2
    started, load_before = time.time(), provenance.load()
    per_rank = run_distributed(_rank, 2, opts.rounds, steps, warmup, timeout=7200.0)
    command = f"python bench/drift_check.py --rounds {opts.rounds} --periods {opts.periods}" + \
        (f" --out {opts.out}" if opts.out else "")
    lines = provenance.header("The drift check's cost (CPU, gloo)", command, started, load_before) + [
        f"2 ranks, one process and one thread each; LLaMA small, batch 8 x 64 random tokens per rank, AdamW; "
        f"{warmup} warm-up steps, then a window of {steps} steps ({opts.periods} periods of the default "
        f"drift_check_every = {n}); {opts.rounds} interleaved rounds. Step ms: the median over rounds of the slower "
        "rank's mean step. ×off: the ratio to the same configuration without the check, per round, median "
        "[range]. One check: a check's time alone (the slower rank's mean of 5, medians over rounds); per step: that "
        "time spread over the period, one check / (drift_check_every x step ms), the cost the period predicts.", "",
        "| plan | drift_check_every | step ms | ×off, median [range] | one check ms | one check per step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for level, cov in MODELS:
        off = [max(r[(level, cov, 0)][i][0] for r in per_rank) for i in range(opts.rounds)]
        for every in (0, n, 1):
            step = [max(r[(level, cov, every)][i][0] for r in per_rank) for i in range(opts.rounds)]
            check = [max(r[(level, cov, every)][i][1] for r in per_rank) for i in range(opts.rounds)]
            ratios = [s / o for s, o in zip(step, off)]
            med_step, med_check = statistics.median(step), statistics.median(check)
            lines.append(f"| {level}, C={cov:g} | {every or 'off (0)'} | {1e3 * med_step:.1f} | "
                         f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] | "
                         f"{1e3 * med_check:.2f} | {med_check / (med_step * every) if every else 0.0:.4f} |")
    provenance.emit(lines, opts.out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())

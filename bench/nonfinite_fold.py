"""The non-finite check folded into gradient clipping, timed against the separate check.

    python bench/nonfinite_fold.py --out bench/results/nonfinite-fold-cpu.md
    python bench/nonfinite_fold.py --rounds 2 --steps 3          # a quick look

K gloo ranks (one thread each) train SDP on a llama preset through subnet-train's optimizer
step (jobs/training.OptimizerStep, fused AdamW, --grad-clip) in interleaved rounds; each round
times a window of steps of each variant on the same model, in an order rotated per round:

- "separate": the guard's own pass over every gradient and its all-reduce, then clipping
  (what the step did before the fold);
- "folded": clipping with `nonfinite_check`, the skip read off its norm (one pass, one
  all-reduce; the default);
- "clip only": clipping without any non-finite check (the floor the fold aims at).

Reported per variant: the median over rounds of the slowest rank's median time of the
decision + clipping + optimizer step (`finish`), and of the whole step (forward, backward,
finish); ratios to "separate" are taken per round, between windows of the same round, and
shown as median [min-max] over rounds. Everything in the table is measured in this run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from subnet_ext.vocabulary import LEVELS

import provenance

VARIANTS = ("separate", "folded", "clip only")


def _worker(rank, world, port, opts, queue):
    import torch.distributed as dist
    import torch.nn.functional as F
    from argparse import Namespace

    import subnet_ext as sx
    from subnet_ext.jobs.methods import SDPMethod
    from subnet_ext.jobs.training import OptimizerStep, make_optimizer
    from subnet_ext.data.tokens import SyntheticTokens
    from subnet_ext.engine.guards.nonfinite_guard import NonFiniteGuard
    from subnet_ext.models.llama import LLAMA_PRESETS, LlamaForCausalLM

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg = LLAMA_PRESETS[opts.preset]
    model = LlamaForCausalLM(cfg)
    plan = sx.plan_subnetworks(model, world, opts.coverage, opts.level, seed=0)
    method = SDPMethod(model, plan, "forward", 1, "none")
    args = Namespace(grad_accum=1, grad_clip=1.0, precision="fp32", lr=1e-4, weight_decay=0.0,
                     lr_schedule="constant", warmup_steps=0, steps=10**9)
    optimizer = make_optimizer(method.parameters(), args)
    guard = NonFiniteGuard(None)
    stepper = OptimizerStep(method, optimizer, guard, args, torch.device("cpu"))
    source = SyntheticTokens(cfg.vocab_size, opts.seq_len, seed=0)
    gen = torch.Generator().manual_seed(rank)
    x, y = source.batch(opts.batch_size, gen)

    def step(variant: str, n: int) -> tuple[float, float]:
        logits = method(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        t0 = time.perf_counter()
        if variant == "clip only":
            method.clip_grad_norm_(args.grad_clip)
            optimizer.step()
        else:
            stepper.fold = variant == "folded"
            stepper.finish(n)
        t1 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        return t1 - t0

    out = {v: [] for v in VARIANTS}
    n = 0
    for r in range(opts.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for variant in order:
            step(variant, n)  # warm-up of this window
            dist.barrier()
            finishes, steps = [], []
            for _ in range(opts.steps):
                n += 1
                t0 = time.perf_counter()
                finishes.append(step(variant, n))
                steps.append(time.perf_counter() - t0)
            out[variant].append((statistics.median(finishes), statistics.median(steps)))
        guard.settle()
    assert not guard.skipped_steps, guard.skipped_steps  # nothing non-finite in this benchmark
    queue.put((rank, out))
    dist.destroy_process_group()


def run(opts) -> list[dict]:
    """Per rank: {variant: [(median finish s, median step s) per round]}."""
    import torch.multiprocessing as mp

    from subnet_ext.jobs.launch import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, opts.world_size, port, opts, queue)) for r in range(opts.world_size)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return [results[r] for r in range(opts.world_size)]


def report(per_rank: list[dict], opts, argv, load_before: str) -> str:
    rounds = opts.rounds
    # Per round, the slowest rank's medians (a step waits for every rank).
    worst = {v: [tuple(max(r[v][i][k] for r in per_rank) for k in (0, 1)) for i in range(rounds)] for v in VARIANTS}
    lines = [f"# Non-finite check folded into clipping: llama {opts.preset}, SDP {opts.level} C={opts.coverage:g}, "
             f"K = {opts.world_size} (gloo, CPU)", "",
             f"Command: `python bench/nonfinite_fold.py {' '.join(argv)}`; commit {provenance.commit()}; "
             f"{provenance.machine()}; load average {load_before} before, {provenance.load()} after.", "",
             f"Batch {opts.batch_size} x {opts.seq_len} tokens per rank, fused AdamW, --grad-clip 1.0; "
             f"{rounds} interleaved rounds of {opts.steps} timed steps per variant (order rotated per round). "
             "finish: the skip decision, clipping and the optimizer step; step: forward, backward and finish. "
             "Times: median over rounds of the slowest rank's median; ratios to separate: per round, "
             "median [min-max].", "",
             "| variant | finish ms | finish / separate | step ms | step / separate |", "|---|---:|---:|---:|---:|"]

    def ratio(v, k):
        values = [worst[v][i][k] / worst["separate"][i][k] for i in range(rounds)]
        return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"

    for v in VARIANTS:
        finish = statistics.median(w[0] for w in worst[v])
        whole = statistics.median(w[1] for w in worst[v])
        lines.append(f"| {v} | {1e3 * finish:.2f} | {ratio(v, 0)} | {1e3 * whole:.2f} | {ratio(v, 1)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", help="llama preset (default: small)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--level", default="neuron", choices=LEVELS)
    p.add_argument("--coverage", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    p.add_argument("--out", default=None)
    opts = p.parse_args(argv)
    load_before = provenance.load()
    text = report(run(opts), opts, argv, load_before)
    print(text)
    if opts.out:
        with open(opts.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

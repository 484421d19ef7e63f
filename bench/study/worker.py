"""One launched group of K ranks running every study configuration, one after another.

Launching K processes costs seconds (torch's import, the rendezvous), so the world size is
launched once and every configuration runs inside, each with a fresh model, wrapper,
optimizer and, for SDP, its own owner-set process groups (destroyed afterwards). Rank 0
writes one JSON per configuration as soon as its job finishes, so an interrupted study
resumes with the jobs still missing.

A job (runs.jobs) is one trained configuration and the derived configurations that read
their loss from it:
1. each derived configuration is built and trained for `measure_steps` steps: its first
   step counted by FlopCounterMode, its third metered (StepMemoryMeter), the rest timed;
2. the trained configuration takes its first (counted) step; then every mark is fixed
   (runs.py: equal tokens, equal FLOPs, on CUDA equal wall time; its own and the derived
   configurations'), each with the cooldown branch that ends at it;
3. the stable trajectory runs to the last branch's first step, evaluated on the grid,
   snapshotting each branch's first step, metering its third step (with stochastic depth,
   the step where this rank keeps the most blocks);
4. each branch restores its snapshot, decays the rate to its mark and evaluates every model
   a user could keep there.
The anchor (the recipe's cosine schedule) trains straight to its one mark instead of 2-4.
"""
from __future__ import annotations

import gc
import json
import os
import time

import torch
import torch.distributed as dist

from .evaluation import evaluate_method
from .measure import block_training_flops, register_masked_linear_flops, reset_peak_rss
from .training import Run
from .runs import (MAX_EXTENSION, cooldown_steps, flops_mark, result_path, seconds_mark, tokens_mark)
from subnet_ext.jobs.launch import init_distributed, pick_backend
from subnet_ext.jobs.stochastic_depth import residual_branches
from subnet_ext.jobs.tasks import build_task

METER_STEP = 2  # the third step: after the first (counted) and the optimizer state's creation


def run_group(spec: dict) -> None:
    """Entry point of every rank (subnet_ext.jobs.launch.spawn_local): spec = {"device", "profile",
    "out", "jobs": [job, ...]} (runs.jobs)."""
    backend, device = pick_backend("auto", spec["device"])
    init_distributed(backend, timeout_s=spec["profile"]["timeout"], device=device)
    register_masked_linear_flops()
    for job in spec["jobs"]:
        t0 = time.perf_counter()
        _run_job(job, spec, device)
        if dist.get_rank() == 0:
            print(f"[study]   job {job['config']['task']} seed {job['config']['seed']} {job['config']['name']}: "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
        gc.collect()  # the finished configurations' models and groups, before the next one measures
        dist.barrier()


EVAL_BATCH = 64  # windows per evaluation forward (the task's batches are a rank's training batch: 3)


def _task(sizes: dict, seed: int, batch_size: int, preset: str | None = None):
    return build_task(sizes["data"], sizes["model"], preset or sizes["preset"], batch_size, sizes["seq_len"], seed,
                      eval_sequences=sizes["eval_sequences"])


def _eval_batches(task) -> list:
    """The task's held-out windows in batches of EVAL_BATCH (the same windows, fewer forwards)."""
    pairs = list(task.eval_batches())
    x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    return [(x[i:i + EVAL_BATCH], y[i:i + EVAL_BATCH]) for i in range(0, len(x), EVAL_BATCH)]


def _reference(task, device) -> dict:
    """The full model's FLOPs for one rank's batch (forward + backward) and each block's share."""
    torch.manual_seed(0)
    model = task.make_model().to(device)
    x, y = task.batch(0, 0, 1)
    total, blocks = block_training_flops(model, list(residual_branches(model)), (x.to(device), y.to(device)))
    return {"rank_flops": total, "blocks": blocks}


def _baseline(spec: dict, cfg: dict) -> dict | None:
    """DDP's tokens, FLOPs and training seconds at its equal-tokens mark (same seed), or None for DDP and
    the runs read against nothing (the anchor)."""
    if cfg["baseline"] in (None, cfg["name"]):
        return None
    with open(result_path(spec["out"], cfg["task"], cfg["K"], cfg["seed"], cfg["baseline"])) as f:
        at = json.load(f)["marks"]["tokens"]
    return {"tokens": at["tokens"], "flops": at["flops"], "seconds": at["seconds"]}


def _context(job: dict, spec: dict, device) -> dict:
    cfg, profile = job["config"], spec["profile"]
    sizes = profile["tasks"][cfg["task"]]
    task = _task(sizes, cfg["seed"], sizes["batch_size"])
    return {"profile": profile, "sizes": sizes, "device": device, "base": _baseline(spec, cfg),
            "batches": _eval_batches(task), "reference": _reference(task, device)}


def _build(cfg: dict, ctx: dict) -> Run:
    from .runs import batch_size_of

    task = _task(ctx["sizes"], cfg["seed"], batch_size_of(cfg, ctx["sizes"]), cfg.get("preset"))
    return Run(cfg, ctx["profile"], ctx["device"], task, ctx["reference"])


def _measure(cfg: dict, ctx: dict) -> dict:
    """A derived configuration: `measure_steps` steps of its own (counted, metered, timed)."""
    reset_peak_rss()
    run = _build(cfg, ctx)
    run.meter_at = METER_STEP
    for _ in range(ctx["profile"]["measure_steps"]):
        run.step_once()
    out = {"run": _gather(run), "step_flops": run.step_flops, "step_time": _slowest(run.step_time(), ctx["device"]),
           "comm": run.method.comm(), "tokens_per_step": run.tokens_at(1), "plan": _plan(run)}
    run.close()
    return out


def _slowest(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _marks(run: Run, ctx: dict, readers: dict) -> dict:
    """{(owner name, protocol): mark step}: the run's own marks and its derived configurations'."""
    base, steps = ctx["base"], ctx["sizes"]["steps"]
    limit = MAX_EXTENSION * steps
    own_tokens = run.tokens_at(1)
    base_tokens = base["tokens"] if base else steps * own_tokens
    base_flops = base["flops"] if base else steps * run.step_flops
    name = run.cfg["name"]
    marks = {(name, "tokens"): tokens_mark(base_tokens, own_tokens),
             (name, "flops"): flops_mark(base_flops, run.flops_of_step, limit)}
    for rname, r in readers.items():
        marks[(rname, "tokens")] = tokens_mark(base_tokens, r["tokens_per_step"])
        marks[(rname, "flops")] = flops_mark(base_flops, lambda _: r["step_flops"], limit)
    return {key: m for key, m in marks.items() if m is not None}


def _seconds_marks(run: Run, ctx: dict, readers: dict) -> dict:
    """Equal wall time (profiles with wall_time): marks from the median step times measured so far."""
    steps = ctx["sizes"]["steps"]
    limit = MAX_EXTENSION * steps
    own = _slowest(run.step_time(), ctx["device"])
    base_seconds = ctx["base"]["seconds"] if ctx["base"] else steps * own
    marks = {(run.cfg["name"], "seconds"): seconds_mark(base_seconds, own, limit)}
    for rname, r in readers.items():
        marks[(rname, "seconds")] = seconds_mark(base_seconds, r["step_time"], limit)
    return {key: m for key, m in marks.items() if m is not None}


def _branches(marks: dict, fraction: float, earliest: int) -> dict:
    """{mark step: first step of its cooldown branch} (never before `earliest`)."""
    return {m: max(earliest, m - cooldown_steps(m, fraction)) for m in sorted(set(marks.values()))}


def _meter_step(run: Run, last: int) -> int:
    """The step to meter: METER_STEP, or with stochastic depth the step before `last` where this rank
    keeps the most blocks (memory follows the blocks a step runs; ties: the earliest)."""
    if run.stochastic is None:
        return METER_STEP
    candidates = range(METER_STEP, max(METER_STEP + 1, last))
    return max(candidates, key=lambda s: (sum(run.stochastic.kept_blocks(s, run.rank)), -s))


def _run_job(job: dict, spec: dict, device) -> None:
    # why: the job's four stages (module docstring) in order, each a few lines; split, they would pass
    # the same half-dozen locals around.
    ctx = _context(job, spec, device)
    cfg, profile, every = job["config"], ctx["profile"], ctx["sizes"]["eval_every"]
    if cfg.get("measure_only"):  # the bf16 memory measurement: a few metered steps, no loss
        m = _measure(cfg, ctx)
        _write(spec, cfg, m["run"], {}, ctx, m["step_flops"], m["comm"], m["plan"], [])
        return
    readers = {r["name"]: _measure(r, ctx) for r in job["readers"]}
    reset_peak_rss()
    run = _build(cfg, ctx)
    run.curve.append(_evaluate(run, ctx, every_model=False))
    run.step_once()  # counted: the FLOPs per step fix the marks
    if cfg.get("schedule") == "cosine":  # the anchor: the recipe's own schedule, read where it ends
        own = {"tokens": _to_end(run, ctx["sizes"]["steps"], every, ctx)}
        _write(spec, cfg, _gather(run), own, ctx, run.step_flops, run.method.comm(), _plan(run), run.curve)
        run.close()
        return
    marks = _marks(run, ctx, readers)
    calibrate = 1
    if profile["wall_time"]:  # time a few steps first: the equal-time mark needs a step time
        calibrate = max(2, min(20, ctx["sizes"]["steps"] // 10))
        while run.step < calibrate:
            run.step_once()
        marks.update(_seconds_marks(run, ctx, readers))
    branches = _branches(marks, profile["cooldown"], calibrate)
    last = max(branches.values())
    run.meter_at = _meter_step(run, last)
    snapshots = {}
    while True:
        if run.step in branches.values() and run.step not in snapshots:
            snapshots[run.step] = run.snapshot()
        if run.step >= last:
            break
        run.step_once()
        if run.step % every == 0:
            run.curve.append(_evaluate(run, ctx, every_model=False))
    if run.curve[-1]["step"] != run.step:  # the stable trajectory's last point, where the last branch starts
        run.curve.append(_evaluate(run, ctx, every_model=False))
    points = {}
    for mark, start in sorted(branches.items(), key=lambda kv: kv[1]):
        run.restore(snapshots[start])
        points[mark] = _cool(run, start, mark, ctx)
    del snapshots
    own = {p: points[m] for (n, p), m in marks.items() if n == cfg["name"]}
    _write(spec, cfg, _gather(run), own, ctx, run.step_flops, run.method.comm(), _plan(run), run.curve)
    for rname, r in readers.items():
        rcfg = next(c for c in job["readers"] if c["name"] == rname)
        at = {p: _as_reader(points[m], m, r) for (n, p), m in marks.items() if n == rname}
        _write(spec, rcfg, r["run"], at, ctx, r["step_flops"], r["comm"], r["plan"], [])
    run.close()


def _to_end(run: Run, end: int, every: int, ctx: dict) -> dict:
    """Train on the run's own schedule to step `end` (metering its third step), evaluating on the grid;
    returns the point evaluated there with every model."""
    run.meter_at = METER_STEP
    while run.step < end:
        run.step_once()
        if run.step % every == 0 and run.step < end:
            run.curve.append(_evaluate(run, ctx, every_model=False))
    point = _evaluate(run, ctx, every_model=True)
    run.curve.append({k: v for k, v in point.items() if k in ("step", "tokens", "flops", "seconds", "loss",
                                                                 "accuracy")})
    return point


def _cool(run: Run, start: int, mark: int, ctx: dict) -> dict:
    """A cooldown branch from `start` (the run is there) to `mark`; returns the point evaluated there."""
    run.cooldown = (start, mark)
    while run.step < mark:
        run.step_once()
    run.cooldown = None
    point = _evaluate(run, ctx, every_model=True)
    point["cooldown"] = [start, mark]
    return point


def _evaluate(run: Run, ctx: dict, every_model: bool) -> dict:
    """Evaluate the run's models (collective): a curve point, or every model a user could keep."""
    stepper = getattr(run, "_optimizer_step", None)
    if stepper is not None:  # the skip decisions kept on the device, read in one copy
        stepper.guard.settle()
    losses = evaluate_method(run.cfg["method"], run.method, run.task, ctx["batches"], run.device, run.stochastic,
                             every_model)
    return {"step": run.step, "tokens": run.tokens_at(run.step), "flops": run.flops,
            "seconds": run.global_seconds(), **losses}


def _as_reader(point: dict, mark: int, reader: dict) -> dict:
    """The trajectory's point at a derived configuration's mark, with that configuration's counters."""
    out = dict(point)
    out.update(tokens=mark * reader["tokens_per_step"], flops=mark * reader["step_flops"],
               seconds=mark * reader["step_time"])
    return out


def _gather(run: Run) -> list:
    per_rank = [None] * run.world
    dist.all_gather_object(per_rank, run.measurements())
    return per_rank


def _plan(run: Run) -> dict | None:
    plan = getattr(run.method, "plan", None)
    if plan is None:
        return None
    full_flops = plan.shared_flops + float(plan.unit_flops.sum())
    return {"level": plan.level, "coverage": plan.coverage, "owner_count": [int(c) for c in plan.owner_count],
            "units": [u.group for u in plan.units], "owners": plan.owners.int().tolist(),
            "flops_fraction": (plan.flops_per_rank / full_flops).tolist(),  # each subnetwork's forward / the full one's
            "params_fraction": plan.held_fraction.tolist(), "flops_source": plan.flops_source}


def _write(spec, cfg, per_rank, marks, ctx, step_flops, comm, plan, curve) -> None:
    """Rank 0 writes the configuration's JSON and a progress line."""
    if dist.get_rank() != 0:
        return
    result = {"config": cfg, "profile": spec["profile"], "world_size": dist.get_world_size(),
              "step_flops": step_flops, "reference": ctx["reference"], "baseline": ctx["base"],
              "per_rank": per_rank, "comm": comm, "curve": curve, "marks": marks, "plan": plan,
              "capped": not (cfg.get("schedule") == "cosine" or cfg.get("measure_only"))
              and not {"tokens", "flops"} <= set(marks),
              "written": time.time()}
    path = result_path(spec["out"], cfg["task"], cfg["K"], cfg["seed"], cfg["name"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    tokens = marks.get("tokens", {})
    loss = tokens.get("loss", {}).get("full", float("nan"))
    print(f"[study] {cfg['task']} K={cfg['K']} seed {cfg['seed']} {cfg['name']}: val loss {loss:.4f} at the "
          f"equal-tokens mark (step {tokens.get('step')})", flush=True)

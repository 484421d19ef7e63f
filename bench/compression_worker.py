"""The ranks of bench/compression.py: training runs (K = 4) and interleaved step timing (K = 2).

Each rank builds its task (TASK_SIZES: the sizes of the earlier study's quick profile, on which the
committed results were measured; subnet_ext.jobs' task, optimizer and optimizer step, the study's
evaluation) and an SDP engine whose gradient
reduction is one of REDUCTIONS; rank 0 writes one JSON per training run, and one for the
timing, into the work folder.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from study.evaluation import evaluate_method
from study.runs import training_overrides
from subnet_ext import SDPConfig, SubnetDataParallel, plan_subnetworks
from subnet_ext.jobs.arguments import training_args
from subnet_ext.jobs.launch import init_distributed, pick_backend
from subnet_ext.jobs.methods import Method, SDPMethod
from subnet_ext.jobs.tasks import sample_input_for
from subnet_ext.jobs.tasks import build_task
from subnet_ext.jobs.training import OptimizerStep, make_optimizer
from subnet_ext.comm.hooks import LowRankState, low_rank_hook
from subnet_ext.engine.guards.nonfinite_guard import NonFiniteGuard

# name -> (reduce_dtype, low-rank matrix rank or None)
REDUCTIONS = {"fp32": (None, None), "bf16": ("bfloat16", None), "low-rank r=1": (None, 1), "low-rank r=4": (None, 4)}
VARIANT = dict(method="sdp", level="neuron", regime="forward", coverage=0.5)  # the study's best SDP variant
TIMEOUT = 600.0


class CompressedSDP(SDPMethod):
    """The CLI's SDPMethod (training step, evaluation, reports) around an engine with a chosen
    gradient reduction (the CLI has no option for one)."""

    def __init__(self, model, plan, reduction: str):
        Method.__init__(self, model)
        wire_dtype, matrix_rank = REDUCTIONS[reduction]
        config = SDPConfig(regime=VARIANT["regime"], strategy="groups", timeout=TIMEOUT, reduce_dtype=wire_dtype)
        self.sdp = SubnetDataParallel(model, plan, config)
        if matrix_rank is not None:
            self.sdp.register_comm_hook(LowRankState(matrix_rank=matrix_rank), low_rank_hook)
        self.plan, self.simulated = plan, False


# The sizes of the study's former quick profile (pysrc and digits), which bench/results/compression-cpu.md
# was measured at; the optimizer as then: AdamW (0.9, 0.999), decay on every parameter, no clipping.
_OPTIMIZER = dict(min_lr=0.0, beta2=0.999, decay="all", grad_clip=None)
TASK_SIZES = {
    "pysrc": dict(_OPTIMIZER, model="gpt", preset="deep", data="pysrc", lr=2e-3, weight_decay=0.0, seq_len=64,
                  batch_size=4, steps=28, eval_every=14, eval_sequences=24, warmup_steps=3),
    "digits": dict(_OPTIMIZER, model="mlp", preset=None, data="digits", seq_len=1, batch_size=32,
                   eval_sequences=None, lr=3e-3, weight_decay=0.0, steps=24, eval_every=12, warmup_steps=3)}


def sizes_of(task_name: str, steps: int | None) -> dict:
    """The sizes of a task (TASK_SIZES; steps replaced when given)."""
    sizes = dict(TASK_SIZES[task_name])
    if steps:
        sizes["steps"] = steps
        sizes["warmup_steps"] = min(sizes["warmup_steps"], steps - 1)
    return sizes


class Run:
    """One engine training one task: its model, optimizer and optimizer step."""

    def __init__(self, task_name: str, seed: int, reduction: str, sizes: dict, device, task=None):
        world = dist.get_world_size()
        cfg = dict(VARIANT, task=task_name, seed=seed)
        self.args = training_args(**training_overrides(cfg, sizes, TIMEOUT, device.type))
        self.task = task or build_task(sizes["data"], sizes["model"], sizes["preset"], sizes["batch_size"],
                                       sizes["seq_len"], seed, eval_sequences=sizes["eval_sequences"])
        torch.manual_seed(seed)  # the same initial model on every rank and for every reduction
        model = self.task.make_model().to(device)
        sample = sample_input_for(self.args.model, model, self.args.seq_len, self.args.data)
        plan = plan_subnetworks(model, world_size=world, coverage=VARIANT["coverage"], level=VARIANT["level"],
                                seed=seed, sample_input=sample)
        self.method = CompressedSDP(model, plan, reduction)
        self.optimizer = make_optimizer(self.method.parameters(), self.args)
        self.stepper = OptimizerStep(self.method, self.optimizer, NonFiniteGuard(None, timeout=TIMEOUT), self.args,
                                     device)
        self.device, self.step, self.times, self.losses = device, 0, [], []

    def step_once(self) -> None:
        """One optimizer step, timed (its loss kept on the device until the end)."""
        t0 = time.perf_counter()
        loss = self.stepper.accumulate(self.task, self.step, dist.get_rank(), dist.get_world_size())
        self.stepper.finish(self.step + 1)
        self.method.after_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.times.append(time.perf_counter() - t0)
        self.losses.append(loss)
        self.step += 1


def _slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _train(job: dict, spec: dict, device) -> None:
    """One training run (task, seed, reduction); rank 0 writes its JSON."""
    sizes = sizes_of(job["task"], spec["steps"])
    run = Run(job["task"], job["seed"], job["reduction"], sizes, device)
    for _ in range(sizes["steps"]):
        run.step_once()
    batches = list(run.task.eval_batches())
    loss = evaluate_method("sdp", run.method, run.task, batches, device, every_model=False)["loss"]["full"]
    stats = run.method.sdp.comm_stats()
    gradient_bytes, collectives = stats["by_quantity"]["gradients"]
    timed = run.times[1:] or run.times  # the first step allocates buckets and draws the low-rank Qs
    record = dict(job, steps=run.step, loss=loss,
                  train_loss=float(torch.stack(run.losses[-5:]).mean()),
                  bytes_per_step=gradient_bytes / run.step, collectives_per_step=collectives / run.step,
                  predicted_bytes=stats["predicted_per_sync"]["bytes"], reduction_name=stats["reduction"],
                  step_seconds=_slowest(statistics.median(timed)))
    if dist.get_rank() == 0:
        path = os.path.join(spec["work"], "train", f"{job['task']}-{job['seed']}-{job['reduction']}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(record, f)
        print(f"[compression] K={dist.get_world_size()} {job['task']} seed {job['seed']} {job['reduction']}: "
              f"loss {loss:.4f}, {record['bytes_per_step'] / 1024:.1f} KiB/step", flush=True)


def _interleaved(task_name: str, spec: dict, device) -> dict:
    """{reduction: [slowest rank's median step seconds per round]}: every reduction's engine built
    once, then `rounds` rounds of `window` steps of each in turn (the order rotated per round)."""
    sizes = sizes_of(task_name, None)
    names = list(REDUCTIONS)
    runs = {}
    for name in names:
        runs[name] = Run(task_name, 0, name, sizes, device, task=runs[names[0]].task if runs else None)
        runs[name].step_once()  # warm-up: buckets, homes, the low-rank state
    per_round = {name: [] for name in names}
    for r in range(spec["rounds"]):
        for name in names[r % len(names):] + names[:r % len(names)]:
            run = runs[name]
            start = len(run.times)
            for _ in range(spec["window"]):
                run.step_once()
            per_round[name].append(_slowest(statistics.median(run.times[start:])))
    return per_round


def run_group(spec: dict) -> None:
    """Entry point of every rank (subnet_ext.jobs.launch.spawn_local): spec = {"mode": "train" | "time",
    "work", "steps", "jobs" (train), "tasks", "rounds", "window" (time)}."""
    backend, device = pick_backend("auto", "cpu")
    init_distributed(backend, timeout_s=TIMEOUT, device=device)
    torch.set_num_threads(1)
    if spec["mode"] == "train":
        for job in spec["jobs"]:
            _train(job, spec, device)
            gc.collect()
            dist.barrier()
        return
    timing = {task: _interleaved(task, spec, device) for task in spec["tasks"]}
    if dist.get_rank() == 0:
        with open(os.path.join(spec["work"], f"timing-K{dist.get_world_size()}.json"), "w") as f:
            json.dump(timing, f)

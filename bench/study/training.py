"""One training run of the study: the wrapped model, its optimizer, its learning-rate schedule,
its counters (step, tokens, FLOPs, training seconds), one metered step, and the snapshots its
cooldown branches start from.

The schedule is warmup-stable-decay: a linear warmup, then the constant rate of the stable
trajectory; a cooldown branch (runs.py) restores the snapshot taken at its first step
and decays the rate linearly to 1/d of it over its d steps. Everything a step reads is a
pure function of the step number (the batches, stochastic depth's draws), so a branch
restored at step b trains exactly as a run that had decayed from b.
"""
from __future__ import annotations

import contextlib
import copy
import math
import time
import types

import torch
import torch.distributed as dist

from .measure import counting_flops
from .runs import batch_size_of, training_overrides
from subnet_ext.jobs.arguments import training_args
from subnet_ext.jobs.loop import make_method
from subnet_ext.jobs.stochastic_depth import StochasticDepth
from subnet_ext.jobs.training import OptimizerStep, apply_activation_checkpointing, make_optimizer
from subnet_ext.engine.guards.nonfinite_guard import NonFiniteGuard
from subnet_ext.measure.step_memory import StepMemoryMeter

TRAIN_LOSSES = 8  # the training loss of this many first steps of the stable trajectory is recorded


def lr_factor(step: int, warmup: int, cooldown: tuple[int, int] | None = None) -> float:
    """Warmup-stable-decay: the learning rate of optimizer step `step` (0-based) as a fraction of the
    peak: (step + 1) / warmup during the warmup, 1 on the stable trajectory, and in a cooldown branch
    (first, end) (end - step) / (end - first): 1 at its first step, 1/d at its last (d = end - first)."""
    if cooldown is not None and cooldown[0] <= step < cooldown[1]:
        return (cooldown[1] - step) / (cooldown[1] - cooldown[0])
    return (step + 1) / warmup if step < warmup else 1.0


def recipe_lr_factor(step: int, warmup: int, total: int, floor: float) -> float:
    """nanoGPT's schedule (train.py get_lr) as a fraction of the peak: (step + 1) / (warmup + 1) during
    the warmup, then a cosine from 1 to `floor` (min_lr / lr) at step `total`, `floor` after."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if step > total:
        return floor
    return floor + 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / (total - warmup))) * (1.0 - floor)


class Run:
    """One training run of configuration `cfg` (runs.py) on this rank; collective to build."""

    def __init__(self, cfg: dict, profile: dict, device, task, reference: dict):
        from subnet_ext.measure.storage import proc_status_bytes

        self.rss_at_start = proc_status_bytes("VmRSS")  # before the model: what this configuration adds is above it
        self.cfg, self.device, self.task, self.reference = cfg, device, task, reference
        self.sizes = profile["tasks"][cfg["task"]]
        self.batch_size = batch_size_of(cfg, self.sizes)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.args = training_args(**training_overrides(cfg, self.sizes, profile["timeout"], device.type))
        torch.manual_seed(cfg["seed"])  # the same initial model on every rank
        model = task.make_model().to(device)
        if cfg.get("activation_checkpointing"):
            apply_activation_checkpointing(model)
        self.stochastic = None
        if cfg.get("stochastic_depth"):
            self.stochastic = StochasticDepth(model, cfg["stochastic_depth"], cfg["seed"], self.rank)
        self.method = make_method(self.args, model, device, self.stochastic)
        self.optimizer = make_optimizer(self.method.parameters(), self.args)
        self.step, self.flops, self.seconds, self.steps_taken = 0, 0.0, 0.0, 0
        self.cooldown = None  # (first step, end step) of the cooldown branch being trained
        self.step_flops = self.counted_step_flops = None
        self.meter_at, self.meter, self.memory, self.times = None, None, None, []
        self.curve, self.marks, self.train_losses = [], {}, {}
        self._counted = False
        self.started, self.cpu_started = time.perf_counter(), time.process_time()

    # ------------------------------------------------------------------ stepping
    def _stepper(self) -> OptimizerStep:
        if not hasattr(self, "_optimizer_step"):
            guard = NonFiniteGuard(None, timeout=self.args.timeout)
            self._optimizer_step = OptimizerStep(self.method, self.optimizer, guard, self.args, self.device,
                                                 taken=self.step)
            self._optimizer_step.scheduler = types.SimpleNamespace(step=lambda: None)  # the rate is set per step
        return self._optimizer_step

    def step_once(self) -> None:
        """One optimizer step at the schedule's rate; the run's first step is counted by FlopCounterMode,
        the step `meter_at` by the StepMemoryMeter (neither is timed)."""
        stepper = self._stepper()
        if self.cfg.get("schedule") == "cosine":  # the anchor: the published recipe's own schedule
            factor = recipe_lr_factor(self.step, self.sizes["warmup_steps"], self.sizes["steps"],
                                      self.sizes["min_lr"] / self.sizes["lr"])
        else:
            factor = lr_factor(self.step, self.sizes["warmup_steps"], self.cooldown)
        for group in self.optimizer.param_groups:
            group["lr"] = self.args.lr * factor
        counting = not self._counted
        metering = self.step == self.meter_at and self.meter is None
        counter = counting_flops() if counting else None
        meter = StepMemoryMeter([self.method.module], [self.optimizer], self.device) if metering else None
        task = self.task
        if metering:  # the batch fetched outside the meter: the dataset's storage is not the step's memory
            task = _Prefetched(self.task, self.task.batch(self.step, self.rank, self.world))
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            for context in (meter, counter):  # both on one step only when a branch is that short
                if context is not None:
                    stack.enter_context(context)
            loss = stepper.accumulate(task, self.step, self.rank, self.world)
            stepper.finish(self.step + 1)  # the study never skips a step
        if self.cooldown is None and self.step < TRAIN_LOSSES and self.step not in self.train_losses:
            self.train_losses[self.step] = float(loss)  # the first steps' losses: derived runs are checked on them
        # Gradients still held: the largest over the run (AdamW creates its state at the first update).
        memory = self.method.memory(self.optimizer)
        if self.memory is None or memory["model_state"] > self.memory["model_state"]:
            self.memory = memory
        self.method.after_step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if counting:
            self._counted = True
            self.counted_step_flops = float(counter.get_total_flops())
            self.step_flops = _all_sum(self.counted_step_flops, self.device)
        if metering:
            self.meter = dict(meter.result(), step=self.step)
        if not counting and not metering:
            self.times.append(dt)
        self.seconds += self.step_time() if counting or metering else dt  # untimed steps count as typical ones
        self.flops += self.flops_of_step(self.step)
        self.step += 1
        self.steps_taken += 1

    def step_time(self) -> float:
        """The median of this run's timed steps so far (0 before the first)."""
        t = sorted(self.times)
        return t[len(t) // 2] if t else 0.0

    def flops_of_step(self, step: int) -> float:
        """FLOPs of optimizer step `step` summed over ranks: the counted first step, or with stochastic
        depth the full model's minus the blocks each rank drops at that step (a function of the step)."""
        if self.stochastic is None:
            return self.step_flops
        blocks = list(self.reference["blocks"].values())
        return sum(self.reference["rank_flops"] - sum(f for f, k in zip(blocks, self.stochastic.kept_blocks(step, r))
                                                      if not k) for r in range(self.world))

    def tokens_at(self, step: int) -> int:
        """Training tokens (or samples) of all ranks after `step` steps."""
        return step * self.world * self.batch_size * self.sizes["seq_len"]

    # ------------------------------------------------------------------ branches
    def _state_tensors(self) -> list:
        module = self.method.module
        return [getattr(t, "_local_tensor", t) for t in [*module.parameters(), *module.buffers()]]

    def snapshot(self) -> dict:
        """This rank's parameters, buffers, optimizer state and counters, to branch from later."""
        return {"tensors": [t.detach().clone() for t in self._state_tensors()],
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "counters": (self.step, self.flops, self.seconds)}

    @torch.no_grad()
    def restore(self, snap: dict) -> None:
        """Back to a snapshot of this run (every rank restores its own, taken at the same step)."""
        for t, saved in zip(self._state_tensors(), snap["tensors"], strict=True):
            t.copy_(saved)
        self.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
        self.step, self.flops, self.seconds = snap["counters"]
        if self.stochastic is not None:
            self.stochastic.step = self.step

    # ------------------------------------------------------------------ what a result records
    def global_seconds(self) -> float:
        """Training seconds so far of the slowest rank (collective)."""
        t = torch.tensor([self.seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def measurements(self) -> dict:
        """This rank's costs: the metered step's peak memory and its split, the model state held,
        peak RSS, the counted step's FLOPs, the median step time, CPU seconds."""
        from subnet_ext.measure.storage import proc_status_bytes

        return {"rank": self.rank, "meter": self.meter, "memory": self.memory,
                "peak_rss_bytes": proc_status_bytes("VmHWM"), "rss_at_start_bytes": self.rss_at_start,
                "counted_step_flops": self.counted_step_flops,
                "cpu_seconds": time.process_time() - self.cpu_started, "step_time_s": self.step_time(),
                "timed_steps": len(self.times), "steps_taken": self.steps_taken, "train_losses": self.train_losses}

    def close(self) -> None:
        """Destroy the owner-set process groups SDP made (a long study would otherwise accumulate them)."""
        sdp = getattr(self.method, "sdp", None)
        groups = getattr(getattr(sdp, "_comm", None), "groups", {}) or {}
        for group in {id(g): g for g in groups.values()}.values():
            if group is not dist.group.WORLD and group is not None:
                dist.destroy_process_group(group)


class _Prefetched:
    """A task whose batch was fetched already (one micro-batch per step: the study never accumulates)."""

    def __init__(self, task, batch):
        self.task, self.fetched = task, batch

    def batch(self, *args, **kwargs):
        """The fetched (inputs, targets)."""
        return self.fetched

    def loss(self, output, targets):
        """The task's loss."""
        return self.task.loss(output, targets)


def _all_sum(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())

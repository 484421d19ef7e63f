"""One launched group of K ranks running many study configurations, one after another.

Launching K processes costs seconds (torch's import, the rendezvous), so each world size
is launched once and every configuration of it (methods x seeds) runs inside, each with
a fresh model, wrapper, optimizer and, for SDP, its own owner-set process groups
(destroyed afterwards). Rank 0 writes one JSON per configuration as soon as it finishes,
so an interrupted study resumes with the configurations still missing.

One configuration trains with the CLI's pieces (build_task, make_method, OptimizerStep,
the non-finite guard) and the study's stopping rule (study_runs.py): at least `steps`
optimizer steps, and until it has spent the DDP run's FLOPs and wall time of the same
seed (equal iterations, FLOP-matched and equal-time protocols from one constant-rate
run). Evaluations on a fixed step grid and at each protocol's mark; in between, the
curve records step, tokens, FLOPs (sum over ranks) and training seconds (slowest rank).
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import time

import torch
import torch.distributed as dist

from study_eval import evaluate_method
from study_measure import (block_training_flops, counting_flops, register_masked_linear_flops, reset_peak_rss)
from study_runs import result_path, training_overrides
from subnet_ext.cli.arguments import training_args
from subnet_ext.cli.launch import init_distributed, pick_backend
from subnet_ext.cli.loop import make_method
from subnet_ext.cli.methods import ActivationMeter, proc_status_bytes
from subnet_ext.cli.stochastic_depth import StochasticDepth, residual_branches
from subnet_ext.cli.tasks import build_task
from subnet_ext.cli.training import OptimizerStep, apply_activation_checkpointing, make_optimizer
from subnet_ext.engine.guard import NonFiniteGuard

MAX_EXTENSION = 10  # a run stops at 10 x `steps` whatever its budgets say (flagged "capped")
# The equal-time mark waits at most this many times the steps the other marks needed: on a machine
# whose load changes, a run can be much faster per step than DDP was, and the study has a time budget.
TIME_EXTENSION = 2.0


def run_group(spec: dict) -> None:
    """Entry point of every rank (subnet_ext.cli.launch.spawn_local): spec = {"device", "profile",
    "out", "jobs": [{"config": cfg, "phases": [cfg, ...]}, ...]}."""
    backend, device = pick_backend("auto", spec["device"])
    init_distributed(backend, timeout_s=spec["profile"]["timeout"], device=device)
    register_masked_linear_flops()
    for job in spec["jobs"]:
        _run_job(job, spec, device)
        gc.collect()  # the finished configurations' models and groups, before the next one measures
        dist.barrier()


class Run:
    """One training run: the wrapped model, its optimizer and the counters the curve records."""

    def __init__(self, cfg: dict, profile: dict, device, task, reference: dict):
        self.cfg, self.device, self.task = cfg, device, task
        self.sizes = profile["tasks"][cfg["task"]]
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.args = training_args(**training_overrides(cfg, self.sizes, profile["timeout"], device.type))
        torch.manual_seed(cfg["seed"])  # the same initial model on every rank
        model = task.make_model().to(device)
        if cfg.get("activation_checkpointing"):
            apply_activation_checkpointing(model)
        drop = cfg.get("stochastic_depth", 0.0)
        self.stochastic = StochasticDepth(model, drop, cfg["seed"], self.rank) if drop else None
        self.method = make_method(self.args, model, device, self.stochastic)
        self.optimizer = make_optimizer(self.method.parameters(), self.args)
        self.reference = reference  # the full model's training FLOPs per rank batch, and per block
        self.step, self.flops, self.seconds = 0, 0.0, 0.0
        self.step_flops = None  # FLOPs of a step, summed over ranks (deterministic methods)
        self.counted_step_flops = None  # FlopCounterMode's count of this rank's first step
        self.activation_bytes, self.memory, self.times, self.curve = [], None, [], []
        self.started = time.perf_counter()  # the configuration's wall time, setup and evaluations included
        self.cpu_started = time.process_time()  # and this rank's CPU time (a loaded machine's budget estimate)

    def start_at(self, step: int, flops: float, seconds: float) -> None:
        """Continue a run from another's counters (a final phase resumed from a snapshot)."""
        self.step, self.flops, self.seconds = step, flops, seconds
        if self.stochastic is not None:
            self.stochastic.step = step

    def _stepper(self) -> OptimizerStep:
        if not hasattr(self, "_optimizer_step"):
            guard = NonFiniteGuard(None, timeout=self.args.timeout)
            self._optimizer_step = OptimizerStep(self.method, self.optimizer, guard, self.args, self.device,
                                                 taken=self.step)
        return self._optimizer_step

    def step_once(self) -> float:
        """One optimizer step (the first under the FLOP counter); returns its loss."""
        stepper, first = self._stepper(), not self.times
        meter = ActivationMeter()
        t0 = time.perf_counter()
        counter = counting_flops() if first else None
        with counter if counter is not None else contextlib.nullcontext():
            loss = stepper.accumulate(self.task, self.step, self.rank, self.world, meter=meter)
            stepper.finish(self.step + 1)  # a skipped step is skipped on the device; the study never skips
        # Gradients still held. The largest over the run: with stochastic depth a dropped block has no
        # gradient, and AdamW creates a parameter's state at its first update, so step 0 can undercount.
        memory = self.method.memory(self.optimizer)
        if self.memory is None or memory["model_state"] > self.memory["model_state"]:
            self.memory = memory
        self.method.after_step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        # The first step carries one-off costs (allocation, FLOP counting): it is timed as the second.
        self.times.append(dt)
        self.seconds += dt if not first else 0.0
        if len(self.times) == 2:
            self.seconds += dt
        self.activation_bytes.append(meter.bytes)
        if counter is not None:
            self.counted_step_flops = float(counter.get_total_flops())
            self.step_flops = _all_sum(self.counted_step_flops, self.device)
        self.flops += self._flops_of_step(self.step)
        self.step += 1
        return loss

    def _flops_of_step(self, step: int) -> float:
        if self.stochastic is None:
            return self.step_flops
        # Stochastic depth: each rank's step is the full model's minus the blocks it dropped.
        blocks = list(self.reference["blocks"].values())
        total = 0.0
        for r in range(self.world):
            kept = self.stochastic.kept_blocks(step, r)
            total += self.reference["rank_flops"] - sum(f for f, k in zip(blocks, kept) if not k)
        return total

    def global_seconds(self) -> float:
        """Training seconds so far of the slowest rank (collective)."""
        t = torch.tensor([self.seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def evaluate(self, marks: list[str], batches: list) -> dict:
        """Evaluate every model of the run (collective) and append the point to the curve."""
        kind = self.cfg["method"]
        stepper = getattr(self, "_optimizer_step", None)
        if stepper is not None:  # the skip decisions kept on the device since the last point, read in one copy
            stepper.guard.settle()
        # Every model a user could keep at the protocols' marks; the full model alone elsewhere (the curves).
        every_model = bool(set(marks) - {"start"})
        losses = evaluate_method(kind, self.method, self.task, batches, self.device, self.stochastic, every_model)
        point = {"step": self.step, "tokens": self.step * self.world * self.sizes["batch_size"]
                 * self.sizes["seq_len"], "flops": self.flops, "seconds": self.global_seconds(),
                 "marks": marks, **losses}
        self.curve.append(point)
        return point

    def measurements(self) -> dict:
        """This rank's costs: model state, activations saved for backward, peak RSS, FLOPs."""
        acts = self.activation_bytes or [0]
        cuda = self.device.type == "cuda"
        return {"rank": self.rank, "memory": self.memory, "activation_bytes_max": max(acts),
                "peak_cuda_bytes": torch.cuda.max_memory_allocated(self.device) if cuda else None,
                "activation_bytes_mean": sum(acts) / len(acts), "peak_rss_bytes": proc_status_bytes("VmHWM"),
                "counted_step_flops": self.counted_step_flops, "cpu_seconds": time.process_time() - self.cpu_started,
                "step_time_s": sorted(self.times[1:] or self.times)[len(self.times[1:] or self.times) // 2]}

    def close(self) -> None:
        """Destroy the owner-set process groups SDP made (a long study would otherwise accumulate them)."""
        sdp = getattr(self.method, "sdp", None)
        groups = getattr(getattr(sdp, "_comm", None), "groups", {}) or {}
        for group in {id(g): g for g in groups.values()}.values():
            if group is not dist.group.WORLD and group is not None:
                dist.destroy_process_group(group)


def _all_sum(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def _reference(task, device) -> dict:
    """The full model's FLOPs for one rank's batch (forward + backward) and each block's share."""
    torch.manual_seed(0)
    model = task.make_model().to(device)
    x, y = task.batch(0, 0, 1)
    total, blocks = block_training_flops(model, list(residual_branches(model)), (x.to(device), y.to(device)))
    return {"rank_flops": total, "blocks": blocks}


def _baseline(spec: dict, cfg: dict) -> dict | None:
    """The DDP run of the same world size and seed (its FLOPs per step and seconds at `steps`)."""
    if cfg["name"] == cfg["baseline"]:
        return None
    path = result_path(spec["out"], cfg["task"], cfg["K"], cfg["seed"], cfg["baseline"])
    with open(path) as f:
        base = json.load(f)
    at_steps = next(p for p in base["curve"] if "tokens" in p["marks"])
    return {"flops": at_steps["flops"], "seconds": at_steps["seconds"]}


def _eval_batches(task) -> list:
    return list(task.eval_batches())


def _run_job(job: dict, spec: dict, device) -> None:
    """A configuration and the final phases that branch off it (study_runs.jobs)."""
    cfg, profile = job["config"], spec["profile"]
    sizes = profile["tasks"][cfg["task"]]
    task = build_task(sizes["data"], sizes["model"], sizes["preset"], sizes["batch_size"], sizes["seq_len"],
                      cfg["seed"], eval_sequences=sizes["eval_sequences"])
    batches = _eval_batches(task)
    reference = _reference(task, device)
    base = _baseline(spec, cfg)
    steps = sizes["steps"]
    branch_at = steps - round(profile["phase_fraction"] * steps) if job["phases"] else None
    run, snapshot = _train(cfg, profile, device, task, reference, base, batches, branch_at)
    _write(spec, cfg, run, reference, base)
    run.close()
    del run
    gc.collect()
    for phase in job["phases"]:
        prun = Run(phase, profile, device, task, reference)
        prun.method.sdp.load_full_state_dict(snapshot["model"])
        prun.method.sdp.load_full_optimizer_state_dict(prun.optimizer, snapshot["optimizer"])
        prun.start_at(branch_at, snapshot["flops"], snapshot["seconds"])
        prun.curve = [dict(p) for p in snapshot["curve"]]
        _continue(prun, sizes["eval_every"], batches, stop=steps)
        _write(spec, phase, prun, reference, base)
        prun.close()


def _reset_peaks(device) -> None:
    """Peak RSS (and on a GPU the allocator's peak) measured from here: one configuration's."""
    reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _train(cfg, profile, device, task, reference, base, batches, branch_at):
    """The main run, with the stopping rule of the module docstring; returns (run, phase snapshot)."""
    _reset_peaks(device)
    run = Run(cfg, profile, device, task, reference)
    steps, every, check = run.sizes["steps"], run.sizes["eval_every"], profile["time_check_every"]
    pending = {"tokens"} | ({"flops", "seconds"} if base else set())
    snapshot, others_done_at = None, None
    run.evaluate(["start"], batches)
    while pending and run.step < MAX_EXTENSION * steps:
        run.step_once()
        marks = []
        if run.step == steps:
            marks.append("tokens")
        if "flops" in pending and run.flops >= base["flops"]:
            marks.append("flops")
        if "seconds" in pending and (run.step % check == 0 or run.step == steps) and \
                run.global_seconds() >= base["seconds"]:
            marks.append("seconds")
        pending -= set(marks)
        if pending == {"seconds"}:
            others_done_at = others_done_at or run.step
            if run.step >= TIME_EXTENSION * others_done_at:  # the time mark is not reached: say so
                marks.append("seconds_not_reached")
                pending.clear()
        on_grid = run.step % (every if run.step <= steps else 2 * every) == 0  # sparser past `steps`
        if marks or on_grid or not pending:
            run.evaluate(marks + ([] if pending else ["end"]), batches)
        if run.step == branch_at:
            snapshot = {"model": run.method.sdp.full_state_dict(),  # on every rank: each loads its pieces
                        "optimizer": run.method.sdp.full_optimizer_state_dict(run.optimizer),
                        "flops": run.flops, "seconds": run.seconds, "curve": [dict(p) for p in run.curve]}
    run.capped = bool(pending)
    return run, snapshot


def _continue(run: Run, every: int, batches: list, stop: int) -> None:
    """A final phase: steps from its start to `stop`, evaluated on the grid and at the end."""
    _reset_peaks(run.device)
    while run.step < stop:
        run.step_once()
        if run.step % every == 0 or run.step == stop:
            run.evaluate(["tokens", "end"] if run.step == stop else [], batches)
    run.capped = False


def _write(spec: dict, cfg: dict, run: Run, reference: dict, base: dict | None) -> None:
    """Gather every rank's measurements; rank 0 writes the configuration's JSON and a progress line."""
    per_rank = [None] * run.world
    dist.all_gather_object(per_rank, run.measurements())
    comm = run.method.comm()
    if run.rank != 0:
        return
    plan = getattr(run.method, "plan", None)
    wall = time.perf_counter() - run.started
    result = {"config": cfg, "profile": spec["profile"], "world_size": run.world, "steps_done": run.step,
              "wall_seconds": wall,
              "capped": run.capped, "step_flops": run.step_flops, "reference": reference, "baseline": base,
              "per_rank": per_rank, "comm": comm, "curve": run.curve,
              "plan": None if plan is None else {"level": plan.level, "coverage": plan.coverage,
                                                 "owner_count": [int(c) for c in plan.owner_count],
                                                 "units": [u.group for u in plan.units]}}
    path = result_path(spec["out"], cfg["task"], cfg["K"], cfg["seed"], cfg["name"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    last = run.curve[-1]
    print(f"[study] {cfg['task']} K={cfg['K']} seed {cfg['seed']} {cfg['name']}: {run.step} steps, val loss "
          f"{last['loss']['full']:.4f}, {last['seconds']:.1f} s training, {wall:.1f} s in all", flush=True)

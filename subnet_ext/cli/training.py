"""The optimizer step of `subnet-train`, the same for every method: precision (autocast,
loss scaling), gradient accumulation, clipping, the learning-rate schedule.

One `OptimizerStep` per run. Per step: N micro-batches (the first N-1 backwards without
communication, the loss divided by N), then either the scaler's decision (fp16: the
scaler finds inf/NaN and skips) or the NonFiniteGuard's all-reduced flag (fp32/bf16),
then clipping of the synchronised gradient, the optimizer step and the scheduler step
(only when the optimizer stepped). Every decision is agreed by all ranks.
"""
from __future__ import annotations

import contextlib
import functools
import math
import types

import torch
import torch.nn as nn

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
LR_SCHEDULES = ("constant", "cosine")
# What the optimizer step does: recorded in every report ("training") and checkpoint identity.
TRAINING_KEYS = ("lr", "weight_decay", "lr_schedule", "warmup_steps", "grad_accum", "grad_clip", "precision",
                 "activation_checkpointing", "compile", "stochastic_depth")


def training_settings(args) -> dict:
    """{setting: value} of TRAINING_KEYS for a run's arguments."""
    return {k: getattr(args, k, None) for k in TRAINING_KEYS}


def lr_factor(taken: int, total: int, warmup: int, schedule: str) -> float:
    """The learning rate of the optimizer step that follows `taken` steps, as a fraction of --lr.

    Linear warmup over `warmup` steps ((taken + 1) / warmup), then constant or a cosine
    from 1 to 0 over the remaining `total - warmup` steps.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(LR_SCHEDULES)}, got {schedule!r}")
    if taken < warmup:
        return (taken + 1) / warmup
    if schedule == "constant":
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * (taken - warmup) / max(1, total - warmup)))


def make_scheduler(optimizer, base_lr: float, total: int, warmup: int, schedule: str, taken: int = 0):
    """LambdaLR with `lr_factor`, positioned after `taken` optimizer steps (a resumed run)."""
    for group in optimizer.param_groups:  # a resumed optimizer's lr is the decayed one: start from --lr
        group["lr"] = base_lr
        group.pop("initial_lr", None)
    factor = functools.partial(lr_factor, total=total, warmup=warmup, schedule=schedule)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=-1)
    if taken:
        scheduler.last_epoch = taken  # LambdaLR's lr is closed-form in last_epoch
        for group, lr in zip(optimizer.param_groups, scheduler.get_lr()):
            group["lr"] = lr
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    return scheduler


def make_scaler(method_name: str, precision: str, device: torch.device, timeout: float | None):
    """fp16 only: torch.amp.GradScaler for ddp (gradients are all-reduced, so every rank
    finds the same inf); subnet_ext.GradScaler for sdp (an inf in a unit is seen only by
    its owners) and fsdp (each rank checks only its shard of the gradient): their
    found-inf flag is all-reduced, so every rank skips the same steps."""
    if precision != "fp16":
        return None
    if method_name == "ddp":
        return torch.amp.GradScaler(device.type)
    from ..engine.grad_scaler import GradScaler

    return GradScaler(device.type, timeout=timeout)


def autocast(device: torch.device, precision: str):
    """The autocast context of the forward + loss (a no-op context for fp32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if PRECISIONS[precision] is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=PRECISIONS[precision])


def _checkpointed_forward(self, *args, **kwargs):
    """The block's class forward, recomputed in backward (non-reentrant checkpoint).

    Installed as a method bound to the block (types.MethodType), not as a closure over
    the block's bound forward: a deep copy of the model (the planner's meta copy for FLOP
    tracing, the engine's skeleton) then calls its own copy, not the original block."""
    return torch.utils.checkpoint.checkpoint(type(self).forward, self, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute each residual block in backward instead of keeping its activations.

    The project's blocks (llama decoder layers, GPT blocks, ResNet BasicBlock/Bottleneck,
    residual-MLP blocks) get their instance `forward` wrapped in non-reentrant
    torch.utils.checkpoint: parameter names and modules stay as they are, so the plan, SDP's
    surgery (which may replace a whole block) and DDP/FSDP wrapping see the same model. A transformers model
    uses its own gradient_checkpointing_enable. Call before wrapping. Returns the number
    of blocks wrapped (-1: the transformers model's own mechanism).

    Raises:
        ValueError: the model has none of these blocks.
    """
    from ..models.gpt import Block, ParallelBlock
    from ..models.hf import HFCausalLM
    from ..models.llama import LlamaDecoderLayer
    from ..models.residual_mlp import ResidualMLPBlock
    from ..models.resnet import BasicBlock, Bottleneck

    if isinstance(model, HFCausalLM):
        model.gradient_checkpointing_enable()
        return -1
    kinds = (LlamaDecoderLayer, Block, ParallelBlock, ResidualMLPBlock, BasicBlock, Bottleneck)
    blocks = [m for m in model.modules() if isinstance(m, kinds)]
    if not blocks:
        raise ValueError(f"--activation-checkpointing: {type(model).__name__} has no residual blocks to checkpoint")
    for block in blocks:
        block.forward = types.MethodType(_checkpointed_forward, block)
    return len(blocks)


class OptimizerStep:
    """One optimizer step of a run: micro-batches, the skip decision, clipping, the step.

    A step reads one number to the host: its skip decision (the guard's all-reduced flag,
    or inside the fp16 scaler's `step`, as torch DDP + GradScaler do). The loss and the
    gradient norm stay on the device (the loop reads them every --log-every steps), and
    whether the scaler stepped is seen by an optimizer step hook, not by reading the scale.

    Args:
        method: the wrapped model (methods.Method: __call__, parameters, no_sync, clip_grad_norm_).
        optimizer: over method.parameters().
        guard: engine.guard.NonFiniteGuard (its skipped_steps also receive the scaler's skips).
        args: grad_accum, grad_clip, precision, lr, lr_schedule, warmup_steps, steps, timeout.
        taken: optimizer steps already taken (a resumed run), to position the schedule.
    """

    def __init__(self, method, optimizer, guard, args, device: torch.device, taken: int = 0):
        self.method, self.optimizer, self.guard, self.device = method, optimizer, guard, device
        self.micro_steps, self.max_norm, self.precision = args.grad_accum, args.grad_clip, args.precision
        self.scaler = make_scaler(method.name, args.precision, device, args.timeout)
        self.scheduler = make_scheduler(optimizer, args.lr, args.steps, args.warmup_steps, args.lr_schedule, taken)
        self._stepped = False
        optimizer.register_step_post_hook(self._saw_step)

    def _saw_step(self, optimizer, args, kwargs) -> None:
        self._stepped = True

    def accumulate(self, task, step: int, rank: int, world: int, meter=None) -> torch.Tensor:
        """Forward + backward of the step's micro-batches; returns their mean loss, a 0-d
        tensor on the device (not read here: reading it would wait for the backward).

        `meter` (a context manager, e.g. ActivationMeter) wraps the first forward only.
        """
        total = None
        for micro in range(self.micro_steps):
            x, y = task.batch(step, rank, world, micro, self.micro_steps)
            x, y = x.to(self.device), y.to(self.device)
            last = micro == self.micro_steps - 1
            # Forward and backward both inside no_sync (DDP records the sync decision in forward).
            with contextlib.nullcontext() if last else self.method.no_sync():
                with meter if (meter is not None and micro == 0) else contextlib.nullcontext():
                    with autocast(self.device, self.precision):
                        loss = task.loss(self.method(x), y) / self.micro_steps
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total = loss.detach().float() if total is None else total + loss.detach().float()
        return total

    def finish(self, step: int) -> dict:
        """Decide, clip and step after `accumulate`. `step` (1-based) labels a skip.

        Returns {"stepped": bool, "lr": lr of this step, "grad_norm": pre-clip norm of the
        synchronised gradient, a 0-d device tensor (None without --grad-clip or when the
        step was skipped)}.
        """
        lr = self.optimizer.param_groups[0]["lr"]
        norm = None
        self._stepped = False
        if self.scaler is not None:
            # fp16: the scaler's found-inf decides (agreed by all ranks); no second check by the guard.
            self.scaler.unscale_(self.optimizer)
            norm = self._clip()
            self.scaler.step(self.optimizer)  # reads its found-inf flag: the step's one host read
            self.scaler.update()
            stepped = self._stepped  # the scaler called optimizer.step() (the hook saw it)
            if not stepped:
                _count_skip(self.guard, step)
                norm = None
        else:
            stepped = self.guard.should_step(self.method.parameters(), step)
            if stepped:
                norm = self._clip()
                self.optimizer.step()
        if stepped:
            self.scheduler.step()
        return {"stepped": stepped, "lr": lr, "grad_norm": norm}

    def _clip(self):
        if self.max_norm is None:
            return None
        norm = self.method.clip_grad_norm_(self.max_norm)
        return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).detach()


def _count_skip(guard, step: int) -> None:
    """Records a step the scaler skipped in the guard, which enforces --max-skipped."""
    from ..engine.guard import TooManySkippedSteps

    guard.skipped_steps.append(step)
    if guard.max_skipped is not None and guard.skipped > guard.max_skipped:
        raise TooManySkippedSteps(
            f"{guard.skipped} step(s) were skipped by the fp16 loss scaler for inf/NaN gradients (latest: "
            f"{guard.skipped_steps[-5:]}), more than the {guard.max_skipped} allowed (--max-skipped); stopping. "
            "Use --precision bf16, lower the learning rate or clip gradients; resume from the last checkpoint.")

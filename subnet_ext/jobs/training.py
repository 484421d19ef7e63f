"""The optimizer step of `subnet-train`, the same for every method: precision (autocast,
loss scaling), gradient accumulation, clipping, the learning-rate schedule.

One `OptimizerStep` per run. Per step: N micro-batches (the first N-1 backwards without
communication, the loss divided by N), then either the scaler's decision (fp16: the
scaler finds inf/NaN) or the NonFiniteGuard's all-reduced flag (fp32/bf16), then clipping
of the synchronised gradient, the optimizer step and the scheduler step. With clipping the
guard's flag is read off the clipping's norm (NonFiniteGuard.check_norm: the norm of every
gradient, agreed by all ranks, is non-finite exactly when some gradient is), so the step makes
one pass over the gradients and one collective fewer. Every decision is
agreed by all ranks and stays on the device: the optimizer is torch's fused AdamW, which
takes the flag as its `found_inf` and leaves parameters and state unchanged on a skipped
step (as with torch's GradScaler), so nothing is read to the host. The skipped steps reach
the host when the loop settles the guard (every --log-every steps). The schedule advances
every step, skipped ones included (as a scheduler beside torch's GradScaler does).
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn as nn

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
LR_SCHEDULES = ("constant", "cosine")
# What the optimizer step does: recorded in every report ("training") and checkpoint identity.
TRAINING_KEYS = ("lr", "min_lr", "beta2", "weight_decay", "decay", "lr_schedule", "warmup_steps", "grad_accum",
                 "grad_clip", "precision", "activation_checkpointing", "compile", "stochastic_depth")
DECAY_CHOICES = ("all", "matrices")  # what --weight-decay applies to: every parameter, or tensors of 2+ dimensions


def training_settings(args) -> dict:
    """{setting: value} of TRAINING_KEYS for a run's arguments."""
    return {k: getattr(args, k, None) for k in TRAINING_KEYS}


def lr_factor(taken: int, total: int, warmup: int, schedule: str, floor: float = 0.0) -> float:
    """The learning rate of the optimizer step that follows `taken` steps, as a fraction of --lr.

    Linear warmup over `warmup` steps ((taken + 1) / warmup), then constant or a cosine
    from 1 to `floor` (--min-lr / --lr; nanoGPT's min_lr) over the remaining `total - warmup` steps.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(LR_SCHEDULES)}, got {schedule!r}")
    if taken < warmup:
        return (taken + 1) / warmup
    if schedule == "constant":
        return 1.0
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, (taken - warmup) / max(1, total - warmup))))
    return floor + (1.0 - floor) * cosine


def make_optimizer(parameters, args) -> torch.optim.Optimizer:
    """The run's optimizer: torch's AdamW at --lr, betas (0.9, --beta2) and --weight-decay (on every
    parameter, or with --decay matrices on tensors of two or more dimensions only, as nanoGPT and
    most language-model recipes: no decay on biases and norms), fused (one kernel per device and
    dtype), which skips a step on the device when handed a found-inf flag.
    Not fused when FSDP2's DTensors sit beside plain tensors (--shard-shared: fused AdamW
    refuses the mix); such a run decides its skips on the host (OptimizerStep.finish)."""
    parameters = list(parameters)
    sharded = [hasattr(p, "to_local") for p in parameters]
    fused = all(sharded) or not any(sharded)
    groups = [{"params": parameters}]
    if getattr(args, "decay", "all") == "matrices":
        groups = [{"params": [p for p in parameters if p.dim() >= 2]},
                  {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, getattr(args, "beta2", 0.999)),
                             weight_decay=args.weight_decay, fused=fused)


def make_scheduler(optimizer, base_lr: float, total: int, warmup: int, schedule: str, taken: int = 0,
                   min_lr: float = 0.0):
    """LambdaLR with `lr_factor` (its cosine ending at `min_lr`), positioned after `taken` steps (a resumed run)."""
    for group in optimizer.param_groups:  # a resumed optimizer's lr is the decayed one: start from --lr
        group["lr"] = base_lr
        group.pop("initial_lr", None)
    factor = functools.partial(lr_factor, total=total, warmup=warmup, schedule=schedule, floor=min_lr / base_lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=-1)
    if taken:
        scheduler.last_epoch = taken  # LambdaLR's lr is closed-form in last_epoch
        for group, lr in zip(optimizer.param_groups, scheduler.get_lr()):
            group["lr"] = lr
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    return scheduler


def make_scaler(method_name: str, precision: str, device: torch.device):
    """fp16 only: torch.amp.GradScaler for ddp (gradients are all-reduced, so every rank
    finds the same inf); subnet_ext.GradScaler for sdp (an inf in a unit is seen only by
    its owners) and fsdp (each rank checks only its shard of the gradient): their
    found-inf flag is all-reduced, so every rank skips the same steps. That all-reduce is
    waited for in stream order (no host wait on NCCL); its deadline is the world group's
    own timeout (--timeout, given to init_process_group)."""
    if precision != "fp16":
        return None
    if method_name == "ddp":
        return torch.amp.GradScaler(device.type)
    from ..engine.guards.grad_scaler import GradScaler

    return GradScaler(device.type, timeout=None)


def autocast(device: torch.device, precision: str):
    """The autocast context of the forward + loss (a no-op context for fp32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if PRECISIONS[precision] is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=PRECISIONS[precision])


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute each residual block in backward instead of keeping its activations.

    The project's blocks (llama decoder layers, GPT blocks, ResNet BasicBlock/Bottleneck,
    residual-MLP blocks) get torch's composable `checkpoint` (non-reentrant, installed as
    forward hooks): parameter names, modules and classes stay as they are, so the plan, SDP's
    surgery (which may replace a whole block) and DDP/FSDP wrapping see the same model, and a
    copy of the model (the planner's meta copy, the engine's skeleton) checkpoints its own blocks. A transformers model
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
    from torch.distributed._composable import checkpoint

    for block in blocks:
        checkpoint(block)
    return len(blocks)


class OptimizerStep:
    """One optimizer step of a run: micro-batches, the skip decision, clipping, the step.

    A step reads nothing to the host. The skip decision (the guard's all-reduced flag, or
    the fp16 scaler's found-inf, all-reduced by subnet_ext.GradScaler) is a 0-d device
    tensor handed to the fused optimizer (`guard.optimizer_step`, or the scaler's step,
    which does the same for optimizers that support it) and kept in the guard until the
    loop settles it; the loss and the gradient norm stay on the device too (the loop reads
    them every --log-every steps).

    Args:
        method: the wrapped model (methods.Method: ``__call__``, ``parameters``, ``no_sync``, ``clip_grad_norm_``).
        optimizer: over method.parameters(), able to skip on the device (`make_optimizer`).
        guard: engine.guards.nonfinite_guard.NonFiniteGuard (it also keeps the scaler's flags).
        args: grad_accum, grad_clip, precision, lr, min_lr, lr_schedule, warmup_steps, steps.
        taken: steps already taken (a resumed run, skipped ones included), to position the schedule.
        fold_nonfinite_check: with clipping and a norm every rank agrees on, decide the skip
            from the clipping's norm (the default); False: the guard's separate pass and
            all-reduce, as without clipping (bench/nonfinite_fold.py times both).
    An optimizer that takes no found-inf flag (make_optimizer's unfused AdamW beside FSDP2's
    DTensors) has its skips decided on the host: one read of the agreed flag per step.
    """

    def __init__(self, method, optimizer, guard, args, device: torch.device, taken: int = 0,
                 fold_nonfinite_check: bool = True):
        self.method, self.optimizer, self.guard, self.device = method, optimizer, guard, device
        self.fold = fold_nonfinite_check
        self.micro_steps, self.max_norm, self.precision = args.grad_accum, args.grad_clip, args.precision
        self.scaler = make_scaler(method.name, args.precision, device)
        self.scheduler = make_scheduler(optimizer, args.lr, args.steps, args.warmup_steps, args.lr_schedule, taken,
                                        getattr(args, "min_lr", 0.0))

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
        """Decide, clip and step after `accumulate`. `step` (1-based) labels the decision in
        the guard. Collective (every rank steps or skips together).

        Returns {"lr": lr of this step, "grad_norm": pre-clip norm of the synchronised
        gradient, a 0-d device tensor (None without --grad-clip; not finite on a skipped
        step), "skip": the decision, a 0-d float32 device tensor, nonzero: skipped}.
        """
        lr = self.optimizer.param_groups[0]["lr"]
        if self.scaler is not None:
            # fp16: the scaler's found-inf decides (agreed by all ranks); no second check by the guard.
            self.scaler.unscale_(self.optimizer)
            skip = _scaler_found_inf(self.scaler, self.optimizer)
            norm = self._clip()
            self.scaler.step(self.optimizer)  # a fused optimizer gets found_inf: no host read
            self.scaler.update()
            self.guard.record(skip, step)
        else:
            if self.fold and self.max_norm is not None and self.method.clip_norm_is_agreed():
                norm = self._clip(nonfinite_check=True)  # every gradient read once, one all-reduce
                skip = self.guard.check_norm(norm, step)
            else:
                skip = self.guard.check(self.method.parameters(), step)
                norm = self._clip()
            if getattr(self.optimizer, "_step_supports_amp_scaling", False):
                self.guard.optimizer_step(self.optimizer, skip)
            elif skip.item() == 0.0:  # an optimizer that takes no flag (make_optimizer): decided on the host
                self.optimizer.step()
        self.scheduler.step()
        return {"lr": lr, "grad_norm": norm, "skip": skip}

    def _clip(self, nonfinite_check: bool = False):
        if self.max_norm is None:
            return None
        norm = self.method.clip_grad_norm_(self.max_norm, nonfinite_check=nonfinite_check)
        return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).detach()


def _scaler_found_inf(scaler, optimizer) -> torch.Tensor:
    """The scaler's found-inf of this step after `unscale_` (its per-device flags, the same on
    every rank), as one 0-d float32 tensor; taken before `update()`, which may add into them."""
    flags = list(scaler._found_inf_per_device(optimizer).values())
    device = flags[0].device
    return torch.stack([f.to(device, torch.float32).reshape(()) for f in flags]).amax()

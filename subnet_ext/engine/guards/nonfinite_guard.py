"""Non-finite guard: skip a step on every rank when any rank has an inf/NaN gradient.

In SDP a unit owned by one rank is never averaged, so a NaN there is seen by that rank
alone; letting it step while the others skip (or the reverse) would make the ranks'
optimizer states, step counters and — in the backward regime and with local SGD —
their collective schedules diverge. So the decision is one flag all-reduced (MAX) over
the whole group: every rank skips the same steps.

Two ways to use it. With the decision read on the host (any optimizer; one read a step):

    guard = NonFiniteGuard(max_skipped=10)
    loss.backward()
    if guard.should_step(sdp.parameters()):   # collective
        optimizer.step()
    optimizer.zero_grad()

A step skipped this way calls neither `optimizer.step()` nor its post hooks, so the
engine's refresh (backward regime) and parameter averaging (sync_every > 1) stay in step
on all ranks.

With the decision kept on the device (what `subnet-train` does; no host read a step), as
torch's GradScaler does with a fused optimizer: the flag is handed to the optimizer as its
`found_inf`, and the fused kernel leaves parameters, moments and step counts untouched
where it is 1. The optimizer must support it (torch's `fused=True` Adam/AdamW):

    optimizer = torch.optim.AdamW(sdp.parameters(), lr=3e-4, fused=True)
    flag = guard.check(sdp.parameters(), step)  # collective; a 0-d device tensor
    guard.optimizer_step(optimizer, flag)       # optimizer.step(), skipped on the device
    ...
    guard.settle()                              # now and then: one read of the pending flags

With gradient clipping the check rides on the clipping's pass: asked to, the norm of the
whole synchronised gradient also reads the pieces a rank holds but does not lead (clipping.py)
and is non-finite, after its one all-reduce, on every rank exactly when some rank holds an inf
or NaN gradient; `check_norm` reads the decision off it, with no pass and no collective of
its own:

    norm = sdp.clip_grad_norm_(1.0, nonfinite_check=True)   # collective
    flag = guard.check_norm(norm, step)                     # no pass, no collective
    guard.optimizer_step(optimizer, flag)

(One difference in kind: finite gradients whose norm overflows the float32 range, about
3.4e38, also skip the step, where the separate check would let a step with zero-scaled
gradients through.)

Here `optimizer.step()` and its post hooks run on a skipped step too: every rank calls
them at the same points, and the engine's refresh or averaging then moves values the step
left unchanged. The skipped steps are known on the host once `settle()` reads the flags;
`TooManySkippedSteps` is raised there.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from ...comm import collectives


class TooManySkippedSteps(RuntimeError):
    """More steps were skipped for non-finite gradients than allowed; raised on every rank."""


def nonfinite_flag(parameters: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """1.0 when some gradient holds an inf or NaN, else 0.0: a 0-d float32 tensor on the
    first gradient's device, computed there without a host read (one multi-tensor max |g|
    per device and dtype, which propagates NaN, then one reduction). None without any
    gradient element (parameters without .grad are skipped; a DTensor counts its local
    shard)."""
    grads = []
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        g = g.to_local() if hasattr(g, "to_local") else g  # DTensor (FSDP): the local shard
        if g.numel():  # an empty one has no max |g| (and nothing to be non-finite)
            grads.append(g)
    if not grads:
        return None
    device = grads[0].device
    peaks = torch._foreach_norm(grads, float("inf"))
    return (~torch.stack([m.to(device, torch.float32) for m in peaks]).isfinite().all()).float()


def agreed_nonfinite_flag(parameters: Iterable[torch.Tensor], group=None, timeout: float | None = None,
                          device: torch.device | None = None, host_deadline: bool = True) -> torch.Tensor:
    """1.0 when some rank of `group` holds an inf/NaN gradient, else 0.0: a 0-d float32
    tensor, the same on every rank, never read to the host here. Collective.

    It lies on `device` (default: the first gradient's, the CPU on a gloo group). With
    `host_deadline` the host waits for the all-reduce at most `timeout` seconds; without
    it the wait is in stream order (on NCCL the host goes on queueing; the deadline is the
    group's own timeout), as for the step's other collectives."""
    parameters = list(parameters)
    flag = nonfinite_flag(parameters)
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    if device is None and distributed and dist.get_backend(group) == "gloo":
        device = torch.device("cpu")
    if device is None:
        device = flag.device if flag is not None else next((p.device for p in parameters), torch.device("cpu"))
    if not distributed:
        return (flag if flag is not None else torch.zeros(())).to(device)
    flag = (flag if flag is not None else torch.zeros(())).reshape(1).to(device)
    if host_deadline:
        collectives.all_reduce(flag, group, op=dist.ReduceOp.MAX, timeout=timeout)
    else:
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        collectives.wait_in_stream_order(work, "all_reduce (non-finite gradient flag)",
                                         collectives.group_ranks(group), timeout)
    return flag.reshape(())


def gradients_finite(parameters: Iterable[torch.Tensor], group=None, timeout: float | None = None,
                     device: torch.device | None = None) -> bool:
    """True when the gradients are finite on *every* rank of `group` (one all-reduce of a
    flag, and one read of it to the host). Collective: every rank must call it at the same
    point of the step."""
    return bool(agreed_nonfinite_flag(parameters, group, timeout, device).item() == 0.0)


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor):
    """optimizer.step(), which changes nothing where `found_inf` (a 0-d float32 tensor) is
    1.0, decided on the device: torch's GradScaler protocol (the optimizer's `found_inf`
    attribute, read by optimizers with `_step_supports_amp_scaling`: Adam and AdamW with
    fused=True leave parameters, exp_avg, exp_avg_sq and step as they were). Returns what
    step() returns.

    Raises:
        ValueError: the optimizer cannot take the flag (build it with fused=True, or decide
            on the host with NonFiniteGuard.should_step).
    """
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        raise ValueError(f"{type(optimizer).__name__} (fused={optimizer.defaults.get('fused')!r}) cannot skip a step "
                         "on the device: its step() reads no found_inf flag. Build it with fused=True (torch's "
                         "Adam/AdamW), or decide on the host with NonFiniteGuard.should_step")
    if found_inf.dim() != 0 or found_inf.dtype != torch.float32:
        raise ValueError(f"found_inf must be a 0-d float32 tensor, got shape {list(found_inf.shape)} "
                         f"and dtype {found_inf.dtype}")
    optimizer.found_inf = found_inf
    try:
        return optimizer.step()
    finally:
        del optimizer.found_inf


class NonFiniteGuard:
    """Counts the steps skipped for non-finite gradients; raises once too many were skipped.

    Args:
        max_skipped: raise TooManySkippedSteps when more steps than this were skipped
            (None: never). The count is the same on every rank, so all raise together.
        group, timeout: of the flag's all-reduce.

    `skipped_steps`: the labels of the skipped steps known on the host (for the device-side
    path, those `settle()` has read).
    """

    def __init__(self, max_skipped: int | None = None, group=None, timeout: float | None = None):
        if max_skipped is not None and (isinstance(max_skipped, bool) or not isinstance(max_skipped, int)
                                        or max_skipped < 0):
            raise ValueError(f"max_skipped must be None or an int >= 0, got {max_skipped!r}")
        self.max_skipped, self.group, self.timeout = max_skipped, group, timeout
        self.skipped_steps: list[int] = []
        self._pending: list[tuple[int, torch.Tensor]] = []  # (step label, its 0-d flag), not yet read

    @property
    def skipped(self) -> int:
        """Number of optimizer steps known to be skipped for non-finite gradients so far."""
        return len(self.skipped_steps)

    def should_step(self, parameters: Iterable[torch.Tensor], step: int | None = None) -> bool:
        """False when some rank has a non-finite gradient: then the caller must not step
        (zero the gradients instead). Collective; reads the flag to the host. `step` only
        labels the record."""
        if gradients_finite(parameters, self.group, self.timeout):
            return True
        self._count([self.skipped if step is None else int(step)])
        return False

    def check(self, parameters: Iterable[torch.Tensor], step: int) -> torch.Tensor:
        """The agreed flag of this step (0-d float32 on the device, 1.0: skip), kept as
        pending for `step` (a label); no host read, the all-reduce waited for in stream
        order. Collective. Pass it to `optimizer_step`."""
        flag = agreed_nonfinite_flag(parameters, self.group, self.timeout, host_deadline=False)
        self.record(flag, step)
        return flag

    def check_norm(self, norm: torch.Tensor, step: int) -> torch.Tensor:
        """The agreed flag of this step read off `norm`, a gradient norm that is the same on
        every rank and non-finite when any rank's gradient is (`SubnetDataParallel.clip_grad_norm_`
        with nonfinite_check=True and sync_every = 1; torch's `clip_grad_norm_` over DDP's or
        FSDP2's gradients): 1.0 when it is inf or NaN.
        Kept as pending for `step`, as `check` keeps its flag; neither a pass over the gradients
        nor a collective (the module docstring says why it is the same decision)."""
        flag = (~torch.isfinite(norm.detach().reshape(()))).float()
        self.record(flag, step)
        return flag

    def record(self, flag: torch.Tensor, step: int) -> None:
        """Keep a step's flag (a 0-d tensor agreed by every rank, nonzero: skipped; e.g. a loss
        scaler's found-inf) until `settle` reads it."""
        self._pending.append((int(step), flag.detach().reshape(())))

    @staticmethod
    def optimizer_step(optimizer: torch.optim.Optimizer, flag: torch.Tensor):
        """optimizer.step(), skipped on the device where `flag` is 1.0 (`step_unless`)."""
        return step_unless(optimizer, flag)

    def pending_flags(self) -> list[torch.Tensor]:
        """The flags `check`/`record` kept and `settle` has not read, in step order."""
        return [flag for _, flag in self._pending]

    def settle(self, values: list[float] | None = None) -> list[int]:
        """Read the pending flags (one copy to the host; or `values`, the caller's read of
        `pending_flags()`, in order), add the skipped steps to `skipped_steps` and return
        them. Raises TooManySkippedSteps as `should_step` does (at the same call on every
        rank, since the flags are agreed)."""
        if not self._pending:
            return []
        if values is None:
            values = torch.stack([f.float().to(self._pending[0][1].device) for f in self.pending_flags()]).tolist()
        if len(values) != len(self._pending):
            raise ValueError(f"settle: {len(values)} value(s) for {len(self._pending)} pending flag(s)")
        skipped = [step for (step, _), v in zip(self._pending, values) if v != 0.0]
        self._pending = []
        self._count(skipped)
        return skipped

    def _count(self, steps: list[int]) -> None:
        self.skipped_steps.extend(steps)
        if steps and self.max_skipped is not None and self.skipped > self.max_skipped:
            recent = self.skipped_steps[-5:]
            raise TooManySkippedSteps(
                f"{self.skipped} step(s) had an inf/NaN gradient on some rank and were skipped (latest: {recent}), "
                f"more than the {self.max_skipped} allowed (--max-skipped); stopping. Lower the learning rate, "
                "clip the gradients, check the data, or use a wider dtype (bf16 rather than fp16); resume from "
                "the last checkpoint once fixed.")

"""Non-finite guard: skip a step on every rank when any rank has an inf/NaN gradient.

In SDP a unit owned by one rank is never averaged, so a NaN there is seen by that rank
alone; letting it step while the others skip (or the reverse) would make the ranks'
optimizer states, step counters and — in the backward regime and with local SGD —
their collective schedules diverge. So the decision is one flag all-reduced (MAX) over
the whole group: every rank skips the same steps.

    guard = NonFiniteGuard(max_skipped=10)
    loss.backward()
    if guard.should_step(sdp.parameters()):   # collective
        optimizer.step()
    optimizer.zero_grad()

A skipped step calls neither `optimizer.step()` nor its post hooks, so the engine's
refresh (backward regime) and parameter averaging (sync_every > 1) stay in step on all
ranks.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from ..comm import collectives


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


def local_gradients_finite(parameters: Iterable[torch.Tensor]) -> bool:
    """True when every gradient this rank holds is finite (parameters without .grad pass)."""
    flag = nonfinite_flag(parameters)
    return flag is None or flag.item() == 0.0


def gradients_finite(parameters: Iterable[torch.Tensor], group=None, timeout: float | None = None,
                     device: torch.device | None = None) -> bool:
    """True when the gradients are finite on *every* rank of `group` (one all-reduce of a
    flag, and one read of it to the host). Collective: every rank must call it at the same
    point of the step."""
    parameters = list(parameters)
    flag = nonfinite_flag(parameters)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return flag is None or flag.item() == 0.0
    if device is None:
        device = flag.device if flag is not None else next((p.device for p in parameters), torch.device("cpu"))
        if dist.get_backend(group) == "gloo":
            device = torch.device("cpu")
    flag = (flag if flag is not None else torch.zeros(())).reshape(1).to(device)
    collectives.all_reduce(flag, group, op=dist.ReduceOp.MAX, timeout=timeout)
    return bool(flag.item() == 0.0)


class NonFiniteGuard:
    """Counts the steps skipped for non-finite gradients; raises once too many were skipped.

    Args:
        max_skipped: raise TooManySkippedSteps when more steps than this were skipped
            (None: never). The count is the same on every rank, so all raise together.
        group, timeout: of the flag's all-reduce.
    """

    def __init__(self, max_skipped: int | None = None, group=None, timeout: float | None = None):
        if max_skipped is not None and (isinstance(max_skipped, bool) or not isinstance(max_skipped, int)
                                        or max_skipped < 0):
            raise ValueError(f"max_skipped must be None or an int >= 0, got {max_skipped!r}")
        self.max_skipped, self.group, self.timeout = max_skipped, group, timeout
        self.skipped_steps: list[int] = []

    @property
    def skipped(self) -> int:
        """Number of optimizer steps skipped for non-finite gradients so far."""
        return len(self.skipped_steps)

    def should_step(self, parameters: Iterable[torch.Tensor], step: int | None = None) -> bool:
        """False when some rank has a non-finite gradient: then the caller must not step
        (zero the gradients instead). Collective. `step` only labels the record."""
        if gradients_finite(parameters, self.group, self.timeout):
            return True
        self.skipped_steps.append(self.skipped if step is None else int(step))
        if self.max_skipped is not None and self.skipped > self.max_skipped:
            recent = self.skipped_steps[-5:]
            raise TooManySkippedSteps(
                f"{self.skipped} step(s) had an inf/NaN gradient on some rank and were skipped (latest: {recent}), "
                f"more than the {self.max_skipped} allowed (--max-skipped); stopping. Lower the learning rate, "
                "check the data, or use a wider dtype; resume from the last checkpoint once fixed.")
        return False

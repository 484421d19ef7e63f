"""Test-only fault injection for `subnet-train`, driven by environment variables.

Never set in a normal run; the reliability tests use them to make a worker die or a
gradient go bad at a known point. Steps are counted from 1 (step N = the N-th
optimizer step, as in the history and the checkpoint names).

  SUBNET_EXT_FAULT_KILL=RANK:STEP        that rank SIGKILLs itself as step STEP begins,
                                         on the first attempt only (TORCHELASTIC_RESTART_COUNT
                                         unset or 0), so an elastic restart then succeeds.
  SUBNET_EXT_FAULT_NAN=RANK:STEP[,...]   after backward of step STEP, that rank's first
                                         gradient gets a NaN (after averaging: only that
                                         rank sees it).
"""
from __future__ import annotations

import math
import os
import signal

KILL, NAN = "SUBNET_EXT_FAULT_KILL", "SUBNET_EXT_FAULT_NAN"


def _parse(name: str) -> list[tuple[int, int]]:
    text = os.environ.get(name, "").strip()
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            rank, step = (int(v) for v in item.split(":"))
        except ValueError:
            raise ValueError(f"{name}={text!r}: expected RANK:STEP[,RANK:STEP...] with integers") from None
        out.append((rank, step))
    return out


class Faults:
    """The faults planned for this rank (empty in normal runs)."""

    def __init__(self, rank: int):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.kill_at = {s for r, s in _parse(KILL) if r == rank} if first_attempt else set()
        self.nan_at = {s for r, s in _parse(NAN) if r == rank}

    def before_step(self, step: int) -> None:
        """SIGKILL this process when `step` (counted from 1) is a planned kill step."""
        if step in self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def after_backward(self, step: int, parameters) -> None:
        """When `step` is a planned NaN step, write a NaN into element 0 of the first existing
        gradient among `parameters` (the local shard of a DTensor gradient)."""
        if step not in self.nan_at:
            return
        for p in parameters:
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                g.view(-1)[0] = math.nan
                return

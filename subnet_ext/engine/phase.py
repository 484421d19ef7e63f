"""Where a SubnetDataParallel is in its life, as one value instead of several flags."""
from __future__ import annotations

import enum


class Phase(enum.Enum):
    """The engine's training phase.

    TRAINING: backward passes average gradients among owners (the default).
    ACCUMULATING: backward passes only accumulate into `.grad`, without communication
        (inside no_sync(), or while DDP's `require_backward_grad_sync` is False); the
        first backward after it averages the accumulated sum.
    CLOSED: close() gave the model back; every method refuses.
    """

    TRAINING = "training"
    ACCUMULATING = "accumulating"
    CLOSED = "closed"

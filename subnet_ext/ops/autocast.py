"""How a linear layer runs under torch.autocast, as nn.Linear does (docs/design.md §5.2).

Inside `torch.autocast(device, dtype)` a linear layer runs in the autocast dtype: its
floating inputs (fp32, fp16, bf16; never fp64) are cast to that dtype, the GEMM
accumulates in fp32 inside the kernel, and the output has the autocast dtype.

These helpers need no compiled library: the masked-linear ops' autocast kernels
(registration.py) use them, and so does code that calls the ops (or F.linear) by hand
inside an autograd.Function, e.g. the backward regime's owned linear layer.
"""
from __future__ import annotations

from typing import Optional

import torch


def autocast_dtype(t: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype autocast would run a linear layer on `t`'s device in, or None when
    autocast is off there (or `t` is fp64 / not floating, which autocast leaves alone)."""
    device_type = t.device.type
    if not torch._C._is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    if not t.is_floating_point() or t.dtype == torch.float64:
        return None
    return torch.get_autocast_dtype(device_type)


def cast_to(t: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """t in `dtype` when it is a floating tensor autocast would cast (not fp64), else t."""
    if t is None or dtype is None or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
        return t
    return t.to(dtype)

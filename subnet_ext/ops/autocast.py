"""The masked-linear ops under torch.autocast, as nn.Linear behaves (docs/design.md §5.2).

Inside `torch.autocast(device, dtype)` a linear layer runs in the autocast dtype: its
floating inputs (fp32, fp16, bf16; never fp64) are cast to that dtype, the GEMM
accumulates in fp32 inside the kernel, and the output has the autocast dtype.
`torch.library.register_autocast` takes one fixed dtype, but autocast's dtype is chosen
at run time (bf16 or fp16), so the kernels here read it when they run.

The kernels sit on the AutocastCPU / AutocastCUDA dispatch keys, above autograd: the
casts are recorded by autograd, so gradients reach fp32 parameters in fp32.

`autocast_dtype(t)` is the helper for code that calls the ops (or F.linear) by hand
inside an autograd.Function, e.g. the backward regime's owned linear layer.
"""
from __future__ import annotations

from typing import Optional

import torch

_LIB = torch.library.Library("subnet_ext", "IMPL")  # kept alive: it owns the registrations
_OPS = ("masked_linear", "masked_linear_forward")  # the GEMM ops; the backward runs outside autocast


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


def _autocast_kernel(op, device_type: str, key):
    def kernel(_keyset, *args):
        dtype = torch.get_autocast_dtype(device_type)
        cast = [cast_to(a, dtype) if isinstance(a, torch.Tensor) and a.device.type == device_type else a
                for a in args]
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return op(*cast)

    return kernel


def _register() -> None:
    for device_type in ("cpu", "cuda"):
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        key = getattr(torch._C.DispatchKey, key_name)
        for name in _OPS:
            op = getattr(torch.ops.subnet_ext, name).default
            _LIB.impl(name, _autocast_kernel(op, device_type, key), key_name, with_keyset=True)


_register()

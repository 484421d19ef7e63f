"""What Python adds to the ops the compiled library defines (their schemas are in
csrc/registration.cpp): fake kernels (fake.py), the masked linear's autograd and its
autocast kernels. Importing it loads the library; linear.py and segments.py import it, so
their ops are complete whichever is imported first, and the pure-PyTorch reference,
which imports neither, never loads the library.

Autograd: `register_autograd(formula)` makes the backward of masked_linear and
masked_linear_forward the masked linear's one gradient formula,
`linear.masked_linear_backward` (which the engine's owned Linear layers call too);
linear.py registers it when it is imported.

Autocast: the GEMM ops run as nn.Linear does under torch.autocast (autocast.py).
`torch.library.register_autocast` takes one fixed dtype, but autocast's dtype is chosen
at run time (bf16 or fp16), so the kernels here read it when they run. They sit on the
AutocastCPU / AutocastCUDA dispatch keys, above autograd: the casts are recorded by
autograd, so gradients reach fp32 parameters in fp32.
"""
from __future__ import annotations

import torch

from . import fake  # noqa: F401  (loads the library; registers the fake kernels on import)
from .autocast import cast_to

_AUTOCAST_OPS = ("masked_linear", "masked_linear_forward")  # the GEMM ops; the backward runs outside autocast


def _setup_context(ctx, inputs, output):
    x, weight, bias, out_idx, in_idx, compact_weight, scatter_width, *rest = inputs
    if isinstance(output, tuple):  # masked_linear_forward: reuse what it gathered
        _, x_kept, block = output
        ctx.mark_non_differentiable(x_kept, block)
    else:
        x_kept = block = None
    ctx.save_for_backward(x, weight, out_idx, in_idx, x_kept, block)
    ctx.has_bias = bias is not None
    ctx.compact_weight = compact_weight
    ctx.scatter = scatter_width >= 0
    ctx.check_indices = bool(rest[0]) if rest else True


def register_autograd(formula) -> None:
    """Make `formula` the backward of masked_linear and masked_linear_forward (once).

    Args:
        formula: `linear.masked_linear_backward` (its signature and results); the autograd
            backward passes what the forward saved and maps a full weight's compact
            gradient block back to the weight's shape [O, I] (zeros where not kept).
    """

    def backward(ctx, grad_out, *_unused_grads):
        x, weight, out_idx, in_idx, x_kept, block = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        gx, gw, gb = formula(
            grad_out.contiguous(), x, weight, out_idx, in_idx, compact_weight=ctx.compact_weight,
            grad_out_full=ctx.scatter and out_idx is not None, output_mask=(need_x, need_w, need_b),
            x_kept=x_kept, weight_block=block, check_indices=ctx.check_indices,
        )
        if not ctx.compact_weight and (out_idx is not None or in_idx is not None):
            rows = out_idx if out_idx is not None else torch.arange(weight.shape[0], device=weight.device)
            cols = in_idx if in_idx is not None else torch.arange(weight.shape[1], device=weight.device)
            if need_w:
                gw = weight.new_zeros(weight.shape).index_put_((rows[:, None], cols[None, :]), gw)
            if need_b:
                gb = weight.new_zeros(weight.shape[0]).index_put_((rows,), gb)
        return gx, gw, gb, None, None, None, None, None

    for name in ("masked_linear", "masked_linear_forward"):
        torch.library.register_autograd(f"subnet_ext::{name}", backward, setup_context=_setup_context)


def _autocast_kernel(op, device_type: str, key):
    def kernel(_keyset, *args):
        dtype = torch.get_autocast_dtype(device_type)
        cast = [cast_to(a, dtype) if isinstance(a, torch.Tensor) and a.device.type == device_type else a
                for a in args]
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return op(*cast)

    return kernel


def _register_autocast() -> torch.library.Library:
    lib = torch.library.Library("subnet_ext", "IMPL")
    for device_type in ("cpu", "cuda"):
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        key = getattr(torch._C.DispatchKey, key_name)
        for name in _AUTOCAST_OPS:
            op = getattr(torch.ops.subnet_ext, name).default
            lib.impl(name, _autocast_kernel(op, device_type, key), key_name, with_keyset=True)
    return lib


_LIB = _register_autocast()  # kept alive: it owns the autocast registrations

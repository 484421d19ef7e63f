"""What the study measures besides the loss: FLOPs of a training step, the process's peak
resident memory per configuration, and the FLOPs of the full model's blocks.

FLOPs are counted by torch.utils.flop_counter.FlopCounterMode on real training steps
(matrix products, convolutions, attention: the operations with a registered formula).
The project's masked-linear ops (the backward regime's owned weight gradients) are custom
ops the counter does not know; `register_masked_linear_flops()` gives them their matrix
product counts (2 x rows x the product's two widths; masked_linear_grad_runs_, the owned weight
gradient over contiguous runs, 2 x rows x its block), so the backward regime's saving of
weight-gradient FLOPs is counted, not assumed.
"""
from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

_REGISTERED = []


def _rows(shape) -> int:
    return math.prod(shape[:-1])


def _widths(weight, out_idx, in_idx) -> tuple[int, int]:
    """(|R|, |S|): the rows and columns of the weight block a masked linear multiplies by."""
    return (out_idx[0] if out_idx is not None else weight[0]), (in_idx[0] if in_idx is not None else weight[1])


def register_masked_linear_flops() -> None:
    """Give FlopCounterMode formulas for the subnet_ext masked-linear ops (once per process)."""
    if _REGISTERED:
        return
    import subnet_ext.ops.linear  # noqa: F401  (loads the library: importing subnet_ext alone does not)
    ops = torch.ops.subnet_ext

    @register_flop_formula([ops.masked_linear, ops.masked_linear_forward])
    def _forward(x, weight, bias, out_idx, in_idx, compact_weight, scatter_width, check_indices=True, out_shape=None):
        r, s = _widths(weight, out_idx, in_idx)
        return 2 * _rows(x) * r * s

    @register_flop_formula(ops.masked_linear_backward)
    def _backward(grad_out, x, weight, out_idx, in_idx, compact_weight, grad_out_full, dense_grad_input, output_mask,
                  x_kept=None, weight_block=None, check_indices=True, out_shape=None):
        n = _rows(grad_out)
        r, s = _widths(weight, out_idx, in_idx)
        flops = 0
        if output_mask[0]:  # dense: the full grad_out times the full weight; else the owned block only
            flops += 2 * n * (weight[0] * weight[1] if dense_grad_input else r * s)
        if output_mask[1]:
            flops += 2 * n * r * s
        return flops

    @register_flop_formula(ops.masked_linear_grad_weight_)
    def _grad_weight(out, grad_out, x, out_idx, in_idx, grad_out_full, accumulate, check_indices=True,
                     out_shape=None):
        return 2 * _rows(grad_out) * math.prod(out)

    @register_flop_formula(ops.masked_linear_grad_runs_)
    def _grad_runs(weight_out, bias_out, grad_out, x, out_runs, in_runs, accumulate, out_shape=None):
        # weight_out is the owned block [|R|, |S|] (None: the bias alone, no product)
        return 0 if weight_out is None else 2 * _rows(grad_out) * math.prod(weight_out)

    _REGISTERED.append(True)


def counting_flops():
    """A FlopCounterMode context (no printing); read `.get_total_flops()` after it."""
    return FlopCounterMode(display=False)


def block_training_flops(model: torch.nn.Module, block_paths: list[str], batch: tuple) -> tuple[float, dict]:
    """(FLOPs of one forward + backward of `model` on batch (inputs, targets), {block path: its share}).

    The model's output's logits go through cross-entropy, as a training step does; the
    gradients it leaves are cleared. Used for the full model: the reference a step of
    every method is compared to, and stochastic depth's per-step FLOPs (minus dropped blocks)."""
    import torch.nn.functional as F

    from subnet_ext.jobs.tasks import logits_of

    x, y = batch
    with FlopCounterMode(display=False) as counter:
        logits = logits_of(model(x))
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    model.zero_grad(set_to_none=True)
    root = type(model).__name__
    per_module = counter.get_flop_counts()
    blocks = {p: float(sum(per_module.get(f"{root}.{p}", {}).values())) for p in block_paths}
    return float(counter.get_total_flops()), blocks


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set size (Linux: write 5 to /proc/self/clear_refs),
    so VmHWM measures one configuration of a process that runs several. False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False

"""Gradient-norm clipping over the whole model's synchronised gradient (docs/design.md §5.1).

torch's `clip_grad_norm_(sdp.parameters(), ...)` sees one rank's share of the model: a
rank that owns fewer units sees a smaller norm, clips by another coefficient, and the
owners of a unit then apply different updates (they diverge). Here the norm is that of
the synchronised gradient of the *whole* model, every element counted once:

- each piece (a slice of one tensor with one owner set, pieces.py) is counted by its
  leader (lowest-ranked owner) only, shared parameters by rank 0;
- one all-reduce over the engine's group: SUM of the p-th powers (MAX for inf);
- every rank scales all its gradients by the same coefficient
  clip = min(1, max_norm / (norm + 1e-6)), as torch's `clip_grad_norm_`.

After averaging, the owners of a piece hold bit-identical gradients, so counting it on
one of them gives the norm DDP would compute (C = 1: the same up to summation order).

With `nonfinite_check` the same pass also reads the pieces this rank holds but does not lead
(their max |g|, which propagates NaN), and a non-finite one adds inf to this rank's share of
the all-reduce: the norm is then inf or NaN on every rank exactly when some rank holds an inf
or NaN gradient, so a non-finite guard can read its skip decision off the norm
(NonFiniteGuard.check_norm) instead of its own pass and collective.

With sync_every = H > 1 gradients are never averaged (local SGD between parameter
averages): each rank then clips by the norm of its *own* gradients, with no
communication, as local SGD does. With a period per unit group, some gradients are averaged
every step and others stay local: the norm is then that of the averaged gradients (each piece
counted once) together with every rank's local ones (each holder counts its own), one number
on every rank, so the averaged pieces' owners keep applying the same update.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..comm import collectives
from ..state.layout import RankLayout, local_tensor


def _check_args(max_norm, norm_type) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float, torch.Tensor)) or \
            not float(max_norm) >= 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be a number >= 0, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not float(norm_type) > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be a number > 0 or inf, got {norm_type!r}")
    return float(norm_type)


def _nonfinite_elsewhere(views: list[torch.Tensor], device) -> torch.Tensor:
    """inf when some of `views` holds an inf or NaN, else 0: a 0-d float32 tensor on `device`
    (one multi-tensor max |g| per device and dtype, no host read)."""
    views = [v for v in views if v.numel()]
    if not views:
        return torch.zeros((), dtype=torch.float32, device=device)
    peaks = torch.stack([m.to(device, torch.float32) for m in torch._foreach_norm(views, float("inf"))])
    return torch.where(peaks.isfinite().all(), 0.0, math.inf).to(torch.float32)


def synchronised_grad_norm(layout: RankLayout, norm_type: float = 2.0, communicate: bool = False, group=None,
                           timeout: float | None = None, local=None, nonfinite_check: bool = False) -> torch.Tensor:
    """The norm of the whole model's synchronised gradient: a 0-d float32 tensor, the
    same on every rank. Collective over `group` (one all-reduce of one number) when
    `communicate` (False: one rank, a simulated rank, or no torch.distributed: the norm of
    the pieces this rank leads); call it after a synchronising backward (gradients
    averaged; not inside no_sync(), where each rank holds only its own sum).

    Args:
        layout: this rank's RankLayout (where each piece's gradient lives).
        group: the engine's world group (None: the default group); timeout: its deadline.
        local: piece -> True when its gradient is not averaged (a period > 1): every holder counts it.
        nonfinite_check: also read the held pieces this rank does not count; the norm is inf
            or NaN when any of them is (module docstring).
    """
    norm_type = _check_args(1.0, norm_type)
    # A sharded shared parameter's rows are held once each, by one rank: every rank counts its own.
    held = layout.held_gradients()
    counted = [layout.contributes(piece) or (local is not None and local(piece)) for piece, _ in held]
    led = [view for (_, view), c in zip(held, counted) if c]
    device = led[0].device if led else layout.device
    if led:
        # Per-piece norms in fp32 (halves accumulate in fp32), then the norm of the norms.
        norms = [torch.linalg.vector_norm(v, norm_type, dtype=torch.float32) for v in led]
        own = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    else:
        own = torch.zeros((), dtype=torch.float32, device=device)
    if nonfinite_check:
        own = own + _nonfinite_elsewhere([view for (_, view), c in zip(held, counted) if not c], device)
    if not communicate:
        return own
    inf = math.isinf(norm_type)
    reduce_device = torch.device("cpu") if dist.get_backend(group) == "gloo" else device
    flag = (own if inf else own.pow(norm_type)).reshape(1).to(reduce_device)
    # In the step: the engine's world group (made with its timeout), no host deadline, so
    # on NCCL the host does not wait for the norm (collectives.wait_in_stream_order).
    work = dist.all_reduce(flag, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group, async_op=True)
    collectives.wait_in_stream_order(work, "all_reduce (gradient norm)",
                                     collectives.describe_group(range(layout.world_size), layout.world_size), timeout)
    total = flag[0] if inf else flag[0].pow(1.0 / norm_type)
    return total.to(device)


def clip_grad_norm_(layout: RankLayout, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None, *, local_sgd: bool = False, communicate: bool = False, group=None,
                    timeout: float | None = None, local=None, nonfinite_check: bool = False) -> torch.Tensor:
    """Clip every gradient this rank holds by the norm of the whole model's gradient.

    Args:
        layout: this rank's RankLayout, after backward (and before optimizer.step()): its
            trainable parameters are the ones clipped.
        max_norm: the largest allowed norm. norm_type: p of the p-norm (float, or inf).
        error_if_nonfinite: raise RuntimeError (on every rank: the norm is shared) when
            the norm is inf or NaN, instead of scaling by a NaN coefficient.
        foreach: passed to torch's scaling of the gradients (None: torch's default).
        local_sgd: sync_every > 1: each rank clips by its own gradients, no communication.
        communicate, group, timeout, local, nonfinite_check: as synchronised_grad_norm's.
    Returns:
        the total norm before clipping, a 0-d float32 tensor equal on every rank when
        not `local_sgd` (collective); this rank's own norm with `local_sgd`.
    """
    norm_type = _check_args(max_norm, norm_type)
    params = [p for p in layout.trainable if p.grad is not None]
    if local_sgd:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    total = synchronised_grad_norm(layout, norm_type, communicate, group, timeout, local, nonfinite_check)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"The total norm of order {norm_type} of the gradients of the whole model is "
                           f"non-finite ({total.item()}), so it cannot be clipped; pass error_if_nonfinite=False "
                           "to scale by a NaN coefficient anyway, or skip the step (subnet_ext.GradScaler, "
                           "NonFiniteGuard).")
    if not layout.sharded:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
        return total
    # DTensor shards beside plain tensors: the same coefficient as torch's, applied to local tensors.
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            g = local_tensor(p.grad)
            g.mul_(coefficient.to(g.device, g.dtype))
    return total

"""Gradient-norm clipping over the whole model's synchronised gradient (DESIGN.md §7).

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

With sync_every = H > 1 gradients are never averaged (local SGD between parameter
averages): each rank then clips by the norm of its *own* gradients, with no
communication, as local SGD does.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist

from ..comm import collectives
from ..planning.pieces import Piece, rectangle


def _held_gradients(sdp) -> Iterator[tuple[Piece, torch.Tensor]]:
    """(piece, gradient of the piece as a 2-D view [rows, cols]) for every parameter piece
    this rank holds whose gradient exists.

    Where each piece lives comes from the engine's RankLayout (state/layout.py)."""
    layout = sdp.layout
    for piece in layout.pieces:
        if not piece.is_param or layout.rank not in piece.owners:
            continue
        own = layout.piece_params.get(piece)  # backward regime: the owned slice is its own Parameter
        param = own if own is not None else layout.value_of(piece.name)
        if id(param) not in sdp._trainable_ids or param.grad is None:
            continue
        grad = param.grad
        if layout.is_sharded(piece):  # shard_shared: this rank's rows of the reduce-scattered mean
            local = grad.to_local()
            yield piece, local.reshape(local.shape[0], -1)
            continue
        if own is not None:
            r0, r1, c0, c1 = rectangle(grad.shape, 0, 0, grad.shape[0] if grad.dim() else 1)
        else:
            r0, r1, c0, c1 = rectangle(grad.shape, piece.dim, layout.local_start[piece], piece.length)
        rows = grad.shape[0] if grad.dim() else 1
        yield piece, grad.reshape(rows, -1)[r0:r1, c0:c1]


def _check_args(max_norm, norm_type) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float, torch.Tensor)) or \
            not float(max_norm) >= 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be a number >= 0, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not float(norm_type) > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be a number > 0 or inf, got {norm_type!r}")
    return float(norm_type)


def _reduce_device(sdp, fallback: torch.device) -> torch.device:
    if dist.get_backend(sdp.process_group) == "gloo":
        return torch.device("cpu")
    return fallback


def synchronised_grad_norm(sdp, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the whole model's synchronised gradient: a 0-d float32 tensor, the
    same on every rank. Collective (one all-reduce of one number) when the engine runs
    with other ranks; call it after a synchronising backward (gradients averaged; not
    inside no_sync(), where each rank holds only its own sum). An engine simulating one
    rank (simulate_rank) returns the share of the pieces that rank leads."""
    norm_type = _check_args(1.0, norm_type)
    # A sharded shared parameter's rows are held once each, by one rank: every rank counts its own.
    led = [view for piece, view in _held_gradients(sdp) if piece.leader == sdp.rank or sdp.layout.is_sharded(piece)]
    device = led[0].device if led else sdp.device
    if led:
        # Per-piece norms in fp32 (halves accumulate in fp32), then the norm of the norms.
        norms = [torch.linalg.vector_norm(v, norm_type, dtype=torch.float32) for v in led]
        local = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
    if sdp.world_size == 1 or sdp.simulated or not dist.is_initialized():
        return local
    inf = math.isinf(norm_type)
    flag = (local if inf else local.pow(norm_type)).reshape(1).to(_reduce_device(sdp, device))
    # In the step: the engine's world group (made with its timeout), no host deadline, so
    # on NCCL the host does not wait for the norm (collectives.wait_in_stream_order).
    work = dist.all_reduce(flag, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=sdp._comm.world_group,
                           async_op=True)
    collectives.wait_in_stream_order(work, "all_reduce (gradient norm)",
                                     collectives.describe_group(range(sdp.world_size), sdp.world_size), sdp.timeout)
    total = flag[0] if inf else flag[0].pow(1.0 / norm_type)
    return total.to(device)


def clip_grad_norm_(sdp, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Clip every gradient this rank holds by the norm of the whole model's gradient.

    Args:
        sdp: a SubnetDataParallel engine, after backward (and before optimizer.step()).
        max_norm: the largest allowed norm. norm_type: p of the p-norm (float, or inf).
        error_if_nonfinite: raise RuntimeError (on every rank: the norm is shared) when
            the norm is inf or NaN, instead of scaling by a NaN coefficient.
        foreach: passed to torch's scaling of the gradients (None: torch's default).
    Returns:
        the total norm before clipping, a 0-d float32 tensor equal on every rank when
        sync_every == 1 (collective); this rank's own norm when sync_every > 1 (local SGD:
        no communication).
    """
    norm_type = _check_args(max_norm, norm_type)
    params = [p for p in sdp.parameters() if p.grad is not None]
    if sdp.sync_every > 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    total = synchronised_grad_norm(sdp, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"The total norm of order {norm_type} of the gradients of the whole model is "
                           f"non-finite ({total.item()}), so it cannot be clipped; pass error_if_nonfinite=False "
                           "to scale by a NaN coefficient anyway, or skip the step (subnet_ext.GradScaler, "
                           "NonFiniteGuard).")
    if sdp.shared_shards is None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
        return total
    # DTensor shards beside plain tensors: the same coefficient as torch's, applied to local tensors.
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            g.mul_(coefficient.to(g.device, g.dtype))
    return total

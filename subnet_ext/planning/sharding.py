"""Sharded shared parameters (`shard_shared=True`): what FSDP2 takes over from SDP.

The plan's shared parameters (embeddings, LM head, stem, final norms, shortcut
projections: every rank holds them) are sharded along dim 0 across the K ranks by torch's
FSDP2; SDP keeps averaging the units among their owners. These functions say, from the
plan alone, which pieces SDP still communicates and what the sharded part costs in
communication, so the planner's prediction and the engine's report use the same numbers.
Its memory is planning/costs/memory_model.py's (model_state(..., shard_shared=True)).
"""
from __future__ import annotations

import math

from .pieces import Piece, global_pieces, shard_rows
from .plan import SubnetPlan

# FSDP2's own default for a root module: the gathered shared parameters stay full-size from
# the forward to the end of the backward (then resharded), so one all-gather per step, not
# two. On llama small, 4 CPU ranks (bench/e2e.py, a loaded machine, one run each), the
# sharded c0.25 step took 395 ms resharding after the forward and 345 ms without (the
# unsharded SDP step: 300-335 ms); keeping them saves a second all-gather for the shared
# parameters' bytes between forward and backward, which activations dwarf.
RESHARD_AFTER_FORWARD = False

FSDP_SOURCE = ("predicted from the shared parameters' sizes: FSDP2 issues these collectives itself (one "
               "all-gather before the forward, kept through the backward, and one reduce-scatter of the "
               "gradients), so they are not counted by SDP's counter; "
               "tests/engine/test_shard_shared.py checks them against a count of FSDP2's c10d calls")


def sharded_names(plan: SubnetPlan) -> list[str]:
    """The shared floating-point parameters FSDP2 shards (aliases of tied weights excluded:
    the tied tensor is one parameter)."""
    return [n for n in plan.shared_params if plan.is_float(n) and len(plan.tensor_shapes[n]) > 0]


def communicated_pieces(plan: SubnetPlan, shard_shared: bool) -> list[Piece]:
    """global_pieces(plan), less the sharded shared parameters when `shard_shared`."""
    pieces = global_pieces(plan)
    if not shard_shared:
        return pieces
    sharded = set(sharded_names(plan))
    return [p for p in pieces if p.name not in sharded]


def _row_bytes(plan: SubnetPlan, name: str) -> float:
    shape = plan.tensor_shapes[name]
    return plan.bytes_of(name, math.prod(shape)) / shape[0]


def shard_bytes(plan: SubnetPlan, rank: int) -> float:
    """Bytes of `rank`'s shards of the sharded shared parameters (rows of torch.chunk)."""
    return float(sum(shard_rows(plan.tensor_shapes[n][0], rank, plan.world_size)[1] * _row_bytes(plan, n)
                     for n in sharded_names(plan)))


def padded_shard_bytes(plan: SubnetPlan) -> float:
    """Bytes of one rank's padded shard (ceil(rows / K) rows each): what FSDP2's all-gather
    takes from every rank."""
    k = plan.world_size
    return float(sum(-(-plan.tensor_shapes[n][0] // k) * _row_bytes(plan, n) for n in sharded_names(plan)))


def predicted_fsdp_comm(plan: SubnetPlan) -> dict:
    """Per optimizer step: FSDP2's bytes (output of each all-gather, input of the
    reduce-scatter: K x padded shard) and collectives, with where the numbers come from."""
    full = plan.world_size * padded_shard_bytes(plan)
    gathers = (1 if RESHARD_AFTER_FORWARD is False else 2) if sharded_names(plan) else 0
    return {"all_gather_bytes": int(gathers * full), "reduce_scatter_bytes": int(full if gathers else 0),
            "bytes": int((gathers + (1 if gathers else 0)) * full), "collectives": gathers + (1 if gathers else 0),
            "source": FSDP_SOURCE}

"""The cost model of docs/design.md §2, from the plan alone (no process group needed).

Bytes *handed to collectives* by one rank in one synchronisation:
- per-group strategy: for every owner set S with this rank and |S| > 1, the bytes of
  the units owned by S (plus the shared tensors in the world set); one collective per
  bucket (owner set, dtype, cut at the bucket cap; see buckets.py).
- zero-filled strategy: all-reduces over the world of every unit and shared tensor
  with more than one owner, zeros where a rank holds nothing (one per bucket).
Both count whole bucket buffers, including the gaps that align each piece to 16 bytes
(buckets.py): at most 15 bytes per piece, and what the collective is really handed, so
the prediction equals the communicator's count.
A reduction other than the full-precision all-reduce (a wire dtype, a comm hook such as
the low-rank one) says what it hands over per bucket (`WireModel.collective_bytes`); the
prediction sums those instead of the buffers.
Ring all-reduce moves 2(|S|-1)/|S| of a buffer per rank: that is `ring_bytes`, what
the strategy choice minimises (plus a per-collective latency expressed in bytes).
The backward regime adds the refresh: one broadcast per leader rank (the lowest owner)
and dtype of the units it leads that some rank does not hold (pieces 16-byte aligned too).
"""
from __future__ import annotations

from typing import Protocol

from ..buckets import DEFAULT_BUCKET_CAP_MB, Bucket, build_buckets, refresh_broadcasts
from ..pieces import global_pieces
from ..plan import SubnetPlan
from ..sharding import communicated_pieces

STRATEGIES = ("auto", "groups", "zero_filled")
DEFAULT_LATENCY_BYTES = 256 * 1024  # one collective's fixed cost, as bytes of transfer


class WireModel(Protocol):
    """What a reduction hands to collectives for one bucket (comm/reduction.py implements it):
    the bytes of each collective it issues, in order, or None where it cannot say (a user's
    comm hook without a `collective_bytes`). The default, full-precision all-reduce of the
    whole buffer, is [bucket.nbytes]."""

    def collective_bytes(self, bucket: Bucket) -> list[int] | None:
        """Bytes of each collective this reduction issues for `bucket` on one of its ranks."""


def predicted_comm(plan: SubnetPlan, rank: int, strategy: str, regime: str = "forward",
                   bucket_cap_bytes: float = DEFAULT_BUCKET_CAP_MB * 2**20, buckets=None,
                   shard_shared: bool = False, wire: WireModel | None = None) -> dict:
    """Per synchronisation on `rank`: bytes handed to collectives, collectives, ring bytes.

    One collective per bucket this rank takes part in (buckets.py: per owner set and
    dtype, cut at `bucket_cap_bytes`); `buckets` may pass a precomputed layout.
    shard_shared: the shared parameters are left to FSDP2 (sharding.predicted_fsdp_comm).
    wire: how each bucket's gradients travel (None: the whole buffer, in its dtype); every
    value is None when it cannot say for some bucket.
    """
    if strategy not in ("groups", "zero_filled"):
        raise ValueError(f"strategy must be 'groups' or 'zero_filled', got {strategy!r}")
    if buckets is None:
        buckets = build_buckets(plan, communicated_pieces(plan, shard_shared), strategy, bucket_cap_bytes)
    handed = ring = 0.0
    count = 0
    for b in buckets:
        if rank not in b.owners:
            continue
        sizes = [b.nbytes] if wire is None else wire.collective_bytes(b)
        if sizes is None:
            return {"bytes": None, "collectives": None, "ring_bytes": None}
        for n in sizes:
            handed += n
            ring += 2 * (len(b.owners) - 1) / len(b.owners) * n
            count += 1
    if regime == "backward" and plan.world_size > 1:
        refresh, refresh_count = refresh_bytes(plan)
        handed += refresh
        ring += refresh
        count += refresh_count
    return {"bytes": int(handed), "collectives": count, "ring_bytes": ring}


def refresh_bytes(plan: SubnetPlan) -> tuple[float, int]:
    """Backward regime: bytes every rank hands to the leaders' broadcasts, and their number
    (buckets.refresh_broadcasts, the layout comm/refresh.py packs)."""
    sizes = [b.nbytes for _, b in refresh_broadcasts(plan, global_pieces(plan))]
    return float(sum(sizes)), len(sizes)


def choose_strategy(plan: SubnetPlan, requested: str = "auto", latency_bytes: float = DEFAULT_LATENCY_BYTES,
                    bucket_cap_bytes: float = DEFAULT_BUCKET_CAP_MB * 2**20, shard_shared: bool = False,
                    wire: WireModel | None = None):
    """("groups" | "zero_filled", {strategy: modelled cost of the slowest rank, in bytes}); `wire`
    as predicted_comm's (a wire model that cannot say is costed as the whole buffers)."""
    if requested not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {requested!r}")
    costs = {}
    pieces = communicated_pieces(plan, shard_shared)
    for s in ("groups", "zero_filled"):
        worst = 0.0
        buckets = build_buckets(plan, pieces, s, bucket_cap_bytes)
        for r in range(plan.world_size):
            c = predicted_comm(plan, r, s, buckets=buckets, wire=wire)
            if c["bytes"] is None:
                c = predicted_comm(plan, r, s, buckets=buckets)
            worst = max(worst, c["ring_bytes"] + latency_bytes * c["collectives"])
        costs[s] = worst
    if requested != "auto":
        return requested, costs
    return ("groups" if costs["groups"] <= costs["zero_filled"] else "zero_filled"), costs

"""Read-only access to the parts SubnetDataParallel is made of, for inspection and tests.

A mixin, like ddp_interface.py: the engine builds and owns each part (one object, one piece
of mutable state); these properties hand them out without a setter, so code outside the
engine never needs its private attributes and cannot replace a part behind its back.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..comm.averaging import BucketedAverager
from ..comm.call_check import CallLedger
from ..comm.communicator import Communicator
from ..comm.refresh import CopyRefresher
from ..state.drift_check import DriftCheck
from ..state.layout import RankLayout
from .shared_shards import SharedShards


class EngineParts:
    """device, skeleton, layout, communicator, averager, refresh, shared_shards, call_ledger and drift_check of a
    SubnetDataParallel."""

    @property
    def device(self) -> torch.device:
        """The device of the model's first parameter when wrapped: where this rank's tensors live."""
        return self._device

    @property
    def skeleton(self) -> nn.Module:
        """The model as it was before the surgery, its parameters and persistent buffers on the meta
        device (restore.meta_skeleton): the names, shapes and classes a full model is rebuilt from."""
        return self._skeleton

    @property
    def layout(self) -> RankLayout:
        """Where each piece's value, gradient, optimizer state and shard lives on this rank (state/layout.py)."""
        return self._layout

    @property
    def communicator(self) -> Communicator:
        """The owner-set process groups and the byte counter of the engine's collectives (comm/communicator.py)."""
        return self._comm

    @property
    def averager(self) -> BucketedAverager:
        """The bucketed averager of gradients and parameters among owners (comm/averaging.py)."""
        return self._averager

    @property
    def refresh(self) -> CopyRefresher | None:
        """The backward regime's refresh of the copies of units this rank does not own
        (comm/refresh.py), or None (forward regime). With a synchronisation period per unit group
        there is one per period: see `refreshes`."""
        if len(self._refresh) > 1:
            raise AttributeError("this engine refreshes each synchronisation period on its own: use sdp.refreshes "
                                 "({period: CopyRefresher})")
        return next(iter(self._refresh.values()), None)

    @property
    def refreshes(self) -> dict:
        """{synchronisation period: the backward regime's CopyRefresher of its pieces} ({} in the forward regime)."""
        return dict(self._refresh)

    @property
    def shared_shards(self) -> SharedShards | None:
        """FSDP2 over the plan's shared parameters (shard_shared=True, shared_shards.py), or None."""
        return self._shards

    @property
    def call_ledger(self) -> CallLedger:
        """The check that every rank calls the collective methods in one order (comm/call_check.py)."""
        return self._call_ledger

    @property
    def drift_check(self) -> DriftCheck:
        """The owners' comparison every SDPConfig.drift_check_every steps (state/drift_check.py); its
        `checks` counts the comparisons made."""
        return self._drift

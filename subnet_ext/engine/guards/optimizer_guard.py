"""An optimizer built before wrapping is refused at its first step, naming the parameter.

nanoGPT-style scripts build the optimizer (`model.configure_optimizers(...)`) before
wrapping the model. DDP keeps the model's Parameters, so that order works there. SDP's
surgery replaces some of them (compact tensors in the forward regime, owned-slice views and
full buffers in the backward regime, FSDP2's DTensors with shard_shared) and stops training
others (blocks this rank does not own): such an optimizer updates tensors the model no
longer uses, the loss still falls through the shared parameters, owners stay consistent,
and nothing says that the units never train.

`OptimizerGuard` records the model's trainable Parameters before the surgery (by identity,
held weakly) and, from torch's global optimizer-step pre-hook, checks each optimizer once
at its first step (again if param groups were added): holding a recorded Parameter the
engine does not train raises `StaleOptimizerError`. Optimizers over the engine's parameters
or a subset of them, and optimizers over other models, pass.
"""
from __future__ import annotations

import weakref

import torch.nn as nn


class StaleOptimizerError(RuntimeError):
    """An optimizer holds parameters that SubnetDataParallel replaced or does not train."""


class OptimizerGuard:
    """The model's trainable Parameters before the engine's surgery, and the optimizers checked.

    Args:
        model: the model, before SubnetDataParallel changes it.
    """

    def __init__(self, model: nn.Module):
        # id -> (weak reference, name): a freed Parameter's id may be reused by another tensor.
        self.before = {id(p): (weakref.ref(p), name) for name, p in model.named_parameters() if p.requires_grad}
        self.checked = weakref.WeakKeyDictionary()  # optimizer -> number of param groups when checked
        self.trainable_ids: set = set()
        self.in_model: set = set()
        self.rank = 0

    def attach(self, trainable_ids: set, rank: int, model: nn.Module) -> None:
        """What the engine trains after its surgery (ids of `sdp.parameters()`) on `rank`;
        `model` is the wrapped model (to tell replaced Parameters from untrained ones)."""
        self.trainable_ids, self.rank = set(trainable_ids), rank
        self.in_model = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}

    def __call__(self, optimizer, args=None, kwargs=None) -> None:
        """The optimizer-step pre-hook: check `optimizer` unless it was checked as it is."""
        groups = len(optimizer.param_groups)
        if self.checked.get(optimizer) == groups:
            return
        stale = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                entry = self.before.get(id(p))
                if entry is not None and entry[0]() is p and id(p) not in self.trainable_ids:
                    stale.append((entry[1], id(p) in self.in_model))
        if stale:
            raise StaleOptimizerError(self._message(optimizer, stale))
        self.checked[optimizer] = groups

    def _message(self, optimizer, stale) -> str:
        replaced = [n for n, kept in stale if not kept]
        untrained = [n for n, kept in stale if kept]
        parts = []
        if replaced:
            parts.append(f"{len(replaced)} that the engine replaced (first: {', '.join(replaced[:3])}): the model no "
                         "longer uses them, so their updates change nothing")
        if untrained:
            parts.append(f"{len(untrained)} that rank {self.rank} does not train (first: {', '.join(untrained[:3])}): "
                         "their owners train them and the engine refreshes this rank's copies")
        return (f"{type(optimizer).__name__} holds parameters of the wrapped model that SubnetDataParallel does not "
                f"train on rank {self.rank}: " + "; ".join(parts) + ". The optimizer was most likely built before "
                "wrapping (e.g. model.configure_optimizers(...) before SubnetDataParallel(model, ...)). Build it after "
                "wrapping, from sdp.parameters() or sdp.named_parameters(), e.g. torch.optim.AdamW(sdp.parameters()) "
                "or model.configure_optimizers(..., params=sdp.named_parameters()).")

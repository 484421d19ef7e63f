"""SyncBatchNorm under SDP: each one synchronises among the ranks that run it.

`nn.SyncBatchNorm` all-reduces its batch statistics over its `process_group` (the whole
world when None). In the forward regime only a unit's owners run the unit (the other ranks
skip the block), so a SyncBatchNorm inside a unit that synchronised over the world would
issue a collective the other ranks never join: mismatched collectives, a hang on GPUs.
Here each SyncBatchNorm gets the process group of the ranks that run it:

- inside a block unit: the block's owners (a group of one rank when it has one owner: the
  statistics are then that rank's own, as a plain BatchNorm's);
- shared (the stem, a shortcut projection's norm): every rank of the engine;
- sliced by a neuron (channel) group: its channels' owners when every channel has the same
  owners (coverage 1); otherwise no single group holds one batch's channels, and it is refused
  by name before the model changes.

The backward regime runs the full forward on every rank, so its SyncBatchNorms keep their
own groups. The group is set on the engine's twin of each SyncBatchNorm (module_swaps.py), so
the user's module keeps its own and `close()` puts it back.
"""
from __future__ import annotations

from typing import Callable

import torch.nn as nn

from ..planning.pieces import Piece
from .regimes.module_swaps import ModuleSwaps


def sync_norm_owners(model: nn.Module, plan, pieces: list[Piece]) -> dict[str, tuple]:
    """{module path: the plan ranks that run it} for every nn.SyncBatchNorm of `model` (the full
    model, before surgery). Raises ValueError for one whose channels have different owners."""
    owners_of = {}
    for p in pieces:
        owners_of.setdefault(p.name, set()).add(p.owners)
    out = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.SyncBatchNorm):
            continue
        names = [f"{path}.{n}" if path else n for n, _ in module.named_parameters(recurse=False)] + \
            [f"{path}.{n}" if path else n for n, b in module.named_buffers(recurse=False) if b is not None]
        sets = set().union(*(owners_of.get(n, set()) for n in names))
        if len(sets) > 1:
            raise ValueError(
                f"SyncBatchNorm {path!r} is sliced by neuron units with different owners ({sorted(sets)}): no process "
                "group holds one batch's channels, so its statistics cannot be synchronised. Plan at level='block' "
                "(a block's SyncBatchNorms then synchronise among the block's owners), use regime='backward', or "
                "keep plain BatchNorm layers in the sliced channel groups. The model was not changed.")
        out[path] = sets.pop() if sets else tuple(range(plan.world_size))
    return out


def assign_sync_norm_groups(model: nn.Module, owners: dict[str, tuple], group_of: Callable,
                            swaps: ModuleSwaps) -> None:
    """Give each SyncBatchNorm this rank runs (still in `model` after the surgery; a skipped block's
    are gone) the process group of its owners, group_of(owners), on the engine's stand-in for it
    (its twin, swapped in and recorded by `swaps`: the user's module keeps its own group)."""
    paths = [path for path, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm) and path in owners]
    for path in paths:
        swaps.put(swaps.stand_in(model, path), "process_group", group_of(owners[path]))

"""The backward regime's owned slices: Parameters that are views of a full tensor.

The backward regime runs the full model, but a rank trains only the runs of rows or columns
it owns. Each sliced tensor `leaf` of a layer becomes a non-persistent buffer `{leaf}_full`
(the full tensor, no longer a Parameter) and one Parameter `{leaf}_owned{i}` per owned run, a
view of the buffer: the optimizer updates the full tensor in place and keeps state only for
the owned runs. `OwnedLayer` is the base of the engine's layers that hold them
(owned_linear.py, owned_conv.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from ...planning.pieces import Piece
from ..regimes.module_swaps import adopt_tensors


class OwnedRun(NamedTuple):
    """One owned run of a sliced tensor: rows or columns [start, start + length) along its
    dimension, trained through the Parameter named `view` (a view of the full tensor)."""
    start: int
    length: int
    view: str


def own_slices(target: nn.Module, leaf: str, full: torch.Tensor, owned: list[Piece],
               piece_params: dict) -> list[OwnedRun]:
    """Register `full` (detached) on `target` as the buffer `{leaf}_full` and each owned piece
    (in order) as the Parameter `{leaf}_owned{i}`, a view of it; records {piece: Parameter} in
    `piece_params` and returns the runs, in the order of `owned`."""
    full = full.detach().requires_grad_(False)
    target.register_buffer(leaf + "_full", full, persistent=False)
    runs = []
    for i, piece in enumerate(owned):
        view = f"{leaf}_owned{i}"
        param = nn.Parameter(full.narrow(piece.dim, piece.start, piece.length))
        target.register_parameter(view, param)
        piece_params[piece] = param
        runs.append(OwnedRun(piece.start, piece.length, view))
    return runs


class OwnedLayer(nn.Module):
    """A layer of the engine's that stands in for the user's (module_swaps.py) and owns its
    slices: the user's unsliced tensors under their own names, each sliced tensor as
    `{leaf}_full` plus its owned views (`own`), and the runs, per sliced tensor.

    Reading a sliced tensor by its own name (`layer.weight`) gives the full tensor, so code
    that reads e.g. `q_proj.weight.shape` or `.dtype` keeps working."""

    def __init__(self, original: nn.Module, sliced):
        super().__init__()
        adopt_tensors(self, original, skip=set(sliced))
        self.runs: dict[str, list[OwnedRun]] = {}
        self.dims: dict[str, int] = {}

    def own(self, leaf: str, full: torch.Tensor, dim: int, owned: list[Piece], piece_params: dict) -> None:
        """Hold `full` (the user's tensor `leaf`) with this rank's owned runs along `dim` (own_slices)."""
        self.runs[leaf] = own_slices(self, leaf, full, owned, piece_params)
        self.dims[leaf] = dim

    def views(self, leaf: str) -> list[nn.Parameter]:
        """The owned runs' Parameters of `leaf`, in run order ([] when `leaf` is not sliced)."""
        return [getattr(self, run.view) for run in self.runs.get(leaf, ())]

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            full = self.__dict__["_buffers"].get(name + "_full")
            if full is not None:
                return full
            raise

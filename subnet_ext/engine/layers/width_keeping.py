"""Width-keeping units: a sliced head group whose module keeps its width.

The forward regime slices a head group's projections to the heads a rank owns and updates
the attention's head-count attributes (slicing.py). An attention whose forward reshapes by a
fixed width (nanoGPT's `split(self.n_embd)` and `view(B, T, self.n_head, C // self.n_head)`,
C the input's width) cannot run sliced (head_check.py finds it at wrap time). Such a group
keeps its module's width instead:

- the weights stay compact (the owned rows of each producer, the owned columns of the
  consumer), so parameters, gradients and optimizer state shrink as in any sliced group;
- each producer (the fused qkv projection) computes its owned rows with the masked linear
  op and scatters them into the full width, zeros at the unowned heads' positions, so the
  module's own reshapes see the width they were written for;
- the attention runs over every head; an unowned head has zero queries, keys and values,
  so its output is exactly zero;
- the consumer (the output projection) reads only its owned input columns (the masked
  linear op's gather) with its compact weight.

A rank owns whole heads, so its owned indices are usually a few runs of head_dim or more
consecutive columns: then the layer takes the run path (width_kept_runs.py: narrow views,
one GEMM per run into or from its column slice, no gather or scatter by index).

Its output equals the subnetwork's (the owned heads alone). What does not shrink: the
attention's own activations and FLOPs (every head is computed, the unowned ones on zeros);
plan.summary() names the modules that run this way and why. Linear projections only.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ... import ops
from ...planning.pieces import Piece, owned_indices
from ..regimes.module_swaps import ModuleSwaps, adopt_tensors
from ..regimes.slicing import compact_copy, split_name
from .width_kept_runs import WidthKeptRuns, index_runs, runs_worth_it


def keepable(root: nn.Module, prefix: str, group) -> bool:
    """True when every member of `group` belongs to an nn.Linear (what the masked op replaces)."""
    strip = len(prefix) + 1 if prefix else 0
    return all(isinstance(root.get_submodule(split_name(m.name[strip:])[0]), nn.Linear) for m in group.members)


class WidthKeptLinear(nn.Module):
    """The forward regime's stand-in for a width-kept projection (module docstring), swapped in
    for the user's nn.Linear (module_swaps.py). It holds the user's compact Parameters under
    their own names (`weight` [kept out, in] or [out, kept in], `bias`) and the owned indices.

    Producer (`out_index` given): x [..., in] -> [..., width], the owned rows' outputs at their
    positions, zeros elsewhere. Consumer (`in_index` given): x [..., width] -> [..., out], from
    the owned input columns only. `runs`: the owned index as [(start, length)] runs when the
    run path applies (width_kept_runs.py), else None (the masked op's index kernels)."""

    def __init__(self, original: nn.Linear, out_index: torch.Tensor | None, in_index: torch.Tensor | None,
                 width: int | None):
        super().__init__()
        adopt_tensors(self, original)
        self.in_features, self.out_features = original.in_features, original.out_features
        # Plain attributes, not buffers: they are no state of the model (no state-dict entry).
        self.out_index, self.in_index, self.width = out_index, in_index, width
        runs = index_runs(out_index if out_index is not None else in_index)
        self.runs = tuple(runs) if runs_worth_it(runs) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The owned runs' GEMMs into (or from) their column slices of the full width, or the
        masked linear op on the compact weight, scattered to (or gathered from) it."""
        if self.runs is not None:
            return WidthKeptRuns.apply(x, self.weight, self.bias, self.runs, self.width)
        return ops.masked_linear(x, self.weight, self.bias, self.out_index, self.in_index, compact_weight=True,
                                 scatter_width=self.width, check_indices=False)


def keep_width(root: nn.Module, prefix: str, group, pieces: list[Piece], rank: int, swaps: ModuleSwaps) -> None:
    """Swap `group`'s modules in `root` for WidthKeptLinear layers (recorded in `swaps`) holding the
    member tensors sliced to this rank's units (compact, in global order); the user's modules are
    set aside with those tensors released (module docstring). root/prefix as slice_group's."""
    strip = len(prefix) + 1 if prefix else 0
    by_module = {}
    for name in dict.fromkeys(m.name for m in group.members):
        by_module.setdefault(split_name(name[strip:])[0], []).append(name)
    for path, names in by_module.items():
        module = root.get_submodule(path)
        consumer = (prefix + "." + path if prefix else path) in group.consumers
        _, idx = owned_indices(pieces, rank, names[0])  # a producer's bias shares its weight's rows
        idx = idx.to(module.weight.device)
        # Producer: owned output rows scattered into the full width. Consumer: owned input columns.
        layer = WidthKeptLinear(module, None, idx, None) if consumer else \
            WidthKeptLinear(module, idx, None, module.weight.shape[0])
        swaps.swap(root, path, layer)
        for name in names:
            dim, owned = owned_indices(pieces, rank, name)
            leaf = split_name(name)[1]
            swaps.put_tensor(layer, leaf, compact_copy(layer._parameters[leaf], dim, owned))

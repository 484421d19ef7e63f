"""Stochastic depth (Huang et al., "Deep Networks with Stochastic Depth", 2016) for the DDP
baseline: the method SDP's block level is closest to, and the one to beat.

Training: at every optimizer step, each rank drops each residual block with probability
`drop` (survival probability p = 1 - drop, the same for every block, as SDP's coverage
is). A dropped block returns its input: its branches are not computed, so the step saves
their FLOPs and activations (not parameters, gradients or optimizer state: every rank
still holds the whole model). The decision is a pure function of (seed, optimizer step,
rank, block), so a resumed run draws the same blocks, and ranks draw independently (as
each SDP rank trains its own subnetwork). DDP averages over all K ranks, so a block's
gradient is the sum over the ranks that kept it divided by K (`find_unused_parameters`
lets DDP reduce blocks a rank skipped).

Evaluation (the model in eval mode): every block runs, and each residual branch's output
is multiplied by p, the paper's test-time rule ("H = ReLU(p f(H) + id(H))"), so the
expected size of the residual updates matches training's.

The blocks are those SDP's planner finds, their branches the traced residual adds'
other operands (GPT: attn and mlp; LLaMA: self_attn and mlp; residual MLP: fc2). Blocks
whose skip path is not their input (ResNet's projection or ReLU after the sum) are refused.
Each block is swapped (engine/regimes/module_swaps.py) for a twin of a subclass of its class that may
drop it (`droppable_class`): the same attributes, children, hooks (activation checkpointing's
included) and parameter names; `remove()` puts the blocks back.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

try:  # torch 2.14 tells symbolic tracing apart from torch.export (its is_fx_tracing warns)
    from torch.fx._symbolic_trace import is_fx_symbolic_tracing
except ImportError:  # a torch without it: one flag for both
    from torch.fx._symbolic_trace import is_fx_tracing as is_fx_symbolic_tracing

from ..engine.regimes.module_swaps import ModuleSwaps, twin
from .run_checkpoints import stream_seed


def residual_branches(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """{block path: (child names whose outputs are the block's residual branches)}, in model
    order: the blocks the SDP planner finds (planning/discovery/blocks.py) and their traced residual
    adds (planning/discovery/residual.py). Empty when the model has none.

    Raises:
        ValueError: a block whose skip path is not its input (a shortcut projection or a ReLU
            after the sum: dropping it would not be the identity), or a branch that is not
            one child's output (its scale has no module to act on).
    """
    from ..planning.discovery.blocks import find_blocks
    from ..planning.discovery.residual import trace_skip_path

    out = {}
    for group in find_blocks(model):
        path = trace_skip_path(model.get_submodule(group.path))
        if path.mode != "identity":
            raise ValueError(f"stochastic depth: block {group.path} computes {path.mode} on its skip path, so "
                             "dropping it is not the identity; only blocks whose skip path is their input are "
                             "supported")
        if None in path.branches:
            raise ValueError(f"stochastic depth: a residual branch of {group.path} is not one child module's "
                             f"output (found {path.branches})")
        out[group.path] = path.branches
    return out


_DROPPABLE: dict[type, type] = {}


def droppable_class(cls: type) -> type:
    """The subclass of block class `cls` that stochastic depth swaps in (one per class, no state of
    its own). Its forward returns x (the block's first argument) when this step drops the block in
    training, else the block's forward; `stochastic_depth` (the controller) and
    `stochastic_depth_index` (the block's index in its draws) are set on the twin. The forward
    wraps cls.forward (functools.wraps), so torch.fx reads the block's own signature, and while
    torch.fx traces it the block runs whole: the planner's tracing sees the block, not one draw."""
    if cls not in _DROPPABLE:
        block_forward = cls.forward

        @functools.wraps(block_forward)
        def forward(self, *args, **kwargs):
            if self.training and not is_fx_symbolic_tracing() and \
                    not self.stochastic_depth.kept(self.stochastic_depth_index):
                return args[0] if args else next(iter(kwargs.values()))
            return block_forward(self, *args, **kwargs)

        _DROPPABLE[cls] = type(f"Droppable{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
    return _DROPPABLE[cls]


class _ScaleAtEval:
    """Forward hook: a residual branch's output times the survival probability, in eval mode."""

    def __init__(self, controller):
        self.controller = controller

    def __call__(self, module, args, output):
        if module.training or not self.controller.scale_at_eval:
            return None
        return output * self.controller.survival


class StochasticDepth:
    """Installs stochastic depth on `model`'s residual blocks (in place; call before wrapping).

    Args:
        model: a model with blocks residual_branches() knows.
        drop: probability a block is dropped at a step, in [0, 1).
        seed, rank: the run's seed and this rank (the draws' stream).
    Attributes:
        branches: {block path: residual branch child names} (residual_branches of the model as given).
        step: optimizer steps taken (advance with `advance()` after each optimizer step).
        scale_at_eval: True (the paper's rule); False evaluates the unscaled full network.
    Raises:
        ValueError: drop outside [0, 1), or a model with no block of a known type.
    """

    def __init__(self, model: nn.Module, drop: float, seed: int, rank: int):
        if not 0.0 <= drop < 1.0:
            raise ValueError(f"stochastic depth: the drop probability must be in [0, 1), got {drop}")
        branches = residual_branches(model)
        if not branches:
            raise ValueError(f"stochastic depth: {type(model).__name__} has no residual block the planner finds; "
                             "declare blocks to SDP's planner or use a model with residual blocks")
        self.drop, self.survival, self.seed, self.rank = drop, 1.0 - drop, seed, rank
        self.blocks = list(branches)
        self.branches = branches  # traced here, before the swap: a droppable block traces as its draw decides
        self.step = 0
        self.scale_at_eval = True
        self._cached = (None, None)
        self._swaps, self._hooks = ModuleSwaps(), []
        for index, (path, names) in enumerate(branches.items()):
            block = model.get_submodule(path)
            droppable = twin(block, droppable_class(type(block)))
            droppable.stochastic_depth, droppable.stochastic_depth_index = self, index
            self._swaps.swap(model, path, droppable)
            for name in names:
                self._hooks.append(block.get_submodule(name).register_forward_hook(_ScaleAtEval(self)))

    def remove(self) -> None:
        """Put the model's own blocks back and remove the evaluation scaling (the model as it was)."""
        self._swaps.undo()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def kept_blocks(self, step: int, rank: int) -> list[bool]:
        """Which blocks rank `rank` keeps at optimizer step `step` (0-based), one bool per block."""
        generator = torch.Generator().manual_seed(stream_seed(self.seed, step, rank) ^ 0x5D)
        return (torch.rand(len(self.blocks), generator=generator, dtype=torch.float64) >= self.drop).tolist()

    def kept(self, index: int) -> bool:
        """Whether this rank keeps block `index` at the current step."""
        if self._cached[0] != self.step:
            self._cached = (self.step, self.kept_blocks(self.step, self.rank))
        return self._cached[1][index]

    def advance(self) -> None:
        """One optimizer step was taken: the next forward draws the next step's blocks."""
        self.step += 1

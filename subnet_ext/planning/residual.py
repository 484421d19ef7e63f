"""The skip path of a residual block, found by its role rather than by a name.

A rank that does not own a block still has to produce the block's output shape and
the residual signal: it runs the block's *skip path*, the part of the block that
computes the non-branch operand of the residual sum (a shortcut projection, or nothing
for an identity shortcut), followed by the ReLU when the block applies one after the
sum (post-activation ResNets) and without it when it does not (pre-activation blocks).

The path is found by tracing the block once with torch.fx (no sample input needed):
walk back from the output through ReLUs to the residual add; of its two operands the
shortcut is the one that depends on the block input through fewer parameterised
modules. The top-level children that operand depends on are the block's *skip
modules*: shared by every rank (held whole, outside the block's unit), so every rank
can run them. When tracing fails (data-dependent control flow), the shortcut is found
by name (downsample, shortcut, proj, skip) and the ReLU is assumed, as in torchvision.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

SHORTCUT_NAMES = ("downsample", "shortcut", "proj", "skip")
_ADDS = {operator.add, operator.iadd, torch.add}
_RELUS = {F.relu, torch.relu, torch.relu_}


@dataclass
class SkipPath:
    """modules: top-level child names the skip path runs (shared parameters).
    relu: whether the block applies a ReLU after the residual sum.
    forward: function (block_like, x [B, C, ...]) -> skip output [B, C', ...], reading the
    skip modules as attributes of its first argument (so a stub holding them can run it).
    traced: False when found by name (trace failed)."""

    modules: tuple
    relu: bool
    forward: object
    traced: bool = True

    @property
    def mode(self) -> str:
        """The plan's skip mode: "shortcut_relu" (post-activation) or "shortcut"."""
        return "shortcut_relu" if self.relu else "shortcut"


def _is_relu(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_function":
        return node.target in _RELUS
    if node.op == "call_method":
        return node.target in ("relu", "relu_")
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.ReLU)


def _is_add(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _ADDS) or \
        (node.op == "call_method" and node.target in ("add", "add_"))


def _ancestors(node: fx.Node) -> set:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen


def _param_modules(nodes: set, gm: fx.GraphModule) -> set:
    return {n.target for n in nodes if n.op == "call_module"
            and any(True for _ in gm.get_submodule(n.target).parameters())}


def _traced(block: nn.Module) -> SkipPath | None:
    try:
        gm = fx.symbolic_trace(block)
    except Exception:  # data-dependent control flow, unsupported ops: fall back to names
        return None
    graph = gm.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    out = next(n for n in graph.nodes if n.op == "output")
    node, relus = out.args[0], 0
    while isinstance(node, fx.Node) and _is_relu(node, gm):
        node, relus = node.args[0], relus + 1
    if not inputs or not isinstance(node, fx.Node) or not _is_add(node) or len(node.args) < 2 \
            or not all(isinstance(a, fx.Node) for a in node.args[:2]):
        return None
    anc = [_ancestors(a) for a in node.args[:2]]
    costs = [len(_param_modules(a, gm)) for a in anc]
    if costs[0] == costs[1]:
        return None  # no operand is cheaper: not a branch + shortcut sum
    s = 0 if costs[0] < costs[1] else 1
    if inputs[0] not in anc[s]:
        return None
    shortcut = node.args[s]
    modules = tuple(dict.fromkeys(n.target.split(".")[0] for n in anc[s]
                                  if n.op in ("call_module", "get_attr")))
    with graph.inserting_before(out):
        result = graph.call_function(torch.relu, (shortcut,)) if relus else shortcut
    out.args = (result,)
    graph.eliminate_dead_code()
    gm.recompile()
    return SkipPath(modules, relus > 0, type(gm).forward)


def _by_name(block: nn.Module) -> SkipPath:
    name = next((n for n in SHORTCUT_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)

    def forward(self, x):
        return torch.relu(getattr(self, name)(x) if name is not None else x)

    return SkipPath((name,) if name else (), True, forward, traced=False)


def skip_path(block: nn.Module) -> SkipPath:
    """The block's skip path: traced when torch.fx can, else by the shortcut's name."""
    return _traced(block) or _by_name(block)


def is_pre_activation(block: nn.Module) -> bool:
    """True when tracing shows no ReLU after the residual sum (bn-relu-conv order): the
    block's first norm then normalises its input, not the inner channels."""
    path = _traced(block)
    return path is not None and not path.relu


def pre_activation_error(path: str) -> ValueError:
    """The neuron-level refusal of a pre-activation block (see is_pre_activation)."""
    return ValueError(f"{path!r} is a pre-activation residual block (no ReLU after the sum): a channel group would "
                      "slice the norm that normalises the block's input, not its inner channels. Plan it at "
                      "level='block', or declare its units with neuron_groups=[(producer, consumer, norms)].")

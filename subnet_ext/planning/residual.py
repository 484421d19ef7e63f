"""What skipping a residual block computes, found by tracing the block's dataflow (docs/design.md §1.1).

A rank that does not own a block still has to produce the block's output: it runs the
block's *skip path*. The block is traced once with torch.fx, its children kept as opaque
calls (their insides do not matter, and an attention's shape arithmetic would not trace),
arguments with defaults fixed to them. From the output, the *identity chain* is walked
back to the input: residual adds (each continuing through the operand that carries the
input through adds only), norms and dropout applied after an add (post-LN: on the chain,
in the unit, dropped with the block as LayerDrop does), and ReLUs after the last add
(post-activation ResNets: kept, the skip path is relu(shortcut)). Where no add operand
is the input itself, the one through fewer parameterised modules is the shortcut
projection (ResNet's downsample): its modules are the *skip modules*, held by every rank,
so an unowned block still maps shapes. Everything else, every branch of every add
(pre-LN: ln_1, attention, ln_2, MLP; parallel: ln, attention and MLP), is the unit.

A module with no residual add carrying its input to its output is not a block: the trace
says so (ResidualError), and skipping it would compute something else. Only when torch.fx
cannot trace a ResNet-shaped block (see units.py) is its shortcut found by name
(downsample, shortcut, proj, skip) with the ReLU after the sum torchvision blocks apply.
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

SHORTCUT_NAMES = ("downsample", "shortcut", "proj", "skip")
_ADDS = {operator.add, operator.iadd, torch.add}
_RELUS = {F.relu, torch.relu, torch.relu_}
# Functions that leave a residual stream's meaning in place when applied after an add.
_PASS_FUNCTIONS = {F.layer_norm, F.group_norm, F.batch_norm, F.dropout} | \
    ({F.rms_norm} if hasattr(F, "rms_norm") else set())
_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm) + \
    ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


class ResidualError(ValueError):
    """Why a module is not a residual block the planner can skip. untraceable: torch.fx
    could not trace it (as opposed to: traced, and no residual add around it)."""

    def __init__(self, message: str, untraceable: bool = False):
        super().__init__(message)
        self.untraceable = untraceable


@dataclass
class SkipPath:
    """modules: top-level child names the skip path runs (shared parameters).
    relu: whether the block applies a ReLU after the residual sum.
    forward: function (block_like, x [B, C, ...]) -> skip output [B, C', ...], reading the
    skip modules as attributes of its first argument (so a stub holding them can run it).
    traced: False when found by name (trace failed).
    branches: per residual add on the identity chain, input side first, the top-level child
    whose output is the add's other operand (through dropout/identity), or None where that
    operand is not one child's output (a product, a sum of children); () when found by name."""

    modules: tuple
    relu: bool
    forward: object
    traced: bool = True
    branches: tuple = ()

    @property
    def mode(self) -> str:
        """The plan's skip mode: "identity", "shortcut_relu" (post-activation) or "shortcut"."""
        if not self.modules and not self.relu:
            return "identity"
        return "shortcut_relu" if self.relu else "shortcut"


class _ChildrenAsCalls(fx.Tracer):
    """Every submodule call is one graph node: the block's own dataflow is what matters."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def _trace(block: nn.Module) -> fx.GraphModule:
    """The block's forward as a graph (children opaque; defaulted arguments fixed to their defaults)."""
    try:  # the class's forward, as torch.fx traces it (an instance may wrap it, e.g. in a checkpoint)
        params = list(inspect.signature(type(block).forward).parameters.values())[1:]  # without self
    except (TypeError, ValueError):
        params = []
    fixed = {p.name: p.default for p in params[1:]
             if p.default is not inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD}
    tracer = _ChildrenAsCalls()
    try:
        graph = tracer.trace(block, concrete_args=fixed or None)
    except Exception as e:  # data-dependent control flow, size unpacking, unsupported ops
        raise ResidualError(f"torch.fx cannot trace it ({type(e).__name__}: {str(e).splitlines()[0][:200]})",
                            untraceable=True) from None
    return fx.GraphModule(tracer.root, graph)


def _is_relu(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_function":
        return node.target in _RELUS
    if node.op == "call_method":
        return node.target in ("relu", "relu_")
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.ReLU)


def _is_add(node: fx.Node) -> bool:
    is_add = (node.op == "call_function" and node.target in _ADDS) or \
        (node.op == "call_method" and node.target in ("add", "add_"))
    return is_add and len(node.args) >= 2 and all(isinstance(a, fx.Node) for a in node.args[:2]) and \
        "alpha" not in node.kwargs


def _passes_through(node: fx.Node, gm: fx.GraphModule) -> bool:
    """A norm, dropout or identity of one tensor: on the chain when applied after an add."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.op == "call_function":
        return node.target in _PASS_FUNCTIONS
    if node.op != "call_module":
        return False
    m = gm.get_submodule(node.target)
    return isinstance(m, _NORM_TYPES + (nn.Dropout, nn.Identity)) or type(m).__name__.endswith("Norm")


def _ancestors(node: fx.Node) -> set:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen


def _cost(nodes: set, gm: fx.GraphModule) -> int:
    """Parameterised modules (counted inside opaque children) the nodes call."""
    total = 0
    for n in nodes:
        if n.op == "call_module":
            total += sum(1 for m in gm.get_submodule(n.target).modules()
                         if any(True for _ in m.parameters(recurse=False)))
    return total


@dataclass(frozen=True)
class _Chain:
    base: fx.Node  # the input placeholder, or the shortcut projection's output
    adds: int  # residual adds between base and the node
    branches: tuple = ()  # each add's other operand (the residual branch), input side first


def _chain(node: fx.Node, inp: fx.Node, gm: fx.GraphModule, memo: dict) -> _Chain | None:
    """The identity chain from `inp` to `node`, or None when `node` is not on one."""
    if node in memo:
        return memo[node]
    memo[node] = None  # a graph is acyclic; this only guards against re-entry
    found = None
    if node is inp:
        found = _Chain(inp, 0)
    elif _is_add(node):
        operands = list(node.args[:2])
        chains = {i: c for i, a in enumerate(operands) if (c := _chain(a, inp, gm, memo)) is not None}
        costs = [_cost(_ancestors(a), gm) for a in operands]
        cheaper = costs.index(min(costs)) if costs[0] != costs[1] else None
        reached = len(chains)
        if reached == 2:  # both operands reach the input through adds: the cheaper one carries it
            chains = {cheaper: chains[cheaper]} if cheaper is not None else {}
        if len(chains) == 1:
            (i, c), = chains.items()
            found = _Chain(c.base, c.adds + 1, c.branches + (operands[1 - i],))
        elif reached == 0 and cheaper is not None and inp in _ancestors(operands[cheaper]):
            # No operand is a chain: the one through fewer parameterised modules is the shortcut.
            found = _Chain(operands[cheaper], 1, (operands[1 - cheaper],))
    elif _passes_through(node, gm):
        c = _chain(node.args[0], inp, gm, memo)
        if c is not None and c.adds > 0:
            found = _Chain(c.base, c.adds, c.branches)
    memo[node] = found
    return found


def _branch_child(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """The top-level child whose output `node` is, through dropout and identity; None otherwise."""
    while node.op in ("call_module", "call_function") and node.args and isinstance(node.args[0], fx.Node):
        if node.op == "call_module" and not isinstance(gm.get_submodule(node.target), (nn.Dropout, nn.Identity)):
            return node.target.split(".")[0]
        if node.op == "call_function" and node.target is not F.dropout:
            return None
        node = node.args[0]
    return None


def _top_names(nodes) -> tuple:
    return tuple(dict.fromkeys(n.target.split(".")[0] for n in nodes if n.op in ("call_module", "get_attr")))


def trace_skip_path(block: nn.Module) -> SkipPath:
    """The block's skip path from its traced dataflow (module docstring); raises ResidualError
    when it cannot be traced or no chain of residual adds carries its input to its output."""
    gm = _trace(block)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    node, relus = out.args[0], 0
    if not isinstance(node, fx.Node):
        raise ResidualError(f"its forward returns a {type(node).__name__}, not one tensor: a stand-in returning "
                            "its input could not replace it")
    while _is_relu(node, gm) and isinstance(node.args[0], fx.Node):
        node, relus = node.args[0], relus + 1
    chain = _chain(node, inputs[0], gm, {}) if inputs else None
    if chain is None:
        raise ResidualError("no residual add carries its input to its output (skipping it would not be the "
                            "identity)")
    needed = _ancestors(chain.base)
    others = [n.name for n in needed if n.op == "placeholder" and n is not inputs[0]]
    if others:
        raise ResidualError(f"its shortcut reads the argument(s) {others} besides the input; a stand-in cannot "
                            "compute it from the input alone")
    graph, env = fx.Graph(), {}
    for n in gm.graph.nodes:  # the skip path alone: the base's ancestors, then the ReLU
        if n in needed:
            env[n] = graph.node_copy(n, lambda a: env[a])
    result = env[chain.base]
    graph.output(graph.call_function(torch.relu, (result,)) if relus else result)
    skip = fx.GraphModule(gm, graph)
    modules = _top_names(needed) if chain.base is not inputs[0] else ()
    branches = tuple(_branch_child(b, gm) for b in chain.branches)
    return SkipPath(modules, relus > 0, type(skip).forward, True, branches)


def _by_name(block: nn.Module) -> SkipPath:
    name = next((n for n in SHORTCUT_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)

    def forward(self, x):
        return torch.relu(getattr(self, name)(x) if name is not None else x)

    return SkipPath((name,) if name else (), True, forward, traced=False)


def skip_path(block: nn.Module) -> SkipPath:
    """The block's skip path: traced when torch.fx can, else (untraceable blocks) by the
    shortcut's name with a ReLU after the sum. For ResNet-shaped blocks only (units.py)."""
    try:
        return trace_skip_path(block)
    except ResidualError as e:
        if not e.untraceable:
            raise
        return _by_name(block)


def is_pre_activation(block: nn.Module) -> bool:
    """True when tracing shows no ReLU after the residual sum (bn-relu-conv order): the
    block's first norm then normalises its input, not the inner channels."""
    try:
        return not trace_skip_path(block).relu
    except ResidualError:
        return False


def pre_activation_error(path: str) -> ValueError:
    """The neuron-level refusal of a pre-activation block (see is_pre_activation)."""
    return ValueError(f"{path!r} is a pre-activation residual block (no ReLU after the sum): a channel group would "
                      "slice the norm that normalises the block's input, not its inner channels. Plan it at "
                      "level='block', or declare its units with neuron_groups=[(producer, consumer, norms)].")

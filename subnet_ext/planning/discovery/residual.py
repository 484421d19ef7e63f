"""What skipping a residual block computes, found by tracing the block's dataflow (docs/design.md §1.1).

A rank that does not own a block still has to produce the block's output: it runs the
block's *skip path*. The block is traced once with torch.fx, its children kept as opaque
calls (their insides do not matter, and an attention's shape arithmetic would not trace),
arguments with defaults fixed to them. Where torch.fx cannot trace the block's own forward
(a factory function fed a shape, a branch on a size, a child's tuple output unpacked), one
real call of it, recorded on the model's sample input, is traced at the dispatcher level
instead (call_trace.py): a graph of the same form, its ops aten overloads, read the same way.

From the output, the *identity chain* is walked
back to the input: residual adds (each continuing through the operand that carries the
input through adds only), norms and dropout applied after an add (post-LN: on the chain,
in the unit, dropped with the block as LayerDrop does), reshapes of the stream in a traced
call that end in the input's shape (OPT's decoder layer flattens it around its MLP), and
ReLUs after the last add
(post-activation ResNets: kept, the skip path is relu(shortcut)). Where no add operand
is the input itself, the one through fewer parameterised modules is the shortcut
projection (ResNet's downsample): its modules are the *skip modules*, held by every rank,
so an unowned block still maps shapes. Everything else, every branch of every add
(pre-LN: ln_1, attention, ln_2, MLP; parallel: ln, attention and MLP), is the unit.

A module with no residual add carrying its input to its output is not a block: the trace
says so (ResidualError), and skipping it would compute something else; nor is one where
two operands carry the input at equal cost (ambiguous). Only when neither trace is possible
for a ResNet-shaped block (see units.py) is its shortcut found by name
(downsample, shortcut, proj, skip) with the ReLU after the sum torchvision blocks apply.
"""
from __future__ import annotations

import inspect
import linecache
import operator
import os
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .call_trace import tensor_leaf, trace_call

SHORTCUT_NAMES = ("downsample", "shortcut", "proj", "skip")
_ATEN = torch.ops.aten


def _overloads(*names: str) -> set:
    """The aten overloads of these names that this torch has ("native_layer_norm.default")."""
    out = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(_ATEN, packet, None), overload, None)
        if op is not None:
            out.add(op)
    return out


# torch.fx records the Python call (operator.add, F.layer_norm); a traced call records aten ops.
_ADDS = {operator.add, operator.iadd, torch.add} | _overloads("add.Tensor", "add_.Tensor")
_RELUS = {F.relu, torch.relu, torch.relu_} | _overloads("relu.default", "relu_.default")
# Functions that leave a residual stream's meaning in place when applied after an add.
_PASS_FUNCTIONS = {F.layer_norm, F.group_norm, F.batch_norm, F.dropout} | \
    ({F.rms_norm} if hasattr(F, "rms_norm") else set()) | \
    _overloads("layer_norm.default", "group_norm.default", "rms_norm.default", "dropout.default")
# The same as aten ops returning (output, saved statistics...): their output is item 0.
_PASS_TUPLES = _overloads("native_layer_norm.default", "native_group_norm.default", "native_batch_norm.default",
                          "_native_batch_norm_legit.default", "_native_batch_norm_legit_no_training.default",
                          "_fused_rms_norm.default", "native_dropout.default")
_DROPOUTS = {F.dropout} | _overloads("dropout.default", "native_dropout.default")
# Reshapes that keep the elements in order: a traced call's stream may pass through them if
# it ends in the input's shape (checked on the recorded shapes).
_REORDER_FREE = _overloads("view.default", "_unsafe_view.default", "reshape.default", "flatten.using_ints",
                           "unflatten.int", "squeeze.dim", "squeeze.dims", "unsqueeze.default", "alias.default",
                           "clone.default")
_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm) + \
    ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


class ResidualError(ValueError):
    """Why a module is not a residual block the planner can skip. untraceable: it could not
    be traced (as opposed to: traced, and no residual add around it); traced_call: the reason
    comes from a traced call (torch.fx could not read the module)."""

    def __init__(self, message: str, untraceable: bool = False, traced_call: bool = False):
        super().__init__(message)
        self.untraceable, self.traced_call = untraceable, traced_call


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


def _failing_line(block: nn.Module, error: BaseException) -> str:
    """", at file:line: `code`" of the last line of the block's own class (its forward or a
    helper) the error passed through: the call torch.fx could not trace; "" when none did."""
    try:
        source = inspect.getsourcefile(type(block))
    except TypeError:
        return ""
    found, tb = None, error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == source:
            found = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    if found is None:
        return ""
    code = linecache.getline(*found).strip()
    return f", at {os.path.basename(found[0])}:{found[1]}: `{code}`"


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
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise ResidualError(f"torch.fx cannot trace it ({type(e).__name__}: {first}{_failing_line(block, e)})",
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


def _carried(node: fx.Node, gm: fx.GraphModule) -> tuple[fx.Node, bool] | None:
    """(the stream `node` carries, whether it reshapes it) when `node` is a norm, dropout or
    identity of one tensor (on the chain when applied after an add), or a reshape of a traced
    call's stream; else None."""
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0 and \
            isinstance(node.args[0], fx.Node) and node.args[0].op == "call_function" and \
            node.args[0].target in _PASS_TUPLES:  # item 0 of an aten norm or dropout: its output
        node = node.args[0]
        return (node.args[0], False) if node.args and isinstance(node.args[0], fx.Node) else None
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.op == "call_function":
        if node.target in _PASS_FUNCTIONS:
            return node.args[0], False
        return (node.args[0], True) if node.target in _REORDER_FREE else None
    if node.op != "call_module":
        return None
    m = gm.get_submodule(node.target)
    passes = isinstance(m, _NORM_TYPES + (nn.Dropout, nn.Identity)) or type(m).__name__.endswith("Norm")
    return (node.args[0], False) if passes else None


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
    reshaped: bool = False  # the stream passes through a reshape (a traced call's; see _carried)


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
            found = _Chain(c.base, c.adds + 1, c.branches + (operands[1 - i],), c.reshaped)
        elif reached == 0 and cheaper is not None and inp in _ancestors(operands[cheaper]):
            # No operand is a chain: the one through fewer parameterised modules is the shortcut.
            found = _Chain(operands[cheaper], 1, (operands[1 - cheaper],))
    elif (carried := _carried(node, gm)) is not None:
        c = _chain(carried[0], inp, gm, memo)
        if c is not None and (c.adds > 0 or carried[1]):  # a norm before the first add is the branch's
            found = _Chain(c.base, c.adds, c.branches, c.reshaped or carried[1])
    memo[node] = found
    return found


def _branch_child(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """The top-level child whose output `node` is, through dropout and identity; None otherwise."""
    while node.op in ("call_module", "call_function") and node.args and isinstance(node.args[0], fx.Node):
        if node.op == "call_module" and not isinstance(gm.get_submodule(node.target), (nn.Dropout, nn.Identity)):
            return node.target.split(".")[0]
        if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0 and \
                node.args[0].target in _DROPOUTS:  # item 0 of aten's native_dropout
            node = node.args[0]
        elif node.op == "call_function" and node.target not in _DROPOUTS:
            return None
        node = node.args[0]
    return None


def _top_names(nodes) -> tuple:
    return tuple(dict.fromkeys(n.target.split(".")[0] for n in nodes if n.op in ("call_module", "get_attr")))


# Nodes a stand-in can replay from a traced call's graph: module calls and reading their outputs.
# An aten op of the block's own forward holds the sample's shapes as constants.
_REPLAYABLE = ("placeholder", "call_module")


def _replayable(n: fx.Node) -> bool:
    return n.op in _REPLAYABLE or (n.op == "call_function" and n.target in (operator.getitem, tensor_leaf))


def skip_path_of_graph(gm: fx.GraphModule, traced_call: bool = False) -> SkipPath:
    """The skip path of a block traced as `gm` (torch.fx's symbolic trace, or `traced_call`:
    one real call traced by call_trace.py); module docstring. Raises ResidualError."""
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
                            "identity), or two operands carry it at equal cost (ambiguous)")
    if chain.reshaped and node.meta["val"].shape != chain.base.meta["val"].shape:
        raise ResidualError(f"its residual stream is reshaped from {list(chain.base.meta['val'].shape)} to "
                            f"{list(node.meta['val'].shape)}; a stand-in returning its input would not have that shape")
    needed = _ancestors(chain.base)
    others = [n.name for n in needed if n.op == "placeholder" and n is not inputs[0]]
    if others:
        raise ResidualError(f"its shortcut reads the argument(s) {others} besides the input; a stand-in cannot "
                            "compute it from the input alone")
    own_ops = sorted({str(n.target) for n in needed if not _replayable(n)})
    if traced_call and own_ops:
        raise ResidualError(f"its shortcut computes {own_ops} in the block's own forward; a stand-in replays only "
                            "the module calls of a traced call (the ops hold the sample input's shapes). Move them "
                            "into a child module, or make the forward traceable by torch.fx")
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


# Skip paths found from a traced call, by block (the user's module): the engine's stand-in for
# a skipped block (engine/regimes/surgery.py) reads them where torch.fx cannot trace the block.
_FROM_CALLS: "weakref.WeakKeyDictionary[nn.Module, SkipPath]" = weakref.WeakKeyDictionary()


def trace_skip_path(block: nn.Module) -> SkipPath:
    """The block's skip path from its traced dataflow (module docstring): the one found from a
    traced call of this very module (traced_call_skip_path), else torch.fx's. Raises
    ResidualError when it cannot be traced or no chain of residual adds carries its input to its
    output."""
    found = _FROM_CALLS.get(block)
    return found if found is not None else skip_path_of_graph(_trace(block))


def traced_call_skip_path(block: nn.Module, meta_block: nn.Module, args: tuple, kwargs: dict) -> SkipPath:
    """The skip path of `block` from one real call of its meta copy `meta_block` on the recorded
    (args, kwargs) (call_trace.py), remembered for `block`. Raises ResidualError."""
    try:
        gm = trace_call(meta_block, args, kwargs)
    except Exception as e:  # noqa: BLE001 - the block's own code on meta tensors: reported by name
        raise ResidualError(f"tracing its recorded call failed ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200] if str(e) else ''})", untraceable=True) from None
    found = skip_path_of_graph(gm, traced_call=True)
    _FROM_CALLS[block] = found
    return found


def by_name(block: nn.Module) -> SkipPath:
    """The skip path of a ResNet-shaped block neither trace can read: relu(shortcut(x)), the
    shortcut found by name (SHORTCUT_NAMES), or relu(x) without one (torchvision's convention)."""
    name = next((n for n in SHORTCUT_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)

    def forward(self, x):
        return torch.relu(getattr(self, name)(x) if name is not None else x)

    return SkipPath((name,) if name else (), True, forward, traced=False)


def skip_path(block: nn.Module) -> SkipPath:
    """The block's skip path: traced (trace_skip_path), else (untraceable blocks) by the
    shortcut's name with a ReLU after the sum. The fallback is for ResNet-shaped blocks only
    (units.py): the caller checks the shape."""
    try:
        return trace_skip_path(block)
    except ResidualError as e:
        if not e.untraceable:
            raise
        return by_name(block)


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

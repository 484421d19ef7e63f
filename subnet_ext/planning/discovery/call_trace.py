"""One real call of a block, traced at the dispatcher level (docs/design.md §1.1).

torch.fx's symbolic trace (residual.py) runs a block's forward on proxies: it cannot pass a
shape read from its input to a factory function (`torch.ones(T, T)` with `T = x.shape[1]`),
follow `if x.size(1) > n:`, or unpack a child's tuple output. The planner only needs what
skipping the block computes, which one real call shows. So:

- `RecordedCalls` runs the model once on its `sample_input`, on a meta copy (shapes only,
  nothing computed or allocated), and keeps each module's first call: its arguments and
  keyword arguments as meta tensors, as the parent passed them (masks, rotary tables,
  keyword-only inputs included), copied as they were at the call (a KV cache grows);
- `trace_call` runs that call of the block again under a TorchDispatchMode that records
  every aten op the block's own forward makes, while forward hooks turn each submodule call
  into one opaque node. The result is an fx graph of the same form as the symbolic trace's
  (placeholders, `call_module` nodes for the children, the block's own ops, the output), so
  residual.py reads the skip path from either the same way; the ops are aten overloads
  (`aten.add.Tensor` where fx records `operator.add`), each node's meta["val"] the meta
  tensor it produced.

Python code runs for real: shapes are concrete, branches take the way the sample input
takes them. What the block computes from values (`mask.any()`) cannot run on meta tensors
and is reported with the block's name.
"""
from __future__ import annotations

import copy
import inspect
import operator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .flops import meta_copy, sample_meta_input


def tensor_leaf(out, index: int):
    """The index-th tensor among the leaves of a module's output (a tuple, a dict, a dataclass
    output): how the trace reads one tensor out of a child's structured output."""
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)][index]


def constant(value):
    """A tensor the traced call read from outside the block (a global, a cached tensor)."""
    return value


def _snapshot(value):
    """A deep copy of a call's arguments (meta tensors: nothing allocated): a KV cache the
    model passes is mutated by the call, so each replay starts from the state it was called
    with. The arguments themselves where they cannot be copied."""
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an argument deepcopy cannot handle: replayed as it is
        return value


class RecordedCalls:
    """The first call of every module of `model` on `sample_input`, run once on a meta copy.

    sample_input: a tensor or (shape, dtype), as plan_subnetworks takes it. `call_of(path)`
    gives (the meta copy's module at path, args, kwargs). The model is run in eval mode (a
    batch of 1 would trip BatchNorm's training check), its flags restored afterwards."""

    def __init__(self, model: nn.Module, sample_input):
        self.model, self.sample_input = model, sample_input
        self._meta, self._calls, self._error = None, None, None

    def _record(self) -> None:
        x = sample_meta_input(self.sample_input)
        meta = meta_copy(self.model)
        calls, handles = {}, []
        for path, module in meta.named_modules():
            def pre(m, args, kwargs, path=path):
                if path not in calls:
                    calls[path] = _snapshot((args, kwargs))
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        modes = {m: m.training for m in meta.modules()}
        meta.eval()
        try:
            with torch.no_grad():
                meta(x)
        except Exception as e:  # noqa: BLE001 - the model's own code, any error: reported by name
            self._error = f"running the model on sample_input {list(x.shape)} {x.dtype} on the meta device " \
                          f"failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
        finally:
            for h in handles:
                h.remove()
            for m, training in modes.items():
                m.train(training)
        self._meta, self._calls = meta, calls

    def call_of(self, path: str) -> tuple[nn.Module, tuple, dict]:
        """(meta module, args, kwargs) of the first call of the module at `path`.

        Raises:
            ValueError: the model did not run on the sample input before calling it, or never called it.
        """
        if self._calls is None:
            self._record()
        if path not in self._calls:
            why = self._error or "the model's forward on sample_input never called it"
            raise ValueError(f"no call of {path!r} was recorded: {why}")
        args, kwargs = _snapshot(self._calls[path])
        return self._meta.get_submodule(path), args, kwargs


def _first_input(block: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    """The block's input: its first positional argument, or the keyword argument named as its
    forward's first parameter (`hidden_states=` in a keyword call)."""
    if args:
        first = args[0]
    else:
        try:
            name = next(iter(inspect.signature(block.forward).parameters))
        except (TypeError, ValueError, StopIteration):
            name = None
        first = kwargs.get(name)
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"its first argument is a {type(first).__name__}, not a tensor")
    return first


class _Recorder(TorchDispatchMode):
    """Records the aten ops the block's own forward makes (not those inside a child) into `graph`.

    `nodes`: {id(tensor): (tensor, node)}: which node produced each live tensor (the tensor is
    kept so its id is not reused); an in-place op makes its node the tensor's producer.
    `depth`: submodule calls entered (ops inside one are the child's, not recorded); `pending`:
    the outermost child call's (args, kwargs) as nodes, until it returns."""

    def __init__(self, graph: fx.Graph, names: dict):
        super().__init__()
        self.graph, self.names, self.nodes, self.depth, self.pending = graph, names, {}, 0, None

    def bind(self, tensor: torch.Tensor, node: fx.Node) -> None:
        node.meta.setdefault("val", tensor)
        self.nodes[id(tensor)] = (tensor, node)

    def node_of(self, value):
        """The node producing `value` (a tensor): its producer, a get_attr of the block's own
        parameter or buffer, or a constant; anything else is returned as it is."""
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) in self.nodes:
            return self.nodes[id(value)][1]
        name = self.names.get(id(value))
        node = self.graph.get_attr(name) if name is not None else self.graph.call_function(constant, (value,))
        self.bind(value, node)
        return node

    def bind_outputs(self, node: fx.Node, out) -> None:
        """Bind each tensor of `out` to `node` (one tensor) or to a leaf node reading it."""
        if isinstance(out, torch.Tensor):
            self.bind(out, node)
            return
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        structured = not isinstance(out, (tuple, list)) or len(tensors) != len(out)
        for i, t in enumerate(tensors):
            self.bind(t, self.graph.call_function(tensor_leaf if structured else operator.getitem, (node, i)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth == 0:
            node = self.graph.call_function(func, tree_map(self.node_of, args), tree_map(self.node_of, kwargs))
            self.bind_outputs(node, out)
        return out


def trace_call(block: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """The block's forward on (args, kwargs) as an fx graph (module docstring): a placeholder
    for each input tensor (the block's input first), a call_module node per submodule call,
    an aten node per op of the block's own forward, the output as the forward returned it.

    Raises:
        TypeError: the first argument is not a tensor. Anything the forward raises on these inputs.
    """
    graph = fx.Graph()
    names = {id(t): n for n, t in list(block.named_parameters()) + list(block.named_buffers())}
    recorder = _Recorder(graph, names)
    recorder.bind(_first_input(block, args, kwargs), graph.placeholder("x"))
    for i, t in enumerate(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)):
        if id(t) not in recorder.nodes:
            recorder.bind(t, graph.placeholder(f"input_{i}"))
    paths = {}
    for path, module in block.named_modules(remove_duplicate=False):
        paths.setdefault(module, path)
    handles = []

    def enter(module, a, k):
        if recorder.depth == 0:
            recorder.pending = (tree_map(recorder.node_of, a), tree_map(recorder.node_of, k))
        recorder.depth += 1

    def leave(module, a, k, out):
        recorder.depth -= 1
        if recorder.depth == 0:
            node_args, node_kwargs = recorder.pending
            node = graph.call_module(paths[module], node_args, node_kwargs)
            recorder.bind_outputs(node, out)

    modes = {m: m.training for m in block.modules()}
    try:
        for module, path in paths.items():
            if path:
                handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
                handles.append(module.register_forward_hook(leave, with_kwargs=True))
        block.eval()  # as the call was recorded (RecordedCalls)
        with recorder, torch.no_grad():
            out = block(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.train(training)
    graph.output(tree_map(recorder.node_of, out) if isinstance(out, (torch.Tensor, tuple, list, dict)) else out)
    return fx.GraphModule(block, graph)

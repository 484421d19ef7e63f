"""Activation bytes per unit, from one traced forward of a sample (docs/design.md §2).

`trace_activations(model, plan, sample_input)` runs the full model's forward once on fake
tensors (torch's FakeTensorMode: shapes propagate, nothing is allocated, and each operation picks
the kernel of the device it pretends to run on: on the meta device attention would fall back to
the math path, which saves its [B, H, T, T] probabilities that CPU and CUDA kernels do not),
then a cross-entropy loss on its output, under
`torch.autograd.graph.saved_tensors_hooks`, and attributes every tensor autograd saves for
backward, deduplicated by storage and never a parameter's or buffer's storage:
- to the neuron group whose width it has: the output of a group's producer (a module holding
  a sliced parameter of the group that is not one of its consumers) is tagged with the group,
  every operation's output whose input is tagged keeps the tag (activation, attention scores,
  normalisation of sliced channels), and a consumer's output loses it (it is full width
  again). A rank holding a fraction f of the group's units saves f of these bytes;
- else to the block unit whose module was running (a rank that skips the block saves none);
- else to the shared remainder (stem, embeddings, head, loss; every rank saves these).
For activation checkpointing it also records, per residual block (planning/discovery/blocks.py), the
bytes of the block's input (what a checkpoint keeps) and of what the block saves (what a
checkpoint recomputes in backward).

The sample is one rank's batch: activations scale with it.

Mixed precision (`compute_dtype`, e.g. torch.bfloat16): the forward and loss run under
`torch.autocast`, as a bf16 training step does, so each saved tensor has the dtype autocast
gives it, and the half-precision copies autocast makes of the weights (saved by the matrix
products for backward) are counted too: a copy of a neuron group's weight is tagged with the
group (a rank casts only its share), a copy made inside a block belongs to the block's unit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter
from torch.utils.weak import WeakIdKeyDictionary

from ..discovery.blocks import find_blocks
from ..discovery.flops import sample_meta_input
from ..discovery.model_copy import copy_model


@dataclass
class ActivationTrace:
    """Bytes autograd saves in one training forward of the sample (no batch scaling applied).

    Attributes:
        unit: float64 [len(plan.units)], bytes saved for each unit (a neuron group's bytes
            split evenly over its units).
        unit_weight_inputs: float64 [len(plan.units)], the part of `unit` saved only as the
            input of a Linear or convolution (needed for its weight's gradient alone: the
            backward regime does not keep it for units the rank does not own).
        shared: bytes saved outside every unit (every rank saves them).
        block_inputs / block_saved / block_outputs: {block path: bytes} of each residual block's
            input, of what it saves (all units held) and of its output (what a skipped block's
            ReLU saves); empty when the model has no residual block.
        largest: bytes of the largest saved storage (its gradient is a backward temporary).
        source: what was traced.
        compute_dtype: the autocast dtype of the traced forward (None: the parameters' dtypes).
    """

    unit: torch.Tensor
    unit_weight_inputs: torch.Tensor
    shared: float
    block_inputs: dict
    block_saved: dict
    block_outputs: dict
    largest: float
    source: str
    compute_dtype: torch.dtype | None = None

    @property
    def full(self) -> float:
        """Bytes the full model saves (every unit held)."""
        return self.shared + float(self.unit.sum())


class _WidthTags(TorchDispatchMode):
    """Carries a neuron group's tag from a producer's output to everything computed from it."""

    def __init__(self, tags: WeakIdKeyDictionary, weight_groups: WeakIdKeyDictionary,
                 layer_inputs: WeakIdKeyDictionary):
        super().__init__()
        self.tags, self.weight_groups, self.layer_inputs = tags, weight_groups, layer_inputs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            source = args[0].untyped_storage()
            if source in self.layer_inputs:  # autocast's copy of a layer's input: what its weight gradient reads
                self.layer_inputs[out.untyped_storage()] = self.layer_inputs[source]
            if source in self.weight_groups:
                # Autocast's copy of a neuron group's weight: a rank casts only the rows or columns it holds.
                self.tags[out.untyped_storage()] = self.weight_groups[source]
                return out
        tag = next((self.tags[s] for t in tree_iter((args, kwargs)) if isinstance(t, torch.Tensor)
                    and (s := t.untyped_storage()) in self.tags), None)
        if tag is not None:
            for t in tree_iter(out):
                if isinstance(t, torch.Tensor):
                    self.tags[t.untyped_storage()] = tag
        return out


def _weight_groups(model: nn.Module, plan) -> WeakIdKeyDictionary:
    """{storage of a neuron group's member parameter: the group's index}."""
    params, out = dict(model.named_parameters(remove_duplicate=False)), WeakIdKeyDictionary()
    for g_index, g in enumerate(plan.groups):
        if g.kind != "block":
            for member in g.members:
                if member.name in params:
                    out[params[member.name].untyped_storage()] = g_index
    return out


def _group_roles(model: nn.Module, plan) -> tuple[dict, dict]:
    """({module: group index} of producers, {module: group index} of consumers) of neuron groups."""
    producers, consumers = {}, {}
    for g_index, g in enumerate(plan.groups):
        if g.kind == "block":
            continue
        for path in g.consumers:
            consumers[model.get_submodule(path)] = g_index
        for member in g.members:
            module = model.get_submodule(member.name.rsplit(".", 1)[0])
            if module not in consumers:
                producers[module] = g_index
    return producers, consumers


def _first_tensor(out):
    return next((t for t in tree_iter(out) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


def _loss(out) -> torch.Tensor | None:
    """Cross-entropy of the logits (last dim: classes) against class 0: what a classifier or
    language model's loss saves (its log-softmax) is part of the step's activations."""
    logits = _first_tensor(out)
    if logits is None or logits.dim() < 2:
        return None
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device))


def _shortcuts(model: nn.Module, group) -> list:
    """The children of a block group's module that hold parameters, none of them the unit's."""
    owned, out = set(group.params), []
    for name, child in model.get_submodule(group.path).named_children():
        names = [f"{group.path}.{name}.{n}" for n, _ in child.named_parameters()]
        if names and not any(n in owned for n in names):
            out.append(child)
    return out


_WEIGHT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class _Recorder:
    """The hooks' shared state: which module runs, which storages were seen, where bytes go."""

    def __init__(self, model, plan, blocks):
        self.plan, self.stack, self.block_stack = plan, [], []
        self.tags, self.seen = WeakIdKeyDictionary(), WeakIdKeyDictionary()
        for t in list(model.parameters()) + list(model.buffers()):
            self.seen[t.untyped_storage()] = True  # model state, never an activation
        self.block_unit = {model.get_submodule(g.path): a for g, (a, _) in zip(plan.groups, plan.unit_ranges)
                           if g.kind == "block"}
        # A block's shortcut projection holds shared parameters and runs whether the block is
        # held or skipped: what it saves is shared (None stops the search for a block unit).
        self.block_unit.update({child: None for g in plan.groups if g.kind == "block"
                                for child in _shortcuts(model, g)})
        self.blocks = {model.get_submodule(b.path): b.path for b in blocks}
        self.unit = [0.0] * len(plan.units)  # lists: a tensor made here would be fake
        self.weight_inputs = [0.0] * len(plan.units)
        self.layer_inputs = WeakIdKeyDictionary()  # input storage -> the Linear/conv reading it
        self.shared, self.largest = 0.0, 0.0
        self.block_inputs = {b.path: 0.0 for b in blocks}
        self.block_saved, self.block_outputs = dict(self.block_inputs), dict(self.block_inputs)

    def pack(self, t):
        storage = t.untyped_storage()
        if storage in self.seen:
            return t
        self.seen[storage] = True
        size = float(storage.nbytes())
        self.largest = max(self.largest, size)
        if self.block_stack:
            self.block_saved[self.block_stack[0]] += size
        tag = self.tags.get(storage)
        if tag is not None:
            a, b = self.plan.unit_ranges[tag]
            units = range(a, b)
        elif (unit := self._block_unit()) is not None:
            units = range(unit, unit + 1)
        else:
            self.shared += size
            return t
        weight_input = bool(self.stack) and self.layer_inputs.get(storage) is self.stack[-1]
        for u in units:
            self.unit[u] += size / len(units)
            self.weight_inputs[u] += size / len(units) if weight_input else 0.0
        return t

    def _block_unit(self):
        """The unit of the innermost running block (None: none, or inside its shortcut)."""
        return next((self.block_unit[m] for m in reversed(self.stack) if m in self.block_unit), None)

    def enter(self, module, args):
        self.stack.append(module)
        if isinstance(module, _WEIGHT_LAYERS) and (x := _first_tensor(args)) is not None:
            self.layer_inputs[x.untyped_storage()] = module
        if module in self.blocks:
            if not self.block_stack and (x := _first_tensor(args)) is not None:
                self.block_inputs[self.blocks[module]] += float(x.untyped_storage().nbytes())
            self.block_stack.append(self.blocks[module])

    def leave(self, module, producers, consumers, out):
        self.stack.pop()
        if module in self.blocks:
            self.block_stack.pop()
            if (y := _first_tensor(out)) is not None:
                self.block_outputs[self.blocks[module]] = float(y.untyped_storage().nbytes())
        tensors = [t for t in tree_iter(out) if isinstance(t, torch.Tensor)]
        for t in tensors:
            if module in consumers:
                self.tags.pop(t.untyped_storage(), None)
            elif module in producers:
                self.tags[t.untyped_storage()] = producers[module]


def _residual_blocks(model: nn.Module) -> list:
    try:
        return find_blocks(model)
    except ValueError:
        return []  # no residual block: activation checkpointing has nothing to checkpoint


def _fake_copy(model: nn.Module, device: torch.device) -> nn.Module:
    """The model with fake parameters and buffers on `device` (call inside a FakeTensorMode)."""
    memo = {id(p): nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
            for p in model.parameters()}
    memo.update({id(b): torch.empty(b.shape, dtype=b.dtype, device=device) for b in model.buffers()})
    return copy_model(model, memo)


def _trace_device(model: nn.Module, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    where = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    return where  # a model built on the meta device is traced as if on the CPU


def trace_activations(model: nn.Module, plan, sample_input, device=None,
                      compute_dtype: torch.dtype | None = None) -> ActivationTrace:
    """Activation bytes of one training forward (and loss) of `sample_input` (a tensor, or
    (shape, dtype); one rank's batch), attributed to the plan's units; see the module docstring.
    device: the device whose kernels are traced (default: the model's; the CPU for a meta model).
    compute_dtype: trace under `torch.autocast` with this dtype (bf16 training); None: without.

    Raises:
        ValueError: the forward fails on fake tensors with this input.
    """
    shape = sample_meta_input(sample_input)
    device = _trace_device(model, device)
    with FakeTensorMode(allow_non_fake_inputs=False):
        meta = _fake_copy(model, device)
        x = torch.zeros(shape.shape, dtype=shape.dtype, device=device)
        recorder = _run_trace(meta, plan, x, device, compute_dtype)
    kernels = device.type + ("" if compute_dtype is None else f", autocast {str(compute_dtype)[6:]}")
    return ActivationTrace(torch.tensor(recorder.unit, dtype=torch.float64),
                           torch.tensor(recorder.weight_inputs, dtype=torch.float64), recorder.shared,
                           recorder.block_inputs, recorder.block_saved, recorder.block_outputs, recorder.largest,
                           f"saved tensors of one forward of {list(x.shape)} {str(x.dtype)[6:]} ({kernels} kernels)",
                           compute_dtype)


def _run_trace(meta: nn.Module, plan, x: torch.Tensor, device: torch.device, compute_dtype) -> _Recorder:
    producers, consumers = _group_roles(meta, plan)
    recorder = _Recorder(meta, plan, _residual_blocks(meta))
    handles = []
    for module in meta.modules():
        handles.append(module.register_forward_pre_hook(lambda m, a: recorder.enter(m, a)))
        handles.append(module.register_forward_hook(lambda m, a, o: recorder.leave(m, producers, consumers, o)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t), \
                _WidthTags(recorder.tags, _weight_groups(meta, plan), recorder.layer_inputs), torch.enable_grad(), \
                torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype is not None):
            _loss(meta(x))
    except (RuntimeError, NotImplementedError, TypeError, ValueError, IndexError) as e:
        raise ValueError(f"tracing activations with sample_input of shape {list(x.shape)} {x.dtype} on fake "
                         f"tensors failed ({type(e).__name__}: {e}); pass an input the model's forward takes") from e
    finally:
        for h in handles:
            h.remove()
    return recorder

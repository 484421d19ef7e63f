"""Module surgery: turn the full model into this rank's subnetwork, every change recorded.

Each change goes through the swap record (module_swaps.py, undone by `close()`): the engine's
modules are swapped in for the user's, which are set aside untouched but for the tensors this
rank does not hold (released to the meta device); only the root module, which no parent holds,
is changed in place, each change recorded.

Forward regime (`materialise_forward`): sliced layers are swapped for the engine's compact
stand-ins (sliced_layers.py: only the owned rows/columns, in global order; the user's layers set
aside with those tensors released), skipped blocks for their shortcut path (SkippedBlock; the
user's block set aside with its tensors released), so the memory of what is not owned is freed.

Backward regime (`prepare_backward`): the full tensors stay (the forward is the full
model) but stop being parameters; each owned piece becomes a Parameter that is a *view*
of its full tensor (owned_slices.py), so the optimizer updates the full tensor in place
and keeps state only for owned pieces. Sliced Linear and Conv2d layers are swapped for
the engine's OwnedLinear / OwnedConv2d, which compute only the owned weight gradient; other
layers (norms, convs with groups) are swapped for their twin, which routes the gradient
through a concatenation of detached and owned slices, assembled by a pre-hook before each
forward (for nn.MultiheadAttention's out_proj, which the attention reads without calling it,
before the attention's forward). At block level the Parameters of blocks this rank does not
own stop requiring gradients.
"""
from __future__ import annotations

import inspect
import types

import torch
import torch.nn as nn

from ...planning.pieces import Piece
from ...planning.discovery.residual import skip_path
from ...planning.discovery.units import is_basic_block, is_bottleneck
from ..guards.head_check import check_sliced_heads
from .module_swaps import ModuleSwaps
from ..layers.owned_conv import OwnedConv2d, conv_can_be_owned
from ..layers.owned_linear import OwnedLinear
from ..layers.owned_slices import OwnedLayer, own_slices
from ..layers.sliced_attention import SlicedMultiheadAttention
from .slicing import slice_group, split_name
from ..layers.width_keeping import keep_width


class SkippedBlock(nn.Module):
    """What a rank runs for a block it does not own: the block's skip path only.

    skip="identity": returns its input (transformer blocks, pre-LN, post-LN or parallel;
    residual MLP blocks; blocks with an identity shortcut and no ReLU after the sum).
    skip="shortcut" / "shortcut_relu": shortcut(x), or relu(shortcut(x)) for blocks that
    apply a ReLU after the residual sum; the shortcut is the skip path traced from the
    block (planning/discovery/residual.py), its modules kept (shared) under their own names, so a
    shape-changing block stays maskable and its checkpoint names do not move.

    x: the block's input [B, C, ...], positional or by the name of the block's forward's first
    parameter (`hidden_states=`); further arguments (masks, rotary tables) are ignored.
    Returns the skip output (same shape as the block's output).
    """

    def __init__(self, block: nn.Module, skip: str):
        super().__init__()
        self.skip = skip
        self._skip_forward = None
        try:  # the name a parent passing the input by keyword uses
            self._input_name = next(iter(inspect.signature(block.forward).parameters), None)
        except (TypeError, ValueError):
            self._input_name = None
        if skip != "identity":
            path = skip_path(block)
            if not path.traced and not (is_basic_block(block) or is_bottleneck(block)):
                raise ValueError(f"SkippedBlock: the plan says skip={skip!r} for a {type(block).__name__} that "
                                 "torch.fx cannot trace, and no traced call of this module was made in this process: "
                                 "plan this model with sample_input= (plan_subnetworks) before wrapping it")
            if path.traced and path.mode != skip:
                raise ValueError(f"SkippedBlock: the plan says skip={skip!r} for a {type(block).__name__}, "
                                 f"but the block computes {path.mode!r}: the plan was made for another model")
            for name in path.modules:
                setattr(self, name, getattr(block, name))
            self._skip_forward = path.forward
        if isinstance(block, nn.TransformerEncoderLayer):
            # nn.TransformerEncoder reads layers[0].self_attn.batch_first before running.
            self._batch_first = types.SimpleNamespace(batch_first=block.self_attn.batch_first)
        self._fast_path_source = ()  # see stand_in_for_skipped_first_layers

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            source = self.__dict__.get("_fast_path_source")
            if source:
                return getattr(source[0], name)
            if name == "self_attn" and "_batch_first" in self.__dict__:
                return self.__dict__["_batch_first"]
            raise

    def forward(self, *args, **kwargs):
        """The skip path's output for x (the block's input, the first positional argument or the
        keyword the block's forward names first; the rest ignored): x itself for skip="identity",
        else shortcut(x) or relu(shortcut(x)), shaped as the block's output."""
        if args:
            x = args[0]
        elif self._input_name in kwargs:
            x = kwargs[self._input_name]
        else:
            raise TypeError(f"SkippedBlock: no input: the block's forward takes it as its first argument "
                            f"{self._input_name!r}, which this call passes neither by position nor by name "
                            f"(keywords {sorted(kwargs)})")
        if self._skip_forward is not None:
            return self._skip_forward(self, x)
        return x

    def extra_repr(self) -> str:
        """The skip mode, for repr()."""
        return f"skip={self.skip!r}"


def stand_in_for_skipped_first_layers(model: nn.Module, swaps: ModuleSwaps) -> None:
    """nn.TransformerEncoder decides its nested-tensor fast path (eval with a padding mask)
    by reading layers[0]'s attention and norm weights. When a rank skips layer 0, the stub
    answers those reads with the first layer it does run, so the encoder decides exactly as
    the encoder made of this rank's layers would; the stub itself passes the (nested) input
    through. An encoder whose every layer is skipped takes the slow path (its twin, swapped in,
    has use_nested_tensor False)."""
    encoders = [(path, m) for path, m in model.named_modules() if isinstance(m, nn.TransformerEncoder)]
    for path, encoder in encoders:
        if not isinstance(encoder.layers[0], SkippedBlock):
            continue
        run = [layer for layer in encoder.layers if not isinstance(layer, SkippedBlock)]
        if run:
            encoder.layers[0].__dict__["_fast_path_source"] = (run[0],)
        else:
            swaps.put(swaps.stand_in(model, path), "use_nested_tensor", False)


def _skip_blocks(model: nn.Module, plan, rank: int, swaps: ModuleSwaps) -> None:
    """Swap a SkippedBlock in for each block this rank does not own and release the block's
    tensors, except those its skip path runs (a shortcut projection) and any tied to a tensor
    the model still runs."""
    skipped = []
    for g, (a, _) in zip(plan.groups, plan.unit_ranges):
        if not bool(plan.owners[rank, a]):
            block = model.get_submodule(g.path)
            stub = SkippedBlock(block, g.skip)
            swaps.swap(model, g.path, stub)
            skipped.append((block, stub))
    running = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    for block, stub in skipped:
        kept = {id(m) for m in stub.modules()}
        for m in block.modules():
            if id(m) not in kept:
                for leaf, t in list(m._parameters.items()) + list(m._buffers.items()):
                    if t is not None and id(t) not in running:
                        swaps.release(m, leaf)
    stand_in_for_skipped_first_layers(model, swaps)


class _InverseScale:
    """Pre-hook scaling a consumer's input by full width / kept width (inverted dropout)."""

    def __init__(self, factor: float):
        self.factor = factor

    def __call__(self, module, args):
        return (args[0] * self.factor,) + tuple(args[1:])


def materialise_forward(model: nn.Module, plan, pieces: list[Piece], rank: int, scale: str,
                        swaps: ModuleSwaps) -> tuple[list, dict]:
    """Forward regime, each change recorded in `swaps`. Returns (the hook handles it installed
    (scale="inverse"), the head groups that keep their width on this rank, {module path: why}).
    Sliced layers and the attentions of sliced head groups are swapped for the engine's
    (slicing.py), skipped blocks for SkippedBlocks (`_skip_blocks`). Head groups
    whose module cannot run sliced keep their width (width_keeping.py: their projections are swapped
    too); SubnetDataParallel.summary() lists them."""
    if plan.level == "block":
        _skip_blocks(model, plan, rank, swaps)
        return [], {}
    # Before any surgery: a refusal leaves the model as it was. Groups that cannot run sliced keep their width.
    width_kept = check_sliced_heads(model, plan, pieces, rank)
    for g, (a, b) in zip(plan.groups, plan.unit_ranges):
        if g.path in width_kept:
            keep_width(model, "", g, pieces, rank, swaps)
        else:
            slice_group(model, "", g, pieces, rank, int(plan.owners[rank, a:b].sum()), swaps)
    handles = []  # on the consumers the model now runs, every swap done
    if scale == "inverse":
        for g, (a, b) in zip(plan.groups, plan.unit_ranges):
            factor = g.size / int(plan.owners[rank, a:b].sum())
            for c in g.consumers:
                attn = model.get_submodule(_reading_parent(model, c) or c)
                if isinstance(attn, SlicedMultiheadAttention):  # it never calls out_proj: it scales its input
                    attn.out_input_scale = factor
                else:
                    handles.append(model.get_submodule(c).register_forward_pre_hook(_InverseScale(factor)))
    return handles, width_kept


class _AssembleOwned:
    """Pre-hook for non-linear layers: attr = full tensor with the owned slices swapped for
    their Parameters (same values), so autograd delivers gradient to the owned slices only."""

    def __init__(self, attrs):
        self.attrs = attrs  # attr -> (dim, [(start, length, view name)])

    def __call__(self, module, args):
        for attr, (dim, runs) in self.attrs.items():
            full = getattr(module, attr + "_full")
            parts, pos = [], 0
            for start, length, view in runs:
                if start > pos:
                    parts.append(full.narrow(dim, pos, start - pos))
                parts.append(getattr(module, view))
                pos = start + length
            if pos < full.shape[dim]:
                parts.append(full.narrow(dim, pos, full.shape[dim] - pos))
            module.__dict__[attr] = torch.cat(parts, dim)  # the attribute ModuleSwaps.put made at the surgery


class _AssembleChild:
    """Pre-hook of a parent that reads a child's tensors without calling it (nn.MultiheadAttention
    reads out_proj.weight): the child's owned slices are assembled before the parent runs."""

    def __init__(self, child: nn.Module, assemble: _AssembleOwned):
        self.child, self.assemble = child, assemble

    def __call__(self, module, args):
        self.assemble(self.child, args)


def _reading_parent(model: nn.Module, path: str) -> str | None:
    """The path of the module that reads the tensors of the module at `path` without calling it
    (an nn.MultiheadAttention's out_proj), or None: it is called, and its pre-hook runs."""
    parent, leaf = split_name(path)
    return parent if leaf == "out_proj" and isinstance(model.get_submodule(parent), nn.MultiheadAttention) else None


def _owned_layer(module: nn.Module, owned: dict, path: str, rank: int) -> OwnedLayer | None:
    """The engine's stand-in for `module` (OwnedLinear, OwnedConv2d) when one applies to its
    sliced tensors ({leaf: (dim, owned pieces)}), else None (the generic path)."""
    if isinstance(module, nn.Linear) and set(owned) <= {"weight", "bias"} and "weight" in owned:
        if not owned["weight"][1]:
            raise ValueError(f"rank {rank} owns no slice of {path!r} (backward regime needs at least one)")
        return OwnedLinear(module, owned)
    if conv_can_be_owned(module, owned) and owned["weight"][1]:
        return OwnedConv2d(module, owned)
    return None


def prepare_backward(model: nn.Module, plan, pieces: list[Piece], rank: int, swaps: ModuleSwaps):
    """Backward regime, each change recorded in `swaps`. Sliced Linear and Conv2d layers are
    replaced by OwnedLinear / OwnedConv2d holding their full tensors and owned views; other sliced
    layers by their twin (module_swaps.twin: the same class and tensors, registries of its own),
    on which the sliced tensors move to `{leaf}_full` buffers beside the owned views and a
    pre-hook assembles the tensor each forward (_AssembleOwned). The user's modules are left
    untouched (the root's own sliced tensors: changed in place, recorded).

    Returns:
        piece_params: {piece: Parameter} for the owned sliced pieces (views of the full tensors).
        value_refs: {state-dict name: (module, attribute)} where each full tensor now lives.
        handles: the forward-pre-hook handles it installed (for SubnetDataParallel.close).
    """
    piece_params, value_refs, handles = {}, {}, []
    read_by = []  # (parent path, layer, its assembly) of layers whose tensors their parent reads
    if plan.level == "block":
        for g, (a, _) in zip(plan.groups, plan.unit_ranges):
            if not bool(plan.owners[rank, a]):
                for n in g.params:
                    swaps.set_requires_grad(model.get_parameter(n), False)
        return piece_params, value_refs, handles
    by_module = {}
    for p in pieces:
        if p.sliced and p.is_param:
            by_module.setdefault(split_name(p.name)[0], []).append(p)
    for path, mine in by_module.items():
        module = model.get_submodule(path)
        owned = {}  # leaf -> (dim, this rank's pieces of it)
        for p in mine:
            dim, pieces_of_leaf = owned.setdefault(split_name(p.name)[1], (p.dim, []))
            if rank in p.owners:
                pieces_of_leaf.append(p)
        reader = _reading_parent(model, path)
        layer = _owned_layer(module, owned, path, rank) if reader is None else None
        generic = layer is None
        if generic:  # the user's module stays as it was; its twin holds the owned views (the root: recorded)
            layer = swaps.stand_in(model, path)
        for leaf, (dim, pieces_of_leaf) in owned.items():
            value_refs[f"{path}.{leaf}" if path else leaf] = (layer, leaf + "_full")
            if not generic:  # the user's module keeps its Parameter; the layer holds a detached alias
                layer.own(leaf, getattr(module, leaf), dim, pieces_of_leaf, piece_params)
                continue
            full = layer._parameters.pop(leaf)
            runs = own_slices(layer, leaf, full, pieces_of_leaf, piece_params)
            # A plain attribute under the tensor's name, so code reading e.g. norm.weight.shape keeps working.
            swaps.put(layer, leaf, layer.get_buffer(leaf + "_full"))
            owned[leaf] = (dim, runs)
        if not generic:
            swaps.swap(model, path, layer)
        if generic and reader is None:
            handles.append(layer.register_forward_pre_hook(_AssembleOwned(owned)))
        elif generic:
            read_by.append((reader, layer, _AssembleOwned(owned)))
    for reader, layer, assemble in read_by:  # after every swap: the parent the model now runs
        handles.append(model.get_submodule(reader).register_forward_pre_hook(_AssembleChild(layer, assemble)))
    return piece_params, value_refs, handles

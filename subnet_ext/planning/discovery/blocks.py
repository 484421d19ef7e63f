"""Block groups: residual blocks found in a model or declared by the user (docs/design.md §1.1).

A block is one unit holding every parameter of the block except those of a shortcut
projection (residual.py traces which those are): skipping it is the identity on its input,
or its projected input (with the ReLU a post-activation ResNet applies after the sum).

Recognised without help: ResNet basic/bottleneck-shaped blocks, transformer layers known
by their structure (*DecoderLayer, GPT2Block, timm ViT Block, nn.TransformerEncoderLayer,
ResidualMLPBlock), and any child of an nn.ModuleList or nn.Sequential that traces as a
residual block (a chain of residual adds carries its input to its output: nanoGPT-style
GPT blocks, pre- or post-LN, parallel attention + MLP, custom residual blocks). Where
torch.fx cannot trace a block's forward (a causal mask built from the input's length, a
branch on a size, a child's tuple output unpacked, a keyword-only call), the planner traces
the call the model makes of it on its `sample_input` (call_trace.py); without a sample input
such a block is named, with the call torch.fx failed on, in the error (or, beside blocks that
were found, in the plan's summary).
A declared module must be such a block; one with no residual add around it is refused
by name, with the enclosing block to declare instead.
"""
from __future__ import annotations

import torch.nn as nn

from .call_trace import RecordedCalls
from .residual import ResidualError, SkipPath, by_name, trace_skip_path, traced_call_skip_path
from .units import UnitGroup, _join, is_basic_block, is_bottleneck, is_decoder_layer, is_vit_block


def _known_identity_block(m: nn.Module) -> bool:
    """Transformer and residual-MLP layers whose skip path is their input (by structure)."""
    return is_decoder_layer(m) or isinstance(m, nn.TransformerEncoderLayer) or is_vit_block(m) \
        or type(m).__name__ in ("ResidualMLPBlock", "GPT2Block")


def is_recognised_block(m: nn.Module) -> bool:
    """Residual blocks the planner knows by their structure (without tracing)."""
    return is_basic_block(m) or is_bottleneck(m) or _known_identity_block(m)


SAMPLE_HINT = ("pass sample_input= (one input batch, a tensor or (shape, dtype) such as ((1, 64), torch.long)) and "
               "the planner traces the call the model makes of it instead")


class BlockTracer:
    """Skip paths of a model's blocks: torch.fx's trace, else a traced call on the sample input.

    refused: {path: why} of the candidates (children of a ModuleList or Sequential) that could
    not be traced either way, for the plan's summary."""

    def __init__(self, model: nn.Module, sample_input=None):
        self.calls = RecordedCalls(model, sample_input) if sample_input is not None else None
        self.refused: dict[str, str] = {}
        self._found: dict[str, SkipPath | ResidualError] = {}

    def skip_path(self, path: str, block: nn.Module) -> SkipPath:
        """The block's skip path; ResidualError (untraceable: neither trace ran) otherwise."""
        if path not in self._found:
            try:
                self._found[path] = self._skip_path(path, block)
            except ResidualError as e:
                self._found[path] = e
        found = self._found[path]
        if isinstance(found, ResidualError):
            raise ResidualError(str(found), found.untraceable, found.traced_call)
        return found

    def _skip_path(self, path: str, block: nn.Module) -> SkipPath:
        try:
            return trace_skip_path(block)
        except ResidualError as e:
            if not e.untraceable:
                raise
            fx_error = str(e)
        if self.calls is None:
            raise ResidualError(f"{fx_error}; {SAMPLE_HINT}", untraceable=True)
        try:
            meta_block, args, kwargs = self.calls.call_of(path)
        except ValueError as e:
            raise ResidualError(f"{fx_error}, and {e}", untraceable=True) from None
        try:
            return traced_call_skip_path(block, meta_block, args, kwargs)
        except ResidualError as e:
            raise ResidualError(f"{fx_error}; in the call on the sample input, {e}", e.untraceable, True) from None

    def traces_as_block(self, path: str, m: nn.Module) -> bool:
        """True when `m` traces as a residual block with parameters outside its skip path; a
        candidate neither trace could read is noted in `refused`."""
        if not any(True for _ in m.parameters()):
            return False
        try:
            found = self.skip_path(path, m)
        except ResidualError as e:
            if e.untraceable or e.traced_call:  # torch.fx could not read it: say why it is no block
                self.refused[path] = f"{type(m).__name__}: {e}"
            return False
        return any(n.split(".")[0] not in found.modules for n, _ in m.named_parameters())

    def found_block(self, path: str, m: nn.Module, in_container: bool) -> bool:
        """Whether find_blocks takes `m` as a block without a declaration. A ResNet-shaped module
        that traces without a residual add is not one (a stem, say); one neither trace can read
        is, with its shortcut found by name."""
        if _known_identity_block(m):
            return True
        if is_basic_block(m) or is_bottleneck(m):
            try:
                self.skip_path(path, m)
                return True
            except ResidualError as e:
                return e.untraceable
        return in_container and self.traces_as_block(path, m)

    def block_skip(self, model: nn.Module, path: str, block: nn.Module) -> tuple[str, tuple]:
        """(skip mode, top-level children the skip path runs) of a block; see residual.py.

        Known transformer and residual-MLP layers pass their input through unchanged. Any other
        block is traced; a ResNet-shaped block neither trace can read falls back to its
        shortcut's name with a ReLU after the sum (torchvision's convention)."""
        if _known_identity_block(block):
            return "identity", ()
        try:
            found = self.skip_path(path, block)
        except ResidualError as e:
            if not (e.untraceable and (is_basic_block(block) or is_bottleneck(block))):
                raise _refusal(model, path, block, e, self.calls is not None) from None
            found = by_name(block)
        return found.mode, found.modules


def _enclosing_block(model: nn.Module, path: str) -> str | None:
    """The nearest module above `path` that traces as a residual block (torch.fx), or None."""
    tracer = BlockTracer(model)
    while path:
        path = path.rpartition(".")[0]
        m = model.get_submodule(path)
        if is_recognised_block(m) or tracer.traces_as_block(path, m):
            return path
    return None


def _refusal(model: nn.Module, path: str, block: nn.Module, why: ResidualError, sampled: bool) -> ValueError:
    kind = f"block {path!r} ({type(block).__name__})"
    if why.untraceable:
        fix = "Make the block's own forward traceable by torch.fx (no data-dependent control flow in it; its " \
              "children may do anything), " if sampled else ""
        return ValueError(f"{kind}: {why}. The planner traces a block to know what skipping it computes and will "
                          f"not guess. {fix}Declare a traceable block around it, or plan at level='neuron'.")
    outer = _enclosing_block(model, path)
    fix = f"declare the enclosing residual block {outer!r} instead" if outer is not None else \
        "declare the enclosing residual block (the module whose forward adds this one's output to its input)"
    return ValueError(f"{kind} is not a residual block: {why}. A rank that does not own it would compute a "
                      f"different function; {fix}.")


def _block_group(model: nn.Module, path: str, tracer: BlockTracer) -> UnitGroup:
    block = model.get_submodule(path)
    skip, shortcut_children = tracer.block_skip(model, path, block)

    def in_unit(n: str) -> bool:  # the skip path's children are shared: every rank runs them
        return n.split(".")[0] not in shortcut_children

    params, buffers = [], []
    for n, _ in block.named_parameters():
        if in_unit(n):
            params.append(_join(path, n))
    for n, b in block.named_buffers():
        owner_path, _, leaf = n.rpartition(".")
        owner = block.get_submodule(owner_path) if owner_path else block
        if leaf in owner._non_persistent_buffers_set:
            continue
        if in_unit(n):
            buffers.append(_join(path, n))
    if not params:
        raise ValueError(f"block {path!r} has no parameters outside its skip path {shortcut_children}; "
                         "it cannot be a unit")
    return UnitGroup("block", path, 1, params=params, buffers=buffers, skip=skip)


def find_blocks(model: nn.Module, blocks=None, sample_input=None, refused: dict | None = None) -> list[UnitGroup]:
    """Block groups, in model order. `blocks`: module paths declared by the user. sample_input:
    the model's input (a tensor or (shape, dtype)), to trace the blocks torch.fx cannot.
    refused: filled with {path: why} of the candidate blocks neither trace could read."""
    tracer = BlockTracer(model, sample_input)
    if blocks is not None:
        names = dict(model.named_modules())
        for b in blocks:
            if b not in names or b == "":
                raise ValueError(f"declared block {b!r} is not a submodule path of the model "
                                 f"(see model.named_modules())")
        return [_block_group(model, b, tracer) for b in blocks]
    containers = {p for p, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))}
    found, taken = [], []
    for path, m in model.named_modules():
        if not path or any(path.startswith(t + ".") for t in taken):
            continue  # a block inside a block: the outer one is the unit
        if tracer.found_block(path, m, path.rpartition(".")[0] in containers):
            found.append(_block_group(model, path, tracer))
            taken.append(path)
    if refused is not None:
        refused.update({p: why for p, why in tracer.refused.items() if not any(p.startswith(t + ".") for t in taken)})
    return found

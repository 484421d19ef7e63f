"""Where a residual block's branches end: the modules whose parameters scale each branch.

Multiplying a residual branch's output by f (stochastic depth's test-time rule; SDP's
owner-fraction rule for the assembled model) can live in the weights, so the scaled state
loads into the original class: scale every direct parameter of the branch's last affine
operation (weight and bias of a Linear, convolution or norm; a layer-scale vector).

The branches are the traced residual adds' other operands (residual.py): the top-level
child producing each, through dropout and identity. Inside a child that is not itself
affine, its last affine operation is found by structure: the last child (in registration
order) holding parameters, where every child registered after it is a dropout or an
identity; then recursively inside it. Anything else (an activation after the last Linear,
a branch that is a product, an unknown parameterised module) is refused with its name,
since scaling its weights would not scale the branch.
"""
from __future__ import annotations

import torch.nn as nn

from .residual import ResidualError, trace_skip_path

_AFFINE_TYPES = (nn.Linear, nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm) + \
    ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
_AFFINE_NAMES = ("Conv1D",)  # transformers' GPT-2 Linear; and any *Norm / *Scale module (below)


def _is_affine(m: nn.Module) -> bool:
    name = type(m).__name__
    return isinstance(m, _AFFINE_TYPES) or name in _AFFINE_NAMES or name.endswith(("Norm", "Scale"))


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def last_affine(module: nn.Module, path: str) -> str:
    """The path of `module`'s last affine operation (module docstring), `path` being module's own.

    Raises:
        ValueError: naming the module where the rule does not hold.
    """
    if any(True for _ in module.parameters(recurse=False)):
        if _is_affine(module) and not any(_has_params(c) for c in module.children()):
            return path
        raise ValueError(f"residual scaling: {path} ({type(module).__name__}) holds parameters of its own that are "
                         "not those of a Linear, convolution, norm or scale; scaling them would not scale its output")
    children = list(module.named_children())
    holders = [i for i, (_, c) in enumerate(children) if _has_params(c)]
    if not holders:
        raise ValueError(f"residual scaling: {path} ({type(module).__name__}) has no parameters to scale")
    last = holders[-1]
    after = [f"{path}.{n}" for n, c in children[last + 1:] if not isinstance(c, (nn.Dropout, nn.Identity))]
    if after:
        raise ValueError(f"residual scaling: in {path}, {after} come after its last parameterised module "
                         f"{path}.{children[last][0]}; scaling that module's weights would not scale the output")
    name, child = children[last]
    return last_affine(child, f"{path}.{name}")


def branch_ends(model: nn.Module, block_path: str) -> list[str]:
    """Module paths of the last affine operation of each residual branch of block `block_path`
    (a pre-LN GPT block: its attention's and MLP's c_proj; a ResNet basic block: bn2).

    Raises:
        ValueError: the block does not trace as a residual block, or a branch has no such end.
    """
    block = model.get_submodule(block_path)
    try:
        branches = trace_skip_path(block).branches
    except ResidualError as e:
        raise ValueError(f"residual scaling: {block_path} is not a residual block the tracer understands ({e})") \
            from None
    if not branches or None in branches:
        raise ValueError(f"residual scaling: a residual branch of {block_path} is not the output of one child "
                         f"module (found {branches}); its scale cannot be placed in a weight")
    return [last_affine(block.get_submodule(b), f"{block_path}.{b}") for b in branches]

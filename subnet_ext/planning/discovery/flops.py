"""FLOPs per unit, measured by tracing one forward on the meta device (docs/design.md §1.2).

A convolution's cost depends on its input's spatial size and attention's on the
sequence length, not only on the parameter count, so the planner counts FLOPs by
running the model once under `torch.utils.flop_counter.FlopCounterMode` on meta
tensors: shapes propagate, nothing is computed or allocated. Attribution:
- block unit: the FLOPs inside the block's module, minus those of its children that
  hold no parameter of the unit (the shortcut projection, which every rank runs);
- neuron/channel group: the FLOPs of its member modules (producers, norms,
  consumers) / size; head group: the FLOPs of the whole attention module / size
  (the score and value products scale with the heads too);
- shared: the total minus the units.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import ExitStack

import numpy as np
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from .model_copy import copy_model


def sample_meta_input(sample_input) -> torch.Tensor:
    """A meta tensor of the sample's shape and dtype.

    sample_input: a torch.Tensor (any device; only its shape and dtype are read), or a
    pair (shape, dtype), e.g. ((1, 3, 32, 32), torch.float32) or ((1, 64), torch.long).
    """
    if isinstance(sample_input, torch.Tensor):
        return torch.empty(sample_input.shape, dtype=sample_input.dtype, device="meta")
    ok = (isinstance(sample_input, (tuple, list)) and len(sample_input) == 2
          and isinstance(sample_input[0], (tuple, list, torch.Size))
          and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sample_input[0])
          and isinstance(sample_input[1], torch.dtype))
    if not ok:
        raise ValueError(f"sample_input must be a tensor or (shape, dtype) such as ((1, 3, 32, 32), torch.float32); "
                         f"got {sample_input!r}")
    return torch.empty(tuple(sample_input[0]), dtype=sample_input[1], device="meta")


def meta_copy(model: nn.Module) -> nn.Module:
    """The model with every parameter and buffer replaced by a meta tensor (no data copied)."""
    if all(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers())):
        return model
    memo = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy_model(model, memo)


def _unit_modules(model: nn.Module, groups) -> tuple[list, list]:
    """Per group, the [(module path, +1 or -1)] whose FLOPs sum to the group's; and all paths to time."""
    plus_minus = []  # per group: [(path, sign)]
    for g in groups:
        if g.kind == "block":
            block = model.get_submodule(g.path)
            owned = set(g.params)
            terms = [(g.path, 1)]
            for name, child in block.named_children():
                names = [f"{g.path}.{name}.{n}" for n, _ in child.named_parameters()]
                if names and not any(n in owned for n in names):
                    terms.append((f"{g.path}.{name}", -1))  # a shared shortcut inside the block
        elif g.kind == "head":
            terms = [(g.path, 1)]
        else:
            terms = [(p, 1) for p in dict.fromkeys(m.name.rsplit(".", 1)[0] for m in g.members)]
        plus_minus.append(terms)
    paths = sorted({p for terms in plus_minus for p, _ in terms})
    return plus_minus, paths


def trace_unit_flops(model: nn.Module, groups, sample_input) -> tuple[np.ndarray, float, str]:
    """(FLOPs per unit float64 [units], shared FLOPs, description) of one forward of sample_input.

    Units are in plan order (a block: 1 unit, a group of size n: n equal units). The
    model is traced in eval mode (batch statistics do not change FLOPs, and batch 1
    would trip BatchNorm's training check); its training flags are restored.
    """
    x = sample_meta_input(sample_input)
    meta = meta_copy(model)
    terms, paths = _unit_modules(meta, groups)
    spent = defaultdict(float)
    starts = defaultdict(list)
    modes = {m: m.training for m in meta.modules()}
    with FlopCounterMode(display=False) as counter, ExitStack() as hooks, torch.no_grad():
        for path in paths:
            mod = meta.get_submodule(path)
            pre = mod.register_forward_pre_hook(lambda m, a, p=path: starts[p].append(counter.get_total_flops()))
            post = mod.register_forward_hook(
                lambda m, a, o, p=path: spent.__setitem__(p, spent[p] + counter.get_total_flops() - starts[p].pop()))
            hooks.callback(pre.remove)
            hooks.callback(post.remove)
        meta.eval()
        try:
            meta(x)
        except (RuntimeError, NotImplementedError, TypeError, ValueError, IndexError) as e:
            raise ValueError(f"tracing FLOPs with sample_input of shape {list(x.shape)} {x.dtype} on the meta device "
                             f"failed ({type(e).__name__}: {e}); pass an input the model's forward takes, or "
                             "sample_input=None to fall back to 2 x parameters") from e
        finally:
            for m, training in modes.items():
                m.train(training)
    total = float(counter.get_total_flops())
    per_unit = []
    for g, group_terms in zip(groups, terms):
        flops = sum(sign * spent[p] for p, sign in group_terms)
        per_unit += [flops / g.size] * g.size
    units = np.asarray(per_unit, dtype=np.float64)
    return units, total - float(units.sum()), f"traced one forward of {list(x.shape)} {str(x.dtype)[6:]}"

"""A sliced attention must compute its kept heads: checked once, at wrap time, before any surgery.

Slicing an attention's projections to the heads a rank owns is right only when its forward
reshapes by what its projections return (or by the head-count attributes slicing.py
updates). One that reshapes by a fixed width, as nanoGPT's `split(self.n_embd)` and
`view(B, T, self.n_head, C // self.n_head)` with C the input's width, fails, or, worse, runs
and mixes heads. So a private copy of each head group's module runs one small seeded input
twice: whole, with the output projection's inputs from the heads this rank does not own
zeroed (heads are independent, so that is what the kept heads compute), then sliced as the
engine slices it. When they disagree the module keeps its width instead (width_keeping.py),
checked the same way; one that computes its kept heads neither way is refused by name.

An attention whose forward needs more than its input (rotary tables, masks without
defaults), or that fails even whole on that input, cannot be run alone and is not checked.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from ...planning.discovery.model_copy import copy_model
from ...planning.pieces import Piece
from ..regimes.module_swaps import ModuleSwaps
from ..regimes.slicing import consumer_member, slice_group, split_name
from ..layers.width_keeping import keep_width, keepable

_SEQUENCE = 3  # tokens of the probe input: attention mixes positions, so more than one


def _runs_alone(module: nn.Module) -> bool:
    """True when the module's forward takes exactly one required positional argument."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in params if p.default is p.empty and p.kind in positional) == 1


def _private_copy(module: nn.Module) -> nn.Module:
    """A deep copy in eval mode with no hooks (a user's hook must not see the probe)."""
    twin = copy_model(module)
    for m in twin.modules():
        m._forward_pre_hooks.clear()
        m._forward_hooks.clear()
    return twin.eval()


def _first_tensor(out):
    while isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out if isinstance(out, torch.Tensor) else None


def _probe_input(attn: nn.Module, group, strip: int) -> torch.Tensor | None:
    """A seeded [1, _SEQUENCE, in_features] input for the group's first projection."""
    proj = attn.get_submodule(split_name(group.members[0].name[strip:])[0])
    weight = getattr(proj, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.device.type == "meta":
        return None
    width = weight.shape[0] if type(proj).__name__ == "Conv1D" else getattr(proj, "in_features", None)
    if not isinstance(width, int):
        return None
    x = torch.randn(1, _SEQUENCE, width, generator=torch.Generator().manual_seed(0))
    return x.to(weight.device, weight.dtype if weight.is_floating_point() else torch.float32)


def _mismatch(got, want) -> str | None:
    """Why `got` is not the kept heads' output `want`, or None when it is."""
    if got is None:
        return "its forward returns no tensor"
    if got.shape != want.shape:
        return f"its output has shape {list(got.shape)}, the kept heads' {list(want.shape)}"
    tol = 1e-3 if want.dtype in (torch.float32, torch.float64) else 3e-2
    err = float((got.float() - want.float()).abs().max())
    if err > tol * max(1.0, float(want.float().abs().max())):
        return f"its output differs from the kept heads' by up to {err:.3g} (it mixes or drops heads)"
    return None


def _probe(attn: nn.Module, g, pieces: list[Piece], rank: int, owned: torch.Tensor, width_kept: bool) -> str | None:
    """Why `attn` (a head group's module), sliced to this rank's units (or width-kept), does not
    compute the kept heads on a probe input; None when it does, or when it cannot be run alone."""
    strip = len(g.path) + 1
    twin = _private_copy(attn)
    x = _probe_input(twin, g, strip)
    if x is None:
        return None
    out = consumer_member(g)
    with torch.no_grad():
        weight = twin.get_parameter(out.name[strip:])
        for j in torch.nonzero(~owned).flatten().tolist():
            weight.narrow(out.dim, out.offset + j * out.width, out.width).zero_()
        try:
            want = _first_tensor(twin(x))
        except Exception:  # noqa: BLE001 - needs more than its input: cannot be checked alone
            return None
        if want is None:
            return None
        if width_kept:
            keep_width(twin, g.path, g, pieces, rank, ModuleSwaps())  # a twin: nothing to undo
        else:
            slice_group(twin, g.path, g, pieces, rank, int(owned.sum()), ModuleSwaps())  # likewise
        try:
            return _mismatch(_first_tensor(twin(x)), want)
        except Exception as e:  # noqa: BLE001 - reported with the module's name
            return f"its forward raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def check_sliced_heads(model: nn.Module, plan, pieces: list[Piece], rank: int) -> dict[str, str]:
    """{head group path: why its module cannot run sliced} for the groups that must keep their
    width (width_keeping.py), each checked to compute its kept heads that way; raises ValueError
    naming a module that computes them neither way. Leaves `model` unchanged."""
    keep = {}
    for g, (a, b) in zip(plan.groups, plan.unit_ranges):
        attn = model.get_submodule(g.path)
        owned = plan.owners[rank, a:b]
        if g.kind != "head" or not _runs_alone(attn) or bool(owned.all()):
            continue  # nothing is sliced away, or it cannot be run alone
        why = _probe(attn, g, pieces, rank, owned, width_kept=False)
        if why is None:
            continue
        kept_why = _probe(attn, g, pieces, rank, owned, width_kept=True) if keepable(attn, g.path, g) else \
            "its projections are not all nn.Linear (width keeping runs Linear projections only)"
        if kept_why is None:
            keep[g.path] = why
            continue
        raise ValueError(
            f"attention {g.path!r} ({type(attn).__name__}) does not compute the {int(owned.sum())} of its "
            f"{g.size} head unit(s) rank {rank} keeps once sliced: {why}; nor with its width kept (the owned heads' "
            f"rows scattered into the full width): {kept_why}. Its forward reshapes by a fixed width or reads its "
            "projections' weights itself. Use regime='backward' (the full forward runs), level='block', or make the "
            "forward call its projections and read the head count from their output (e.g. heads = q.shape[-1] // "
            "head_dim). The model was not changed.")
    return keep

"""`sdp.module.state_dict()` never passes for a model checkpoint when it is not one.

After the engine's surgery the wrapped model holds this rank's subnetwork: compact tensors
(forward regime, neuron level), no entries for the blocks it skips (forward regime, block
level), owned-slice views `*_owned0` instead of full weights (backward regime, neuron
level), DTensor shards (shard_shared). A DDP script's `raw_model.state_dict()` would save
that without complaint and fail to load into a fresh model later (or load a partial one).

`install_state_dict_guard` compares the wrapped model's state-dict entries with the
plan's (the original model's names and shapes) once, after the surgery. Where this rank
holds the whole model unchanged (coverage 1 at block level, the backward regime at block
level, any plan whose surgery kept every name and shape) `state_dict()` and
`load_state_dict()` work as on the plain model. Elsewhere both raise `PartialStateError`,
naming what differs and pointing to `full_state_dict()` / `load_full_state_dict()`.
Hooks sit on the wrapped model itself, so `sdp.state_dict()` (which recurses into it)
raises too; the engine removes them in close(). `copy.deepcopy(sdp.module)` (an EMA's copy)
raises PartialStateError the same way, pointing to ExponentialMovingAverage: the engine's
modules swapped into the model (module_swaps.py) refuse to be copied, so a copy of any module
holding one is refused, and nothing is set on the user's modules. A model whose only change
is its root's own tensors (no module swapped in) copies as it is.
"""
from __future__ import annotations

import torch.nn as nn

from ...state.tied_exports import with_aliases
from ..regimes.module_swaps import ModuleSwaps


class PartialStateError(RuntimeError):
    """The wrapped model's own state dict is this rank's subnetwork, not the model's state."""


def state_differences(model: nn.Module, tensor_shapes: dict, sharded: bool) -> list[str]:
    """Descriptions of how `model`'s state-dict entries differ from the original model's
    ({name: shape}, the plan's tensor_shapes); [] when they are the same names and shapes."""
    local = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    missing = [n for n in tensor_shapes if n not in local]
    extra = [n for n in local if n not in tensor_shapes]
    resized = [f"{n} {local[n]} instead of {tuple(tensor_shapes[n])}" for n in tensor_shapes
               if n in local and local[n] != tuple(tensor_shapes[n])]
    out = []
    if missing:
        out.append(f"{len(missing)} entries missing (skipped blocks or replaced weights; first: "
                   f"{', '.join(missing[:3])})")
    if extra:
        out.append(f"{len(extra)} entries the original model does not have (first: {', '.join(extra[:3])})")
    if resized:
        out.append(f"{len(resized)} compact tensors (first: {', '.join(resized[:2])})")
    if sharded:
        out.append("the shared parameters are FSDP2 DTensor shards (shard_shared=True)")
    return out


class _Refuse:
    """A state_dict / load_state_dict pre-hook raising PartialStateError (signature-agnostic)."""

    def __init__(self, message: str):
        self.message = message

    def __call__(self, *args, **kwargs):
        raise PartialStateError(self.message)


def install_state_dict_guard(model: nn.Module, plan, rank: int, sharded: bool, swaps: ModuleSwaps) -> list:
    """Hooks on `model` (after the surgery) refusing its state_dict() and load_state_dict()
    when its entries differ from the original model's (the plan's names and shapes, tied
    aliases included), and a refusal of copy.deepcopy on the engine's modules in it (`swaps`);
    returns their handles (none when this rank holds the whole model unchanged)."""
    differences = state_differences(model, with_aliases(plan, dict(plan.tensor_shapes)), sharded)
    if not differences:
        return []
    what = (f"the wrapped model holds rank {rank}'s subnetwork, not the model: " + "; ".join(differences) + ".")
    save = model.register_state_dict_pre_hook(_Refuse(
        f"state_dict(): {what} Saved, it would not load into a fresh model. Use sdp.full_state_dict() (a collective: "
        "call it on every rank, save rank 0's result), which loads strictly into the original model class; "
        "sdp.local_full_state_dict() gives this rank's own values (NaN where it holds nothing)."))
    load = model.register_load_state_dict_pre_hook(_Refuse(
        f"load_state_dict(): {what} Load a full state dict (a checkpoint of the original model) with "
        "sdp.load_full_state_dict(state_dict): every rank takes the pieces it holds."))
    copy = _RefuseCopies(swaps.replacements(), _Refuse(
        f"copy.deepcopy(): {what} A copy of it (an EMA's, torch.optim.swa_utils.AveragedModel(sdp.module)) would "
        "average or evaluate this subnetwork as if it were the model. For an EMA use "
        "subnet_ext.ExponentialMovingAverage(sdp, decay); for a copy of the model, sdp.full_model() (collective)."))
    return [save, load, copy]


class _RefuseCopies:
    """copy.deepcopy of any of the engine's `modules` (and so of a model holding one) calls `refuse`
    (copy.deepcopy looks `__deepcopy__` up on the instance: set on the engine's modules only);
    `remove()` takes it away again, as a hook handle does."""

    def __init__(self, modules: list, refuse):
        self.modules = modules
        for m in modules:
            m.__dict__["__deepcopy__"] = refuse

    def remove(self) -> None:
        """Let the engine's modules be copied again (the engine's close(), a change of assignment)."""
        for m in self.modules:
            m.__dict__.pop("__deepcopy__", None)

"""Evaluation of the union of the ranks' subnetworks ("full"), of their ensemble, and of
each rank's own subnetwork.

"full" runs the original, unmasked model (the engine's meta skeleton) on the assembled
full state (`full_output`, which takes that state and nothing else); "ensemble" runs each
rank's own subnetwork and averages its floating outputs with one all-reduce; "subnetwork"
is this rank's own output. Outputs may be any structure torch's pytree knows (tensors in
tuples, lists, dicts, named tuples, transformers' ModelOutput) or a dataclass; floating
tensors are reported as float32, anything else (integer tensors, None, Python values,
caches) as this rank's own. With a loss function the losses come too, and each rank's
subnetwork loss is gathered so every rank sees all K. Tied weights stay tied: only
canonical names are loaded, and the skeleton resolves each alias to its canonical tensor.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from ..comm import collectives
from ..planning.discovery.model_copy import copy_model
from ..state.tied_exports import retie, without_aliases

MODES = ("full", "ensemble", "subnetwork")


def full_model(skeleton: nn.Module, plan, full_state: dict) -> nn.Module:
    """A new model built from the meta `skeleton` holding `full_state` (ties re-made)."""
    model = copy_model(skeleton)
    canonical = without_aliases(plan, full_state)
    missing, unexpected = model.load_state_dict(canonical, assign=True, strict=False)
    if sorted(missing) != sorted(plan.aliases) or unexpected:  # assign=True would untie an alias
        raise RuntimeError(f"subnet_ext: full_model() could not load missing {missing} / unexpected {unexpected}")
    retie(plan, model)
    return model


def full_output(skeleton: nn.Module, plan, full_state: dict, inputs: tuple):
    """The unmasked model's output on `inputs` (eval mode) holding `full_state` (the whole
    model's state dict, original names and shapes; aliases may be present or not)."""
    canonical = without_aliases(plan, full_state)  # functional_call ties an alias to its canonical value
    was_training = skeleton.training
    try:
        return torch.func.functional_call(skeleton.eval(), canonical, inputs)
    finally:
        skeleton.train(was_training)


def _is_plain_dataclass(x) -> bool:
    """A dataclass instance pytree does not know (a registered one, such as transformers'
    ModelOutput, is flattened by pytree itself)."""
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and pytree.tree_is_leaf(x)


def map_floating(fn, output):
    """`output` with every floating tensor t replaced by fn(t), the structure and the other
    leaves kept; a dataclass pytree does not know is rebuilt field by field."""

    def leaf(x):
        if torch.is_tensor(x):
            return fn(x) if x.is_floating_point() else x
        if _is_plain_dataclass(x):
            rebuilt = copy.copy(x)
            for f in dataclasses.fields(x):
                object.__setattr__(rebuilt, f.name, map_floating(fn, getattr(x, f.name)))  # frozen ones too
            return rebuilt
        return x

    return pytree.tree_map(leaf, output, is_leaf=_is_plain_dataclass)


def floating_tensors(output) -> list[torch.Tensor]:
    """The floating tensors of `output`, in the order map_floating visits them."""
    found = []
    map_floating(lambda t: found.append(t) or t, output)
    return found


def _as_float(output):
    return map_floating(lambda t: t.float(), output)


def _mean_over_ranks(output, group, world_size: int, timeout):
    """`output` with each floating tensor the mean over the ranks (one all-reduce per dtype).
    Every rank's output must have the same structure and shapes, as every subnetwork's has."""
    summed = iter(collectives.all_reduce_by_dtype(floating_tensors(output), group, timeout=timeout,
                                                  operation="all_reduce (ensemble outputs)"))
    return map_floating(lambda _: next(summed) / world_size, output)


def check_request(modes, loss_fn, targets) -> tuple[tuple, tuple]:
    """(modes, targets) as tuples; ValueError naming a bad mode, loss function or targets."""
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"evaluate: modes must be one or more of {MODES}, got {list(modes)}")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"evaluate: loss_fn must be callable as loss_fn(output, *targets), got {loss_fn!r}")
    targets = (targets,) if torch.is_tensor(targets) else tuple(targets)
    if targets and loss_fn is None:
        raise ValueError("evaluate: targets are passed to loss_fn(output, *targets); give a loss_fn too (a model "
                         "that computes its own loss takes its targets among the inputs)")
    return modes, targets


def _loss(loss_fn, output, targets: tuple, which: str) -> torch.Tensor:
    value = loss_fn(output, *targets)
    value = value if torch.is_tensor(value) else torch.as_tensor(value)
    if value.numel() != 1:
        raise ValueError(f"evaluate: loss_fn must return a scalar (a 0-d tensor or a number); on the {which} output "
                         f"it returned shape {tuple(value.shape)}")
    return value.detach().reshape(()).float()


def evaluate(module: nn.Module, skeleton: nn.Module, plan, inputs: tuple, modes, full_state_fn, ranks: tuple,
             loss_fn=None, targets=()) -> dict:
    """{mode: output} for the requested modes, plus "loss" when `loss_fn` is given; the
    structure is documented in SubnetDataParallel.evaluate.

    Args:
        module: this rank's subnetwork; skeleton: the unmasked model on the meta device.
        full_state_fn: () -> the full state dict (collective on every rank).
        ranks: (communicate, process group, world size K, rank, timeout); communicate False
            (one rank, or a simulated rank) keeps this rank's own output as the ensemble.
        loss_fn, targets: loss_fn(output, *targets) -> scalar, called on the float32 outputs.
    Collective when communicate: the ensemble's all-reduce, the subnetwork losses'
    all-gather and the full state's assembly, in that order.
    """
    modes, targets = check_request(modes, loss_fn, targets)
    communicate, group, world_size, rank, timeout = ranks
    was_training = module.training
    module.eval()
    out, losses = {}, {}
    try:
        if "ensemble" in modes or "subnetwork" in modes:
            own = _as_float(module(*inputs))
            if "subnetwork" in modes:
                out["subnetwork"] = own
            if "ensemble" in modes:
                out["ensemble"] = _mean_over_ranks(own, group, world_size, timeout) if communicate else own
            if loss_fn is not None:
                losses["subnetworks"] = _gathered_loss(_loss(loss_fn, own, targets, "subnetwork"), communicate,
                                                       group, world_size, rank, timeout)
                if "ensemble" in modes:
                    losses["ensemble"] = _loss(loss_fn, out["ensemble"], targets, "ensemble")
        if "full" in modes:
            out["full"] = _as_float(full_output(skeleton, plan, full_state_fn(), inputs))
            if loss_fn is not None:
                losses["full"] = _loss(loss_fn, out["full"], targets, "full")
    finally:
        module.train(was_training)
    if loss_fn is not None:
        out["loss"] = losses
    return out


def _gathered_loss(own: torch.Tensor, communicate: bool, group, world_size: int, rank: int, timeout) -> torch.Tensor:
    """[K]: entry r is rank r's subnetwork loss (one all-gather); without communication only
    this rank's entry is known and the others are NaN."""
    if communicate:
        return collectives.all_gather(own.reshape(1), group, timeout=timeout).reshape(world_size)
    out = torch.full((world_size,), float("nan"), dtype=own.dtype, device=own.device)
    out[rank] = own
    return out

"""Parameters and optimizer state in the full model's coordinates: saved by one plan,
loaded by any other (world size, coverage, level, regime).

Here the *sharded* form (`sharded_state_dict`): each piece saved once, by its leader,
under "model/<piece key>" and "optim/<state key>/<piece key>" as [rows, cols] tensors of
its full rectangle — what torch.distributed.checkpoint writes, each rank its own pieces.
`load_sharded_state_dict` takes the plan that saved them and reads, for each piece this
rank now holds, the saved pieces overlapping it (layout.py). The *full* form, torch's
full optimizer state dict, is in full_optim_state.py.

Optimizer state: a tensor entry shaped like its parameter (exp_avg, exp_avg_sq,
momentum_buffer, ...) is sliced like the parameter; a 0-d entry (Adam's step) is kept
per piece and restored as the largest over the overlapping saved pieces (all equal when
every parameter steps together). A parameter without state (never stepped) is saved
as zeros with step 0, which is exactly Adam's lazily initialised state.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..planning.pieces import full_rectangle, global_pieces, rectangle
from .layout import RankLayout, area, as_2d, copy_overlaps, local_tensor, overlapping, piece_key

MODEL, OPTIM = "model/", "optim/"
SHARED = "shared/"  # key of a sharded shared parameter (one DTensor, each rank its shard)


# ----------------------------------------------------------------------------- helpers
def state_entry_shapes(optimizer, params) -> dict:
    """{state key: "tensor" | "scalar"} over the state of `params` (this rank only)."""
    entry_shapes = {}
    for p in params:
        for key, value in optimizer.state.get(p, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError(f"optimizer state {key!r} has shape {tuple(value.shape)} but its parameter "
                                     f"{tuple(p.shape)}; only per-element and scalar state can be re-planned")
                entry_shapes[key] = "tensor"
            elif torch.is_tensor(value) or isinstance(value, (int, float)):
                entry_shapes[key] = "scalar"
            else:
                raise ValueError(f"optimizer state {key!r} is a {type(value).__name__}; only tensors and numbers "
                                 "can be saved in full-model coordinates")
    return entry_shapes


def _all_entry_shapes(optimizer, params, group) -> dict:
    entry_shapes = state_entry_shapes(optimizer, params)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, entry_shapes, group=group)
        for k in everyone:
            entry_shapes.update(k)
    return dict(sorted(entry_shapes.items()))


def scalar_value(value) -> torch.Tensor:
    """A 0-d CPU tensor copy of scalar optimizer state (a 0-d tensor or a number)."""
    return value.detach().cpu().clone() if torch.is_tensor(value) else torch.tensor(float(value))


def hyperparameters(optimizer) -> list[dict]:
    """The param groups' settings without the parameters, as plain JSON-able values."""
    out = []
    for g in optimizer.param_groups:
        d = {}
        for k, v in g.items():
            if k == "params":
                continue
            if torch.is_tensor(v):
                v = v.item()
            d[k] = list(v) if isinstance(v, tuple) else v
        out.append(d)
    return out


def load_hyperparameters(optimizer, groups) -> None:
    """Restores the settings of `hyperparameters()` when the number of groups matches."""
    if not groups or len(groups) != len(optimizer.param_groups):
        return
    for g, saved in zip(optimizer.param_groups, groups):
        for k, v in saved.items():
            if k not in g:
                continue
            if torch.is_tensor(g[k]):
                g[k].fill_(v)  # a tensor lr stays a tensor (capturable/compiled optimizers)
            else:
                g[k] = tuple(v) if isinstance(g[k], tuple) else v


def _new_state(optimizer, param, entry_shapes: dict, step_dtype=torch.float32) -> dict:
    group = next(g for g in optimizer.param_groups if any(q is param for q in g["params"]))
    on_device = group.get("capturable", False) or group.get("fused", False)
    state = {}
    for key, entry_shape in entry_shapes.items():
        if entry_shape == "tensor":
            state[key] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        else:
            state[key] = torch.zeros((), dtype=step_dtype, device=param.device if on_device else "cpu")
    return state


def ensure_state(optimizer, held, entry_shapes) -> None:
    """Every held piece's parameter gets state with every key (contiguous tensors, to be filled)."""
    for s in held:
        state = optimizer.state.get(s.param)
        if not state:
            optimizer.state[s.param] = _new_state(optimizer, s.param, entry_shapes)
            continue
        for key, entry_shape in entry_shapes.items():
            if key not in state:
                state.update({key: _new_state(optimizer, s.param, {key: entry_shape})[key]})
            elif entry_shape == "tensor" and not state[key].is_contiguous():
                state[key] = state[key].contiguous()


# ----------------------------------------------------------------------------- sharded form
def sharded_state_dict(layout: RankLayout, optimizer=None, process_group=None) -> tuple[dict, dict]:
    """(tensors, info): the pieces this rank leads, keyed for torch.distributed.checkpoint.

    tensors: {"model/<piece key>": [rows, cols] values, "model/<name>": integer entries
    (e.g. num_batches_tracked, whole), "optim/<state key>/<piece key>": state}.
    info: {"optimizer_state": {state key: "tensor" | "scalar"}} (the same on every rank). `layout`: this
    rank's RankLayout. Collective over `process_group` when an optimizer is given (the
    state keys are agreed on)."""
    out = {}
    for s in layout.held_values():
        if layout.is_sharded(s.piece):
            out[MODEL + SHARED + s.piece.name] = layout.value_of(s.piece.name).detach()
        elif s.piece.leader == layout.rank:
            out[MODEL + piece_key(s.piece)] = s.read()
    for name, leader in layout.integer_entries.items():
        if leader == layout.rank:
            out[MODEL + name] = layout.value_of(name).detach().clone()
    entry_shapes = {}
    if optimizer is not None:
        held = layout.held_optimizer_pieces(optimizer)
        entry_shapes = _all_entry_shapes(optimizer, [s.param for s in held], process_group)
        for s in held:
            if layout.is_sharded(s.piece):
                out.update(_sharded_optimizer_entries(s, optimizer, entry_shapes, layout.rank))
                continue
            if s.piece.leader != layout.rank:
                continue
            state = optimizer.state.get(s.param, {})
            for key, entry_shape in entry_shapes.items():
                name = f"{OPTIM}{key}/{piece_key(s.piece)}"
                if entry_shape == "scalar":
                    out[name] = scalar_value(state[key]) if key in state else torch.tensor(0.0)
                elif key in state:
                    r0, r1, c0, c1 = s.local
                    out[name] = as_2d(state[key].contiguous())[r0:r1, c0:c1].detach().clone()
                else:
                    out[name] = torch.zeros(s.full[1] - s.full[0], s.full[3] - s.full[2], dtype=s.param.dtype,
                                            device=s.param.device)
    return out, {"optimizer_state": entry_shapes, "sharded": sorted(layout.sharded)}


def _sharded_optimizer_entries(held_piece, optimizer, entry_shapes: dict, rank: int) -> dict:
    """{"optim/<key>/shared/<name>": DTensor state (every rank its shard), or the 0-d
    scalar (rank 0 only)} for one sharded shared parameter."""
    state, out = optimizer.state.get(held_piece.param, {}), {}
    for key, entry_shape in entry_shapes.items():
        name = f"{OPTIM}{key}/{SHARED}{held_piece.piece.name}"
        if entry_shape == "scalar":
            if rank == 0:
                out[name] = scalar_value(state[key]) if key in state else torch.tensor(0.0)
        else:
            out[name] = state[key].detach() if key in state else torch.zeros_like(held_piece.param).detach()
    return out


def _saved_sources(saved_plan, info: dict) -> dict:
    """{name: [(full rectangle, key suffix, is_param)]} of what a checkpoint of `saved_plan`
    holds: its pieces, or one whole tensor under "shared/<name>" for a sharded parameter."""
    sharded = set(info.get("sharded", ()))
    saved = {n: [(rectangle(saved_plan.tensor_shapes[n], 0, 0, saved_plan.tensor_shapes[n][0]), SHARED + n, True)]
             for n in sharded}
    for p in global_pieces(saved_plan):
        if p.name not in sharded:
            saved.setdefault(p.name, []).append((full_rectangle(saved_plan, p), piece_key(p), p.is_param))
    return saved


def load_sharded_state_dict(layout: RankLayout, optimizer, saved_plan, info: dict, available: dict, read) -> None:
    """Load the pieces a `sharded_state_dict()` of `saved_plan` saved into this rank's tensors
    and (when `optimizer` is given and state was saved) its optimizer state.

    Args:
        layout: this rank's RankLayout.
        saved_plan: the SubnetPlan that saved them (same model; any world size/coverage/level).
        info: the `info` returned at save time.
        available: {key: (shape, dtype)} of what the checkpoint holds (its metadata).
        read: read(request) fills the dict {key: preallocated tensor} in place; collective
            (torch.distributed.checkpoint.load), so every rank calls this function.
    Raises:
        ValueError: another model, or a checkpoint that lacks a piece this plan needs.
    """
    if saved_plan.fingerprint != layout.plan.fingerprint or saved_plan.tensor_shapes != layout.plan.tensor_shapes:
        raise ValueError(f"the checkpoint was saved for another model (structure fingerprint "
                         f"{saved_plan.fingerprint}, this model {layout.plan.fingerprint})")
    saved = _saved_sources(saved_plan, info)
    request = {}

    def want(key):
        if key not in available:
            raise ValueError(f"the checkpoint lacks {key!r}, which its own plan says it saved: it is incomplete "
                             "or was written by another version")
        shape, dtype = available[key]
        request[key] = torch.empty(shape, dtype=dtype)

    targets = []  # (held piece, key prefix, tensor to fill)
    for s in layout.held_values():
        for _, key, _ in overlapping(s.full, saved[s.piece.name]):
            want(MODEL + key)
        targets.append((s, MODEL, s.tensor))
    integer = [n for n in layout.integer_entries if layout.holds_whole(n)]
    for n in integer:
        want(MODEL + n)
    entry_shapes = info.get("optimizer_state", {}) if optimizer is not None else {}
    optimizer_pieces = layout.held_optimizer_pieces(optimizer) if entry_shapes else []
    if entry_shapes:
        ensure_state(optimizer, optimizer_pieces, entry_shapes)
        for s in optimizer_pieces:
            for _, key, _ in overlapping(s.full, saved[s.piece.name]):
                for k in entry_shapes:
                    want(f"{OPTIM}{k}/{key}")
    read(request)
    with torch.no_grad():
        for s, prefix, dst in targets:
            sources = [(rect, as_2d(request[prefix + key]).to(dst.device))
                       for rect, key, _ in overlapping(s.full, saved[s.piece.name])]
            _check_covered(s, copy_overlaps(dst, s.local, s.full, sources))
        for n in integer:
            layout.value_of(n).copy_(request[MODEL + n])
        for s in optimizer_pieces:
            parts = overlapping(s.full, saved[s.piece.name])
            state = optimizer.state[s.param]
            for k, entry_shape in entry_shapes.items():
                if entry_shape == "scalar":
                    state[k].fill_(max(float(request[f"{OPTIM}{k}/{key}"]) for _, key, _ in parts))
                    continue
                sources = [(rect, as_2d(request[f"{OPTIM}{k}/{key}"]).to(s.param.device)) for rect, key, _ in parts]
                _check_covered(s, copy_overlaps(local_tensor(state[k]), s.local, s.full, sources))


def _check_covered(held_piece, written: int) -> None:
    if written != area(held_piece.full):
        raise ValueError(f"the checkpoint covers {written} of the {area(held_piece.full)} elements of "
                         f"{held_piece.piece.name!r} this rank needs (rectangle {held_piece.full}): its pieces do "
                         "not tile the tensor; it is corrupt or from another model")

"""A change of assignment (planning/assignment/schedule.py): what changes hands moves, the rest stays.

At a change the engine rebuilds this rank's subnetwork for the new owners; this module carries
the values across:

1. `snapshot`: references (no copies) to every value and optimizer-state rectangle this rank held,
   in full coordinates (state/layout.py), taken before the rebuild;
2. `unit_transfers` / `exchange`: each unit a rank gains arrives from the lowest-ranked of its
   former owners, point to point, one packed message per (sender, receiver) and dtype: its
   parameters and buffers (forward regime: the backward regime holds every value everywhere) and
   each optimizer's state tensors shaped like its parameters (AdamW's two moments);
3. `fill_values` / `rebind_optimizers`: the new tensors are written from what this rank held and
   what it received; every optimizer that stepped the engine's parameters gets the new ones in
   place of the old (in the parameter group of the old parameter of the same name, or of the same
   role: the name with its block indices replaced), with their state, and forgets the ones lost.

What is sent is the plan's own arithmetic (`predicted_bytes`), so the cost model and the
communicator's count of what was handed to the sends agree.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..planning.pieces import rectangle
from ..state.layout import RankLayout, as_2d
from ..vocabulary import Quantity, dtype_size

ROLE = re.compile(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)")


def role(name: str) -> str:
    """A parameter's name with its numeric path components (block indices) replaced by '#':
    'transformer.h.3.attn.c_attn.weight' -> 'transformer.h.#.attn.c_attn.weight'."""
    return ROLE.sub("#", name)


@dataclass
class Held:
    """What this rank held before a change, by reference: values[name] = [(full rect, 2-D tensor)];
    states[i][key][name] likewise for optimizer i's state tensors shaped like their parameter;
    scalars[i][key]: a per-parameter scalar state (AdamW's step) to give new parameters;
    groups[i][name]: the parameter group index of the parameter that held `name`, and
    roles[i][role]: likewise by role."""

    values: dict = field(default_factory=dict)
    states: list = field(default_factory=list)
    scalars: list = field(default_factory=list)
    groups: list = field(default_factory=list)
    roles: list = field(default_factory=list)
    param_ids: list = field(default_factory=list)


def _slice(tensor: torch.Tensor, local) -> torch.Tensor:
    r0, r1, c0, c1 = local
    return as_2d(tensor)[r0:r1, c0:c1]


def snapshot(layout: RankLayout, optimizers: list) -> Held:
    """References to this rank's values and optimizer state in full coordinates (nothing copied)."""
    held = Held()
    for h in layout.held_values():
        held.values.setdefault(h.piece.name, []).append((h.full, _slice(h.tensor, h.local)))
    for opt in optimizers:
        states, scalars, groups, roles = {}, {}, {}, {}
        group_of = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
        for h in layout.held_optimizer_pieces(opt):
            gi = group_of[id(h.param)]
            groups.setdefault(h.piece.name, gi)
            roles.setdefault(role(h.piece.name), gi)
            for key, value in opt.state.get(h.param, {}).items():
                if not isinstance(value, torch.Tensor):
                    continue
                if value.shape == h.param.shape:
                    if value.dtype != h.param.dtype:
                        raise ValueError(f"an ownership change moves optimizer state as its parameter's dtype, but "
                                         f"{type(opt).__name__}'s state {key!r} of {h.piece.name!r} is {value.dtype} "
                                         f"(the parameter {h.param.dtype})")
                    states.setdefault(key, {}).setdefault(h.piece.name, []).append((h.full, _slice(value, h.local)))
                elif value.dim() == 0:
                    scalars.setdefault(key, value)
        held.states.append(states)
        held.scalars.append(scalars)
        held.groups.append(groups)
        held.roles.append(roles)
        held.param_ids.append({id(p) for g in opt.param_groups for p in g["params"]})
    return held


@dataclass(frozen=True)
class Transfer:
    """One rectangle of one state-dict entry that moves from `src` to `dst`; `is_param`: a trained
    parameter, whose optimizer state moves with it."""

    name: str
    rect: tuple
    src: int
    dst: int
    is_param: bool


def unit_transfers(old_plan, new_plan, values: bool, trained=None) -> list[Transfer]:
    """Every rectangle that changes hands between two assignments of one plan, in one global order
    (unit, receiver, tensor): a unit's floating parameters and buffers (`values`: the forward regime)
    or its trained parameters only (whose optimizer state moves). trained: the names of the parameters
    the user trains (requires_grad in the model as wrapped, the same on every rank; default: all)."""
    trained = old_plan.param_names if trained is None else trained
    from ..planning.assignment.schedule import moved_units

    owner_of = {}
    for g, (a, b) in zip(old_plan.groups, old_plan.unit_ranges):
        for u in range(a, b):
            owner_of[u] = g
    out = []
    for u, src, dst in moved_units(old_plan.owners, new_plan.owners):
        g = owner_of[u]
        first = old_plan.unit_ranges[old_plan.groups.index(g)][0]
        if g.kind == "block":
            for n in g.params + g.buffers:
                is_param = n in trained
                if old_plan.is_float(n) and (values or is_param):
                    shape = old_plan.tensor_shapes[n]
                    out.append(Transfer(n, rectangle(shape, 0, 0, shape[0] if len(shape) else 1), src, dst, is_param))
            continue
        j = u - first
        for m in g.members:
            is_param = not m.buffer and m.name in trained
            if values or is_param:
                shape = old_plan.tensor_shapes[m.name]
                out.append(Transfer(m.name, rectangle(shape, m.dim, m.offset + j * m.width, m.width), src, dst,
                                    is_param))
    return out


def _area(rect) -> int:
    return (rect[1] - rect[0]) * (rect[3] - rect[2])


def predicted_bytes(plan, transfers: list[Transfer], state_tensors: int, values: bool) -> int:
    """Bytes the senders hand to their sends for `transfers`: each rectangle in its entry's dtype, once
    for its value (`values`: the forward regime) and, for a parameter, once per optimizer state tensor
    shaped like it (`state_tensors`, e.g. 2 for AdamW)."""
    total = 0
    for t in transfers:
        size = dtype_size(plan.tensor_dtypes[t.name])
        total += _area(t.rect) * size * ((1 if values else 0) + (state_tensors if t.is_param else 0))
    return total


def entry_axis(plan, name: str, rects) -> int:
    """The axis of entry `name`'s 2-D view [rows, cols] along which its rectangles slice it: 1 when one of
    them spans every row and only some columns (a dim-1 neuron slice), else 0 (rows, or whole)."""
    shape = plan.tensor_shapes[name]
    rows = shape[0] if len(shape) else 1
    cols = math.prod(shape[1:]) if len(shape) > 1 else 1
    return 1 if any(r[0] == 0 and r[1] == rows and r[3] - r[2] < cols for r in rects) else 0


def _positions(rects, axis: int) -> torch.Tensor:
    """The indices along `axis` (0: rows, 1: columns) the rectangles cover, concatenated in order."""
    lo = torch.tensor([r[2 * axis] for r in rects], dtype=torch.long)
    length = torch.tensor([r[2 * axis + 1] - r[2 * axis] for r in rects], dtype=torch.long)
    start = torch.repeat_interleave(lo - (torch.cumsum(length, 0) - length), length)
    return start + torch.arange(int(length.sum()))


@torch.no_grad()
def gather(sources: list, rects: list, axis: int) -> torch.Tensor:
    """The rectangles `rects` (full coordinates, one entry's, sliced along `axis` of its 2-D view) read from
    `sources` [(rects, 2-D tensor holding them concatenated along axis)], concatenated along axis in order.
    RuntimeError if a rectangle has no source."""
    stacked = torch.cat([t for _, t in sources], dim=axis) if len(sources) > 1 else sources[0][1]
    covered = _positions([r for rs, _ in sources for r in rs], axis)
    where = torch.full((max(int(covered.max()), int(_positions(rects, axis).max())) + 1,), -1, dtype=torch.long)
    where[covered] = torch.arange(len(covered))
    wanted = where[_positions(rects, axis)]
    if bool((wanted < 0).any()):
        raise RuntimeError("internal: an ownership change found no source for part of a tensor")
    return stacked.index_select(axis, wanted.to(stacked.device))


def _by_entry(transfers: list[Transfer]) -> dict:
    """{name: [its transfers' rectangles]}, entries in the transfers' order."""
    out = {}
    for t in transfers:
        out.setdefault(t.name, []).append(t)
    return out


def exchange(transfers: list[Transfer], held: Held, plan, rank: int, comm, device, values: bool,
             state_keys: list, quantity: Quantity | str = Quantity.REASSIGN) -> tuple[dict, list]:
    """Send what this rank leads and receive what it gains (point to point, one message per peer and
    dtype, both sides reading the transfers in their one order: per entry its value, then each
    optimizer's state tensors by sorted key); returns (values {name: [(rects, 2-D tensor)]}, per
    optimizer {key: {name: [(rects, 2-D tensor)]}}) received. The sends are counted under `quantity`."""
    sends, recvs = {}, {}
    for t in transfers:
        if t.src == rank:
            sends.setdefault(t.dst, []).append(t)
        elif t.dst == rank:
            recvs.setdefault(t.src, []).append(t)
    ops, incoming = [], []
    for dst, ts in sorted(sends.items()):
        payload = []
        for name, tn in _by_entry(ts).items():
            rects, axis = [t.rect for t in tn], entry_axis(plan, name, [t.rect for t in tn])
            if values:
                payload.append(gather(_wrapped(held.values[name]), rects, axis))
            if tn[0].is_param:
                payload += [gather(_wrapped(states[key][name]), rects, axis) for states in held.states
                            for key in sorted(states)]
        ops += [("send", flat, dst) for flat in _pack(payload).values()]
    for src, ts in sorted(recvs.items()):
        layout = []  # (name, rects, dtype, shape, what): what = None (value) or (optimizer, key)
        for name, tn in _by_entry(ts).items():
            rects = [t.rect for t in tn]
            axis = entry_axis(plan, name, rects)
            along = sum(r[2 * axis + 1] - r[2 * axis] for r in rects)
            other = rects[0][3] - rects[0][2] if axis == 0 else rects[0][1] - rects[0][0]
            shape = (along, other) if axis == 0 else (other, along)
            dtype = getattr(torch, plan.tensor_dtypes[name])
            whats = ([None] if values else []) + ([(i, k) for i, keys in enumerate(state_keys) for k in keys]
                                                  if tn[0].is_param else [])
            layout += [(name, rects, dtype, shape, what) for what in whats]
        buffers = {d: torch.empty(sum(s[0] * s[1] for _, _, dt, s, _ in layout if dt == d), dtype=d, device=device)
                   for d in dict.fromkeys(dt for _, _, dt, _, _ in layout)}
        ops += [("recv", flat, src) for flat in buffers.values()]
        incoming.append((layout, buffers))
    comm.exchange(ops, quantity)
    got_values, got_states = {}, [{key: {} for key in keys} for keys in state_keys]
    for layout, buffers in incoming:
        cursor = {d: 0 for d in buffers}
        for name, rects, dtype, shape, what in layout:
            block = buffers[dtype][cursor[dtype]:cursor[dtype] + shape[0] * shape[1]].view(shape)
            cursor[dtype] += shape[0] * shape[1]
            slot = got_values if what is None else got_states[what[0]][what[1]]
            slot.setdefault(name, []).append((rects, block))
    return got_values, got_states


def _wrapped(held_rects: list) -> list:
    """Held [(rect, view)] as gather's sources [([rect], view)]."""
    return [([r], v) for r, v in held_rects]


def _pack(tensors: list[torch.Tensor]) -> dict:
    """{dtype: one flat contiguous tensor of the given tensors of that dtype, in order}."""
    by_dtype = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t.reshape(-1))
    return {d: torch.cat(ts) if len(ts) > 1 else ts[0].contiguous() for d, ts in by_dtype.items()}


@torch.no_grad()
def fill(target: torch.Tensor, pieces: list, sources: list, axis: int) -> None:
    """Write `target` (its 2-D view) at each (local rect, full rect) of `pieces` from `sources` [(full rects,
    2-D tensor holding them concatenated along `axis`)], all of one entry sliced along `axis` of its 2-D
    view (entry_axis): one gather and one scatter for the whole tensor."""
    view = as_2d(target)
    local = _positions([loc for loc, _ in pieces], axis).to(view.device)
    view.index_copy_(axis, local, gather(sources, [f for _, f in pieces], axis))


@torch.no_grad()
def fill_values(layout: RankLayout, held: Held, received: dict) -> None:
    """Write every value of the new layout from what this rank held and what it received; a tensor the
    rebuild kept (the same storage) is left as it is."""
    by_tensor = {}
    for h in layout.held_values():
        by_tensor.setdefault(id(h.tensor), (h.tensor, h.piece.name, []))[2].append((h.local, h.full))
    for tensor, name, pieces in by_tensor.values():
        old = held.values.get(name, [])
        if any(view.data_ptr() == as_2d(tensor).data_ptr() for _, view in old) and \
                all(_kept(old, loc, full) for loc, full in pieces):
            continue  # the rebuild kept this tensor: it holds its values already
        fill(tensor, pieces, _wrapped(old) + received.get(name, []),
             entry_axis(layout.plan, name, [f for _, f in pieces] + [r for r, _ in old]))


def _kept(sources, local, full) -> bool:
    """True when a source rectangle is this very place (the rebuild kept the tensor)."""
    return any(f == full for f, _ in sources)


@torch.no_grad()
def rebind_optimizers(optimizers: list, new: RankLayout, held: Held, received: list) -> None:
    """Give each optimizer the new layout's parameters in place of the old, with their state (module
    docstring); parameters kept across the change keep their entries."""
    name_of, pieces_of = {}, {}
    for piece in new.pieces:
        if piece.is_param and new.owns(piece):
            param, local = new.parameter_place(piece)
            if new.is_trainable(param):
                name_of.setdefault(id(param), piece.name)
                pieces_of.setdefault(id(param), []).append((local, new.held_rectangle(piece)))
    new_ids = {id(p) for p in new.trainable}
    for opt_index, opt in enumerate(optimizers):
        kept = held.param_ids[opt_index]
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in new_ids:
                    opt.state.pop(p, None)
            group["params"] = [p for p in group["params"] if id(p) in new_ids]
        for p in new.trainable:
            if id(p) in kept:
                continue
            name = name_of.get(id(p))
            gi = held.groups[opt_index].get(name, held.roles[opt_index].get(role(name))) if name else None
            if gi is None:
                continue  # this optimizer held no parameter of this name or role: not one it steps
            opt.param_groups[gi]["params"].append(p)
            state = {key: value.clone() for key, value in held.scalars[opt_index].items()}
            for key, by_name in held.states[opt_index].items():
                state[key] = torch.empty_like(p)
                old = by_name.get(name, [])
                fill(state[key], pieces_of[id(p)], _wrapped(old) + received[opt_index].get(key, {}).get(name, []),
                     entry_axis(new.plan, name, [f for _, f in pieces_of[id(p)]] + [r for r, _ in old]))
            if state:
                opt.state[p] = state


def state_keys_of(held: Held) -> list:
    """Per optimizer, the sorted keys of its state tensors shaped like their parameters."""
    return [sorted(states) for states in held.states]


def agree(values: list, group, timeout) -> None:
    """ValueError unless every rank sees the same `values` (the optimizers' state keys: every rank must
    move the same tensors)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, values, group=group)
    if any(g != gathered[0] for g in gathered):
        raise ValueError(f"an ownership change needs the same optimizers with the same state on every rank; the ranks "
                         f"hold {gathered}")

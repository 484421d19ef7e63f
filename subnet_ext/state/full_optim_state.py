"""The optimizer state of the whole model in torch.distributed.checkpoint's full format.

`full_optimizer_state_dict` writes, and `load_full_optimizer_state_dict` reads, exactly
what `get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))`
gives for a DDP or FSDP2 model (the format below): state keyed by the parameters' names in
the unwrapped model, each tensor whole, and param groups listing those names. So a DDP or
FSDP2 checkpoint resumes under SDP (any plan), and an SDP one under DDP or FSDP2 through
`set_optimizer_state_dict`.

Saving (collective): each rank's optimizer holds only its pieces, in param groups of its
own; the groups are matched by index across ranks (every rank builds its optimizer with
the same groups, as the same training script does) and list the union of their
parameters' names, in the model's order. Tensor state is summed from the pieces' leaders
(full_gather.py, bit-exact); a scalar (Adam's step) is the largest over the pieces.
Entries follow the param groups' order, as torch's. Unlike torch, every parameter some
rank's optimizer holds gets an entry once any state exists: one no rank has state for
(it never had a gradient) is written as zeros with step 0, which is what Adam and AdamW
would initialise lazily.

Loading (not collective): each rank takes its pieces' rectangles out of the whole
tensors, and every param group takes the settings of the saved group that lists its
parameters (as torch's set_optimizer_state_dict matches groups by name, not by position).

The format, and what is recognised when it is not given (check_format): errors that name what was given instead.

torch's `get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))`
(the same for a plain, DDP-wrapped or FSDP2 model) returns

    {"state": {fqn: {"step": 0-d tensor, "exp_avg": tensor of the parameter's shape, ...}},
     "param_groups": [{"lr": ..., "weight_decay": ..., ..., "params": [fqn, ...]}, ...]}

keyed by the parameters' fully qualified names in the unwrapped model (tied parameters
once, under their first name in `named_parameters()`), every tensor whole. SDP writes and
reads exactly this, so checkpoints move between DDP, FSDP2 and SDP runs. What else people
pass by mistake, and how each is recognised here: torch's own `optimizer.state_dict()`
(integer parameter indices), DCP's flattened form (`"state.<fqn>.<key>"` at the top level),
a sharded one (DTensor values: `full_state_dict=False`), subnet_ext's older full form
(param groups without "params"), and another model's state (names or shapes this model
lacks).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ..comm import collectives
from ..comm.collectives import describe_group
from .full_gather import FullEntry, check_options, sum_gather
from .layout import RankLayout, as_2d, copy_overlaps, local_tensor
from .optim_state import ensure_state, hyperparameters, scalar_value, state_entry_shapes


def optimizer_param_names(layout: RankLayout, optimizer) -> dict:
    """{id(parameter): its name in the unwrapped model} for every parameter of `optimizer`.

    Raises:
        ValueError: a parameter that is not one of this engine's (an optimizer built over
            the model before wrapping, or over another model).
    """
    names = {id(s.param): s.piece.name for s in layout.held_optimizer_pieces(optimizer)}
    for n in layout.plan.param_names:  # parameters this rank holds but does not own (backward regime)
        if layout.holds_whole(n):
            names.setdefault(id(layout.value_of(n)), n)
    for i, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            if id(p) not in names:
                raise ValueError(f"the optimizer's param group {i} holds a parameter of shape {tuple(p.shape)} that "
                                 "is not one of this engine's parameters: build the optimizer after wrapping, over "
                                 "sdp.parameters()")
    return names


def _merged_groups(layout: RankLayout, optimizer, everyone: list) -> list[dict]:
    """torch's param_groups for the whole model: this rank's settings, each group listing the
    names every rank holds in it (model order). ValueError when the ranks' groups differ."""
    counts = [len(info["groups"]) for info in everyone]
    if len(set(counts)) > 1:
        raise ValueError(f"full_optimizer_state_dict: the ranks' optimizers have different numbers of param groups "
                         f"({counts}, by rank); build the optimizer with the same groups on every rank (a group may "
                         "hold no parameter on a rank)")
    order = {n: i for i, n in enumerate(layout.plan.tensor_shapes)}
    out = []
    for i, group in enumerate(optimizer.param_groups):
        settings = [info["groups"][i][1] for info in everyone]
        differing = sorted({k for s in settings for k in s if any(s.get(k) != t.get(k) for t in settings)})
        if differing:
            raise ValueError(f"full_optimizer_state_dict: param group {i} has different settings on different ranks "
                             f"({', '.join(f'{k}: {[s.get(k) for s in settings]}' for k in differing)}, by rank); "
                             "owners would apply different updates: give every rank the same settings")
        listed = {n for info in everyone for n in info["groups"][i][0]}
        packed = {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in group.items() if k != "params"}
        packed["params"] = sorted(listed, key=order.__getitem__)
        out.append(packed)
    return out


def full_optimizer_state_dict(layout: RankLayout, optimizer, process_group=None, timeout: float | None = None,
                              rank0_only: bool = False, cpu_offload: bool = False) -> dict:
    """{"state": {name: {key: whole tensor or 0-d}}, "param_groups": [{..., "params": [name, ...]}]}.

    `layout`: this rank's RankLayout. Collective over `process_group`. Identical on every
    rank, or with `rank0_only` on group rank 0 only ({} elsewhere, which then never holds
    more than one chunk of it); `cpu_offload` returns CPU tensors. See the module docstring."""
    check_options("full_optimizer_state_dict", rank0_only, cpu_offload)
    names = optimizer_param_names(layout, optimizer)
    held = layout.held_optimizer_pieces(optimizer)
    local = {"entries": state_entry_shapes(optimizer, [s.param for s in held]),
             "groups": [([names[id(p)] for p in g["params"]], settings)  # settings comparable across ranks
                        for g, settings in zip(optimizer.param_groups, hyperparameters(optimizer))]}
    communicate = layout.world_size > 1 and dist.is_initialized()
    everyone = [local]
    if communicate:
        everyone = [None] * layout.world_size
        dist.all_gather_object(everyone, local, group=process_group)
    groups = _merged_groups(layout, optimizer, everyone)
    entry_shapes = dict(sorted({k: v for info in everyone for k, v in info["entries"].items()}.items()))
    plan = layout.plan
    params = list(dict.fromkeys(n for g in groups for n in g["params"] if plan.is_float(n)))  # torch's order
    by_name = {}
    for s in held:
        by_name.setdefault(s.piece.name, []).append(s)

    def write(key, target):
        entry, name = key
        for s in by_name.get(name, ()):
            value = optimizer.state.get(s.param, {}).get(entry)
            if value is not None and layout.contributes(s.piece):
                s.write_into_full(target, local_tensor(value))

    tensors = sum_gather([FullEntry((k, n), plan.tensor_shapes[n], getattr(torch, plan.tensor_dtypes[n]))
                          for k, shape in entry_shapes.items() if shape == "tensor" for n in params],
                         write, layout.device, process_group, timeout, rank0_only, cpu_offload, communicate,
                         label=describe_group(range(layout.world_size), layout.world_size), what="optimizer state")
    scalars = _max_scalars(optimizer, held, [k for k, shape in entry_shapes.items() if shape == "scalar"], params,
                           process_group, timeout, communicate, layout.device)
    if rank0_only and communicate and dist.get_rank(process_group) != 0:
        return {}
    state = {}
    for n in params:
        entries = {k: tensors[(k, n)] for k, shape in entry_shapes.items() if shape == "tensor"}
        entries.update((k, torch.tensor(scalars[(k, n)], dtype=torch.float32))
                       for k, shape in entry_shapes.items() if shape == "scalar")
        if entries:
            state[n] = entries
    return {"state": state, "param_groups": groups}


def _max_scalars(optimizer, held, keys: list, params: list, process_group, timeout, communicate,
                 device: torch.device) -> dict:
    """{(key, name): float}: the largest value of scalar state `key` over the pieces of each
    parameter (one MAX all-reduce, on the CPU where the group takes CPU tensors, else on `device`)."""
    values = {(k, n): 0.0 for k in keys for n in params}
    for s in held:
        state = optimizer.state.get(s.param, {})
        for k in keys:
            if k in state:
                values[(k, s.piece.name)] = max(values[(k, s.piece.name)], float(scalar_value(state[k])))
    if communicate and values:
        flat = torch.tensor(list(values.values()), dtype=torch.float64,
                            device=collectives.staging_device(process_group, device))
        collectives.all_reduce(flat, process_group, op=dist.ReduceOp.MAX, timeout=timeout,
                               operation="all_reduce (optimizer step counts)")
        values = dict(zip(values, flat.tolist()))
    return values


def load_full_optimizer_state_dict(layout: RankLayout, optimizer, full: dict, strict: bool = True) -> None:
    """Give this rank's optimizer its share of a full optimizer state (SDP's, DDP's or
    FSDP2's, any plan). `layout`: this rank's RankLayout. Not collective.

    Raises:
        ValueError: another format or model (check_format names what was given), a
            parameter of this optimizer missing from a non-empty state (unless
            `strict=False`, which leaves it without state, as torch's option), or a param
            group whose parameters the saved groups do not list.
    """
    check_format(layout.plan, full)
    names = optimizer_param_names(layout, optimizer)
    state = {canonical(layout.plan, n): entries for n, entries in full["state"].items()}
    held = layout.held_optimizer_pieces(optimizer)
    missing = sorted({s.piece.name for s in held if s.piece.name not in state})
    if state and missing and strict:
        raise ValueError(f"load_full_optimizer_state_dict: the state has no entry for {len(missing)} parameter(s) "
                         f"this rank's optimizer updates ({missing[:3]}); it holds entries for {len(state)} "
                         "names. Save the whole model's optimizer state (full_state_dict=True, every rank calling "
                         "it), or pass strict=False to leave those parameters without state")
    _load_group_settings(layout.plan, optimizer, names, full["param_groups"])
    held = [s for s in held if s.piece.name in state]
    entry_shapes = {}
    for s in held:
        for key, value in state[s.piece.name].items():
            entry_shapes[key] = "tensor" if torch.is_tensor(value) and value.dim() > 0 else "scalar"
    ensure_state(optimizer, held, entry_shapes)
    with torch.no_grad():
        for s in held:
            entries = state[s.piece.name]
            for key, entry_shape in entry_shapes.items():
                if key not in entries:
                    raise ValueError(f"load_full_optimizer_state_dict: the state of {s.piece.name!r} lacks {key!r}, "
                                     f"which other parameters have ({sorted(entries)} vs {sorted(entry_shapes)})")
                if entry_shape == "scalar":
                    optimizer.state[s.param][key].fill_(float(scalar_value(entries[key])))
                    continue
                src = as_2d(entries[key].to(layout.device).contiguous())
                copy_overlaps(local_tensor(optimizer.state[s.param][key]), s.local, s.full,
                              [((0, src.shape[0], 0, src.shape[1]), src)])


def _load_group_settings(plan, optimizer, names: dict, saved_groups: list) -> None:
    """Each param group takes the settings (lr, weight_decay, ...) of the saved group listing
    its parameters; a group with no parameter on this rank keeps its own."""
    group_of = {canonical(plan, n): i for i, g in enumerate(saved_groups) for n in g["params"]}
    for i, group in enumerate(optimizer.param_groups):
        mine = sorted({names[id(p)] for p in group["params"]})
        matches = sorted({group_of[n] for n in mine if n in group_of})
        unlisted = [n for n in mine if n not in group_of]
        if unlisted or len(matches) > 1:
            problem = f"no saved group lists {unlisted[:3]}" if unlisted else \
                f"its parameters sit in saved groups {matches}"
            raise ValueError(f"load_full_optimizer_state_dict: param group {i} of this optimizer cannot be matched: "
                             f"{problem}. Build the optimizer with the param groups the state was saved with")
        if not matches:
            continue
        for k, v in saved_groups[matches[0]].items():
            if k == "params":
                continue
            if torch.is_tensor(group.get(k)):
                group[k].fill_(float(v))  # a tensor lr stays a tensor (capturable/compiled optimizers)
            else:
                group[k] = v.clone() if torch.is_tensor(v) else copy.deepcopy(v)


# ---- the format and the errors that name what was given instead
EXPECTED = ("the full optimizer state of torch.distributed.checkpoint — {'state': {fqn: {key: tensor}}, "
            "'param_groups': [{..., 'params': [fqn, ...]}]}, as get_optimizer_state_dict(model, optimizer, "
            "options=StateDictOptions(full_state_dict=True)) or sdp.full_optimizer_state_dict(optimizer) return it")


def _error(given: str, fix: str) -> ValueError:
    return ValueError(f"load_full_optimizer_state_dict expects {EXPECTED}; got {given}. {fix}")


def _first(items, n: int = 3) -> str:
    items = list(items)
    return f"{items[:n]}" + (f" (and {len(items) - n} more)" if len(items) > n else "")


def check_format(plan, full) -> None:
    """ValueError, naming what was expected and what `full` is, unless `full` is a full,
    name-keyed optimizer state of this plan's model (see the module docstring)."""
    if not isinstance(full, dict) or not isinstance(full.get("state"), dict) or \
            not isinstance(full.get("param_groups"), list):
        keys = _first(full) if isinstance(full, dict) else ""
        if isinstance(full, dict) and any(isinstance(k, str) and k.startswith(("state.", "param_groups."))
                                          for k in full):
            raise _error(f"the flattened form (keys such as {keys})",
                         "Save it with flatten_optimizer_state_dict=False (the default).")
        raise _error(f"a {type(full).__name__} with keys {keys}" if keys else f"a {type(full).__name__}",
                     "Pass the whole dict, with both 'state' and 'param_groups'.")
    state, groups = full["state"], full["param_groups"]
    indexed = [k for k in state if not isinstance(k, str)] + \
        [p for g in groups if isinstance(g, dict) for p in g.get("params", ()) if not isinstance(p, str)]
    if indexed:
        raise _error(f"torch's optimizer.state_dict() form, keyed by parameter index ({_first(indexed)}), which "
                     "only the optimizer that wrote it can read",
                     "Save with get_optimizer_state_dict(model, optimizer, "
                     "options=StateDictOptions(full_state_dict=True)) instead of optimizer.state_dict().")
    if any(not isinstance(g, dict) or "params" not in g for g in groups):
        raise _error("param_groups without 'params' (subnet_ext's older full form, or settings only)",
                     "Save the optimizer state again with sdp.full_optimizer_state_dict(optimizer).")
    sharded = [n for n, entries in state.items() if isinstance(entries, dict) for v in entries.values()
               if hasattr(v, "to_local")]
    if sharded:
        raise _error(f"sharded values (DTensors, e.g. of {_first(dict.fromkeys(sharded))})",
                     "Save with options=StateDictOptions(full_state_dict=True).")
    known = set(plan.param_names) | set(plan.aliases)
    unknown = [n for n in list(state) + [p for g in groups for p in g["params"]] if n not in known]
    if unknown:
        raise _error(f"names this model does not have ({_first(dict.fromkeys(unknown))}; the model's parameters "
                     f"include {_first(plan.param_names)})",
                     "It is another model's optimizer state, or names with a wrapper's prefix (such as 'module.'): "
                     "torch's get_optimizer_state_dict strips those.")
    bad = [n for n, entries in state.items() if not isinstance(entries, dict)]
    if bad:
        raise _error(f"entries that are not dicts of state ({_first(bad)})", "Each entry maps a state key to a value.")
    shapes = [f"{n}[{k!r}]: {tuple(v.shape)} vs parameter {plan.tensor_shapes[canonical(plan, n)]}"
              for n, entries in state.items() for k, v in entries.items()
              if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) != plan.tensor_shapes[canonical(plan, n)]]
    if shapes:
        raise _error(f"state whose shapes differ from this model's ({_first(shapes, 2)})",
                     "It is another model's optimizer state (or another configuration of it).")


def canonical(plan, name: str) -> str:
    """The name the plan keeps for `name` (a tied alias maps to its canonical name)."""
    return plan.aliases.get(name, name)

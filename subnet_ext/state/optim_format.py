"""The full optimizer state format SDP shares with torch.distributed.checkpoint, and the
errors that name what was given instead.

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

import torch

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

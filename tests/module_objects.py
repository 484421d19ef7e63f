"""What a user sees on each module object of a model, to check that wrapping and closing (or an
integration's evaluation) leave it as it was: `objects(model)` before, `differences(before,
objects(model))` after."""
import types

import torch

HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
         "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
         "_load_state_dict_post_hooks")
PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _value(v):
    """A comparable form of an attribute's value: plain values as they are, a bound method as
    (its function, the object it is bound to), anything else by identity."""
    if isinstance(v, PLAIN) or (isinstance(v, tuple) and all(isinstance(x, PLAIN) for x in v)):
        return v
    if isinstance(v, types.MethodType):
        return ("bound", v.__func__, id(v.__self__))
    return ("object", id(v))


def objects(model) -> dict:
    """{path: what a user sees on that module object} for every module of `model`."""
    out = {}
    for path, m in model.named_modules(remove_duplicate=False):
        out[path] = {
            "object": id(m), "class": type(m), "dict": sorted(vars(m)),
            "parameters": list(m._parameters), "buffers": list(m._buffers),
            "modules": [(n, id(c)) for n, c in m._modules.items()],
            "non_persistent": sorted(m._non_persistent_buffers_set),
            "attributes": {k: _value(v) for k, v in vars(m).items()},  # registries and hook dicts: the same objects
            "hooks": {h: list(getattr(m, h).items()) for h in HOOKS},
            "forward": (type(m.forward), getattr(m.forward, "__func__", m.forward),
                        id(getattr(m.forward, "__self__", None))),
            "requires_grad": {n: p.requires_grad for n, p in m._parameters.items() if p is not None},
        }
    return out


def differences(before: dict, after: dict) -> list:
    """[(path, what, before, after)] for each difference of two `objects` snapshots; [] when none."""
    if list(before) != list(after):
        return [("paths", sorted(set(before) ^ set(after)))]
    return [(path, key, before[path][key], after[path].get(key)) for path in before for key in before[path]
            if before[path][key] != after[path].get(key)]

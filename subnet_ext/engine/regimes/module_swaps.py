"""The swap record: every change the engine makes to a user's model, undone by close().

The engine never edits a user's layer to make it compute this rank's share. It puts a module
of its own in the layer's place, in every parent module that holds it (`swap`), and keeps the
user's object aside untouched, so `undo()` puts the very same object back and a reference the
user kept to it stays valid. The stand-ins are the engine's layers (owned_linear.py,
owned_conv.py, sliced_layers.py, width_keeping.py, sliced_attention.py, surgery.SkippedBlock)
or, for a layer the engine has no class for (a norm, a grouped convolution, an attention, a
SyncBatchNorm given its owners' group), the layer's `twin`: the same class, attributes and
tensors with registries of its own, so what the surgery changes on it never reaches the
user's module. Whatever the engine sets afterwards it sets on its own modules.

Three other changes go through the same record, because no swap can make them:

- the root module has no parent to be swapped in: its own tensors and the widths that follow
  them are changed in place (`stand_in` returns it, `put` records each change), its registries
  and attributes restored as they were by `undo()`;
- a tensor this rank does not hold is released (`release`): the user's module set aside (or
  the root) holds a meta tensor of its shape instead, so its memory is freed, and close()
  gives it memory again and loads the trained values into it;
- `requires_grad` of a Parameter this rank does not train (`set_requires_grad`).

A replacement registers the user's unsliced parameters and buffers under their own names
(`adopt_tensors`), so `named_parameters()` and state-dict names do not move with the swap.
"""
from __future__ import annotations

import copy
import weakref

import torch
import torch.nn as nn

_ABSENT = object()  # an attribute the module did not have before the engine set it


def adopt_tensors(replacement: nn.Module, original: nn.Module, skip=()) -> None:
    """Register `original`'s parameters and buffers (the same tensor objects, persistence kept)
    on `replacement` under their own names, in their order, except the names in `skip`."""
    for name, param in original._parameters.items():
        if name not in skip:
            replacement.register_parameter(name, param)
    for name, buffer in original._buffers.items():
        if name not in skip:
            replacement.register_buffer(name, buffer, persistent=name not in original._non_persistent_buffers_set)
    replacement.train(original.training)


def twin(module: nn.Module, cls: type | None = None) -> nn.Module:
    """A shallow copy of `module`: the same class (or `cls`, a subclass of it that adds no state),
    attributes, tensors and submodules, with its own registries (parameters, buffers, submodules,
    hooks: every dict and set in its __dict__), so registering or removing on the twin leaves
    `module` as it was. A method bound to `module` in its __dict__ (a forward the user set on
    the instance, e.g. to checkpoint it) is bound to the twin in the twin's own __dict__, so the
    twin computes with what it holds; `module` itself is not changed."""
    if cls is None:
        twin_module = copy.copy(module)
    else:
        if not issubclass(cls, type(module)):
            raise TypeError(f"twin: a {cls.__name__} cannot be the twin of a {type(module).__name__} "
                            "(it must be a subclass of the module's class)")
        twin_module = cls.__new__(cls)
        twin_module.__dict__.update(vars(module))
    for key, value in vars(module).items():
        if isinstance(value, (dict, set)):
            twin_module.__dict__[key] = value.copy()
        elif getattr(value, "__self__", None) is module and hasattr(value, "__func__"):
            twin_module.__dict__[key] = value.__func__.__get__(twin_module, type(twin_module))
    return twin_module


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of `tensor`'s shape and dtype (a Parameter, requires_grad kept, for a Parameter)."""
    meta = torch.empty_like(tensor, device="meta")
    return nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta


class _InPlace:
    """A user's module the engine changes in place (the root, or a module whose tensors it
    releases): its registries as they were, and the previous value of each attribute set."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.parameters = dict(module._parameters)
        self.buffers = dict(module._buffers)
        self.non_persistent = set(module._non_persistent_buffers_set)
        self.attributes = {}  # name -> value before the engine set it, or _ABSENT

    def restore(self) -> None:
        """The registries (same dict objects, original order) and the attributes as they were."""
        m = self.module
        m._parameters.clear()
        m._parameters.update(self.parameters)
        m._buffers.clear()
        m._buffers.update(self.buffers)
        m._non_persistent_buffers_set.clear()
        m._non_persistent_buffers_set.update(self.non_persistent)
        for name, value in self.attributes.items():
            if value is _ABSENT:
                m.__dict__.pop(name, None)
            else:
                m.__dict__[name] = value


class ModuleSwaps:
    """The changes made in one model, in order, so they can be undone in reverse order."""

    def __init__(self):
        self._undo: list = []  # callables, undone last first
        self._originals: dict[int, nn.Module] = {}  # id(replacement) -> the module it stands in for
        self._replacements: dict[int, nn.Module] = {}  # id(replacement) -> replacement (kept alive: ids stay theirs)
        self._in_place: dict[int, _InPlace] = {}  # id(user's module) -> its record
        self._placeholders: dict[int, tuple] = {}  # id(released tensor) -> (weak ref, its meta stand-in)

    def original_of(self, module: nn.Module) -> nn.Module | None:
        """The user's module `module` stands in for, or None when `module` is not a replacement."""
        return self._originals.get(id(module))

    def is_ours(self, module: nn.Module) -> bool:
        """True for a module the engine swapped in (it may change it freely)."""
        return self._replacements.get(id(module)) is module

    def replacements(self) -> list[nn.Module]:
        """The modules swapped in, in the order they were."""
        return list(self._replacements.values())

    def swap(self, root: nn.Module, path: str, replacement: nn.Module) -> nn.Module:
        """Put `replacement` where `root.get_submodule(path)` is, in every parent module holding
        that object (a module shared by two parents is replaced in both); returns the original."""
        if not path:
            raise ValueError(f"ModuleSwaps.swap: cannot replace the root module itself by a "
                             f"{type(replacement).__name__}; wrap a model that contains the layer")
        original = root.get_submodule(path)
        slots = [(parent, name) for parent in root.modules() for name, child in parent._modules.items()
                 if child is original]
        for parent, name in slots:
            parent._modules[name] = replacement

        def undo():  # in the train or eval mode the replacement was left in (sdp.train()/eval() reached it only)
            for parent, name in slots:
                original.train(parent._modules[name].training)
                parent._modules[name] = original
        self._undo.append(undo)
        self._originals[id(replacement)] = original
        self._replacements[id(replacement)] = replacement
        return original

    def stand_in(self, root: nn.Module, path: str, make=twin) -> nn.Module:
        """The module at `path` that the engine may change: the replacement already there, else
        `make(user's module)` swapped in; the root itself when path is "" (its changes recorded by
        `put` and `release`)."""
        module = root.get_submodule(path)
        if not path:
            self._record(module)
            return module
        if self.is_ours(module):
            return module
        replacement = make(module)
        self.swap(root, path, replacement)
        return replacement

    def _record(self, module: nn.Module) -> _InPlace:
        record = self._in_place.get(id(module))
        if record is None:
            record = self._in_place[id(module)] = _InPlace(module)
            self._undo.append(record.restore)
        return record

    def put(self, module: nn.Module, name: str, value) -> None:
        """Set the plain attribute `name` (an int width, a process group, a tensor under a name that
        is no parameter or buffer) of `module`, one of the engine's modules or the root from
        `stand_in`; on a user's module the previous value is recorded."""
        if name in module._parameters or name in module._buffers or name in module._modules:
            raise ValueError(f"ModuleSwaps.put: {name!r} is a registered tensor or submodule of the "
                             f"{type(module).__name__}; use put_tensor or swap")
        if not self.is_ours(module):
            self._record(module).attributes.setdefault(name, module.__dict__.get(name, _ABSENT))
        module.__dict__[name] = value

    def put_tensor(self, module: nn.Module, leaf: str, tensor: torch.Tensor, release: bool = True) -> None:
        """Put `tensor` where parameter or buffer `leaf` of `module` (one of the engine's modules, or
        the root) is, as a Parameter with the old requires_grad where a parameter was (unless it is
        one). release: this rank does not hold the user's tensor it stands in for (`release`); else
        undo() puts that tensor back."""
        if not self.is_ours(module):
            self._record(module)
        if release:
            self.release(module, leaf)
        registry = module._parameters if leaf in module._parameters else module._buffers
        if registry is module._parameters and not isinstance(tensor, nn.Parameter):
            tensor = nn.Parameter(tensor, requires_grad=registry[leaf].requires_grad)
        registry[leaf] = tensor

    def release(self, module: nn.Module, leaf: str) -> None:
        """This rank does not hold the user's tensor `leaf` behind `module` (a replacement: its
        original's; else `module`'s own): the user's module, and this record, hold a meta tensor of
        its shape and dtype in its place, so its memory is freed once nothing else refers to it. A
        non-persistent buffer (no state of the model: close() could not load it) is kept."""
        user = self.original_of(module) or module
        if leaf in user._buffers and leaf in user._non_persistent_buffers_set:
            return
        record = self._record(user)
        for now, before in ((user._parameters, record.parameters), (user._buffers, record.buffers)):
            if now.get(leaf) is not None:
                original = before.get(leaf)
                now[leaf] = self._placeholder(original if original is not None else now[leaf])
                if original is not None:  # what undo() puts back
                    before[leaf] = now[leaf]
                return

    def _placeholder(self, tensor: torch.Tensor) -> torch.Tensor:
        """One meta stand-in per released tensor, so a tensor released under two names stays one."""
        if tensor.is_meta:
            return tensor
        ref, meta = self._placeholders.get(id(tensor), (None, None))
        if ref is None or ref() is not tensor:
            meta = _meta(tensor)
            self._placeholders[id(tensor)] = (weakref.ref(tensor), meta)
        return meta

    def set_requires_grad(self, param: nn.Parameter, flag: bool) -> None:
        """Set a Parameter's requires_grad; undo() sets it back."""
        previous = param.requires_grad
        param.requires_grad_(flag)
        self._undo.append(lambda: param.requires_grad_(previous))

    def undo(self) -> None:
        """Undo every change, last first: the user's modules back in their parents, the root's
        registries and attributes as they were, released tensors as meta tensors of their shape
        (close() gives them memory and the trained values)."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self._originals.clear()
        self._replacements.clear()
        self._in_place.clear()
        self._placeholders.clear()

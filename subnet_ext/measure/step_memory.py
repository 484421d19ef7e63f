"""Peak memory of one whole training step on one rank, by the same code for every method.

`StepMemoryMeter` is a context manager around one step (forward, backward, optimizer
step, and whatever a wrapper does around them). It follows the live tensor storage of
the process through the dispatcher (a TorchDispatchMode): every storage an operation
reads or writes is tracked from the first time it is seen, a storage an operation
returns that was not seen before is an allocation at that moment, a storage seen first
as an input existed before the step (it is counted from the step's start), a weak
reference reports when it is freed, and `UntypedStorage.resize_` (how FSDP2 gathers
and frees parameters) is followed. The peak is the largest sum of live bytes over the
step. On CUDA the total is the allocator's peak (`torch.cuda.max_memory_allocated`),
which also sees what the dispatcher does not (allocator rounding, library workspaces).

At the peak the live bytes are split three ways, by what each storage turned out to be:
- model_state: storages of the parameters, gradients, buffers and optimizer state of
  the modules and optimizers given (as they are at the step's end, or were at its
  start). A view of a weight (`weight.t()` saved by a matmul) is the weight's storage,
  so it is model state, never an activation.
- activations: storages autograd saved for backward (a saved-tensors hook), apart from
  model state and from storages the step resized (FSDP2's gathered parameters, which it
  frees after use). Under non-reentrant activation checkpointing the block inputs the
  checkpoint keeps are saved tensors too; what it recomputes in backward is transient.
- transient: everything else alive at the peak: gathered parameters, gradients before
  they reach `.grad`, communication buckets, recomputed activations, temporaries.

Not counted: memory that is not tensor storage (allocator fragmentation on CPU, the
process's code and libraries, buffers a library allocates without a tensor), and
storages allocated before the step that the step never touches.

Example::

    meter = StepMemoryMeter(modules=[model], optimizers=[optimizer])
    with meter:
        loss_fn(model(x), y).backward()
        optimizer.step()
    meter.result()   # {"model_state": ..., "activations": ..., "transient": ..., "total": ...} in bytes
"""
from __future__ import annotations

import weakref
from typing import Iterable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = ("model_state", "activations", "transient")


def _plain(t):
    """The plain tensor holding `t`'s bytes on this rank (a DTensor's local shard), or None."""
    local = getattr(t, "_local_tensor", None)
    t = local if isinstance(local, torch.Tensor) else t
    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.is_sparse:
        return None
    if type(t) not in (torch.Tensor, nn.Parameter) and not isinstance(t, nn.Parameter):
        return None  # another wrapper subclass: its inner tensors reach the dispatcher on their own
    return t


def _storage(t):
    t = _plain(t)
    if t is None:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. functional wrappers)
        return None


def model_state_tensors(modules: Iterable[nn.Module] = (), optimizers: Iterable[torch.optim.Optimizer] = ()):
    """Every tensor of model state: parameters, their gradients and the buffers of `modules`,
    and the parameters and state tensors of `optimizers`."""
    out = []
    for module in modules:
        for p in module.parameters():
            out += [p, p.grad]
        out += list(module.buffers())
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                out += [p, p.grad]
        for state in optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return [t for t in out if t is not None]


class _Tracker(TorchDispatchMode):
    """The dispatch mode: records allocations, first sightings, resizes and frees in order."""

    def __init__(self, meter: "StepMemoryMeter"):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor and t is not nn.Parameter for t in types):
            return NotImplemented  # a subclass (DTensor) first runs its local ops, which come back here
        kwargs = kwargs or {}
        for t in tree_iter((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self.meter._see(t, allocated=False)
        out = func(*args, **kwargs)
        for t in tree_iter(out):
            if isinstance(t, torch.Tensor):
                self.meter._see(t, allocated=True)
        return out


class StepMemoryMeter:
    """Per-rank peak memory of one training step, split into model state, activations and
    transient bytes (see the module docstring for what each holds).

    Args:
        modules: the modules whose parameters, gradients and buffers are model state
            (the model as this rank holds it: the wrapped module, FSDP2's sharded model).
        optimizers: the optimizers whose parameters and state tensors are model state.
        device: where the step runs; on CUDA the total is the allocator's peak.
    """

    def __init__(self, modules: Iterable[nn.Module] = (), optimizers: Iterable[torch.optim.Optimizer] = (),
                 device: torch.device | str | None = None):
        self.modules, self.optimizers = list(modules), list(optimizers)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._ids = WeakIdKeyDictionary()  # storage -> its id in the tables below
        self._bytes, self._start_bytes, self._refs = [], [], []
        self._events = []  # (storage id, new size in bytes, phase), in the order they happened
        self._saved, self._resized = set(), set()
        self._phase, self._active, self._result = "forward", False, None

    # ------------------------------------------------------------------ tracking
    def _track(self, storage, allocated: bool) -> int:
        sid = self._ids.get(storage)
        if sid is not None:
            return sid
        sid = len(self._bytes)
        self._ids[storage] = sid
        size = storage.nbytes()
        self._bytes.append(size)
        self._start_bytes.append(0 if allocated else size)  # seen first as an input: it existed at the start
        if allocated:
            self._events.append((sid, size, self._current_phase()))
        self._refs.append(weakref.ref(storage, lambda _, sid=sid: self._freed(sid)))
        return sid

    def _see(self, t, allocated: bool) -> None:
        storage = _storage(t)
        if storage is not None:
            self._track(storage, allocated)

    def _freed(self, sid: int) -> None:
        if self._active:
            self._events.append((sid, 0, self._current_phase()))

    def _resize(self, storage, size: int) -> None:
        sid = self._track(storage, allocated=False)
        self._resized.add(sid)
        self._events.append((sid, int(size), self._current_phase()))  # an UntypedStorage's size is in bytes

    def _pack(self, t):
        storage = _storage(t)
        if storage is not None:
            self._saved.add(self._track(storage, allocated=False))
        return t

    def _current_phase(self) -> str:
        if self._phase == "optimizer":
            return "optimizer"
        return "backward" if torch._C._current_graph_task_id() != -1 else self._phase

    # ------------------------------------------------------------------ context
    def __enter__(self) -> "StepMemoryMeter":
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        if self._active or self._result is not None:
            raise RuntimeError("StepMemoryMeter measures one step: make a new meter for the next one")
        for t in model_state_tensors(self.modules, self.optimizers):
            self._see(t, allocated=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        original_resize = torch.UntypedStorage.resize_
        meter = self

        def resize_(storage, size):
            meter._resize(storage, size)
            return original_resize(storage, size)

        self._original_resize = original_resize
        torch.UntypedStorage.resize_ = resize_
        self._hooks = [register_optimizer_step_pre_hook(lambda *a: setattr(self, "_phase", "optimizer")),
                       register_optimizer_step_post_hook(lambda *a: setattr(self, "_phase", "after"))]
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved_hooks.__enter__()
        self._mode = _Tracker(self)
        self._active = True
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._saved_hooks.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        torch.UntypedStorage.resize_ = self._original_resize
        cuda_peak = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            cuda_peak = torch.cuda.max_memory_allocated(self.device)
        state = {sid for t in model_state_tensors(self.modules, self.optimizers)
                 if (s := _storage(t)) is not None and (sid := self._ids.get(s)) is not None}
        self._active = False
        self._result = self._replay(state, cuda_peak)

    # ------------------------------------------------------------------ the peak
    def _category(self, sid: int, state: set) -> str:
        if sid in state:
            return "model_state"
        if sid in self._saved and sid not in self._resized:
            return "activations"
        return "transient"

    def _replay(self, state: set, cuda_peak) -> dict:
        """Replays the step's events from its start: the largest live total and its split."""
        category = [self._category(sid, state) for sid in range(len(self._bytes))]
        live = list(self._start_bytes)
        split = dict.fromkeys(CATEGORIES, 0)
        for sid, size in enumerate(live):
            split[category[sid]] += size
        total = sum(split.values())
        peak, peak_split, peak_phase = total, dict(split), "start"
        for sid, size, phase in self._events:
            delta = size - live[sid]
            live[sid] = size
            split[category[sid]] += delta
            total += delta
            if total > peak:
                peak, peak_split, peak_phase = total, dict(split), phase
        result = dict(peak_split, total=peak, peak_phase=peak_phase, source="live tensor storage (dispatcher)")
        if cuda_peak is not None:  # the allocator's peak; what the dispatcher did not see is transient
            result.update(total=cuda_peak, tracked_total=peak, source="torch.cuda.max_memory_allocated",
                          transient=max(0, cuda_peak - peak_split["model_state"] - peak_split["activations"]))
        return result

    def result(self) -> dict:
        """{"model_state", "activations", "transient", "total"} in bytes at the step's peak (the
        three parts add up to the total; on CUDA transient is the allocator's peak minus the other
        two), plus "peak_phase" (forward, backward, optimizer, after or start: when the peak
        happened) and "source" (what measured the total).

        Raises:
            RuntimeError: the meter has not measured a step yet.
        """
        if self._result is None:
            raise RuntimeError("StepMemoryMeter.result(): no step measured yet (use the meter as a context "
                               "manager around one training step)")
        return dict(self._result)


def measure_step(step, modules: Iterable[nn.Module] = (), optimizers: Iterable[torch.optim.Optimizer] = (),
                 device: torch.device | str | None = None):
    """(step()'s return value, StepMemoryMeter.result()) of one call of `step` (a function running
    one training step: forward, backward, optimizer step)."""
    meter = StepMemoryMeter(modules, optimizers, device)
    with meter:
        out = step()
    return out, meter.result()

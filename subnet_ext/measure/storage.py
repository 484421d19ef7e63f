"""Counting the bytes tensors and the process hold: the one home of the package's storage meters.

- local_tensor / tensor_bytes: the tensor this rank holds (a DTensor's local shard) and its bytes;
- optimizer_state_bytes: the bytes of an optimizer's tensor state;
- storage_counter: bytes of storages not counted before (a storage shared by two tensors counts once),
  what `SubnetDataParallel.memory_report()` sums;
- ActivationMeter: bytes autograd saves for backward during a forward (the CLI's CPU measure);
- peak_rss_bytes / proc_status_bytes: the process's resident memory, as the kernel reports it.

The peak of a whole training step, by category, is step_memory.py's StepMemoryMeter.
"""
from __future__ import annotations

import resource
from typing import Callable, Iterable

import torch
import torch.nn as nn


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a sharded shared parameter, its gradient or its
    optimizer state), or `t` itself: the tensor a rectangle addresses."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for t (the local shard of a DTensor)."""
    local = local_tensor(t)
    return local.numel() * local.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in `optimizer.state` this rank holds (local shards of DTensors)."""
    return sum(tensor_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def storage_counter() -> Callable[[Iterable[torch.Tensor | None]], int]:
    """nbytes(tensors): bytes of the storages not counted before by this counter (a storage
    shared by several tensors counts once; None and meta tensors count nothing)."""
    seen = set()

    def nbytes(ts):
        total = 0
        for t in ts:
            if t is None or t.device.type == "meta":
                continue
            key = _storage_key(t)
            if key not in seen:
                seen.add(key)
                total += key[1]
        return total

    return nbytes


class ActivationMeter:
    """Bytes of tensors autograd saves for backward during a forward (tensor accounting).

    Parameters are not activations and are skipped; storages saved twice count once.
    """

    def __init__(self):
        self.bytes = 0
        self._count = storage_counter()

    def _pack(self, t):
        if not isinstance(t, nn.Parameter):
            self.bytes += self._count([t])
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (getrusage ru_maxrss, KiB on Linux, x 1024)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def proc_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status in bytes ("VmRSS": resident now, "VmHWM": its
    high-water mark); 0 where the field or the file is missing (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0

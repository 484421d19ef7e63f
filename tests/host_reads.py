"""Counting the reads of tensor values to the host that subnet_ext's own code makes.

A read of a device tensor's value (`.item()`, `bool(t)`, `float(t)`, `.tolist()`,
`.cpu()`, `torch.equal`) waits for every kernel queued before it: inside a training step
it stalls the GPU pipeline once per read. On the CPU nothing stalls, but the reads are
the same calls, so they can be counted here, without a GPU:

- `aten._local_scalar_dense` and `aten.equal` (what item/bool/float/int/equal dispatch to),
  seen by a TorchDispatchMode;
- `Tensor.tolist`, `.numpy`, `.cpu`, which read without dispatching such an op, patched.

A read is charged to the code that asked for it: the innermost frame outside torch's
dispatch plumbing (and this file). Only those in the subnet_ext package are kept: a read
torch makes inside a function subnet_ext calls (an optimizer reading its CPU step count)
is torch's, not the engine's. Reads inside the C++ kernels are invisible here; on a GPU,
`torch.cuda.set_sync_debug_mode("error")` catches those. `subnet_ext_caller` is that
charging alone, for other counts (tests/state/test_rank0_state.py charges allocations).
"""
import contextlib
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import subnet_ext

PACKAGE = os.path.dirname(os.path.abspath(subnet_ext.__file__))
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_READ_OPS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default)
_PATCHED = ("tolist", "numpy", "cpu")


# Frames between a read and the code that asked for it (the dispatcher calls the mode
# through torch.compile's disable wrapper).
_PLUMBING = tuple(os.path.join(TORCH_DIR, f) for f in ("_ops.py", "overrides.py", "_tensor.py", "_compile.py",
                                                         "_dynamo", os.path.join("utils", "_python_dispatch.py")))


def _caller(frame):
    """(file, line) of the innermost frame outside torch's dispatch plumbing and this file."""
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_PLUMBING) and name != __file__ and not name.startswith("<"):
            return name, frame.f_lineno
        frame = frame.f_back
    return None, None


def subnet_ext_caller(frame):
    """(file relative to the package, line) of the subnet_ext code that asked for the op or
    read being handled in `frame` (its innermost frame outside torch's dispatch plumbing
    and this file), or None when that code is not subnet_ext's (torch's own, a test's)."""
    name, line = _caller(frame)
    if name is None or not name.startswith(PACKAGE):
        return None
    return os.path.relpath(name, PACKAGE), line


class HostReads(TorchDispatchMode):
    """`reads`: [(what, file, line)] of the host reads subnet_ext made while active;
    `scalar_reads`: [(what, file, line)] of every item/bool/float/equal read, torch's own
    included (a loss scaler reading its found-inf), the file absolute."""

    def __init__(self):
        super().__init__()
        self.reads, self.scalar_reads = [], []

    def note(self, what: str, frame) -> None:
        """Record a read if the code that asked for it is subnet_ext's."""
        caller = subnet_ext_caller(frame)
        if caller is not None:
            self.reads.append((what, *caller))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _READ_OPS:
            self.scalar_reads.append((str(func), *_caller(sys._getframe(1))))
            self.note(str(func), sys._getframe(1))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_host_reads():
    """Yields a HostReads whose `reads` lists subnet_ext's host reads inside the block."""
    mode = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in _PATCHED}

    def patched(name):
        original = originals[name]

        def method(self, *args, **kwargs):
            mode.note(f"Tensor.{name}", sys._getframe(1))
            return original(self, *args, **kwargs)

        return method

    for name in _PATCHED:
        setattr(torch.Tensor, name, patched(name))
    try:
        with mode:
            yield mode
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)

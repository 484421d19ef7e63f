"""Typed Python front end of the `subnet_ext` ops (the C++/CUDA library in csrc/).

Notation used throughout: a full linear layer has weight W [O, I]. `out_idx` = R (the
kept outputs) and `in_idx` = S (the kept inputs) are 1-D int64 tensors of distinct
indices on the operands' device; an absent index means "all". A weight is stored either
full [O, I] or compact `[|R|, |S|]` (`compact_weight=True`, the forward regime's storage).
Packed segments (the tables of `pack_segments` / `unpack_average_`): see segments.py.

Modules, mirroring csrc/::

  linear.py        masked_linear, masked_linear_backward (its one gradient formula),
                   masked_linear_grad_weight_, masked_linear_grad_runs_ (csrc/masked_linear.cpp)
  segments.py      segment_table, PreparedSegments, pack_segments, unpack_average_
                                                                (csrc/pack_segments.cpp)
  fake.py          fake kernels of every op, for torch.compile and opcheck
  registration.py  loads the library; fake kernels, the masked linear's autograd and
                   autocast kernels                             (csrc/registration.cpp)
  autocast.py      autocast dtype helpers (no compiled code)
  build_info.py    loading the compiled library `_C`; what it was built with
  reference.py     pure-PyTorch references of every op (no compiled code)

The compiled library is loaded, with the Python registrations, on the first use of one of
the names below (`subnet_ext.ops.masked_linear`, `from subnet_ext.ops import
pack_segments`, ...) or an import of linear.py / segments.py, not on importing this
package: `import subnet_ext.ops.reference` works without the library.
"""
from __future__ import annotations

import importlib

__all__ = [
    "masked_linear",
    "masked_linear_backward",
    "masked_linear_grad_weight_",
    "masked_linear_grad_runs_",
    "segment_table",
    "PreparedSegments",
    "pack_segments",
    "unpack_average_",
]

# Where each public name is defined (both modules are loaded together).
_HOMES = {
    "masked_linear": "linear",
    "masked_linear_backward": "linear",
    "masked_linear_grad_weight_": "linear",
    "masked_linear_grad_runs_": "linear",
    "segment_table": "segments",
    "PreparedSegments": "segments",
    "pack_segments": "segments",
    "unpack_average_": "segments",
}
_SUBMODULES = ("autocast", "build_info", "fake", "linear", "reference", "registration", "segments")


def _load_ops() -> None:
    """Loads the library with every registration and binds the public names here, so
    later lookups are plain module attributes (no call into this hook, e.g. under dynamo)."""
    from . import linear, segments

    homes = {"linear": linear, "segments": segments}
    for name, home in _HOMES.items():
        globals()[name] = getattr(homes[home], name)


def __getattr__(name: str):
    if name in _HOMES:
        _load_ops()
        return globals()[name]
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_HOMES) | set(_SUBMODULES))

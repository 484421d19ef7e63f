"""subnet_ext: Subnetwork Data Parallelism (SDP) for PyTorch.

Each of K ranks trains a structured subnetwork of the model; each parameter is averaged
only among the ranks that hold it. See README.md and docs/design.md.
"""
import sys as _sys

from .engine import subnet_checkpoint as checkpoint

# `import subnet_ext.checkpoint` and `from subnet_ext.checkpoint import save_subnet_checkpoint` find
# the same module as the attribute `subnet_ext.checkpoint` (subnet_ext/engine/subnet_checkpoint.py).
_sys.modules[f"{__name__}.checkpoint"] = checkpoint
from . import ops
from .ops import reference
from .ops.build_info import build_info
from .comm.collectives import CollectiveError
from .comm.call_check import CallOrderError
from .state.consistency import ConsistencyError
from .engine import SDPConfig, SubnetDataParallel
from .engine.ema import ExponentialMovingAverage
from .engine.guards.grad_scaler import GradScaler
from .engine.guards.nonfinite_guard import NonFiniteGuard, TooManySkippedSteps
from .engine.guards.optimizer_guard import StaleOptimizerError
from .engine.guards.state_dict_guard import PartialStateError
from .planning.plan import SubnetPlan, Unit, plan_subnetworks
from .planning.assignment.schedule import OwnershipSchedule
from .planning.costs.budget import MemoryFit, NoConfigurationFits, plan_for_memory

__version__ = "0.1.0"

__all__ = [
    "SubnetDataParallel",
    "SDPConfig",
    "ExponentialMovingAverage",
    "GradScaler",
    "NonFiniteGuard",
    "TooManySkippedSteps",
    "ConsistencyError",
    "CollectiveError",
    "CallOrderError",
    "PartialStateError",
    "StaleOptimizerError",
    "checkpoint",
    "SubnetPlan",
    "Unit",
    "plan_subnetworks",
    "OwnershipSchedule",
    "plan_for_memory",
    "MemoryFit",
    "NoConfigurationFits",
    "build_info",
    "masked_linear",
    "masked_linear_backward",
    "masked_linear_grad_weight_",
    "masked_linear_grad_runs_",
    "pack_segments",
    "segment_table",
    "unpack_average_",
    "ops",
    "reference",
]

# The op functions are those of `subnet_ext.ops`, looked up there on first use: importing
# the package loads no compiled code until an op runs (`subnet_ext.ops.reference` needs none).
_OPS = ("masked_linear", "masked_linear_backward", "masked_linear_grad_weight_", "masked_linear_grad_runs_",
        "pack_segments", "segment_table", "unpack_average_")


def __getattr__(name: str):
    if name in _OPS:
        value = getattr(ops, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_OPS))

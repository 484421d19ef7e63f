"""subnet_ext: Subnetwork Data Parallelism (SDP) for PyTorch.

Each of K ranks trains a structured subnetwork of the model; each parameter is averaged
only among the ranks that hold it. See README.md and DESIGN.md.
"""
import sys as _sys

from .state import checkpoint

# `import subnet_ext.checkpoint` and `from subnet_ext.checkpoint import save_subnet_checkpoint` find
# the same module as the attribute `subnet_ext.checkpoint` (subnet_ext/state/checkpoint.py).
_sys.modules[f"{__name__}.checkpoint"] = checkpoint
from . import ops
from .ops import reference
from .ops.build_info import build_info
from .comm.collectives import CollectiveError
from .state.consistency import ConsistencyError
from .engine import SubnetDataParallel
from .engine.grad_scaler import GradScaler
from .engine.guard import NonFiniteGuard, TooManySkippedSteps
from .planning.plan import SubnetPlan, Unit, plan_subnetworks
from .ops import (
    masked_linear,
    masked_linear_backward,
    masked_linear_grad_weight_,
    pack_segments,
    segment_table,
    unpack_average_,
)

__version__ = "0.1.0"

__all__ = [
    "SubnetDataParallel",
    "GradScaler",
    "NonFiniteGuard",
    "TooManySkippedSteps",
    "ConsistencyError",
    "CollectiveError",
    "checkpoint",
    "SubnetPlan",
    "Unit",
    "plan_subnetworks",
    "build_info",
    "masked_linear",
    "masked_linear_backward",
    "masked_linear_grad_weight_",
    "pack_segments",
    "segment_table",
    "unpack_average_",
    "ops",
    "reference",
]

"""SDPConfig: how SubnetDataParallel trains, in one frozen, validated object.

    sdp = SubnetDataParallel(model, plan, config=SDPConfig(regime="backward", sync_every=4))
    sdp = SubnetDataParallel(model, plan, regime="backward", sync_every=4)   # the same

The options describe the algorithm (regime, synchronisation, bucketing, deadlines); where
the engine runs (`process_group`, `simulate_rank`) is an argument of SubnetDataParallel
itself, as DDP's `process_group` is. A config is checked when it is made, so a bad value
fails before any model is touched; the checks that need the plan run when the engine is
built (`check_plan`).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..comm.collectives import as_timedelta
from ..planning.buckets import DEFAULT_BUCKET_CAP_MB
from ..planning.costs.comm_costs import DEFAULT_LATENCY_BYTES, STRATEGIES
from ..planning.plan import ReadOnlyDict, SubnetPlan
from ..planning.assignment.schedule import OwnershipSchedule, check_periods
from ..vocabulary import REGIMES

# The engine's deadline for its collectives and for the check that every rank calls a collective
# method (comm/call_check.py), in seconds: subnet-train's --timeout default too. A rank that never
# comes (a collective method under `if rank == 0:`) is an error on every rank after about this
# long, not after the process group's 10 or 30 minutes (tests/comm/test_call_order.py).
DEFAULT_TIMEOUT_S = 300.0
# N of the drift check (state/drift_check.py): the owners' copies are compared every N optimizer
# steps; its cost is measured in bench/results/drift-check-cpu.md.
DEFAULT_DRIFT_CHECK_EVERY = 20
SCALES = ("none", "inverse")
EVAL_FORWARDS = ("subnetwork", "full")  # what a forward in eval mode runs (eval_mode.py)
BUFFER_SYNCS = ("average", "broadcast")  # how owners agree on buffers (comm/buffer_sync.py)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SDPConfig:
    """SubnetDataParallel's options. Frozen: `dataclasses.replace(config, regime="backward")`
    makes a changed copy.

    Attributes:
        regime: "forward" (materialise only the subnetwork) or "backward" (full model,
            owned weight gradients and optimizer state only).
        sync_every: H; 1 averages gradients every step, H > 1 averages parameters every
            H optimizer steps (local SGD within owner groups). Or a period per unit group (DreamDDP):
            {"shared": 1, "units": 4} averages the shared parameters' gradients every step and the
            units' parameters every 4 steps; a key may also be a pattern of unit group paths
            ("transformer.h.*", fnmatch), which takes precedence over "units"; unnamed: 1.
        scale: "inverse" multiplies the input of each neuron group's consumer by h/h_k
            (forward regime, neuron level); "none" does nothing.
        strategy: "auto" (cost model), "groups" (collectives per owner set) or
            "zero_filled" (world all-reduces, zeros where a rank holds nothing).
        latency_bytes: the cost model's price of one collective, in bytes ("auto" only).
        bucket_cap_mb: a bucket (one packed collective) closes at this many MiB.
        overlap: issue each bucket's all-reduce during the backward as soon as its
            gradients are ready (False: all of them when the backward ends; same results).
        timeout: seconds any of the engine's collectives may take before it raises a
            CollectiveError naming the operation and the group, and that rank 0 waits for
            every rank to call a collective method (CallOrderError). Default
            DEFAULT_TIMEOUT_S = 300 s (subnet-train's --timeout); None: the process group's
            own timeout (torch's default: 10 minutes for NCCL, 30 for gloo).
        drift_check_every: N: every N optimizer steps (with periods H > 1, every ceil(N / L) x L
            steps, L their least common multiple: right after everything was averaged) the
            owners of every piece with two or more owners compare a
            checksum of their copies, in one small all-reduce, and a divergence raises
            ConsistencyError on every rank naming the pieces and the likely cause
            (`torch.nn.utils.clip_grad_norm_` over `sdp.parameters()`). Default
            DEFAULT_DRIFT_CHECK_EVERY; 0 or None: never (state/drift_check.py).
        shard_shared: shard the plan's shared parameters over the group with torch's FSDP2
            (gathered per use, gradients reduce-scattered, optimizer state sharded); SDP
            averages only the units. Needs sync_every=1, torch.distributed and no
            simulate_rank.
        eval_forward: what `sdp.eval(); sdp(x)` runs on a rank that does not hold the whole
            model: "subnetwork" (this rank's, as in training; a warning says so once per
            process) or "full" (the assembled model, once per optimizer step: collective,
            every rank evaluates). See eval_mode.py.
        buffer_sync: how the owners of a floating buffer (BatchNorm's running statistics)
            agree: "average" (their mean, with each step's gradients) or "broadcast" (its
            leader's values after each synchronising backward, the values torch DDP's
            broadcast_buffers gives: rank 0's at coverage 1 and for shared buffers). See
            comm/buffer_sync.py.
        reduce_dtype: the dtype gradients travel in (torch.bfloat16, torch.float16, or their
            names), as FSDP2's reduce_dtype: each bucket is divided by its group's size, cast,
            all-reduced and cast back; gradients and their accumulation stay in their own
            dtype. None (the default): the gradients' dtype. The bf16/fp16 comm hooks
            (comm/hooks/cast.py) at that dtype; needs sync_every=1 and shard_shared=False.
    Raises:
        ValueError (when made) naming the option that is out of range, its value and the
        values it takes; TypeError for a numeric option that is not a number (timeout="5").
    """

    regime: str = "forward"
    sync_every: int | Mapping[str, int] = 1
    scale: str = "none"
    strategy: str = "auto"
    latency_bytes: float = DEFAULT_LATENCY_BYTES
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    overlap: bool = True
    timeout: float | None = DEFAULT_TIMEOUT_S
    shard_shared: bool = False
    eval_forward: str = "subnetwork"
    buffer_sync: str = "average"
    reduce_dtype: torch.dtype | str | None = None
    assignment: str = "static"
    reassign_every: int = 0
    assignment_shift: int = 1
    assignment_seed: int = 0
    drift_check_every: int | None = DEFAULT_DRIFT_CHECK_EVERY

    def __post_init__(self):
        if isinstance(self.sync_every, Mapping):
            object.__setattr__(self, "sync_every", _periods(self.sync_every))
        for name in ("latency_bytes", "bucket_cap_mb", "timeout") + (() if self.periodic else ("sync_every",)):
            value = getattr(self, name)
            if not (_is_number(value) or isinstance(value, bool) or (name == "timeout" and value is None)):
                kind = "an int >= 1" if name == "sync_every" else \
                    "a number of seconds (or None)" if name == "timeout" else "a number"
                raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
        if self.regime not in REGIMES:
            raise ValueError(f"regime must be 'forward' or 'backward', got {self.regime!r}")
        if not self.periodic and (not isinstance(self.sync_every, int) or isinstance(self.sync_every, bool)
                                  or self.sync_every < 1):
            raise ValueError(f"sync_every must be an int >= 1, got {self.sync_every!r} (or a period per unit group)")
        if self.scale not in SCALES:
            raise ValueError(f"scale must be 'none' or 'inverse', got {self.scale!r}")
        if self.eval_forward not in EVAL_FORWARDS:
            raise ValueError(f"eval_forward must be 'subnetwork' or 'full', got {self.eval_forward!r}")
        if self.buffer_sync not in BUFFER_SYNCS:
            raise ValueError(f"buffer_sync must be 'average' or 'broadcast', got {self.buffer_sync!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if not (_is_number(self.latency_bytes) and 0 <= self.latency_bytes < math.inf):
            raise ValueError(f"latency_bytes must be a finite number >= 0, got {self.latency_bytes!r}")
        if not (_is_number(self.bucket_cap_mb) and 0 < self.bucket_cap_mb < math.inf):
            raise ValueError(f"bucket_cap_mb must be a positive number, got {self.bucket_cap_mb!r}")
        for name in ("overlap", "shard_shared"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        as_timedelta(self.timeout)  # a positive, finite number of seconds, or None
        every = self.drift_check_every
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 0):
            raise ValueError(f"drift_check_every must be an int >= 0 (0 or None: no check), got {every!r}")
        if self.shard_shared and not self.every_step:
            raise ValueError(f"shard_shared=True averages the shared parameters' gradients every step (FSDP2's "
                             f"reduce-scatter), so it needs sync_every=1, got sync_every={self.sync_every}; use "
                             "shard_shared=False for local SGD")
        object.__setattr__(self, "reduce_dtype", _wire_dtype(self.reduce_dtype))
        if self.reduce_dtype is not None and not self.every_step:
            raise ValueError(f"reduce_dtype={self.reduce_dtype} is the dtype gradients travel in, so it needs "
                             f"sync_every=1, got sync_every={self.sync_every} (which averages the parameters "
                             "themselves, in their own dtype); use reduce_dtype=None for local SGD")
        if self.reduce_dtype is not None and self.shard_shared:
            raise ValueError(f"reduce_dtype={self.reduce_dtype} applies to SDP's buckets, but with shard_shared=True "
                             "FSDP2 reduces the shared parameters' gradients in their own dtype; use one of the two")
        schedule = self.schedule  # OwnershipSchedule checks assignment, reassign_every, shift and seed
        check_periods(schedule, self.longest_period)
        if schedule.moves and self.shard_shared:
            raise ValueError(f"assignment={self.assignment!r} moves units between ranks, which FSDP2's sharding of the "
                             "shared parameters does not follow yet; use shard_shared=False or assignment='static'")

    @property
    def periodic(self) -> bool:
        """True when sync_every gives a period per unit group (a mapping)."""
        return isinstance(self.sync_every, Mapping)

    @property
    def periods(self) -> set:
        """Every synchronisation period in use (those of sync_every's mapping, 1 for what it does not name)."""
        return set(self.sync_every.values()) | {1} if self.periodic else {self.sync_every}

    @property
    def every_step(self) -> bool:
        """True when everything is averaged every step (gradients, not parameters)."""
        return self.periods == {1}

    @property
    def longest_period(self) -> int:
        """The least common multiple of the periods: a step where everything is averaged."""
        return longest_period(self.sync_every)

    def period_of(self, group_path: str | None) -> int:
        """The synchronisation period of a unit group (its module path), or of the shared parameters (None)."""
        if not self.periodic:
            return self.sync_every
        if group_path is None:
            return self.sync_every.get("shared", 1)
        for pattern, period in self.sync_every.items():
            if pattern not in ("shared", "units") and fnmatch.fnmatchcase(group_path, pattern):
                return period
        return self.sync_every.get("units", 1)

    @property
    def schedule(self) -> OwnershipSchedule:
        """The ownership schedule these options describe (planning/assignment/schedule.py)."""
        return OwnershipSchedule(self.assignment, self.reassign_every, self.assignment_shift, self.assignment_seed)

    @property
    def bucket_cap_bytes(self) -> float:
        """bucket_cap_mb in bytes."""
        return self.bucket_cap_mb * 2**20

    def check_plan(self, plan: SubnetPlan) -> None:
        """ValueError unless these options apply to `plan` (scale="inverse" needs a neuron-level
        plan in the forward regime; every group pattern of sync_every names some unit group)."""
        if not isinstance(plan, SubnetPlan):
            raise ValueError(f"plan must be a SubnetPlan, got {type(plan).__name__}")
        for pattern in (self.sync_every if self.periodic else ()):
            if pattern not in ("shared", "units") and not any(fnmatch.fnmatchcase(g.path, pattern) for g in plan.groups):
                raise ValueError(f"sync_every: {pattern!r} matches no unit group of the plan (its groups: "
                                 f"{', '.join(g.path for g in plan.groups[:6])}{', ...' if len(plan.groups) > 6 else ''}"
                                 "); use 'shared', 'units' or a pattern of group paths")
        if self.scale == "inverse" and (plan.level != "neuron" or self.regime != "forward"):
            raise ValueError(f"scale='inverse' applies to the neuron level in the forward regime; this plan is "
                             f"level={plan.level!r} and regime={self.regime!r}")


def longest_period(sync_every) -> int:
    """A step where everything is averaged: sync_every itself (an int, returned unchecked), or the least
    common multiple of a mapping's periods and 1 (what it does not name is averaged every step)."""
    return math.lcm(*sync_every.values(), 1) if isinstance(sync_every, Mapping) else sync_every


def _periods(mapping: Mapping) -> ReadOnlyDict:
    """sync_every's mapping, checked: str keys ('shared', 'units' or group path patterns) to ints >= 1; read-only."""
    out = {}
    for key, period in mapping.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"sync_every: keys are 'shared', 'units' or unit group path patterns, got {key!r}")
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise ValueError(f"sync_every[{key!r}] must be an int >= 1, got {period!r}")
        out[key] = period
    if not out:
        raise ValueError("sync_every: an empty mapping; give an int, or periods such as {'shared': 1, 'units': 4}")
    return ReadOnlyDict(out)


def _wire_dtype(value) -> torch.dtype | None:
    """reduce_dtype as a floating torch.dtype (a name such as "bfloat16" accepted), or None."""
    if value is None or (isinstance(value, torch.dtype) and value.is_floating_point):
        return value
    named = getattr(torch, value, None) if isinstance(value, str) else None
    if isinstance(named, torch.dtype) and named.is_floating_point:
        return named
    raise ValueError(f"reduce_dtype must be a floating torch.dtype (torch.bfloat16, torch.float16, ...) or its name, "
                     f"or None, got {value!r}")


OPTIONS = tuple(f.name for f in dataclasses.fields(SDPConfig))


def config_from(config, options: dict) -> SDPConfig:
    """The engine's SDPConfig: `config`, or one made from keyword `options` (SubnetDataParallel's
    keyword form); TypeError for an unknown option, a config that is not an SDPConfig, or both."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"SubnetDataParallel got unexpected keyword argument(s) {unknown}; its options are "
                        f"SDPConfig's fields {list(OPTIONS)}, and process_group and simulate_rank")
    if config is None:
        return SDPConfig(**options)
    if not isinstance(config, SDPConfig):
        raise TypeError(f"config must be an SDPConfig, got {type(config).__name__} {config!r}; pass the options "
                        "as keywords (regime='backward') or as config=SDPConfig(regime='backward')")
    if options:
        raise TypeError(f"SubnetDataParallel got both config= and the options {sorted(options)}; give them in "
                        f"one place: config=dataclasses.replace(config, {', '.join(f'{k}=...' for k in options)})")
    return config

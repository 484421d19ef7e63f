"""The plan: which rank owns which unit, checked and balanced, identical on every rank.

`plan_subnetworks(model, world_size, coverage, level, seed)` finds the units (see
units.py), gives each unit r = max(1, round(coverage * world_size)) owners and returns a
`SubnetPlan`. Everything is a pure function of (model structure, world_size, coverage,
level, seed), so every rank computes the same plan without talking to the others.

Assignment (assign.py): contiguous rolling chunks at neuron level, every rank getting
a unit of every group whenever r x units >= K; at block level greedy balancing of
bytes and FLOPs together. FLOPs (flops.py) are traced on the meta device from a
`sample_input`; without one they fall back to 2 x parameters, and summary() says so.

The rank graph joins two ranks that share a unit (docs/design.md §1.2): shared parameters do
not count, or every model with a stem would get the complete graph. A plan whose units
leave it disconnected warns (its ranks are tied by the shared parameters only) and is
refused only when no shared parameter ties the ranks either.

Parts:
- Unit: one unit of a plan (its group, index and size);
- ReadOnlyDict: the frozen plan's mappings (picklable, unlike mappingproxy);
- model_fingerprint (from model_units.py): what a plan read from JSON is checked against;
- SubnetPlan: the plan as a value, with its owner queries, costs, JSON and summary;
- plan_subnetworks: the planner (units, owners, checks); plan_from_units: the same from a
  model's units read once (plan_for_memory plans every owner count from them).
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from .assign import assign_blocks, assign_neurons, assign_per_rank
from .plan_json import check_plan_json
from .summary import plan_summary
from .coverage import check_arguments, describe, is_per_rank, owners_per_unit, warn_if_rounded
from .rank_graph import check_ranks_tied, components, rank_graph, spectral_gap
from .plan_costs import FLOAT_DTYPES, plan_costs
from .model_units import ModelUnits, model_fingerprint, model_units  # noqa: F401  (the plan's API)
from .units import UnitGroup
from ..vocabulary import dtype_size


@dataclass(frozen=True)
class Unit:
    """kind: block/neuron/head/channel; group: module path; index: position in the group (None for blocks)."""

    kind: str
    group: str
    index: int | None


class ReadOnlyDict(dict):
    """A dict that refuses to change (TypeError), pickled and copied as one: what a frozen value hands out."""

    def _refuse(self, *args, **kwargs):
        raise TypeError(f"this {type(self).__name__} is read-only (a plan's or a config's, which never change)")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _refuse

    def __reduce__(self):
        return type(self), (dict(self),)


class SubnetPlan:
    """Ownership of every unit by every rank, with its costs and checks.

    Attributes:
        units: list[Unit], in model order.
        groups: list[UnitGroup]; unit_ranges[g] = (first unit, end) of group g in `units`.
        owners: bool tensor [world_size, len(units)].
        owner_count: int64 tensor [len(units)], >= 1 everywhere.
        shared: names of parameters/buffers every rank holds (stem, embeddings, head, norms, ...).
        tensor_shapes / tensor_dtypes: the original model's state-dict entries.
        unit_bytes, unit_flops: float64 tensors [len(units)]; shared_bytes, shared_flops: floats.
            FLOPs are those of one forward of the sample input, traced (flops_source says
            which input), or without one 2 x the parameter count per sample position.
        flops_source: how the FLOPs were counted (str).
    """

    def __init__(self, *, world_size: int, coverage: float, level: str, seed: int, groups: list[UnitGroup],
                 owners: torch.Tensor, shared: list[str], tensor_shapes: dict, tensor_dtypes: dict, param_names,
                 fingerprint: str, flops: dict | None = None, aliases: dict | None = None, unsplit: dict | None = None):
        """A plan from its parts, checked (ValueError naming what is wrong): owners bool
        [world_size, units] over the units of `groups` in order; tensor_shapes / tensor_dtypes /
        param_names: the model's state-dict entries in model order (dtypes by name, "float32"),
        aliases included; flops: {"unit": [units], "shared", "source"} as traced, or None for
        2 x parameters; unsplit: modules left whole that could have been units, {path: why}.
        plan_subnetworks and from_json build it; so may a caller with its own owners. Frozen once made:
        another assignment is another plan (with_owners)."""
        self._param_names = tuple(param_names)
        self._flops = flops
        self.world_size, self.coverage, self.level, self.seed = world_size, coverage, level, seed
        self.groups: tuple = tuple(groups)
        self._owners = owners.detach().clone()
        self.shared: tuple = tuple(shared)
        # Tied weights: an alias is a state-dict name for the same tensor as an earlier name.
        # It gets no pieces, no owners and no communication; exports write it beside its
        # canonical name (state/tied_exports.py). tensor_shapes/dtypes list canonical names only;
        # the whole state dict's order stays in _entries (fingerprint, JSON).
        self.aliases = ReadOnlyDict(dict(aliases or {}))
        self._entries = tuple((k, tuple(v), tensor_dtypes[k]) for k, v in tensor_shapes.items())
        self.tensor_shapes = ReadOnlyDict({k: tuple(v) for k, v in tensor_shapes.items() if k not in self.aliases})
        self.tensor_dtypes = ReadOnlyDict({k: v for k, v in tensor_dtypes.items() if k not in self.aliases})
        self.fingerprint = fingerprint
        self.unsplit = ReadOnlyDict(dict(unsplit or {}))  # modules left whole (shared): summary() lists them
        units, ranges = [], []
        for g in self.groups:
            start = len(units)
            if g.kind == "block":
                units.append(Unit("block", g.path, None))
            else:
                units += [Unit(g.kind, g.path, j) for j in range(g.size)]
            ranges.append((start, len(units)))
        self.units, self.unit_ranges = tuple(units), tuple(ranges)
        for name, value in vars(plan_costs(self.groups, self.unit_ranges, self.tensor_shapes, self.tensor_dtypes,
                                           self.shared, self._param_names, flops)).items():
            if isinstance(value, torch.Tensor):
                value = value.clone()
                value.requires_grad_(False)
            setattr(self, name, value)  # unit_bytes, unit_flops, shared_bytes, ... (plan_costs.PlanCosts)
        self.check()
        self._frozen = True

    def __setattr__(self, name, value):
        if self.__dict__.get("_frozen"):
            raise AttributeError(f"SubnetPlan is immutable: it cannot set {name!r}; another assignment of owners is "
                                 "another plan (plan.with_owners(owners)), another model another plan_subnetworks(...)")
        super().__setattr__(name, value)

    def __delattr__(self, name):
        raise AttributeError(f"SubnetPlan is immutable: it cannot delete {name!r}")

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)  # pickle and copy restore the frozen plan as it was

    @property
    def owners(self) -> torch.Tensor:
        """Bool [world_size, units]: owners[k, u] says whether rank k owns unit u (a copy: the plan never
        changes)."""
        return self._owners.clone()

    def with_owners(self, owners: torch.Tensor) -> "SubnetPlan":
        """The same plan with another owner matrix (bool [world_size, units]), checked: an assignment of
        an ownership schedule (schedule.py). Its checks' warnings were the plan's own to give: not repeated."""
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return self._with_owners(owners)

    def _with_owners(self, owners: torch.Tensor) -> "SubnetPlan":
        return SubnetPlan(world_size=self.world_size, coverage=self.coverage, level=self.level, seed=self.seed,
                          groups=self.groups, owners=owners.clone(), shared=self.shared,
                          tensor_shapes={k: v for k, v, _ in self._entries},
                          tensor_dtypes={k: d for k, _, d in self._entries}, param_names=self._param_names,
                          fingerprint=self.fingerprint, flops=self._flops, aliases=dict(self.aliases),
                          unsplit=dict(self.unsplit))

    # ----------------------------------------------------------------- costs
    def bytes_of(self, name: str, numel: int | None = None) -> int:
        """Bytes of `numel` elements (default: the whole entry) of state-dict entry `name`'s dtype."""
        return (self.numel_of(name) if numel is None else numel) * dtype_size(self.tensor_dtypes[name])

    def is_float(self, name: str) -> bool:
        """True when state-dict entry `name` is floating point (averaged; integers are not)."""
        return self.tensor_dtypes[name] in FLOAT_DTYPES

    @property
    def entries(self) -> list[tuple[str, tuple, str]]:
        """(name, shape, dtype name) of every state-dict entry of the original model, in model
        order, aliases included (tensor_shapes lists canonical names only)."""
        return list(self._entries)

    @property
    def param_names(self) -> set:
        """Names of the original model's parameters (state-dict entries that are not buffers)."""
        return set(self._param_names)

    @property
    def owner_count(self) -> torch.Tensor:
        """int64 [len(units)]: how many ranks own each unit."""
        return self._owners.sum(0)

    @property
    def bytes_per_rank(self) -> torch.Tensor:
        """Parameter bytes each rank holds in the forward regime, float64 [world_size]."""
        return self.shared_bytes + self._owners.double() @ self.unit_bytes

    @property
    def flops_per_rank(self) -> torch.Tensor:
        """FLOPs each rank computes per forward of the sample input, float64 [world_size]
        (shared FLOPs + those of the units it owns; units as flops_source says)."""
        return self.shared_flops + self._owners.double() @ self.unit_flops

    def numel_of(self, name: str) -> int:
        """Elements of state-dict entry `name` in the original model."""
        return math.prod(self.tensor_shapes[name])

    @property
    def total_params(self) -> int:
        """Parameters of the full model (a tied tensor once)."""
        return self.shared_param_count + int(self.unit_params.sum())

    @property
    def params_per_rank(self) -> torch.Tensor:
        """Parameters each rank holds (shared + owned units) in the forward regime, float64 [world_size]."""
        return self.shared_param_count + self._owners.double() @ self.unit_params

    @property
    def held_fraction(self) -> torch.Tensor:
        """params_per_rank / total_params, float64 [world_size]: about the coverage when units dominate."""
        return self.params_per_rank / max(self.total_params, 1)

    @property
    def full_bytes(self) -> float:
        """Parameter bytes of the full model (shared + every unit)."""
        return self.shared_bytes + float(self.unit_bytes.sum())

    def unit_owner_sets(self) -> list[tuple[int, ...]]:
        """[U] the owner set (ascending ranks) of each unit, in unit order. Computed once (the plan
        never changes; the memory model and the pieces ask for it per rank and per candidate)."""
        if "_owner_sets" not in self.__dict__:
            distinct, which = torch.unique(self._owners.t(), dim=0, return_inverse=True)
            sets = [tuple(torch.nonzero(row).flatten().tolist()) for row in distinct]
            self.__dict__["_owner_sets"] = tuple(sets[i] for i in which.tolist())  # a cache, not state
        return list(self.__dict__["_owner_sets"])

    def owner_sets(self) -> list[tuple[int, ...]]:
        """Distinct owner sets of the units, in one canonical order (sorted)."""
        return sorted(set(self.unit_owner_sets()))

    @property
    def owners_per_unit_text(self) -> str:
        """'2 owner(s)/unit', or '1-4 owner(s)/unit' when they vary (a coverage per rank)."""
        lo, hi = int(self.owner_count.min()), int(self.owner_count.max())
        return f"{lo} owner(s)/unit" if lo == hi else f"{lo}-{hi} owner(s)/unit"

    def coverage_of(self, rank: int) -> float:
        """The coverage asked for rank `rank` (the plan's coverage, or its value in a per-rank list)."""
        return self.coverage[rank] if is_per_rank(self.coverage) else self.coverage

    # ----------------------------------------------------------------- checks
    def rank_graph(self) -> np.ndarray:
        """[K, K] float64: the number of units two ranks share (diagonal 0); shared parameters do not count."""
        return rank_graph(self._owners)

    def rank_components(self) -> list[list[int]]:
        """Connected components of the rank graph, each a sorted list of ranks, by smallest rank."""
        return components(self.rank_graph())

    @property
    def spectral_gap(self) -> float:
        """Second-smallest eigenvalue of the rank graph's normalised Laplacian (0 = disconnected)."""
        return spectral_gap(self.rank_graph())

    @property
    def imbalance(self) -> dict:
        """max/mean - 1 of bytes and FLOPs per rank (0 = perfectly balanced)."""
        b, f = self.bytes_per_rank, self.flops_per_rank
        return {"bytes": float(b.max() / b.mean() - 1), "flops": float(f.max() / f.mean() - 1)}

    def check(self) -> None:
        """Raise ValueError naming what is wrong and where."""
        k, u = self._owners.shape
        if k != self.world_size or u != len(self.units) or self._owners.dtype != torch.bool:
            raise ValueError(f"plan owners must be a bool tensor [{self.world_size}, {len(self.units)}], "
                             f"got {self._owners.dtype} {list(self._owners.shape)}")
        unowned = torch.nonzero(self.owner_count == 0).flatten().tolist()
        if unowned:
            raise ValueError(f"plan leaves {len(unowned)} unit(s) without an owner, first {self.units[unowned[0]]}")
        for g, (a, b) in zip(self.groups, self.unit_ranges):
            if g.kind != "block":
                empty = torch.nonzero(~self._owners[:, a:b].any(1)).flatten().tolist()
                if empty:
                    raise ValueError(f"rank(s) {empty} own no unit of {g.kind} group {g.path!r} ({g.size} units, "
                                     f"world size {k}, coverage {describe(self.coverage)}): that layer would be empty. "
                                     "Raise the coverage or use level='block'.")
        components = self.rank_components() if k > 1 else [[0]]
        check_ranks_tied(components, describe(self.coverage), self.owners_per_unit_text, bool(self.shared_params))

    # ----------------------------------------------------------------- output
    def summary(self) -> str:
        """A readable report: parameters per unit, per-rank units, parameters, held fraction of the
        model next to the coverage, bytes, FLOPs; the checks; warnings (summary.py)."""
        return plan_summary(self)

    def to_json(self) -> str:
        """The plan as JSON (format "subnet_ext.plan/1"): groups, owners, shapes, dtypes, FLOPs, ..."""
        return json.dumps({
            "format": "subnet_ext.plan/1", "world_size": self.world_size,
            "coverage": list(self.coverage) if is_per_rank(self.coverage) else self.coverage,
            "level": self.level, "seed": self.seed, "fingerprint": self.fingerprint,
            "groups": [g.to_dict() for g in self.groups], "shared": list(self.shared),
            "owners": self._owners.to(torch.uint8).tolist(),
            "tensor_shapes": {k: list(v) for k, v, _ in self._entries},
            "tensor_dtypes": {k: d for k, _, d in self._entries}, "param_names": sorted(self._param_names),
            "flops": {"unit": self.unit_flops.tolist(), "shared": self.shared_flops, "source": self.flops_source},
            "aliases": dict(self.aliases),
        })

    @staticmethod
    def from_json(text: str) -> "SubnetPlan":
        """Inverse of to_json; raises ValueError on anything malformed."""
        try:
            if not isinstance(text, (str, bytes, bytearray)):
                raise ValueError(f"a plan is read from JSON text, got {type(text).__name__}")
            d = json.loads(text)
            check_plan_json(d)  # types, ranges and cross-field consistency, before anything is built
            owners = torch.tensor(d["owners"], dtype=torch.uint8)
            plan = SubnetPlan(
                world_size=int(d["world_size"]),
                coverage=tuple(map(float, d["coverage"])) if isinstance(d["coverage"], list) else float(d["coverage"]),
                level=str(d["level"]),
                seed=int(d["seed"]), groups=[UnitGroup.from_dict(g) for g in d["groups"]],
                owners=owners.bool(), shared=list(d["shared"]), tensor_shapes=d["tensor_shapes"],
                tensor_dtypes=d["tensor_dtypes"], param_names=d["param_names"], fingerprint=str(d["fingerprint"]),
                flops=d.get("flops"), aliases=d.get("aliases", {}))
            check_arguments(plan.world_size, plan.coverage, plan.level)
            return plan
        except ValueError:
            raise
        except (KeyError, TypeError, AttributeError, IndexError, RuntimeError, OverflowError, RecursionError,
                UnicodeDecodeError) as e:
            raise ValueError(f"malformed plan JSON: {type(e).__name__}: {e}") from None

    def __repr__(self):
        return (f"SubnetPlan(level={self.level!r}, world_size={self.world_size}, coverage={describe(self.coverage)}, "
                f"units={len(self.units)}, groups={len(self.groups)})")


def _assign(level, k, r, groups, ranges, flops, block_assignment="balanced", coverage=None, **tensors) -> torch.Tensor:
    """Owner matrix bool [k, units] before the seed's relabelling, balanced on the units' costs (or, for a
    coverage per rank, windows of each rank's share: assign_per_rank).

    tensors: shapes, dtypes, shared, param_names of the model (what plan_costs reads).
    """
    if is_per_rank(coverage):
        return assign_per_rank(ranges if level == "neuron" else [(0, ranges[-1][1])], k, coverage)
    costs = plan_costs(groups, ranges, tensors["shapes"], tensors["dtypes"], tensors["shared"],
                       tensors["param_names"], flops)
    if level == "block":
        return assign_blocks(costs.unit_bytes, costs.unit_flops, k, r, block_assignment)
    weight = torch.zeros(ranges[-1][1], dtype=torch.float64)
    for cost in (costs.unit_bytes, costs.unit_flops):
        if float(cost.sum()) > 0:
            weight += cost / cost.sum()  # bytes and FLOPs each as a share of the model's, summed
    return assign_neurons(ranges, k, r, weight)


def _unit_ranges(groups) -> list[tuple[int, int]]:
    """(first unit, end) of each group in the plan's unit numbering."""
    ranges, start = [], 0
    for g in groups:
        ranges.append((start, start + g.size))
        start += g.size
    return ranges


def plan_subnetworks(model: nn.Module, world_size: int, coverage: float, level: str = "block", seed: int = 0,
                     blocks=None, neuron_groups=None, sample_input=None, block_assignment="balanced") -> SubnetPlan:
    """Plan which rank trains which part of `model`.

    Args:
        model: the full model (may live on the meta device: only structure is read).
        world_size: K, the number of ranks.
        coverage: C in (0, 1]; each unit gets r = max(1, round(C*K)) owners (halves up): the
            effective coverage is r/K, and a warning says when it is not C. Or one value per
            rank ([1.0, 0.5, 0.5, 0.25]: ranks with unequal memory): rank k owns about c_k of each
            group's units in a window (assign.assign_per_rank), owner counts then vary by unit.
        level: "block" (residual branches) or "neuron" (neurons, heads, channels).
        seed: relabels the ranks by a seeded permutation (0 = identity).
        blocks, neuron_groups: residual blocks' module paths, (producer, consumer[, norms]) paths: declarations.
        sample_input: one input batch, a tensor or (shape, dtype), e.g. ((1, 3, 32, 32), torch.float32)
            or ((1, seq_len), torch.long): FLOPs are traced from one forward of it on the meta device
            (nothing allocated). Without it FLOPs are 2 x parameters, which ignores a convolution's
            spatial size.
        block_assignment: block level: "balanced" (owner windows balanced by bytes and FLOPs) or "contiguous" (each rank
            trains runs of neighbouring blocks); see assign.py.

    Raises:
        TypeError: a world size, coverage or seed of the wrong type (coverage="0.5").
        ValueError: bad arguments, no unit at that level, or a plan that fails its checks.
    """
    # why one function: the planner's steps in order (units, owners, costs, checks), each a call
    check_arguments(world_size, coverage, level, seed)
    return _plan(model_units(model, level, blocks, neuron_groups, sample_input), world_size, coverage, seed,
                 block_assignment)


def plan_from_units(units: ModelUnits, world_size: int, coverage, seed: int = 0,
                    block_assignment="balanced") -> SubnetPlan:
    """The plan plan_subnetworks(model, world_size, coverage, units.level, seed, ...) makes, from
    model_units(model, ...): the same plan, bit for bit, without reading the model again."""
    check_arguments(world_size, coverage, units.level, seed)
    return _plan(units, world_size, coverage, seed, block_assignment)


def _plan(units: ModelUnits, world_size: int, coverage, seed: int, block_assignment: str) -> SubnetPlan:
    # Called by both public functions, so that warnings name their caller's line (stacklevels).
    k = world_size
    r = None if is_per_rank(coverage) else owners_per_unit(world_size, coverage)
    if r is not None:
        warn_if_rounded(coverage, k, r)
    groups = list(units.groups)  # frozen dataclasses: shared between the plans of one ModelUnits
    owners = _assign(units.level, k, r, groups, _unit_ranges(groups), units.flops, block_assignment, coverage,
                     shapes=units.shapes, dtypes=units.dtypes, shared=units.shared, param_names=units.param_names)
    if seed:
        perm = list(range(k))
        random.Random(seed).shuffle(perm)
        owners = owners[torch.tensor(perm)]
    coverage = tuple(float(c) for c in coverage) if is_per_rank(coverage) else float(coverage)
    return SubnetPlan(world_size=k, coverage=coverage, level=units.level, seed=seed, groups=groups, owners=owners,
                      shared=list(units.shared), tensor_shapes=dict(units.shapes), tensor_dtypes=dict(units.dtypes),
                      param_names=list(units.param_names), fingerprint=units.fingerprint, flops=units.flops,
                      aliases=dict(units.aliases), unsplit=dict(units.unsplit))

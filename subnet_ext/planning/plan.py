"""The plan: which rank owns which unit, checked and balanced, identical on every rank.

`plan_subnetworks(model, world_size, coverage, level, seed)` finds the units (see
units.py), gives each unit r = max(1, round(coverage * world_size)) owners and returns a
`SubnetPlan`. Everything is a pure function of (model structure, world_size, coverage,
level, seed), so every rank computes the same plan without talking to the others.

Assignment (DESIGN.md §1):
- neuron level, equal units: the n units of a group are cut into world_size contiguous
  chunks; chunk i is owned by ranks i+o, ..., i+o+r-1 (mod K), where the offset o rolls
  from group to group so the larger chunks spread over the ranks. Contiguous chunks keep
  the number of distinct owner sets at most K and the packed segments long.
- block level, unequal blocks: largest first, each to the r least-loaded ranks (bytes).
"""
from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from .plan_json import check_plan_json
from .aliases import find_aliases
from .units import UnitGroup, check_no_chained, find_blocks, find_neuron_groups, slice_numel

LEVELS = ("block", "neuron")


@dataclass(frozen=True)
class Unit:
    """kind: block/neuron/head/channel; group: module path; index: position in the group (None for blocks)."""

    kind: str
    group: str
    index: int | None


def model_fingerprint(model: nn.Module) -> str:
    """Hash of the names, shapes and dtypes of every state-dict entry (structure, not values)."""
    h = hashlib.sha256()
    for name, t in model.state_dict(keep_vars=True).items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


def owners_per_unit(world_size: int, coverage: float) -> int:
    """r = max(1, round(C*K)), rounding halves up (not Python's banker's rounding)."""
    return max(1, min(world_size, int(math.floor(coverage * world_size + 0.5))))


def _check_args(world_size, coverage, level):
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(coverage, (int, float)) or isinstance(coverage, bool) or not (0.0 < coverage <= 1.0):
        raise ValueError(f"coverage must be in (0, 1], got {coverage!r}")
    if level not in LEVELS:
        raise ValueError(f"level must be 'block' or 'neuron', got {level!r}")


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
            FLOPs are per sample position: 2 x the unit's parameter count (its matmul cost).
    """

    def __init__(self, *, world_size, coverage, level, seed, groups, owners, shared, tensor_shapes,
                 tensor_dtypes, fingerprint, aliases=None):
        self.world_size, self.coverage, self.level, self.seed = world_size, coverage, level, seed
        self.groups: list[UnitGroup] = groups
        self.owners = owners
        self.shared: list[str] = shared
        # Tied weights: an alias is a state-dict name for the same tensor as an earlier name.
        # It gets no pieces, no owners and no communication; exports write it beside its
        # canonical name (state/aliases.py). tensor_shapes/dtypes list canonical names only;
        # the whole state dict's order stays in _entries (fingerprint, JSON).
        self.aliases: dict = dict(aliases or {})
        self._entries = [(k, tuple(v), tensor_dtypes[k]) for k, v in tensor_shapes.items()]
        self.tensor_shapes: dict = {k: tuple(v) for k, v in tensor_shapes.items() if k not in self.aliases}
        self.tensor_dtypes: dict = {k: v for k, v in tensor_dtypes.items() if k not in self.aliases}
        self.fingerprint = fingerprint
        self.units, self.unit_ranges = [], []
        for g in groups:
            start = len(self.units)
            if g.kind == "block":
                self.units.append(Unit("block", g.path, None))
            else:
                self.units += [Unit(g.kind, g.path, j) for j in range(g.size)]
            self.unit_ranges.append((start, len(self.units)))
        self._costs()
        self.check()

    # ----------------------------------------------------------------- costs
    def _bytes_of(self, name, numel):
        return numel * torch.empty((), dtype=_dtype(self.tensor_dtypes[name])).element_size()

    def _costs(self):
        ub = np.zeros(len(self.units))
        ubuf = np.zeros(len(self.units))
        uparams = np.zeros(len(self.units))
        for g, (a, b) in zip(self.groups, self.unit_ranges):
            if g.kind == "block":
                n = sum(math.prod(self.tensor_shapes[p]) for p in g.params)
                ub[a] = sum(self._bytes_of(p, math.prod(self.tensor_shapes[p])) for p in g.params)
                ubuf[a] = sum(self._bytes_of(p, math.prod(self.tensor_shapes[p])) for p in g.buffers
                              if self.is_float(p))
                uparams[a] = n
            else:
                for m in g.members:
                    numel = slice_numel(self.tensor_shapes[m.name], m)
                    if not m.buffer:
                        ub[a:b] += self._bytes_of(m.name, numel)
                        uparams[a:b] += numel
                    elif self.is_float(m.name):
                        ubuf[a:b] += self._bytes_of(m.name, numel)
        self.unit_bytes = torch.from_numpy(ub)
        self.unit_buffer_bytes = torch.from_numpy(ubuf)
        self.shared_buffer_bytes = float(sum(self._bytes_of(n, math.prod(self.tensor_shapes[n])) for n in self.shared
                                             if n not in self.param_names and self.is_float(n)))
        self.unit_flops = torch.from_numpy(2.0 * uparams)
        self.shared_params = [n for n in self.shared if n in self.param_names]
        self.shared_bytes = float(sum(self._bytes_of(n, math.prod(self.tensor_shapes[n])) for n in self.shared_params))
        self.shared_flops = 2.0 * sum(math.prod(self.tensor_shapes[n]) for n in self.shared_params)

    def is_float(self, name: str) -> bool:
        return self.tensor_dtypes[name] in ("float32", "float64", "float16", "bfloat16")

    @property
    def param_names(self) -> set:
        return set(self._param_names)

    @property
    def owner_count(self) -> torch.Tensor:
        return self.owners.sum(0)

    @property
    def bytes_per_rank(self) -> torch.Tensor:
        """Parameter bytes each rank holds in the forward regime, float64 [world_size]."""
        return self.shared_bytes + self.owners.double() @ self.unit_bytes

    @property
    def flops_per_rank(self) -> torch.Tensor:
        return self.shared_flops + self.owners.double() @ self.unit_flops

    @property
    def full_bytes(self) -> float:
        return self.shared_bytes + float(self.unit_bytes.sum())

    def owner_sets(self) -> list[tuple[int, ...]]:
        """Distinct owner sets of the units, in one canonical order (sorted)."""
        return sorted({tuple(torch.nonzero(self.owners[:, u]).flatten().tolist()) for u in range(len(self.units))})

    # ----------------------------------------------------------------- checks
    def rank_graph(self) -> np.ndarray:
        """[K, K] weights: units two ranks share, plus 1 where both hold the shared parameters."""
        m = self.owners.double().numpy()
        adj = m @ m.T
        if self.shared_params:
            adj += 1.0
        np.fill_diagonal(adj, 0.0)
        return adj

    @property
    def spectral_gap(self) -> float:
        """Second-smallest eigenvalue of the rank graph's normalised Laplacian (0 = disconnected)."""
        k = self.world_size
        if k == 1:
            return 1.0
        adj = self.rank_graph()
        deg = adj.sum(1)
        with np.errstate(divide="ignore"):
            inv = np.where(deg > 0, 1.0 / np.sqrt(deg), 0.0)
        lap = np.eye(k) - inv[:, None] * adj * inv[None, :]
        return float(np.sort(np.linalg.eigvalsh(lap))[1])

    @property
    def imbalance(self) -> dict:
        """max/mean - 1 of bytes and FLOPs per rank (0 = perfectly balanced)."""
        b, f = self.bytes_per_rank, self.flops_per_rank
        return {"bytes": float(b.max() / b.mean() - 1), "flops": float(f.max() / f.mean() - 1)}

    def check(self) -> None:
        """Raise ValueError naming what is wrong and where."""
        k, u = self.owners.shape
        if k != self.world_size or u != len(self.units) or self.owners.dtype != torch.bool:
            raise ValueError(f"plan owners must be a bool tensor [{self.world_size}, {len(self.units)}], "
                             f"got {self.owners.dtype} {list(self.owners.shape)}")
        unowned = torch.nonzero(self.owner_count == 0).flatten().tolist()
        if unowned:
            raise ValueError(f"plan leaves {len(unowned)} unit(s) without an owner, first {self.units[unowned[0]]}")
        for g, (a, b) in zip(self.groups, self.unit_ranges):
            if g.kind != "block":
                empty = torch.nonzero(~self.owners[:, a:b].any(1)).flatten().tolist()
                if empty:
                    raise ValueError(f"rank(s) {empty} own no unit of {g.kind} group {g.path!r} ({g.size} units, "
                                     f"world size {k}, coverage {self.coverage}): that layer would be empty. "
                                     "Raise the coverage or use level='block'.")
        if k > 1:
            adj = self.rank_graph()
            seen, todo = {0}, [0]
            while todo:
                i = todo.pop()
                for j in np.nonzero(adj[i])[0].tolist():
                    if j not in seen:
                        seen.add(j)
                        todo.append(j)
            if len(seen) < k:
                raise ValueError(f"the rank graph is disconnected: ranks {sorted(set(range(k)) - seen)} share no "
                                 f"unit and no parameter with rank 0, so their models never mix. Raise the "
                                 f"coverage (now {self.coverage}) or keep some parameters shared.")

    # ----------------------------------------------------------------- output
    def summary(self) -> str:
        """A readable table: per-rank units, parameters, bytes, FLOPs; the checks."""
        k, full = self.world_size, self.full_bytes
        lines = [f"SubnetPlan: {len(self.units)} {self.level}-level units in {len(self.groups)} group(s), "
                 f"world size {k}, coverage {self.coverage} ({owners_per_unit(k, self.coverage)} owner(s)/unit), "
                 f"seed {self.seed}",
                 f"shared: {len(self.shared_params)} parameter tensors, {self.shared_bytes / 2**20:.2f} MiB; "
                 f"full model {full / 2**20:.2f} MiB",
                 "", "| rank | units | param MiB | vs full | GFLOP/pos |", "|---:|---:|---:|---:|---:|"]
        for r in range(k):
            b, f = float(self.bytes_per_rank[r]), float(self.flops_per_rank[r])
            lines.append(f"| {r} | {int(self.owners[r].sum())} | {b / 2**20:.2f} | {b / full:.1%} | {f / 1e9:.4f} |")
        imb = self.imbalance
        lines += ["", f"checks: every unit owned (min owners {int(self.owner_count.min())}), "
                      f"rank graph connected (spectral gap {self.spectral_gap:.3f}), "
                      f"imbalance bytes {imb['bytes']:.1%} flops {imb['flops']:.1%}, "
                      f"{len(self.owner_sets())} distinct owner set(s)"]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({
            "format": "subnet_ext.plan/1", "world_size": self.world_size, "coverage": self.coverage,
            "level": self.level, "seed": self.seed, "fingerprint": self.fingerprint,
            "groups": [g.to_dict() for g in self.groups], "shared": self.shared,
            "owners": self.owners.to(torch.uint8).tolist(),
            "tensor_shapes": {k: list(v) for k, v, _ in self._entries},
            "tensor_dtypes": {k: d for k, _, d in self._entries}, "param_names": sorted(self._param_names),
            "aliases": self.aliases,
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
            plan = SubnetPlan.__new__(SubnetPlan)
            plan._param_names = list(d["param_names"])
            SubnetPlan.__init__(
                plan, world_size=int(d["world_size"]), coverage=float(d["coverage"]), level=str(d["level"]),
                seed=int(d["seed"]), groups=[UnitGroup.from_dict(g) for g in d["groups"]],
                owners=owners.bool(), shared=list(d["shared"]), tensor_shapes=d["tensor_shapes"],
                tensor_dtypes=d["tensor_dtypes"], fingerprint=str(d["fingerprint"]), aliases=d.get("aliases", {}))
            _check_args(plan.world_size, plan.coverage, plan.level)
            return plan
        except ValueError:
            raise
        except (KeyError, TypeError, AttributeError, IndexError, RuntimeError, OverflowError, RecursionError,
                UnicodeDecodeError) as e:
            raise ValueError(f"malformed plan JSON: {type(e).__name__}: {e}") from None

    def __repr__(self):
        return (f"SubnetPlan(level={self.level!r}, world_size={self.world_size}, coverage={self.coverage}, "
                f"units={len(self.units)}, groups={len(self.groups)})")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


def _assign_neurons(groups, ranges, k, r, n_units):
    owners = torch.zeros(k, n_units, dtype=torch.bool)
    offset = 0
    for g, (a, b) in zip(groups, ranges):
        n = b - a
        sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
        bounds = np.cumsum([0] + sizes)
        for i in range(k):
            for t in range(r):
                owners[(i + offset + t) % k, a + bounds[i]: a + bounds[i + 1]] = True
        offset = (offset + n % k) % k  # roll, so the larger chunks of the next group land elsewhere
    return owners


def _assign_blocks(unit_bytes, k, r):
    owners = torch.zeros(k, len(unit_bytes), dtype=torch.bool)
    if len(unit_bytes) and bool((unit_bytes == unit_bytes[0]).all()):
        # Equal blocks: rolling windows, so consecutive blocks overlap in owners and the
        # rank graph mixes well (greedy would pair the same ranks again and again).
        for u in range(len(unit_bytes)):
            start = u * r % k + (u * r // k if k % r == 0 else 0)  # shift each wrap when tiles repeat
            for t in range(r):
                owners[(start + t) % k, u] = True
        return owners
    load = np.zeros(k)
    order = sorted(range(len(unit_bytes)), key=lambda u: (-float(unit_bytes[u]), u))
    for u in order:
        ranks = sorted(range(k), key=lambda q: (load[q], q))[:r]
        for q in ranks:
            owners[q, u] = True
            load[q] += float(unit_bytes[u])
    return owners


def plan_subnetworks(model: nn.Module, world_size: int, coverage: float, level: str = "block", seed: int = 0,
                     blocks=None, neuron_groups=None) -> SubnetPlan:
    """Plan which rank trains which part of `model`.

    Args:
        model: the full model (may live on the meta device: only structure is read).
        world_size: K, the number of ranks.
        coverage: C in (0, 1]; each unit gets max(1, round(C*K)) owners.
        level: "block" (residual branches) or "neuron" (neurons, heads, channels).
        seed: relabels the ranks by a seeded permutation (0 = identity).
        blocks: module paths of residual blocks, for architectures not recognised.
        neuron_groups: (producer, consumer[, norms]) module paths, likewise.

    Raises:
        ValueError: bad arguments, no unit at that level, or a plan that fails its checks.
    """
    _check_args(world_size, coverage, level)
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    groups = find_blocks(model, blocks) if level == "block" else find_neuron_groups(model, neuron_groups)
    if not groups:
        hint = "blocks=[...]" if level == "block" else "neuron_groups=[(producer, consumer), ...]"
        raise ValueError(f"{type(model).__name__} has no {level}-level unit the planner recognises; "
                         f"declare them with {hint}")
    check_no_chained(groups)
    sd = model.state_dict(keep_vars=True)
    in_units = {m.name for g in groups for m in g.members} | {n for g in groups for n in g.params + g.buffers}
    aliases = find_aliases(model, groups)
    in_units -= set(aliases)  # a block's own tied pair: the canonical name carries it
    for g in groups:
        g.params = [n for n in g.params if n not in aliases]
        g.buffers = [n for n in g.buffers if n not in aliases]
    shared = [n for n in sd if n not in in_units and n not in aliases]
    shapes = {n: tuple(t.shape) for n, t in sd.items()}
    dtypes = {n: str(t.dtype).replace("torch.", "") for n, t in sd.items()}
    k, r = world_size, owners_per_unit(world_size, coverage)

    plan = SubnetPlan.__new__(SubnetPlan)
    plan._param_names = [n for n, _ in model.named_parameters()]
    ranges, start = [], 0
    for g in groups:
        ranges.append((start, start + g.size))
        start += g.size
    if level == "neuron":
        owners = _assign_neurons(groups, ranges, k, r, start)
    else:
        tmp = SubnetPlan.__new__(SubnetPlan)
        tmp.__dict__.update(groups=groups, tensor_shapes=shapes, tensor_dtypes=dtypes, shared=shared,
                            _param_names=plan._param_names, units=[Unit("block", g.path, None) for g in groups],
                            unit_ranges=ranges)
        tmp._costs()
        owners = _assign_blocks(tmp.unit_bytes, k, r)
    if seed:
        perm = list(range(k))
        random.Random(seed).shuffle(perm)
        owners = owners[torch.tensor(perm)]
    SubnetPlan.__init__(plan, world_size=k, coverage=float(coverage), level=level, seed=seed, groups=groups,
                        owners=owners, shared=shared, tensor_shapes=shapes, tensor_dtypes=dtypes,
                        fingerprint=model_fingerprint(model), aliases=aliases)
    return plan

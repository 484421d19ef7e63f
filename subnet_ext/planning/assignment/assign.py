"""Who owns what: the owner matrix from unit sizes, r owners per unit (docs/design.md §1.2).

Neuron level (equal units within a group, n units, K ranks, r owners):
- n >= K: the group is cut into K contiguous chunks with Bresenham bounds
  floor(i*n/K) (sizes differ by at most 1 and the larger ones are spread out); chunk
  i is owned by ranks i, ..., i+r-1 (mod K).
- n < K: unit j is owned by ranks s_j, ..., s_j+r-1 (mod K) with s_j = floor(j*K/n).
Guarantee, for r <= K: every unit has exactly r owners, and in every group each rank
owns a cyclically contiguous run of floor(r*n/K) or ceil(r*n/K) units — so at least
one unit whenever r*n >= K, and exactly r*n/K when K divides r*n. (Either way a rank
owns the units whose window positions fall in an interval of length r*n/K.) At most
K distinct owner sets per group. The whole group is then rotated by the offset that
keeps the running per-rank load (bytes and FLOPs) lowest, so ranks that got the extra
unit in one group do not get it again in the next.

Block level (`block_assignment="balanced"`, the default): equal blocks (in bytes and FLOPs)
get rolling windows of r ranks; unequal blocks go largest first to the r least-loaded ranks, the load being bytes and FLOPs
each normalised by its total and summed. Greedy balancing tends to pair the same
ranks again and again (at K=4, r=2 the ResNet-18 blocks fall into {0,1} and {2,3}), so
while the rank graph (ranks sharing a block) is disconnected, two blocks in different
components swap one owner each — the swap that keeps the largest load lowest.
`block_assignment="contiguous"` gives each rank runs of neighbouring blocks instead: the
neuron level's pattern over the blocks in model order (rank q owns the cyclic window of
chunks q, ..., q+r-1), so every pair of adjacent blocks but one wrap is trained together
by some rank; balanced by block count, not by bytes. `block_pairs_covered` counts what a
plan trains together.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ...vocabulary import BLOCK_ASSIGNMENTS


def _group_pattern(n: int, k: int, r: int) -> np.ndarray:
    """Bool [k, n]: the owners of one group of n equal units before rotation."""
    owners = np.zeros((k, n), dtype=bool)
    if n >= k:
        bounds = [i * n // k for i in range(k + 1)]
        for i in range(k):
            for t in range(r):
                owners[(i + t) % k, bounds[i]:bounds[i + 1]] = True
    else:
        for j in range(n):
            for t in range(r):
                owners[(j * k // n + t) % k, j] = True
    return owners


def assign_neurons(ranges, k: int, r: int, unit_weight: torch.Tensor) -> torch.Tensor:
    """Owner matrix bool [k, units] for neuron groups.

    ranges: per group (first unit, end) in plan order. unit_weight: float64 [units], the
    load one unit adds to a rank (normalised bytes + FLOPs); equal within a group.
    """
    if not 1 <= r <= k:
        raise ValueError(f"owners per unit must be in [1, world size {k}], got {r}")
    n_units = ranges[-1][1] if ranges else 0
    owners = torch.zeros(k, n_units, dtype=torch.bool)
    weight = unit_weight.double().numpy()
    load = np.zeros(k)
    for a, b in ranges:
        pattern = _group_pattern(b - a, k, r)
        added = pattern.astype(np.float64) @ weight[a:b]
        scale = max(float(load.max() + added.max()), 1e-300)
        # ties (to 1e-9 of the load) go to the smallest rotation, so equal groups stay unrotated
        best = min(range(k), key=lambda o: (round(float((load + np.roll(added, o)).max()) / scale, 9), o))
        pattern = np.roll(pattern, best, axis=0)
        load += np.roll(added, best)
        owners[:, a:b] = torch.from_numpy(pattern)
    return owners


def assign_per_rank(ranges, k: int, coverage) -> torch.Tensor:
    """Owner matrix bool [k, units] for a coverage per rank (coverage.py): in each group of n units (a
    neuron group, or all the blocks as one group), rank q owns a cyclically contiguous window of
    max(1, round(c_q * n)) units starting where rank q - 1's ended, so the windows cover the group
    whenever the counts sum to n or more (every unit at least one owner; a rank never an empty layer).

    ValueError when a group's counts do not cover it (too few units to round the coverages up)."""
    n_units = ranges[-1][1] if ranges else 0
    owners = torch.zeros(k, n_units, dtype=torch.bool)
    for a, b in ranges:
        n = b - a
        counts = [min(n, max(1, int(math.floor(c * n + 0.5)))) for c in coverage]
        if sum(counts) < n:
            raise ValueError(f"coverages per rank {list(coverage)} give the ranks {counts} of a group of {n} units, "
                             f"which leaves {n - sum(counts)} without an owner; raise the coverages")
        start = 0
        for q, count in enumerate(counts):
            for j in range(start, start + count):
                owners[q, a + j % n] = True
            start = (start + count) % n
    return owners




def assign_blocks(unit_bytes: torch.Tensor, unit_flops: torch.Tensor, k: int, r: int,
                  kind: str = "balanced") -> torch.Tensor:
    """Owner matrix bool [k, blocks] from each block's bytes and FLOPs (float64 [blocks]);
    kind: "balanced" (windows of owners balanced by bytes and FLOPs) or "contiguous" (runs of
    neighbouring blocks)."""
    if kind == "rolling":
        raise ValueError("block_assignment='rolling' is now called 'balanced' (the static pattern of the default "
                         "plan); the schedule that rolls each rank's blocks during training is "
                         "SubnetDataParallel(..., assignment='rolling', reassign_every=N)")
    if kind not in BLOCK_ASSIGNMENTS:
        raise ValueError(f"block_assignment must be one of {', '.join(BLOCK_ASSIGNMENTS)}, got {kind!r}")
    n = len(unit_bytes)
    if kind == "contiguous":
        # the pattern gives chunk i to ranks i..i+r-1; rolled so that rank q holds chunks q..q+r-1
        return torch.from_numpy(np.roll(_group_pattern(n, k, r), 1 - r, axis=0).copy())
    owners = torch.zeros(k, n, dtype=torch.bool)
    equal = n and bool((unit_bytes == unit_bytes[0]).all()) and bool((unit_flops == unit_flops[0]).all())
    if equal:
        # Equal blocks: rolling windows, so consecutive blocks overlap in owners and the
        # rank graph mixes well (greedy would pair the same ranks again and again).
        for u in range(n):
            start = u * r % k + (u * r // k if k % r == 0 else 0)  # shift each wrap when tiles repeat
            for t in range(r):
                owners[(start + t) % k, u] = True
        return owners
    weight = np.zeros(n)
    for cost in (unit_bytes, unit_flops):
        total = float(cost.sum())
        if total > 0:
            weight += cost.double().numpy() / total
    load = np.zeros(k)
    for u in sorted(range(n), key=lambda u: (-weight[u], u)):
        for q in sorted(range(k), key=lambda q: (load[q], q))[:r]:
            owners[q, u] = True
            load[q] += weight[u]
    if r >= 2:
        _join_components(owners, weight, load)
    return owners


def _component_labels(owners: torch.Tensor) -> list[int]:
    """Per rank, the smallest rank of its component in the graph of ranks sharing a unit."""
    k = owners.shape[0]
    label = list(range(k))

    def find(q):
        while label[q] != q:
            q = label[q]
        return q

    for u in range(owners.shape[1]):
        ranks = torch.nonzero(owners[:, u]).flatten().tolist()
        for q in ranks[1:]:
            a, b = find(ranks[0]), find(q)
            label[max(a, b)] = min(a, b)
    return [find(q) for q in range(k)]


def _join_components(owners: torch.Tensor, weight: np.ndarray, load: np.ndarray) -> None:
    """Swap owners between blocks of different components until connected (in place).

    Swapping owner a of block u (owners A) with owner b of block v (owners B) puts b
    beside A - {a} and a beside B - {b}: with r >= 2 both blocks then join the two
    components. Each round takes the swap with the lowest resulting maximum load
    (ties: first in (u, v, a, b) order), so the plan stays deterministic.
    """
    n = owners.shape[1]
    sets = [torch.nonzero(owners[:, u]).flatten().tolist() for u in range(n)]
    for _ in range(owners.shape[0]):  # each swap merges two components
        label = _component_labels(owners)
        if len(set(label)) == 1:
            return
        best = None
        for u in range(n):
            for v in range(u + 1, n):
                if label[sets[u][0]] == label[sets[v][0]]:
                    continue
                for a in sets[u]:
                    for b in sets[v]:
                        new = load.copy()
                        new[a] += weight[v] - weight[u]
                        new[b] += weight[u] - weight[v]
                        key = (round(float(new.max()), 12), u, v, a, b)
                        best = key if best is None or key < best else best
        if best is None:
            return
        _, u, v, a, b = best
        owners[a, u], owners[b, u], owners[b, v], owners[a, v] = False, True, False, True
        load[a] += weight[v] - weight[u]
        load[b] += weight[u] - weight[v]
        sets[u] = torch.nonzero(owners[:, u]).flatten().tolist()
        sets[v] = torch.nonzero(owners[:, v]).flatten().tolist()


def block_pairs_covered(owners: torch.Tensor) -> dict:
    """What a block-level owner matrix (bool [K, blocks], blocks in model order) trains together:
    {"adjacent": pairs (u, u+1) some rank holds both of, "adjacent_total": blocks - 1,
    "pairs": unordered pairs some rank holds both of, "pairs_total": blocks x (blocks - 1) / 2,
    "per_rank": [sorted block indices held by rank q]}."""
    n = owners.shape[1]
    held = [set(torch.nonzero(owners[q]).flatten().tolist()) for q in range(owners.shape[0])]
    together = {(u, v) for h in held for u in h for v in h if u < v}
    return {"adjacent": sum((u, u + 1) in together for u in range(n - 1)), "adjacent_total": max(0, n - 1),
            "pairs": len(together), "pairs_total": n * (n - 1) // 2, "per_rank": [sorted(h) for h in held]}

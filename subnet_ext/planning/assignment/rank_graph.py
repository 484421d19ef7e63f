"""The rank graph: ranks are adjacent when they share a unit (docs/design.md §1.2).

Shared parameters do not count: every rank holds them, so counting them would make
every graph complete and the connectivity check meaningless. The spectral gap (second-
smallest eigenvalue of the normalised Laplacian) measures how well the subnetworks mix.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.distributed as dist


def rank_graph(owners: torch.Tensor) -> np.ndarray:
    """[K, K] float64 from the bool owner matrix [K, U]: units two ranks share, diagonal 0."""
    m = owners.double().numpy()
    adj = m @ m.T
    np.fill_diagonal(adj, 0.0)
    return adj


def components(adj: np.ndarray) -> list[list[int]]:
    """Connected components of a [K, K] adjacency, each a sorted list of ranks, by smallest rank."""
    left, out = set(range(adj.shape[0])), []
    while left:
        seen, todo = {min(left)}, [min(left)]
        while todo:
            i = todo.pop()
            for j in np.nonzero(adj[i])[0].tolist():
                if j not in seen:
                    seen.add(j)
                    todo.append(j)
        out.append(sorted(seen))
        left -= seen
    return out


def spectral_gap(adj: np.ndarray) -> float:
    """Second-smallest eigenvalue of the normalised Laplacian of a [K, K] adjacency (0 = disconnected).

    Chung's convention: an isolated rank's diagonal entry is 0, so every component,
    isolated ranks included, contributes one zero eigenvalue. One rank: 1.0.
    """
    k = adj.shape[0]
    if k == 1:
        return 1.0
    deg = adj.sum(1)
    with np.errstate(divide="ignore"):
        inv = np.where(deg > 0, 1.0 / np.sqrt(deg), 0.0)
    lap = np.diag((deg > 0).astype(np.float64)) - inv[:, None] * adj * inv[None, :]
    return max(0.0, float(np.sort(np.linalg.eigvalsh(lap))[1]))


def on_first_rank() -> bool:
    """True unless torch.distributed is initialised and this process is not rank 0 of the
    default group: every rank builds the same plan, and a warning about it is said once."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def check_ranks_tied(parts: list[list[int]], coverage: str, owners_per_unit: str, has_shared: bool) -> None:
    """Refuse a rank graph split into `parts` (components) when no shared parameter ties them
    either; warn (once across ranks) when only the shared parameters do."""
    if len(parts) <= 1:
        return
    k = sum(len(p) for p in parts)
    apart = sorted(set(range(k)) - set(parts[0]))
    if not has_shared:
        raise ValueError(f"the rank graph is disconnected: ranks {apart} share no unit with rank 0 and no "
                         f"parameter is shared, so their models never mix (components {parts}). "
                         f"Raise the coverage (now {coverage}) or keep some parameters shared.")
    # Every rank builds the plan; one says it. stacklevel: here < SubnetPlan.check < __init__ < plan._plan
    # < plan_subnetworks (or plan_from_units) < its caller.
    if on_first_rank():
        warnings.warn(f"SubnetPlan: ranks {apart} share no unit with rank 0 (components {parts}, world size {k}, "
                      f"coverage {coverage}, {owners_per_unit}): only the shared parameters tie their "
                      "models together, and each unit is trained on its owners' data alone. This is legitimate "
                      "(coverage 1/K gives every unit one owner); raise the coverage so units have 2+ owners if the "
                      "subnetworks should mix.", stacklevel=6)

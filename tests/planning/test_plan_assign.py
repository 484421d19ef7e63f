"""Neuron-level assignment (every rank gets a unit of every group whenever r*n >= K) and the
rank graph's connectivity (adjacency by shared units only), checked against counts and a
spectral gap the tests compute themselves."""
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import subnet_ext as sx
from subnet_ext.models import LLAMA_PRESETS, LlamaForCausalLM
from sdp_helpers import make_model


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 12), r=st.integers(1, 12), groups=st.integers(1, 3))
def test_neuron_assignment_properties(n, k, r, groups):
    """Guarantee (for r <= K, n*r >= K): every unit has exactly r owners; in every group each
    rank owns floor(r*n/K) or ceil(r*n/K) units, so at least 1 and exactly r*n/K when K | r*n."""
    from subnet_ext.planning.assignment.assign import assign_neurons

    r = min(r, k)
    if n * r < k:
        n = -(-k // r)
    ranges = [(i * n, (i + 1) * n) for i in range(groups)]
    owners = assign_neurons(ranges, k, r, unit_weight=torch.ones(groups * n))
    assert owners.shape == (k, groups * n) and owners.dtype == torch.bool
    assert torch.equal(owners.sum(0), torch.full((groups * n,), r))
    for a, b in ranges:
        counts = owners[:, a:b].sum(1)
        assert int(counts.min()) >= max(1, (r * n) // k) and int(counts.max()) <= -(-(r * n) // k)
    # deterministic
    assert torch.equal(owners, assign_neurons(ranges, k, r, unit_weight=torch.ones(groups * n)))


def test_llama_two_kv_heads_at_four_ranks_half_coverage():
    model = LlamaForCausalLM(LLAMA_PRESETS["tiny"])  # 2 kv heads per layer
    plan = sx.plan_subnetworks(model, 4, 0.5, "neuron")
    for g, (a, b) in zip(plan.groups, plan.unit_ranges):
        assert bool(plan.owners[:, a:b].any(1).all()), g.path
        if g.kind == "head":
            assert torch.equal(plan.owners[:, a:b].sum(1), torch.ones(4, dtype=torch.long))
    assert torch.equal(plan.owner_count, torch.full((len(plan.units),), 2))
    # still refused where it is infeasible: 2 heads x 1 owner < 4 ranks
    with pytest.raises(ValueError, match="own no unit of head group"):
        sx.plan_subnetworks(model, 4, 0.25, "neuron")


def _gap_from_owners(owners: np.ndarray) -> float:
    """Second-smallest eigenvalue of the normalised Laplacian of A = M M^T (diag 0)."""
    m = owners.astype(np.float64)
    adj = m @ m.T
    np.fill_diagonal(adj, 0.0)
    deg = adj.sum(1)
    d = np.diag([1 / np.sqrt(x) if x > 0 else 0.0 for x in deg])
    lap = np.eye(len(adj)) - d @ adj @ d
    return float(sorted(np.linalg.eigvalsh(lap))[1])


def test_rank_graph_counts_units_only():
    with pytest.warns(UserWarning, match=r"ranks \[.*\].*coverage 1/K"):
        low = sx.plan_subnetworks(make_model(), 4, 0.25, "block")
    assert low.spectral_gap == pytest.approx(0.0, abs=1e-9)
    assert "spectral gap 0.000" in low.summary() and "disconnected" in low.summary()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        half = sx.plan_subnetworks(make_model(), 4, 0.5, "block")
    expected = _gap_from_owners(half.owners.numpy())
    assert expected > 0 and half.spectral_gap == pytest.approx(expected, rel=1e-9)
    assert f"spectral gap {expected:.3f}" in half.summary()

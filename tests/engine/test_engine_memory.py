"""memory_report's accounting, on one simulated rank (no processes needed).

At coverage 1.0 every rank holds the whole model, so its model state (parameters +
gradients + AdamW state) must equal that of a plain replica trained the same way, in
every regime and at every level, including the backward regime's gradients that the masked kernel writes
straight into the communication buckets.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import subnet_ext as sx
from sdp_helpers import batch, make_model


def _steps(module, opt, n=2):
    """n AdamW steps; the last step's gradients are left in place."""
    for s in range(n):
        opt.zero_grad()
        x, y = batch(0, s)
        F.cross_entropy(module(x), y).backward()
        opt.step()


def _replica_state_bytes(model):
    replica = copy.deepcopy(model)
    opt = torch.optim.AdamW(replica.parameters(), lr=1e-2)
    _steps(replica, opt)
    tensors = [p for p in replica.parameters()] + [p.grad for p in replica.parameters()]
    tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("regime", ["forward", "backward"])
@pytest.mark.parametrize("level", ["block", "neuron"])
def test_full_coverage_model_state_equals_a_replica(regime, level):
    model = make_model()
    replica_bytes = _replica_state_bytes(model)
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, 2, 1.0, level), regime=regime,
                                simulate_rank=0, bucket_cap_mb=0.001)
    opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
    _steps(sdp, opt)
    report = sdp.memory_report(opt)  # gradients still held
    assert report["model_state"] == replica_bytes, report
    if regime == "backward" and level == "neuron":
        # The masked kernel wrote gradients into the buckets; they count once, as gradients.
        assert sdp.comm_stats()["direct_gradient_runs"] > 0
        assert 0 < report["gradients_in_buffers"] <= report["communication_buffers"], report

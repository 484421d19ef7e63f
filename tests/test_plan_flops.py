"""FLOPs traced on the meta device: block balance by bytes and FLOPs together, checked
against FLOPs counted independently on each rank's actual subnetwork."""
import copy
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import subnet_ext as sx
from subnet_ext.models import build_model
from subnet_ext.planning.plan import SubnetPlan


def resnet18_preset():
    torch.manual_seed(0)
    return build_model("resnet", width=16, in_channels=3, num_classes=10)


def measured_rank_flops(model, plan, x):
    """Forward FLOPs of each simulated rank's subnetwork (forward regime), counted by torch."""
    out = []
    for rank in range(plan.world_size):
        sdp = sx.SubnetDataParallel(copy.deepcopy(model), plan, regime="forward", simulate_rank=rank)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            sdp(x)
        out.append(float(counter.get_total_flops()))
    return torch.tensor(out, dtype=torch.float64)


def test_resnet18_block_plan_balances_measured_flops():
    model, x = resnet18_preset(), torch.randn(1, 3, 32, 32)
    plan = sx.plan_subnetworks(model, 4, 0.5, "block", sample_input=x)
    measured = measured_rank_flops(model, plan, x)
    imbalance = float(measured.max() / measured.mean() - 1)
    assert imbalance <= 0.10, measured.tolist()
    torch.testing.assert_close(plan.flops_per_rank, measured, rtol=0.01, atol=0.0)
    assert abs(plan.imbalance["flops"] - imbalance) <= 0.01
    text = plan.summary()
    assert "traced" in text and f"flops {plan.imbalance['flops']:.1%}" in text
    # the traced FLOPs survive a JSON round trip
    back = SubnetPlan.from_json(plan.to_json())
    torch.testing.assert_close(back.flops_per_rank, plan.flops_per_rank)


def test_without_sample_input_flops_fall_back_and_say_so():
    plan = sx.plan_subnetworks(resnet18_preset(), 4, 0.5, "block")
    assert "2 x parameters" in plan.summary()
    n = sum(p.numel() for p in resnet18_preset().parameters())
    assert float(plan.shared_flops + plan.unit_flops.sum()) == 2.0 * n


def test_sample_input_on_meta_and_bad_sample_input():
    with torch.device("meta"):
        model = build_model("llama", preset="tiny")
    plan = sx.plan_subnetworks(model, 4, 0.5, "neuron", sample_input=((1, 16), torch.long))
    assert plan.flops_per_rank.min() > 0 and "traced" in plan.summary()
    with pytest.raises(ValueError, match="sample_input"):
        sx.plan_subnetworks(model, 4, 0.5, "neuron", sample_input="tokens")
    bad = json.loads(plan.to_json())
    bad["flops"]["unit"] = bad["flops"]["unit"][:-1]
    with pytest.raises(ValueError, match="flops"):
        SubnetPlan.from_json(json.dumps(bad))

"""FLOPs traced on the meta device: block balance by bytes and FLOPs together, checked
against FLOPs counted independently on each rank's actual subnetwork."""
import copy
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import subnet_ext as sx
from subnet_ext.models import LLAMA_PRESETS, build_model
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
    with pytest.raises(ValueError, match=r"sample_input of shape \[1, 5, 32, 32\].*failed"):
        sx.plan_subnetworks(resnet18_preset(), 4, 0.5, "block", sample_input=((1, 5, 32, 32), torch.float32))
    bad = json.loads(plan.to_json())
    bad["flops"]["unit"] = bad["flops"]["unit"][:-1]
    with pytest.raises(ValueError, match="flops"):
        SubnetPlan.from_json(json.dumps(bad))


def test_traced_neuron_flops_match_hand_count_and_leave_model_alone():
    """LLaMA tiny, T tokens: a gated-MLP neuron costs 3 matmul columns (gate, up: rows;
    down: a column) of 2*T*hidden FLOPs each; counted here by hand."""
    torch.manual_seed(0)
    model = build_model("llama", preset="tiny")  # real CPU weights: tracing runs on a meta copy
    before = {k: v.clone() for k, v in model.state_dict().items()}
    t, hidden = 16, LLAMA_PRESETS["tiny"].hidden_size
    plan = sx.plan_subnetworks(model, 4, 0.5, "neuron", sample_input=torch.zeros(1, t, dtype=torch.long))
    for k, v in model.state_dict().items():
        assert v.device.type == "cpu" and torch.equal(v, before[k]), k
    mlp = [(g, a) for g, (a, _) in zip(plan.groups, plan.unit_ranges) if g.kind == "neuron"]
    assert mlp and all(float(plan.unit_flops[a]) == 3 * 2 * t * hidden for _, a in mlp)
    total = float(plan.shared_flops + plan.unit_flops.sum())
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, t, dtype=torch.long))
    # torch counts no FLOPs for CPU's fused attention kernel: add QK^T and AV by hand
    cfg = LLAMA_PRESETS["tiny"]
    attention = cfg.num_hidden_layers * 2 * (2 * cfg.num_attention_heads * t * t * cfg.head_dim)
    assert total == pytest.approx(counter.get_total_flops() + attention, rel=1e-9)


def test_cli_sample_inputs_and_resnet_plan_output(capsys):
    from subnet_ext.cli.plan import main
    from subnet_ext.jobs.tasks import sample_input_for

    with torch.device("meta"):
        resnet = build_model("resnet", in_channels=3, num_classes=10)
        mlp = build_model("mlp", in_features=64, num_classes=10)
    assert sample_input_for("resnet", resnet) == ((1, 3, 32, 32), torch.float32)
    assert sample_input_for("resnet", resnet, data="digits") == ((1, 3, 8, 8), torch.float32)
    assert sample_input_for("mlp", mlp) == ((1, 64), torch.float32)
    assert sample_input_for("llama", None, seq_len=32) == ((1, 32), torch.long)
    with pytest.raises(ValueError, match="no sample input known for model 'vit'"):
        sample_input_for("vit", mlp)
    assert main(["--model", "resnet", "--width", "16", "--world-size", "4", "--coverage", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "FLOPs" in out and "(traced one forward of [1, 3, 32, 32] float32)" in out

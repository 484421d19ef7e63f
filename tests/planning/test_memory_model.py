"""The memory model (subnet_ext/planning/costs/memory_model.py) against live measurements.

Its predicted peak of one training step is compared with StepMemoryMeter on a real step of
one rank (tests/memory_steps.py) of the study's two models and the bundled ResNet, at small sizes: SDP at C=1 (what
DDP computes), the block and neuron levels in the forward regime at C=0.5, the backward
regime, and activation checkpointing; within 10% of the measured peak. Model state is
checked exactly against the optimizer's own tensors.
"""
import copy

import pytest
import torch

import subnet_ext as sx
from memory_steps import MIB, gpt_task, measure_rank_step, mlp_task, resnet_task
from subnet_ext.planning.costs.activation_trace import trace_activations
from subnet_ext.planning.costs.memory_model import model_state, optimizer_moments, predict_step_memory

CONFIGS = [  # (task, level, regime, coverage, activation checkpointing)
    ("mlp", "block", "forward", 1.0, False),
    ("mlp", "neuron", "forward", 0.5, False),
    ("mlp", "block", "backward", 0.5, False),
    ("gpt", "block", "forward", 1.0, False),
    ("gpt", "block", "forward", 0.5, False),
    ("gpt", "neuron", "forward", 0.5, False),
    ("gpt", "block", "backward", 0.5, False),
    ("gpt", "block", "forward", 0.5, True),
    ("gpt", "neuron", "forward", 0.5, True),
    ("resnet", "block", "forward", 0.5, False),  # skipped blocks still apply their ReLU
    ("resnet", "neuron", "forward", 0.5, False),
    ("resnet", "block", "forward", 0.5, True),
]
TASKS = {"mlp": mlp_task, "gpt": gpt_task, "resnet": resnet_task}


@pytest.mark.parametrize("task,level,regime,coverage,ac", CONFIGS)
def test_predicted_peak_within_ten_percent_of_the_meter(task, level, regime, coverage, ac):
    model, x, y = TASKS[task]()
    plan = sx.plan_subnetworks(model, 4, coverage, level, seed=0)
    predicted = predict_step_memory(plan, 1, trace_activations(model, plan, x), regime=regime,
                                    activation_checkpointing=ac)
    measured = measure_rank_step(model, plan, x, y, rank=1, regime=regime, activation_checkpointing=ac)
    error = abs(predicted["total"] - measured["total"]) / measured["total"]
    assert error <= 0.10, (f"{task} {level} {regime} C={coverage} ac={ac}: predicted {predicted['total'] / MIB:.2f} "
                           f"MiB ({predicted}), measured {measured['total'] / MIB:.2f} MiB ({measured})")


def test_activation_trace_matches_the_saved_bytes_of_a_full_step():
    """The traced activations of the full model are what the meter sees saved at C=1 (the
    peak is at the start of backward for the GPT, where every saved tensor is alive)."""
    model, x, y = gpt_task()
    plan = sx.plan_subnetworks(model, 4, 1.0, "block", seed=0)
    trace = trace_activations(model, plan, x)
    measured = measure_rank_step(model, plan, x, y)
    assert trace.full == pytest.approx(measured["activations"], rel=0.02)
    assert trace.unit.sum() > 10 * trace.shared  # the blocks save most of it


@pytest.mark.parametrize("optimizer,moments", [("adamw", 2), ("sgd", 0), ("sgd_momentum", 1)])
def test_model_state_counts_the_optimizers_own_tensors(optimizer, moments):
    model, x, y = mlp_task(batch=4)
    plan = sx.plan_subnetworks(model, 4, 0.5, "block", seed=0)
    sdp = sx.SubnetDataParallel(model, plan, regime="forward", simulate_rank=2)
    opt = (torch.optim.AdamW(sdp.parameters()) if optimizer == "adamw"
           else torch.optim.SGD(sdp.parameters(), lr=0.1, momentum=0.9 * moments))
    torch.nn.functional.cross_entropy(sdp(x), y).backward()
    opt.step()
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)
    params = sum(p.numel() * p.element_size() for p in sdp.parameters())
    predicted = model_state(plan, 2, "forward", opt)
    assert optimizer_moments(opt) == moments
    assert predicted["optimizer_state"] == state and predicted["parameters"] == params


def test_unknown_optimizer_and_regime_are_refused():
    model, _, _ = mlp_task(batch=1)
    plan = sx.plan_subnetworks(model, 4, 0.5, "block", seed=0)
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        model_state(plan, 0, "forward", "lion")
    with pytest.raises(ValueError, match="regime must be one of"):
        model_state(plan, 0, "sideways")


def test_the_study_comparison_in_the_docs_is_generated_and_close():
    """docs/memory.md's table is what bench/memory_model_check.py writes from the committed
    study summary, and every prediction is within 15% of the study's measured peak."""
    import json
    import os
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(repo, "bench"))
    import memory_model_check

    with open(memory_model_check.SUMMARY) as f:
        summary = json.load(f)
    expected = memory_model_check.block(summary)
    with open(memory_model_check.DOC) as f:
        doc = f.read()
    assert expected in doc, "docs/memory.md is stale: run python bench/memory_model_check.py --write"
    for task, run, predicted, measured in memory_model_check.rows(summary):
        assert abs(predicted - measured) <= 0.15 * measured, (task, run, predicted, measured)


# ---- how the optimizer updates, autocast, the refresh buffer ----

def _llama(batch=1, seq_len=4):
    from subnet_ext.models.llama import LLAMA_PRESETS, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LLAMA_PRESETS["tiny"])
    return model, torch.randint(0, 256, (batch, seq_len)), torch.randint(0, 256, (batch, seq_len))


def _metered_step(sdp, opt, x, y, compute_dtype=None):
    """StepMemoryMeter.result() of the third step (the optimizer state exists from the second)."""
    from subnet_ext.measure.step_memory import StepMemoryMeter

    for _ in range(3):
        meter = StepMemoryMeter([sdp], [opt])
        with meter:
            with torch.autocast("cpu", dtype=compute_dtype or torch.float32, enabled=compute_dtype is not None):
                logits = sdp(x)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return meter.result()


@pytest.mark.parametrize("kernel,options", [("for-loop", dict(foreach=False)), ("foreach", dict(foreach=True)),
                                            ("fused", dict(fused=True))])
def test_update_temporaries_of_each_optimizer_kernel(kernel, options):
    """A step whose peak is the optimizer's (a few tokens, small buckets): AdamW's for-loop,
    foreach and fused updates, each forced on the CPU, against the meter; the kernel read off
    the optimizer as the model's helper reads it."""
    from subnet_ext.planning.costs.memory_model import optimizer_kernel

    model, x, y = _llama()
    plan = sx.plan_subnetworks(model, 4, 1.0, "block", seed=0)
    cap_mb = 0.05
    sdp = sx.SubnetDataParallel(model, plan, regime="forward", simulate_rank=0, bucket_cap_mb=cap_mb)
    opt = torch.optim.AdamW(sdp.parameters(), lr=1e-3, **options)
    assert optimizer_kernel(opt) == kernel
    measured = _metered_step(sdp, opt, x, y)
    predicted = predict_step_memory(plan, 0, trace_activations(model, plan, x), bucket_cap_bytes=cap_mb * MIB,
                                    optimizer_kernel=kernel)
    assert measured["peak_phase"] == "optimizer" or kernel != "foreach", measured  # the update's temporaries peak
    error = abs(predicted["total"] - measured["total"]) / measured["total"]
    assert error <= 0.10, (kernel, predicted, measured)


def test_optimizer_kernel_defaults_follow_torch():
    from subnet_ext.planning.costs.memory_model import optimizer_kernel, update_temporaries

    params = [torch.nn.Parameter(torch.zeros(3))]
    assert optimizer_kernel(torch.optim.AdamW(params)) == "for-loop"  # the CPU's default
    assert optimizer_kernel(torch.optim.AdamW(params), device="cuda") == "foreach"
    assert optimizer_kernel(None, "cuda") == "foreach" and optimizer_kernel(None) == "for-loop"
    with pytest.raises(ValueError, match="optimizer_kernel must be one of"):
        update_temporaries("vectorised", 1.0, 1.0)


@pytest.mark.filterwarnings("ignore:SubnetPlan. ranks")
@pytest.mark.parametrize("level", ["block", "neuron"])
def test_autocast_bf16_steps_within_ten_percent(level):
    """Autocast over fp32 parameters: activations traced under the same autocast (its weight
    copies saved for backward: whole blocks at block level, the held share of each head and
    MLP group at neuron level)."""
    model, x, y = _llama(batch=2, seq_len=32)
    plan = sx.plan_subnetworks(model, 4, 0.5, level, seed=0)
    trace = trace_activations(model, plan, x, compute_dtype=torch.bfloat16)
    assert trace.compute_dtype == torch.bfloat16 and trace.full < trace_activations(model, plan, x).full
    predicted = predict_step_memory(plan, 1, trace, optimizer_kernel="foreach")
    sdp = sx.SubnetDataParallel(model, plan, regime="forward", simulate_rank=1)
    measured = _metered_step(sdp, torch.optim.AdamW(sdp.parameters(), lr=1e-3, foreach=True), x, y, torch.bfloat16)
    # Both peak at the start of backward, where every saved tensor is alive: the trace is exact there.
    assert predicted["activations"] == pytest.approx(measured["activations"], rel=0.02), (predicted, measured)
    error = abs(predicted["total"] - measured["total"]) / measured["total"]
    assert error <= 0.10, (level, predicted, measured)


@pytest.mark.filterwarnings("ignore:SubnetPlan. ranks")
@pytest.mark.parametrize("level,coverage", [("block", 0.25), ("neuron", 0.5)])
def test_refresh_buffer_is_the_largest_broadcast(level, coverage):
    """The backward regime's refresh buffer, as the model predicts it, against the bytes the
    engine allocated for it after a step (every rank of K = 8)."""
    from subnet_ext.planning.costs.memory_model import _refresh_buffer_bytes

    model, x, y = _llama()
    plan = sx.plan_subnetworks(model, 8, coverage, level, seed=0)
    sizes = set()
    for rank in (0, 5):
        sdp = sx.SubnetDataParallel(copy.deepcopy(model), plan, regime="backward", simulate_rank=rank)
        opt = torch.optim.SGD(sdp.parameters(), lr=0.1)
        sdp(x).sum().backward()
        opt.step()
        sizes.add(sdp.refresh.buffer_bytes)
    assert len(sizes) == 1 and sizes.pop() == pytest.approx(_refresh_buffer_bytes(plan), rel=0.02)

"""Blocks as users write them (tests/user_blocks.py: issue 40's causal-mask block with
nn.MultiheadAttention and with F.scaled_dot_product_attention(is_causal=True), a branch on a
size, a timm-style block with drop path and layer scale and timm's own, a parallel attention +
MLP block, a block called with keywords only, transformers' OPT, GPT-NeoX and GPT-J decoder
layers called with keyword arguments) at block level, planned with a sample input and no
declaration: 2 gloo ranks, coverage 0.5, both regimes. One SGD step equals the owner mean of
one-process reference gradients (forward regime: each rank's subnetwork emulated on the full
model, its unowned blocks replaced by the identity; backward regime: the full model on each
rank, subnet_reference.py), drop path drawn alike (seeded per rank and step); the full state
loads strictly into the original model class."""
import copy

import pytest
import torch

import subnet_ext as sx
from subnet_ext.testing import run_distributed
from subnet_ext.vocabulary import REGIMES
from subnet_reference import expected_sgd_step, from_numpy, max_diff, reference_subnetwork, to_numpy
from user_blocks import NAMES, SAMPLE, build, loss_of

LR = 0.1

pytestmark = pytest.mark.filterwarnings("ignore:SubnetPlan. ranks")


def _worker(rank, world):
    out = {}
    for name in NAMES:
        plan = sx.plan_subnetworks(build(name), world, 0.5, "block", sample_input=SAMPLE)
        for regime in REGIMES:
            sdp = sx.SubnetDataParallel(build(name), plan, regime=regime)
            opt = torch.optim.SGD(sdp.parameters(), lr=LR)
            loss_of(name, sdp, rank, 0).backward()
            opt.step()
            theta1 = sdp.full_state_dict()
            build(name).load_state_dict(theta1, strict=True)  # raises when a name or a shape is off
            out[name, regime] = theta1
    return to_numpy(out)


@pytest.fixture(scope="module")
def trained():
    return from_numpy(run_distributed(_worker, 2))


@pytest.mark.parametrize("name", NAMES)
def test_one_step_equals_the_reference_in_both_regimes(trained, name):
    model = build(name)
    plan = sx.plan_subnetworks(model, 2, 0.5, "block", sample_input=SAMPLE)
    assert [bool(plan.owners[k].all()) for k in range(2)] == [False, False]  # each rank skips a block
    for regime in REGIMES:
        refs = [reference_subnetwork(model, plan, k) if regime == "forward" else copy.deepcopy(model)
                for k in range(2)]
        expected = expected_sgd_step(model, plan, refs, lambda m, k: loss_of(name, m, k, 0), LR)
        moved = max((expected[n] - p).abs().max().item() for n, p in model.named_parameters())
        assert moved > 1e-4  # the step changes the model
        for rank in range(2):
            assert max_diff(trained[rank][name, regime], expected) < 1e-5, (name, regime, rank)

"""clip_grad_norm_ and GradScaler in one process (no torch.distributed): the same as
torch's own over the whole model, and clear errors for bad arguments."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

import subnet_ext as sx
from sdp_helpers import batch, make_model


@pytest.mark.parametrize("regime,level", [("forward", "neuron"), ("backward", "neuron")])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_one_rank_clip_equals_torch(regime, level, norm_type):
    model = make_model()
    reference = copy.deepcopy(model)
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, 1, 1.0, level), regime=regime)
    x, y = batch(0, 0)
    F.cross_entropy(sdp(x), y).backward()
    F.cross_entropy(reference(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type)
    got = sdp.clip_grad_norm_(0.05, norm_type)
    assert expected > 0.05 and got.item() == pytest.approx(expected.item(), rel=1e-5)
    clipped = dict(reference.named_parameters())
    for name, p in sdp.module.named_parameters():
        ref = clipped[name.split("_owned")[0]].grad  # one rank owns every tensor whole: one run each
        assert (p.grad - ref).abs().max().item() <= 1e-6, name


def test_bad_arguments_raise_value_error():
    model = make_model()
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, 1, 1.0, "block"))
    with pytest.raises(ValueError, match="max_norm must be a number >= 0, got -1"):
        sdp.clip_grad_norm_(-1)
    with pytest.raises(ValueError, match="norm_type must be a number > 0 or inf, got 0"):
        sdp.clip_grad_norm_(1.0, norm_type=0)
    with pytest.raises(ValueError, match="timeout"):
        sx.GradScaler("cpu", timeout=-5)


def test_error_if_nonfinite():
    model = make_model()
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, 1, 1.0, "block"))
    x, y = batch(0, 0)
    F.cross_entropy(sdp(x), y).backward()
    sdp.module.head.weight.grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        sdp.clip_grad_norm_(1.0, error_if_nonfinite=True)


def test_grad_scaler_without_distributed_is_torchs():
    for cls in (sx.GradScaler, torch.amp.GradScaler):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = cls("cpu", init_scale=2.0**8)
        x, y = batch(0, 0)
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        model.head.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 2.0**7

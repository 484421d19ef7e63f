"""Residual scaling in the weights (planning/discovery/branch_ends.py, engine/regimes/residual_scale.py).

Reference: each model's forward with every residual branch's output multiplied by a
factor, through forward hooks on the branch modules chosen here by name (attn, mlp,
self_attn, fc2, bn2), not by the tracer under test; and for the GPT a forward written out
by hand.
"""
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

import subnet_ext as sx
from subnet_ext.engine.evaluation import full_model
from subnet_ext.engine.regimes.residual_scale import owner_fractions, scale_full_state, scaled_names
from subnet_ext.engine.regimes.restore import meta_skeleton
from subnet_ext.models import build_model
from subnet_ext.models.gpt import GPT, GPT_PRESETS
from subnet_ext.planning.discovery.branch_ends import branch_ends


def _models():
    torch.manual_seed(0)
    return [
        ("gpt", build_model("gpt", preset="tiny"), "transformer.h", ("attn", "mlp"), torch.randint(0, 128, (2, 12))),
        ("gpt-parallel", GPT(dataclasses.replace(GPT_PRESETS["tiny"], parallel_residual=True)), "transformer.h",
         ("attn", "mlp"), torch.randint(0, 128, (2, 12))),
        ("llama", build_model("llama"), "model.layers", ("self_attn", "mlp"), torch.randint(0, 100, (2, 12))),
        ("mlp", build_model("mlp", in_features=8, num_classes=3), "blocks", ("fc2",), torch.randn(4, 8)),
        ("resnet", build_model("resnet", num_classes=10, in_channels=1), None, ("bn2",), torch.randn(2, 1, 8, 8)),
    ]


def _blocks(model, container):
    if container is not None:
        return [f"{container}.{i}" for i in range(len(model.get_submodule(container)))]
    return [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]


def _out(model, x):
    y = model.eval()(x)
    return y[0] if isinstance(y, tuple) else y


@pytest.mark.parametrize("name,model,container,branches,x", _models(), ids=lambda v: v if isinstance(v, str) else "")
def test_weights_scaled_at_the_branch_ends_scale_the_branches(name, model, container, branches, x):
    blocks = _blocks(model, container)
    factors = {b: 0.3 + 0.6 * i / len(blocks) for i, b in enumerate(blocks)}
    reference = copy.deepcopy(model)
    for b, f in factors.items():
        for child in branches:
            reference.get_submodule(f"{b}.{child}").register_forward_hook(lambda m, a, out, f=f: out * f)
    scaled = copy.deepcopy(model)
    state = scaled.state_dict()
    for b, f in factors.items():
        for end in branch_ends(model, b):
            for leaf, _ in model.get_submodule(end).named_parameters(recurse=False):
                state[f"{end}.{leaf}"] = state[f"{end}.{leaf}"] * f
    scaled.load_state_dict(state)
    expected, got = _out(reference, x), _out(scaled, x)
    assert not torch.allclose(expected, _out(model, x), atol=1e-3), "the factors changed nothing"
    assert torch.allclose(got, expected, atol=1e-5), (name, (got - expected).abs().max().item())


def _gpt_by_hand(model, idx, factor):
    t = model.transformer
    x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
    for block in t.h:
        x = x + factor * block.attn(block.ln_1(x))
        x = x + factor * block.mlp(block.ln_2(x))
    return model.lm_head(t.ln_f(x))


@pytest.mark.parametrize("coverage,factor", [(0.5, 0.5), (0.25, 0.25), (1.0, 1.0)])
def test_owner_fraction_state_loads_into_the_gpt_and_scales_by_owners_over_k(coverage, factor):
    torch.manual_seed(1)
    model = build_model("gpt", preset="tiny")
    plan = sx.plan_subnetworks(model, world_size=4, coverage=coverage, level="block")
    assert set(owner_fractions(plan).values()) == {factor}
    state = scale_full_state(model.state_dict(), plan, meta_skeleton(model), "owner_fraction")
    fresh = build_model("gpt", preset="tiny")
    fresh.load_state_dict(state)  # the original class takes it
    idx = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        assert torch.allclose(fresh.eval()(idx)[0], _gpt_by_hand(model.eval(), idx, factor), atol=1e-5)
        rebuilt = full_model(meta_skeleton(model), plan, state)
        assert torch.allclose(rebuilt.eval()(idx)[0], _gpt_by_hand(model, idx, factor), atol=1e-5)
    assert (len(scaled_names(plan, meta_skeleton(model))) == 0) == (factor == 1.0)
    assert scale_full_state(model.state_dict(), plan, model, None) is not None


def test_refusals_name_the_problem():
    model = build_model("gpt", preset="tiny")
    neuron = sx.plan_subnetworks(model, world_size=2, coverage=0.5, level="neuron")
    with pytest.raises(ValueError, match="neuron level"):
        scale_full_state(model.state_dict(), neuron, meta_skeleton(model), "owner_fraction")
    block = sx.plan_subnetworks(model, world_size=2, coverage=0.5, level="block")
    with pytest.raises(ValueError, match="residual_scale must be one of"):
        scale_full_state(model.state_dict(), block, model, "half")

    class GeluAfter(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = nn.GELU()

        def forward(self, x):
            return self.act(self.fc(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.branch = GeluAfter()

        def forward(self, x):
            return x + self.branch(x)

    holder = nn.Sequential(Block())
    with pytest.raises(ValueError, match=r"\['0.branch.act'\] come after its last parameterised module 0.branch.fc"):
        branch_ends(holder, "0")


def _mlp_by_hand(model, x, factors):
    h = model.stem(x)
    for block, f in zip(model.blocks, factors):
        h = h + f * block.fc2(block.act(block.fc1(block.norm(h))))
    return model.head(model.norm(h))


def _engine_worker(rank, world):
    import torch.nn.functional as F

    from sdp_helpers import batch

    out = {}
    torch.manual_seed(0)
    mlp = build_model("mlp", in_features=12, num_classes=5, width=16)
    sdp = sx.SubnetDataParallel(mlp, sx.plan_subnetworks(mlp, world, 0.5, "block"), regime="forward")
    opt = torch.optim.AdamW(sdp.parameters(), lr=0.05)
    for step in range(2):
        x, y = batch(rank, step)
        F.cross_entropy(sdp(x), y).backward()
        opt.step()
        opt.zero_grad()
    x, _ = batch(0, 99)
    plain = build_model("mlp", in_features=12, num_classes=5, width=16)
    plain.load_state_dict(sdp.full_state_dict())
    scaled = build_model("mlp", in_features=12, num_classes=5, width=16)
    scaled.load_state_dict(sdp.full_state_dict(residual_scale="owner_fraction"))  # the original class takes it
    with torch.no_grad():
        expected = _mlp_by_hand(plain.eval(), x, [0.5] * 4)
        out["state"] = (scaled.eval()(x) - expected).abs().max().item()
        out["model"] = (sdp.full_model(residual_scale="owner_fraction").eval()(x) - expected).abs().max().item()
        out["evaluate"] = (sdp.evaluate(x, modes=("full",), residual_scale="owner_fraction")["full"]
                           - expected).abs().max().item()
        out["unscaled"] = (sdp.evaluate(x, modes=("full",))["full"] - plain(x)).abs().max().item()
        out["differs"] = (expected - plain(x)).abs().max().item()
    try:
        sdp.full_state_dict(residual_scale="half")
    except ValueError as e:
        out["error"] = str(e)
    return out


def test_engine_options_scale_the_assembled_model():
    from subnet_ext.testing import run_distributed

    for r in run_distributed(_engine_worker, 2):
        assert r["differs"] > 1e-3, "the scaling changed nothing: the test would pass without it"
        assert r["state"] < 1e-5 and r["model"] < 1e-5 and r["evaluate"] < 1e-5 and r["unscaled"] < 1e-5, r
        assert "residual_scale must be one of" in r["error"]

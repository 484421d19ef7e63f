"""The optimizer-state mapping in one process (simulate_rank, no process group): torch's full
optimizer state (name-keyed, whole tensors) into each rank's optimizer, and back.

Reference: a full state drawn here; each rank's share is cut from it with the rank's
parameters as tests/rank_views.py derives them from the plan; without communication a
rank's full_optimizer_state_dict holds only the pieces it leads, so the ranks' results
summed must give back the drawn state (every piece has one leader)."""
import copy

import pytest
import torch

import subnet_ext as sx
from rank_views import local_views
from sdp_helpers import make_model

WORLD = 4
CASES = [("block", "forward"), ("neuron", "forward"), ("block", "backward"), ("neuron", "backward")]


def full_state(plan, step=7.0):
    """An AdamW-shaped full optimizer state of the whole model, one param group listing every parameter."""
    g = torch.Generator().manual_seed(11)
    names = [n for n in plan.tensor_shapes if n in plan.param_names]
    state = {n: {"step": torch.tensor(step), "exp_avg": torch.randn(plan.tensor_shapes[n], generator=g),
                 "exp_avg_sq": torch.rand(plan.tensor_shapes[n], generator=g)} for n in names}
    group = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
             "foreach": None, "maximize": False, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": True, "params": names}
    return {"state": state, "param_groups": [group]}


def engines(level, regime):
    model = make_model()
    plan = sx.plan_subnetworks(copy.deepcopy(model), WORLD, 0.5, level)
    out = []
    for r in range(WORLD):
        sdp = sx.SubnetDataParallel(copy.deepcopy(model), plan, regime=regime, simulate_rank=r)
        out.append((sdp, torch.optim.AdamW(sdp.parameters(), lr=0.5, weight_decay=0.0)))
    return plan, out


@pytest.mark.parametrize("level,regime", CASES)
def test_full_state_loads_each_ranks_share(level, regime):
    plan, ranks = engines(level, regime)
    full = full_state(plan)
    for r, (sdp, opt) in enumerate(ranks):
        sdp.load_full_optimizer_state_dict(opt, full)
        assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["weight_decay"] == 0.1  # the saved group's
        trained = {id(p) for p in sdp.parameters()}
        checked = 0
        for param, name, view in local_views(plan, r, sdp.module):
            if id(param) not in trained:
                continue
            state = opt.state[param]
            assert float(state["step"]) == 7.0, name
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key], view(full["state"][name][key])), (r, name, key)
            checked += 1
        assert checked == len(trained)


@pytest.mark.parametrize("level,regime", CASES)
def test_leaders_pieces_sum_to_the_full_state(level, regime):
    plan, ranks = engines(level, regime)
    full = full_state(plan)
    total, steps = {}, {}
    for sdp, opt in ranks:
        sdp.load_full_optimizer_state_dict(opt, full)
        mine = sdp.full_optimizer_state_dict(opt)  # one rank alone: the pieces it leads, zeros elsewhere
        assert sorted(mine["param_groups"][0]["params"]) == sorted(n for n in mine["state"])
        for name, entries in mine["state"].items():
            steps.setdefault(name, set()).add(float(entries["step"]))
            for key in ("exp_avg", "exp_avg_sq"):
                total[(name, key)] = total.get((name, key), 0) + entries[key]
    assert {n for n, _ in total} == set(full["state"])
    for (name, key), value in total.items():
        assert torch.equal(value, full["state"][name][key]), (name, key)
    assert all(s == {7.0} for s in steps.values())


def test_missing_parameter_is_named_unless_not_strict():
    plan, ranks = engines("neuron", "forward")
    sdp, opt = ranks[2]
    full = full_state(plan)
    del full["state"]["head.weight"]
    with pytest.raises(ValueError, match="head.weight.*strict=False"):
        sdp.load_full_optimizer_state_dict(opt, full)
    sdp.load_full_optimizer_state_dict(opt, full, strict=False)
    head = sdp.module.head.weight
    assert head not in opt.state or not opt.state[head], "strict=False leaves the missing parameter without state"

"""The planner: units recognised without help, declared units, assignment, checks, JSON."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import subnet_ext as sx
from subnet_ext.models import LLAMA_PRESETS, LlamaForCausalLM, ResidualMLP, plain_mlp, resnet18
from subnet_ext.planning.plan import SubnetPlan


def mlp():
    torch.manual_seed(0)
    return ResidualMLP(12, 5, width=16, depth=4, hidden=32)


def test_residual_mlp_units_and_balance():
    plan = sx.plan_subnetworks(mlp(), 4, 0.5, "neuron")
    assert [u.kind for u in plan.units] == ["neuron"] * 128
    assert plan.units[0] == sx.Unit("neuron", "blocks.0", 0)
    assert torch.equal(plan.owner_count, torch.full((128,), 2))
    assert plan.imbalance["bytes"] < 1e-9 and len(plan.owner_sets()) <= 4
    block = sx.plan_subnetworks(mlp(), 4, 0.5, "block")
    assert [u.group for u in block.units] == [f"blocks.{i}" for i in range(4)]
    assert all(u.index is None and u.kind == "block" for u in block.units)
    assert block.spectral_gap > 0


def test_resnet_blocks_keep_shortcut_shared_and_channels():
    model = resnet18(num_classes=10, in_channels=1, width=8)
    plan = sx.plan_subnetworks(model, 2, 0.5, "block")
    assert len(plan.units) == 8
    assert "layer2.0.downsample.0.weight" in plan.shared and "layer2.0.conv1.weight" not in plan.shared
    neuron = sx.plan_subnetworks(model, 2, 0.5, "neuron")
    assert {u.kind for u in neuron.units} == {"channel"}
    g = neuron.groups[0]
    assert g.path == "layer1.0" and g.size == 8
    names = {(m.name, m.dim) for m in g.members}
    assert {("layer1.0.conv1.weight", 0), ("layer1.0.bn1.weight", 0), ("layer1.0.bn1.running_mean", 0),
            ("layer1.0.conv2.weight", 1)} <= names


def test_llama_heads_with_grouped_query_attention():
    model = LlamaForCausalLM(LLAMA_PRESETS["tiny"])  # 4 query heads, 2 kv heads
    plan = sx.plan_subnetworks(model, 2, 0.5, "neuron")
    heads = [g for g in plan.groups if g.kind == "head"]
    assert len(heads) == 2 and heads[0].size == 2  # a unit = one kv head with its 2 query heads
    widths = {m.name.rsplit(".", 2)[-2]: (m.dim, m.width) for m in heads[0].members}
    assert widths == {"q_proj": (0, 32), "k_proj": (0, 16), "v_proj": (0, 16), "o_proj": (1, 32)}
    assert "model.embed_tokens.weight" in plan.shared and "lm_head.weight" in plan.shared
    assert len(sx.plan_subnetworks(model, 2, 0.5, "block").units) == 2


def test_transformer_encoder_and_plain_stack():
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 3, enable_nested_tensor=False)
    assert len(sx.plan_subnetworks(enc, 4, 0.5, "block").units) == 3
    assert {g.path for g in sx.plan_subnetworks(enc, 4, 0.5, "neuron").groups} == {f"layers.{i}" for i in range(3)}
    stack = plain_mlp(8, 3, hidden=(16, 16, 16))
    groups = sx.plan_subnetworks(stack, 2, 0.5, "neuron").groups
    # hidden layers 0 and 2 are masked, layer 1 is not: no weight between two masked groups
    assert [(g.path, g.consumers) for g in groups] == [("1", ("3",)), ("5", ("7",))]


def test_declared_units_and_refusals():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    plan = sx.plan_subnetworks(model, 2, 1.0, "neuron", neuron_groups=[("0", "2")])
    assert len(plan.units) == 8
    with pytest.raises(ValueError, match="belongs to two unit groups"):
        sx.plan_subnetworks(model, 2, 1.0, "neuron", neuron_groups=[("0", "2"), ("2", "4")])
    with pytest.raises(ValueError, match="not a submodule"):
        sx.plan_subnetworks(model, 2, 1.0, "neuron", neuron_groups=[("0", "nope")])
    with pytest.raises(ValueError, match="no block-level unit"):
        sx.plan_subnetworks(model, 2, 0.5, "block")
    assert len(sx.plan_subnetworks(mlp(), 2, 0.5, "block", blocks=["blocks.0", "blocks.2"]).units) == 2
    with pytest.raises(ValueError, match="declared block 'blocks.9'"):
        sx.plan_subnetworks(mlp(), 2, 0.5, "block", blocks=["blocks.9"])


@pytest.mark.parametrize("coverage", [0.0, -0.5, 1.5, float("nan")])
def test_coverage_outside_range(coverage):
    with pytest.raises(ValueError, match="coverage must be in"):
        sx.plan_subnetworks(mlp(), 4, coverage)


@pytest.mark.parametrize("coverage", ["0.5", "half", None, True])
def test_coverage_of_the_wrong_type_is_a_type_error(coverage):
    with pytest.raises(TypeError, match=f"coverage must be a number in \\(0, 1\\].*got {type(coverage).__name__}"):
        sx.plan_subnetworks(mlp(), 4, coverage)
    with pytest.raises(TypeError, match="world_size must be an int.*got str '4'"):
        sx.plan_subnetworks(mlp(), "4", 0.5)


@pytest.mark.parametrize("coverage,owners,why", [(0.1, 1, "below 1/(2K) = 0.125, raised to one owner per unit"),
                                                 (0.3, 1, "round(0.3 x 4) = 1 owner(s) per unit"),
                                                 (0.6, 2, "round(0.6 x 4) = 2 owner(s) per unit")])
def test_coverage_rounded_to_whole_owners_is_said(coverage, owners, why):
    with pytest.warns(UserWarning, match=r"coverage .* at world size 4 is " + why.replace("(", r"\(").replace(")", r"\)")):
        plan = sx.plan_subnetworks(mlp(), 4, coverage)
    assert int(plan.owner_count.min()) == int(plan.owner_count.max()) == owners
    assert f"({owners} owner(s)/unit: effective coverage {owners}/4 = {owners / 4:g})" in plan.summary()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coverage that is a multiple of 1/K says nothing
        assert "effective" not in sx.plan_subnetworks(mlp(), 4, 0.5).summary()


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        sx.plan_subnetworks(mlp(), 0, 0.5)
    with pytest.raises(ValueError, match="level must be"):
        sx.plan_subnetworks(mlp(), 2, 0.5, "layer")


def test_checks_fail_with_where():
    # 2 kv heads cannot give each of 4 ranks a head at one owner per unit
    with pytest.raises(ValueError, match=r"own no unit of head group 'model.layers.0.self_attn'"):
        sx.plan_subnetworks(LlamaForCausalLM(LLAMA_PRESETS["tiny"]), 4, 0.25, "neuron")
    blocks_only = nn.Sequential(*[copy.deepcopy(mlp().blocks[0]) for _ in range(2)])
    with pytest.raises(ValueError, match="rank graph is disconnected"):
        sx.plan_subnetworks(blocks_only, 2, 0.5, "block")


def test_deterministic_json_round_trip_and_summary():
    a = sx.plan_subnetworks(mlp(), 4, 0.5, "neuron", seed=3)
    b = sx.plan_subnetworks(mlp(), 4, 0.5, "neuron", seed=3)
    assert torch.equal(a.owners, b.owners)
    assert not torch.equal(a.owners, sx.plan_subnetworks(mlp(), 4, 0.5, "neuron", seed=0).owners)
    c = SubnetPlan.from_json(a.to_json())
    assert torch.equal(c.owners, a.owners) and c.units == a.units and c.fingerprint == a.fingerprint
    text = a.summary()
    assert "spectral gap" in text and "| rank |" in text
    for bad in ["{", "[]", '{"format": "other"}', a.to_json().replace('"owners": [[', '"owners": [[7, ')]:
        with pytest.raises(ValueError):
            SubnetPlan.from_json(bad)


def test_meta_device_1b_at_world_size_8():
    with torch.device("meta"):
        model = LlamaForCausalLM(LLAMA_PRESETS["1b"])
    plan = sx.plan_subnetworks(model, 8, 0.25, "block")
    assert len(plan.units) == 22 and plan.imbalance["bytes"] < 0.1


@pytest.mark.parametrize("regime", ["forward", "backward"])
@pytest.mark.parametrize("level", ["block", "neuron"])
@pytest.mark.parametrize("arch", ["resnet", "llama"])
def test_single_rank_equals_plain_training(arch, level, regime):
    torch.manual_seed(0)
    if arch == "resnet":
        model = resnet18(num_classes=10, in_channels=1, width=4)
        x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    else:
        model = LlamaForCausalLM(LLAMA_PRESETS["tiny"])
        x = torch.randint(0, 256, (2, 8))
        y = torch.randint(0, 256, (2, 8))
    reference = copy.deepcopy(model)
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, 1, 1.0, level), regime=regime)
    opt, ropt = torch.optim.SGD(sdp.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for net, o in ((sdp, opt), (reference, ropt)):
        for _ in range(2):
            out = net(x)
            F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
            o.step()
            o.zero_grad()
    full, ref = sdp.full_state_dict(), reference.state_dict()
    for k in ref:
        torch.testing.assert_close(full[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)


def test_plan_cli_1b_at_world_size_8(capsys):
    from subnet_ext.cli.plan import main

    assert main(["--model", "llama", "--preset", "1b", "--world-size", "8", "--coverage", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "1100.0M parameters" in out and "| ddp |" in out and "| fsdp |" in out and "sdp (block" in out
    assert "imbalance (max/mean - 1): bytes" in out and "(traced one forward of [1, 64] int64)" in out
    with pytest.raises(SystemExit):
        main(["--coverage", "0"])
    assert "--coverage must be in (0, 1]" in capsys.readouterr().err


def test_plan_cli_plans_the_gpt_by_its_blocks(capsys):
    from subnet_ext.cli.plan import main
    from subnet_ext.models import build_model

    model = build_model("gpt", preset="small")
    total = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.transformer.h[0].parameters())
    held = total - len(model.transformer.h) * block + 2 * block  # everything outside the blocks, and 2 of 4 blocks
    assert main(["--model", "gpt", "--preset", "small", "--world-size", "4", "--coverage", "0.5"]) == 0
    out = capsys.readouterr().out
    assert f"{total / 1e6:.1f}M parameters" in out and "(traced one forward of [1, 64] int64)" in out
    for rank in range(4):
        assert f"| {rank} | 0.5 | 2 | {held:,} |" in out, out


def _parts(plan: SubnetPlan, owners: torch.Tensor) -> dict:
    """The keyword arguments of SubnetPlan's constructor, read from `plan` through its public attributes."""
    return dict(world_size=plan.world_size, coverage=plan.coverage, level=plan.level, seed=plan.seed,
                groups=plan.groups, owners=owners, shared=plan.shared,
                tensor_shapes={n: s for n, s, _ in plan.entries}, tensor_dtypes={n: d for n, _, d in plan.entries},
                param_names=sorted(plan.param_names), fingerprint=plan.fingerprint,
                flops={"unit": plan.unit_flops.tolist(), "shared": plan.shared_flops, "source": plan.flops_source},
                aliases=plan.aliases)


def test_a_plan_is_built_from_its_parts_by_its_public_constructor():
    """The constructor from parts gives the planner's plan back; other owners give their own
    costs per rank; a plan leaving a unit without an owner is refused by its check."""
    plan = sx.plan_subnetworks(mlp(), 2, 1.0, "neuron")
    assert SubnetPlan(**_parts(plan, plan.owners)).to_json() == plan.to_json()
    only_rank0 = torch.zeros_like(plan.owners)
    only_rank0[0] = True
    only_rank0[1, [a for a, _ in plan.unit_ranges]] = True  # rank 1 keeps one unit per group
    mine = SubnetPlan(**_parts(plan, only_rank0))
    assert float(mine.bytes_per_rank[0]) == mine.full_bytes > float(mine.bytes_per_rank[1])
    assert mine.bytes_of("blocks.0.fc1.weight") == 4 * mine.numel_of("blocks.0.fc1.weight")
    unowned = plan.owners.clone()
    unowned[:, 0] = False
    with pytest.raises(ValueError, match="without an owner"):
        SubnetPlan(**_parts(plan, unowned))


def test_a_plan_cannot_change_once_made():
    """The plan is a value (the seam ownership schedules build on): every assignment is another plan."""
    import copy
    import pickle

    plan = sx.plan_subnetworks(ResidualMLP(8, 3, width=16, depth=4, hidden=32), 4, 0.5, "block")
    before = plan.to_json()
    with pytest.raises(AttributeError, match="immutable"):
        plan.coverage = 1.0
    with pytest.raises(AttributeError, match="immutable"):
        plan.owners = plan.owners
    owners = plan.owners
    owners[:] = True  # a copy
    with pytest.raises(TypeError):
        plan.tensor_shapes["blocks.0.fc1.weight"] = (1,)  # a read-only mapping
    with pytest.raises(Exception):  # dataclasses.FrozenInstanceError
        plan.groups[0].size = 2
    assert isinstance(plan.groups, tuple) and isinstance(plan.groups[0].params, tuple)
    assert plan.to_json() == before
    moved = plan.with_owners(plan.owners.flip(1))
    assert moved is not plan and plan.to_json() == before and moved.owners.flip(1).equal(plan.owners)
    for again in (copy.deepcopy(plan), pickle.loads(pickle.dumps(plan))):
        assert again.to_json() == before
        with pytest.raises(AttributeError, match="immutable"):
            again.seed = 3

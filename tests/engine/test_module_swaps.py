"""The engine swaps its own layers in for the user's sliced layers, and close() swaps them back.

Backward regime (neuron level): each sliced nn.Linear becomes an OwnedLinear, each plain sliced
nn.Conv2d an OwnedConv2d, any other sliced layer (a norm) its twin (the same class and tensors,
registries of its own); forward regime: each sliced nn.Linear a SlicedLinear, nn.Conv2d a
SlicedConv2d, any other sliced layer and a sliced head group's attention a twin (MLP, ResNet,
GPT), the user's modules keeping their attributes and releasing only their sliced tensors (meta);
with width kept (forced on a small GPT): the head groups' projections become WidthKeptLinear.
Checked, on a simulated rank of a 2-rank plan:

- the layers at the sliced paths are the engine's types, and the user's layer objects (kept
  aside) have the same instance attributes as before wrapping (no `forward`, nothing new), the
  same Parameter objects and the same values;
- the swap moves no name: the wrapped model's parameter and state-dict names are the same as
  if the user's layer held the owned views itself (`path.weight_owned{i}`, the unsliced
  `path.bias`), and an owned layer's `weight` reads as the full tensor.

With 2 gloo ranks: after training and close(), every parent holds the user's original layer
objects, the model's Parameters are the objects it had before wrapping, its state-dict keys
are the original ones, and its forward equals an unwrapped model loaded with full_state_dict().
"""
import copy
import warnings

import torch
import torch.nn as nn

import subnet_ext as sx
from sdp_helpers import batch, make_model, train
from subnet_ext.engine.regimes import surgery
from subnet_ext.engine.regimes.module_swaps import ModuleSwaps, twin
from subnet_ext.engine.layers.owned_conv import OwnedConv2d
from subnet_ext.engine.layers.owned_linear import OwnedLinear
from subnet_ext.engine.layers.sliced_layers import SlicedConv2d, SlicedLinear
from subnet_ext.engine.layers.width_keeping import WidthKeptLinear
from subnet_ext.models.gpt import GPT, GPTConfig
from subnet_ext.models.resnet import resnet18
from subnet_ext.testing import run_distributed


def plan_quietly(model, world, coverage, level):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # coverage warnings of small plans
        return sx.plan_subnetworks(model, world, coverage, level)


def sliced_paths(plan) -> set[str]:
    """The modules holding a tensor the plan slices into units."""
    return {m.name.rpartition(".")[0] for g in plan.groups for m in g.members}


def user_view(model) -> dict:
    """{path: (instance attribute names, {parameter name: id})} of every module, as the user sees it."""
    return {path: (sorted(vars(m)), {n: id(p) for n, p in m._parameters.items()})
            for path, m in model.named_modules()}


def test_swaps_reach_every_parent_and_undo_restores_objects_and_mode():
    """A layer shared by two parents is replaced in both; a twin's registries are its own;
    undo() puts the original objects back, in the mode the replacements were left in."""
    shared, norm = nn.Linear(3, 3), nn.LayerNorm(3)
    model = nn.Sequential(nn.Sequential(shared, norm), nn.Sequential(shared))
    swaps, norm_twin = ModuleSwaps(), twin(norm)
    norm_twin._parameters.pop("weight")
    norm_twin.register_forward_pre_hook(lambda m, args: None)
    assert "weight" in norm._parameters and not norm._forward_pre_hooks and norm_twin.bias is norm.bias
    norm.forward = nn.LayerNorm.forward.__get__(norm)  # an instance forward (a user's patch) runs on the twin
    assert twin(norm).forward.__self__ is not norm
    replacement = nn.Identity()
    swaps.swap(model, "0.0", replacement)
    swaps.swap(model, "0.1", norm_twin)
    assert model[0][0] is replacement and model[1][0] is replacement and model[0][1] is norm_twin
    model.eval()
    swaps.undo()
    assert model[0][0] is shared and model[1][0] is shared and model[0][1] is norm
    assert not shared.training and not norm.training


def check_backward_swaps(model, owned_type) -> None:
    plan = plan_quietly(model, 2, 0.5, "neuron")
    originals = dict(model.named_modules())
    before, values = user_view(model), {n: p.detach().clone() for n, p in model.named_parameters()}
    sdp = sx.SubnetDataParallel(model, plan, regime="backward", simulate_rank=0)
    swapped = {path for path, m in model.named_modules() if m is not originals.get(path)}
    assert swapped == sliced_paths(plan), (swapped, sliced_paths(plan))
    assert any(isinstance(model.get_submodule(p), owned_type) for p in swapped), swapped
    for path in swapped:
        layer, original = model.get_submodule(path), originals[path]
        assert user_view(original)[""] == before[path], (path, user_view(original)[""], before[path])
        assert torch.equal(original.weight, values[path + ".weight"]) and original.weight.requires_grad, path
        assert layer.weight.shape == original.weight.shape and layer.weight.data_ptr() == original.weight.data_ptr()
        assert not original._forward_pre_hooks, path  # the engine's hooks sit on its own layers
        names = [n for n, _ in layer.named_parameters(recurse=False)]
        if not isinstance(layer, (OwnedLinear, OwnedConv2d)):  # a twin: the user's class, its own registries
            assert type(layer) is type(original) and layer._parameters is not original._parameters, path
        owned = [n for n in names if n.startswith("weight_owned")]
        assert owned and set(names) - set(owned) <= {"bias", "bias_owned0", "bias_owned1"}, (path, names)
        if "bias" in names:
            assert layer.bias is original.bias, path  # an unsliced bias: the user's own Parameter
    assert sdp.layout.piece_params, "the owned views are the layout's piece parameters"


def test_backward_regime_swaps_sliced_linears_and_keeps_the_users_layers_untouched():
    check_backward_swaps(make_model(), OwnedLinear)


def test_backward_regime_swaps_sliced_convs():
    torch.manual_seed(0)
    check_backward_swaps(resnet18(num_classes=5, in_channels=1, width=4), OwnedConv2d)


def test_owned_linear_matches_the_users_layer_and_names_do_not_move():
    model = make_model()
    plain = copy.deepcopy(model)
    plan = plan_quietly(model, 2, 0.5, "neuron")
    sdp = sx.SubnetDataParallel(model, plan, regime="backward", simulate_rank=1)
    x, _ = batch(1, 0)
    torch.testing.assert_close(sdp(x), plain(x), rtol=0, atol=0)  # the backward regime's forward is the full model
    names = [n for n, _ in model.named_parameters()]
    for path, m in model.named_modules():
        if isinstance(m, OwnedLinear):
            assert f"{path}.weight_owned0" in names and f"{path}.weight" not in names, names
    assert set(sdp.layout.value_refs) >= {p + ".weight" for p, m in model.named_modules()
                                          if isinstance(m, OwnedLinear)}


def test_width_kept_projections_are_swapped(monkeypatch):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=4, n_embd=32))
    plan = plan_quietly(model, 2, 0.5, "neuron")
    monkeypatch.setattr(surgery, "check_sliced_heads",
                        lambda m, plan, pieces, r: {g.path: "forced" for g in plan.groups if g.kind == "head"})
    originals, before = dict(model.named_modules()), user_view(model)
    names_before = [n for n, _ in model.named_parameters()]
    sx.SubnetDataParallel(model, plan, regime="forward", simulate_rank=0)
    kept = {path for path, m in model.named_modules() if isinstance(m, WidthKeptLinear)}
    assert kept == {f"transformer.h.{i}.attn.{p}" for i in range(2) for p in ("c_attn", "c_proj")}, kept
    assert [n for n, _ in model.named_parameters()] == names_before  # the compact weights keep their names
    for path in kept:
        assert sorted(vars(originals[path])) == before[path][0], path  # no attribute added to the user's layer
        layer, original = model.get_submodule(path), originals[path]
        assert original.weight.is_meta and original.in_features == 32, path  # released, its widths kept
        assert layer.weight.numel() * 2 == original.weight.numel(), path  # the compact weight: half the heads


def check_forward_swaps(model, layer_type, attention: bool = False) -> None:
    """Forward regime, neuron level, simulated rank 0 of 2 at C=0.5: each sliced nn.Linear /
    nn.Conv2d is a Sliced* layer, any other sliced layer (and a sliced head group's attention) a
    twin of the user's class; the user's modules keep their attributes (widths, head counts) and
    class, lose only the sliced tensors (meta, full shape), and keep their unsliced Parameters."""
    plan = plan_quietly(model, 2, 0.5, "neuron")
    originals, before = dict(model.named_modules()), user_view(model)
    attrs = {path: {k: v for k, v in vars(m).items() if isinstance(v, int)} for path, m in model.named_modules()}
    shapes = {n: p.shape for n, p in model.named_parameters()}
    sliced = {m.name for g in plan.groups for m in g.members}
    heads = {g.path for g in plan.groups if g.kind == "head"} if attention else set()
    sdp = sx.SubnetDataParallel(model, plan, regime="forward", simulate_rank=0)
    swapped = {path for path, m in model.named_modules() if m is not originals.get(path)}
    assert swapped == sliced_paths(plan) | heads, (swapped ^ (sliced_paths(plan) | heads))
    assert any(isinstance(model.get_submodule(p), layer_type) for p in swapped), swapped
    assert [n for n, _ in model.named_parameters()] == list(shapes)  # no name moves
    for path in swapped:
        layer, original = model.get_submodule(path), originals[path]
        exact = {nn.Linear: SlicedLinear, nn.Conv2d: SlicedConv2d}.get(type(original), type(original))
        assert type(layer) is exact, (path, type(layer))
        assert sorted(vars(original)) == before[path][0], path  # nothing added to the user's module
        assert {k: v for k, v in vars(original).items() if isinstance(v, int)} == attrs[path], path
        for leaf, param in original._parameters.items():
            name = f"{path}.{leaf}" if path else leaf
            if name in sliced:  # released to meta, full shape; the stand-in holds the owned half
                assert param.is_meta and param.shape == shapes[name], name
                assert layer._parameters[leaf].numel() * 2 == param.numel(), name
            elif param is not None:
                assert layer._parameters[leaf] is param and id(param) == before[path][1][leaf], name
    for path in heads:
        layer, original = model.get_submodule(path), originals[path]
        assert layer.n_head * 2 == original.n_head, path  # the twin runs the kept heads
    assert all(isinstance(m.owned, dict) and m.owned for m in model.modules() if isinstance(m, (SlicedLinear, SlicedConv2d)))
    assert sdp.layout is not None


def test_forward_regime_swaps_sliced_layers_and_keeps_the_users_modules():
    check_forward_swaps(make_model(), SlicedLinear)


def test_forward_regime_swaps_sliced_convs_and_norms():
    torch.manual_seed(0)
    check_forward_swaps(resnet18(num_classes=5, in_channels=1, width=4), SlicedConv2d)


def test_forward_regime_swaps_a_sliced_attention_for_its_twin():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=4, n_embd=32))
    check_forward_swaps(model, SlicedLinear, attention=True)


def _close_worker(rank, world):
    results = []
    for regime in ("backward", "forward"):
        model = make_model()
        fresh = make_model(seed=5)
        originals = dict(model.named_modules())
        params_before = {n: id(p) for n, p in model.named_parameters()}
        keys_before = list(model.state_dict())
        sdp = sx.SubnetDataParallel(model, plan_quietly(model, world, 0.5, "neuron"), regime=regime)
        swapped = sum(isinstance(m, (OwnedLinear, OwnedConv2d, SlicedLinear, SlicedConv2d)) for m in model.modules())
        train(sdp, torch.optim.SGD(sdp.parameters(), lr=0.1), rank, 2)
        fresh.load_state_dict(sdp.full_state_dict())
        sdp.close()
        x, _ = batch(rank, 7)
        with torch.no_grad():
            same_output = torch.equal(model(x), fresh(x))
        results.append({"regime": regime, "swapped": swapped, "same_output": same_output,
                        "same_modules": all(m is originals[p] for p, m in model.named_modules()),
                        "same_params": {n: id(p) for n, p in model.named_parameters()} == params_before,
                        "same_keys": list(model.state_dict()) == keys_before})
    return results


def test_close_puts_the_users_layers_back():
    for rank_results in run_distributed(_close_worker, 2, timeout=300.0):
        for r in rank_results:
            assert r["swapped"] > 0 and r["same_modules"], r  # the swapped layers come back as the same objects
            assert r["same_output"] and r["same_keys"], r
            if r["regime"] == "backward":  # the forward regime re-creates the tensors it released
                assert r["same_params"], r

"""Real architectures from torchvision, transformers and timm, in tiny configs built here
(no weights, no downloads): each is planned at block and neuron level, trained 2 SGD steps
on 2 gloo ranks in the forward regime, its full_state_dict() loads strictly into a fresh
instance, and its first step equals theta - lr * (owner mean of the gradients of each
rank's reference subnetwork computed in one process, see subnet_reference.py)."""
import importlib
import importlib.util

import pytest
import torch
import torch.nn.functional as F

import subnet_ext as sx
from subnet_ext.testing import run_distributed
from subnet_reference import expected_sgd_step, from_numpy, max_diff, reference_subnetwork, to_numpy

LR = 0.05
VOCAB = 64


def require(package):
    """Skip when `package` is not installed, and only then: an installed package that fails
    to import (say a torchvision built for another torch) fails the test instead."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (the [test] extra: pip install -e '.[test]'; make test installs it)")
    importlib.import_module(package)


def build(arch):
    """A tiny model of `arch`, the same weights in every process."""
    torch.manual_seed(0)
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                          tie_word_embeddings=False, attn_implementation="eager")
        return LlamaForCausalLM(cfg)
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False, attn_implementation="eager")
        return GPT2LMHeadModel(cfg)
    if arch == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=10)
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2,
                             num_classes=10)


def loss_of(arch, module, rank):
    g = torch.Generator().manual_seed(rank)
    if arch in ("llama", "gpt2"):
        ids = torch.randint(0, VOCAB, (2, 8), generator=g)
        return module(ids, labels=ids).loss
    size = 32 if arch == "resnet18" else 16
    x, y = torch.randn(4, 3, size, size, generator=g), torch.randint(0, 10, (4,), generator=g)
    return F.cross_entropy(module(x), y)


def consumers(arch, plan):
    """{group path: (consumer, unit width[, 1 for conv channels])}, from knowing each architecture."""
    out = {}
    for g in plan.groups:
        leaf = g.path.rsplit(".", 1)[-1]
        if arch == "llama":
            out[g.path] = (g.path + ".o_proj", 16) if leaf == "self_attn" else (g.path + ".down_proj", 1)
        elif arch == "gpt2":
            out[g.path] = (g.path + ".c_proj", 8 if leaf == "attn" else 1)
        elif arch == "resnet18":
            out[g.path] = (g.path + ".conv2", 1, 1)
        else:
            out[g.path] = (g.path + ".proj", 16) if leaf == "attn" else (g.path + ".fc2", 1)
    return out


def _worker(rank, world, arch):
    out = {}
    for level in ("block", "neuron"):
        model = build(arch)
        plan = sx.plan_subnetworks(model, world, 0.5, level)
        sdp = sx.SubnetDataParallel(model, plan, regime="forward")
        opt = torch.optim.SGD(sdp.parameters(), lr=LR)
        for step in range(2):
            loss_of(arch, sdp, rank + 10 * step).backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                theta1 = sdp.full_state_dict()
        build(arch).load_state_dict(sdp.full_state_dict(), strict=True)
        out[level] = {"theta1": theta1 if rank == 0 else None,
                      "groups": [(g.kind, g.path, g.size) for g in plan.groups]}
    return to_numpy(out)


@pytest.mark.parametrize("arch,package", [("llama", "transformers"), ("gpt2", "transformers"),
                                          ("resnet18", "torchvision"), ("vit", "timm")])
def test_real_architecture_trains_and_matches_reference(arch, package):
    require(package)
    results = from_numpy(run_distributed(_worker, 2, arch, timeout=300))
    for level in ("block", "neuron"):
        model = build(arch)
        plan = sx.plan_subnetworks(model, 2, 0.5, level)
        kinds = {g.kind for g in plan.groups}
        assert kinds == ({"block"} if level == "block" else
                         {"channel"} if arch == "resnet18" else {"head", "neuron"}), kinds
        refs = [reference_subnetwork(model, plan, k, None, consumers(arch, plan) if level == "neuron" else None)
                for k in range(2)]
        if arch == "resnet18" and level == "block":  # skipped BasicBlocks compute relu(downsample(x)) or relu(x)
            refs = [reference_subnetwork(model, plan, k, {g.path: _resnet_skip for g in plan.groups})
                    for k in range(2)]
        expected = expected_sgd_step(model, plan, refs, lambda m, k: loss_of(arch, m, k), LR)
        assert max_diff(results[0][level]["theta1"], expected) < 2e-5, (arch, level)


def _resnet_skip(block, x):
    return torch.relu(block.downsample(x) if block.downsample is not None else x)


def test_fused_head_plan_round_trips_and_bad_offsets_are_refused():
    require("transformers")
    import json

    plan = sx.plan_subnetworks(build("gpt2"), 2, 0.5, "neuron")
    attn = next(g for g in plan.groups if g.kind == "head")
    assert [(m.name.rsplit(".", 2)[-2:], m.dim, m.width, m.offset) for m in attn.members][:2] == \
        [(["c_attn", "weight"], 1, 8, 0), (["c_attn", "bias"], 0, 8, 0)]
    back = sx.SubnetPlan.from_json(plan.to_json())
    assert [g.to_dict() for g in back.groups] == [g.to_dict() for g in plan.groups]
    d = json.loads(plan.to_json())
    d["groups"][0]["members"][2]["offset"] = 0  # the k block moved onto the q block: a gap and an overlap
    with pytest.raises(ValueError, match="do not tile"):
        sx.SubnetPlan.from_json(json.dumps(d))

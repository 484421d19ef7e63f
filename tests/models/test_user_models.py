"""Models users bring, written the way popular code writes them: CIFAR-style ResNets whose
projection is called `shortcut` (empty nn.Sequential when there is none), pre-activation
ResNets (no ReLU after the sum), plain Linear stacks with BatchNorm1d(affine=False), and
nn.TransformerEncoder with its nested-tensor fast path. Each: 2 gloo ranks, coverage 0.5,
forward regime; one SGD step equals the owner mean of one-process reference gradients
(subnet_reference.py), and the result loads strictly into a fresh model."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import subnet_ext as sx
from subnet_ext.testing import run_distributed
from subnet_reference import expected_sgd_step, from_numpy, max_diff, reference_subnetwork, to_numpy

LR = 0.1


class CifarBlock(nn.Module):
    """kuangliu/pytorch-cifar BasicBlock: conv-bn-relu-conv-bn, + shortcut(x), relu."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)
        return F.relu(out)


class PreActBlock(nn.Module):
    """Pre-activation block: bn-relu-conv-bn-relu-conv, + shortcut(x), no ReLU after the sum."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False))

    def forward(self, x):
        out = self.conv1(F.relu(self.bn1(x)))
        out = self.conv2(F.relu(self.bn2(out)))
        return out + (self.shortcut(x) if hasattr(self, "shortcut") else x)


class TinyResNet(nn.Module):
    """x [B, 3, 8, 8] -> logits [B, 4]; blocks 8->8 (identity shortcut) and 8->16 (projection)."""

    def __init__(self, block):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.layer1 = nn.Sequential(block(8, 8), block(8, 16, stride=2))
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.layer1(self.stem(x)).mean((2, 3)))


class TinyEncoder(nn.Module):
    """x [B, T, 8] (+ padding mask [B, T], True = pad) -> [B, T, 4]; 2 post-norm layers."""

    def __init__(self, nested):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)
        self.out = nn.Linear(16, 4)

    def forward(self, x, mask=None):
        return self.out(self.encoder(self.inp(x), src_key_padding_mask=mask))


def build(name):
    torch.manual_seed(0)
    if name == "cifar":
        return TinyResNet(CifarBlock)
    if name == "preact":
        return TinyResNet(PreActBlock)
    if name == "bn_stack":
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, affine=False), nn.ReLU(), nn.Linear(8, 8),
                             nn.ReLU(), nn.Linear(8, 3))
    return TinyEncoder(nested=name == "encoder_nested")


def loss_of(name, module, rank):
    g = torch.Generator().manual_seed(rank)
    if name in ("cifar", "preact"):
        return F.cross_entropy(module(torch.randn(4, 3, 8, 8, generator=g)), torch.randint(0, 4, (4,), generator=g))
    if name == "bn_stack":
        return F.cross_entropy(module(torch.randn(6, 6, generator=g)), torch.randint(0, 3, (6,), generator=g))
    return module(torch.randn(3, 5, 8, generator=g)).square().mean()


def _step_worker(rank, world, name, level):
    model = build(name)
    plan = sx.plan_subnetworks(model, world, 0.5, level)
    sdp = sx.SubnetDataParallel(model, plan, regime="forward")
    opt = torch.optim.SGD(sdp.parameters(), lr=LR)
    out = {"skips": [g.skip for g in plan.groups]}
    for step in range(2):
        loss_of(name, sdp, rank + 10 * step).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            out["theta1"] = {n: t.clone() for n, t in sdp.full_state_dict().items()}
    fresh = build(name)
    fresh.load_state_dict(sdp.full_state_dict(), strict=True)
    if name.startswith("encoder"):
        x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(7))
        pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
        sdp.module.eval()
        with torch.no_grad():
            out["eval"] = sdp.module(x, pad)
        out["state"] = sdp.full_state_dict()
        out["x"], out["pad"] = x, pad
    return to_numpy(out)


def _relu_shortcut(block, x):
    return F.relu(block.shortcut(x))


SKIPS = {"cifar": _relu_shortcut, "preact": lambda block, x: block.shortcut(x) if hasattr(block, "shortcut") else x}
CONSUMERS = {"bn_stack": {"0": ("3", 1)}}


@pytest.mark.parametrize("name,level,skips", [
    ("cifar", "block", ["shortcut_relu", "shortcut_relu"]),
    ("preact", "block", ["identity", "shortcut"]),
    ("bn_stack", "neuron", None),
])
def test_forward_step_equals_reference(name, level, skips):
    results = from_numpy(run_distributed(_step_worker, 2, name, level))
    model = build(name)
    plan = sx.plan_subnetworks(model, 2, 0.5, level)
    fn = SKIPS.get(name)
    refs = [reference_subnetwork(model, plan, k, {g.path: fn for g in plan.groups} if fn else None,
                                 CONSUMERS.get(name)) for k in range(2)]
    assert [bool(plan.owners[k].all()) for k in range(2)] == [False, False]  # each rank skips something
    expected = expected_sgd_step(model, plan, refs, lambda m, k: loss_of(name, m, k), LR)
    for r in results:
        if skips is not None:
            assert r["skips"] == skips
        assert max_diff(r["theta1"], expected) < 1e-5


def test_pre_activation_block_at_neuron_level_is_refused():
    """A pre-activation block's first norm normalises the block's input: slicing it with the
    inner channels would be silently wrong, so the neuron-level planner refuses it (post-
    activation blocks of the same shapes are still planned)."""
    with pytest.raises(ValueError, match="pre-activation residual block"):
        sx.plan_subnetworks(build("preact"), 2, 0.5, "neuron")
    assert {g.kind for g in sx.plan_subnetworks(build("cifar"), 2, 0.5, "neuron").groups} == {"channel"}


def test_layernorm_in_masked_plain_stack_is_refused():
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8, elementwise_affine=False), nn.Linear(8, 3))
    with pytest.raises(ValueError, match="LayerNorm"):
        sx.plan_subnetworks(model, 2, 0.5, "neuron")


@pytest.mark.parametrize("nested", [True, False])
def test_transformer_encoder_skipping_layer0_evaluates_with_padding_mask(nested):
    name = "encoder_nested" if nested else "encoder_plain"
    results = from_numpy(run_distributed(_step_worker, 2, name, "block"))
    model = build(name)
    plan = sx.plan_subnetworks(model, 2, 0.5, "block")
    refs = [reference_subnetwork(model, plan, k) for k in range(2)]
    expected = expected_sgd_step(model, plan, refs, lambda m, k: loss_of(name, m, k), LR)
    assert not all(bool(plan.owners[k, 0]) for k in range(2))  # some rank skips layer 0
    for k, r in enumerate(results):
        assert max_diff(r["theta1"], expected) < 1e-5
        # The reference subnetwork: an encoder made of the layers rank k owns (same nested setting).
        ref = build(name)
        ref.load_state_dict(r["state"])
        ref.encoder.layers = nn.ModuleList([layer for i, layer in enumerate(ref.encoder.layers)
                                            if bool(plan.owners[k, i])])
        ref.encoder.num_layers = len(ref.encoder.layers)
        ref.eval()
        with torch.no_grad():
            want = ref(r["x"], r["pad"])
        assert torch.allclose(r["eval"], want, atol=1e-5), (r["eval"] - want).abs().max()

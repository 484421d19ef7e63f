"""Residual blocks are whole units and skipping one is the identity (docs/design.md §1.1).

Blocks with several residual branches (pre-LN, post-LN and parallel GPT blocks, a block
with three adds, post-activation ResNet blocks with a projection, pre-activation
bottlenecks): every parameter off the identity path belongs to the unit, and a rank that
does not own a block computes the model with that block replaced by the identity (or its
shortcut projection, + ReLU after a post-activation sum). References are computed here by
calling the remaining blocks by hand; held fractions are counted here from
named_parameters() and from what a simulated rank actually holds.
"""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import subnet_ext as sx
from subnet_ext.models.gpt import GPT, MLP, CausalSelfAttention, GPTConfig
from subnet_ext.testing import run_distributed

CFG = GPTConfig(block_size=32, vocab_size=65, n_layer=4, n_head=4, n_embd=64)
SMALL = GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=16)


def plan_quietly(*args, **kwargs):
    """plan_subnetworks without the coverage-1/K warning (tested on its own below)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sx.plan_subnetworks(*args, **kwargs)


def gpt(cfg=CFG, **overrides):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**cfg.__dict__, **overrides}))


class PostLNBlock(nn.Module):
    """Post-LN block (the original Transformer's order): a norm after each residual add."""

    def __init__(self, cfg):
        super().__init__()
        self.attn, self.ln_1 = CausalSelfAttention(cfg), nn.LayerNorm(cfg.n_embd)
        self.mlp, self.ln_2 = MLP(cfg), nn.LayerNorm(cfg.n_embd)

    def forward(self, x):
        x = self.ln_1(x + self.attn(x))
        return self.ln_2(x + self.mlp(x))


class ThreeAddBlock(nn.Module):
    """Three residual branches, one of them reading the stream without a norm."""

    def __init__(self, width):
        super().__init__()
        self.norm, self.a, self.b, self.c = nn.LayerNorm(width), nn.Linear(width, width), \
            nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        x = x + self.a(self.norm(x))
        x = self.b(F.gelu(x)) + x
        return x + self.c(x).tanh()


class Stack(nn.Module):
    """x [B, T, 8] -> [B, T, 3] through a ModuleList of residual blocks of width E."""

    def __init__(self, blocks, width):
        super().__init__()
        self.inp, self.h, self.out = nn.Linear(8, width), nn.ModuleList(blocks), nn.Linear(width, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.h:
            x = block(x)
        return self.out(x)


class PostActBlock(nn.Module):
    """conv-bn-relu-conv-bn + match(x), ReLU after the sum; the projection has an unusual name."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.match = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) \
            if stride != 1 or cin != cout else None

    def forward(self, x):
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (self.match(x) if self.match is not None else x))


class PreActBottleneck(nn.Module):
    """bn-relu-conv x 3 (1x1, 3x3, 1x1) + x, no ReLU after the sum."""

    def __init__(self, width, inner):
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(width), nn.Conv2d(width, inner, 1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(inner), nn.Conv2d(inner, inner, 3, 1, 1, bias=False)
        self.bn3, self.conv3 = nn.BatchNorm2d(inner), nn.Conv2d(inner, width, 1, bias=False)

    def forward(self, x):
        out = self.conv1(F.relu(self.bn1(x)))
        out = self.conv2(F.relu(self.bn2(out)))
        return self.conv3(F.relu(self.bn3(out))) + x


class ConvNet(nn.Module):
    """x [B, 3, 8, 8] -> [B, 4]."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.layers = nn.Sequential(PostActBlock(8, 8), PostActBlock(8, 16, 2), PreActBottleneck(16, 4),
                                    PreActBottleneck(16, 4))
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


def _skipped(block, x):
    """What an unowned block must compute, written from each block's definition."""
    if isinstance(block, PostActBlock):
        return F.relu(block.match(x) if block.match is not None else x)
    return x  # transformer blocks and pre-activation blocks: the identity


def build(kind):
    torch.manual_seed(0)
    if kind == "pre_ln":
        return gpt(SMALL)
    if kind == "parallel":
        return gpt(SMALL, parallel_residual=True)
    if kind == "post_ln":
        return Stack([PostLNBlock(SMALL) for _ in range(2)], SMALL.n_embd)
    if kind == "three_adds":
        return Stack([ThreeAddBlock(16) for _ in range(2)], 16)
    return ConvNet()


def blocks_of(model):
    return model.transformer.h if isinstance(model, GPT) else model.h if isinstance(model, Stack) else model.layers


def sample(kind):
    g = torch.Generator().manual_seed(5)
    if kind in ("pre_ln", "parallel"):
        return torch.randint(0, SMALL.vocab_size, (2, 6), generator=g)
    return torch.randn(2, 6, 8, generator=g) if kind in ("post_ln", "three_adds") else torch.randn(3, 3, 8, 8,
                                                                                                   generator=g)


def by_hand(model, x, owned):
    """The model's output with block i run when owned[i], else replaced by its skip path."""
    blocks = blocks_of(model)
    if isinstance(model, GPT):
        t = model.transformer
        h = t.drop(t.wte(x) + t.wpe(torch.arange(x.shape[1])))
    else:
        h = model.inp(x) if isinstance(model, Stack) else model.stem(x)
    for block, own in zip(blocks, owned):
        h = block(h) if own else _skipped(block, h)
    if isinstance(model, GPT):
        return model.lm_head(model.transformer.ln_f(h))
    return model.out(h) if isinstance(model, Stack) else model.fc(h.mean((2, 3)))


def logits(out):
    return out[0] if isinstance(out, tuple) else out


KINDS = ["pre_ln", "parallel", "post_ln", "three_adds", "resnet"]


@pytest.mark.parametrize("kind", KINDS)
def test_unowned_block_is_its_skip_path(kind):
    """Forward regime: rank r's output is the model with its unowned blocks replaced by their
    skip paths; backward regime: the full forward, and no gradient reaches an unowned block."""
    model = build(kind)
    plan = plan_quietly(model, 2, 0.5, "block")  # recognised without declarations
    paths = [g.path for g in plan.groups]
    assert len(paths) == len(blocks_of(model))
    owned_by = [[bool(plan.owners[r, a]) for a, _ in plan.unit_ranges] for r in range(2)]
    assert all(any(o) and not all(o) for o in owned_by)  # each rank skips a block and runs one
    x = sample(kind)
    for r in range(2):
        sdp = sx.SubnetDataParallel(copy.deepcopy(model), plan, regime="forward", simulate_rank=r)
        with torch.no_grad():
            got, want = logits(sdp(x)), logits(by_hand(model, x, owned_by[r]))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

        back = sx.SubnetDataParallel(copy.deepcopy(model), plan, regime="backward", simulate_rank=r)
        out = logits(back(x))
        torch.testing.assert_close(out, logits(model(x)), rtol=1e-5, atol=1e-5)
        out.square().mean().backward()
        grads = {n for n, p in back.module.named_parameters() if p.grad is not None}
        for g, own in zip(plan.groups, owned_by[r]):
            assert grads & set(g.params) == (set(g.params) if own else set()), (r, g.path)


def test_post_ln_norms_and_every_branch_are_in_the_unit():
    """Post-LN: the norms after the adds belong to the unit; a three-add block holds all its
    branches; a post-activation block's projection stays shared."""
    for kind in ("post_ln", "three_adds", "pre_ln", "parallel"):
        model = build(kind)
        plan = plan_quietly(model, 2, 0.5, "block")
        for g, block in zip(plan.groups, blocks_of(model)):
            assert sorted(g.params) == sorted(f"{g.path}.{n}" for n, _ in block.named_parameters()), kind
            assert g.skip == "identity"
    plan = plan_quietly(build("resnet"), 2, 0.5, "block")
    assert [g.skip for g in plan.groups] == ["shortcut_relu", "shortcut_relu", "identity", "identity"]
    assert "layers.1.match.0.weight" in plan.shared and "layers.1.conv1.weight" in plan.groups[1].params


def _held_by_count(model, plan, rank):
    """Fraction of the model's parameters rank `rank` holds, counted from named_parameters()
    (tied tensors once) and the plan's unit membership."""
    params = dict(model.named_parameters())
    in_units = {}
    for g, (a, _) in zip(plan.groups, plan.unit_ranges):
        for n in g.params:
            in_units[n] = bool(plan.owners[rank, a])
    held = sum(p.numel() for n, p in params.items() if in_units.get(n, True))
    return held / sum(p.numel() for p in params.values())


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("declared", [False, True])
def test_whole_blocks_hold_about_the_coverage(world, declared):
    """A GPT whose blocks dominate its parameters: at C = 0.5 each rank holds at most
    C + 0.06 of them, counted by hand and by what a simulated forward-regime rank holds;
    summary() reports each unit's parameters and each rank's held fraction, without warning."""
    model = gpt()
    blocks = [f"transformer.h.{i}" for i in range(CFG.n_layer)] if declared else None
    plan = plan_quietly(model, world, 0.5, "block", blocks=blocks)
    total = sum(p.numel() for p in model.parameters())
    fractions = [_held_by_count(model, plan, r) for r in range(world)]
    assert max(fractions) <= 0.5 + 0.06, fractions
    for r in range(world):
        sdp = sx.SubnetDataParallel(copy.deepcopy(model), plan, regime="forward", simulate_rank=r)
        assert sum(p.numel() for p in sdp.parameters()) / total == pytest.approx(fractions[r])
    text = plan.summary()
    per_block = sum(p.numel() for p in model.transformer.h[0].parameters())
    assert f"| transformer.h.0 | block | 1 | {per_block:,} |" in text
    assert all(f"| {f:.1%} |" in text for f in fractions)
    assert "hold up to" not in text  # no rank far above the coverage (the co-training warning may stand)


def test_summary_warns_when_shared_parameters_lift_a_rank():
    """A large vocabulary (shared embedding) makes every rank hold far more than C."""
    model = gpt(SMALL, vocab_size=2048)
    plan = plan_quietly(model, 2, 0.5, "block")
    worst = max(_held_by_count(model, plan, r) for r in range(2))
    assert worst > 0.6
    text = plan.summary()
    assert f"hold up to {worst:.1%} of the model's parameters at coverage 0.5" in text
    assert "transformer.wte.weight" in text.split("hold up to")[1]


def test_declared_module_without_a_residual_add_is_refused():
    model = gpt()
    with pytest.raises(ValueError, match=r"'transformer\.h\.0\.attn' \(CausalSelfAttention\) is not a residual "
                                         r"block.*declare the enclosing residual block 'transformer\.h\.0'"):
        sx.plan_subnetworks(model, 2, 0.5, "block", blocks=[f"transformer.h.{i}.attn" for i in range(4)])
    with pytest.raises(ValueError, match=r"'transformer\.h\.1\.mlp\.c_fc' \(Linear\) is not a residual block"):
        sx.plan_subnetworks(model, 2, 0.5, "block", blocks=["transformer.h.0", "transformer.h.1.mlp.c_fc"])


class UntraceableBlock(nn.Module):
    """A residual block with data-dependent control flow in its own forward (torch.fx cannot trace it)."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        if bool((x.abs() > 1e3).any()):
            x = x.clamp(-1e3, 1e3)
        return x + self.fc(x)


def test_untraceable_declared_block_is_refused_not_guessed():
    model = Stack([UntraceableBlock(16), UntraceableBlock(16)], 16)
    with pytest.raises(ValueError, match=r"'h\.0' \(UntraceableBlock\): torch\.fx cannot trace it.*will not guess"):
        sx.plan_subnetworks(model, 2, 0.5, "block", blocks=["h.0", "h.1"])
    with pytest.raises(ValueError, match="no block-level unit"):
        sx.plan_subnetworks(model, 2, 0.5, "block")  # not taken as a block without a declaration either


def _warning_worker(rank, world):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sx.plan_subnetworks(gpt(SMALL), world, 0.5, "block")
    return sum("share no unit" in str(w.message) for w in caught)


def test_coverage_one_over_k_warning_is_printed_once_across_ranks():
    assert run_distributed(_warning_worker, 2) == [1, 0]

"""Blocks torch.fx cannot trace, read from one real call traced at the dispatcher level.

- every block recognised before traced calls existed (ResNet basic/bottleneck blocks with and
  without projections, post-activation and pre-activation blocks, pre-LN, post-LN and parallel
  GPT blocks, three adds, residual MLPs, nn.TransformerEncoderLayer, timm's ViT blocks,
  transformers' GPT-2 and LLaMA layers, the bundled LLaMA): the traced call finds the same skip
  path as torch.fx's trace (mode, skip modules, ReLU, branches; the shortcut computing the same),
  or, where torch.fx cannot trace a block known by its structure, the identity it is known by;
- the blocks users write (tests/user_blocks.py) plan at block level with a sample input and no
  declaration; without one, those torch.fx cannot trace are named with the call it failed on;
- an ambiguous skip path, a tuple output and a shortcut the block computes itself are refused
  by name; a shortcut of module calls found in a traced call is what a skipped block runs.
"""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import subnet_ext as sx
from subnet_ext.planning.discovery.call_trace import RecordedCalls
from subnet_ext.planning.discovery.residual import ResidualError, trace_skip_path, traced_call_skip_path
from user_blocks import NAMES, NEED_A_CALL, SAMPLE, block_paths, build

pytestmark = pytest.mark.filterwarnings("ignore:SubnetPlan. ranks")


class PostLNBlock(nn.Module):
    def __init__(self, e=8):
        super().__init__()
        self.attn, self.ln_1, self.mlp, self.ln_2 = nn.Linear(e, e), nn.LayerNorm(e), nn.Linear(e, e), nn.LayerNorm(e)

    def forward(self, x):  # the second norm functional: an aten op on the traced call's stream
        x = self.ln_1(x + self.attn(x))
        return F.layer_norm(x + F.dropout(self.mlp(x), 0.1, self.training), (x.shape[-1],), self.ln_2.weight,
                            self.ln_2.bias)


class ThreeAddBlock(nn.Module):
    def __init__(self, e=8):
        super().__init__()
        self.norm, self.a, self.b, self.c = nn.LayerNorm(e), nn.Linear(e, e), nn.Linear(e, e), nn.Linear(e, e)

    def forward(self, x):
        x = x + self.a(self.norm(x))
        x = self.b(F.gelu(x)) + x
        return x + self.c(x).tanh()


class PostActBlock(nn.Module):
    """conv-bn-relu-conv-bn + match(x) (projection or identity), ReLU after the sum; += in place."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.match = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) \
            if stride != 1 or cin != cout else nn.Sequential()

    def forward(self, x):
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        out += self.match(x)
        return F.relu(out)


class PreActBottleneck(nn.Module):
    def __init__(self, width, inner):
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(width), nn.Conv2d(width, inner, 1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(inner), nn.Conv2d(inner, width, 3, 1, 1, bias=False)

    def forward(self, x):
        return self.conv2(F.relu(self.bn2(self.conv1(F.relu(self.bn1(x)))))) + x


class Seq(nn.Module):
    """A ModuleList of blocks between a stem and a head; x [B, ...] -> [B, out]."""

    def __init__(self, blocks, stem, head):
        super().__init__()
        self.stem, self.blocks, self.head = stem, nn.ModuleList(blocks), head

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _gpt(parallel):
    from subnet_ext.models import GPT, GPTConfig

    return GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=16, parallel_residual=parallel))


def _vit(block_fn):
    from timm.models import vision_transformer as vt

    return vt.VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=4,
                                init_values=0.5, drop_path_rate=0.1, block_fn=getattr(vt, block_fn))


def _hf(kind):
    import transformers as tf

    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=16))
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2,
                                              intermediate_size=32, num_attention_heads=2, max_position_embeddings=16))


def _encoder(norm_first):
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, norm_first=norm_first)
    return nn.Sequential(nn.Linear(6, 8), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(8, 3))


def _recognised_today():
    """{name: (model builder, sample input)}: the blocks the planner recognised before traced calls."""
    from torchvision.models import resnet as tv
    from subnet_ext.models import LlamaConfig, LlamaForCausalLM, ResidualMLP, resnet18

    image = ((1, 3, 16, 16), torch.float32)
    tokens = ((1, 8), torch.long)
    return {
        "residual_mlp": (lambda: ResidualMLP(6, 3, width=8, depth=2, hidden=16), ((2, 6), torch.float32)),
        "bundled_resnet18": (lambda: resnet18(num_classes=4, width=8), image),
        "torchvision_basic": (lambda: tv.ResNet(tv.BasicBlock, [1, 1, 1, 1], num_classes=4), image),
        "torchvision_bottleneck": (lambda: tv.ResNet(tv.Bottleneck, [1, 1, 1, 1], num_classes=4), image),
        "post_activation": (lambda: Seq([PostActBlock(4, 4), PostActBlock(4, 8, 2)], nn.Conv2d(3, 4, 1),
                                        nn.Flatten()), image),
        "pre_activation": (lambda: Seq([PreActBottleneck(4, 2), PreActBottleneck(4, 2)], nn.Conv2d(3, 4, 1),
                                       nn.Flatten()), image),
        "post_ln": (lambda: Seq([PostLNBlock(), PostLNBlock()], nn.Linear(6, 8), nn.Linear(8, 3)),
                    ((2, 5, 6), torch.float32)),
        "three_adds": (lambda: Seq([ThreeAddBlock(), ThreeAddBlock()], nn.Linear(6, 8), nn.Linear(8, 3)),
                       ((2, 5, 6), torch.float32)),
        "gpt_pre_ln": (lambda: _gpt(False), tokens),
        "gpt_parallel": (lambda: _gpt(True), tokens),
        "encoder_post_ln": (lambda: _encoder(False), ((2, 5, 6), torch.float32)),
        "encoder_pre_ln": (lambda: _encoder(True), ((2, 5, 6), torch.float32)),
        "timm_block": (lambda: _vit("Block"), image),
        "timm_res_post": (lambda: _vit("ResPostBlock"), image),
        "timm_parallel_scaling": (lambda: _vit("ParallelScalingBlock"), image),
        "timm_parallel_things": (lambda: _vit("ParallelThingsBlock"), image),
        "hf_gpt2": (lambda: _hf("gpt2"), tokens),
        "hf_llama": (lambda: _hf("llama"), tokens),
        "bundled_llama": (lambda: LlamaForCausalLM(LlamaConfig(32, 16, 32, 2, 2, 1, 8, max_position_embeddings=16)),
                          tokens),
    }


RECOGNISED = _recognised_today()


def _fresh(builder):
    torch.manual_seed(0)
    return builder()


@pytest.mark.parametrize("name", sorted(RECOGNISED))
def test_traced_call_finds_what_torch_fx_finds(name):
    builder, sample = RECOGNISED[name]
    planned = sx.plan_subnetworks(_fresh(builder), 2, 0.5, "block")  # the blocks, found as before
    assert planned.groups
    model, twin = _fresh(builder), _fresh(builder)  # torch.fx traces one, the traced call reads the other
    calls = RecordedCalls(model, sample)
    for group in planned.groups:
        meta_block, args, kwargs = calls.call_of(group.path)
        from_call = traced_call_skip_path(model.get_submodule(group.path), meta_block, args, kwargs)
        try:
            by_fx = trace_skip_path(twin.get_submodule(group.path))
        except ResidualError as e:  # a block known by its structure: its input passes through
            assert e.untraceable and group.skip == "identity", (group.path, e)
            assert (from_call.mode, from_call.modules) == ("identity", ()), group.path
            continue
        got = (from_call.mode, from_call.modules, from_call.relu, from_call.branches)
        assert got == (by_fx.mode, by_fx.modules, by_fx.relu, by_fx.branches), group.path
        assert from_call.mode == group.skip
        if from_call.modules:  # the shortcut a skipped block runs computes what torch.fx's computes
            block = twin.get_submodule(group.path).eval()
            x = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                torch.testing.assert_close(from_call.forward(block, x), by_fx.forward(block, x))


@pytest.mark.parametrize("name", NAMES)
def test_user_blocks_plan_at_block_level(name):
    plan = sx.plan_subnetworks(build(name), 2, 0.5, "block", sample_input=SAMPLE)
    assert [g.path for g in plan.groups] == block_paths(name)
    assert {g.skip for g in plan.groups} == {"identity"}
    params = [n for n, _ in build(name).named_parameters() if n.startswith(block_paths(name)[0] + ".")]
    assert sorted(plan.groups[0].params) == sorted(params)  # every parameter of the block is the unit's
    if name not in NEED_A_CALL:
        assert [g.path for g in sx.plan_subnetworks(build(name), 2, 0.5, "block").groups] == block_paths(name)
        return
    with pytest.raises(ValueError) as refused:
        sx.plan_subnetworks(build(name), 2, 0.5, "block")
    message = str(refused.value)
    cls = type(build(name).get_submodule(block_paths(name)[0])).__name__
    assert f"{block_paths(name)[0]!r}" in message and cls in message and "sample_input=" in message, message
    assert "torch.fx cannot trace it" in message
    if name in ("pre_ln_mha", "sdpa"):  # the call it failed on, with its line
        assert "user_blocks.py:" in message and "torch.ones(T, T" in message, message


def test_declared_block_without_a_sample_input_names_the_call():
    with pytest.raises(ValueError) as refused:
        sx.plan_subnetworks(build("pre_ln_mha"), 2, 0.5, "block", blocks=["blocks.1"])
    message = str(refused.value)
    assert message.startswith("block 'blocks.1' (PreLNBlock): torch.fx cannot trace it (TypeError: ")
    assert "torch.ones(T, T" in message and "sample_input=" in message
    plan = sx.plan_subnetworks(build("pre_ln_mha"), 2, 0.5, "block", blocks=["blocks.1"], sample_input=SAMPLE)
    assert [g.path for g in plan.groups] == ["blocks.1"]


class Ambiguous(nn.Module):
    """Two residual chains of equal cost: which one carries the input is a guess."""

    def __init__(self, e=16):
        super().__init__()
        self.a, self.b = nn.Linear(e, e), nn.Linear(e, e)

    def forward(self, x):
        T = x.shape[1]  # noqa: N806
        gate = torch.ones(T, 1, device=x.device)
        return (x + self.a(x) * gate) + (x + self.b(x))


class TupleOut(nn.Module):
    def __init__(self, e=16):
        super().__init__()
        self.ln, self.f = nn.LayerNorm(e), nn.Linear(e, e)

    def forward(self, x):
        T = x.shape[1]  # noqa: N806
        return x + self.f(self.ln(x)) * torch.ones(T, 1, device=x.device), None


class TupleLM(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.emb, self.blocks, self.head = nn.Embedding(32, 16), nn.ModuleList([block(), block()]), nn.Linear(16, 32)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
            x = x[0] if isinstance(x, tuple) else x
        return self.head(x)


@pytest.mark.parametrize("block,why", [(Ambiguous, "two operands carry it at equal cost (ambiguous)"),
                                       (TupleOut, "returns a tuple, not one tensor")])
def test_an_unreadable_traced_call_is_refused_by_name(block, why):
    with pytest.raises(ValueError) as declared:
        sx.plan_subnetworks(TupleLM(block), 2, 0.5, "block", blocks=["blocks.0"], sample_input=SAMPLE)
    assert str(declared.value).startswith(f"block 'blocks.0' ({block.__name__})") and why in str(declared.value)
    with pytest.raises(ValueError) as found:  # not taken as a block; the error names it and why
        sx.plan_subnetworks(TupleLM(block), 2, 0.5, "block", sample_input=SAMPLE)
    assert f"'blocks.0' and 1 more (blocks.*) ({block.__name__})" in str(found.value) and why in str(found.value)


def test_blocks_left_out_are_named_in_the_summary():
    """A container mixing traceable and untraceable blocks, without a sample input: the traceable
    ones are units, the others are named in the summary with why."""
    from user_blocks import PreLNBlock, TokenLM

    model = TokenLM(PreLNBlock)
    model.blocks[1] = _ResidualMLP()
    plan = sx.plan_subnetworks(model, 2, 0.5, "block")
    assert [g.path for g in plan.groups] == ["blocks.1"]
    summary = plan.summary()
    assert "not split (held whole by every rank):\n- 'blocks.0' (PreLNBlock): torch.fx cannot trace it" in summary


class _ResidualMLP(nn.Module):
    def __init__(self, e=16):
        super().__init__()
        self.fc = nn.Linear(e, e)

    def forward(self, x):
        return x + self.fc(x)


class BranchingResBlock(nn.Module):
    """A post-activation block with a projection shortcut and a branch on a size (torch.fx cannot
    trace it; not ResNet-shaped by name)."""

    def __init__(self, cin, cout, own_pool=False):
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.n2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.own_pool = own_pool

    def forward(self, x):
        out = self.n2(self.c2(F.relu(self.n1(self.c1(x)))))
        if x.size(-1) > 2:
            out = out * 1.0
        shortcut = self.down(F.avg_pool2d(x, 1) if self.own_pool else x)
        return F.relu(out + shortcut)


def _conv_net(own_pool=False):
    torch.manual_seed(0)
    return Seq([BranchingResBlock(4, 8, own_pool), BranchingResBlock(8, 8, own_pool)], nn.Conv2d(3, 4, 1),
               nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)))


def test_a_shortcut_found_in_a_traced_call_is_what_a_skipped_block_runs():
    image = ((1, 3, 8, 8), torch.float32)
    full = _conv_net()
    plan = sx.plan_subnetworks(full, 2, 0.5, "block", sample_input=image)
    assert [g.skip for g in plan.groups] == ["shortcut_relu"] * 2
    assert all(not any(".down." in n for n in g.params) for g in plan.groups)  # the shortcut is shared
    skipper = next(r for r in range(2) if not bool(plan.owners[r, 0]))
    reference = copy.deepcopy(full).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sdp = sx.SubnetDataParallel(full, plan, regime="forward", simulate_rank=skipper)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    sdp.module.eval()
    with torch.no_grad():
        got = sdp.module.blocks[0](reference.stem(x))
        want = F.relu(reference.blocks[0].down(reference.stem(x)))
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError) as refused:  # a shortcut with an op of the block's own: not replayed
        sx.plan_subnetworks(_conv_net(own_pool=True), 2, 0.5, "block", sample_input=image, blocks=["blocks.0"])
    assert "its shortcut computes ['aten.avg_pool2d.default'] in the block's own forward" in str(refused.value)

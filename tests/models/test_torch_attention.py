"""torch's nn.MultiheadAttention at the neuron level: its heads are units.

References are torch's own module: a rank's subnetwork is the full nn.MultiheadAttention with
the columns of out_proj.weight of the heads the rank does not own zeroed (heads are independent,
so the kept heads compute exactly that), run by torch's forward with the same arguments.

- planning: packed and separate in-projections (kdim/vdim), with and without bias, batch_first
  both ways: one head group of num_heads units; each rank holds the parameters the test counts
  for its heads (about half at coverage 0.5, not 68.6% as with the heads shared); the summary
  names every module left whole and why (add_bias_kv, a subclass, the attention inside
  nn.TransformerEncoderLayer, an attention it does not recognise, a head with no consumer);
- forward regime, both ranks of 2 simulated, every variant: outputs (masks 2-D and per-head 3-D,
  key padding, is_causal, need_weights averaged or not, unbatched, add_zero_attn) and the
  compact weights' gradients equal the reference's; scale="inverse" scales the kept heads;
- backward regime, simulated: the full forward, gradients only for the owned heads, equal to
  the full module's there;
- 2 gloo ranks, both regimes, two layouts: one SGD step equals the owner mean of the references'
  gradients, the full state loads strictly into the original model, close() gives torch's
  module back.
"""
import copy
import itertools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import subnet_ext as sx
from subnet_ext.testing import run_distributed
from subnet_reference import expected_sgd_step, from_numpy, max_diff, ownership_masks, to_numpy

E, H, D, KDIM, VDIM = 16, 4, 4, 8, 12
N, L, S = 2, 5, 6
LR = 0.1
VARIANTS = [dict(batch_first=bf, separate=sep, bias=bias)
            for bf, sep, bias in itertools.product([True, False], [False, True], [True, False])]

pytestmark = pytest.mark.filterwarnings("ignore:SubnetPlan. ranks")


class Net(nn.Module):
    """An attention between two shared layers: q [N, L, E] (k, v [N, S, kdim/vdim]) -> [N, L, 3]."""

    def __init__(self, batch_first=True, separate=False, bias=True, zero=False):
        super().__init__()
        kdims = dict(kdim=KDIM, vdim=VDIM) if separate else {}
        self.attn = nn.MultiheadAttention(E, H, bias=bias, batch_first=batch_first, add_zero_attn=zero, **kdims)
        self.head = nn.Linear(E, 3)
        self.batch_first = batch_first

    def forward(self, q, k, v, **kwargs):
        if not self.batch_first:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        out = self.attn(q, k, v, **kwargs)[0]
        return self.head(out.transpose(0, 1) if not self.batch_first else out)


def net(seed=0, **variant):
    torch.manual_seed(seed)
    return Net(**variant)


def inputs(variant, seed=1):
    g = torch.Generator().manual_seed(seed)
    kdim, vdim = (KDIM, VDIM) if variant["separate"] else (E, E)
    return torch.randn(N, L, E, generator=g), torch.randn(N, S, kdim, generator=g), torch.randn(N, S, vdim, generator=g)


def plan_of(model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sx.plan_subnetworks(model, 2, 0.5, "neuron", **kwargs)


def owned_heads(plan, rank):
    a, b = plan.unit_ranges[0]
    return torch.nonzero(plan.owners[rank, a:b]).flatten().tolist()


def reference(model, heads):
    """The full model with the out_proj columns of every other head zeroed (the rank's subnetwork)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for h in range(H):
            if h not in heads:
                ref.attn.out_proj.weight[:, h * D:(h + 1) * D] = 0
    return ref


def rows(heads, blocks=3):
    return torch.cat([torch.arange(b * E + h * D, b * E + (h + 1) * D) for b in range(blocks) for h in heads])


def columns(heads):
    return torch.cat([torch.arange(h * D, (h + 1) * D) for h in heads])


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_heads_are_units_and_each_rank_holds_its_heads(variant):
    model = net(**variant)
    plan = plan_of(model)
    assert [(g.kind, g.path, g.size) for g in plan.groups] == [("head", "attn", H)]
    total = sum(p.numel() for p in model.parameters())
    per_head = 3 * D * E if not variant["separate"] else D * (E + KDIM + VDIM)  # q, k, v rows
    per_head += (3 * D if variant["bias"] else 0) + E * D  # their biases, the out_proj columns
    for rank in range(2):
        sdp = sx.SubnetDataParallel(copy.deepcopy(model), plan, regime="forward", simulate_rank=rank)
        held = sum(p.numel() for p in sdp.parameters())
        assert held == total - (H - len(owned_heads(plan, rank))) * per_head
        assert held / total < 0.6


def _check_forward(variant, rank, call):
    model = net(**variant)
    plan = plan_of(model)
    heads = owned_heads(plan, rank)
    sdp = sx.SubnetDataParallel(copy.deepcopy(model), plan, regime="forward", simulate_rank=rank)
    ref = reference(model, heads)
    got, want = call(sdp.module), call(ref)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.square().sum().backward()
    want.square().sum().backward()
    attn, full = sdp.module.attn, ref.attn
    if variant["separate"]:
        for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
            torch.testing.assert_close(getattr(attn, name).grad, getattr(full, name).grad[rows(heads, 1)])
    else:
        torch.testing.assert_close(attn.in_proj_weight.grad, full.in_proj_weight.grad[rows(heads)])
    if variant["bias"]:
        torch.testing.assert_close(attn.in_proj_bias.grad, full.in_proj_bias.grad[rows(heads)])
    torch.testing.assert_close(attn.out_proj.weight.grad, full.out_proj.weight.grad[:, columns(heads)])
    return sdp


CALLS = {
    "plain": lambda q, k, v: dict(need_weights=False),
    "causal_2d": lambda q, k, v: dict(attn_mask=torch.triu(torch.ones(L, S, dtype=torch.bool), 1), need_weights=False),
    "is_causal": lambda q, k, v: dict(attn_mask=torch.triu(torch.ones(L, S, dtype=torch.bool), 1), is_causal=True,
                                      need_weights=False),
    "per_head_3d": lambda q, k, v: dict(attn_mask=torch.randn(N * H, L, S, generator=torch.Generator().manual_seed(4))),
    "padding": lambda q, k, v: dict(key_padding_mask=torch.tensor([[False] * S, [False] * 4 + [True] * 2])),
    "padding_and_mask": lambda q, k, v: dict(key_padding_mask=torch.tensor([[False] * S, [False] * 3 + [True] * 3]),
                                             attn_mask=torch.zeros(L, S, dtype=torch.bool), need_weights=False),
}


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("rank", [0, 1])
def test_forward_regime_computes_the_kept_heads(variant, rank):
    q, k, v = inputs(variant)
    for name, masks in CALLS.items():
        _check_forward(variant, rank, lambda m: m(q, k, v, **masks(q, k, v)))


@pytest.mark.parametrize("rank", [0, 1])
def test_forward_regime_weights_unbatched_and_zero_attention(rank):
    """need_weights: the kept heads' weights, averaged over them or per head; unbatched inputs;
    add_zero_attn."""
    variant = dict(batch_first=True, separate=False, bias=True)
    model = net(**variant)
    plan = plan_of(model)
    heads = owned_heads(plan, rank)
    sdp = sx.SubnetDataParallel(copy.deepcopy(model), plan, regime="forward", simulate_rank=rank)
    ref = reference(model, heads)
    q, k, v = inputs(variant)
    mask = torch.triu(torch.ones(L, S, dtype=torch.bool), 1)
    out, weights = sdp.module.attn(q, k, v, attn_mask=mask, average_attn_weights=False)
    want, want_weights = ref.attn(q, k, v, attn_mask=mask, average_attn_weights=False)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(weights, want_weights[:, heads])
    averaged = sdp.module.attn(q, k, v, attn_mask=mask)[1]
    torch.testing.assert_close(averaged, want_weights[:, heads].mean(1))
    torch.testing.assert_close(sdp.module.attn(q[0], k[0], v[0])[0], ref.attn(q[0], k[0], v[0])[0])
    zero = net(zero=True, **variant)
    zplan = plan_of(zero)
    zsdp = sx.SubnetDataParallel(copy.deepcopy(zero), zplan, regime="forward", simulate_rank=rank)
    torch.testing.assert_close(zsdp.module(q, k, v, need_weights=False),
                               reference(zero, owned_heads(zplan, rank))(q, k, v, need_weights=False))


def test_inverse_scale_scales_the_kept_heads():
    variant = dict(batch_first=True, separate=False, bias=True)
    model = net(**variant)
    plan = plan_of(model)
    heads = owned_heads(plan, 0)
    sdp = sx.SubnetDataParallel(copy.deepcopy(model), plan, regime="forward", simulate_rank=0, scale="inverse")
    ref = reference(model, heads)
    with torch.no_grad():
        ref.attn.out_proj.weight.mul_(H / len(heads))
    q, k, v = inputs(variant)
    torch.testing.assert_close(sdp.module(q, k, v, need_weights=False), ref(q, k, v, need_weights=False))


@pytest.mark.parametrize("variant", VARIANTS[::3], ids=str)
def test_backward_regime_trains_the_owned_heads(variant):
    """One SGD step of a simulated rank: the full forward; the owned heads' rows and columns (and
    the shared tensors) move by the full module's gradient, the others not at all."""
    model = net(**variant)
    plan = plan_of(model)
    sdp = sx.SubnetDataParallel(copy.deepcopy(model), plan, regime="backward", simulate_rank=0)
    opt = torch.optim.SGD(sdp.parameters(), lr=LR)
    full = copy.deepcopy(model)
    q, k, v = inputs(variant)
    got, want = sdp(q, k, v, need_weights=False), full(q, k, v, need_weights=False)
    torch.testing.assert_close(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    opt.step()
    after, owned = sdp.local_full_state_dict(), ownership_masks(model, plan, 0)
    assert 0 < float(owned["attn.out_proj.weight"].mean()) < 1
    for name, p in full.named_parameters():
        torch.testing.assert_close(after[name], p.detach() - LR * p.grad * owned[name], rtol=1e-5, atol=1e-6)


class CustomAttention(nn.Module):
    """An attention of the user's own layout (wq, wk, wv, wo): the planner does not know its heads."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(E, E) for _ in range(4))


class MyMHA(nn.MultiheadAttention):
    pass


class Zoo(nn.Module):
    def __init__(self):
        super().__init__()
        self.ok = nn.MultiheadAttention(E, H, batch_first=True)
        self.kv = nn.MultiheadAttention(E, H, add_bias_kv=True)
        self.sub = MyMHA(E, H)
        self.enc = nn.TransformerEncoderLayer(E, H, 2 * E, batch_first=True)
        self.custom = CustomAttention()
        self.head = nn.Linear(E, 3)


def test_summary_names_every_module_left_whole():
    plan = plan_of(Zoo())
    assert [(g.path, g.kind) for g in plan.groups] == [("ok", "head"), ("enc", "neuron")]
    summary = plan.summary()
    lines = summary[summary.index("not split (held whole by every rank):"):].splitlines()
    assert lines[1].startswith("- 'kv' (MultiheadAttention): add_bias_kv=True"), lines
    assert lines[2].startswith("- 'sub' (MyMHA): a subclass of nn.MultiheadAttention"), lines
    assert lines[3].startswith("- 'enc.self_attn' (MultiheadAttention): inside nn.TransformerEncoderLayer"), lines
    assert lines[4].startswith("- 'custom' (CustomAttention): an attention layout the planner does not recognise"), lines
    assert lines[5] == "- 'head' (Linear): no neuron group pairs its outputs with the layer that consumes them", lines
    with pytest.raises(ValueError) as none:  # nothing to split: the error names what was left whole first
        plan_of(nn.Sequential(CustomAttention(), nn.Linear(E, 3)))
    assert "layer '0' (CustomAttention): an attention layout the planner does not recognise" in str(none.value)


LAYOUTS = {"packed_batch_first": dict(batch_first=True, separate=False, bias=True),
           "separate_sequence_first": dict(batch_first=False, separate=True, bias=False)}


def loss_of(layout, module, rank, step=0):
    q, k, v = inputs(LAYOUTS[layout], seed=100 * step + rank)
    mask = torch.triu(torch.ones(L, S, dtype=torch.bool), 1)
    logits = module(q, k, v, attn_mask=mask, need_weights=False)
    target = torch.randint(0, 3, (N, L), generator=torch.Generator().manual_seed(7 + rank))
    return F.cross_entropy(logits.reshape(-1, 3), target.reshape(-1))


def _train_worker(rank, world):
    out = {}
    for layout, variant in LAYOUTS.items():
        for regime in ("forward", "backward"):
            model = net(**variant)
            plan = plan_of(model)
            sdp = sx.SubnetDataParallel(model, plan, regime=regime)
            opt = torch.optim.SGD(sdp.parameters(), lr=LR)
            loss_of(layout, sdp, rank).backward()
            opt.step()
            theta1 = sdp.full_state_dict()
            fresh = net(seed=1, **variant)
            fresh.load_state_dict(theta1, strict=True)
            sdp.close()
            given_back = type(model.attn) is nn.MultiheadAttention and all(
                torch.equal(t, theta1[n]) for n, t in model.state_dict().items())
            out[layout, regime] = {"theta1": theta1, "given_back": given_back}
    return to_numpy(out)


def test_two_ranks_train_the_heads_in_both_regimes():
    results = from_numpy(run_distributed(_train_worker, 2))
    for layout, variant in LAYOUTS.items():
        model = net(**variant)
        plan = plan_of(model)
        for regime in ("forward", "backward"):
            refs = [reference(model, owned_heads(plan, k)) if regime == "forward" else copy.deepcopy(model)
                    for k in range(2)]
            expected = expected_sgd_step(model, plan, refs, lambda m, k: loss_of(layout, m, k), LR)
            for rank, result in enumerate(results):
                got = result[layout, regime]
                assert max_diff(got["theta1"], expected) < 1e-5, (layout, regime, rank)
                assert got["given_back"], (layout, regime, rank)

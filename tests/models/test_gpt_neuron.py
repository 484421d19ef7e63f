"""A nanoGPT-style GPT at neuron level, without declarations: MLP neurons through nn.Linear
c_fc/c_proj, heads through a fused nn.Linear c_attn. The forward regime's sliced model
equals the full model with the unowned heads and neurons zeroed at their consumer's input
(subnet_reference.py); it trains, its full state loads strictly into a fresh GPT, and
close() gives back the head-count attributes. An attention that reshapes by a fixed
width (nanoGPT's verbatim pattern) or by a head count slicing does not update keeps its
width instead (found at wrap time)."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import subnet_ext as sx
from subnet_ext.models.gpt import GPT, CausalSelfAttention, GPTConfig
from subnet_ext.testing import run_distributed
from subnet_reference import reference_subnetwork

CFG = GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=4, n_embd=32)
HEAD_DIM = CFG.n_embd // CFG.n_head


def gpt(**overrides):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**CFG.__dict__, **overrides}))


def plan_quietly(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sx.plan_subnetworks(*args, **kwargs)


def tokens(rank, n=4, t=12):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, CFG.vocab_size, (n, t + 1), generator=g)


def test_gpt_heads_and_neurons_recognised():
    plan = plan_quietly(gpt(), 2, 0.5, "neuron")
    e = CFG.n_embd
    assert [(g.path, g.kind, g.size) for g in plan.groups] == [
        (f"transformer.h.{i}.{m}", k, n) for i in range(CFG.n_layer)
        for m, k, n in (("attn", "head", CFG.n_head), ("mlp", "neuron", 4 * e))]

    def role(m):  # (projection, tensor, dim, width, offset) of a member
        return tuple(m.name.split(".")[-2:]) + (m.dim, m.width, m.offset)

    assert {role(m) for m in plan.groups[0].members} == \
        {("c_attn", leaf, 0, HEAD_DIM, off) for leaf in ("weight", "bias") for off in (0, e, 2 * e)} | \
        {("c_proj", "weight", 1, HEAD_DIM, 0)}
    assert {role(m) for m in plan.groups[1].members} == \
        {("c_fc", "weight", 0, 1, 0), ("c_fc", "bias", 0, 1, 0), ("c_proj", "weight", 1, 1, 0)}


@pytest.mark.parametrize("parallel", [False, True])
def test_sliced_gpt_equals_zeroed_reference(parallel):
    model = gpt(parallel_residual=parallel)
    plan = plan_quietly(model, 2, 0.5, "neuron")
    widths = {g.path: (g.path + ".c_proj", HEAD_DIM if g.kind == "head" else 1) for g in plan.groups}
    idx = tokens(0)[:, :-1]
    for r in range(2):
        sdp = sx.SubnetDataParallel(copy.deepcopy(model), plan, regime="forward", simulate_rank=r)
        attn = sdp.module.transformer.h[0].attn
        kept = int(plan.owners[r, plan.unit_ranges[0][0]:plan.unit_ranges[0][1]].sum())
        assert kept < CFG.n_head and attn.n_head == kept and attn.n_embd == kept * HEAD_DIM
        assert sdp.module.transformer.h[0].attn.c_attn.weight.shape == (3 * kept * HEAD_DIM, CFG.n_embd)
        with torch.no_grad():
            got = sdp(idx)[0]
            want = reference_subnetwork(model, plan, r, consumer_widths=widths)(idx)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class FixedWidthAttention(CausalSelfAttention):
    """Reshapes by its stored width and the input's width, as many hand-written GPT scripts do."""

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class StoredHeadsAttention(CausalSelfAttention):
    """Reads its head count from an attribute of its own: once sliced it still runs, mixing heads."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.heads_in_use = cfg.n_head

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.heads_in_use, -1).transpose(1, 2) for z in self.c_attn(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("attention,why", [(FixedWidthAttention, "raised RuntimeError"),
                                           (StoredHeadsAttention, "mixes or drops heads")])
def test_attention_that_cannot_run_compact_keeps_its_width(attention, why):
    """Found at wrap time (sliced, it raises or mixes heads) and run with its width kept
    (tests/models/test_width_kept_attention.py has the details): the same output as the full
    model with the unowned heads zeroed; the backward regime runs the full forward."""
    model = gpt()
    for block in model.transformer.h:
        block.attn = attention(CFG)
    plan = plan_quietly(model, 2, 0.5, "neuron")
    widths = {g.path: (g.path + ".c_proj", HEAD_DIM if g.kind == "head" else 1) for g in plan.groups}
    idx = tokens(0)[:, :-1]
    with torch.no_grad():
        want = model(idx)[0]
    sdp = sx.SubnetDataParallel(copy.deepcopy(model), plan, regime="forward", simulate_rank=0)
    assert why in sdp.width_kept["transformer.h.0.attn"], sdp.width_kept
    assert sdp.module.transformer.h[0].attn.n_head == CFG.n_head  # the width is kept
    with torch.no_grad():
        torch.testing.assert_close(sdp(idx)[0], reference_subnetwork(model, plan, 0, consumer_widths=widths)(idx)[0],
                                   rtol=1e-5, atol=1e-5)
    backward = sx.SubnetDataParallel(model, plan, regime="backward", simulate_rank=0)
    with torch.no_grad():
        torch.testing.assert_close(backward(idx)[0], want)


def _ints(model):
    return {n: {k: v for k, v in vars(m).items() if type(v) is int} for n, m in model.named_modules()}


def _train_worker(rank, world):
    model = gpt()
    plan = plan_quietly(model, world, 0.5, "neuron")
    sdp = sx.SubnetDataParallel(model, plan, regime="forward")
    opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
    data = tokens(rank)
    losses = []
    for _ in range(30):
        _, loss = sdp(data[:, :-1], data[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    full = sdp.full_state_dict()
    fresh = gpt()
    fresh.load_state_dict(full, strict=True)
    sdp.close()
    with torch.no_grad():
        same_output = torch.allclose(model(data[:, :-1])[0], fresh(data[:, :-1])[0], atol=1e-6)
    return {"losses": losses, "ints_restored": _ints(model) == _ints(gpt()), "same_output": same_output}


def test_neuron_forward_regime_trains_assembles_and_closes():
    for r in run_distributed(_train_worker, 2):
        first, last = r["losses"][0], sum(r["losses"][-3:]) / 3
        assert last < 0.8 * first, r["losses"]
        assert r["ints_restored"] and r["same_output"]

"""nanoGPT's attention at the neuron level: a module that cannot run sliced keeps its width.

`NanoGPTAttention` is written the way nanoGPT's CausalSelfAttention is: `c_attn(x).split(
self.n_embd)` and `view(B, T, self.n_head, C // self.n_head)` with C taken from its input, so
its forward cannot run with its heads sliced. At wrap time the engine finds that and keeps the
module's width (engine/layers/width_keeping.py). Against a hand-written reference (each owned head's
attention computed alone from the full weights, concatenated, through the owned columns of
c_proj):

- forward regime, coverage 0.5, both ranks of 2 (simulated): weights compact, head count and
  width unchanged, plan.summary() naming the modules and why; the attention's output and the
  compact weights' gradients equal the reference's; the unowned heads' inputs to c_proj are
  exactly 0; the whole model equals the full model with the unowned heads zeroed;
- backward regime: the full forward, equal to the full attention (the reference with every
  head);
- 2 gloo ranks: coverage 0.5 trains, its full state loads into a fresh model, close() gives the
  modules back; at coverage 1 with width keeping forced (nothing is sliced, so the masked op
  runs every row) it equals torch DDP bit for bit (every loss, the final state);
- a module that computes its kept heads neither sliced nor width-kept (it applies its
  projection's weight itself) is refused by name, the model unchanged;
- on a GPU (`cuda` mark): the width-kept attention on its run path (owned heads are runs:
  GEMMs into column slices) and, with that path turned off, through the masked op's CUDA kernels.
"""
import copy
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import subnet_ext as sx
from gpu_marks import needs_cuda
from subnet_ext.testing import run_distributed
from subnet_reference import reference_subnetwork

VOCAB, CONTEXT, EMBD, HEADS, LAYERS = 32, 16, 32, 4, 2
HEAD_DIM = EMBD // HEADS


class NanoGPTAttention(nn.Module):
    """Causal self-attention as nanoGPT writes it: fused c_attn split by n_embd, heads by n_head, C from x."""

    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)
        self.n_head, self.n_embd = HEADS, EMBD

    def forward(self, x):
        B, T, C = x.size()  # noqa: N806 - nanoGPT's names
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class DirectWeightAttention(NanoGPTAttention):
    """Applies c_attn's weight itself: neither slicing nor width keeping reaches its projection."""

    def forward(self, x):
        B, T, C = x.size()  # noqa: N806
        q, k, v = F.linear(x, self.c_attn.weight, self.c_attn.bias).split(self.n_embd, dim=2)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))
        return self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(EMBD, 4 * EMBD), nn.Linear(4 * EMBD, EMBD)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(EMBD), attention(), nn.LayerNorm(EMBD), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, attention=NanoGPTAttention):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, EMBD), nn.Embedding(CONTEXT, EMBD)
        self.h = nn.ModuleList([Block(attention) for _ in range(LAYERS)])
        self.ln_f, self.lm_head = nn.LayerNorm(EMBD), nn.Linear(EMBD, VOCAB, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))
        return logits, loss


def tiny_gpt(attention=NanoGPTAttention, seed=0):
    torch.manual_seed(seed)
    return TinyGPT(attention)


def plan_quietly(model, world, coverage, level="neuron"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sx.plan_subnetworks(model, world, coverage, level)


def tokens(rank, step=0, n=4):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=g)


def owned_heads_attention(attn, x, heads):
    """The hand-written subnetwork: each owned head's attention alone, from the full weights."""
    w, b = attn.c_attn.weight, attn.c_attn.bias
    outputs = []
    for h in heads:
        q, k, v = (x @ w[off + h * HEAD_DIM: off + (h + 1) * HEAD_DIM].T + b[off + h * HEAD_DIM: off + (h + 1) *
                   HEAD_DIM] for off in (0, EMBD, 2 * EMBD))
        outputs.append(F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=True)[:, 0])
    columns = torch.cat([torch.arange(h * HEAD_DIM, (h + 1) * HEAD_DIM) for h in heads])
    return torch.cat(outputs, -1) @ attn.c_proj.weight[:, columns].T + attn.c_proj.bias


def owned_heads(plan, rank, path):
    group = next(i for i, g in enumerate(plan.groups) if g.path == path)
    a, b = plan.unit_ranges[group]
    return torch.nonzero(plan.owners[rank, a:b]).flatten().tolist()


def owned_rows(heads):
    return torch.cat([torch.arange(off + h * HEAD_DIM, off + (h + 1) * HEAD_DIM) for off in (0, EMBD, 2 * EMBD)
                      for h in heads]).sort().values


@pytest.mark.parametrize("rank", [0, 1])
def test_forward_regime_keeps_the_width_and_computes_the_owned_heads(rank):
    full = tiny_gpt()
    plan = plan_quietly(full, 2, 0.5)
    sdp = sx.SubnetDataParallel(copy.deepcopy(full), plan, regime="forward", simulate_rank=rank)
    paths = [f"h.{i}.attn" for i in range(LAYERS)]
    assert sorted(sdp.width_kept) == paths and all("raised RuntimeError" in why for why in sdp.width_kept.values())
    summary = sdp.summary()
    assert "width kept" in summary and all(f"- {p}: " in summary for p in paths), summary
    heads = owned_heads(plan, rank, "h.0.attn")
    assert 0 < len(heads) < HEADS
    attn, reference = sdp.module.h[0].attn, full.h[0].attn
    assert attn.n_head == HEADS and attn.n_embd == EMBD  # the width is kept
    assert attn.c_attn.weight.shape == (3 * len(heads) * HEAD_DIM, EMBD)  # the weights are compact
    assert attn.c_proj.weight.shape == (EMBD, len(heads) * HEAD_DIM)
    assert torch.equal(attn.c_attn.weight, reference.c_attn.weight[owned_rows(heads)])

    x = torch.randn(3, 7, EMBD, generator=torch.Generator().manual_seed(5))
    seen = []
    handle = attn.c_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    got = attn(x)
    handle.remove()
    want = owned_heads_attention(reference, x, heads)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    unowned = [h for h in range(HEADS) if h not in heads]
    assert all(bool((seen[0][..., h * HEAD_DIM:(h + 1) * HEAD_DIM] == 0).all()) for h in unowned)  # exactly 0

    got.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(attn.c_attn.weight.grad, reference.c_attn.weight.grad[owned_rows(heads)],
                               rtol=1e-5, atol=1e-6)
    columns = torch.cat([torch.arange(h * HEAD_DIM, (h + 1) * HEAD_DIM) for h in heads])
    torch.testing.assert_close(attn.c_proj.weight.grad, reference.c_proj.weight.grad[:, columns], rtol=1e-5,
                               atol=1e-6)

    idx = tokens(rank)[:, :-1]
    widths = {g.path: (g.path + ".c_proj", HEAD_DIM if g.kind == "head" else 1) for g in plan.groups}
    with torch.no_grad():
        torch.testing.assert_close(sdp(idx)[0], reference_subnetwork(full, plan, rank, consumer_widths=widths)(idx)[0],
                                   rtol=1e-5, atol=1e-5)


def test_backward_regime_runs_the_full_attention():
    full = tiny_gpt()
    sdp = sx.SubnetDataParallel(copy.deepcopy(full), plan_quietly(full, 2, 0.5), regime="backward", simulate_rank=0)
    x = torch.randn(3, 7, EMBD, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(sdp.module.h[0].attn(x), owned_heads_attention(full.h[0].attn, x, range(HEADS)),
                               rtol=1e-5, atol=1e-6)
    idx = tokens(0)[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(sdp(idx)[0], full(idx)[0], rtol=1e-5, atol=1e-6)


def test_a_module_that_runs_neither_way_is_refused():
    model = tiny_gpt(DirectWeightAttention)
    plan = plan_quietly(model, 2, 0.5)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"attention 'h\.0\.attn' \(DirectWeightAttention\).*nor with its width kept"
                                         r".*regime='backward'.*level='block'"):
        sx.SubnetDataParallel(model, plan, regime="forward", simulate_rank=0)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[n], before[n]) for n in before)


def _train(net, opt, rank, steps, fixed=False):
    """Losses of `steps` AdamW steps on this rank's batches (the same one each step when `fixed`:
    random tokens have nothing else to learn)."""
    losses = []
    for s in range(steps):
        data = tokens(rank, 0 if fixed else s)
        _, loss = net(data[:, :-1], data[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _worker(rank, world):
    out = {}
    model = tiny_gpt()
    sdp = sx.SubnetDataParallel(model, plan_quietly(model, world, 0.5))
    out["width_kept"] = sorted(sdp.width_kept)
    losses = _train(sdp, torch.optim.AdamW(sdp.parameters(), lr=1e-2), rank, 20, fixed=True)
    out["losses"] = losses
    fresh = tiny_gpt(seed=9)
    fresh.load_state_dict(sdp.full_state_dict(), strict=True)
    sdp.close()
    idx = tokens(0, 99)[:, :-1]
    with torch.no_grad():
        out["closed"] = torch.equal(model(idx)[0], fresh(idx)[0]) and model.h[0].attn.n_head == HEADS and \
            "forward" not in vars(model.h[0].attn.c_attn)

    # Coverage 1 with width keeping forced: the masked op runs every row; compared with DDP.
    from subnet_ext.engine.regimes import surgery

    original = surgery.check_sliced_heads
    surgery.check_sliced_heads = lambda m, plan, pieces, r: {g.path: "forced" for g in plan.groups if g.kind == "head"}
    try:
        model = tiny_gpt()
        sdp = sx.SubnetDataParallel(model, plan_quietly(model, world, 1.0))
        out["forced"] = sorted(sdp.width_kept)
        sdp_losses = _train(sdp, torch.optim.AdamW(sdp.parameters(), lr=1e-2), rank, 5)
        sdp_state = sdp.full_state_dict()
    finally:
        surgery.check_sliced_heads = original
    ddp = DDP(tiny_gpt())
    ddp_losses = _train(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), rank, 5)
    ddp_state = ddp.module.state_dict()
    out["coverage_one"] = (sdp_losses, ddp_losses,
                           max(float((sdp_state[k] - ddp_state[k]).abs().max()) for k in ddp_state))
    return out


def test_two_ranks_train_assemble_close_and_equal_ddp_at_coverage_one():
    for rank, r in enumerate(run_distributed(_worker, 2)):
        assert r["width_kept"] == ["h.0.attn", "h.1.attn"] and r["forced"] == r["width_kept"], r
        first, last = sum(r["losses"][:3]) / 3, sum(r["losses"][-3:]) / 3
        assert first > math.log(VOCAB) - 0.5 and last < first - 0.5, r["losses"]
        assert r["closed"], rank
        sdp_losses, ddp_losses, state_difference = r["coverage_one"]
        assert sdp_losses == ddp_losses, (sdp_losses, ddp_losses)  # bit for bit
        assert state_difference == 0, state_difference


@needs_cuda
@pytest.mark.parametrize("path", ["runs", "masked"])
def test_width_kept_attention_on_cuda(path, monkeypatch):
    """The same width-kept attention with its weights and inputs on the GPU: on the run path
    (engine/layers/width_kept_runs.py) and, with it turned off, through the masked op's CUDA kernels."""
    from subnet_ext.engine.layers import width_kept_runs

    if path == "masked":
        monkeypatch.setattr(width_kept_runs, "MIN_MEAN_RUN", 10**9)
    full = tiny_gpt().cuda()
    plan = plan_quietly(full, 2, 0.5)
    sdp = sx.SubnetDataParallel(copy.deepcopy(full), plan, regime="forward", simulate_rank=0)
    heads = owned_heads(plan, 0, "h.0.attn")
    assert "h.0.attn" in sdp.width_kept
    assert (sdp.module.h[0].attn.c_attn.runs is not None) == (path == "runs")
    x = torch.randn(3, 7, EMBD, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    seen = []
    attn = sdp.module.h[0].attn
    handle = attn.c_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    got = attn(x)
    handle.remove()
    torch.testing.assert_close(got, owned_heads_attention(full.h[0].attn, x, heads), rtol=1e-4, atol=1e-5)
    unowned = [h for h in range(HEADS) if h not in heads]
    assert all(bool((seen[0][..., h * HEAD_DIM:(h + 1) * HEAD_DIM] == 0).all()) for h in unowned)
    got.square().sum().backward()
    assert attn.c_attn.weight.grad.shape == attn.c_attn.weight.shape

"""DDP + stochastic depth (subnet_ext/jobs/stochastic_depth.py).

References: the GPT's blocks run by hand (a dropped block skipped, branches scaled by p at
evaluation), and for DDP a one-process computation of the averaged gradient: each rank's
gradient with its own dropped blocks (zero there), summed and divided by K.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from subnet_ext.jobs.arguments import training_args
from subnet_ext.jobs.stochastic_depth import StochasticDepth, residual_branches
from subnet_ext.models import build_model
from subnet_ext.testing import run_distributed


def _gpt(seed=0):
    torch.manual_seed(seed)
    return build_model("gpt", preset="tiny")


def _by_hand(model, idx, kept, scale):
    """The GPT forward written out: blocks with kept[i] False skipped, each branch times `scale`."""
    t = model.transformer
    x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
    for block, keep in zip(t.h, kept):
        if not keep:
            continue
        x = x + scale * block.attn(block.ln_1(x))
        x = x + scale * block.mlp(block.ln_2(x))
    return model.lm_head(t.ln_f(x))


def test_training_skips_dropped_blocks_and_evaluation_scales_branches():
    model = _gpt()
    reference = copy.deepcopy(model)
    sd = StochasticDepth(model, drop=0.5, seed=4, rank=1)
    idx = torch.randint(0, 128, (2, 16))
    patterns = set()
    for step in range(8):
        sd.step = step
        kept = sd.kept_blocks(step, 1)
        patterns.add(tuple(kept))
        assert torch.allclose(model(idx)[0], _by_hand(reference, idx, kept, 1.0), atol=1e-6)
    assert len(patterns) > 1, "eight steps drew one pattern: the draw does not depend on the step"
    model.eval()
    assert torch.allclose(model(idx)[0], _by_hand(reference, idx, [True, True], 0.5), atol=1e-6)
    sd.scale_at_eval = False
    assert torch.allclose(model(idx)[0], _by_hand(reference, idx, [True, True], 1.0), atol=1e-6)


def test_blocks_are_swapped_not_patched_and_remove_puts_them_back():
    """Each block is a twin of a subclass of its class (the model's names and the user's block
    objects unchanged, nothing set on them); with activation checkpointing installed first, the
    blocks keep less for the backward (recomputed), and a step keeping every block gives the plain
    model's gradients bit for bit; remove() restores the model's own blocks and its unscaled evaluation."""
    from subnet_ext.jobs.training import apply_activation_checkpointing
    from subnet_ext.models.gpt import Block

    model = _gpt()
    reference = copy.deepcopy(model)
    apply_activation_checkpointing(model)
    blocks, names = list(model.transformer.h), [n for n, _ in model.named_parameters()]
    attrs = [sorted(vars(b)) for b in blocks]
    sd = StochasticDepth(model, drop=0.5, seed=4, rank=1)
    swapped = list(model.transformer.h)
    assert all(isinstance(b, Block) and type(b) is not Block and b is not o for b, o in zip(swapped, blocks))
    assert [n for n, _ in model.named_parameters()] == names
    assert [sorted(vars(b)) for b in blocks] == attrs  # nothing set on the model's own blocks
    idx = torch.randint(0, 128, (2, 16))
    dropping = next(s for s in range(64) if not any(sd.kept_blocks(s, 1)))  # a step dropping every block
    sd.step = dropping
    assert residual_branches(model) == sd.branches  # tracing sees the blocks, whatever this step draws
    sd.step = next(s for s in range(64) if all(sd.kept_blocks(s, 1)))  # a step keeping every block
    saved = {model: 0, reference: 0}  # bytes autograd keeps for the backward, per model
    for m in saved:
        def keep(t, m=m):
            saved[m] += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = m(idx)[0].pow(2).mean()
        loss.backward()
    assert saved[model] < saved[reference] / 2, saved  # the blocks' activations are recomputed, not kept
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    sd.remove()
    assert list(model.transformer.h) == blocks and all(type(b) is Block for b in model.transformer.h)
    model.eval(), reference.eval()
    torch.testing.assert_close(model(idx)[0], reference(idx)[0], rtol=0, atol=0)  # no scaling left


def test_draws_are_reproducible_per_rank_and_keep_the_survival_rate():
    model = _gpt()
    sd = StochasticDepth(model, drop=0.25, seed=0, rank=0)
    assert sd.kept_blocks(5, 0) == StochasticDepth(_gpt(), 0.25, 0, 0).kept_blocks(5, 0)
    draws = [sd.kept_blocks(s, r) for s in range(500) for r in range(4)]
    assert any(sd.kept_blocks(s, 0) != sd.kept_blocks(s, 1) for s in range(20)), "ranks draw the same blocks"
    kept = sum(sum(d) for d in draws)
    n = 2 * len(draws)
    assert abs(kept - 0.75 * n) < 5 * (n * 0.75 * 0.25) ** 0.5  # binomial, 5 sigma


def test_refuses_bad_probabilities_and_unknown_blocks():
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        StochasticDepth(_gpt(), drop=1.0, seed=0, rank=0)
    with pytest.raises(ValueError, match="block layer1.0 computes shortcut_relu on its skip path"):
        StochasticDepth(build_model("resnet", num_classes=10, in_channels=1), drop=0.5, seed=0, rank=0)
    with pytest.raises(ValueError, match="no residual block"):
        StochasticDepth(torch.nn.Sequential(torch.nn.Linear(2, 2)), drop=0.5, seed=0, rank=0)
    with pytest.raises(ValueError, match="applies to --method ddp"):
        training_args(method="sdp", stochastic_depth=0.5)
    with pytest.raises(ValueError, match="drop probability"):
        training_args(method="ddp", stochastic_depth=-0.1)


def test_branches_traced_for_the_projects_transformer_and_mlp_blocks():
    assert residual_branches(_gpt()) == {"transformer.h.0": ("attn", "mlp"), "transformer.h.1": ("attn", "mlp")}
    mlp = build_model("mlp", in_features=8, num_classes=3)
    assert residual_branches(mlp) == {f"blocks.{i}": ("fc2",) for i in range(4)}
    llama = build_model("llama")
    assert set(residual_branches(llama).values()) == {("self_attn", "mlp")}


def _ddp_worker(rank, world, drop):
    from subnet_ext.jobs.methods import DDPMethod

    model = _gpt()
    sd = StochasticDepth(model, drop=drop, seed=9, rank=rank)
    method = DDPMethod(model, torch.device("cpu"), stochastic_depth=sd)
    grads = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        idx, tgt = torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)
        logits = method(idx)[0]
        F.cross_entropy(logits.reshape(-1, 128), tgt.reshape(-1)).backward()
        # Plain lists: tensors would travel through shared memory the exiting worker releases.
        grads.append({n: (p.grad if p.grad is not None else torch.zeros_like(p)).tolist()
                      for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
        method.after_step()  # no optimizer step: every step's gradient is at the initial weights
    return grads


@pytest.mark.parametrize("drop", [0.5])
def test_ddp_averages_each_ranks_gradient_with_its_own_dropped_blocks(drop):
    world = 2
    results = run_distributed(_ddp_worker, world, drop)
    sd_ref = StochasticDepth(_gpt(), drop=drop, seed=9, rank=0)
    assert any(sd_ref.kept_blocks(s, 0) != sd_ref.kept_blocks(s, 1) for s in range(3)), "no rank-local drop tested"
    for step in range(3):
        expected = None
        for rank in range(world):
            model = _gpt()
            g = torch.Generator().manual_seed(100 * step + rank)
            idx, tgt = torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)
            logits = _by_hand(model, idx, sd_ref.kept_blocks(step, rank), 1.0)
            F.cross_entropy(logits.reshape(-1, 128), tgt.reshape(-1)).backward()
            contrib = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) / world
                       for n, p in model.named_parameters()}
            expected = contrib if expected is None else {n: expected[n] + contrib[n] for n in expected}
        for rank in range(world):
            got = results[rank][step]
            for name, value in expected.items():
                assert torch.allclose(torch.tensor(got[name]), value, atol=1e-6), (step, rank, name)

"""Activation checkpointing (torch.utils.checkpoint, non-reentrant) inside the blocks gives
the same averaged gradients as without it, in both regimes; the backward regime's
masked kernel writes each direct gradient once per use, not again while recomputing."""
import types

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import subnet_ext as sx
from sdp_helpers import batch, counting_direct_writes, make_model
from subnet_ext.models.residual_mlp import ResidualMLPBlock
from subnet_ext.testing import run_distributed


RUNS = {"uses": 0, "computed": 0}  # this process's block uses and block forward computations


def _counted_block_forward(block, x):
    RUNS["computed"] += 1
    return ResidualMLPBlock.forward(block, x)


def checkpointed_forward(block, x):
    """A ResidualMLPBlock's forward, recomputed during the backward."""
    RUNS["uses"] += 1
    return checkpoint(_counted_block_forward, block, x, use_reentrant=False)


def make_checkpointed_model():
    """make_model() whose blocks checkpoint their forward (instance-level, so the blocks
    keep their class and the planner still recognises them)."""
    model = make_model()
    for block in model.blocks:
        block.forward = types.MethodType(checkpointed_forward, block)
    return model


def _run(rank, world, make, regime, level, coverage):
    """2 steps: ([{name: averaged gradient}] per step, DirectGradient.write calls, direct runs)."""
    model = make()
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, coverage, level), regime=regime)
    opt = torch.optim.SGD(sdp.parameters(), lr=0.1)
    grads = []
    with counting_direct_writes() as calls:
        for s in range(2):
            x, y = batch(rank, s)
            F.cross_entropy(sdp(x), y).backward()
            grads.append({n: p.grad.clone() for n, p in sdp.module.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
    return grads, calls[0], sdp.comm_stats()["direct_gradient_runs"]


def _worker(rank, world):
    out = {}
    for regime, level, coverage in (("forward", "block", 0.5), ("forward", "neuron", 0.5),
                                    ("backward", "block", 0.5), ("backward", "neuron", 0.5),
                                    ("backward", "neuron", 1.0)):
        plain, plain_calls, runs = _run(rank, world, make_model, regime, level, coverage)
        ckpt, ckpt_calls, _ = _run(rank, world, make_checkpointed_model, regime, level, coverage)
        diff = max((a[n] - b[n]).abs().max().item() for a, b in zip(plain, ckpt) for n in a)
        same_keys = all(a.keys() == b.keys() for a, b in zip(plain, ckpt))
        out[(regime, level, coverage)] = {"diff": diff, "same_keys": same_keys, "runs": runs,
                                          "calls": (plain_calls, ckpt_calls)}
    out["runs"] = dict(RUNS)
    return out


def test_checkpointed_blocks_give_the_same_gradients_and_write_once():
    for r in run_distributed(_worker, 2):
        runs = r.pop("runs")
        assert runs["uses"] > 0 and runs["computed"] == 2 * runs["uses"], runs  # really recomputed
        for key, v in r.items():
            assert v["same_keys"] and v["diff"] <= 1e-6, (key, v)
            plain_calls, ckpt_calls = v["calls"]
            assert plain_calls == ckpt_calls == 2 * v["runs"], (key, v)  # once per use, 2 steps
        assert r[("backward", "neuron", 1.0)]["runs"] > 0  # the direct path was exercised

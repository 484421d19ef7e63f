"""The non-finite check folded into gradient clipping (engine/clipping.py nonfinite_check,
NonFiniteGuard.check_norm, jobs/training.OptimizerStep): one pass over the gradients and one
all-reduce per step instead of two of each.

Three gloo ranks train SDP (neuron level, coverage 2/3: every piece has two owners, so each
rank holds pieces it does not lead) through OptimizerStep with clipping, once with the check
folded and once with the guard's own pass and all-reduce; a NaN is written after the backward
into one rank's copy of a piece that rank does not lead (what the clipping's norm alone never
reads), or of one it leads. Both ways skip the same step on every rank and end with
bit-identical parameters and optimizer state. Without `nonfinite_check` the norm stays finite
for the first NaN (so the fold needs it); with it the norm is inf on every rank. One process:
the folded step never calls the guard's separate check.
"""
from argparse import Namespace

import pytest
import torch
import torch.nn.functional as F

import subnet_ext as sx
from sdp_helpers import batch, make_model
from subnet_ext.jobs.methods import SDPMethod
from subnet_ext.jobs.training import OptimizerStep, make_optimizer
from subnet_ext.engine.clipping import synchronised_grad_norm
from subnet_ext.engine.guards.nonfinite_guard import NonFiniteGuard
from subnet_ext.testing import run_distributed

WORLD, STEPS, BAD_STEP, BAD_RANK = 3, 5, 3, 1
ARGS = Namespace(grad_accum=1, grad_clip=0.5, precision="fp32", lr=1e-2, weight_decay=0.01, lr_schedule="constant",
                 warmup_steps=0, steps=STEPS)


def _poison(sdp, rank: int, led: bool) -> dict:
    """NaN into element 0 of a held gradient piece this rank leads (or does not); returns the
    norms of the synchronised gradient then, without and with nonfinite_check (communicated)."""
    layout, _ = sdp.state_access("test")
    piece, view = next((p, v) for p, v in layout.held_gradients() if layout.contributes(p) == led and v.numel())
    view.view(-1)[0] = float("nan")
    group = sdp._comm.world_group
    return {check: synchronised_grad_norm(layout, 2.0, True, group, nonfinite_check=check).item()
            for check in (False, True)}


def _run(rank, world, fold, led):
    """One scenario on this rank: {"skipped", "state" (numpy arrays), "norms" at the bad step}."""
    model = make_model()
    plan = sx.plan_subnetworks(model, world, 2 / 3, "neuron", seed=0)
    method = SDPMethod(model, plan, "forward", 1, "none")
    optimizer = make_optimizer(method.parameters(), ARGS)
    guard = NonFiniteGuard(None)
    stepper = OptimizerStep(method, optimizer, guard, ARGS, torch.device("cpu"), fold_nonfinite_check=fold)
    norms = None
    for step in range(1, STEPS + 1):
        x, y = batch(rank, step)
        F.cross_entropy(method(x), y).backward()
        if step == BAD_STEP:
            # Every rank asks (the norms are collectives); only BAD_RANK's gradient is spoiled first.
            norms = _poison(method.sdp, rank, led) if rank == BAD_RANK else None
            if rank != BAD_RANK:
                layout, _ = method.sdp.state_access("test")
                norms = {c: synchronised_grad_norm(layout, 2.0, True, method.sdp._comm.world_group,
                                                   nonfinite_check=c).item() for c in (False, True)}
        stepper.finish(step)
        optimizer.zero_grad(set_to_none=True)
    # numpy arrays: pickled by value through the result queue (tensors would go by shared memory).
    state = {f"param/{i}": p.detach().numpy().copy() for i, p in enumerate(method.parameters())}
    for i, s in enumerate(optimizer.state.values()):
        state.update({f"optim/{i}/{k}": v.numpy().copy() for k, v in s.items() if torch.is_tensor(v)})
    return {"skipped": guard.settle() + guard.skipped_steps, "state": state, "norms": norms}


SCENARIOS = [(fold, led) for led in (False, True) for fold in (True, False)]


def _scenarios(rank, world):
    return [_run(rank, world, fold, led) for fold, led in SCENARIOS]


@pytest.fixture(scope="module")
def runs():
    """{(fold, led): [rank 0's result, ...]}: every scenario in one launch of the ranks."""
    per_rank = run_distributed(_scenarios, WORLD, timeout=300)
    return {scenario: [r[i] for r in per_rank] for i, scenario in enumerate(SCENARIOS)}


@pytest.mark.parametrize("led", [False, True], ids=["not-led", "led"])
def test_both_ways_skip_the_same_step_everywhere_and_end_bit_identical(runs, led):
    for fold in (True, False):
        assert [sorted(set(r["skipped"])) for r in runs[fold, led]] == [[BAD_STEP]] * WORLD, fold
    for folded, separate in zip(runs[True, led], runs[False, led]):
        assert folded["state"].keys() == separate["state"].keys()
        different = [k for k in folded["state"] if folded["state"][k].tobytes() != separate["state"][k].tobytes()]
        assert not different, different


@pytest.mark.parametrize("led", [False, True], ids=["not-led", "led"])
def test_the_norm_reads_every_held_piece_only_when_asked(runs, led):
    for r in runs[True, led]:
        norms = r["norms"]
        assert not torch.isfinite(torch.tensor(norms[True])), norms  # every rank sees the NaN
        # The clipping's own norm reads only led pieces: a NaN elsewhere leaves it finite.
        assert bool(torch.isfinite(torch.tensor(norms[False]))) != led, norms


def test_the_folded_step_makes_no_separate_check(monkeypatch):
    """One simulated rank: with clipping the guard's own pass is never called; without, it is."""
    calls = []
    monkeypatch.setattr(NonFiniteGuard, "check", lambda self, *a: calls.append(a) or torch.zeros(()))
    for clip, expected in ((0.5, 0), (None, 1)):
        model = make_model()
        plan = sx.plan_subnetworks(model, 2, 1.0, "block", seed=0)
        method = SDPMethod(model, plan, "forward", 1, "none", simulate_rank=0)
        args = Namespace(**{**vars(ARGS), "grad_clip": clip})
        optimizer = make_optimizer(method.parameters(), args)
        stepper = OptimizerStep(method, optimizer, NonFiniteGuard(None), args, torch.device("cpu"))
        x, y = batch(0, 0)
        F.cross_entropy(method(x), y).backward()
        calls.clear()
        stepper.finish(1)
        assert len(calls) == expected, (clip, calls)

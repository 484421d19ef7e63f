"""Ownership that moves (planning/assignment/schedule.py, engine/reassignment.py), with 4 gloo ranks against
references computed in this one process.

The reference of a schedule is written here from its definition: at step s the owner matrix is the
plan's with its columns permuted (redraw: numpy's default_rng([seed, epoch, class]).permutation; rolling:
a cyclic shift by epoch x shift), each unit's gradient is the mean over its owners of each owner's
gradient, and AdamW (single-tensor, elementwise) steps the full model. A rank's gradient comes from a
plain model at block level (its skipped blocks replaced by the identity in the forward regime, the
full model in the backward regime) and, at neuron level, from a static SubnetDataParallel simulating
that rank alone (the reassignment code under test is not involved). Shared parameters are frozen so
every averaged sum has two terms (C = 0.5 at K = 4), which the all-reduce adds exactly as this file
does: the runs must equal the reference bit for bit, parameters, optimizer state and EMA.
"""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import subnet_ext as sx
from subnet_ext.models.gpt import GPT, GPTConfig
from subnet_ext.ops.reference import as_2d
from subnet_ext.planning.pieces import global_pieces
from subnet_ext.testing import run_distributed
from subnet_reference import reference_subnetwork



@pytest.fixture(autouse=True)
def one_thread():
    """The reference on one thread, as each rank runs: a matmul's summation order follows the thread count
    (on a 2-core machine with two threads the tied embedding's gradient came out one ulp apart)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CFG = GPTConfig(block_size=16, vocab_size=32, n_layer=4, n_head=4, n_embd=16, bias=False)
EVERY, STEPS, SEED, LR, DECAY = 3, 7, 5, 1e-2, 0.9


def build(freeze_shared=True):
    torch.manual_seed(0)
    model = GPT(CFG)
    if freeze_shared:
        for name, p in model.named_parameters():
            if not name.startswith("transformer.h.") or ".ln_" in name:  # embeddings and every norm: shared
                p.requires_grad_(False)
    return model


def loss_on(model, rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, 32, (2, 9), generator=g)
    logits, _ = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, 32), ids[:, 1:].reshape(-1))


def _numpy(state: dict) -> dict:
    return {k: v.detach().numpy().copy() for k, v in state.items()}


def _run(rank, world, level, regime, assignment, steps=STEPS):
    model = build()
    plan = sx.plan_subnetworks(model, world_size=world, coverage=0.5, level=level)
    sdp = sx.SubnetDataParallel(model, plan, regime=regime, assignment=assignment, reassign_every=EVERY,
                                assignment_seed=SEED)
    opt = torch.optim.AdamW(sdp.parameters(), lr=LR, foreach=False)
    ema = sx.ExponentialMovingAverage(sdp, decay=DECAY)
    for s in range(steps):
        loss_on(sdp, rank, s).backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters()
    optim = sdp.full_optimizer_state_dict(opt)["state"]
    return {"state": _numpy(sdp.full_state_dict()), "ema": _numpy(ema.full_state_dict()),
            "optim": {n: _numpy({k: v for k, v in d.items() if k != "step"}) for n, d in optim.items()},
            "moved": dict(sdp.comm_stats()["by_quantity"]).get("reassign"),
            "predicted": sum(r["predicted_bytes"] for r in sdp.comm_stats()["reassignments"]),
            "owners": [o.tolist() for o in sdp.plan.owners]}


def owners_at(plan, assignment, step):
    """The schedule's owner matrix after `step` steps, from its definition (module docstring)."""
    epoch = step // EVERY
    owners = plan.owners.clone()
    if epoch == 0:
        return owners
    classes = [list(range(a, b)) for a, b in plan.unit_ranges] if plan.level == "neuron" else \
        [list(range(len(plan.units)))]
    for c, members in enumerate(classes):
        n = len(members)
        order = [(i - epoch) % n for i in range(n)] if assignment == "rolling" else \
            np.random.default_rng([SEED, epoch, c]).permutation(n).tolist()
        owners[:, members] = plan.owners[:, [members[j] for j in order]]
    return owners


def _local_gradients(model, plan, regime, q, step):
    """{name: rank q's gradient in full coordinates} (zeros where q holds nothing)."""
    if plan.level == "block":
        m = reference_subnetwork(model, plan, q) if regime == "forward" else copy.deepcopy(model)
        loss_on(m, q, step).backward()
        return {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    sim = sx.SubnetDataParallel(copy.deepcopy(model), plan, regime=regime, simulate_rank=q)
    loss_on(sim, q, step).backward()
    out = {}
    for p in global_pieces(plan):
        if p.is_param and q in p.owners:
            param, (r0, r1, c0, c1) = sim.layout.parameter_place(p)
            if param.grad is not None:
                f0, f1, g0, g1 = sim.layout.held_rectangle(p)
                full = out.setdefault(p.name, torch.zeros(plan.tensor_shapes[p.name]))
                as_2d(full)[f0:f1, g0:g1] = as_2d(param.grad)[r0:r1, c0:c1]
    return out


def reference(level, regime, assignment, world=4, steps=STEPS):
    """(state, {name: AdamW state}, EMA state, bytes each rank sent) of the schedule, in this process."""
    model = build()
    plan = sx.plan_subnetworks(model, world_size=world, coverage=0.5, level=level)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, foreach=False)
    ema = {n: v.clone() for n, v in model.state_dict().items()}
    sent = [0] * world
    for s in range(steps):
        owners = owners_at(plan, assignment, s)
        current = plan.with_owners(owners)
        grads = [_local_gradients(model, current, regime, q, s) for q in range(world)]
        for p in global_pieces(current):
            if not (p.is_param and params[p.name].requires_grad):
                continue
            a, b = (grads[q][p.name].narrow(p.dim, p.start, p.length) for q in p.owners)  # two owners each
            if params[p.name].grad is None:
                params[p.name].grad = torch.zeros_like(params[p.name])
            params[p.name].grad.narrow(p.dim, p.start, p.length).copy_((a + b) * 0.5)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for n, v in model.state_dict().items():
                ema[n] = v.clone() if s == 0 else ema[n].lerp(v, 1 - DECAY)
        if (s + 1) % EVERY == 0:  # the change after this step: what each unit's lowest-ranked owner sends
            after = owners_at(plan, assignment, s + 1)
            for u in range(owners.shape[1]):
                gained = (after[:, u] & ~owners[:, u]).nonzero().flatten().tolist()
                src = int(owners[:, u].nonzero()[0])
                sent[src] += len(gained) * _unit_bytes(current, u, regime)
    states = {n: {k: v for k, v in opt.state[params[n]].items() if k != "step"} for n in params if params[n] in opt.state}
    return model.state_dict(), states, ema, sent


def _unit_bytes(plan, u, regime):
    """What moves with unit u: its trainable parameters' bytes, times 1 (value, forward regime only) + 2
    (AdamW's moments), and its other float tensors' values in the forward regime."""
    g = next(g for g, (a, b) in zip(plan.groups, plan.unit_ranges) if a <= u < b)
    model = build()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if g.kind == "block":
        sizes = [(n, plan.numel_of(n)) for n in g.params + g.buffers]
    else:  # a fused qkv weight is a member three times (q, k and v rows)
        sizes = [(m.name, plan.numel_of(m.name) // plan.tensor_shapes[m.name][m.dim] * m.width) for m in g.members]
    total = 0
    for n, numel in sizes:
        copies = (1 if regime == "forward" else 0) + (2 if n in trainable else 0)
        total += 4 * numel * copies
    return total


@pytest.mark.parametrize("level", ["block", "neuron"])
@pytest.mark.parametrize("regime", ["forward", "backward"])
def test_a_moving_assignment_equals_the_one_process_reference(level, regime):
    assignment = "redraw" if level == "block" else "rolling"
    runs = run_distributed(_run, 4, level, regime, assignment, timeout=600)
    state, optim, ema, sent = reference(level, regime, assignment)
    assert runs[0]["owners"] != build_plan(level).owners.tolist()  # the run ended on a moved assignment
    for r, run in enumerate(runs):
        for name, value in state.items():
            assert np.array_equal(run["state"][name], value.numpy()), (r, name)
            assert np.array_equal(run["ema"][name], ema[name].numpy()), (r, "ema", name)
        assert set(run["optim"]) == set(optim)
        for name, moments in optim.items():
            for key, value in moments.items():
                assert np.array_equal(run["optim"][name][key], value.numpy()), (r, name, key)
        moved = (run["moved"] or (0, 0))[0]
        assert moved == sent[r] == run["predicted"], (r, moved, sent[r], run["predicted"])
    assert sum(sent) > 0


def build_plan(level):
    return sx.plan_subnetworks(build(), world_size=4, coverage=0.5, level=level)


# ------------------------------------------------------------------------ a coverage per rank, a period per group
def _run_two(rank, world, coverage, sync_every, steps):
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = sx.plan_subnetworks(model, world_size=world, coverage=coverage, level="block")
    sdp = sx.SubnetDataParallel(model, plan, regime="forward", sync_every=sync_every)
    opt = torch.optim.AdamW(sdp.parameters(), lr=LR, foreach=False)
    for s in range(steps):
        loss_on(sdp, rank, s).backward()
        opt.step()
        opt.zero_grad()
    return {"local": _numpy({k: v for k, v in sdp.local_full_state_dict().items()}),
            "owners": plan.owners.tolist()}


def test_a_coverage_per_rank_equals_the_reference():
    """Two ranks, coverage [1, 0.5]: rank 0 trains all four blocks, rank 1 two of them; a block both own is
    averaged over the two, the others are rank 0's alone."""
    runs = run_distributed(_run_two, 2, [1.0, 0.5], 1, 5, timeout=300)
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = sx.plan_subnetworks(model, world_size=2, coverage=[1.0, 0.5], level="block")
    assert plan.owners.sum(1).tolist() == [4, 2] and runs[0]["owners"] == plan.owners.tolist()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    for s in range(5):
        grads = []
        for q in range(2):
            m = reference_subnetwork(model, plan, q)
            loss_on(m, q, s).backward()
            grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
        for name, p in model.named_parameters():
            held = [g[name] for g in grads if name in g]
            p.grad = held[0] if len(held) == 1 else (held[0] + held[1]) * 0.5
        opt.step()
        opt.zero_grad()
    for q, run in enumerate(runs):
        for name, value in model.state_dict().items():
            if not np.isnan(run["local"][name]).any():  # what rank q holds
                assert np.array_equal(run["local"][name], value.numpy()), (q, name)
    assert np.isnan(runs[1]["local"]["transformer.h.3.mlp.c_fc.weight"]).all() != \
        np.isnan(runs[1]["local"]["transformer.h.0.mlp.c_fc.weight"]).all()  # rank 1 holds only some blocks


def test_a_period_per_group_equals_the_reference():
    """Two ranks at coverage 1, sync_every={"shared": 1, "units": 2}: the shared parameters' gradients are
    averaged every step, the blocks train locally (each rank its own AdamW state) and their parameters are
    averaged every second step."""
    steps = 5
    runs = run_distributed(_run_two, 2, 1.0, {"shared": 1, "units": 2}, steps, timeout=300)
    torch.manual_seed(0)
    base = GPT(CFG)
    models = [copy.deepcopy(base) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=LR, foreach=False) for m in models]
    for s in range(steps):
        for q in range(2):
            loss_on(models[q], q, s).backward()
        for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
            if not name.startswith("transformer.h."):  # shared: the owners' mean gradient
                a.grad = b.grad = (a.grad + b.grad) * 0.5
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if (s + 1) % 2 == 0:
            with torch.no_grad():
                for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
                    if name.startswith("transformer.h."):
                        a.copy_((a + b) * 0.5)
                        b.copy_(a)
    for q, run in enumerate(runs):
        for name, value in models[q].state_dict().items():
            assert np.array_equal(run["local"][name], value.numpy()), (q, name)
    block = "transformer.h.0.mlp.c_fc.weight"
    assert not np.array_equal(runs[0]["local"][block], runs[1]["local"][block])  # step 5: local, not yet averaged


# ------------------------------------------------------------------------ accumulation, resume, memory, reports
def _accumulate_across_a_change(rank, world):
    model = build(freeze_shared=False)
    plan = sx.plan_subnetworks(model, world_size=world, coverage=0.5, level="block")
    sdp = sx.SubnetDataParallel(model, plan, assignment="redraw", reassign_every=2)
    opt = torch.optim.AdamW(sdp.parameters(), lr=LR)
    loss_on(sdp, rank, 0).backward()
    opt.step()
    opt.zero_grad()
    with sdp.no_sync():
        loss_on(sdp, rank, 1).backward()
        try:
            opt.step()  # the second step ends the assignment inside the accumulation
        except RuntimeError as e:
            return str(e)
    return None


def test_a_change_inside_gradient_accumulation_is_refused():
    for message in run_distributed(_accumulate_across_a_change, 2, timeout=300):
        assert message and "inside no_sync()" in message and "after optimizer step 2" in message, message


def _resume(rank, world, split, world_then):
    """Train `split` steps on `world` ranks, save the full state and step; resume on `world_then` ranks
    (its own plan, the same schedule) and train to STEPS. Returns the final full state and the memory."""
    import torch.distributed as dist

    model = build(freeze_shared=False)
    plan = sx.plan_subnetworks(model, world_size=world, coverage=0.5, level="block")
    sdp = sx.SubnetDataParallel(model, plan, assignment="redraw", reassign_every=EVERY, assignment_seed=SEED)
    opt = torch.optim.AdamW(sdp.parameters(), lr=LR, foreach=False)
    for s in range(split):
        loss_on(sdp, rank, s).backward()
        opt.step()
        opt.zero_grad()
        if s == EVERY - 2:
            before = sdp.memory_report(opt)  # the first assignment, its optimizer state made
    after = sdp.memory_report(opt)  # after the change at step EVERY
    saved = (sdp.full_state_dict(), sdp.full_optimizer_state_dict(opt), sdp.steps)
    if world_then != world:  # the resumed job runs on fewer ranks: a group of its own
        group = dist.new_group(list(range(world_then)))
        if rank >= world_then:
            return {"memory": (before, after)}
    else:
        group = None
    model = build(freeze_shared=False)
    plan = sx.plan_subnetworks(model, world_size=world_then, coverage=0.5, level="block")
    sdp = sx.SubnetDataParallel(model, plan, process_group=group, assignment="redraw", reassign_every=EVERY,
                                assignment_seed=SEED)
    sdp.set_step(saved[2])
    opt = torch.optim.AdamW(sdp.parameters(), lr=LR, foreach=False)
    sdp.load_full_state_dict(saved[0])
    sdp.load_full_optimizer_state_dict(opt, saved[1])
    for s in range(saved[2], STEPS):
        loss_on(sdp, rank, s).backward()
        opt.step()
        opt.zero_grad()
    return {"state": _numpy(sdp.full_state_dict()), "steps": sdp.steps, "owners": sdp.plan.owners.tolist(),
            "memory": (before, after)}


def _straight(rank, world):
    model = build(freeze_shared=False)
    plan = sx.plan_subnetworks(model, world_size=world, coverage=0.5, level="block")
    sdp = sx.SubnetDataParallel(model, plan, assignment="redraw", reassign_every=EVERY, assignment_seed=SEED)
    opt = torch.optim.AdamW(sdp.parameters(), lr=LR, foreach=False)
    for s in range(STEPS):
        loss_on(sdp, rank, s).backward()
        opt.step()
        opt.zero_grad()
    return _numpy(sdp.full_state_dict())


def test_resume_across_a_change_on_the_same_and_another_world_size():
    straight = run_distributed(_straight, 4, timeout=300)[0]
    resumed = run_distributed(_resume, 4, 4, 4, timeout=300)  # saved after step 4: one change behind it
    for r in resumed:
        assert r["steps"] == STEPS
        for name, value in straight.items():
            assert np.array_equal(r["state"][name], value), name
        (before, after) = r["memory"]
        for key in ("parameters", "optimizer_state"):  # forward regime: one assignment's worth, before and after
            assert after[key] == before[key] > 0, (key, before[key], after[key])
    smaller = run_distributed(_resume, 4, 4, 2, timeout=300)  # resumed on 2 ranks, its own plan
    assert all(np.isfinite(v).all() for v in smaller[0]["state"].values()) and smaller[0]["steps"] == STEPS
    assert smaller[0]["owners"] != [[True] * 4, [True] * 4]  # a 2-rank plan, half the blocks each


def test_the_plan_says_which_neighbours_train_together_and_the_engine_warns():
    from subnet_ext.planning.assignment.schedule import co_training_lines

    plan = build_plan("block")
    text = plan.summary()
    assert "transformer.h.0 + 1: no" in text and "warning: 2 of 3 pairs" in text  # K=4, C=0.5: balanced pattern
    contiguous = sx.plan_subnetworks(build(), 4, 0.5, "block", block_assignment="contiguous")
    assert "warning" not in "\n".join(co_training_lines(contiguous))
    redraw = "\n".join(co_training_lines(plan, sx.OwnershipSchedule("redraw", 10), 2000))
    assert "warning" not in redraw and "% " not in redraw.split(":", 1)[0]
    shares = [float(x.split(": ")[1].rstrip("%;")) for x in redraw.split("): ", 1)[1].split("; ")]
    assert len(shares) == 3 and all(0 < s < 100 for s in shares), shares
    with pytest.raises(ValueError, match="now called 'balanced'"):
        sx.plan_subnetworks(build(), 4, 0.5, "block", block_assignment="rolling")

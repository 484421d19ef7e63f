"""Gradients live in the engine's storage (as torch DDP's gradient_as_bucket_view).

At coverage 1.0 every rank holds the whole model, so rank 0 of 2 simulated alone must
produce exactly the gradients of a plain replica (the simulated averaging scales by 1).
Checked against that replica:
- after a backward, a parameter that is one whole piece in one bucket has as .grad a view
  of its bucket (the same storage every step), also after zero_grad(set_to_none=True)
  and after zero_grad(set_to_none=False);
- gradient accumulation with no_sync() sums the micro-batches as the replica does, with
  the gradient starting as None or as the (zeroed) bucket view;
- neuron level, 4 ranks, coverage 0.5: parameters cut into pieces of several owner sets
  keep one standalone gradient (same address every step), and those pieces' values are
  still the replica's.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import subnet_ext as sx
from sdp_helpers import batch, make_model


def engine(level, regime, world=2, coverage=1.0, rank=0):
    model = make_model()
    replica = copy.deepcopy(model)
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, coverage, level), regime=regime,
                                simulate_rank=rank, bucket_cap_mb=0.002)
    return sdp, replica


def in_bucket(sdp, grad) -> bool:
    return grad.untyped_storage().data_ptr() in sdp.averager.buffer_storages()


def replica_grads(replica, steps):
    replica.zero_grad(set_to_none=True)
    for s in steps:
        x, y = batch(0, s)
        F.cross_entropy(replica(x), y).backward()
    return {n: p.grad for n, p in replica.named_parameters()}


def engine_grads(sdp):
    """{full name: gradient} of what the engine holds (backward regime: the owned views)."""
    out = {}
    for piece, param in sdp.layout.piece_params.items():
        out[(piece.name, piece.dim, piece.start, piece.length)] = param.grad
    for name, param in sdp.module.named_parameters():
        if not any(name.endswith(f"_owned{i}") for i in range(8)):
            out[name] = param.grad
    return out


def assert_matches(sdp, replica_grad):
    for key, grad in engine_grads(sdp).items():
        if isinstance(key, tuple):
            name, dim, start, length = key
            expected = replica_grad[name].narrow(dim, start, length)
        else:
            expected = replica_grad[key]
        assert grad is not None and torch.equal(grad, expected), key


@pytest.mark.parametrize("level,regime", [("block", "forward"), ("neuron", "forward"), ("block", "backward"),
                                          ("neuron", "backward")])
def test_gradients_are_bucket_views_and_equal_the_replica(level, regime):
    sdp, replica = engine(level, regime)
    opt = torch.optim.SGD(sdp.parameters(), lr=0.0)  # lr 0: the replica stays the same model
    storages = None
    for s, set_to_none in enumerate([True, False, True]):
        opt.zero_grad(set_to_none=set_to_none)
        x, y = batch(0, s)
        F.cross_entropy(sdp(x), y).backward()
        assert_matches(sdp, replica_grads(replica, [s]))
        homes = {id(p): p.grad.data_ptr() for p in sdp.parameters()}
        assert all(in_bucket(sdp, p.grad) for p in sdp.parameters()), \
            [n for n, p in sdp.module.named_parameters() if p.requires_grad and not in_bucket(sdp, p.grad)]
        assert storages is None or homes == storages  # the same place every step
        storages = homes
        opt.step()


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("regime", ["forward", "backward"])
def test_no_sync_accumulates_like_the_replica(regime, set_to_none):
    sdp, replica = engine("neuron", regime)
    opt = torch.optim.SGD(sdp.parameters(), lr=0.0)
    x, y = batch(0, 9)
    F.cross_entropy(sdp(x), y).backward()  # grads now live in the buckets
    opt.zero_grad(set_to_none=set_to_none)
    with sdp.no_sync():
        x, y = batch(0, 1)
        F.cross_entropy(sdp(x), y).backward()
    x, y = batch(0, 2)
    F.cross_entropy(sdp(x), y).backward()
    expected = replica_grads(replica, [1, 2])
    for key, grad in engine_grads(sdp).items():
        name = key[0] if isinstance(key, tuple) else key
        ref = expected[name].narrow(*key[1:]) if isinstance(key, tuple) else expected[name]
        torch.testing.assert_close(grad, ref, rtol=1e-6, atol=1e-7)
    assert all(in_bucket(sdp, p.grad) for p in sdp.parameters())


def test_pieces_of_several_owner_sets_keep_one_standalone_gradient():
    model = make_model()
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, 4, 0.5, "neuron"), simulate_rank=1,
                                bucket_cap_mb=0.002)
    opt = torch.optim.SGD(sdp.parameters(), lr=0.0)
    params = list(sdp.parameters())
    kept = []  # the previous gradients stay alive: a fresh one cannot reuse their address
    for s in range(3):
        opt.zero_grad(set_to_none=True)
        x, y = batch(1, s)
        F.cross_entropy(sdp(x), y).backward()
        kept.append([p.grad for p in params])
    homes = sdp.averager.gradient_homes()
    standalone = [i for i, p in enumerate(params) if id(p) in homes and not in_bucket(sdp, homes[id(p)])]
    assert standalone, "the plan should cut some parameter into pieces of several owner sets"
    for i in standalone:
        assert len({step[i].data_ptr() for step in kept}) == 1, i

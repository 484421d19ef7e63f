"""Gradient reductions and comm hooks in one process: the engine simulates rank 1 of 4
(simulate_rank), so collectives count their bytes and change nothing (a group of one).

- for every built-in reduction and both bucket strategies, the bytes and collectives the
  communicator counts per step equal the cost model's prediction (planning/costs/comm_costs.py);
- bf16 on the wire: a rank alone gets back its own gradients rounded to bf16;
- what a hook is given: each held piece's matrix is that piece's rectangle of its gradient;
- a hook's wrong result and a second hook are refused with errors that say what to do;
- the low-rank hook sends 1-D pieces and small matrices whole.
"""
import pytest
import torch
import torch.nn.functional as F

import subnet_ext as sx
from rank_views import to_full
from sdp_helpers import batch, make_model
from subnet_ext.comm.hooks import LowRankState, allreduce_hook, bf16_compress_hook, fp16_compress_hook, low_rank_hook
from subnet_ext.comm.hooks.low_rank import approximation_rank

RANK, WORLD = 1, 4


def engine(strategy="groups", regime="forward", **options):
    model = make_model()
    plan = sx.plan_subnetworks(model, WORLD, 0.5, "neuron")
    return plan, sx.SubnetDataParallel(model, plan, regime=regime, simulate_rank=RANK, strategy=strategy,
                                       bucket_cap_mb=0.002, **options)


def steps(sdp, n=2):
    opt = torch.optim.SGD(sdp.parameters(), lr=0.1)
    for s in range(n):
        x, y = batch(RANK, s)
        F.cross_entropy(sdp(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("strategy", ["groups", "zero_filled"])
@pytest.mark.parametrize("reduction", ["default", "bf16_dtype", "fp16_hook", "bf16_hook", "allreduce_hook",
                                       "low_rank_1", "low_rank_4"])
def test_counted_bytes_equal_the_prediction(strategy, reduction):
    _, sdp = engine(strategy, reduce_dtype="bfloat16" if reduction == "bf16_dtype" else None)
    hooks = {"fp16_hook": (None, fp16_compress_hook), "bf16_hook": (None, bf16_compress_hook),
             "allreduce_hook": (None, allreduce_hook), "low_rank_1": (LowRankState(matrix_rank=1), low_rank_hook),
             "low_rank_4": (LowRankState(matrix_rank=4), low_rank_hook)}
    if reduction in hooks:
        sdp.register_comm_hook(*hooks[reduction])
    steps(sdp, 2)
    stats = sdp.comm_stats()
    predicted = stats["predicted_per_sync"]
    assert stats["by_quantity"]["gradients"] == (2 * predicted["bytes"], 2 * predicted["collectives"]), stats
    default = engine(strategy)[1].comm_stats()["predicted_per_sync"]
    if reduction in ("bf16_dtype", "fp16_hook", "bf16_hook"):
        assert 2 * predicted["bytes"] == default["bytes"]
    if reduction == "low_rank_1":  # at rank 4 this small model's pieces are too small to compress
        assert predicted["bytes"] < default["bytes"] and predicted["collectives"] > default["collectives"]


def test_a_rank_alone_gets_its_own_gradients_rounded_to_the_wire_dtype():
    plan, exact = engine()
    plan, wired = engine(reduce_dtype=torch.bfloat16)
    x, y = batch(RANK, 0)
    for sdp in (exact, wired):
        F.cross_entropy(sdp(x), y).backward()
    own = to_full(plan, RANK, exact.module, lambda p: p.grad)
    got = to_full(plan, RANK, wired.module, lambda p: p.grad)
    assert got.keys() == own.keys()
    for name in own:
        rounded = own[name].to(torch.bfloat16).float()
        assert torch.equal(got[name].nan_to_num(), rounded.nan_to_num()), name
        assert not torch.equal(got[name].nan_to_num(), own[name].nan_to_num()), name  # the rounding shows


def test_a_hook_sees_each_held_piece_as_its_gradients_rectangle():
    _, sdp = engine()
    places = sdp.layout.averaging_places()
    seen = []

    def hook(state, bucket):
        for piece, info, matrix in zip(bucket.layout.pieces, bucket.pieces, bucket.matrices()):
            assert info.held and (info.rows, info.columns) == tuple(matrix.shape)
            place = places[piece]
            r0, r1, c0, c1 = place.grad_rect
            grad = place.param.grad
            seen.append(torch.equal(matrix, grad.reshape(grad.shape[0], -1)[r0:r1, c0:c1]))
        return bucket.buffer()

    sdp.register_comm_hook("state", hook)
    x, y = batch(RANK, 0)
    F.cross_entropy(sdp(x), y).backward()
    assert seen and all(seen)


def test_hook_mistakes_are_refused_by_name():
    _, sdp = engine()
    sdp.register_comm_hook(None, lambda state, bucket: bucket.buffer()[:3])
    x, y = batch(RANK, 0)
    with pytest.raises(TypeError, match=r"comm hook <lambda> returned a tensor of shape \[3\] for bucket \d+; it must "
                                        r"return the bucket's mean over its group"):
        F.cross_entropy(sdp(x), y).backward()
    with pytest.raises(RuntimeError, match="a comm hook \\(<lambda>\\) is already registered; it can be registered "
                                           "only once"):
        sdp.register_comm_hook(None, allreduce_hook)
    _, cast = engine(reduce_dtype="float16")
    with pytest.raises(ValueError, match="already casts its gradients for the wire \\(reduce_dtype=torch.float16\\)"):
        cast.register_comm_hook(None, allreduce_hook)
    _, local_sgd = engine(sync_every=2)
    with pytest.raises(ValueError, match="needs sync_every=1 and shard_shared=False"):
        local_sgd.register_comm_hook(None, allreduce_hook)
    with pytest.raises(TypeError, match="hook must be callable as hook\\(state, bucket\\), got 'bf16'"):
        engine()[1].register_comm_hook(None, "bf16")


def test_low_rank_sends_vectors_and_small_matrices_whole():
    assert approximation_rank(32, 1, 4, 2.0) == 0  # a bias [32] is a [32, 1] piece
    assert approximation_rank(5, 16, 1, 2.0) == 1 and approximation_rank(5, 16, 2, 2.0) == 0  # 80 > 2*2*21 fails
    assert approximation_rank(3, 100, 8, 2.0) == 0  # r = min(8, 3) = 3: 300 > 2*3*103 fails
    assert approximation_rank(64, 64, 4, 2.0) == 4

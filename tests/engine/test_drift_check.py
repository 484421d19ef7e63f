"""No silent drift: a run whose owners stop agreeing fails within SDPConfig.drift_check_every
steps by default, on every rank, naming torch's clipping as the likely cause.

The DDP habit `torch.nn.utils.clip_grad_norm_(sdp.parameters(), max_norm)` clips each rank by
its own subnetwork's norm, so the shared parameters drift apart (checked here by gathering
them, independently of the engine). On 2 gloo ranks, with the default configuration:

- both regimes: ConsistencyError on both ranks at step N (the first check), and the gathered
  shared parameters do differ then; the same loop with `sdp.clip_grad_norm_` runs 2N steps
  without an error, its two checks made;
- the check changes no bit of training: the parameters after 2N steps with a check at every
  step equal those without a check;
- sync_every = 4 (local SGD diverges between averaging points): only averaging steps are
  checked (no error over 3 checks), and a copy corrupted right after an averaging step is
  caught at that step;
- shard_shared: FSDP2's shards are not compared, the units are (a corrupted unit is caught);
- a simulated rank keeps training with torch's clipping (there is nobody to compare with);
- on 4 ranks at neuron level in the backward regime, the owned slices (non-contiguous views) are
  compared: clean runs pass their checks, a nudged slice is named at the next check.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import subnet_ext as sx
from sdp_helpers import batch, make_model
from subnet_ext.engine.config import DEFAULT_DRIFT_CHECK_EVERY
from subnet_ext.testing import run_distributed

N = DEFAULT_DRIFT_CHECK_EVERY


def _train(sdp, opt, rank, steps, clip=None, after_step=None):
    """`steps` steps; clip "torch" (the DDP habit), "sdp" or None. Returns the step of the
    ConsistencyError raised (and its message), or (None, None)."""
    for s in range(1, steps + 1):
        x, y = batch(rank, s)
        F.cross_entropy(sdp(x), y).backward()
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(sdp.parameters(), 1e-3)
        elif clip == "sdp":
            sdp.clip_grad_norm_(1e-3)
        try:
            opt.step()
        except sx.ConsistencyError as e:
            return s, str(e)
        opt.zero_grad()
        if after_step is not None:
            after_step(s)
    return None, None


def _shared_differ(sdp, name) -> bool:
    """True when the ranks' copies of shared parameter `name` differ (an all_gather of its values)."""
    mine = dict(sdp.module.named_parameters())[name].detach().reshape(-1)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return not all(torch.equal(parts[0], p) for p in parts[1:])


def _engine(regime="forward", coverage=0.5, **config):
    model = make_model()
    plan = sx.plan_subnetworks(model, dist.get_world_size(), coverage, "block")
    sdp = sx.SubnetDataParallel(model, plan, regime=regime, **config)
    return sdp, torch.optim.AdamW(sdp.parameters(), lr=1e-2)


def _clipping(rank):
    out = {}
    for regime in ("forward", "backward"):
        sdp, opt = _engine(regime)
        step, message = _train(sdp, opt, rank, 2 * N, clip="torch")
        out[regime] = (step, message, _shared_differ(sdp, "stem.weight"), sdp.drift_check.checks)
        sdp, opt = _engine(regime)
        out[regime + " sdp clip"] = (*_train(sdp, opt, rank, 2 * N, clip="sdp"), sdp.drift_check.checks)
    return out


def _worker(rank, world):
    """Every scenario of this file's 2-rank tests in one pair of processes (one start-up)."""
    return {"clipping": _clipping(rank), "bits": _bits(rank), "local sgd": _local_sgd(rank), "sharded": _sharded(rank),
            "periods": _periods_and_moves(rank)}


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, 2)


def test_torch_clipping_is_caught_by_default_within_n_steps_on_every_rank(ranks):
    assert N == sx.SDPConfig().drift_check_every and 1 <= N <= 100
    for out in (r["clipping"] for r in ranks):
        for regime in ("forward", "backward"):
            step, message, differ, checks = out[regime]
            assert step == N and checks == 1, (regime, step, checks)
            assert differ  # the error is true: the ranks' copies of the stem differ
            assert "clip_grad_norm_" in message and "shared tensor 'stem.weight'" in message, message
            assert f"after optimizer step {N}" in message and "drift_check_every" in message, message
            assert out[regime + " sdp clip"] == (None, None, 2), regime  # sdp.clip_grad_norm_: no drift


def _bits(rank):
    finals = []
    for every in (1, 0):
        sdp, opt = _engine("forward", coverage=1.0, drift_check_every=every)
        assert _train(sdp, opt, rank, 2 * N) == (None, None)
        finals.append({k: v.detach().clone() for k, v in sdp.module.state_dict().items()})
        assert sdp.drift_check.checks == (2 * N if every else 0)
    return all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


def test_the_check_changes_no_training_bit(ranks):
    assert [r["bits"] for r in ranks] == [True, True]


def _corrupt_after(sdp, rank, at_step, name):
    """An after-step callback that, on rank 1 at `at_step`, nudges parameter `name` (as a bit
    flip or a rank that stepped alone would) before the engine's next check."""
    def nudge(step):
        if rank == 1 and step == at_step:
            with torch.no_grad():
                dict(sdp.module.named_parameters())[name].add_(1e-3)
    return nudge


def _local_sgd(rank):
    out = {}
    sdp, opt = _engine("forward", sync_every=4, drift_check_every=5)
    out["steps"] = _train(sdp, opt, rank, 24, clip="sdp")  # each rank clips by its own norm: local SGD
    out["checks"] = sdp.drift_check.checks  # at steps 8, 16 and 24 (the first averaging step 5 or more after)
    sdp, opt = _engine("forward", sync_every=4, drift_check_every=5)
    # Nudged after the averaging step 8 was checked: the averaging at 12 makes the copies agree again.
    out["healed"] = _train(sdp, opt, rank, 16, after_step=_corrupt_after(sdp, rank, 8, "stem.weight"))
    sdp, opt = _engine("forward", sync_every=4, drift_check_every=5)
    real_average = sdp.averager.average_now

    def average_then_corrupt(*args):  # a rank that corrupts its copy right after averaging at step 16
        real_average(*args)
        if rank == 1 and sdp.communicator.counter.steps == 16:
            with torch.no_grad():
                sdp.module.stem.weight.add_(1e-3)
    sdp.averager.average_now = average_then_corrupt
    out["caught"] = _train(sdp, opt, rank, 24)[0]
    return out


def test_local_sgd_is_checked_only_right_after_averaging(ranks):
    for out in (r["local sgd"] for r in ranks):
        assert out["steps"] == (None, None) and out["checks"] == 3
        assert out["healed"] == (None, None)
        assert out["caught"] == 16


def _periods_and_moves(rank):
    out = {}
    # Shared parameters averaged every step, the units every 2 (they differ at odd steps): checked every
    # 6 steps (the first multiple of the periods' least common multiple, 2, at or past 5).
    sdp, opt = _engine("forward", coverage=1.0, sync_every={"shared": 1, "units": 2}, drift_check_every=5)
    out["periods"] = (*_train(sdp, opt, rank, 12, clip="sdp"), sdp.drift_check.checks)
    # Ownership that moves every 3 steps: the check is rebuilt for each assignment and keeps its rhythm
    # (steps 5, 10, 15); a copy nudged after the move at step 12 is caught at 15.
    sdp, opt = _engine("forward", assignment="rolling", reassign_every=3, drift_check_every=5)
    out["moves"] = _train(sdp, opt, rank, 18, after_step=_corrupt_after(sdp, rank, 12, "head.weight"))[0]
    return out


def test_periods_per_group_and_moving_ownership_are_checked_where_owners_agree(ranks):
    for out in (r["periods"] for r in ranks):
        assert out["periods"] == (None, None, 2)
        assert out["moves"] == 15


def _sharded(rank):
    sdp, opt = _engine("forward", coverage=1.0, shard_shared=True, drift_check_every=5)
    assert not any(sdp.layout.is_sharded(p) for p in sdp.drift_check.pieces)  # FSDP2's shards: one holder each
    unit = next(p.name for p in sdp.drift_check.pieces)
    clean = _train(sdp, opt, rank, 5, clip="sdp")
    step, message = _train(sdp, opt, rank, 10, after_step=_corrupt_after(sdp, rank, 2, unit))
    return clean, step, unit in message, sdp.drift_check.checks


def test_shard_shared_compares_the_units(ranks):
    for clean, step, named, checks in (r["sharded"] for r in ranks):
        assert clean == (None, None) and step == 5 and named and checks == 2  # steps 5 and 10 (5 + 5)


def test_a_simulated_rank_trains_with_torch_clipping():
    model = make_model()
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, 2, 0.5, "block"), simulate_rank=1)
    opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
    assert _train(sdp, opt, 1, 2 * N, clip="torch") == (None, None) and sdp.drift_check.checks == 0


@pytest.mark.parametrize("value", [-1, 2.5, True, "10"])
def test_a_bad_period_is_refused_by_name(value):
    with pytest.raises(ValueError, match=f"drift_check_every must be an int >= 0 .* got {value!r}"):
        sx.SDPConfig(drift_check_every=value)
    assert dataclasses.replace(sx.SDPConfig(), drift_check_every=0).drift_check_every == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_checksum_is_exact_and_free_of_layout(dtype, monkeypatch):
    """A column slice and its contiguous copy, summed in any chunks, give one checksum (the
    owners' compact tensors lay a piece out differently); one changed bit changes it."""
    from subnet_ext.state import drift_check

    full = torch.randn(300, 97, generator=torch.Generator().manual_seed(0)).to(dtype)
    piece = full[:, 10:60]
    expected = drift_check.checksum(piece.contiguous())
    monkeypatch.setattr(drift_check, "_CHUNK", 7 * 50)  # 7 rows per chunk
    assert torch.equal(drift_check.checksum(piece), expected)
    flipped = piece.contiguous()
    bits = flipped.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flipped.element_size()])
    bits[123 // 50, 123 % 50] ^= 1  # the last bit of one value
    assert not torch.equal(drift_check.checksum(flipped), expected)


def test_the_docs_state_the_period():
    """The porting guide (its clipping section), the reliability page and the user guide give N as
    the code defines it."""
    import pathlib

    docs = pathlib.Path(__file__).resolve().parents[2] / "docs"
    clipping = (docs / "porting.md").read_text().split("## Gradient clipping", 1)[1].split("\n## ", 1)[0]
    assert f"`drift_check_every` = {N} optimizer steps" in clipping
    for page in ("reliability.md", "user-guide.md"):
        assert f"`drift_check_every` = {N}" in (docs / page).read_text(), page


def _owned_slices(rank, world):
    """Neuron level, backward regime, C = 0.5 at K = 4: each unit has two owners, and the Parameters
    a rank trains are owned slices (views of the full tensors with their row stride). Clean, every
    check passes; then one rank nudges an owned slice and the next check names it."""
    torch.set_num_threads(1)
    out = {}
    for nudge in (False, True):
        model = make_model()
        plan = sx.plan_subnetworks(model, world, 0.5, "neuron")
        sdp = sx.SubnetDataParallel(model, plan, regime="backward", drift_check_every=2)
        opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
        strided = [n for n, p in sdp.named_parameters() if not p.is_contiguous()]
        target = strided[0] if strided else None

        def after(step, sdp=sdp, target=target):
            if nudge and rank == 1 and step == 2:
                with torch.no_grad():
                    dict(sdp.named_parameters())[target].add_(1e-3)
        out[nudge] = (*_train(sdp, opt, rank, 4, after_step=after), sdp.drift_check.checks, strided, target)
    return out


def test_owned_slices_are_checked_in_the_backward_regime():
    for rank, out in enumerate(run_distributed(_owned_slices, 4)):
        step, message, checks, strided, _ = out[False]
        assert strided and (step, message, checks) == (None, None, 2), rank  # non-contiguous slices, checked
        step, message, _, _, target = out[True]
        assert step == 4 and " disagree on " in message, (rank, step, message)
        name = target.removeprefix("module.").split("_owned")[0]  # the user's parameter the slice is of
        assert name in message, (name, message)

"""The training-loop acceptance matrix: every training-loop feature x {torch DDP at coverage 1.0
(2 ranks), verify_consistency at coverage 0.5 (4 ranks)} x {forward, backward} regime.

Features: gradient clipping (sdp.clip_grad_norm_ vs torch.nn.utils.clip_grad_norm_), loss
scaling (subnet_ext.GradScaler vs torch.amp.GradScaler, fixed scale 2^8, no infs), bf16
autocast, activation checkpointing (non-reentrant checkpoint around each block's forward,
in both models) and torch.compile (backend "aot_eager", over the wrapped engine and over
DDP). Forward regime at block level, backward regime at neuron level; 3 SGD steps on
tests/sdp_helpers batches, a fresh make_model() per cell.

Two launches in all (process start-up dominates on 2 cores): one 2-rank run computes
max |SDP - DDP| over the full state dict for every (feature, regime), one 4-rank run
calls verify_consistency after 3 steps at C = 0.5 for every (feature, regime); the
parametrised tests read the cached results (ids like "clip-forward").
"""
import copy
import traceback
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import subnet_ext as sx
from sdp_helpers import batch, make_model
from subnet_ext.models.residual_mlp import ResidualMLPBlock
from subnet_ext.testing import run_distributed

FEATURES = ("clip", "scaler", "bf16", "ckpt", "compile")
REGIMES = {"forward": "block", "backward": "neuron"}  # regime -> plan level
CELLS = [(f, r) for f in FEATURES for r in REGIMES]
IDS = [f"{f}-{r}" for f, r in CELLS]
STEPS, LR = 3, 0.5
MAX_NORM = 0.05  # below every gradient norm of these runs: clipping is active
SCALE = 2.0**8
FP32_RTOL = 1e-5  # fp32 features: max |SDP - DDP| relative to max |param|
# bf16 autocast: the same bound as test_training_loop.py. bf16 rounds to 2^-8 relative; in
# the backward regime SDP accumulates weight gradients in fp32 where DDP's autocast GEMM
# rounds them to bf16, so after 3 steps the parameters differ by ~1e-3 (measured 9.2e-4 at
# max |param| ~1.0; a few bf16 ulps of the updates), not by fp32 noise. The forward
# regime measured 0.0 (same kernels as DDP under autocast).
BF16_ATOL = 5e-3

RECOMPUTED = {"uses": 0, "computed": 0}  # this process's checkpointed block uses / forward runs


def _counted_block_forward(block, x):
    RECOMPUTED["computed"] += 1
    return ResidualMLPBlock.forward(block, x)


def _checkpointed_forward(block, x):
    RECOMPUTED["uses"] += 1
    return checkpoint(_counted_block_forward, block, x, use_reentrant=False)


def _checkpoint_blocks(model):
    """Each block recomputes its forward during the backward (instance-level, so the
    blocks keep their class and the planner still recognises them)."""
    for block in model.blocks:
        block.forward = types.MethodType(_checkpointed_forward, block)
    return model


def _train(run, params, clip, rank, feature, scaler_cls=sx.GradScaler):
    """STEPS SGD steps of `run` (the module called on x), feature applied -> what the
    tests check besides the parameters (clip norms, scales, logits dtypes, steps)."""
    opt = torch.optim.SGD(params, lr=LR)
    scaler = None
    if feature == "scaler":
        scaler = scaler_cls("cpu", init_scale=SCALE, growth_interval=10**6)
    info = {"norms": [], "scales": [], "dtypes": []}
    for s in range(STEPS):
        x, y = batch(rank, s)
        if feature == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = run(x)
        else:
            logits = run(x)
        info["dtypes"].append(str(logits.dtype))
        loss = F.cross_entropy(logits.float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            info["scales"].append(scaler.get_scale())
        else:
            loss.backward()
            if feature == "clip":
                info["norms"].append(float(clip()))
            opt.step()
        opt.zero_grad()
    info["steps"] = max(int(st["step"]) if "step" in st else 0 for st in opt.state.values()) \
        if opt.state else None
    return info


def _pair(rank, world, feature, regime):
    """(SDP at C = 1.0, DDP) after STEPS steps with `feature` -> max |diff|, max |param|, info."""
    model = make_model()
    reference = copy.deepcopy(model)
    if feature == "ckpt":
        _checkpoint_blocks(model)
        _checkpoint_blocks(reference)
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 1.0, REGIMES[regime]), regime=regime)
    run_sdp, run_ddp = sdp, ddp
    if feature == "compile":
        torch._dynamo.reset()
        run_sdp = torch.compile(sdp, backend="aot_eager")
        run_ddp = torch.compile(ddp, backend="aot_eager")
    before = dict(RECOMPUTED)
    info_sdp = _train(run_sdp, list(sdp.parameters()), None if feature != "clip" else
                      (lambda: sdp.clip_grad_norm_(MAX_NORM)), rank, feature)
    info_ddp = _train(run_ddp, list(ddp.parameters()),
                      lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM), rank, feature,
                      torch.amp.GradScaler)
    full, ref = sdp.full_state_dict(), ddp.module.state_dict()
    assert full.keys() == ref.keys(), (sorted(full), sorted(ref))
    diff = max((full[k].float() - ref[k].float()).abs().max().item() for k in ref)
    scale = max(v.float().abs().max().item() for v in ref.values())
    recomputed = {k: RECOMPUTED[k] - before[k] for k in RECOMPUTED}
    return {"diff": diff, "max_param": scale, "sdp": info_sdp, "ddp": info_ddp, "recomputed": recomputed}


def _consistency(rank, world, feature, regime):
    """SDP at C = 0.5 for STEPS steps with `feature` -> (True or the ConsistencyError text, info)."""
    model = make_model()
    if feature == "ckpt":
        _checkpoint_blocks(model)
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 0.5, REGIMES[regime]), regime=regime)
    run = sdp
    if feature == "compile":
        torch._dynamo.reset()
        run = torch.compile(sdp, backend="aot_eager")
    before = dict(RECOMPUTED)
    info = _train(run, list(sdp.parameters()), None if feature != "clip" else
                  (lambda: sdp.clip_grad_norm_(MAX_NORM)), rank, feature)
    info["recomputed"] = {k: RECOMPUTED[k] - before[k] for k in RECOMPUTED}
    try:
        sdp.verify_consistency()
        return True, info
    except sx.ConsistencyError as e:
        return str(e), info


def _matrix(rank, world, cell):
    out = {}
    for feature, regime in CELLS:
        try:
            out[(feature, regime)] = cell(rank, world, feature, regime)
        except Exception:  # noqa: BLE001 -- reported per cell by the tests
            out[(feature, regime)] = {"error": traceback.format_exc()}
    return out


def _ddp_worker(rank, world):
    return _matrix(rank, world, _pair)


def _half_worker(rank, world):
    return _matrix(rank, world, _consistency)


@pytest.fixture(scope="module")
def ddp_results():
    return run_distributed(_ddp_worker, 2, timeout=300.0)


@pytest.fixture(scope="module")
def half_results():
    return run_distributed(_half_worker, 4, timeout=300.0)


def _feature_was_active(feature, info):
    """The feature really ran in this loop (not a silent no-op)."""
    if feature == "clip":
        assert len(info["norms"]) == STEPS and all(n > MAX_NORM for n in info["norms"]), info["norms"]
    if feature == "scaler":  # fixed scale, no infs: no step skipped, scale unchanged
        assert info["scales"] == [SCALE] * STEPS and info["steps"] in (None, STEPS), info
    expected = "torch.bfloat16" if feature == "bf16" else "torch.float32"
    assert info["dtypes"] == [expected] * STEPS, info["dtypes"]


@pytest.mark.parametrize("feature,regime", CELLS, ids=IDS)
def test_equals_ddp_at_full_coverage(ddp_results, feature, regime):
    for rank, r in enumerate(ddp_results):
        v = r[(feature, regime)]
        assert "error" not in v, f"rank {rank}:\n{v.get('error')}"
        _feature_was_active(feature, v["sdp"])
        _feature_was_active(feature, v["ddp"])
        if feature == "clip":  # the same total norm as torch's clip over DDP's full gradients
            assert v["sdp"]["norms"] == pytest.approx(v["ddp"]["norms"], rel=1e-5), v
        if feature == "ckpt":  # both models recomputed every block use (3 steps x 4 blocks x 2 models)
            assert v["recomputed"]["uses"] == 2 * STEPS * 4, v["recomputed"]
            assert v["recomputed"]["computed"] == 2 * v["recomputed"]["uses"], v["recomputed"]
        bound = BF16_ATOL if feature == "bf16" else FP32_RTOL * v["max_param"]
        assert v["diff"] <= bound, (feature, regime, v["diff"], bound)
    assert ddp_results[0][(feature, regime)]["diff"] == ddp_results[1][(feature, regime)]["diff"]


@pytest.mark.parametrize("feature,regime", CELLS, ids=IDS)
def test_consistent_at_half_coverage_with_four_ranks(half_results, feature, regime):
    for rank, r in enumerate(half_results):
        v = r[(feature, regime)]
        assert isinstance(v, tuple), f"rank {rank}:\n{v.get('error')}"
        consistent, info = v
        assert consistent is True, f"rank {rank}: {consistent}"
        _feature_was_active(feature, info)
        if feature == "ckpt":  # the blocks this rank runs were checkpointed and recomputed
            uses = info["recomputed"]["uses"]
            assert uses > 0 and info["recomputed"]["computed"] == 2 * uses, info["recomputed"]
    if feature == "clip":  # one whole-model norm, agreed by every rank
        assert len({tuple(r[(feature, regime)][1]["norms"]) for r in half_results}) == 1

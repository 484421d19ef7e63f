"""bench/e2e.py's statistics (bench/e2e_report.py): step-time ratios are taken per round and
reported as median [min-max]; every verdict uses the median ratio; a configuration's round
time is its slowest rank's. Expected values are worked out by hand from made-up rounds.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from e2e_report import combine, ratio_cell, round_ratios, shard_targets  # noqa: E402
from e2e_worker import Config  # noqa: E402

MIB = 2**20


def _figures(rounds, model_state=60 * MIB, **extra):
    return {"step_s": sorted(rounds)[len(rounds) // 2], "round_steps": list(rounds), "model_state": model_state,
            "predicted_model_state": model_state, "flops_share": 0.36, **extra}


def test_ratios_are_taken_per_round_not_from_pooled_medians():
    # The machine was slow for DDP's windows of rounds 2 and 3 and for SDP's of round 3:
    # per round SDP/DDP = 0.5, 1/6, 0.5 -> median 0.5; the ratio of the pooled medians
    # would be 0.5 / 3 = 1/6.
    ddp, sdp = _figures([1.0, 3.0, 3.0]), _figures([0.5, 0.5, 1.5])
    assert round_ratios(sdp, ddp) == pytest.approx([0.5, 1 / 6, 0.5])
    assert ratio_cell(sdp, ddp) == "0.500 [0.167-0.500]"
    assert ratio_cell(sdp, {"error": "refused"}) == "n/a"


def test_a_rounds_time_is_the_slowest_ranks():
    cfg = Config(model="small", world=2, method="ddp")
    rank = lambda steps: {"ddp": {"rounds": [{"step_s": s, "model_state": 10, "peak_growth": 5, "comm_bytes": 1,  # noqa: E731
                                              "collectives": 1, "predicted_model_state": 10, "flops_share": 1.0}
                                             for s in steps]}}
    [(_, figures)] = combine([cfg], [rank([1.0, 2.0, 1.5]), rank([1.2, 1.0, 1.4])])
    assert figures["round_steps"] == [1.2, 2.0, 1.5]
    assert figures["step_s"] == 1.5
    [(_, failed)] = combine([cfg], [rank([1.0]), {"ddp": {"rounds": [], "error": "ValueError: no"}}])
    assert failed == {"error": "ValueError: no"}


def _shard_results(k2_rounds):
    ddp = Config(model="small", world=2, method="ddp")
    shard = Config(model="small", world=2, method="sdp", level="block", regime="forward", coverage=0.5,
                   shard_shared=True)
    return [(ddp, _figures([1.0, 1.0, 1.0])), (shard, _figures(k2_rounds, model_state=30 * MIB))]


def test_verdicts_use_the_median_ratio():
    # Rounds 0.55, 0.90 (one slow window), 0.58: median 0.58 <= 0.6 passes despite the outlier.
    lines = shard_targets(_shard_results([0.55, 0.90, 0.58]), "small", "cpu")
    line = next(ln for ln in lines if "2 ranks" in ln)
    assert "step time 0.580× DDP (rounds 0.550-0.900; target ≤ 0.6): PASS" in line
    assert "model state 0.500× DDP (target ≤ 0.52): PASS" in line
    # Rounds 0.62, 0.30, 0.65: median 0.62 fails although one round was fast.
    line = next(ln for ln in shard_targets(_shard_results([0.62, 0.30, 0.65]), "small", "cpu") if "2 ranks" in ln)
    assert "step time 0.620× DDP (rounds 0.300-0.650; target ≤ 0.6): FAIL" in line

"""bench/compression.py end to end at a tiny size (digits, 2 seeds, 2 steps, one timing round),
and its confidence interval.

The run's records are checked against what this file knows independently: the bf16 wire
carries half of fp32's bytes, the low-rank hook fewer still, the communicator's count equals
the cost model's prediction in every run, and the report shows every reduction.
"""
import glob
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench"))

from compression import interval  # noqa: E402

REDUCTIONS = ("fp32", "bf16", "low-rank r=1", "low-rank r=4")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("compression")
    report, work = out / "compression.md", out / "work"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "compression.py"), "--seeds", "2", "--steps",
                           "2", "--rounds", "1", "--window", "1", "--tasks", "digits", "--out", str(report),
                           "--work", str(work)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = []
    for path in glob.glob(str(work / "train" / "*.json")):
        with open(path) as f:
            records.append(json.load(f))
    return report.read_text(), records


def test_every_run_counts_what_the_cost_model_predicts(run):
    _, records = run
    assert sorted((r["seed"], r["reduction"]) for r in records) == sorted((s, r) for s in (0, 1) for r in REDUCTIONS)
    for r in records:
        assert r["bytes_per_step"] == r["predicted_bytes"] and r["steps"] == 2, r
        assert math.isfinite(r["loss"]) and r["step_seconds"] > 0, r
    by = {(r["seed"], r["reduction"]): r["bytes_per_step"] for r in records}
    for seed in (0, 1):
        assert by[(seed, "bf16")] * 2 == by[(seed, "fp32")]
        assert by[(seed, "low-rank r=1")] < by[(seed, "low-rank r=4")] < by[(seed, "bf16")]


def test_the_report_shows_every_reduction_and_the_timing(run):
    report, _ = run
    assert report.startswith("# Gradient compression under SDP")
    assert "Load average (1, 5, 15 min)" in report and "commit " in report
    for name in REDUCTIONS:
        assert f"| {name} | " in report and f"| digits | {name} | " in report
    assert report.count("= counted") == len(REDUCTIONS)


def test_confidence_interval_of_paired_differences():
    mean, half = interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.302653 * 1.0 / math.sqrt(3), rel=1e-5)  # t(0.975, 2) = 4.3027
    assert math.isnan(interval([0.5])[1])

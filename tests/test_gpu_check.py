"""bench/gpu_check.sh's plumbing, on CPU (--dry-run): one summary row per step with its exit
code, written after every step; an injected failure (GPU_CHECK_FAIL_STEP) makes the script
exit non-zero while later steps still run and are listed. Also: `-m cuda` selects the
device='cuda' variants of parametrised tests (tests/conftest.py).
"""
import os
import re
import subprocess
import sys
from pathlib import Path


pytest_plugins = ["pytester"]  # for the marker test

ROOT = Path(__file__).resolve().parents[1]
STEPS = {"phase1": ["build", "build-info", "tests-cuda", "bench-build", "bench-masked-linear", "bench-pack-segments"],
         "phase2": ["build", "train-nccl", "simulated-rank-1b", "e2e-gpu"]}


def run_check(phase: str, out: Path, fail_step: str | None = None) -> tuple[int, dict, str]:
    """Runs the dry run; returns (exit code, {step: (exit, notes)} from summary.md, stdout)."""
    env = dict(os.environ, OUT=str(out), PY=sys.executable, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("GPU_CHECK_FAIL_STEP", None)
    if fail_step:
        env["GPU_CHECK_FAIL_STEP"] = fail_step
    proc = subprocess.run(["bash", "bench/gpu_check.sh", phase, "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    rows = {}
    for line in (out / "summary.md").read_text().splitlines():
        m = re.match(r"\| ([\w-]+) \| (-|\d+) \| (\d+) \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(4))
    return proc.returncode, rows, proc.stdout + proc.stderr


def test_phase1_dry_run_with_an_injected_failure(tmp_path):
    code, rows, output = run_check("phase1", tmp_path, fail_step="build-info")
    assert code != 0, output
    assert list(rows) == STEPS["phase1"], rows  # one row per step, in order, after the failed one too
    assert rows["build-info"][0] == "97" and "GPU_CHECK_FAIL_STEP" in rows["build-info"][1]
    assert "failing on purpose" in (tmp_path / "build-info.log").read_text()  # each step's own log
    assert rows["tests-cuda"][0] == "0", rows  # the later step still ran
    assert "skipped" in (tmp_path / "tests-cuda.log").read_text()  # the cuda tests were selected (skipped on CPU)
    for name in ("build", "bench-build", "bench-masked-linear", "bench-pack-segments"):
        assert rows[name][0] == "-" and "skipped (dry run" in rows[name][1]


def test_phase2_dry_run(tmp_path):
    code, rows, output = run_check("phase2", tmp_path)
    assert code == 0, output
    assert list(rows) == STEPS["phase2"], rows
    assert rows["build"][0] == "-" and "skipped (dry run" in rows["build"][1]
    assert all(rows[name][0] == "0" for name in STEPS["phase2"][1:]), rows
    assert "| sdp-block-forward" in (tmp_path / "train-nccl-report.md").read_text()  # the training report came back
    assert "sdp-block-forward" in (tmp_path / "e2e-gpu.md").read_text()  # the e2e table was written
    assert len(list(tmp_path.iterdir())) <= 8  # what the device tool brings back


def test_bad_phase_is_refused(tmp_path):
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "phase3"], cwd=ROOT, env=dict(os.environ, OUT=str(tmp_path)),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "phase1|phase2" in proc.stderr and "phase3" in proc.stderr


def test_cuda_marker_selects_cuda_variants(pytester):
    """The conftest hook, on a stand-in test file: only the device='cuda' variant is selected."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    cuda: needs a GPU\n")
    pytester.makepyfile(test_x="""
import pytest
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_op(device):
    pass
def test_plain():
    pass
""")
    result = pytester.runpytest("-m", "cuda", "--collect-only", "-q")
    listed = [ln for ln in result.outlines if "::" in ln]
    assert listed == ["test_x.py::test_op[cuda]"], result.outlines


"""bench/gpu_check.sh's plumbing, on CPU (--dry-run): one summary row per step with its exit
code and result, written after every step; the versions in the summary; an injected
failure (GPU_CHECK_FAIL_STEP) makes the script exit 1 while later steps still run and are
listed; a failed benchmark build skips the benchmarks with a note; a benchmark that ran
below its speed target (exit 3) is reported as such, not as a failure (script exit 3).
The phase-1 dry run really compiles the benchmark binaries (bench/build.sh). Also: `-m
cuda` selects the device='cuda' variants of parametrised tests (tests/conftest.py).
"""
import os
import re
import subprocess
import sys
from pathlib import Path


pytest_plugins = ["pytester"]  # for the marker test

ROOT = Path(__file__).resolve().parents[2]
STEPS = {"phase1": ["build", "build-info", "tests-cuda", "bench-build", "bench-masked-linear", "bench-pack-segments"],
         "phase2": ["build", "train-nccl", "simulated-rank-1b", "e2e-gpu"]}
BENCHES = ("bench-masked-linear", "bench-pack-segments")


def run_check(phase: str, out: Path, inject: str | None = None, timeout: float = 300) -> tuple[int, dict, str]:
    """Runs the dry run; returns (exit code, {step: (exit, result, notes)} from summary.md, output)."""
    env = dict(os.environ, OUT=str(out), PY=sys.executable, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("GPU_CHECK_FAIL_STEP", None)
    if inject:
        env["GPU_CHECK_FAIL_STEP"] = inject
    proc = subprocess.run(["bash", "bench/gpu_check.sh", phase, "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    rows = {}
    for line in (out / "summary.md").read_text().splitlines():
        m = re.match(r"\| ([\w-]+) \| (-|\d+) \| ([\w ]+) \| (\d+) \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3), m.group(5))
    return proc.returncode, rows, proc.stdout + proc.stderr


def test_phase1_dry_run_runs_the_cuda_tests_and_compiles_the_benchmarks(tmp_path):
    code, rows, output = run_check("phase1", tmp_path, timeout=900)
    assert list(rows) == STEPS["phase1"], rows  # one row per step, in order
    assert rows["build"][:2] == ("-", "skipped") and "dry run" in rows["build"][2]
    # Every cuda-marked test was selected (skipped on CPU); the note counts them.
    m = re.search(r"cuda-marked tests: (\d+) selected, 0 passed, 0 failed, (\d+) skipped", rows["tests-cuda"][2])
    assert rows["tests-cuda"][:2] == ("0", "ok") and m and int(m.group(1)) == int(m.group(2)) > 30, rows
    assert rows["bench-build"][:2] == ("0", "ok"), (rows["bench-build"], (tmp_path / "bench-build.log").read_text())
    for name in BENCHES:
        assert rows[name][:2] == ("0", "ok") and "built; not run (dry run" in rows[name][2], rows[name]
    summary = (tmp_path / "summary.md").read_text()
    import torch

    assert f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}" in summary and "driver" in summary
    assert code == 0, output
    assert len(list(tmp_path.iterdir())) <= 8  # what the device tool brings back


def test_phase1_failed_steps_are_listed_and_a_failed_bench_build_skips_the_benchmarks(tmp_path):
    code, rows, output = run_check("phase1", tmp_path, inject="build-info,bench-build")
    assert code == 1, output
    assert list(rows) == STEPS["phase1"], rows
    assert rows["build-info"][:2] == ("97", "failed") and "GPU_CHECK_FAIL_STEP" in rows["build-info"][2]
    assert "exiting 97 on purpose" in (tmp_path / "build-info.log").read_text()  # each step's own log
    assert rows["tests-cuda"][:2] == ("0", "ok"), rows  # a later step still ran
    assert rows["bench-build"][:2] == ("97", "failed")
    for name in BENCHES:
        assert rows[name][:2] == ("-", "skipped") and "bench-build failed (exit 97)" in rows[name][2], rows[name]
        assert not (tmp_path / f"{name}.log").exists()  # not run: no "No such file" from a missing binary


def test_a_benchmark_below_its_target_is_not_a_failure(tmp_path):
    code, rows, output = run_check("phase1", tmp_path,
                                   inject="bench-build:0,bench-masked-linear:3,bench-pack-segments:0")
    assert rows["bench-masked-linear"][:2] == ("3", "below target"), rows
    assert rows["bench-pack-segments"][:2] == ("0", "ok"), rows
    assert code == 3 and "below their speed target" in output, output


def test_phase2_dry_run(tmp_path):
    code, rows, output = run_check("phase2", tmp_path)
    assert code == 0, output
    assert list(rows) == STEPS["phase2"], rows
    assert rows["build"][:2] == ("-", "skipped") and "dry run" in rows["build"][2]
    assert all(rows[name][:2] == ("0", "ok") for name in STEPS["phase2"][1:]), rows
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

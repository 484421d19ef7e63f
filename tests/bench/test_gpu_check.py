"""bench/gpu_check.sh's plumbing, on CPU (--dry-run): one summary row per step with its phase,
exit code and result, written after every step; the commit and versions in the summary;
what comes back fits the device tool's limits (the summary and one archive per phase,
holding each step's log, pytest's junit file and durations, the e2e report); the limits
of a real run add up to the 480 s budget; an injected failure (GPU_CHECK_FAIL_STEP) makes
the script exit 1 while later steps still run and are listed; a failed benchmark build
skips the benchmarks with a note; a benchmark that ran below its speed target (exit 3) is
reported as such, not as a failure (script exit 3). The dry run really compiles the
benchmark binaries (bench/build.sh) and runs bench/memory_1b.py at its CPU size. The cuda
tests run under a per-test limit (pytest-timeout's options where it is installed, with its
thread method under pytest-xdist; pytest's faulthandler_timeout where it is not, as here);
pip's version check is off; the summary is written once more at exit with the exit code.
Also: `-m cuda` selects the device='cuda' variants of
parametrised tests (tests/conftest.py).
"""
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest


pytest_plugins = ["pytester"]  # for the marker test

ROOT = Path(__file__).resolve().parents[2]
STEPS = [("build", "build"), ("build", "build-info"), ("build", "bench-build"), ("tests", "tests-cuda"),
         ("bench", "bench-masked-linear"), ("bench", "bench-pack-segments"), ("e2e", "train-nccl"),
         ("e2e", "e2e-gpu"), ("e2e", "memory-1b")]
BENCHES = ("bench-masked-linear", "bench-pack-segments")
RETURN_LIMIT_FILES = 8  # what the device tool brings back from $OUT


def run_check(out: Path, *args: str, inject: str | None = None, timeout: float = 900, path: str | None = None):
    """Runs the dry run; returns (exit code, {step: (phase, exit, result, notes)} from summary.md, output).
    path: a folder put before the repository on PYTHONPATH (stand-in packages)."""
    env = dict(os.environ, OUT=str(out), PY=sys.executable, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [path, str(ROOT)])),
               GPU_CHECK_WORK=str(out.parent / f"{out.name}-work"))
    env.pop("GPU_CHECK_FAIL_STEP", None)
    if inject:
        env["GPU_CHECK_FAIL_STEP"] = inject
    proc = subprocess.run(["bash", "bench/gpu_check.sh", *args, "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    rows = {}
    for line in (out / "summary.md").read_text().splitlines():
        m = re.match(r"\| (\w+) \| ([\w-]+) \| (-|\d+) \| ([\w ]+) \| (\d+) \| (.*) \|$", line)
        if m:
            rows[m.group(2)] = (m.group(1), m.group(3), m.group(4), m.group(6))
    return proc.returncode, rows, proc.stdout + proc.stderr


def members(archive: Path) -> dict[str, str]:
    """{member name: text} of a phase archive."""
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}


@pytest.fixture(scope="module")
def dry_run_all(tmp_path_factory):
    """`all --dry-run`, once: every phase's plumbing on the CPU (the benchmarks really compiled)."""
    out = tmp_path_factory.mktemp("gpu_check") / "out"
    started = time.monotonic()
    code, rows, output = run_check(out, "all")
    return code, rows, output, out, time.monotonic() - started


def test_all_dry_run_runs_every_phase_within_its_limits(dry_run_all):
    code, rows, output, out, seconds = dry_run_all
    assert code == 0, output
    assert [(phase, step) for step, (phase, *_) in rows.items()] == STEPS, rows  # one row per step, in order
    assert rows["build"][1:3] == ("-", "skipped") and "dry run" in rows["build"][3]
    assert all(rows[step][1:3] == ("0", "ok") for _, step in STEPS[1:]), rows
    # Every cuda-marked test was selected (skipped on CPU); the note counts them.
    m = re.search(r"cuda-marked tests: (\d+) selected, 0 passed, 0 failed, (\d+) skipped", rows["tests-cuda"][3])
    assert m and int(m.group(1)) == int(m.group(2)) > 30, rows["tests-cuda"]
    for name in BENCHES:
        assert "built; not run (dry run" in rows[name][3], rows[name]
    summary = (out / "summary.md").read_text()
    import torch

    assert f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}" in summary and "driver" in summary
    assert "commit " in summary
    # What comes back: the summary and one archive per phase, no folders.
    assert sorted(p.name for p in out.iterdir()) == ["bench.tar.gz", "build.tar.gz", "e2e.tar.gz", "summary.md",
                                                      "tests.tar.gz"]
    assert len(list(out.iterdir())) <= RETURN_LIMIT_FILES
    tests = members(out / "tests.tar.gz")
    assert "tests/junit.xml" in tests and "<testsuite" in tests["tests/junit.xml"]
    assert "slowest" in tests["tests/tests-cuda.log"]  # --durations
    e2e = members(out / "e2e.tar.gz")
    assert "sdp-block-forward" in e2e["e2e/train-nccl-report.md"]  # the training report came back
    assert "sdp-block-forward" in e2e["e2e/e2e-gpu.md"]  # the e2e table was written
    assert "1 round" in e2e["e2e/e2e-gpu.md"] or "1 interleaved round" in e2e["e2e/e2e-gpu.md"]
    # bench/memory_1b.py at its CPU size: every configuration's row, and its JSON beside it.
    assert "| sdp block/forward C=0.5 | " in e2e["e2e/memory-1b.md"] and "e2e/memory-1b.json" in e2e
    assert re.search(r"13 of 13 rows ran", rows["memory-1b"][3]), rows["memory-1b"]
    # The per-test limit: pytest's own faulthandler_timeout here (no pytest-timeout installed).
    assert "-o faulthandler_timeout=90" in tests["tests/tests-cuda.log"].split("\n")[2]
    assert "PIP_DISABLE_PIP_VERSION_CHECK=1" in members(out / "build.tar.gz")["build/build-info.log"]
    assert re.search(r"Finished: exit 0 after \d+ s\.", summary)
    assert seconds < 600, seconds


def limits(table: str) -> dict[str, int]:
    """The script's GPU_LIMIT or DRY_LIMIT table: {step: seconds}."""
    text = (ROOT / "bench" / "gpu_check.sh").read_text()
    body = re.search(rf"declare -A {table}=\((.*?)\)\n", text, re.DOTALL).group(1)
    return {k: int(v) for k, v in re.findall(r"\[([\w-]+)\]=(\d+)", body)}


def test_gpu_limits_add_up_to_the_device_budget():
    """Every step has a limit on the GPU and in the dry run; on the GPU they add up to at most
    470 s (one device call of 480 s, the build included); the e2e runs at most 2 rounds there;
    the per-test limit is below the tests step's; memory_1b.py stops starting rows in time."""
    gpu = limits("GPU_LIMIT")
    assert set(gpu) == set(limits("DRY_LIMIT")) == {step for _, step in STEPS}, gpu
    # Their sum leaves 10 s of the call for the script's own work between steps.
    assert sum(gpu.values()) <= 470 and min(gpu.values()) > 0, gpu
    text = (ROOT / "bench" / "gpu_check.sh").read_text()
    test_limit = int(re.search(r"TEST_LIMIT=\$\{GPU_CHECK_TEST_LIMIT:-(\d+)\}", text).group(1))
    memory_limit = int(re.search(r"MEMORY_TIME_LIMIT=(\d+)", text).group(1))
    assert test_limit < gpu["tests-cuda"] and memory_limit + 25 <= gpu["memory-1b"], (test_limit, memory_limit)
    e2e = text.split("phase_e2e()")[1]
    assert re.search(r"--rounds [12] ", e2e.split("if ((dry))")[0]), "e2e on the GPU: at most 2 rounds"


def test_failed_steps_are_listed_and_a_failed_bench_build_skips_the_benchmarks(tmp_path):
    code, rows, output = run_check(tmp_path / "out", "build", "bench", inject="build-info,bench-build")
    assert code == 1, output
    assert "Finished: exit 1 after" in (tmp_path / "out" / "summary.md").read_text()
    assert list(rows) == ["build", "build-info", "bench-build", *BENCHES], rows
    assert rows["build-info"][1:3] == ("97", "failed") and "GPU_CHECK_FAIL_STEP" in rows["build-info"][3]
    assert "exiting 97 on purpose" in members(tmp_path / "out" / "build.tar.gz")["build/build-info.log"]
    assert rows["bench-build"][1:3] == ("97", "failed")  # a later step still ran
    for name in BENCHES:
        assert rows[name][1:3] == ("-", "skipped") and "bench-build failed (exit 97)" in rows[name][3], rows[name]


def test_a_benchmark_below_its_target_is_not_a_failure(tmp_path):
    code, rows, output = run_check(tmp_path / "out", "build", "bench",
                                   inject="build-info:0,bench-build:0,bench-masked-linear:3,bench-pack-segments:0")
    assert rows["bench-masked-linear"][1:3] == ("3", "below target"), rows
    assert rows["bench-pack-segments"][1:3] == ("0", "ok"), rows
    assert code == 3 and "below their speed target" in output, output


@pytest.mark.parametrize("xdist,method", [(False, "signal"), (True, "thread")])
def test_per_test_limit_uses_pytest_timeout_where_installed(tmp_path, xdist, method):
    """Stand-in pytest_timeout (and xdist) modules on the path: the tests step's command carries
    pytest-timeout's options, its thread method with xdist workers. The step itself is replaced
    by an injected exit 0 (the command is logged before it would run)."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "pytest_timeout.py").write_text("")
    if xdist:
        (stubs / "xdist").mkdir()
        (stubs / "xdist" / "__init__.py").write_text("")
    code, rows, output = run_check(tmp_path / "out", "tests", inject="tests-cuda:0", path=str(stubs))
    assert code == 0, output
    command = members(tmp_path / "out" / "tests.tar.gz")["tests/tests-cuda.log"].split("\n")[2]
    assert f"--timeout=90 --timeout-method={method}" in command and "faulthandler_timeout" not in command
    assert ("-n 4" in command) == xdist


@pytest.mark.parametrize("args", [["phase3"], [], ["all", "--fast"]])
def test_bad_command_line_is_refused(tmp_path, args):
    proc = subprocess.run(["bash", "bench/gpu_check.sh", *args], cwd=ROOT, env=dict(os.environ, OUT=str(tmp_path)),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "all|{build|tests|bench|e2e}" in proc.stderr, proc.stderr


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

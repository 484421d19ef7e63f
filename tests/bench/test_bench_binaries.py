"""The benchmark binaries build and run, as `make bench` builds and runs them.

bench/build.sh compiles every binary into bench/bin/ (the CPU ones always; the CUDA ones
when the package has CUDA kernels: host compiler and CUDA headers only, no GPU needed;
binaries already up to date are reused). Each CPU binary then runs at --quick size and
must exit 0 and print its table and its targets; the exit codes tell a failure (1: a
result over its error tolerance, bad arguments) from a missed speed target (3), which a
test provokes with SUBNET_EXT_BENCH_FAULT; bench/run_cpu.sh writes its results file with
the command, commit and load average. Without a GPU a CUDA binary must start (its
libraries load) and fail cleanly, saying there is no device.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_marks import needs_cuda
from subnet_ext import _build_info

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "bench" / "bin"
# binary -> the first cells of its table's header row
CPU_BINARIES = {"masked_linear_bench": "| shape | f | ours ms |", "pack_segments_bench": "| tensors | MiB total |"}
CUDA_BINARIES = {"masked_linear_cuda_bench": "| path | shape | f |", "pack_segments_cuda_bench": "| dtype | tensors |"}
BUILT_CUDA = CUDA_BINARIES if _build_info.WITH_CUDA else {}


def _env(**extra) -> dict:
    env = dict(os.environ, PY=sys.executable, OMP_NUM_THREADS="1", **extra)
    if "SUBNET_EXT_BENCH_FAULT" not in extra:
        env.pop("SUBNET_EXT_BENCH_FAULT", None)
    return env


@pytest.fixture(scope="module")
def built():
    """bench/build.sh's run (it rebuilds only what is out of date)."""
    result = subprocess.run(["bash", "bench/build.sh"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def run_binary(name: str, *args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = _env(**({"SUBNET_EXT_BENCH_FAULT": fault} if fault else {}))
    return subprocess.run([str(BIN / name), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def assert_table(stdout: str, header: str) -> None:
    """stdout holds a Markdown table starting with `header`, with at least one data row."""
    lines = stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(header)]
    assert starts, f"no table header {header!r} in:\n{stdout}"
    rows = lines[starts[0] + 2:]
    assert lines[starts[0] + 1].startswith("|---") and rows and rows[0].startswith("| "), stdout


def test_every_binary_is_built(built):
    for name in [*CPU_BINARIES, *BUILT_CUDA]:
        assert os.access(BIN / name, os.X_OK), f"bench/bin/{name} was not built:\n{built.stdout}{built.stderr}"
    if not _build_info.WITH_CUDA:
        assert "CUDA benchmarks not built" in built.stdout


@pytest.mark.parametrize("name", CPU_BINARIES)
def test_cpu_binary_runs_quick(built, name):
    result = run_binary(name, "--quick")
    assert result.returncode == 0, result.stdout + result.stderr
    assert_table(result.stdout, CPU_BINARIES[name])
    assert "Targets (CPU fp32" in result.stdout and "speed targets not judged" in result.stdout


@pytest.mark.parametrize("name", CPU_BINARIES)
@pytest.mark.parametrize("fault, code, message", [("wrong-result", 1, "over its error tolerance"),
                                                  ("missed-target", 3, "")])
def test_exit_code_tells_a_failure_from_a_missed_target(built, name, fault, code, message):
    result = run_binary(name, "--quick", fault=fault)
    assert result.returncode == code, result.stdout + result.stderr
    assert message in result.stderr
    assert_table(result.stdout, CPU_BINARIES[name])  # it ran: the table is there either way


def test_bad_argument_is_a_failure(built):
    result = run_binary("pack_segments_bench", "--fast")
    assert result.returncode == 1 and "unknown argument '--fast'" in result.stderr, result.stderr


@needs_cuda
@pytest.mark.parametrize("name", CUDA_BINARIES)
def test_cuda_binary_runs_quick(built, name):
    result = run_binary(name, "--quick")
    assert result.returncode == 0, result.stdout + result.stderr
    assert_table(result.stdout, CUDA_BINARIES[name])
    assert "Targets (GPU" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the quick run replaces it where a device is visible")
@pytest.mark.parametrize("name", BUILT_CUDA)
def test_cuda_binary_says_no_gpu(built, name):
    """Without a GPU a CUDA binary's libraries still load, and it refuses cleanly."""
    result = run_binary(name)
    assert result.returncode == 1 and "no CUDA device visible" in result.stderr, result.stdout + result.stderr


def _run_cpu_sh(out: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    env = _env(**({"SUBNET_EXT_BENCH_FAULT": fault} if fault else {}))
    return subprocess.run(["bash", "bench/run_cpu.sh", "--quick", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_run_cpu_sh_writes_the_results_file(built, tmp_path):
    out = tmp_path / "cpu.md"
    result = _run_cpu_sh(out)
    assert result.returncode == 0, result.stdout + result.stderr
    text = out.read_text()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert f"Command: `bash bench/run_cpu.sh --quick --out {out}`" in text
    assert f"commit {head}" in text
    assert "Load average (1, 5, 15 min): " in text and " before, " in text and " after." in text
    for name, header in CPU_BINARIES.items():
        assert_table(text.split(f"`bench/bin/{name} --quick`")[0], header)
        assert f"Exit code of `bench/bin/{name} --quick`: 0 (ran" in text


def test_run_cpu_sh_fails_when_a_binary_fails(built, tmp_path):
    out = tmp_path / "cpu.md"
    result = _run_cpu_sh(out, fault="wrong-result")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Exit code of `bench/bin/masked_linear_bench --quick`: 1 (FAILED" in out.read_text()

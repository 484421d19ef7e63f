"""Where a benchmark result came from: the commit, the machine and its load.

Every results file under bench/results/ states the command that wrote it, the commit it
ran on (and whether the tree had uncommitted changes), and the load average before and
after the run, so that a reader can tell a quiet-machine figure from a contended one.

    python bench/provenance.py commit    # e.g. "3e25744" or "3e25744 + uncommitted changes"
    python bench/provenance.py load      # "0.12 0.30 0.41" (1, 5, 15 min)
    python bench/provenance.py machine   # cores, CPU model, torch version
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def commit() -> str:
    """The checked-out commit (short hash), with "+ uncommitted changes" when tracked files
    outside bench/results/ differ from it; "unknown" outside a git checkout. A copy of the
    tree whose git data is not its own (the GPU machine's: bench/gpu_check.sh) names its
    commit in GPU_CHECK_COMMIT, which wins."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"] + " (GPU_CHECK_COMMIT)"
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" + uncommitted changes" if dirty else "")


def load() -> str:
    """The load average over 1, 5 and 15 minutes, e.g. "0.12 0.30 0.41"."""
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo; the architecture elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_version() -> str:
    """torch.__version__ (e.g. "2.14.1+cu130"), read from torch/version.py without importing torch."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
            return re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", f.read(), re.M).group(1)
    except (AttributeError, OSError, TypeError):
        return "unknown"


def machine() -> str:
    """Cores, CPU model and torch version, e.g. "2 cores, Intel(R) Xeon(R) Processor, torch 2.14.1"."""
    return f"{os.cpu_count()} cores, {cpu_model()}, torch {torch_version()}"


def header(title: str, command: str, started: float, load_before: str) -> list[str]:
    """The first lines of a results file: `title`, the command with the time, commit and wall
    time since `started` (time.time()), the machine, and the load before (provenance.load()
    when the run began) and now."""
    import time

    return [f"# {title}", "",
            f"Command: `{command}`, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}, commit {commit()}, "
            f"wall time {time.time() - started:.0f} s.",
            f"Machine: {machine()}. Load average (1, 5, 15 min): {load_before} before, {load()} after."]


def emit(lines: list[str], out: str | None) -> None:
    """Print a results file's lines, and write them to `out` when given."""
    report = "\n".join(lines) + "\n"
    if out:
        with open(out, "w") as f:
            f.write(report)
    print(report)


def baseline_tree(commit: str, folder: str) -> str:
    """The files of `commit` under `folder`/baseline (git archive), with this tree's built extension
    copied in, for a benchmark that runs the same command on a baseline and on this tree."""
    import glob
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(folder, "baseline")
    os.makedirs(path)
    archive = subprocess.run(["git", "archive", commit], cwd=root, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", path], input=archive, check=True)
    for built in glob.glob(os.path.join(root, "subnet_ext", "_C*.so")):
        shutil.copy(built, os.path.join(path, "subnet_ext"))
    return path


def main(argv: list[str]) -> int:
    what = {"commit": commit, "load": load, "machine": machine}
    if len(argv) != 1 or argv[0] not in what:
        print(f"usage: python bench/provenance.py {'|'.join(what)} (got {' '.join(argv) or 'nothing'})",
              file=sys.stderr)
        return 2
    print(what[argv[0]]())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`make demo` builds once: with a build stamp newer than every input, a dry run (make -n,
the real Makefile) would run no pip or setup.py; a changed kernel source, header or
setup.py makes it rebuild. Nothing is built: the Makefile runs in a scratch copy of its
inputs (csrc/, setup.py, pyproject.toml) with made-up timestamps.
"""
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


@pytest.fixture
def tree(tmp_path):
    """A scratch copy of the Makefile's inputs: sources old, .venv/.deps newer, the stamp newest."""
    for name in ("Makefile", "setup.py", "pyproject.toml"):
        shutil.copy2(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    now = time.time()
    for path in [tmp_path / "Makefile", tmp_path / "setup.py", tmp_path / "pyproject.toml",
                 *(p for p in (tmp_path / "csrc").rglob("*") if p.is_file())]:
        os.utime(path, (now - 300, now - 300))
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".deps").touch()
    os.utime(tmp_path / ".venv" / ".deps", (now - 200, now - 200))
    return tmp_path


def dry_run(tree: Path, target: str = "demo") -> list[str]:
    """The commands `make -n target` would run in `tree`."""
    out = subprocess.run(["make", "-n", target], cwd=tree, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def installs(commands: list[str]) -> list[str]:
    return [c for c in commands if "pip" in c or "setup.py" in c]


def stamp(tree: Path) -> None:
    """What a finished build leaves (the build target's file)."""
    (tree / "build").mkdir(exist_ok=True)
    (tree / "build" / "subnet_ext.stamp").touch()


def test_no_stamp_builds_then_stamp_skips_pip(tree):
    assert installs(dry_run(tree)), "without a build stamp, make demo must build"
    stamp(tree)
    commands = dry_run(tree)
    assert installs(commands) == [], commands
    assert any("subnet_ext.cli.train compare" in c for c in commands), commands  # the demo itself still runs
    assert installs(dry_run(tree, "bench")) == []


@pytest.mark.parametrize("changed", ["csrc/masked_linear.cpp", "csrc/kernels/segments.h",
                                     "csrc/cuda/pack_segments_cuda.cu", "setup.py"])
def test_a_changed_input_rebuilds(tree, changed):
    stamp(tree)
    assert installs(dry_run(tree)) == []
    later = time.time() + 60
    os.utime(tree / changed, (later, later))
    assert any("pip install" in c for c in installs(dry_run(tree))), changed

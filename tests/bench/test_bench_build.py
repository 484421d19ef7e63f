"""bench/build.sh must fail when a compile or link fails (it runs them as background jobs)."""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tree_copy(tmp_path: Path) -> Path:
    """The sources build.sh reads and the built library it links, in a fresh tree (no
    up-to-date binaries to skip)."""
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    (tmp_path / "subnet_ext").mkdir()
    for lib in (ROOT / "subnet_ext").glob("_C*.so"):
        shutil.copy2(lib, tmp_path / "subnet_ext" / lib.name)
    (tmp_path / "bench").mkdir()
    for f in (ROOT / "bench").iterdir():
        if f.is_file() and f.suffix in (".sh", ".h", ".cpp"):
            shutil.copy2(f, tmp_path / "bench" / f.name)
    return tmp_path


def test_build_sh_exits_non_zero_when_a_compile_fails(tmp_path):
    tree = _tree_copy(tmp_path)
    torch_dir = os.path.dirname(importlib.util.find_spec("torch").origin)
    # every compile-and-link job fails at once; TORCH_DIR spares the script a torch import
    env = dict(os.environ, CXX="false", PY=sys.executable, TORCH_DIR=torch_dir)
    result = subprocess.run(["bash", str(tree / "bench" / "build.sh")], cwd=tree, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "a compile or link step failed" in result.stderr
    assert "build bench/bin/masked_linear_bench" in result.stdout  # the jobs were started, then failed
    assert not (tree / "bench" / "bin" / "masked_linear_bench").exists()

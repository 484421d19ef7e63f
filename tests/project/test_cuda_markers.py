"""Every test that needs a GPU carries the `cuda` marker, so that bench/gpu_check.sh's
`pytest -m cuda` runs all of them on the lent GPU (a test guarded only by a skip would be
deselected there and never run anywhere); and the GPU tests collect where a GPU exists.

"Needs a GPU" is read from the tests themselves, as pytest collects them here (without
a GPU): a skipif mark whose reason names a GPU or CUDA, or a module/class mark that
does. Parametrised device='cuda' variants exist only where a GPU is visible; the
conftest marks those.

A GPU machine collects differently (subnet_ext.testing.DEVICES gains "cuda", skip
conditions flip), and CI has no GPU: so the suite is also collected here with
`torch.cuda.is_available()` forced true and one device, and every bench script imported
the same way. A collection error there (a test module or bench script that asks the
dispatcher or the device something it cannot answer at import) fails here first.
"""
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_marks import SUMMARY_LINES

ROOT = Path(__file__).resolve().parents[2]

# Makes this interpreter look like one with `GPUS` visible GPUs (nothing CUDA runs while
# collecting or importing, so the answers to these questions are all it needs).
FORCE_GPU = r"""
import torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: GPUS
torch.cuda.is_bf16_supported = lambda *a, **k: True
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
"""

# Collects the whole suite in a fresh interpreter and prints, per test, its skip reasons
# and whether it is marked cuda (after the conftest's own marking); with FORCE_GPU in
# front, also each skipif's condition and whether collection had errors.
COLLECT = r"""
import json, sys, pytest

class Report:
    rows = []

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        for item in items:
            marks = list(item.iter_markers("skipif"))
            reasons = [m.kwargs.get("reason", "") or " ".join(map(str, m.args)) for m in marks]
            # A condition given as a bool was evaluated when the module was imported.
            skips = [m.args[0] if m.args and isinstance(m.args[0], bool) else None for m in marks]
            Report.rows.append((item.nodeid, reasons, item.get_closest_marker("cuda") is not None, skips))

code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"], plugins=[Report()])
print("ROWS " + json.dumps(Report.rows))
sys.exit(int(code))
"""
GPU = re.compile(r"\bGPUs?\b|\bCUDA\b|cuda", re.IGNORECASE)


def collected(gpus: int | None = None):
    """[(nodeid, skipif reasons, marked cuda, skipif conditions)] of the whole suite;
    gpus: collect as a machine with that many GPUs would (None: as this machine does)."""
    script = (FORCE_GPU.replace("GPUS", str(gpus)) if gpus else "") + COLLECT
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS ")), None)
    # Exit 0: collected without an error (a collection error exits 2 and names the module).
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[5:])


@pytest.fixture(scope="module")
def here():
    return collected()


def test_every_gpu_guarded_test_is_marked_cuda(here):
    rows = here
    guarded = [(nodeid, cuda) for nodeid, reasons, cuda, _ in rows if any(GPU.search(r) for r in reasons)]
    unmarked = [nodeid for nodeid, cuda in guarded if not cuda]
    assert not unmarked, f"{len(unmarked)} GPU-guarded test(s) lack @pytest.mark.cuda (tests/gpu_marks.py): {unmarked}"
    # The GPU tests are there to be found (the engine's, the kernels', the sync-free step's).
    files = {nodeid.split("::")[0] for nodeid, _ in guarded}
    assert {"tests/engine/test_engine_cuda.py", "tests/ops/test_masked_linear.py",
            "tests/ops/test_pack_segments.py"} <= files


def test_gpu_tests_collect_where_a_gpu_is_visible(here):
    """On a one-GPU machine: no collection error, every test marked cuda here is there,
    every device='cpu' variant has its device='cuda' twin, and no cuda-marked test is
    skipped by a condition other than wanting a second GPU."""
    forced = collected(gpus=1)
    cuda_there = {nodeid for nodeid, _, cuda, _ in forced if cuda}
    marked_here = {nodeid for nodeid, _, cuda, _ in here if cuda}
    assert marked_here <= cuda_there, f"marked cuda here but not collected there: {sorted(marked_here - cuda_there)}"
    # The twins are counted from this machine's collection, independently of the conftest.
    cpu_variants = [nodeid for nodeid, *_ in here if re.search(r"[\[-]cpu[\]-]", nodeid)]
    twins = {re.sub(r"([\[-])cpu([\]-])", r"\1cuda\2", nodeid) for nodeid in cpu_variants}
    assert twins <= cuda_there, f"device='cpu' variants without a cuda twin there: {sorted(twins - cuda_there)[:10]}"
    expected = len(marked_here | twins)
    assert len(cuda_there) >= expected > 100, (len(cuda_there), expected)
    skipped = {nodeid: [r for r, s in zip(reasons, skips) if s] for nodeid, reasons, cuda, skips in forced
               if cuda and any(skips)}
    always = {nodeid: why for nodeid, why in skipped.items() if not all("two GPUs" in r for r in why)}
    assert not always, f"cuda-marked tests that skip even on a GPU: {always}"
    unknown = [nodeid for nodeid, _, cuda, skips in forced if cuda and None in skips]
    assert not unknown, f"skipif conditions that are not booleans (cannot be checked here): {unknown}"
    SUMMARY_LINES.append(f"[gpu collection] with CUDA forced visible (one GPU): {len(cuda_there)} cuda-marked tests "
                         f"collected, {len(cuda_there) - len(skipped)} would run, {len(skipped)} need two GPUs")


def test_bench_scripts_import_where_a_gpu_is_visible():
    """Every bench/*.py imports on a machine with a GPU (as gpu_check.sh and make bench run them)."""
    scripts = sorted(p.stem for p in (ROOT / "bench").glob("*.py"))
    code = FORCE_GPU.replace("GPUS", "1") + (
        "import importlib, sys\nsys.path.insert(0, 'bench')\n"
        f"for name in {scripts!r}:\n    importlib.import_module(name)\nprint('IMPORTED', len({scripts!r}))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and f"IMPORTED {len(scripts)}" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(scripts) >= 10, scripts


def body_skips(source: str) -> list[str]:
    """Names of the test functions in `source` that call pytest.skip in their body, outside an
    `except ImportError` handler (a missing optional package, decided by the environment)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
            continue
        handlers = [h for h in ast.walk(node) if isinstance(h, ast.ExceptHandler) and h.type is not None
                    and "ImportError" in ast.unparse(h.type)]
        allowed = {id(n) for h in handlers for n in ast.walk(h)}
        if any(isinstance(c, ast.Call) and ast.unparse(c.func) == "pytest.skip" and id(c) not in allowed
               for c in ast.walk(node)):
            out.append(node.name)
    return out


def test_no_test_skips_itself_in_its_body():
    """A skip decided in a test's body (for some parameters, say) is seen by neither the checks
    above nor `pytest -m cuda`'s selection: on the GPU it reads as a skipped test that never runs
    anywhere (12 such cases ran skipped on the H200 at a6dbb0c). Impossible combinations are
    not generated instead; conditions go in skipif marks."""
    offenders = [f"{path.relative_to(ROOT)}::{name}" for path in sorted((ROOT / "tests").rglob("test_*.py"))
                 for name in body_skips(path.read_text())]
    assert not offenders, f"tests that skip themselves in their body: {offenders}"
    # The check finds the pattern it forbids (the old test_backward_matches_reference's).
    old = ("import pytest\n@pytest.mark.parametrize('compact', [False, True])\n"
           "def test_x(compact, dense=True):\n    if compact and dense:\n        pytest.skip('needs the full weight')\n"
           "def test_y():\n    try:\n        import fsdp\n    except ImportError:\n        pytest.skip('no fsdp')\n")
    assert body_skips(old) == ["test_x"]

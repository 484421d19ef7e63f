"""Every test that needs a GPU carries the `cuda` marker, so that bench/gpu_check.sh's
`pytest -m cuda` runs all of them on the lent GPU (a test guarded only by a skip would be
deselected there and never run anywhere).

"Needs a GPU" is read from the tests themselves, as pytest collects them here (without
a GPU): a skipif mark whose reason names a GPU or CUDA, or a module/class mark that
does. Parametrised device='cuda' variants exist only where a GPU is visible; the
conftest marks those.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Collects the whole suite in a fresh interpreter and prints, per test, its skip reasons
# and whether it is marked cuda (after the conftest's own marking).
COLLECT = r"""
import json, sys, pytest

class Report:
    rows = []

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        for item in items:
            reasons = [m.kwargs.get("reason", "") or " ".join(map(str, m.args)) for m in item.iter_markers("skipif")]
            Report.rows.append((item.nodeid, reasons, item.get_closest_marker("cuda") is not None))

code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"], plugins=[Report()])
print("ROWS " + json.dumps(Report.rows))
sys.exit(int(code))
"""
GPU = re.compile(r"\bGPUs?\b|\bCUDA\b|cuda", re.IGNORECASE)


def collected():
    proc = subprocess.run([sys.executable, "-c", COLLECT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[5:])


def test_every_gpu_guarded_test_is_marked_cuda():
    rows = collected()
    guarded = [(nodeid, cuda) for nodeid, reasons, cuda in rows if any(GPU.search(r) for r in reasons)]
    unmarked = [nodeid for nodeid, cuda in guarded if not cuda]
    assert not unmarked, f"{len(unmarked)} GPU-guarded test(s) lack @pytest.mark.cuda (tests/gpu_marks.py): {unmarked}"
    # The GPU tests are there to be found (the engine's, the kernels', the sync-free step's).
    files = {nodeid.split("::")[0] for nodeid, _ in guarded}
    assert {"tests/engine/test_engine_cuda.py", "tests/ops/test_masked_linear.py",
            "tests/ops/test_pack_segments.py"} <= files

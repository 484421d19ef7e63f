"""The `cuda` marker (pyproject.toml) on every GPU test, so `pytest -m cuda` selects them all.

Whole GPU files and GPU-only tests carry @pytest.mark.cuda themselves (tests/gpu_marks.py;
tests/project/test_cuda_markers.py fails when one is missing); the variants of a test
parametrised over subnet_ext.testing.DEVICES get it here, from their `device` parameter
(they exist only where a GPU is visible and the CUDA kernels were built).

With `-m cuda`, the run ends with one line counting the selected tests by outcome, which
bench/gpu_check.sh shows in its summary ("[summary] ..." lines are its notes).

The helpers beside this file (sdp_helpers.py, ...) import by their bare names from every
test folder: pytest's default import mode (prepend) puts this conftest's folder, tests/,
on sys.path, and each test file's own folder before it; no folder has an __init__.py, so
test file names must be unique across folders (tests/README.md).
"""
import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("device") == "cuda":
            item.add_marker(pytest.mark.cuda)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from gpu_marks import SUMMARY_LINES

    for line in SUMMARY_LINES:
        terminalreporter.write_line(line)
    if config.getoption("markexpr", "") != "cuda":
        return
    stats = terminalreporter.stats
    counts = {k: len([r for r in stats.get(k, []) if getattr(r, "when", "call") in ("call", "setup")])
              for k in ("passed", "failed", "skipped", "error")}
    # Counted from the outcomes, which pytest-xdist's controller also has (not its collection).
    selected = counts["passed"] + counts["failed"] + counts["skipped"] + counts["error"]
    terminalreporter.write_line(
        f"[summary] cuda-marked tests: {selected} selected, {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['skipped']} skipped, {counts['error']} errors")

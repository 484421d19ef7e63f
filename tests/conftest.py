"""The `cuda` marker (pyproject.toml) on every GPU test, so `pytest -m cuda` selects them all.

Whole GPU files and GPU-only tests carry @pytest.mark.cuda themselves; the variants of a
test parametrised over subnet_ext.testing.DEVICES get it here, from their `device`
parameter (they exist only where a GPU is visible and the CUDA kernels were built).
"""
import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("device") == "cuda":
            item.add_marker(pytest.mark.cuda)

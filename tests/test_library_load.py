"""Loading the compiled library: a build made for another torch release says so.

A library compiled against one torch does not load into another (undefined C++ symbols);
the import error must name both versions and the rebuild, not only the missing symbol.
The failing load is simulated here (the real one needs two torch installs: seen with a
2.14.1 build under torch 2.11.0, recorded in the README's "Supported torch versions").
"""
import importlib

import pytest
import torch

from subnet_ext import _build_info
from subnet_ext.ops import build_info as loader

SYMBOL_ERROR = "_C.so: undefined symbol: _ZN3c104cuda19CUDAErrorLogCaptureC1Ev"


@pytest.fixture
def failing_load(monkeypatch):
    """import_module('subnet_ext._C') raises what a library built for another torch raises."""
    real = importlib.import_module

    def import_module(name, *args):
        if name == "subnet_ext._C":
            raise ImportError(SYMBOL_ERROR)
        return real(name, *args)

    monkeypatch.setattr(loader.importlib, "import_module", import_module)
    return monkeypatch


def test_library_built_for_another_torch_names_both_versions(failing_load):
    failing_load.setattr(_build_info, "TORCH_VERSION", "2.99.0+other")
    with pytest.raises(ImportError) as raised:
        loader.load_library()
    message = str(raised.value)
    assert f"built against torch 2.99.0+other but torch {torch.__version__} is running" in message
    assert SYMBOL_ERROR in message and "pip install --no-build-isolation ." in message


def test_other_load_failures_are_raised_unchanged(failing_load):
    failing_load.setattr(_build_info, "TORCH_VERSION", torch.__version__)
    with pytest.raises(ImportError) as raised:
        loader.load_library()
    assert str(raised.value) == SYMBOL_ERROR


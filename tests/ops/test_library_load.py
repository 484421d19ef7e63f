"""Loading the compiled library: a build made for another torch release says so, and the
pure-PyTorch reference never needs it.

A library compiled against one torch does not load into another (undefined C++ symbols);
the import error must name both versions and the rebuild, not only the missing symbol.
The failing load is simulated here (the real one needs two torch installs: seen with a
2.14.1 build under torch 2.11.0, recorded in the README's "Supported torch versions").

The reference tests run in a fresh interpreter (this one has loaded the library long ago),
where a finder makes `subnet_ext._C` unimportable: the reference must import and compute,
and the library must count as not loaded (not in sys.modules, no op registered).
"""
import importlib
import subprocess
import sys
import textwrap

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



# A fresh interpreter in which `import subnet_ext._C` fails; `subnet_ext._C` imports are counted.
_NO_LIBRARY = """
import importlib.abc, sys
attempts = []
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "subnet_ext._C":
            attempts.append(name)
            raise ImportError("subnet_ext._C refused by the test")
        return None
sys.meta_path.insert(0, Refuse())
"""


def _run_fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NO_LIBRARY + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300)


def test_reference_imports_and_runs_without_the_compiled_library():
    result = _run_fresh("""
        import torch
        import subnet_ext.ops.reference as ref
        x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
        rows, cols = torch.tensor([4, 0]), torch.tensor([1, 3])
        y = ref.masked_linear(x, w, None, rows, cols)
        assert torch.allclose(y, x[:, cols] @ w[rows][:, cols].T), y
        assert attempts == [], attempts
        assert "subnet_ext._C" not in sys.modules
        assert not hasattr(torch.ops.subnet_ext, "masked_linear"), "an op of the library is registered"
        import subnet_ext  # the package too, and its non-op names, until an op is used
        assert subnet_ext.plan_subnetworks and subnet_ext.SubnetDataParallel and attempts == []
        print("reference ok")
    """)
    assert result.returncode == 0 and "reference ok" in result.stdout, result.stderr


def test_first_use_of_an_op_loads_the_library_with_its_registrations():
    result = _run_fresh("""
        sys.meta_path.pop(0)  # the library may load here
        import torch
        import subnet_ext as sx
        assert "subnet_ext._C" not in sys.modules
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(5, 4, requires_grad=True)
        sx.masked_linear(x, w, None, torch.tensor([4, 0]), torch.tensor([1, 3])).sum().backward()  # autograd
        assert "subnet_ext._C" in sys.modules and w.grad[[4, 0]][:, [1, 3]].abs().sum() > 0
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode():  # the fake kernels
            y = torch.ops.subnet_ext.masked_linear(torch.empty(3, 4), torch.empty(5, 4), None, None, None, False, -1)
            assert y.shape == (3, 5)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the autocast kernels
            assert sx.ops.masked_linear(x.detach(), w.detach()).dtype == torch.bfloat16
        print("loaded ok")
    """)
    assert result.returncode == 0 and "loaded ok" in result.stdout, result.stderr

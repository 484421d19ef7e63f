"""Marks for tests that need a GPU: each carries the `cuda` marker, so that
`pytest -m cuda` (bench/gpu_check.sh) selects it, and is skipped where it cannot run.
tests/project/test_cuda_markers.py fails when a GPU-guarded test lacks the marker."""
import pytest
import torch

from subnet_ext.testing import DEVICES


def needs_cuda(test):
    """A GPU and this build's CUDA kernels."""
    skip = pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU and the CUDA kernels")
    return pytest.mark.cuda(skip(test))


def needs_two_gpus(test):
    """Two GPUs and this build's CUDA kernels."""
    skip = pytest.mark.skipif("cuda" not in DEVICES or torch.cuda.device_count() < 2, reason="needs two GPUs")
    return pytest.mark.cuda(skip(test))


# Lines a test wants shown at the end of the run whatever the capture mode (tests/conftest.py
# prints them in the terminal summary), e.g. how many GPU tests a GPU machine would run.
SUMMARY_LINES: list[str] = []

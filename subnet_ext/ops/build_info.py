"""What this installation of subnet_ext was built with."""
from __future__ import annotations

import importlib

import torch


def load_library() -> None:
    """Load the compiled library `subnet_ext._C`, which registers the ops' kernels.

    Raises:
        ImportError: when it cannot load and was built against another torch than the one
            running (a build loads only into the torch release it was compiled with): the
            message names both versions and the rebuild. Other failures are re-raised as is.
    """
    try:
        importlib.import_module("subnet_ext._C")
    except ImportError as error:
        try:
            from .. import _build_info as info
        except ImportError:
            raise error from None
        if info.TORCH_VERSION == torch.__version__:
            raise
        raise ImportError(
            f"subnet_ext's compiled library was built against torch {info.TORCH_VERSION} but torch "
            f"{torch.__version__} is running, and cannot load ({error}). Rebuild it in this environment: "
            "pip install --no-build-isolation . (or `make build` in a checkout)."
        ) from error


def build_info() -> dict:
    """Versions and kernels of this build.

    Returns:
        dict with torch_version (built against), runtime_torch_version, cuda_version
        (None without CUDA kernels), cuda_archs (list like ["8.0", "9.0"]), with_cuda (CUDA
        kernels compiled), cuda_kernels_registered (the CUDA dispatch key is live) and
        cuda_available (a GPU is visible now).
    """
    from .. import _build_info as info

    load_library()
    registered = torch._C._dispatch_has_kernel_for_dispatch_key("subnet_ext::masked_linear", "CUDA")
    return {
        "torch_version": info.TORCH_VERSION,
        "runtime_torch_version": torch.__version__,
        "cuda_version": info.CUDA_VERSION,
        "cuda_archs": list(info.CUDA_ARCHS),
        "cuda_home": info.CUDA_HOME,
        "with_cuda": bool(info.WITH_CUDA),
        "cuda_kernels_registered": bool(registered),
        "cuda_available": torch.cuda.is_available(),
    }

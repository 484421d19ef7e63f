"""What this installation of subnet_ext was built with."""
from __future__ import annotations

import torch


def build_info() -> dict:
    """Versions and kernels of this build.

    Returns:
        dict with torch_version (built against), runtime_torch_version, cuda_version
        (None without CUDA kernels), cuda_archs (list like ["8.0", "9.0"]), with_cuda (CUDA
        kernels compiled), cuda_kernels_registered (the CUDA dispatch key is live) and
        cuda_available (a GPU is visible now).
    """
    from .. import _build_info as info
    from .. import _C  # noqa: F401

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

"""Device and dtype lists every kernel test is parametrised over, and the tolerance rule.

CUDA variants appear only where a GPU is visible and the CUDA kernels were built.
"""
from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
HALF_DTYPES = (torch.float16, torch.bfloat16)


def cuda_ready() -> bool:
    """A GPU is visible and this build registered CUDA kernels."""
    return torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
        "subnet_ext::masked_linear", "CUDA"
    )


DEVICES = ["cpu"] + (["cuda"] if cuda_ready() else [])


def assert_close_to_reference(out: torch.Tensor, exact: torch.Tensor, torch_at_dtype: torch.Tensor, name: str = ""):
    """Flash-attention rule for half types, tight tolerance otherwise.

    Args:
        out: the kernel's result, any dtype.
        exact: the same quantity computed in float64 (the truth).
        torch_at_dtype: PyTorch's own composition at out's dtype; its error against
            `exact` is the yardstick: the kernel may be at most twice as wrong (plus a
            floor for results that are exactly representable).
    """
    exact = exact.double()
    err = (out.double() - exact).abs().max().item() if out.numel() else 0.0
    if out.dtype in HALF_DTYPES:
        base = (torch_at_dtype.double() - exact).abs().max().item() if out.numel() else 0.0
        scale = exact.abs().max().item() if out.numel() else 0.0
        bound = 2 * base + 1e-3 * scale + 1e-5
    else:
        eps = torch.finfo(out.dtype).eps
        scale = exact.abs().max().item() if out.numel() else 0.0
        bound = 64 * eps * max(scale, 1.0)
    assert err <= bound, f"{name}: max error {err:.3e} exceeds bound {bound:.3e} ({out.dtype})"

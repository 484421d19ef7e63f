"""The masked-linear op under torch.autocast behaves as nn.Linear does (docs/design.md §5.2):
output in the autocast dtype, values within the flash-attention rule of the exact result
on the autocast-cast operands, gradients of fp32 leaves in fp32."""
import pytest
import torch
import torch.nn.functional as F

import subnet_ext as sx
from subnet_ext import reference
from subnet_ext.testing import DEVICES, assert_close_to_reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compact", [False, True])
def test_masked_linear_under_autocast(device, dtype, compact):
    g = torch.Generator().manual_seed(0)
    rows, cols = torch.tensor([0, 2, 5, 6], device=device), torch.tensor([1, 3, 4, 8, 9], device=device)
    x = torch.randn(3, 7, 10, generator=g).to(device).requires_grad_()
    full = torch.randn(8, 10, generator=g).to(device)
    weight = (full[rows][:, cols] if compact else full).clone().requires_grad_()
    bias = torch.randn(weight.shape[0], generator=g).to(device).requires_grad_()
    with torch.autocast(device, dtype=dtype):
        out = sx.masked_linear(x, weight, bias, rows, cols, compact_weight=compact)
        # torch's own composition under the same autocast: the yardstick of the rule.
        b = bias if compact else bias[rows]
        w = weight if compact else weight[rows][:, cols]
        torch_out = F.linear(x[..., cols], w, b)
    assert out.dtype == dtype and torch_out.dtype == dtype
    cast = [t.detach().to(dtype).double() for t in (x, weight, bias)]
    exact = reference.masked_linear(*cast, rows, cols, compact_weight=compact)
    assert_close_to_reference(out, exact, torch_out, f"masked_linear autocast {dtype}")
    assert torch.equal(out, reference.masked_linear(*(t.to(dtype) for t in cast), rows, cols,
                                                    compact_weight=compact))
    out.float().square().sum().backward()
    assert x.grad.dtype == weight.grad.dtype == bias.grad.dtype == torch.float32
    # The gradient flows through the cast: the same as the fp32 op's on the rounded operands.
    xr, wr, br = (t.detach().to(dtype).float().requires_grad_() for t in (x, weight, bias))
    ref_out = sx.masked_linear(xr, wr, br, rows, cols, compact_weight=compact)
    ref_out.to(dtype).float().square().sum().backward()
    for got, ref in ((x.grad, xr.grad), (weight.grad, wr.grad), (bias.grad, br.grad)):
        assert (got - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def test_no_autocast_outside_the_context_or_for_fp64():
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    assert sx.masked_linear(x, w).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert sx.masked_linear(x.double(), w.double()).dtype == torch.float64

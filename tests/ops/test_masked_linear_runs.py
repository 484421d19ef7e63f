"""masked_linear_grad_runs_: the owned weight/bias gradient for index sets that are contiguous
runs (the engine's), computed on strided views with no gather, against the pure-PyTorch
reference (`subnet_ext.reference.masked_linear_grad_runs_`, itself built from index
tensors and plain matmuls in float64/float32).
"""
import pytest
import torch

import subnet_ext as sx
import subnet_ext.ops.linear  # noqa: F401  (loads the library: some tests call torch.ops.subnet_ext directly)
from gpu_marks import needs_cuda
from subnet_ext import reference as ref
from subnet_ext.testing import DEVICES, DTYPES

N, OUT, IN = 37, 24, 20

# (out_runs, in_runs): one run, several (out of order, as a rank's wrapped-around runs
# are), every column (no runs), a single column.
RUNS = [
    ([(4, 8)], []),
    ([(16, 8), (0, 4)], [(3, 5), (12, 8)]),
    ([], [(0, 20)]),
    ([(23, 1)], [(7, 1)]),
]


def operands(device, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(N, OUT, generator=gen).to(device, dtype)
    x = torch.randn(N, IN, generator=gen).to(device, dtype)
    return g, x


def kept(runs, width):
    return sum(length for _, length in runs) if runs else width


def tolerance(dtype, out_dtype):
    if out_dtype == torch.float64:
        return 1e-12
    if dtype in (torch.float16, torch.bfloat16) and out_dtype != torch.float32:
        return 2e-2  # one half-precision rounding of each output
    return 1e-4


# (operands' dtype, outputs' dtype): the same, or float32 outputs for half-precision operands.
DTYPE_PAIRS = [(d, d) for d in DTYPES] + [(torch.float16, torch.float32), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, out_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("runs", RUNS)
@pytest.mark.parametrize("accumulate", [False, True])
def test_grad_runs_matches_reference(device, dtype, out_dtype, runs, accumulate):
    out_runs, in_runs = runs
    g, x = operands(device, dtype)
    shape = (kept(out_runs, OUT), kept(in_runs, IN))
    start_w = torch.randn(shape).to(device, out_dtype)
    start_b = torch.randn(shape[0]).to(device, out_dtype)
    w, b = start_w.clone(), start_b.clone()
    sx.masked_linear_grad_runs_(w, b, g, x, out_runs, in_runs, accumulate=accumulate)
    want_w, want_b = start_w.double(), start_b.double()
    ref.masked_linear_grad_runs_(want_w, want_b, g.double(), x.double(), out_runs, in_runs, accumulate=accumulate)
    tol = tolerance(dtype, out_dtype)
    for name, got, want in (("weight", w, want_w), ("bias", b, want_b)):
        assert got.dtype == out_dtype
        err = (got.double() - want).abs().max().item()
        assert err <= tol * max(want.abs().max().item(), 1.0), f"{name}: max error {err:.3e}"


@pytest.mark.parametrize("device", DEVICES)
def test_grad_runs_into_a_bucket_view_leaves_the_rest(device):
    """weight_out may be a view of a flat buffer (the engine's bucket); bias_out may be absent."""
    g, x = operands(device, torch.float32)
    flat = torch.full((3 + 8 * IN + 2,), 7.0, device=device)
    view = flat[3:3 + 8 * IN].view(8, IN)
    sx.masked_linear_grad_runs_(view, None, g, x, [(4, 8)])
    torch.testing.assert_close(view, g[:, 4:12].t() @ x)
    assert (flat[:3] == 7).all() and (flat[-2:] == 7).all()
    bias = torch.zeros(8, device=device)
    sx.masked_linear_grad_runs_(None, bias, g, x, [(4, 8)])
    torch.testing.assert_close(bias, g[:, 4:12].sum(0))


@pytest.mark.parametrize("flat_runs, message", [
    ([4], r"out_runs must list \[start, length\] pairs, got 1 values"),
    ([4, 0], r"out_runs run 0 = \[4, 4\) must be non-empty and lie in \[0, 24\)"),
    ([20, 8], r"out_runs run 0 = \[20, 28\) must be non-empty and lie in \[0, 24\)"),
    ([-1, 2], r"out_runs run 0 = \[-1, 1\) must be non-empty"),
    ([0, 8, 4, 8], r"out_runs runs \[0, 8\) and \[4, 12\) overlap"),
])
def test_bad_runs_are_refused_by_name(flat_runs, message):
    g, x = operands("cpu", torch.float32)
    with pytest.raises(ValueError, match="subnet_ext.masked_linear_grad_runs_: " + message):
        torch.ops.subnet_ext.masked_linear_grad_runs_(torch.zeros(16, IN), None, g, x, flat_runs, [], False)


def test_bad_shapes_and_dtypes_are_refused():
    g, x = operands("cpu", torch.float32)
    with pytest.raises(ValueError, match=r"weight_out must have shape \[8, 20\], got \[8, 19\]"):
        sx.masked_linear_grad_runs_(torch.zeros(8, 19), None, g, x, [(0, 8)])
    with pytest.raises(ValueError, match=r"bias_out must have shape \[8\], got \[7\]"):
        sx.masked_linear_grad_runs_(None, torch.zeros(7), g, x, [(0, 8)])
    with pytest.raises(ValueError, match="weight_out is Double but the operands are Float"):
        sx.masked_linear_grad_runs_(torch.zeros(8, IN, dtype=torch.float64), None, g, x, [(0, 8)])
    with pytest.raises(ValueError, match="grad_out has 37 rows but x has 36"):
        sx.masked_linear_grad_runs_(torch.zeros(8, IN), None, g, x[:-1], [(0, 8)])


def test_grad_runs_opcheck():
    g, x = operands("cpu", torch.float32)
    torch.library.opcheck(torch.ops.subnet_ext.masked_linear_grad_runs_.default,
                          (torch.zeros(12, 5), torch.zeros(12), g, x, [16, 8, 0, 4], [3, 5], False))


@needs_cuda
def test_cuda_grad_runs_launches_no_gather_and_never_synchronises():
    """The run path is GEMMs (and the bias sums) on strided views: no gather or scatter kernel
    of subnet_ext runs, and nothing waits for the device."""
    g, x = operands("cuda", torch.bfloat16)
    w, b = torch.empty(12, 13, device="cuda"), torch.empty(12, device="cuda")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")
        try:
            sx.masked_linear_grad_runs_(w, b, g, x, [(16, 8), (0, 4)], [(3, 5), (12, 8)])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels, "the profiler saw no kernel"
    assert not [k for k in kernels if "gather" in k or "scatter" in k or "inverse_map" in k], kernels
    want_w, want_b = torch.zeros(12, 13, dtype=torch.float64), torch.zeros(12, dtype=torch.float64)
    ref.masked_linear_grad_runs_(want_w, want_b, g.double().cpu(), x.double().cpu(), [(16, 8), (0, 4)],
                                 [(3, 5), (12, 8)])
    torch.testing.assert_close(w.double().cpu(), want_w, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(b.double().cpu(), want_b, rtol=1e-2, atol=1e-2)

"""Owned weight gradients of half-precision operands into fp32 storage, at half-GEMM speed.

`masked_linear_grad_weight_(out fp32, grad_out fp16/bf16, x fp16/bf16, ...)` gathers the
owned block in the half dtype and multiplies with fp32 output and accumulation (CUDA: a
tensor-core GEMM). Reference implementations, all in float64 from the same data:
- `truth`: the gradient of the fp32 operands the half ones were rounded from;
- `exact_half`: the gradient of the half operands themselves (what a GEMM accumulating in
  fp32 computes up to fp32 rounding; a result rounded to, or summed in, the half dtype is
  far from it).
Tolerances: the flash-attention rule against `truth` (at most twice the error of
PyTorch's own composition at that precision, a half GEMM with half output), and fp32
rounding against `exact_half`.

The engine (backward regime under autocast): the masked kernel is handed the half
operands and the fp32 bucket (no fp32 copy of the activations), and the owned gradients
obey the same rule against an fp32 run, with a plain model under autocast as PyTorch's
own error.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import subnet_ext as sx
from sdp_helpers import batch, make_model
from subnet_ext.testing import DEVICES, HALF_DTYPES

N, WIDTH, IN = 64, 24, 40


def _error(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("grad_out_full", [False, True])
def test_half_operands_into_fp32(device, dtype, accumulate, grad_out_full):
    gen = torch.Generator().manual_seed(5)
    out_idx = torch.randperm(WIDTH, generator=gen)[:9].to(device)
    in_idx = torch.randperm(IN, generator=gen)[:17].to(device)
    g32 = torch.randn(N, WIDTH if grad_out_full else 9, generator=gen).to(device)
    x32 = torch.randn(N, IN, generator=gen).to(device)
    g, x = g32.to(dtype), x32.to(dtype)
    start = torch.randn(9, 17, generator=gen).to(device) if accumulate else torch.full((9, 17), float("nan"),
                                                                                          device=device)
    out = start.clone()
    sx.masked_linear_grad_weight_(out, g, x, out_idx, in_idx, grad_out_full=grad_out_full, accumulate=accumulate)

    cols = out_idx if grad_out_full else torch.arange(9, device=device)
    base = start.double() if accumulate else 0.0
    truth = base + g32.double()[:, cols].t() @ x32.double()[:, in_idx]
    exact_half = base + g.double()[:, cols].t() @ x.double()[:, in_idx]
    torch_half = base + (g[:, cols].t() @ x[:, in_idx]).double()  # PyTorch's own at that precision
    assert out.dtype == torch.float32 and not out.isnan().any()  # every element written
    scale = truth.abs().max().item()
    assert _error(out, truth) <= 2 * _error(torch_half, truth) + 1e-3 * scale + 1e-5
    # fp32 accumulation: only fp32 rounding from the exact product of the half operands.
    assert _error(out, exact_half) <= 1e-5 * (scale + 1), _error(out, exact_half)


def test_mixed_dtypes_other_than_half_into_fp32_are_refused():
    g, x = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32 when they are float16/bfloat16"):
        sx.masked_linear_grad_weight_(torch.zeros(3, 5), g, x)


def _owned_grads(sdp):
    """{(name, dim, start, length): gradient} of the backward regime's owned runs."""
    return {(p.name, p.dim, p.start, p.length): param.grad for p, param in sdp.layout.piece_params.items()
            if param.grad is not None and param.dim() == 2}


@pytest.mark.parametrize("device", DEVICES)
def test_engine_writes_bf16_gradients_into_fp32_buckets(device, monkeypatch):
    model = make_model().to(device)
    reference = copy.deepcopy(model)
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, 2, 1.0, "neuron"), regime="backward",
                                simulate_rank=0)
    seen = []
    # The weight-gradient kernel on runs, as the engine's owned Linear layers call it.
    original = sx.ops.masked_linear_grad_runs_

    def spy(weight_out, bias_out, grad_out, x, *args, **kwargs):
        if weight_out is not None:
            seen.append((weight_out.dtype, grad_out.dtype, x.dtype))
        return original(weight_out, bias_out, grad_out, x, *args, **kwargs)

    monkeypatch.setattr(sx.ops, "masked_linear_grad_runs_", spy)
    x, y = (t.to(device) for t in batch(0, 0, n=64))
    with torch.autocast(device, dtype=torch.bfloat16):
        F.cross_entropy(sdp(x), y).backward()
    assert seen and all(s == (torch.float32, torch.bfloat16, torch.bfloat16) for s in seen), seen

    fp32 = {n: p.grad for n, p in _plain_grads(reference, x, y, None).items()}
    plain_bf16 = _plain_grads(reference, x, y, torch.bfloat16)
    for (name, dim, start, length), grad in _owned_grads(sdp).items():
        truth = fp32[name].narrow(dim, start, length)
        torch_own = plain_bf16[name].grad.narrow(dim, start, length)
        scale = truth.abs().max().item()
        assert grad.dtype == torch.float32
        assert _error(grad, truth) <= 2 * _error(torch_own, truth) + 1e-3 * scale + 1e-5, name


def _plain_grads(model, x, y, dtype):
    model = copy.deepcopy(model)
    with torch.autocast(x.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        F.cross_entropy(model(x), y).backward()
    return dict(model.named_parameters())

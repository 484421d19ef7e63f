"""The run path of width-kept projections (engine/layers/width_kept_runs.py) against the masked
linear's pure-PyTorch reference (subnet_ext.reference): a producer writing its owned runs'
outputs into their column slices of the full width, a consumer reading its owned runs' input
columns, forward and every gradient, with and without bias, in fp32, fp64 and under bf16
autocast; which index sets take it (runs of heads) and which do not (scattered indices); and
that it gathers nothing: no index, gather or masked-linear op runs in its forward or backward.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from subnet_ext import reference as ref
from subnet_ext.engine.layers.width_kept_runs import WidthKeptRuns, index_runs, runs_worth_it
from subnet_ext.engine.layers.width_keeping import WidthKeptLinear

WIDTH, IN, HEAD = 48, 20, 8
# Heads 0, 2, 3 of 6 (head_dim 8): runs (0, 8) and (16, 16), in the compact weight's order.
OWNED = torch.cat([torch.arange(0, 8), torch.arange(16, 32)])


def test_index_runs_and_when_they_are_worth_it():
    assert index_runs(OWNED) == [(0, 8), (16, 16)] and runs_worth_it(index_runs(OWNED))
    assert index_runs(torch.tensor([5, 6, 9, 3, 4])) == [(5, 2), (9, 1), (3, 2)]
    scattered = torch.randperm(WIDTH, generator=torch.Generator().manual_seed(0))[:20]
    assert not runs_worth_it(index_runs(scattered))
    assert not runs_worth_it([])


def _operands(dtype, producer, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kept = len(OWNED)
    x = torch.randn(3, 5, IN if producer else WIDTH, generator=gen, dtype=dtype)
    w = torch.randn(kept, IN, generator=gen, dtype=dtype) if producer else torch.randn(IN, kept, generator=gen,
                                                                                        dtype=dtype)
    b = (torch.randn(kept if producer else IN, generator=gen, dtype=dtype) if bias else None)
    return [t.requires_grad_() if t is not None else None for t in (x, w, b)]


def _reference(x, w, b, producer):
    """The masked linear's reference on the compact weight (float64)."""
    if producer:
        return ref.masked_linear(x, w, b, OWNED, None, compact_weight=True, scatter_width=WIDTH)
    return ref.masked_linear(x, w, b, None, OWNED, compact_weight=True)


@pytest.mark.parametrize("producer", [True, False], ids=["producer", "consumer"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_run_path_matches_the_reference(producer, bias, dtype):
    x, w, b = _operands(dtype, producer, bias)
    y = WidthKeptRuns.apply(x, w, b, tuple(index_runs(OWNED)), WIDTH if producer else None)
    exact = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b)]
    want = _reference(*exact, producer)
    assert y.shape == want.shape and y.dtype == dtype
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    y.backward(g)
    want.backward(g.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y.double(), want.detach(), **tol)
    for got, ex in zip((x, w, b), exact):
        if got is not None:
            torch.testing.assert_close(got.grad.double(), ex.grad, **tol)
    if producer:  # the unowned heads' columns are exactly zero
        unowned = torch.ones(WIDTH, dtype=torch.bool)
        unowned[OWNED] = False
        assert (y[..., unowned] == 0).all()


@pytest.mark.parametrize("producer", [True, False], ids=["producer", "consumer"])
def test_run_path_under_bf16_autocast_matches_the_masked_op(producer):
    """Under autocast both paths run in bf16 (output bf16, gradients back in fp32); the masked op
    (the index kernels) is the yardstick, the fp64 reference the truth."""
    import subnet_ext as sx

    x, w, b = _operands(torch.float32, producer, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = WidthKeptRuns.apply(x, w, b, tuple(index_runs(OWNED)), WIDTH if producer else None)
        kw = dict(compact_weight=True, scatter_width=WIDTH) if producer else dict(compact_weight=True)
        masked = sx.masked_linear(x, w, b, OWNED if producer else None, None if producer else OWNED, **kw)
    assert y.dtype == masked.dtype == torch.bfloat16
    exact = _reference(x.double(), w.double(), b.double(), producer)
    err, yardstick = (y.double() - exact).abs().max(), (masked.double() - exact).abs().max()
    assert err <= 2 * yardstick + 1e-3 * exact.abs().max(), (err, yardstick)
    y.float().sum().backward()
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == torch.float32


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("producer", [True, False], ids=["producer", "consumer"])
def test_width_kept_linear_takes_the_run_path_and_gathers_nothing(producer):
    """A WidthKeptLinear owning whole heads holds their runs and runs GEMMs on views only; one
    owning scattered indices keeps the masked op. Both equal the reference."""
    torch.manual_seed(0)
    full = torch.nn.Linear(IN, WIDTH) if producer else torch.nn.Linear(WIDTH, IN)
    for index, runs in ((OWNED, ((0, 8), (16, 16))), (torch.tensor([1, 5, 9, 13, 17, 21, 40]), None)):
        layer = torch.nn.Linear(full.in_features, full.out_features)
        with torch.no_grad():
            layer.weight = torch.nn.Parameter(full.weight[index] if producer else full.weight[:, index])
            layer.bias = torch.nn.Parameter(full.bias[index] if producer else full.bias.clone())
        kept = WidthKeptLinear(layer, index if producer else None, None if producer else index,
                               WIDTH if producer else None)
        assert kept.runs == runs
        x = torch.randn(4, 6, IN if producer else WIDTH, requires_grad=True)
        ops = _Ops()
        with ops:
            y = kept(x)
            y.sum().backward()
        want = ref.masked_linear(x.detach(), full.weight.detach(), full.bias.detach(),
                                 index if producer else None, None if producer else index,
                                 scatter_width=WIDTH if producer else None)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        # masked_linear_grad_runs_ is the run op (GEMMs on strided views); the others index.
        indexing = [n for n in ops.names if any(k in n for k in ("index", "gather", "scatter", "masked_linear"))
                    and "grad_runs" not in n]
        if runs is not None:
            assert not indexing, indexing
            assert "aten.mm" in ops.names or "aten.addmm" in ops.names
            assert "subnet_ext.masked_linear_grad_runs_" in ops.names
        else:
            assert any("masked_linear" in n for n in indexing), ops.names

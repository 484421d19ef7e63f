"""masked_linear forward/backward kernels against subnet_ext.reference.

Reference implementations: `subnet_ext.reference.masked_linear` and
`masked_linear_backward` (pure PyTorch, fp32/fp64 math). PyTorch's own composition at
the test dtype is the yardstick for half types (see testing.assert_close_to_reference).
"""
import pytest
import torch

import subnet_ext as sx
from gpu_marks import needs_cuda, needs_two_gpus
from subnet_ext import reference as ref
from subnet_ext.testing import DEVICES, DTYPES, assert_close_to_reference, kernel_path_count, max_grid_blocks

OUT, IN = 24, 20


def kept(n, fraction, gen, device):
    """Distinct, deliberately unsorted indices: from a single one to all n."""
    k = max(1, round(fraction * n))
    return torch.randperm(n, generator=gen)[:k].to(device)


def operands(device, dtype, fraction, compact, batch=(7,), seed=0):
    gen = torch.Generator().manual_seed(seed)
    out_idx, in_idx = kept(OUT, fraction, gen, device), kept(IN, fraction, gen, device)
    x = torch.randn(*batch, IN, generator=gen).to(device, dtype)
    if compact:
        w = torch.randn(len(out_idx), len(in_idx), generator=gen).to(device, dtype)
        b = torch.randn(len(out_idx), generator=gen).to(device, dtype)
    else:
        w = torch.randn(OUT, IN, generator=gen).to(device, dtype)
        b = torch.randn(OUT, generator=gen).to(device, dtype)
    return x, w, b, out_idx, in_idx


FRACTIONS = [1 / OUT, 0.5, 1.0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("scatter", [False, True])
def test_forward_matches_reference(device, dtype, fraction, compact, scatter):
    x, w, b, oi, ii = operands(device, dtype, fraction, compact, batch=(3, 5))
    kw = dict(compact_weight=compact, scatter_width=OUT if scatter else None)
    y = sx.masked_linear(x, w, b, oi, ii, **kw)
    exact = ref.masked_linear(x.double(), w.double(), b.double(), oi, ii, **kw)
    lowp = _torch_linear(x, w, b, oi, ii, compact, OUT if scatter else None)
    assert y.shape == exact.shape and y.dtype == dtype
    assert_close_to_reference(y, exact, lowp, "forward")


def _torch_linear(x, w, b, oi, ii, compact, scatter_width):
    """PyTorch's composition in the operands' dtype."""
    wb = w if compact else w[oi][:, ii]
    bb = b if compact else b[oi]
    y = torch.nn.functional.linear(x[..., ii], wb, bb)
    if scatter_width is None:
        return y
    full = y.new_zeros((*y.shape[:-1], scatter_width))
    full[..., oi] = y
    return full


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fraction", FRACTIONS)
# (compact weight, dense grad_input): dense_grad_input needs the full weight, so not both.
@pytest.mark.parametrize("compact, dense", [(False, False), (True, False), (False, True)])
def test_backward_matches_reference(device, dtype, fraction, compact, dense):
    x, w, b, oi, ii = operands(device, dtype, fraction, compact, batch=(6,))
    full_g = dense  # the backward regime hands the full-width gradient
    g = torch.randn(6, OUT if full_g else len(oi)).to(device, dtype)
    kw = dict(compact_weight=compact, grad_out_full=full_g, dense_grad_input=dense)
    got = sx.masked_linear_backward(g, x, w, oi, ii, **kw)
    exact = ref.masked_linear_backward(g.double(), x.double(), w.double(), oi, ii, **kw)
    lowp = _torch_backward(g, x, w, oi, ii, compact, full_g, dense)
    for name, a, e, l in zip(("grad_x", "grad_weight", "grad_bias"), got, exact, lowp):
        assert a.shape == e.shape, name
        assert_close_to_reference(a, e, l, name)


def _torch_backward(g, x, w, oi, ii, compact, full_g, dense):
    gk = g[:, oi] if full_g else g
    wb = w if compact else w[oi][:, ii]
    if dense:
        gx = g @ w
    else:
        gx = x.new_zeros(x.shape)
        gx[:, ii] = gk @ wb
    return gx, gk.t() @ x[:, ii], gk.sum(0)


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_matches_reference_autograd(device):
    x, w, b, oi, ii = operands(device, torch.float32, 0.5, compact=False, batch=(4, 3))
    tensors = [t.clone().requires_grad_() for t in (x, w, b)]
    refs = [t.clone().requires_grad_() for t in (x, w, b)]
    sx.masked_linear(*tensors, oi, ii, scatter_width=OUT).square().sum().backward()
    ref.masked_linear(*refs, oi, ii, scatter_width=OUT).square().sum().backward()
    for a, r in zip(tensors, refs):
        torch.testing.assert_close(a.grad, r.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_forward_saves_gathered_operands_for_backward(device, compact, fraction):
    """masked_linear_forward returns exactly what backward would gather, and backward fed
    with them equals backward that gathers itself."""
    x, w, b, oi, ii = operands(device, torch.float32, fraction, compact, batch=(2, 3))
    for out_idx, in_idx in ((oi, ii), (oi, None), (None, ii), (None, None)):
        if compact and (out_idx is None or in_idx is None):
            continue
        y, x_kept, block = torch.ops.subnet_ext.masked_linear_forward(x, w, b, out_idx, in_idx, compact, -1)
        ey, ex, eb = ref.masked_linear_forward(x, w, b, out_idx, in_idx, compact_weight=compact)
        torch.testing.assert_close(y, ey)
        assert torch.equal(x_kept, ex) and torch.equal(block, eb)
        g = torch.randn_like(y)
        saved = sx.masked_linear_backward(g, x, w, out_idx, in_idx, compact_weight=compact, x_kept=x_kept,
                                          weight_block=block)
        fresh = sx.masked_linear_backward(g, x, w, out_idx, in_idx, compact_weight=compact)
        for a, r in zip(saved, fresh):
            assert torch.equal(a, r)


def test_saved_operands_with_wrong_shape_are_refused():
    x, w, b, oi, ii = operands("cpu", torch.float32, 0.5, compact=False)
    g = torch.randn(7, len(oi))
    with pytest.raises(ValueError, match=r"x_kept must have shape \[7, 10\]"):
        sx.masked_linear_backward(g, x, w, oi, ii, x_kept=torch.zeros(7, 3))
    with pytest.raises(ValueError, match=r"weight_block must have shape \[12, 10\]"):
        sx.masked_linear_backward(g, x, w, oi, ii, weight_block=torch.zeros(12, 11))
    with pytest.raises(ValueError, match="weight_block is Double"):
        sx.masked_linear_backward(g, x, w, oi, ii, weight_block=torch.zeros(12, 10, dtype=torch.float64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("scatter", [False, True])
def test_gradcheck_float64(device, compact, scatter):
    x, w, b, oi, ii = operands(device, torch.float64, 0.5, compact, batch=(3,))
    args = [t.requires_grad_() for t in (x, w, b)]
    fn = lambda x, w, b: sx.masked_linear(  # noqa: E731
        x, w, b, oi, ii, compact_weight=compact, scatter_width=OUT if scatter else None
    )
    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradcheck(lambda x, w: sx.masked_linear(x, w, None, oi, ii, compact_weight=compact),
                                    args[:2])


@pytest.mark.parametrize("device", DEVICES)
def test_grad_weight_into_flat_buffer_slice(device):
    x, w, b, oi, ii = operands(device, torch.float32, 0.5, compact=False, batch=(5,))
    g = torch.randn(5, OUT, device=device)
    flat = torch.full((3 + len(oi) * len(ii) + 4,), 7.0, device=device)
    view = flat[3 : 3 + len(oi) * len(ii)].view(len(oi), len(ii))
    sx.masked_linear_grad_weight_(view, g, x, oi, ii, grad_out_full=True)
    expected = ref.masked_linear_backward(g, x, w, oi, ii, grad_out_full=True)[1]
    torch.testing.assert_close(view, expected)
    assert (flat[:3] == 7).all() and (flat[-4:] == 7).all(), "wrote outside its slice"
    sx.masked_linear_grad_weight_(view, g, x, oi, ii, grad_out_full=True, accumulate=True)
    torch.testing.assert_close(view, 2 * expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.float16, torch.float32), (torch.float32, torch.float64)])
def test_backward_writes_weight_gradient_into_a_given_buffer(device, dtype, out_dtype):
    """masked_linear_backward(grad_weight_out=view): the weight gradient lands in (accumulate:
    is added to) a slice of a flat buffer of its own dtype (the engine's bucket), the other
    gradients are those of the call without it. Reference: `ref.masked_linear_backward` in
    float64 on the same (rounded) operands: fp32 output and accumulation leave only fp32
    rounding, in every dtype pairing."""
    x, w, b, oi, ii = operands(device, dtype, 0.5, compact=False, batch=(5,))
    g = torch.randn(5, OUT).to(device, dtype)
    n = len(oi) * len(ii)
    flat = torch.full((3 + n + 4,), 7.0, device=device, dtype=out_dtype)
    view = flat[3 : 3 + n].view(len(oi), len(ii))
    kw = dict(grad_out_full=True, dense_grad_input=True)
    gx, gw, gb = sx.masked_linear_backward(g, x, w, oi, ii, grad_weight_out=view, **kw)
    plain = sx.masked_linear_backward(g, x, w, oi, ii, **kw)
    exact = ref.masked_linear_backward(g.double(), x.double(), w.double(), oi, ii, **kw)[1]
    assert gw is view and torch.equal(gx, plain[0]) and torch.equal(gb, plain[2])
    tolerance = dict(rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    torch.testing.assert_close(view.double(), exact, **tolerance)
    assert (flat[:3] == 7).all() and (flat[-4:] == 7).all(), "wrote outside its slice"
    only = sx.masked_linear_backward(g, x, w, oi, ii, output_mask=(False, True, False), grad_weight_out=view,
                                     accumulate=True, **kw)
    assert only[0] is None and only[2] is None
    torch.testing.assert_close(view.double(), 2 * exact, **tolerance)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch_and_non_contiguous(device):
    x, w, b, oi, ii = operands(device, torch.float32, 0.5, compact=False, batch=(0,))
    y = sx.masked_linear(x, w, b, oi, ii, scatter_width=OUT)
    assert y.shape == (0, OUT)
    gx, gw, gb = sx.masked_linear_backward(y.new_zeros(0, OUT), x, w, oi, ii, grad_out_full=True)
    assert gx.shape == (0, IN) and (gw == 0).all() and (gb == 0).all()
    # Non-contiguous x (a transposed view) and weight (a column slice).
    xt = torch.randn(IN, 9, device=device).t()
    wide = torch.randn(OUT, 2 * IN, device=device)[:, ::2]
    assert not xt.is_contiguous() and not wide.is_contiguous()
    torch.testing.assert_close(sx.masked_linear(xt, wide, b, oi, ii), ref.masked_linear(xt, wide, b, oi, ii))
    g = torch.randn(3 * len(oi), device=device)[::3].expand(9, -1)
    for a, r in zip(sx.masked_linear_backward(g, xt, wide, oi, ii), ref.masked_linear_backward(g, xt, wide, oi, ii)):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, w, b, oi, ii = operands(device, torch.float32, 0.5, compact=False, batch=(4,))
    xc, wc, bc, _, _ = operands(device, torch.float32, 0.5, compact=True, batch=(4,))
    cases = [
        (x, w, b, oi, ii, False, -1),
        (x, w, None, oi, None, False, OUT),
        (xc, wc, bc, oi, ii, True, OUT),
        (x, w, b, None, None, False, -1),
    ]
    for args in cases:
        grad = [a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        torch.library.opcheck(torch.ops.subnet_ext.masked_linear.default, tuple(grad))
    for args in cases:
        grad = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args]
        torch.library.opcheck(torch.ops.subnet_ext.masked_linear_forward.default, tuple(grad))
    g = torch.randn(4, OUT, device=device)
    torch.library.opcheck(
        torch.ops.subnet_ext.masked_linear_backward.default,
        (g, x.detach(), w.detach(), oi, ii, False, True, False, [True, True, True]),
    )
    _, x_kept, block = torch.ops.subnet_ext.masked_linear_forward(x.detach(), w.detach(), None, oi, ii, False, -1)
    torch.library.opcheck(
        torch.ops.subnet_ext.masked_linear_backward.default,
        (g, x.detach(), w.detach(), oi, ii, False, True, False, [True, True, True], x_kept, block),
    )
    torch.library.opcheck(
        torch.ops.subnet_ext.masked_linear_backward.default,
        (g, x.detach(), w.detach(), oi, ii, False, True, True, [True, False, True]),
    )
    out = torch.zeros(len(oi), len(ii), device=device)
    torch.library.opcheck(
        torch.ops.subnet_ext.masked_linear_grad_weight_.default, (out, g, x.detach(), oi, ii, True, True)
    )


def test_torch_compile_fullgraph():
    x, w, b, oi, ii = operands("cpu", torch.float32, 0.5, compact=False, batch=(4,))

    def layer(x, w, b):
        return torch.relu(sx.masked_linear(x, w, b, oi, ii, scatter_width=OUT)).sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    args = [t.clone().requires_grad_() for t in (x, w, b)]
    eager = [t.clone().requires_grad_() for t in (x, w, b)]
    compiled(*args).backward()
    layer(*eager).backward()
    for a, e in zip(args, eager):
        torch.testing.assert_close(a.grad, e.grad)


# ---- bad input: a clear error naming the op and the values ----

BAD_FORWARD = [
    (lambda x, w, b, oi, ii: dict(out_idx=torch.tensor([0, OUT])), "out_idx has values in"),
    (lambda x, w, b, oi, ii: dict(out_idx=torch.tensor([-1, 2])), "out_idx has values in"),
    (lambda x, w, b, oi, ii: dict(in_idx=torch.tensor([3, 3])), "holds the index 3 more than once"),
    (lambda x, w, b, oi, ii: dict(in_idx=torch.tensor([1, 2], dtype=torch.int32)), "must be an int64 tensor"),
    (lambda x, w, b, oi, ii: dict(in_idx=torch.tensor([[1, 2]])), "must be 1-D"),
    (lambda x, w, b, oi, ii: dict(x=x[:, :-1]), "x has width"),
    (lambda x, w, b, oi, ii: dict(weight=w[:, None]), "weight must be 2-D"),
    (lambda x, w, b, oi, ii: dict(x=x.double()), "x is Double but weight is Float"),
    (lambda x, w, b, oi, ii: dict(bias=b[:-1]), "bias must have shape"),
    (lambda x, w, b, oi, ii: dict(scatter_width=-2), "scatter_width must be"),
    (lambda x, w, b, oi, ii: dict(out_idx=oi, scatter_width=2), "out_idx has values in"),
    (lambda x, w, b, oi, ii: dict(weight=w[:3, :4], compact_weight=True, in_idx=ii), "compact weight has 4 input"),
]


@pytest.mark.parametrize("case", range(len(BAD_FORWARD)))
def test_bad_forward_input(case):
    x, w, b, oi, ii = operands("cpu", torch.float32, 0.5, compact=False)
    make, message = BAD_FORWARD[case]
    args = dict(x=x, weight=w, bias=b)
    args.update(make(x, w, b, oi, ii))
    with pytest.raises((ValueError, RuntimeError), match=message) as info:
        sx.masked_linear(**args)
    assert "subnet_ext.masked_linear" in str(info.value)


def test_bad_backward_input():
    x, w, b, oi, ii = operands("cpu", torch.float32, 0.5, compact=False)
    g = torch.randn(7, len(oi))
    with pytest.raises(ValueError, match="grad_out has shape"):
        sx.masked_linear_backward(g[:, :-1], x, w, oi, ii)
    with pytest.raises(ValueError, match="dense_grad_input needs the full grad_out"):
        sx.masked_linear_backward(g, x, w, oi, ii, dense_grad_input=True)
    with pytest.raises(ValueError, match="out must have shape"):
        sx.masked_linear_grad_weight_(torch.zeros(2, 2), g, x, oi, ii)
    with pytest.raises(ValueError, match="devices differ|dtypes differ"):
        sx.masked_linear_grad_weight_(torch.zeros(len(oi), len(ii), dtype=torch.float64), g, x, oi, ii)


@needs_cuda
def test_index_on_wrong_device():
    x, w, b, oi, ii = operands("cuda", torch.float32, 0.5, compact=False)
    with pytest.raises(ValueError, match="in_idx is on cpu"):
        sx.masked_linear(x, w, b, oi, ii.cpu())


# ---- strided (non-contiguous) index tensors: every op, every device ----


def _strided(idx):
    """The same values as idx, as a view with stride 2 (not contiguous)."""
    wide = torch.full((2 * len(idx),), -7, dtype=idx.dtype, device=idx.device)
    wide[::2] = idx
    view = wide[::2]
    assert not view.is_contiguous() or len(idx) <= 1
    return view


def test_strided_in_idx_reported_case():
    """The reported case: x 5x20, w 8x20, in_idx = arange(20)[::2]."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 20, generator=gen), torch.randn(8, 20, generator=gen), torch.randn(8, generator=gen)
    idx = torch.arange(20)[::2]
    torch.testing.assert_close(sx.masked_linear(x, w, b, None, idx), sx.masked_linear(x, w, b, None, idx.contiguous()))
    torch.testing.assert_close(sx.masked_linear(x, w, b, None, idx), ref.masked_linear(x, w, b, None, idx))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compact", [False, True])
def test_strided_indices_on_every_op(device, compact):
    x, w, b, oi, ii = operands(device, torch.float64, 0.5, compact, batch=(2, 3))
    so, si = _strided(oi), _strided(ii)
    for scatter in (None, OUT):
        kw = dict(compact_weight=compact, scatter_width=scatter)
        want = ref.masked_linear(x, w, b, oi, ii, **kw)
        torch.testing.assert_close(sx.masked_linear(x, w, b, so, si, **kw), want)
        y, x_kept, block = torch.ops.subnet_ext.masked_linear_forward(x, w, b, so, si, compact,
                                                                      -1 if scatter is None else scatter)
        ey, ex, eb = ref.masked_linear_forward(x, w, b, oi, ii, **kw)
        torch.testing.assert_close(y, ey)
        assert torch.equal(x_kept, ex) and torch.equal(block, eb)
    dense_cases = (False,) if compact else (False, True)
    for full_g in (False, True):
        for dense in dense_cases:
            if dense and not full_g:
                continue
            g = torch.randn(2, 3, OUT if full_g else len(oi), dtype=torch.float64, device=device)
            kw = dict(compact_weight=compact, grad_out_full=full_g, dense_grad_input=dense)
            got = sx.masked_linear_backward(g, x, w, so, si, **kw)
            want = ref.masked_linear_backward(g, x, w, oi, ii, **kw)
            for a, r in zip(got, want):
                torch.testing.assert_close(a, r)
            out = torch.zeros(len(oi), len(ii), dtype=torch.float64, device=device)
            sx.masked_linear_grad_weight_(out, g, x, so, si, grad_out_full=full_g)
            torch.testing.assert_close(out, want[1])
    # autograd through the strided indices
    args = [t.clone().requires_grad_() for t in (x, w, b)]
    refs = [t.clone().requires_grad_() for t in (x, w, b)]
    sx.masked_linear(*args, so, si, compact_weight=compact, scatter_width=OUT).square().sum().backward()
    ref.masked_linear(*refs, oi, ii, compact_weight=compact, scatter_width=OUT).square().sum().backward()
    for a, r in zip(args, refs):
        torch.testing.assert_close(a.grad, r.grad)


# ---- check_indices=False: the engine's no-validation (sync-free) path ----


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compact", [False, True])
def test_check_indices_false_matches_the_reference(device, compact):
    """The unchecked path (the engine's) against the pure-PyTorch reference, in float64:
    forward, autograd, the backward op and the in-place weight gradient."""
    x, w, b, oi, ii = operands(device, torch.float64, 0.5, compact, batch=(3, 4))
    tol = dict(rtol=1e-12, atol=1e-12)
    for scatter in (None, OUT):
        kw = dict(compact_weight=compact, scatter_width=scatter)
        torch.testing.assert_close(sx.masked_linear(x, w, b, oi, ii, check_indices=False, **kw),
                                   ref.masked_linear(x, w, b, oi, ii, **kw), **tol)
        trusted = [t.clone().requires_grad_() for t in (x, w, b)]
        refs = [t.clone().requires_grad_() for t in (x, w, b)]
        sx.masked_linear(*trusted, oi, ii, check_indices=False, **kw).square().sum().backward()
        ref.masked_linear(*refs, oi, ii, **kw).square().sum().backward()
        for t, r in zip(trusted, refs):
            torch.testing.assert_close(t.grad, r.grad, **tol)
    g = torch.randn(3, 4, len(oi), device=device, dtype=torch.float64)
    for got, want in zip(sx.masked_linear_backward(g, x, w, oi, ii, compact_weight=compact, check_indices=False),
                         ref.masked_linear_backward(g, x, w, oi, ii, compact_weight=compact)):
        torch.testing.assert_close(got, want, **tol)
    out, want = (torch.zeros(len(oi), len(ii), device=device, dtype=torch.float64) for _ in range(2))
    sx.masked_linear_grad_weight_(out, g, x, oi, ii, check_indices=False)
    ref.masked_linear_grad_weight_(want, g, x, oi, ii)
    torch.testing.assert_close(out, want, **tol)


def test_check_indices_true_still_rejects_bad_values_and_false_keeps_cheap_checks():
    x, w, b, oi, ii = operands("cpu", torch.float32, 0.5, compact=False)
    g = torch.randn(7, len(oi))
    for bad, message in ((torch.tensor([0, OUT]), "out_idx has values in"),
                         (torch.tensor([3, 3]), "holds the index 3 more than once")):
        with pytest.raises(ValueError, match=message):
            sx.masked_linear(x, w, b, bad, ii, check_indices=True)
        with pytest.raises(ValueError, match=message):
            torch.ops.subnet_ext.masked_linear_forward(x, w, b, bad, ii, False, -1, True)
        with pytest.raises(ValueError, match=message):
            sx.masked_linear_backward(g[:, : len(bad)], x, w, bad, ii, check_indices=True)
        with pytest.raises(ValueError, match=message):
            sx.masked_linear_grad_weight_(torch.zeros(len(bad), len(ii)), torch.randn(7, OUT), x, bad, ii,
                                          grad_out_full=True, check_indices=True)
    # dtype / dim checks stay on (they need no values)
    with pytest.raises(ValueError, match="must be an int64 tensor"):
        sx.masked_linear(x, w, b, oi, ii.int(), check_indices=False)
    with pytest.raises(ValueError, match="must be 1-D"):
        sx.masked_linear(x, w, b, oi[None], ii, check_indices=False)
    with pytest.raises(ValueError, match="must be an int64 tensor"):
        sx.masked_linear_backward(g, x, w, oi, ii.int(), check_indices=False)
    with pytest.raises(ValueError, match="must be 1-D"):
        sx.masked_linear_grad_weight_(torch.zeros(len(oi), len(ii)), g, x, oi, ii[None], check_indices=False)


def test_check_indices_opcheck_cpu():
    x, w, b, oi, ii = operands("cpu", torch.float32, 0.5, compact=False, batch=(4,))
    args = (x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), oi, ii, False, OUT, False)
    torch.library.opcheck(torch.ops.subnet_ext.masked_linear.default, args)
    torch.library.opcheck(torch.ops.subnet_ext.masked_linear_forward.default,
                          tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                                else a for a in args))


@needs_cuda
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("scatter", [False, True])
def test_check_indices_false_never_synchronises_cuda(compact, scatter):
    """Forward + backward of a training step with check_indices=False: no device sync."""
    x, w, b, oi, ii = operands("cuda", torch.float32, 0.5, compact, batch=(6, 5))
    args = [t.clone().requires_grad_() for t in (x, w, b)]
    kw = dict(compact_weight=compact, scatter_width=OUT if scatter else None)
    g = torch.randn(6, 5, OUT if scatter else len(oi), device="cuda")
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = sx.masked_linear(*args, oi, ii, check_indices=False, **kw)
        y.backward(g)
        out = torch.empty(len(oi), len(ii), device="cuda")
        sx.masked_linear_grad_weight_(out, g, x, oi, ii, grad_out_full=scatter,
                                      check_indices=False)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    refs = [t.clone().requires_grad_() for t in (x, w, b)]
    ref.masked_linear(*refs, oi, ii, **kw).backward(g)
    torch.testing.assert_close(y, ref.masked_linear(x, w, b, oi, ii, **kw))
    for a, r in zip(args, refs):
        torch.testing.assert_close(a.grad, r.grad)
    torch.testing.assert_close(out, ref.masked_linear_backward(g, x, w, oi, ii, grad_out_full=scatter,
                                                               compact_weight=compact)[1])


# ---- CUDA gathers and scatters: many blocks, misaligned operands, side streams ----

def _check_gather_scatter_exact(x, w, b, oi, ii, width):
    """Gather (x_kept), scatter (y at columns R, zeros elsewhere) and the backward's
    scatter of grad_x, all against exact equalities or the reference."""
    y_full, x_kept, block = torch.ops.subnet_ext.masked_linear_forward(x, w, b, oi, ii, False, width)
    y_compact = sx.masked_linear(x, w, b, oi, ii)
    assert torch.equal(x_kept, x.reshape(-1, x.shape[-1])[:, ii]), "gather of x"
    assert torch.equal(block, w[oi][:, ii]), "gather of the weight block"
    assert torch.equal(y_full[..., oi], y_compact), "kept columns of the scatter"
    rest = torch.ones(width, dtype=torch.bool, device=x.device)
    rest[oi] = False
    assert (y_full[..., rest] == 0).all(), "zero columns of the scatter"
    g = torch.randn(y_compact.shape, device=x.device).to(x.dtype)
    gx, gw, gb = sx.masked_linear_backward(g, x, w, oi, ii)
    keep_in = torch.zeros(x.shape[-1], dtype=torch.bool, device=x.device)
    keep_in[ii] = True
    assert (gx[..., ~keep_in] == 0).all(), "zero columns of grad_x"
    exact = ref.masked_linear_backward(g.double(), x.double(), w.double(), oi, ii)
    # Relative to the largest magnitude: GEMMs over 70000 rows may reduce in split-K
    # pieces (bf16 ones possibly rounded), so near-zero elements carry absolute errors.
    tol = {torch.float64: 1e-10, torch.float32: 1e-4}.get(x.dtype, 2e-2)
    for name, a, e in zip(("grad_x", "grad_w", "grad_b"), (gx, gw, gb), exact):
        err = (a.double() - e).abs().max().item()
        assert err <= tol * max(e.abs().max().item(), 1.0), f"{name}: max error {err:.3e} ({x.dtype})"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("blocks", [1, 3])
def test_cuda_grid_smaller_than_the_work(dtype, blocks):
    """The index kernels' grid capped at 1 or 3 blocks per dimension (testing.max_grid_blocks):
    every thread's grid-stride loops make many passes over rows and columns, and every
    path (16-byte column gather, element gather, whole-row vectors, 16-byte and element
    scatter) must still write every element once. Widths 304 (a multiple of 16 bytes for
    every dtype) and 301 (of none) take the vector and the element kernels."""
    gen = torch.Generator().manual_seed(5)
    for n, width, kept_out, kept_in in ((3001, 304, 152, 152), (2999, 301, 151, 149)):
        x = torch.randn(n, width, generator=gen).to("cuda", dtype)
        w = torch.randn(width, width, generator=gen).to("cuda", dtype)
        b = torch.randn(width, generator=gen).to("cuda", dtype)
        oi = torch.randperm(width, generator=gen)[:kept_out].cuda()
        ii = torch.randperm(width, generator=gen)[:kept_in].cuda()
        with max_grid_blocks(blocks):
            _check_gather_scatter_exact(x, w, b, oi, ii, width)
            # all output columns kept: the inverse map without a -1
            _check_gather_scatter_exact(x, w, b, torch.randperm(width, generator=gen).cuda(), ii, width)
            # whole rows of the weight (no in_idx: the whole-row gather, 16-byte vectors at width 304)
            y, _, block = torch.ops.subnet_ext.masked_linear_forward(x, w, b, oi, None, False, -1)
            assert torch.equal(block, w[oi]), "gather of whole weight rows"
            torch.testing.assert_close(y.double(), ref.masked_linear(x.double(), w.double(), b.double(), oi),
                                       rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_many_blocks(dtype):
    """70000 rows x 300 columns at the default grid: many row blocks."""
    gen = torch.Generator().manual_seed(5)
    n, width = 70000, 300
    x = torch.randn(n, width, generator=gen).to("cuda", dtype)
    w = torch.randn(width, width, generator=gen).to("cuda", dtype)
    b = torch.randn(width, generator=gen).to("cuda", dtype)
    oi = torch.randperm(width, generator=gen)[:151].cuda()
    ii = torch.randperm(width, generator=gen)[:149].cuda()
    _check_gather_scatter_exact(x, w, b, oi, ii, width)


def test_max_grid_blocks_is_bounded():
    with pytest.raises(ValueError, match=r"blocks must lie in \[1, 65535\], got 0"):
        with max_grid_blocks(0):
            pass


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_cuda_misaligned_contiguous_operands(dtype):
    """Operands that are contiguous slices of a flat buffer at an odd element offset."""
    gen = torch.Generator().manual_seed(6)
    n, out_f, in_f = 37, 45, 33
    flat = torch.randn(1 + n * in_f + out_f * in_f + out_f, generator=gen).to("cuda", dtype)
    x = flat[1 : 1 + n * in_f].view(n, in_f)
    w = flat[1 + n * in_f : 1 + n * in_f + out_f * in_f].view(out_f, in_f)
    b = flat[1 + n * in_f + out_f * in_f :]
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    oi = torch.randperm(out_f, generator=gen)[:20].cuda()
    ii = torch.randperm(in_f, generator=gen)[:17].cuda()
    _check_gather_scatter_exact(x, w, b, oi, ii, out_f)
    out_flat = torch.full((3 + 20 * 17,), 5.0, device="cuda", dtype=dtype)
    view = out_flat[3:].view(20, 17)
    g = torch.randn(n, 20, generator=gen).to("cuda", dtype)
    sx.masked_linear_grad_weight_(view, g, x, oi, ii)
    torch.testing.assert_close(view.double(), g.double().t() @ x.double()[:, ii], rtol=2e-2, atol=2e-2)
    assert (out_flat[:3] == 5).all()


# Cycles of torch.cuda._sleep: tens of milliseconds at the H200's clocks, far longer than any launch here.
SIDE_STREAM_DELAY = 50_000_000


@needs_cuda
def test_cuda_side_stream():
    """Every launch goes to the current stream. The side stream first sleeps, then writes the
    operands over their NaN fill, then runs forward, backward and the weight gradient into a
    buffer: a kernel launched on any other stream would run during the sleep and read NaN
    (or, launched late, write after the side stream's synchronize), so the results below, read
    once the side stream alone is synchronised, would not match the reference."""
    gen = torch.Generator().manual_seed(7)
    n, width = 4096, 304  # 16-byte rows: the vector gathers and scatters run too
    sources = [torch.randn(n, width, generator=gen), torch.randn(width, width, generator=gen),
               torch.randn(width, generator=gen), torch.randn(n, 100, generator=gen)]
    x_src, w_src, b_src, g_src = (t.cuda() for t in sources)
    oi = torch.randperm(width, generator=gen)[:100].cuda()
    ii = torch.randperm(width, generator=gen)[:120].cuda()
    x, w, b, g = (torch.full_like(t, float("nan")) for t in (x_src, w_src, b_src, g_src))
    grad_block = torch.full((100, 120), float("nan"), device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SIDE_STREAM_DELAY)
        for dst, src in ((x, x_src), (w, w_src), (b, b_src), (g, g_src)):
            dst.copy_(src)
        y = sx.masked_linear(x, w, b, oi, ii, scatter_width=width, check_indices=False)
        gx, gw, gb = sx.masked_linear_backward(g, x, w, oi, ii, check_indices=False)
        sx.masked_linear_grad_weight_(grad_block, g, x, oi, ii, check_indices=False)
    side.synchronize()
    torch.testing.assert_close(y, ref.masked_linear(x_src, w_src, b_src, oi, ii, scatter_width=width),
                               rtol=1e-4, atol=1e-4)
    expected = ref.masked_linear_backward(g_src, x_src, w_src, oi, ii)
    for a, e in zip((gx, gw, gb, grad_block), (*expected, expected[1])):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-3)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_vector_paths_run_where_rows_align(dtype):
    """Which kernel ran, not only what it computed (testing.kernel_path_count): 16-byte aligned
    rows (width 304 and 152 kept columns, multiples of 16 bytes for every dtype) take the
    vector gather of whole rows and of columns and the vector scatter, and no element kernel;
    width 301 with 151 and 149 kept takes the element kernels only. The results match the
    reference either way."""
    gen = torch.Generator().manual_seed(8)
    paths = ("gather_rows_vector", "gather_columns_vector", "gather_elements", "scatter_columns_vector",
             "scatter_columns_elements")
    ran = {}
    for width, kept_out, kept_in in ((304, 152, 152), (301, 151, 149)):
        x = torch.randn(257, width, generator=gen).to("cuda", dtype)
        w = torch.randn(width, width, generator=gen).to("cuda", dtype)
        b = torch.randn(width, generator=gen).to("cuda", dtype)
        oi = torch.randperm(width, generator=gen)[:kept_out].cuda()
        ii = torch.randperm(width, generator=gen)[:kept_in].cuda()
        before = {p: kernel_path_count(p) for p in paths}
        y, _, _ = torch.ops.subnet_ext.masked_linear_forward(x, w, b, oi, ii, False, width)  # column gathers, scatter
        rows = sx.masked_linear(x, w, b, oi, None)  # whole weight rows gathered
        torch.cuda.synchronize()
        ran[width] = {p: kernel_path_count(p) - before[p] for p in paths}
        torch.testing.assert_close(y.double(), ref.masked_linear(x.double(), w.double(), b.double(), oi, ii,
                                                                 scatter_width=width), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(rows.double(), ref.masked_linear(x.double(), w.double(), b.double(), oi),
                                   rtol=2e-2, atol=2e-2)
    vector, element = ran[304], ran[301]
    assert vector["gather_rows_vector"] >= 1 and vector["gather_columns_vector"] >= 2, vector  # x and the weight
    assert vector["scatter_columns_vector"] == 1 and vector["gather_elements"] == 0, vector
    assert vector["scatter_columns_elements"] == 0, vector
    assert element["gather_elements"] >= 3 and element["scatter_columns_elements"] == 1, element
    assert not any(element[p] for p in paths if p.endswith("vector")), element


def test_kernel_path_count_names_the_paths():
    """The counter op exists in every build (CPU ones too); an unknown path is refused by name."""
    assert kernel_path_count("segments_vector") >= 0
    with pytest.raises(ValueError, match="unknown kernel path 'gather_vector'; the paths are: gather_rows_vector"):
        kernel_path_count("gather_vector")


@needs_two_gpus
def test_cuda_second_device():
    """Operands on cuda:1 while cuda:0 is current: every launch on the operands' device."""
    x, w, b, oi, ii = operands("cuda:1", torch.float32, 0.5, compact=False, batch=(300,))
    args = [t.clone().requires_grad_() for t in (x, w, b)]
    with torch.cuda.device(0):
        y = sx.masked_linear(*args, oi, ii, scatter_width=OUT, check_indices=False)
        y.square().sum().backward()
    assert y.device == torch.device("cuda:1")
    refs = [t.clone().requires_grad_() for t in (x, w, b)]
    want = ref.masked_linear(*refs, oi, ii, scatter_width=OUT)
    want.square().sum().backward()
    torch.testing.assert_close(y, want)
    for a, r in zip(args, refs):
        torch.testing.assert_close(a.grad, r.grad)

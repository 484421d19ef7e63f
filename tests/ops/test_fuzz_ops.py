"""Fuzzing of the ops' inputs (hypothesis): masked-linear indices and shapes, packed-segment
rectangles and tables. The contract: a ValueError (TORCH_CHECK_VALUE) or exactly the
reference result; any other exception, a RuntimeError included, fails. Each surface
asserts a minimum share of examples reached the reference (see fuzz_harness.py).
"""
import torch
from hypothesis import strategies as st

import subnet_ext as sx
from subnet_ext import reference
from fuzz_harness import CLEAR, COMPARED, assert_compared, run_surface

# ----------------------------------------------------------------------------- masked linear
def _index(draw, bound):
    kind = draw(st.sampled_from(["none", "good", "good", "raw", "int32", "float", "2d"]))
    if kind == "none":
        return None
    if kind == "good":
        return torch.tensor(draw(st.permutations(list(range(bound))))[:draw(st.integers(0, bound))],
                            dtype=torch.int64)
    values = draw(st.lists(st.integers(-3, bound + 3), max_size=6))
    t = torch.tensor(values, dtype={"raw": torch.int64, "int32": torch.int32, "float": torch.float32,
                                    "2d": torch.int64}[kind])
    return t.reshape(1, -1) if kind == "2d" else t


@st.composite
def linear_case(draw):
    o, i, n = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(0, 3))
    out_idx, in_idx = _index(draw, o), _index(draw, i)
    compact = draw(st.booleans())
    kept_o = o if out_idx is None else len(out_idx.reshape(-1))
    kept_i = i if in_idx is None else len(in_idx.reshape(-1))
    w_shape = (kept_o, kept_i) if compact and draw(st.booleans()) else (o, i)
    g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
    x = torch.randn(n, i if not draw(st.booleans()) else draw(st.integers(1, 6)), generator=g, dtype=torch.float64)
    weight = torch.randn(*w_shape, generator=g, dtype=torch.float64)
    bias = torch.randn(w_shape[0], generator=g, dtype=torch.float64) if draw(st.booleans()) else None
    scatter = draw(st.sampled_from([None, None, o, o - 1, 0]))
    return x, weight, bias, out_idx, in_idx, compact, scatter


def _linear(case):
    x, weight, bias, out_idx, in_idx, compact, scatter = case
    try:
        y = sx.masked_linear(x, weight, bias, out_idx, in_idx, compact_weight=compact, scatter_width=scatter)
    except CLEAR:
        return "clear error"
    expected = reference.masked_linear(x, weight, bias, out_idx, in_idx, compact_weight=compact,
                                       scatter_width=scatter)
    torch.testing.assert_close(y, expected)
    return COMPARED


def fuzz_masked_linear():
    """Counter of outcomes: masked_linear on random shapes, indices and flags."""
    return run_surface(_linear, dict(case=linear_case()))


def test_masked_linear_error_or_reference():
    assert_compared(fuzz_masked_linear(), 0.1)


def fuzz_masked_linear_backward():
    """Counter of outcomes: masked_linear_backward on random shapes, indices, flags and masks."""
    return run_surface(_linear_backward, dict(case=linear_case(), full=st.booleans(),
                                              mask=st.tuples(st.booleans(), st.booleans(), st.booleans())))


def test_masked_linear_backward_error_or_reference():
    assert_compared(fuzz_masked_linear_backward(), 0.1)


def _linear_backward(case, mask, full):
    x, weight, _, out_idx, in_idx, compact, _ = case
    width = weight.shape[0] if (compact or out_idx is None) else len(out_idx.reshape(-1))
    grad_out = torch.randn(x.shape[0], weight.shape[0] if full else width, dtype=torch.float64)
    kw = dict(compact_weight=compact, grad_out_full=full, output_mask=mask)
    try:
        got = sx.masked_linear_backward(grad_out, x, weight, out_idx, in_idx, **kw)
    except CLEAR:
        return "clear error"
    expected = reference.masked_linear_backward(grad_out, x, weight, out_idx, in_idx, **kw)
    for a, b in zip(got, expected):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)
    return COMPARED


def test_backward_with_no_kept_outputs():
    """No kept outputs (an empty out_idx): grad_out is [N, 0]; the backward must give zero
    input gradients, not fail reshaping an empty tensor (it once raised RuntimeError)."""
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    none_kept = torch.empty(0, dtype=torch.int64)
    sx.masked_linear(x, weight, None, none_kept).sum().backward()
    want = reference.masked_linear_backward(torch.zeros(3, 0, dtype=torch.float64), x.detach(),
                                            weight.detach(), none_kept, None)
    torch.testing.assert_close(x.grad, want[0])  # zeros: no output depends on x


# ----------------------------------------------------------------------------- packed segments
@st.composite
def segment_case(draw):
    shapes = draw(st.lists(st.sampled_from([(), (3,), (4, 2), (2, 3, 2), (0, 3)]), min_size=1, max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
    tensors = [torch.randn(s, generator=g) for s in shapes]
    rows = []
    offset = 0
    for _ in range(draw(st.integers(0, 4))):
        t = draw(st.integers(-1, len(tensors)))
        r0, c0 = draw(st.integers(-1, 4)), draw(st.integers(-1, 6))
        r1, c1 = r0 + draw(st.integers(-1, 3)), c0 + draw(st.integers(-1, 3))
        off = draw(st.sampled_from([offset, offset, 0, offset + 1, -1, 2**63 - 2]))
        rows.append((t, r0, r1, c0, c1, off))
        offset = off + max(0, r1 - r0) * max(0, c1 - c0) if 0 <= off < 2**40 else offset
    table = torch.tensor(rows, dtype=torch.int64) if rows else torch.empty(0, 6, dtype=torch.int64)
    if draw(st.booleans()):
        table = table[:, :draw(st.integers(0, 5))]  # a malformed table
    buffer = torch.randn(draw(st.integers(0, 40)), generator=g)
    scales = [draw(st.sampled_from([0.5, 1.0, 1 / 3, float("nan")])) for _ in range(len(rows))]
    return tensors, table, buffer, scales


def _pack(case):
    tensors, table, buffer, _ = case
    got = buffer.clone()
    try:
        sx.pack_segments(tensors, table, got)
    except CLEAR:
        return "clear error"
    torch.testing.assert_close(got, reference.pack_segments(tensors, table, buffer.clone()))
    return COMPARED


def fuzz_pack_segments():
    """Counter of outcomes: pack_segments on random tensors, tables and buffers."""
    return run_surface(_pack, dict(case=segment_case()), examples=[dict(
        case=([torch.zeros(4, 4)], torch.tensor([[0, 0, 1, 0, 4, 2**63 - 2]]), torch.zeros(8), [1.0]))])


def test_pack_segments_error_or_reference():
    assert_compared(fuzz_pack_segments(), 0.05)


def _unpack(case):
    tensors, table, buffer, scales = case
    got = [t.clone() for t in tensors]
    try:
        sx.unpack_average_(got, table, buffer, scales)
    except CLEAR:
        return "clear error"
    expected = [t.clone() for t in tensors]
    reference.unpack_average_(expected, table, buffer, scales)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, equal_nan=True)
    return COMPARED


def fuzz_unpack_average():
    """Counter of outcomes: unpack_average_ on random tensors, tables, buffers and scales."""
    return run_surface(_unpack, dict(case=segment_case()))


def test_unpack_average_error_or_reference():
    assert_compared(fuzz_unpack_average(), 0.05)


# Every surface with its minimum compared fraction, for bench/fuzz.py (make fuzz).
SURFACES = {
    "masked_linear indices": (fuzz_masked_linear, 0.1),
    "masked_linear_backward indices": (fuzz_masked_linear_backward, 0.1),
    "pack_segments rectangles": (fuzz_pack_segments, 0.05),
    "unpack_average_ rectangles": (fuzz_unpack_average, 0.05),
}

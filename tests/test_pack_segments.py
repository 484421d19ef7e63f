"""pack_segments / unpack_average_ against subnet_ext.reference.

Reference implementations: `subnet_ext.reference.pack_segments` and `unpack_average_`
(a Python loop over rectangles of the 2-D views).
"""
import pytest
import torch

import subnet_ext as sx
from subnet_ext import reference as ref
from subnet_ext.testing import DEVICES, DTYPES

SHAPES = [(13, 7), (40,), (), (6, 3, 5), (2, 4, 3, 3), (300, 257)]


def make_tensors(device, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device, dtype) for s in SHAPES]


def random_rectangles(tensors, seed=0, per_tensor=2):
    """Disjoint rectangles: each tensor's rows cut into bands, a column range per band."""
    gen = torch.Generator().manual_seed(seed)
    rects = []
    for i, t in enumerate(tensors):
        v = ref.as_2d(t)
        rows, cols = v.shape
        cuts = sorted(torch.randint(0, rows + 1, (per_tensor - 1,), generator=gen).tolist())
        bounds = [0, *cuts, rows]
        for r0, r1 in zip(bounds[:-1], bounds[1:]):
            c0 = int(torch.randint(0, cols, (1,), generator=gen))
            c1 = int(torch.randint(c0, cols + 1, (1,), generator=gen))
            rects.append((i, r0, r1, c0, c1))
    order = torch.randperm(len(rects), generator=gen).tolist()  # buffer order != tensor order
    return [rects[k] for k in order]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_pack_matches_reference(device, dtype, seed):
    tensors = make_tensors(device, dtype, seed)
    segments, n = sx.segment_table(random_rectangles(tensors, seed), start=5)
    buffer = torch.full((n + 3,), 9.0, device=device, dtype=dtype)
    expected = ref.pack_segments(tensors, segments, buffer.clone())
    sx.pack_segments(tensors, segments, buffer)
    torch.testing.assert_close(buffer, expected, rtol=0, atol=0)
    assert (buffer[:5] == 9).all() and (buffer[n:] == 9).all(), "pack wrote outside the segments"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_unpack_average_matches_reference(device, dtype):
    tensors = make_tensors(device, dtype)
    segments, n = sx.segment_table(random_rectangles(tensors, per_tensor=3))
    buffer = torch.randn(n).to(device, dtype)
    scales = torch.rand(len(segments), dtype=torch.float64) + 0.1
    got = [t.clone() for t in tensors]
    want = [t.clone() for t in tensors]
    sx.unpack_average_(got, segments, buffer, scales)
    ref.unpack_average_(want, segments, buffer, scales)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_with_scale_is_the_average(device):
    """pack on two 'ranks', sum the buffers, unpack with 1/2: the mean of the two."""
    a, b = make_tensors(device, torch.float32, 0), make_tensors(device, torch.float32, 1)
    segments, _ = sx.segment_table(random_rectangles(a))
    total = sx.pack_segments(a, segments) + sx.pack_segments(b, segments)
    out = [t.clone() for t in a]
    sx.unpack_average_(out, segments, total, [0.5] * len(segments))
    for t, r0, r1, c0, c1, _ in segments.tolist():
        got = ref.as_2d(out[t])[r0:r1, c0:c1]
        mean = (ref.as_2d(a[t])[r0:r1, c0:c1] + ref.as_2d(b[t])[r0:r1, c0:c1]) * 0.5
        torch.testing.assert_close(got, mean)


@pytest.mark.parametrize("device", DEVICES)
def test_many_tensors_and_large_segments(device):
    """Chunking across segment boundaries: one big tensor and 150 small ones."""
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(700, 301, generator=gen)] + [torch.randn(int(r), 5, generator=gen)
                                                        for r in torch.randint(1, 9, (150,), generator=gen)]
    tensors = [t.to(device) for t in tensors]
    rects = [(i, 0, max(1, t.shape[0] // 2), 0, t.shape[1]) for i, t in enumerate(tensors)]
    rects.append((0, 400, 700, 17, 290))
    segments, n = sx.segment_table(rects)
    buffer = sx.pack_segments(tensors, segments)
    torch.testing.assert_close(buffer, ref.pack_segments(tensors, segments), rtol=0, atol=0)
    out = [t.clone() for t in tensors]
    want = [t.clone() for t in tensors]
    sx.unpack_average_(out, segments, buffer * 3, [1 / 3] * len(segments))
    ref.unpack_average_(want, segments, buffer * 3, [1 / 3] * len(segments))
    for o, w in zip(out, want):
        torch.testing.assert_close(o, w, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_segment_list_and_empty_rectangles(device):
    """Empty rectangles and an empty table move nothing: every tensor and every buffer
    element keeps its value (the reference agrees)."""
    tensors = make_tensors(device, torch.float32)
    kept = [t.clone() for t in tensors]
    segments, n = sx.segment_table([(0, 3, 3, 0, 7), (1, 0, 0, 0, 1)])
    assert n == 0
    # A buffer with elements outside every segment: they must be left as they were.
    buffer = torch.arange(5, dtype=torch.float32, device=device) + 0.5
    sentinel = buffer.clone()
    assert sx.pack_segments(tensors, segments, buffer) is buffer
    torch.testing.assert_close(buffer, sentinel, rtol=0, atol=0)
    torch.testing.assert_close(buffer.cpu(), ref.pack_segments([t.cpu() for t in tensors], segments,
                                                               sentinel.cpu().clone()), rtol=0, atol=0)
    sx.unpack_average_(tensors, segments, buffer, [1.0, 1.0])
    sx.pack_segments(tensors, torch.empty(0, 6, dtype=torch.int64), buffer)
    sx.unpack_average_(tensors, torch.empty(0, 6, dtype=torch.int64), buffer, [])
    torch.testing.assert_close(buffer, sentinel, rtol=0, atol=0)
    for t, k in zip(tensors, kept):
        torch.testing.assert_close(t, k, rtol=0, atol=0)


def test_opcheck():
    tensors = make_tensors("cpu", torch.float32)
    segments, n = sx.segment_table(random_rectangles(tensors))
    buffer = torch.zeros(n)
    torch.library.opcheck(torch.ops.subnet_ext.pack_segments.default, (tensors, segments, buffer))
    scales = torch.full((len(segments),), 0.5, dtype=torch.float64)
    torch.library.opcheck(torch.ops.subnet_ext.unpack_average_.default, (tensors, segments, buffer, scales))


# ---- bad input ----

def _bad_cases():
    t = make_tensors("cpu", torch.float32)
    ok, n = sx.segment_table([(0, 0, 2, 0, 7), (1, 0, 4, 0, 1)])
    buf = torch.zeros(n)
    seg = lambda rows: torch.tensor(rows, dtype=torch.int64)  # noqa: E731
    return [
        ("outside tensor", t, seg([[0, 0, 14, 0, 7, 0]]), torch.zeros(200), "lies outside tensor 0"),
        ("bad column range", t, seg([[0, 0, 2, 5, 8, 0]]), torch.zeros(200), "lies outside tensor 0"),
        ("tensor index", t, seg([[9, 0, 1, 0, 1, 0]]), buf, "names tensor 9"),
        ("buffer too small", t, ok, torch.zeros(n - 1), "occupies buffer"),
        ("overlap in buffer", t, seg([[0, 0, 2, 0, 7, 0], [1, 0, 4, 0, 1, 10]]), torch.zeros(30), "overlap in the buffer"),
        ("segments shape", t, ok[:, :5], buf, "shape \\[S, 6\\]"),
        ("segments dtype", t, ok.int(), buf, "int64 CPU tensor"),
        ("dtype mismatch", t, ok, buf.double(), "tensor 0 is Float"),
        ("non-contiguous", [t[0].t()] + t[1:], ok, buf, "must be contiguous"),
        ("2-D buffer", t, ok, buf[None], "contiguous 1-D"),
    ]


# Parametrised over the case list itself: a case added to _bad_cases() is always run.
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda case: case[0])
def test_bad_input_is_a_clear_error(case):
    name, tensors, segments, buffer, message = case
    with pytest.raises(ValueError, match=message):
        sx.pack_segments(tensors, segments, buffer)
    scales = torch.ones(len(segments), dtype=torch.float64)
    with pytest.raises(ValueError, match=message):
        sx.unpack_average_(tensors, segments, buffer, scales)


def test_unpack_rejects_overlapping_rectangles_and_bad_scales():
    t = make_tensors("cpu", torch.float32)
    segments, n = sx.segment_table([(5, 0, 10, 0, 10), (5, 5, 20, 8, 30)])
    buffer = torch.zeros(n)
    sx.pack_segments(t, segments, buffer)  # reading overlapping rectangles is fine
    with pytest.raises(ValueError, match="overlap inside tensor 5"):
        sx.unpack_average_(t, segments, buffer, [1.0, 1.0])
    ok, n = sx.segment_table([(0, 0, 2, 0, 7)])
    with pytest.raises(ValueError, match="scales must be"):
        sx.unpack_average_(t, ok, torch.zeros(n), [1.0, 2.0])
    with pytest.raises(ValueError, match="not finite"):
        sx.unpack_average_(t, ok, torch.zeros(n), [float("nan")])

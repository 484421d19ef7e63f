"""pack_segments / unpack_average_ against subnet_ext.reference.

Reference implementations: `subnet_ext.reference.pack_segments` and `unpack_average_`
(a Python loop over rectangles of the 2-D views).
"""
import pytest
import torch

import subnet_ext as sx
from gpu_marks import needs_cuda, needs_two_gpus
from subnet_ext import reference as ref
from subnet_ext.ops import PreparedSegments
from subnet_ext.testing import DEVICES, DTYPES, kernel_path_count

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


# ---- unpack_average_: writes must not share memory (by address, not by tensor index) ----


def _unpack(tensors, rects, buffer=None):
    segments, n = sx.segment_table(rects)
    if buffer is None:
        buffer = torch.randn(n)
    sx.unpack_average_(tensors, segments, buffer, [0.5] * len(rects))
    return segments, buffer


def test_unpack_same_tensor_listed_twice_overlapping_is_refused():
    t = torch.zeros(10, 8)
    with pytest.raises(ValueError, match=r"segments 0 and 1 write the same memory.*tensors 0 and 1 share storage"):
        _unpack([t, t], [(0, 0, 4, 0, 8), (1, 3, 6, 2, 5)])


def test_unpack_same_tensor_listed_twice_disjoint_is_fine():
    t = torch.zeros(10, 8)
    want = [torch.zeros(10, 8)]
    segments, buffer = _unpack([t, t], [(0, 0, 4, 0, 8), (1, 4, 6, 2, 5)])
    ref.unpack_average_(want * 2, segments, buffer, [0.5, 0.5])
    torch.testing.assert_close(t, want[0], rtol=0, atol=0)


def test_unpack_overlapping_views_of_one_storage_are_refused():
    base = torch.zeros(10, 8)
    a, b = base[0:6], base[4:10]  # rows 4 and 5 of base are in both
    with pytest.raises(ValueError, match="write the same memory"):
        _unpack([a, b], [(0, 4, 5, 0, 8), (1, 0, 1, 3, 4)])
    # Views with different row widths over one flat storage: equal indices need not meet,
    # different indices can.
    flat = torch.zeros(100)
    wide, narrow = flat[:80].view(10, 8), flat[3:39].view(6, 6)  # narrow[0, 5] is flat[8] == wide[1, 0]
    with pytest.raises(ValueError, match="write the same memory"):
        _unpack([wide, narrow], [(0, 1, 2, 0, 1), (1, 0, 1, 5, 6)])


def test_unpack_disjoint_views_of_one_storage_are_fine():
    base = torch.zeros(10, 8)
    a, b = base[0:6], base[4:10]
    got = _unpack([a, b], [(0, 0, 4, 0, 8), (1, 2, 6, 1, 7)])
    want_base = torch.zeros(10, 8)
    ref.unpack_average_([want_base[0:6], want_base[4:10]], got[0], got[1], [0.5, 0.5])
    torch.testing.assert_close(base, want_base, rtol=0, atol=0)
    flat = torch.zeros(100)
    wide, narrow = flat[:80].view(10, 8), flat[3:39].view(6, 6)
    _unpack([wide, narrow], [(0, 1, 2, 0, 8), (1, 0, 1, 0, 5)])  # flat[8:16] and flat[3:8]


def test_unpack_into_a_view_of_the_buffer_is_refused():
    buffer = torch.randn(100)
    inside = buffer[50:70].view(4, 5)
    segments, n = sx.segment_table([(0, 0, 2, 0, 5)])
    with pytest.raises(ValueError, match="segment 0 .*aliases the buffer"):
        sx.unpack_average_([inside], segments, buffer, [1.0])
    # pack reads such a tensor: still allowed (nothing written to the tensors)
    sx.pack_segments([inside.clone()], segments, buffer)


# ---- prepared segment tables: validated once, reused, never stale ----


def _builds():
    return torch.ops.subnet_ext.segment_table_builds()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prepared_segments_match_plain_calls(device, dtype):
    tensors = make_tensors(device, dtype, seed=2)
    segments, n = sx.segment_table(random_rectangles(tensors, seed=2, per_tensor=3), start=3)
    scales = torch.rand(len(segments), dtype=torch.float64) + 0.1
    buffer = torch.full((n + 2,), 9.0, device=device, dtype=dtype)
    plain = sx.pack_segments(tensors, segments, buffer.clone())
    prepared = PreparedSegments(tensors, segments, buffer, scales)
    sx.pack_segments(tensors, prepared, buffer)
    torch.testing.assert_close(buffer, plain, rtol=0, atol=0)
    incoming = torch.randn(n + 2).to(device, dtype)
    want = [t.clone() for t in tensors]
    sx.unpack_average_(want, segments, incoming, scales)
    buffer.copy_(incoming)
    sx.unpack_average_(tensors, prepared, buffer)
    for g, w in zip(tensors, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_prepared_segments_validate_once():
    tensors = make_tensors("cpu", torch.float32)
    segments, n = sx.segment_table(random_rectangles(tensors))
    buffer = torch.zeros(n)
    before = _builds()
    prepared = PreparedSegments(tensors, segments, buffer, [0.5] * len(segments))
    assert _builds() == before + 1
    for _ in range(3):
        sx.pack_segments(tensors, prepared, buffer)
        sx.unpack_average_(tensors, prepared, buffer)
    assert _builds() == before + 1, "the prepared path validated the table again"
    assert prepared.preparations == 1
    host_table = prepared.host_table
    sx.pack_segments(tensors, prepared, buffer)
    assert prepared.host_table is host_table, "the prepared table was rebuilt"
    sx.pack_segments(tensors, segments, buffer)  # the plain path validates every call
    sx.pack_segments(tensors, segments, buffer)
    assert _builds() == before + 3


def test_prepared_segments_changed_table_is_not_served_stale():
    tensors = make_tensors("cpu", torch.float32)
    segments, n = sx.segment_table([(0, 0, 5, 0, 7), (5, 10, 20, 0, 257)])
    buffer = torch.zeros(n)
    prepared = PreparedSegments(tensors, segments, buffer, torch.tensor([1.0, 1.0], dtype=torch.float64))
    sx.pack_segments(tensors, prepared, buffer)
    torch.testing.assert_close(buffer, ref.pack_segments(tensors, segments, torch.zeros(n)), rtol=0, atol=0)
    before = _builds()
    segments[0, 1:3] = torch.tensor([6, 11])  # in place: rows [6, 11) of tensor 0 now
    buffer.zero_()
    sx.pack_segments(tensors, prepared, buffer)
    assert prepared.preparations == 2 and _builds() == before + 1
    torch.testing.assert_close(buffer, ref.pack_segments(tensors, segments, torch.zeros(n)), rtol=0, atol=0)
    prepared.scales.fill_(0.25)  # changed scales are noticed too
    want = [t.clone() for t in tensors]
    ref.unpack_average_(want, segments, buffer, [0.25, 0.25])
    sx.unpack_average_(tensors, prepared, buffer)
    assert prepared.preparations == 3
    for g, w in zip(tensors, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_prepared_segments_refuse_other_tensors_or_buffer():
    tensors = make_tensors("cpu", torch.float32)
    segments, n = sx.segment_table([(0, 0, 5, 0, 7), (1, 0, 40, 0, 1)])
    buffer = torch.zeros(n)
    pack_only = PreparedSegments(tensors, segments, buffer)
    with pytest.raises(ValueError, match="tensor 1 .*is not the tensor the table was prepared for"):
        sx.pack_segments([tensors[0], tensors[1].clone()] + tensors[2:], pack_only, buffer)
    with pytest.raises(ValueError, match="is not the buffer the table was prepared for"):
        sx.pack_segments(tensors, pack_only, torch.zeros(n))
    with pytest.raises(ValueError, match="tensors given but the table was prepared for"):
        sx.pack_segments(tensors[:3], pack_only, buffer)
    with pytest.raises(ValueError, match="prepared without scales"):
        sx.unpack_average_(tensors, pack_only, buffer)
    with pytest.raises(ValueError, match="prepared without scales"):
        torch.ops.subnet_ext.unpack_average_prepared_(tensors, pack_only.host_table, pack_only.device_table, buffer)
    with_scales = PreparedSegments(tensors, segments, buffer, [1.0, 1.0])
    with pytest.raises(ValueError, match="scales are part of the PreparedSegments"):
        sx.unpack_average_(tensors, with_scales, buffer, [1.0, 1.0])
    with pytest.raises(ValueError, match="not a table prepare_segments returned"):
        torch.ops.subnet_ext.pack_segments_prepared(tensors, torch.zeros(200, dtype=torch.uint8),
                                                    pack_only.device_table, buffer)
    # preparing validates like the plain ops (including the memory overlap of unpack)
    t = torch.zeros(10, 8)
    overlap, m = sx.segment_table([(0, 0, 4, 0, 8), (1, 3, 6, 2, 5)])
    with pytest.raises(ValueError, match="write the same memory"):
        PreparedSegments([t, t], overlap, torch.zeros(m), [1.0, 1.0])
    PreparedSegments([t, t], overlap, torch.zeros(m))  # pack only: reading overlaps is fine


def test_prepared_ops_fake_kernels():
    """opcheck runs ops on copies of their arguments, which a table bound to data pointers
    refuses by design; the fake kernels are checked under FakeTensorMode instead."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    tensors = make_tensors("cpu", torch.float32)
    segments, n = sx.segment_table(random_rectangles(tensors))
    buffer = torch.zeros(n)
    scales = torch.full((len(segments),), 0.5, dtype=torch.float64)
    host, device = torch.ops.subnet_ext.prepare_segments(tensors, segments, buffer, scales)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fake = lambda t: mode.from_tensor(t)  # noqa: E731
    with mode:
        fake_tensors = [fake(t) for t in tensors]
        fake_host, fake_device = torch.ops.subnet_ext.prepare_segments(fake_tensors, fake(segments), fake(buffer),
                                                                       fake(scales))
        assert fake_host.dtype == torch.uint8 and fake_host.device == host.device
        assert fake_device.dtype == torch.uint8 and fake_device.device == device.device
        assert torch.ops.subnet_ext.pack_segments_prepared(fake_tensors, fake(host), fake(device), fake(buffer)) is None
        assert torch.ops.subnet_ext.unpack_average_prepared_(fake_tensors, fake(host), fake(device),
                                                             fake(buffer)) is None


# ---- CUDA: vector paths, partial widths, multi-chunk segments, opcheck, second device ----

def _round_trip_exact(tensors, rects, start=0, scale=0.5):
    """pack == reference exactly; unpack with `scale` == reference exactly."""
    segments, n = sx.segment_table(rects, start=start)
    device, dtype = tensors[0].device, tensors[0].dtype
    buffer = torch.full((n + 5,), 3.0, device=device, dtype=dtype)
    want = ref.pack_segments(tensors, segments, buffer.clone())
    sx.pack_segments(tensors, segments, buffer)
    torch.testing.assert_close(buffer, want, rtol=0, atol=0)
    incoming = torch.randn(n + 5, device=device).to(dtype)
    got = [t.clone() for t in tensors]
    expected = [t.clone() for t in tensors]
    sx.unpack_average_(got, segments, incoming, [scale] * len(rects))
    ref.unpack_average_(expected, segments, incoming, [scale] * len(rects))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.float32])
def test_cuda_vector_paths(dtype):
    """16-byte aligned tensors, buffer offsets and column ranges: the vectorised path, and
    it is the path that ran (testing.kernel_path_count: every segment of the pack's and of
    the unpack's work table moved in vectors); misaligned buffer offsets: the element path."""
    lanes = 16 // torch.empty(0, dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(11)
    tensors = [torch.randn(64, 8 * lanes, generator=gen).to("cuda", dtype),
               torch.randn(33, 4 * lanes, generator=gen).to("cuda", dtype),
               torch.randn(1000, 2 * lanes, generator=gen).to("cuda", dtype)]
    assert all(t.data_ptr() % 16 == 0 for t in tensors)
    rects = [(0, 3, 60, 2 * lanes, 6 * lanes),   # partial width, vector-aligned columns
             (1, 0, 33, 0, 4 * lanes),           # whole rows: one run
             (2, 100, 1000, 0, 2 * lanes)]
    for start, path in ((lanes, "segments_vector"), (1, "segments_elements")):  # aligned, then misaligned offsets
        before = {p: kernel_path_count(p) for p in ("segments_vector", "segments_elements")}
        _round_trip_exact(tensors, rects, start=start)
        ran = {p: kernel_path_count(p) - n for p, n in before.items()}
        assert ran == {p: 2 * len(rects) if p == path else 0 for p in before}, (start, ran)


@needs_cuda
def test_cuda_pack_and_unpack_on_a_side_stream():
    """Every launch (and the work table's upload) on the current stream: the side stream sleeps,
    then writes the tensors over their NaN fill, packs, and unpacks another buffer; a launch or
    upload on another stream would run during the sleep and move NaN or a stale table."""
    gen = torch.Generator().manual_seed(14)
    sources = [torch.randn(512, 64, generator=gen).cuda(), torch.randn(300, 37, generator=gen).cuda()]
    tensors = [torch.full_like(t, float("nan")) for t in sources]
    rects = [(0, 0, 512, 0, 64), (1, 3, 290, 1, 30)]
    segments, n = sx.segment_table(rects)
    buffer = torch.full((n,), float("nan"), device="cuda")
    incoming_src = torch.randn(n, generator=gen).cuda()
    incoming = torch.full_like(incoming_src, float("nan"))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds
        for dst, src in zip(tensors, sources):
            dst.copy_(src)
        incoming.copy_(incoming_src)
        sx.pack_segments(tensors, segments, buffer)
        sx.unpack_average_(tensors, segments, incoming, [0.5, 0.25])
    side.synchronize()
    torch.testing.assert_close(buffer, ref.pack_segments(sources, segments, torch.zeros(n, device="cuda")),
                               rtol=0, atol=0)
    expected = [t.clone() for t in sources]
    ref.unpack_average_(expected, segments, incoming_src, [0.5, 0.25])
    for got, want in zip(tensors, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_partial_width_rectangles(dtype):
    gen = torch.Generator().manual_seed(12)
    tensors = [torch.randn(50, 37, generator=gen).to("cuda", dtype),
               torch.randn(9, 4, 5, generator=gen).to("cuda", dtype),
               torch.randn(128, 64, generator=gen).to("cuda", dtype)]
    rects = [(0, 1, 49, 3, 30), (1, 2, 7, 1, 19), (2, 0, 128, 1, 63), (0, 49, 50, 0, 37)]
    _round_trip_exact(tensors, rects, start=7)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_segments_spanning_many_chunks(dtype):
    """Segments of several 64 KiB chunks, next to tiny ones, whole-row and partial."""
    gen = torch.Generator().manual_seed(13)
    tensors = [torch.randn(2000, 301, generator=gen).to("cuda", dtype),
               torch.randn(3, generator=gen).to("cuda", dtype),
               torch.randn(4096, 256, generator=gen).to("cuda", dtype)]
    rects = [(0, 0, 2000, 5, 290), (1, 0, 3, 0, 1), (2, 0, 4096, 0, 256), (0, 0, 0, 0, 301)]
    _round_trip_exact(tensors, rects, start=0)
    _round_trip_exact(tensors, rects, start=3, scale=1 / 3)


@needs_cuda
def test_cuda_opcheck():
    tensors = make_tensors("cuda", torch.float32)
    segments, n = sx.segment_table(random_rectangles(tensors))
    buffer = torch.zeros(n, device="cuda")
    torch.library.opcheck(torch.ops.subnet_ext.pack_segments.default, (tensors, segments, buffer))
    scales = torch.full((len(segments),), 0.5, dtype=torch.float64)
    torch.library.opcheck(torch.ops.subnet_ext.unpack_average_.default, (tensors, segments, buffer, scales))
    # (the prepared ops bind data pointers and refuse opcheck's copies: see test_prepared_ops_fake_kernels)


@needs_cuda
def test_cuda_prepared_calls_never_synchronise():
    tensors = make_tensors("cuda", torch.float32)
    segments, n = sx.segment_table(random_rectangles(tensors, per_tensor=3))
    buffer = torch.zeros(n, device="cuda")
    prepared = PreparedSegments(tensors, segments, buffer, [0.5] * len(segments))
    want = ref.pack_segments(tensors, segments, torch.zeros(n, device="cuda"))
    expected = [t.clone() for t in tensors]
    ref.unpack_average_(expected, segments, want, [0.5] * len(segments))
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sx.pack_segments(tensors, prepared, buffer)
        sx.unpack_average_(tensors, prepared, buffer)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.testing.assert_close(buffer, want, rtol=0, atol=0)
    for g, e in zip(tensors, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@needs_two_gpus
def test_cuda_second_device():
    """Operands on cuda:1 while cuda:0 is current: launches and tables on the operands' device."""
    tensors = make_tensors("cuda:1", torch.float32)
    segments, n = sx.segment_table(random_rectangles(tensors, per_tensor=3))
    with torch.cuda.device(0):
        buffer = sx.pack_segments(tensors, segments)
        assert buffer.device == torch.device("cuda:1")
        torch.testing.assert_close(buffer, ref.pack_segments(tensors, segments), rtol=0, atol=0)
        got, want = [t.clone() for t in tensors], [t.clone() for t in tensors]
        sx.unpack_average_(got, segments, buffer, [0.25] * len(segments))
        ref.unpack_average_(want, segments, buffer, [0.25] * len(segments))
        prepared = PreparedSegments(tensors, segments, buffer)
        again = torch.zeros_like(buffer)
        prepared_again = PreparedSegments(tensors, segments, again)
        sx.pack_segments(tensors, prepared_again, again)
        del prepared
    torch.cuda.synchronize(1)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch.testing.assert_close(again, buffer, rtol=0, atol=0)

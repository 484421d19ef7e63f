"""Layout and lifetime details of the packed paths.

- The backward regime's refresh lays its pieces out at 16-byte aligned offsets, as the
  buckets do, so the packing kernels' vector path applies to every segment (not only to
  those before the first piece of an odd size); `segment_table(align=)` is that layout.
- GPU: a prepared table used on a side stream and then dropped keeps its memory until
  that stream's work is done (record_stream): without it the allocator hands the block
  to the next allocation of the same size on the default stream, whose write lands
  before the delayed pack reads its table.
"""
import torch

import subnet_ext as sx
from gpu_marks import needs_cuda
from sdp_helpers import CLASSES, IN
from subnet_ext.models import ResidualMLP
from subnet_ext.ops import PreparedSegments


def test_segment_table_aligns_every_rectangle():
    rects = [(0, 0, 1, 0, 3), (1, 0, 2, 0, 5), (0, 1, 2, 0, 3), (2, 0, 1, 0, 4)]  # 3, 10, 3, 4 elements
    table, end = sx.segment_table(rects, start=1, align=4)
    assert table[:, 5].tolist() == [4, 8, 20, 24] and end == 28  # each offset rounded up to a multiple of 4
    plain, plain_end = sx.segment_table(rects, start=1)
    assert plain[:, 5].tolist() == [1, 4, 14, 17] and plain_end == 21


def test_refresh_pieces_start_at_16_byte_offsets():
    torch.manual_seed(0)
    model = ResidualMLP(in_features=IN, num_classes=CLASSES, width=16, depth=2, hidden=30)  # runs of 15 neurons
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, 4, 0.5, "neuron"), regime="backward",
                                simulate_rank=1)
    broadcasts = sdp.refresh.broadcasts
    assert broadcasts
    sizes = set()
    for _, pieces, table, _, _, total in broadcasts:
        elem = sdp.refresh.places[pieces[0]].tensor.element_size()
        assert all(off * elem % 16 == 0 for off in table[:, 5].tolist()), table
        counts = ((table[:, 2] - table[:, 1]) * (table[:, 4] - table[:, 3])).tolist()
        sizes.update(c * elem % 16 for c in counts)
        assert total == table[-1, 5].item() + counts[-1]
    assert sizes - {0}, "some piece has an odd size (else alignment would be trivial)"


@needs_cuda
def test_prepared_table_dropped_while_a_side_stream_uses_it():
    tensors = [torch.randn(1000, 64, device="cuda") for _ in range(3)]
    table, total = sx.segment_table([(i, 0, 1000, 0, 64) for i in range(3)])
    buffer = torch.full((total,), float("nan"), device="cuda")
    prepared = PreparedSegments(tensors, table, buffer)
    table_bytes = prepared.device_table.numel()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # tens of milliseconds: the pack below runs late
        sx.pack_segments(tensors, prepared, buffer)
    del prepared  # the table's device memory goes back to the allocator
    # Same size, default stream: without record_stream this gets the table's block and
    # zeroes it (an all-zero table moves nothing) before the side stream reads it.
    reused = torch.zeros(table_bytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    assert torch.equal(buffer, torch.cat([t.reshape(-1) for t in tensors]))
    del reused

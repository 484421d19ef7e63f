"""Bucket layout: every piece at a 16-byte aligned buffer offset, gaps never overlapping data.

The engine's averaged results with these padded buckets are checked against one-process
references in tests/engine/test_engine_distributed.py.
"""
import pytest
import torch

import subnet_ext as sx
from subnet_ext.models import ResidualMLP
from subnet_ext.planning.buckets import PIECE_ALIGN_BYTES, build_buckets, piece_numel
from subnet_ext.planning.pieces import global_pieces


def odd_plan(dtype, level):
    # in_features 7 and width 9: rows/columns of 7 and 9 elements, not multiples of 16 bytes
    # in any dtype, so without alignment every piece after the first odd one is misaligned.
    torch.manual_seed(0)
    model = ResidualMLP(in_features=7, num_classes=3, width=9, depth=3, hidden=11).to(dtype)
    return sx.plan_subnetworks(model, 4, 0.5, level)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("level", ["block", "neuron"])
@pytest.mark.parametrize("strategy", ["groups", "zero_filled"])
def test_piece_offsets_are_16_byte_aligned(dtype, level, strategy):
    plan = odd_plan(dtype, level)
    buckets = build_buckets(plan, global_pieces(plan), strategy, cap_bytes=64.0)
    size = torch.empty((), dtype=dtype).element_size()
    sizes = [piece_numel(plan, p) for b in buckets for p in b.pieces]
    # The case the alignment is for: some piece whose byte size is not a multiple of 16.
    assert any(n * size % PIECE_ALIGN_BYTES for n in sizes), sizes
    gaps = 0
    for b in buckets:
        assert len(b.offsets) == len(b.pieces) and b.offsets[0] == 0
        ends = [off + piece_numel(plan, p) for p, off in zip(b.pieces, b.offsets)]
        for off in b.offsets:
            assert off * size % PIECE_ALIGN_BYTES == 0, (b.offsets, size)
        # Pieces in order, never overlapping, each gap shorter than one alignment step.
        for end, nxt in zip(ends, b.offsets[1:]):
            assert end <= nxt and (nxt - end) * size < PIECE_ALIGN_BYTES, (end, nxt)
            gaps += nxt - end
        assert b.numel == ends[-1] and b.nbytes == b.numel * size
    # numel = data + gaps: the count the cost model and the communicator both report.
    assert sum(b.numel for b in buckets) == sum(sizes) + gaps and gaps > 0

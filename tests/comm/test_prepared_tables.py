"""comm/prepared.py: a segment table is validated once per layout and prepared again only
when the tensors move or the table is another one (never served stale)."""
import torch

import subnet_ext as sx
from subnet_ext.comm.prepared import PreparedTables


def test_prepared_once_then_again_only_when_storage_or_table_changes():
    tensors = [torch.arange(12.0).view(3, 4), torch.arange(5.0)]
    table, total = sx.segment_table([(0, 1, 3, 0, 4), (1, 0, 5, 0, 1)])
    buffer = torch.zeros(total)
    cache = PreparedTables()
    first = cache.get("pack", tensors, table, buffer)
    assert cache.get("pack", tensors, table, buffer) is first and cache.preparations == 1
    sx.pack_segments(tensors, first, buffer)
    assert torch.equal(buffer, torch.cat([tensors[0][1:].reshape(-1), tensors[1]]))  # what the rectangles hold

    other_table = table.clone()  # same values, another table object: prepared again, not assumed equal
    assert cache.get("pack", tensors, other_table, buffer) is not first and cache.preparations == 2

    moved = [tensors[0].clone(), tensors[1]]  # a tensor at another address (a gradient allocated again)
    again = cache.get("pack", moved, other_table, buffer)
    assert cache.preparations == 3
    moved[0].mul_(2)
    sx.pack_segments(moved, again, buffer)
    assert torch.equal(buffer[:8], 2 * tensors[0][1:].reshape(-1))

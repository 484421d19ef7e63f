"""Segment tables and the segment-packing ops (csrc/pack_segments.cpp).

Packed segments: every tensor is viewed 2-D as [size(0), numel // size(0)] (a 1-D tensor
[n] as [n, 1], a scalar as [1, 1]); a segment is a rectangle of one tensor, stored
row-major in a 1-D buffer. `segments` is an int64 CPU tensor [S, 6] with columns
(tensor_index, row_begin, row_end, col_begin, col_end, buffer_offset).

`segment_table` builds such a table (pure Python); `PreparedSegments` is a table validated
once by the library for fixed tensors and buffer; `pack_segments` / `unpack_average_` run
the kernels.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import registration  # noqa: F401  (loads the library; the ops' fake kernels)

_ops = torch.ops.subnet_ext


def segment_table(rectangles: Sequence[Sequence[int]], start: int = 0, align: int = 1):
    """Segments for consecutive rectangles in a buffer.

    Args:
        rectangles: (tensor_index, row_begin, row_end, col_begin, col_end) each.
        start: buffer offset of the first rectangle.
        align: each rectangle starts at a multiple of this many elements (16 bytes //
            element size: the packing kernels' vector path); the gaps are never written.
    Returns:
        (segments int64 CPU [S, 6], end offset = where the last rectangle ends).
    """
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"segment_table: align must be an int >= 1 (elements), got {align!r}")
    rows = []
    offset = int(start)
    for rect in rectangles:
        if len(rect) != 5:
            raise ValueError(f"segment_table: a rectangle has 5 entries, got {tuple(rect)!r}")
        t, r0, r1, c0, c1 = (int(v) for v in rect)
        if r1 < r0 or c1 < c0:
            raise ValueError(f"segment_table: rectangle {tuple(rect)!r} has a negative extent")
        offset = -(-offset // align) * align
        rows.append((t, r0, r1, c0, c1, offset))
        offset += (r1 - r0) * (c1 - c0)
    table = torch.tensor(rows, dtype=torch.int64) if rows else torch.empty(0, 6, dtype=torch.int64)
    return table, offset


def _buffer_size(segments: torch.Tensor) -> int:
    if segments.numel() == 0:
        return 0
    sizes = (segments[:, 2] - segments[:, 1]) * (segments[:, 4] - segments[:, 3])
    return int((segments[:, 5] + sizes).max())


def _scales_tensor(scales) -> torch.Tensor:
    if isinstance(scales, torch.Tensor):
        return scales
    return torch.tensor([float(s) for s in scales], dtype=torch.float64)


class PreparedSegments:
    """A segment table validated once for fixed tensors and buffer, reused by every call.

    Pass it in place of `segments` to `pack_segments` / `unpack_average_`: the calls then
    skip the validation (sorting, overlap checks) and, on CUDA, the per-call table upload
    (no host-to-device copy, so a prepared call can be captured in a CUDA graph). Each call
    only checks on the host, in O(#tensors) and without a device sync, that it is given the
    tensors and buffer the table was prepared for (same addresses, shapes, dtype); other
    tensors or another buffer raise ValueError: prepare again for them.

    Changing `segments` (or a `scales` tensor) in place is noticed through the tensor's
    version counter and the table is prepared again at the next call, never served stale.

    Args:
        tensors: contiguous tensors of one dtype and device (as in `pack_segments`).
        segments: int64 CPU [S, 6] (see module docstring).
        buffer: the 1-D buffer every call will use.
        scales: None → the table serves `pack_segments` only; float CPU [S] or S floats →
            it also serves `unpack_average_` (validated for disjoint writes once).
    Attributes:
        preparations: how many times the table was validated (1 unless it changed).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], segments: torch.Tensor, buffer: torch.Tensor, scales=None):
        self.segments = segments
        self.scales = None if scales is None else _scales_tensor(scales)
        self.preparations = 0
        self._prepare(tensors, buffer)

    def _versions(self):
        return self.segments._version, None if self.scales is None else self.scales._version

    def _prepare(self, tensors, buffer):
        self.host_table, self.device_table = _ops.prepare_segments.default(
            list(tensors), self.segments, buffer, self.scales
        )
        self._prepared_versions = self._versions()
        self.preparations += 1

    def tables(self, tensors: Sequence[torch.Tensor], buffer: torch.Tensor):
        """(host_table, device_table) for the prepared ops, prepared again if the table changed."""
        if self._versions() != self._prepared_versions:
            self._prepare(tensors, buffer)
        return self.host_table, self.device_table


def pack_segments(
    tensors: Sequence[torch.Tensor], segments, buffer: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Gathers the rectangles of many tensors into one buffer (one launch on CUDA).

    Args:
        tensors: contiguous tensors of one dtype and device.
        segments: int64 CPU [S, 6] (see module docstring), or a `PreparedSegments` for
            these tensors and this buffer (validated once, no per-call upload).
        buffer: 1-D destination; when None a zero buffer just large enough is made
            (required with a PreparedSegments).
    Returns:
        the buffer. Elements outside every segment are left as they were.
    """
    tensors = list(tensors)
    if isinstance(segments, PreparedSegments):
        if buffer is None:
            raise ValueError("pack_segments: a PreparedSegments needs the buffer it was prepared for, got None")
        host_table, device_table = segments.tables(tensors, buffer)
        _ops.pack_segments_prepared.default(tensors, host_table, device_table, buffer)
        return buffer
    if buffer is None:
        if not tensors:
            raise ValueError("pack_segments: no tensors and no buffer given")
        buffer = tensors[0].new_zeros(_buffer_size(segments))
    _ops.pack_segments.default(tensors, segments, buffer)
    return buffer


def unpack_average_(
    tensors: Sequence[torch.Tensor], segments, buffer: torch.Tensor, scales=None
) -> None:
    """tensor[rectangle s] = buffer[segment s] * scales[s], in place (fp32 math for halves).

    Args:
        tensors, segments, buffer: as in `pack_segments`; no two rectangles may share
            memory (even across tensors that are views of one storage), and no tensor may
            share memory with the buffer.
        scales: float CPU tensor [S] or a sequence of S floats (typically 1/owner-count).
            Omitted with a PreparedSegments: its own scales are used.
    """
    tensors = list(tensors)
    if isinstance(segments, PreparedSegments):
        if scales is not None:
            raise ValueError("unpack_average_: scales are part of the PreparedSegments; pass scales=None "
                             "(or prepare a new table with the new scales)")
        if segments.scales is None:
            raise ValueError("unpack_average_: the PreparedSegments was prepared without scales (pack only); "
                             "prepare it with scales to unpack")
        host_table, device_table = segments.tables(tensors, buffer)
        _ops.unpack_average_prepared_.default(tensors, host_table, device_table, buffer)
        return
    if scales is None:
        raise ValueError("unpack_average_: scales are required with a plain segment table")
    _ops.unpack_average_.default(tensors, segments, buffer, _scales_tensor(scales))

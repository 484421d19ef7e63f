"""Windows of a character (or byte) corpus held as one uint8 tensor: random windows for
training, evenly spaced ones for a quick held-out set, and every window of a split for an
evaluation that reads all of it."""
from __future__ import annotations

import torch


class CharWindows:
    """Windows of seq_len + 1 characters of one split: inputs [B, T] and the next characters [B, T].

    Raises:
        ValueError: the split is shorter than seq_len + 1 characters, or seq_len < 1.
    """

    def __init__(self, chars: torch.Tensor, seq_len: int):
        if seq_len < 1 or chars.numel() < seq_len + 1:
            raise ValueError(f"CharWindows needs seq_len >= 1 and at least seq_len + 1 characters; got seq_len "
                             f"{seq_len} and {chars.numel()} characters")
        self.chars, self.seq_len = chars, seq_len

    def _rows(self, starts: torch.Tensor):
        offsets = torch.arange(self.seq_len + 1)
        seq = self.chars[starts[:, None] + offsets[None, :]].long()
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def batch(self, batch_size: int, generator: torch.Generator):
        """batch_size windows at random starts drawn from `generator`: (inputs int64 [B, T], targets int64 [B, T])."""
        starts = torch.randint(0, self.chars.numel() - self.seq_len, (batch_size,), generator=generator)
        return self._rows(starts)

    def evenly_spaced(self, count: int):
        """`count` windows at evenly spaced starts over the whole split (a fixed evaluation set, no RNG):
        (inputs int64 [count, T], targets int64 [count, T])."""
        if count < 1:
            raise ValueError(f"evenly_spaced needs count >= 1, got {count}")
        last = self.chars.numel() - self.seq_len - 1
        return self._rows(torch.linspace(0, last, count).round().long())

    def every_window(self):
        """The split cut into consecutive windows, each predicting its next T characters: every
        character but the first is a target exactly once, up to the last (n - 1) mod T left over.
        (inputs int64 [W, T], targets int64 [W, T]), W = (n - 1) // T."""
        count = (self.chars.numel() - 1) // self.seq_len
        return self._rows(torch.arange(count) * self.seq_len)

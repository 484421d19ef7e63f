"""Token streams: a synthetic Markov source with a known entropy rate, and flat uint16
.bin files (the nanoGPT layout)."""
from __future__ import annotations

import os

import numpy as np
import torch


class SyntheticTokens:
    """A stationary first-order Markov chain: each token has `branching` successors drawn
    once from the seed, with fixed probabilities p. The entropy rate is exactly H(p), so a
    language model's loss has a known floor.

    batch(batch_size, generator) -> (inputs int64 [B, T], targets int64 [B, T]).
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, branching: int = 4):
        if vocab_size < 2 or seq_len < 1 or not 1 <= branching <= vocab_size:
            raise ValueError(f"SyntheticTokens needs vocab_size >= 2, seq_len >= 1, 1 <= branching <= vocab_size; "
                             f"got {vocab_size}, {seq_len}, {branching}")
        self.vocab_size, self.seq_len = vocab_size, seq_len
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.stack([torch.randperm(vocab_size, generator=g)[:branching]
                                       for _ in range(vocab_size)])
        weights = torch.tensor([2.0 ** -i for i in range(branching)], dtype=torch.float64)
        self.probs = weights / weights.sum()
        self.entropy_rate_nats = float(-(self.probs * self.probs.log()).sum())

    def batch(self, batch_size: int, generator: torch.Generator):
        """batch_size random sequences of the Markov chain: (inputs int64 [B, T], targets int64 [B, T]),
        targets being inputs shifted by one token; T = seq_len."""
        t = self.seq_len + 1
        seq = torch.empty(batch_size, t, dtype=torch.int64)
        seq[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=generator)
        choice = torch.multinomial(self.probs.float().expand(batch_size * (t - 1), -1), 1, replacement=True,
                                   generator=generator).view(batch_size, t - 1)
        for i in range(1, t):
            seq[:, i] = self.successors[seq[:, i - 1], choice[:, i - 1]]
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class TokenFileDataset:
    """Random windows of a flat uint16 token file.

    Raises:
        FileNotFoundError: no file at path.
        ValueError: odd byte size, fewer than seq_len + 1 tokens, or a token >= vocab_size.
    """

    def __init__(self, path: str, seq_len: int, vocab_size: int):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"token file {path!r} does not exist (expected a flat uint16 .bin file)")
        size = os.path.getsize(path)
        if size % 2:
            raise ValueError(f"token file {path!r} has {size} bytes, not a whole number of uint16 tokens")
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        if len(self.tokens) < seq_len + 1:
            raise ValueError(f"token file {path!r} has {len(self.tokens)} tokens; seq_len {seq_len} needs at least "
                             f"{seq_len + 1}")
        top = max(int(self.tokens[i:i + (1 << 24)].max()) for i in range(0, len(self.tokens), 1 << 24))
        if top >= vocab_size:
            raise ValueError(f"token file {path!r} holds token id {top}, outside the model's vocabulary of "
                             f"{vocab_size}")
        self.seq_len = seq_len

    def batch(self, batch_size: int, generator: torch.Generator):
        """batch_size random windows of seq_len + 1 tokens: (inputs int64 [B, T], targets int64 [B, T]),
        targets being inputs shifted by one token; T = seq_len."""
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (batch_size,), generator=generator)
        rows = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64) for s in starts.tolist()])
        seq = torch.from_numpy(rows)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()



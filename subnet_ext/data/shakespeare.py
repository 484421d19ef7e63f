"""Tiny Shakespeare as nanoGPT's character benchmark (`data/shakespeare_char/prepare.py`).

The corpus is karpathy/char-rnn's `tinyshakespeare/input.txt`: 1,115,394 characters of
Shakespeare's plays. nanoGPT's benchmark uses its sorted set of characters as the
vocabulary (65), the first 90% of the text for training (1,003,854 characters) and the
last 10% for validation (111,540). Nothing is downloaded: the caller passes the file's
path (the command line reads `--data shakespeare:PATH`, or the SUBNET_EXT_TINY_SHAKESPEARE
environment variable), and the file is checked against its published SHA-256 so a report
can say which text it trained on.

nanoGPT's README quotes a CPU recipe on it (4 layers x 128, 4 heads, context 64, 12
sequences per iteration, 2,000 iterations, learning rate 1e-3 with 100 warmup iterations
and cosine decay to 1e-4, AdamW betas (0.9, 0.99), weight decay 0.1, clipping 1.0) that
reaches a validation loss of about 1.88: RECIPE and PUBLISHED_VAL_LOSS below.
"""
from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass

import numpy as np
import torch

SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
CHARACTERS = 1_115_394
VOCAB_SIZE = 65
TRAIN_FRACTION = 0.9
ENVIRONMENT_VARIABLE = "SUBNET_EXT_TINY_SHAKESPEARE"
# nanoGPT's README, CPU quick start (config/train_shakespeare_char.py with its command-line overrides).
RECIPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, max_iters=2000, lr=1e-3, min_lr=1e-4,
              warmup_iters=100, lr_decay_iters=2000, betas=(0.9, 0.99), weight_decay=0.1, grad_clip=1.0,
              dropout=0.0, bias=False)
PUBLISHED_VAL_LOSS = 1.88


@dataclass(frozen=True)
class CharCorpus:
    """A character corpus split as nanoGPT's prepare.py splits it.

    train, val: uint8 token tensors [n_train], [n_val] (ids into `vocab`).
    vocab: the sorted distinct characters of the whole text (id i is vocab[i]).
    sha256: of the file's bytes; path: where it was read.
    """

    train: torch.Tensor
    val: torch.Tensor
    vocab: str
    sha256: str
    path: str

    def encode(self, text: str) -> torch.Tensor:
        """Characters -> int64 ids [len(text)]; ValueError naming a character outside the vocabulary."""
        index = {c: i for i, c in enumerate(self.vocab)}
        missing = sorted(set(text) - set(index))
        if missing:
            raise ValueError(f"characters {missing[:10]!r} are not in the corpus's vocabulary of {len(self.vocab)}")
        return torch.tensor([index[c] for c in text], dtype=torch.int64)

    def decode(self, ids) -> str:
        """ids (a tensor or a sequence of ints) -> the text they stand for."""
        return "".join(self.vocab[int(i)] for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids))

    def describe(self) -> dict:
        """{path, sha256, characters {train, val}, vocab_size}: what a report records of its corpus."""
        return {"path": self.path, "sha256": self.sha256, "vocab_size": len(self.vocab),
                "characters": {"train": int(self.train.numel()), "val": int(self.val.numel())}}


def char_corpus(text: str, path: str = "<text>", sha256: str | None = None) -> CharCorpus:
    """nanoGPT's preparation of any text: the sorted set of its characters as the vocabulary, the
    first 90% for training and the rest for validation (ids as uint8; at most 256 characters).

    Raises:
        ValueError: a text of fewer than 2 characters, or with more than 256 distinct ones.
    """
    if len(text) < 2:
        raise ValueError(f"a character corpus needs at least 2 characters, got {len(text)}")
    vocab = "".join(sorted(set(text)))
    if len(vocab) > 256:
        raise ValueError(f"{path}: {len(vocab)} distinct characters; ids are stored as uint8 (at most 256)")
    table = np.zeros(max(map(ord, vocab)) + 1, dtype=np.uint8)
    table[[ord(c) for c in vocab]] = np.arange(len(vocab), dtype=np.uint8)
    ids = torch.from_numpy(table[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)])
    n_train = int(len(text) * TRAIN_FRACTION)
    digest = sha256 or hashlib.sha256(text.encode()).hexdigest()
    return CharCorpus(ids[:n_train].clone(), ids[n_train:].clone(), vocab, digest, path)


def resolve_path(path: str | None = None) -> str:
    """The Tiny Shakespeare file to read: `path`, else $SUBNET_EXT_TINY_SHAKESPEARE.

    Raises:
        FileNotFoundError: neither names an existing file (the message says what the file is and
            where it comes from).
    """
    chosen = path or os.environ.get(ENVIRONMENT_VARIABLE)
    if not chosen:
        raise FileNotFoundError(
            f"Tiny Shakespeare: no path given and ${ENVIRONMENT_VARIABLE} is not set; pass the path of "
            f"karpathy/char-rnn's tinyshakespeare/input.txt ({CHARACTERS:,} characters, SHA-256 {SHA256})")
    if not os.path.isfile(chosen):
        raise FileNotFoundError(
            f"Tiny Shakespeare: {chosen!r} is not a file; expected karpathy/char-rnn's tinyshakespeare/input.txt "
            f"({CHARACTERS:,} characters, SHA-256 {SHA256})")
    return chosen


@functools.lru_cache(maxsize=2)
def load_tiny_shakespeare(path: str | None = None) -> CharCorpus:
    """Tiny Shakespeare split as nanoGPT's benchmark (module docstring), checked against its SHA-256
    (cached per process: each rank reads the file once).

    Args:
        path: the text file (default: $SUBNET_EXT_TINY_SHAKESPEARE).
    Raises:
        FileNotFoundError: no such file (see resolve_path).
        ValueError: the file's SHA-256 or vocabulary is not Tiny Shakespeare's (another text, or a
            copy changed on the way: line endings, an encoding).
    """
    chosen = resolve_path(path)
    with open(chosen, "rb") as f:
        raw = f.read()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SHA256:
        raise ValueError(f"Tiny Shakespeare: {chosen!r} has SHA-256 {digest} ({len(raw):,} bytes), not {SHA256} "
                         f"({CHARACTERS:,} characters); it is another text or a changed copy (line endings, "
                         "encoding). Use the original tinyshakespeare/input.txt, or char_corpus(text) for another text")
    return char_corpus(raw.decode("utf-8"), chosen, digest)

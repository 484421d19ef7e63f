"""A real character corpus on every machine, without a download: the ASCII source files
of the running Python's standard library.

Corpus: every `*.py` file under `sysconfig.get_paths()["stdlib"]` (walked in sorted
order, `site-packages` and `__pycache__` left out, so installed packages do not change
it) whose bytes are all ASCII; files with any other byte are skipped. Each file goes
whole to one split, chosen from its path relative to the library (the first 8 hex
digits of its SHA-256, modulo 10: 0 -> validation, about 10% of the files), so no
function is seen half in training and half in validation. Files are concatenated
in path order. Tokens are the bytes themselves: a vocabulary of 128 (0..127; the
model's vocab_size must be at least 128). Python 3.11's library gives about 24 MB
of characters in about 1,660 files; other versions give other (similar) corpora, so a
report records `describe()` (version, file and character counts, SHA-256).
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch



VOCAB_SIZE = 128
VALIDATION_MODULUS = 10  # one file in ten (by path hash) is validation


@dataclass(frozen=True)
class PySourceCorpus:
    """The two splits as uint8 token tensors [n_chars] and what they were made from."""

    train: torch.Tensor
    val: torch.Tensor
    train_files: int
    val_files: int
    skipped_files: int
    root: str
    sha256: str

    def describe(self) -> dict:
        """{python, root, files, characters, skipped_non_ascii_files, vocab_size, sha256}: what a report
        records so two runs can tell whether they trained on the same corpus."""
        return {"python": platform.python_version(), "root": self.root,
                "files": {"train": self.train_files, "val": self.val_files},
                "characters": {"train": int(self.train.numel()), "val": int(self.val.numel())},
                "skipped_non_ascii_files": self.skipped_files, "vocab_size": VOCAB_SIZE, "sha256": self.sha256}


def is_validation_file(relative_path: str) -> bool:
    """True for the files of the validation split (by the SHA-256 of the '/'-separated relative path)."""
    digest = hashlib.sha256(relative_path.replace(os.sep, "/").encode()).hexdigest()
    return int(digest[:8], 16) % VALIDATION_MODULUS == 0


def _source_files(root: str) -> list[str]:
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        found += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    return found


@functools.lru_cache(maxsize=2)
def load_pysrc(root: str | None = None) -> PySourceCorpus:
    """The corpus of the module docstring (cached per process: the ranks of a study load it once each).

    Args:
        root: a folder of Python sources (default: this interpreter's standard library).
    Raises:
        FileNotFoundError: root is not a folder.
        ValueError: either split came out empty (too few ASCII .py files under root).
    """
    root = root or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise FileNotFoundError(f"pysrc: {root!r} is not a folder of Python sources")
    parts = {"train": [], "val": []}
    counts = {"train": 0, "val": 0}
    skipped = 0
    digest = hashlib.sha256()
    for path in _source_files(root):
        with open(path, "rb") as f:
            data = f.read()
        if not data.isascii():
            skipped += 1
            continue
        rel = os.path.relpath(path, root)
        split = "val" if is_validation_file(rel) else "train"
        parts[split].append(data)
        counts[split] += 1
        digest.update(rel.replace(os.sep, "/").encode() + b"\0" + data)
    if not counts["train"] or not counts["val"]:
        raise ValueError(f"pysrc: {root!r} holds {counts['train']} training and {counts['val']} validation ASCII .py "
                         "files; both splits need at least one (point root at a larger source tree)")
    tensors = {k: torch.from_numpy(np.frombuffer(b"".join(v), dtype=np.uint8).copy()) for k, v in parts.items()}
    return PySourceCorpus(tensors["train"], tensors["val"], counts["train"], counts["val"], skipped, root,
                          digest.hexdigest())

"""scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes): real data in the package."""
from __future__ import annotations

import numpy as np
import torch


def load_digits_dataset(split: str, seed: int = 0, as_images: bool = False, test_fraction: float = 0.2):
    """(x, y) of a deterministic stratified split.

    Returns:
        x: float32 [n, 64] in [0, 1], or [n, 1, 8, 8] when as_images; y: int64 [n].
    Raises:
        ValueError: split not "train"/"test", or test_fraction outside (0, 1).
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = data.data.astype(np.float32) / 16.0, data.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):  # stratified: the same share of every class in the test set
        idx = rng.permutation(np.flatnonzero(y == c))
        test[idx[: int(round(len(idx) * test_fraction))]] = True
    keep = test if split == "test" else ~test
    xs = torch.from_numpy(x[keep])
    if as_images:
        xs = xs.view(-1, 1, 8, 8)
    return xs, torch.from_numpy(y[keep])

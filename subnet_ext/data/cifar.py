"""CIFAR-10 from a local folder in its standard python-pickle layout (no download)."""
from __future__ import annotations

import os
import pickle

import numpy as np
import torch

_MEAN = (0.4914, 0.4822, 0.4465)
_STD = (0.2470, 0.2435, 0.2616)


def load_cifar10(root: str, split: str):
    """(x float32 [n, 3, 32, 32] normalised per channel, y int64 [n]).

    root holds data_batch_1..5 and test_batch (or a cifar-10-batches-py/ folder that does).
    Raises:
        FileNotFoundError: the folder or a batch file is missing (names what is expected).
        ValueError: a batch file that is not a CIFAR-10 pickle.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if os.path.isdir(os.path.join(root, "cifar-10-batches-py")):
        root = os.path.join(root, "cifar-10-batches-py")
    names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    missing = [n for n in names if not os.path.isfile(os.path.join(root, n))]
    if missing:
        raise FileNotFoundError(f"CIFAR-10 folder {root!r} lacks {missing}; expected the python-pickle layout "
                                "(data_batch_1..data_batch_5, test_batch)")
    xs, ys = [], []
    for n in names:
        path = os.path.join(root, n)
        try:
            with open(path, "rb") as f:
                d = pickle.load(f, encoding="bytes")
            data = np.asarray(d[b"data"], dtype=np.uint8)
            labels = np.asarray(d[b"labels"], dtype=np.int64)
        except Exception as e:
            raise ValueError(f"{path}: not a CIFAR-10 batch ({type(e).__name__}: {e})") from None
        if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
            raise ValueError(f"{path}: expected data [n, 3072] and n labels, got {data.shape} and {labels.shape}")
        xs.append(data)
        ys.append(labels)
    x = torch.from_numpy(np.concatenate(xs)).view(-1, 3, 32, 32).float() / 255.0
    x = (x - torch.tensor(_MEAN).view(1, 3, 1, 1)) / torch.tensor(_STD).view(1, 3, 1, 1)
    return x, torch.from_numpy(np.concatenate(ys))

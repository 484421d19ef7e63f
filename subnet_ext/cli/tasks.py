"""What is trained: a model, its data, its loss and its metric, behind one small interface.

A Task gives every rank its own deterministic batch for a step (so resuming at step s
reproduces the run), the held-out evaluation set, and the loss/metric on logits.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from ..data.sharding import ShardedBatches
from .checkpointing import stream_seed
from ..models.registry import build_model


@dataclass
class Task:
    """A model builder plus data.

    make_model: () -> nn.Module (called under the same seed on every rank).
    batch: (step, rank, world_size, micro=0, micro_steps=1) -> (inputs, targets) for that rank:
        micro-batch `micro` of the `micro_steps` (--grad-accum) of optimizer step `step`, a
        pure function of those numbers and the seed (a resumed run sees the same batches);
        with micro_steps=1 it is the step's one batch.
    eval_batches: () -> iterator of (inputs, targets) of the held-out set.
    task_type: "classification" (metric: accuracy) or "language" (metric: loss in nats/token).
    """

    name: str
    make_model: Callable[[], torch.nn.Module]
    batch: Callable[[int, int, int], tuple]
    eval_batches: Callable[[], Iterator[tuple]]
    task_type: str
    floor: float | None = None  # known entropy floor of the loss, when the source has one

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (nats) of logits [..., C] against integer targets [...] (flattened)."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def score(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, int]:
        """(summed loss, summed correct, count) over a batch, for aggregation."""
        flat, t = logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
        loss = F.cross_entropy(flat, t, reduction="sum").item()
        correct = (flat.argmax(-1) == t).sum().item()
        return loss, correct, t.numel()


def _batch_index(step: int, micro: int, micro_steps: int) -> int:
    """The position of micro-batch `micro` of optimizer step `step` in the stream of batches."""
    if not 0 <= micro < micro_steps:
        raise ValueError(f"micro-batch index must be in [0, {micro_steps}), got {micro}")
    return step * micro_steps + micro


def _classification(name, x_train, y_train, x_test, y_test, make_model, batch_size, seed, eval_batch=512):
    batches = {}

    def batch(step, rank, world, micro=0, micro_steps=1):
        key = (rank, world)
        if key not in batches:
            batches[key] = ShardedBatches(x_train, y_train, batch_size, rank=rank, world_size=world, seed=seed)
        # Micro-batches walk the epoch's permutation in order, so accumulation sees new samples.
        return batches[key].batch_at(_batch_index(step, micro, micro_steps))

    def eval_batches():
        for i in range(0, len(x_test), eval_batch):
            yield x_test[i : i + eval_batch], y_test[i : i + eval_batch]

    return Task(name, make_model, batch, eval_batches, "classification")


def build_task(data: str, model: str, preset: str | None, batch_size: int, seq_len: int, seed: int,
               width: int | None = None) -> Task:
    """Task for `--data` (digits | cifar:PATH | synthetic | tokens:PATH) and `--model`
    (mlp | resnet | llama | hf:DIR, a transformers causal LM's folder: token data only).

    Raises:
        ValueError: an unknown data name, or a model that cannot read that data.
        FileNotFoundError: a data path that does not exist.
    """
    overrides = {} if width is None else {"width": width}
    if data == "digits" or data.startswith("cifar:"):
        if _is_language_model(model):
            raise ValueError(f"--model {model} needs token data (synthetic or tokens:PATH), got --data {data}")
        if data == "digits":
            from ..data.digits import load_digits_dataset

            as_images = model == "resnet"
            x_tr, y_tr = load_digits_dataset("train", seed=seed, as_images=as_images)
            x_te, y_te = load_digits_dataset("test", seed=seed, as_images=as_images)
        else:
            from ..data.cifar import load_cifar10

            root = data.split(":", 1)[1]
            x_tr, y_tr = load_cifar10(root, "train")
            x_te, y_te = load_cifar10(root, "test")
            if model == "mlp":
                x_tr, x_te = x_tr.flatten(1), x_te.flatten(1)
        in_shape = tuple(x_tr.shape[1:])
        kw = dict(num_classes=10, **overrides)
        if model == "mlp":
            kw["in_features"] = int(math.prod(in_shape))
        else:
            kw["in_channels"] = in_shape[0]
        make = lambda: build_model(model, preset=preset, **kw)  # noqa: E731
        return _classification(data.split(":")[0], x_tr, y_tr, x_te, y_te, make, batch_size, seed)
    if data == "synthetic" or data.startswith("tokens:"):
        if not _is_language_model(model):
            raise ValueError(f"token data needs --model llama or hf:DIR, got --model {model}")
        return _language_task(data, model, preset, batch_size, seq_len, seed)
    raise ValueError(f"--data must be digits, cifar:PATH, synthetic or tokens:PATH, got {data!r}")


def _is_language_model(model: str) -> bool:
    return model == "llama" or model.startswith("hf:")


def _language_task(data, model, preset, batch_size, seq_len, seed, eval_steps=4):
    from ..data.tokens import SyntheticTokens, TokenFileDataset

    if model.startswith("hf:"):
        from ..models.hf import hf_vocab_size, load_hf_causal_lm

        folder = model.split(":", 1)[1]
        vocab = hf_vocab_size(folder)
        make = lambda: load_hf_causal_lm(folder)  # noqa: E731
    else:
        from ..models.llama import LLAMA_PRESETS

        vocab = LLAMA_PRESETS[preset or "tiny"].vocab_size
        make = lambda: build_model("llama", preset=preset or "tiny")  # noqa: E731
    if data == "synthetic":
        train_src = SyntheticTokens(vocab_size=vocab, seq_len=seq_len, seed=seed)
        eval_src = train_src
        floor = train_src.entropy_rate_nats
    else:
        path = data.split(":", 1)[1]
        if not os.path.exists(path):
            raise FileNotFoundError(f"--data tokens:{path}: no such file (expected a flat uint16 token .bin file)")
        train_src = TokenFileDataset(path, seq_len, vocab_size=vocab)
        eval_src, floor = train_src, None

    def batch(step, rank, world, micro=0, micro_steps=1):
        # Distinct streams per (rank, step, micro-batch); the same after a restart.
        gen = torch.Generator().manual_seed(stream_seed(seed, _batch_index(step, micro, micro_steps), rank))
        return train_src.batch(batch_size, gen)

    def eval_batches():
        for i in range(eval_steps):
            yield eval_src.batch(batch_size, torch.Generator().manual_seed(10_000_019 + i))

    return Task(data.split(":")[0], make, batch, eval_batches, "language", floor)

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
import torch.nn as nn
import torch.nn.functional as F

from ..data.rank_batches import ShardedBatches
from .run_checkpoints import stream_seed
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

    def loss(self, output, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (nats) of the model's logits [..., C] against integer targets [...]
        (flattened); `output` is the logits or a model output holding them (see logits_of)."""
        logits = logits_of(output)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def score(self, output, targets: torch.Tensor) -> tuple[float, float, int]:
        """(summed loss, summed correct, count) over a batch, for aggregation; output as for loss."""
        logits = logits_of(output)
        flat, t = logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
        loss = F.cross_entropy(flat, t, reduction="sum").item()
        correct = (flat.argmax(-1) == t).sum().item()
        return loss, correct, t.numel()


def logits_of(output) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, the first element of a tuple such as
    nanoGPT's (logits, loss) (the GPT's loss is None without targets; the task computes its
    own), or an object's `.logits` (transformers' outputs).

    Raises:
        TypeError: an output that holds no tensor of logits in one of those places.
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        return output.logits
    raise TypeError(f"expected the model to return logits, a (logits, ...) tuple or an object with .logits; got "
                    f"{type(output).__name__}")


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
               width: int | None = None, eval_sequences: int | None = None) -> Task:
    """Task for `--data` (digits | cifar:PATH | synthetic | tokens:PATH | pysrc | shakespeare[:PATH])
    and `--model` (mlp | resnet | llama | gpt | hf:DIR, a transformers causal LM's folder: token data only).

    pysrc: the Python standard library's ASCII sources as characters (data/pysrc.py); its
    held-out set is `eval_sequences` windows (default 4 x batch_size) evenly spaced over the
    validation files. shakespeare: nanoGPT's Tiny Shakespeare benchmark (data/shakespeare.py;
    the file at PATH, default $SUBNET_EXT_TINY_SHAKESPEARE), held out: every window of the
    validation split, or `eval_sequences` evenly spaced ones. Other token sources evaluate on 4
    random batches.

    Raises:
        ValueError: an unknown data name, a model that cannot read that data, or a sequence
            longer than the model's context.
        FileNotFoundError: a data path that does not exist.
    """
    overrides = {} if width is None else {"width": width}
    if data == "digits" or data.startswith("cifar:"):
        if _is_language_model(model):
            raise ValueError(f"--model {model} needs token data (synthetic, pysrc, shakespeare or tokens:PATH), got "
                             f"--data {data}")
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
    if data in ("synthetic", "pysrc") or data.startswith(("tokens:", "shakespeare")):
        if not _is_language_model(model):
            raise ValueError(f"token data needs --model llama, gpt or hf:DIR, got --model {model}")
        return _language_task(data, model, preset, batch_size, seq_len, seed, eval_sequences)
    raise ValueError(f"--data must be digits, cifar:PATH, synthetic, pysrc, shakespeare[:PATH] or tokens:PATH, got "
                     f"{data!r}")


def _is_language_model(model: str) -> bool:
    return model in ("llama", "gpt") or model.startswith("hf:")


def _language_model(model, preset, seq_len):
    """(make_model, vocabulary size) of a language model name; refuses a seq_len beyond the GPT's context."""
    if model.startswith("hf:"):
        from ..models.hf import hf_vocab_size, load_hf_causal_lm

        folder = model.split(":", 1)[1]
        return (lambda: load_hf_causal_lm(folder)), hf_vocab_size(folder)
    if model == "gpt":
        from ..models.gpt import GPT_PRESETS

        cfg = GPT_PRESETS[preset or "tiny"]
        if seq_len > cfg.block_size:
            raise ValueError(f"--seq-len {seq_len} exceeds the gpt {preset or 'tiny'} preset's context of "
                             f"{cfg.block_size} tokens; use --seq-len {cfg.block_size} or less")
        return (lambda: build_model("gpt", preset=preset or "tiny")), cfg.vocab_size
    from ..models.llama import LLAMA_PRESETS

    return (lambda: build_model("llama", preset=preset or "tiny")), LLAMA_PRESETS[preset or "tiny"].vocab_size


def _token_sources(data, vocab, seq_len, seed, eval_sequences, batch_size):
    """(training source with .batch(B, generator), eval batches (), entropy floor or None) of token data."""
    from ..data.tokens import SyntheticTokens, TokenFileDataset

    if data == "pysrc" or data.split(":", 1)[0] == "shakespeare":
        return _character_sources(data, vocab, seq_len, eval_sequences, batch_size)
    if data == "synthetic":
        src = SyntheticTokens(vocab_size=vocab, seq_len=seq_len, seed=seed)
        floor = src.entropy_rate_nats
    else:
        path = data.split(":", 1)[1]
        if not os.path.exists(path):
            raise FileNotFoundError(f"--data tokens:{path}: no such file (expected a flat uint16 token .bin file)")
        src, floor = TokenFileDataset(path, seq_len, vocab_size=vocab), None

    def eval_batches():
        for i in range(4):
            yield src.batch(batch_size, torch.Generator().manual_seed(10_000_019 + i))

    return src, eval_batches, floor


def _character_sources(data, vocab, seq_len, eval_sequences, batch_size):
    """(training windows, eval batches (), None) of a character corpus: pysrc, or Tiny Shakespeare
    (whose held-out set is every validation window unless eval_sequences asks for fewer)."""
    from ..data.char_windows import CharWindows

    if data == "pysrc":
        from ..data.pysrc import VOCAB_SIZE, load_pysrc

        corpus, size = load_pysrc(), VOCAB_SIZE
    else:
        from ..data.shakespeare import VOCAB_SIZE, load_tiny_shakespeare

        corpus, size = load_tiny_shakespeare(data.split(":", 1)[1] if ":" in data else None), VOCAB_SIZE
    name = data.split(":", 1)[0]
    if vocab < size:
        raise ValueError(f"--data {name} has {size} characters, more than the model's vocabulary of {vocab}")
    val = CharWindows(corpus.val, seq_len)
    if name == "shakespeare" and not eval_sequences:
        inputs, targets = val.every_window()
    else:
        inputs, targets = val.evenly_spaced(eval_sequences or 4 * batch_size)
    held_out = [(inputs[i:i + batch_size], targets[i:i + batch_size]) for i in range(0, len(inputs), batch_size)]
    return CharWindows(corpus.train, seq_len), (lambda: iter(held_out)), None


def _language_task(data, model, preset, batch_size, seq_len, seed, eval_sequences=None):
    make, vocab = _language_model(model, preset, seq_len)
    train_src, eval_batches, floor = _token_sources(data, vocab, seq_len, seed, eval_sequences, batch_size)

    def batch(step, rank, world, micro=0, micro_steps=1):
        # Distinct streams per (rank, step, micro-batch); the same after a restart.
        gen = torch.Generator().manual_seed(stream_seed(seed, _batch_index(step, micro, micro_steps), rank))
        return train_src.batch(batch_size, gen)

    return Task(data.split(":")[0], make, batch, eval_batches, "language", floor)


def sample_input_for(model_name: str, model: nn.Module, seq_len: int = 64, data: str | None = None):
    """(shape, dtype) of one sample `model` reads, for plan_subnetworks(sample_input=...).

    llama, gpt: ([1, seq_len], int64) tokens; hf:DIR (a transformers causal LM): None (its forward
    cannot be traced on the meta device, so the planner counts FLOPs as 2 x parameters); mlp/plain_mlp: ([1, in_features], param dtype);
    resnet: ([1, in_channels, s, s], param dtype) with s = 8 for --data digits, else 32
    (CIFAR). Raises ValueError for another model name or a non-positive seq_len.
    """
    if model_name.startswith("hf:"):
        return None
    if model_name in ("llama", "gpt"):
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        return (1, seq_len), torch.long
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    dtype = floats[0] if floats else torch.float32
    if model_name in ("mlp", "plain_mlp"):
        first = next(m for m in model.modules() if isinstance(m, nn.Linear))
        return (1, first.in_features), dtype
    if model_name == "resnet":
        first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
        side = 8 if data == "digits" else 32
        return (1, first.in_channels, side, side), dtype
    raise ValueError(f"no sample input known for model {model_name!r}; expected llama, gpt, mlp, plain_mlp or resnet")

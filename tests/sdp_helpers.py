"""A small model, per-rank batches and a training loop shared by the engine's
multi-process tests (importable in the spawned workers: they inherit sys.path)."""
import contextlib

import torch
import torch.nn.functional as F

from subnet_ext.models import ResidualMLP

IN, CLASSES = 12, 5


def make_model(width=16, seed=0):
    """ResidualMLP [*, 12] -> [*, 5]; the same weights for the same seed on every rank."""
    torch.manual_seed(seed)
    return ResidualMLP(in_features=IN, num_classes=CLASSES, width=width, depth=4, hidden=32)


def batch(rank, step, n=8):
    """(x [n, 12], y [n]) for this rank and step, the same in every process."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, IN, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def train(sdp, opt, rank, steps, start=0):
    """`steps` optimizer steps of cross-entropy on this rank's batches from step `start`."""
    for s in range(start, start + steps):
        x, y = batch(rank, s)
        F.cross_entropy(sdp(x), y).backward()
        opt.step()
        opt.zero_grad()


@contextlib.contextmanager
def counting_direct_writes():
    """Counts DirectGradient.write calls (the backward regime's masked-kernel writes into a
    bucket) inside the block; yields a one-element list holding the count."""
    from subnet_ext.engine.layers import owned_linear

    count, original = [0], owned_linear.DirectGradient.write

    def counting_write(self, *args):
        count[0] += 1
        return original(self, *args)

    owned_linear.DirectGradient.write = counting_write
    try:
        yield count
    finally:
        owned_linear.DirectGradient.write = original


def value_error(call) -> str | None:
    """The message of the ValueError call() raises, or None when it returns."""
    try:
        call()
    except ValueError as e:
        return str(e)
    return None

"""Real training steps metered by StepMemoryMeter, for the memory model's and the budget
planner's tests: the independent measurement their predictions are checked against.

One rank of a K-rank plan runs alone (SubnetDataParallel(simulate_rank=r): its own
subnetwork, its own buckets, collectives replaced by no-ops), with the study's loss
(cross-entropy over the last dimension) and optimizer (AdamW unless told).
"""
import torch
import torch.nn.functional as F

import subnet_ext as sx
from subnet_ext.jobs.training import apply_activation_checkpointing
from subnet_ext.measure.step_memory import StepMemoryMeter
from subnet_ext.models import build_model

MIB = 2 ** 20


def mlp_task(batch=32):
    """The study's digits model (residual MLP, 64 features, 10 classes) and one rank's batch."""
    torch.manual_seed(0)
    model = build_model("mlp", in_features=64, num_classes=10)
    return model, torch.randn(batch, 64), torch.randint(0, 10, (batch,))


def gpt_task(preset="deep", batch=2, seq_len=32):
    """The study's text model (GPT preset, vocabulary 128) and one rank's batch of tokens."""
    torch.manual_seed(0)
    model = build_model("gpt", preset=preset)
    return model, torch.randint(0, 128, (batch, seq_len)), torch.randint(0, 128, (batch, seq_len))


def resnet_task(batch=8):
    """The bundled CIFAR-shaped ResNet (width 16) and one rank's batch of 3x32x32 images."""
    torch.manual_seed(0)
    model = build_model("resnet", in_channels=3, num_classes=10, width=16)
    return model, torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))


def _logits(out):
    return out[0] if isinstance(out, tuple) else out


def measure_rank_step(model, plan, x, y, rank=0, regime="forward", activation_checkpointing=False,
                      optimizer="adamw", steps=3) -> dict:
    """StepMemoryMeter.result() of the `steps`-th step of `rank` (the optimizer state exists from
    the second step on, as the study meters its third)."""
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    sdp = sx.SubnetDataParallel(model, plan, regime=regime, simulate_rank=rank)
    opt = (torch.optim.AdamW(sdp.parameters(), lr=1e-3) if optimizer == "adamw"
           else torch.optim.SGD(sdp.parameters(), lr=1e-2, momentum=0.9 if optimizer == "sgd_momentum" else 0.0))
    result = None
    for _ in range(steps):
        meter = StepMemoryMeter([sdp], [opt])
        with meter:
            logits = _logits(sdp(x))
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        result = meter.result()
    return result

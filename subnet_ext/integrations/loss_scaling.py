"""The loss scaler every rank agrees on, made from the one a framework built."""
from __future__ import annotations

import torch

from ..engine.guards.grad_scaler import GradScaler


def agreed_scaler(scaler: torch.amp.GradScaler | None, device: str) -> GradScaler:
    """A subnet_ext.GradScaler (found-inf all-reduced over the ranks, so every rank skips the same
    steps) with `scaler`'s settings: initial scale, growth and backoff factors, growth interval,
    enabled (torch's defaults when None). A scaler that already is one is returned as it is.

    Args:
        scaler: the torch.amp.GradScaler Lightning or accelerate built, or None.
        device: the device type it scales on ("cuda", "cpu").
    """
    if isinstance(scaler, GradScaler):
        return scaler
    if scaler is None:
        return GradScaler(device)
    return GradScaler(device, init_scale=scaler._init_scale, growth_factor=scaler._growth_factor,
                      backoff_factor=scaler._backoff_factor, growth_interval=scaler._growth_interval,
                      enabled=scaler._enabled)

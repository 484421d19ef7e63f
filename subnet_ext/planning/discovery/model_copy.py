"""Copies of a model that share what cannot be copied: torch.distributed process groups.

A model converted with `nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group)` holds
the group in each norm's `process_group`, and `copy.deepcopy` cannot pickle a ProcessGroup.
The planner and the engine copy models (meta copies for FLOPs and the engine's skeleton, the
assembled full model, private probes): their copies point at the same groups instead.
"""
from __future__ import annotations

import copy

import torch.distributed as dist
import torch.nn as nn


def copy_model(model: nn.Module, memo: dict | None = None) -> nn.Module:
    """copy.deepcopy(model, memo) with every ProcessGroup a module refers to shared, not copied."""
    memo = {} if memo is None else memo
    if dist.is_available():
        for module in model.modules():
            for value in vars(module).values():
                if isinstance(value, dist.ProcessGroup):
                    memo[id(value)] = value
    return copy.deepcopy(model, memo)

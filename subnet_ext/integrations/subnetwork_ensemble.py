"""The models an integration evaluates: the full model, or the ensemble of the ranks' subnetworks.

The engine's own `evaluate()` runs every rank on the same inputs (the ensemble is one
all-reduce of the ranks' outputs). A trainer's evaluation loop instead gives each rank
its own share of the data, as DDP does. So here the ensemble is built on each rank, from
the full model: `SubnetworkEnsemble` holds the K subnetworks of the plan (each one the
engine simulating rank k alone on a copy of the full model, so each is exactly what rank
k trains) and returns the mean of their floating outputs. Memory: about K x coverage
copies of the unit parameters, plus K copies of the shared ones, on every rank.

In the backward regime every rank's forward is the full model, so the ensemble of the
subnetworks is the full model itself and is built as such.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..engine.config import SDPConfig
from ..engine.data_parallel import SubnetDataParallel
from ..engine.evaluation import floating_tensors, map_floating
from ..planning.plan import SubnetPlan


class SubnetworkEnsemble(nn.Module):
    """The mean of the outputs of the K subnetworks of `plan`, built from the full model.

    Args:
        full: the full (unmasked) model holding the values to evaluate; left unchanged
            (each subnetwork is made from a copy of it).
        plan: the training's plan (K = plan.world_size subnetworks).
        config: the training's engine options (its regime and scale shape the subnetworks).

    `forward` takes the model's inputs and returns the model's output
    structure (tensors, tuples, dicts, ModelOutputs) with every floating tensor the mean
    over the K subnetworks, in float32 (e.g. logits [B, T, V]); other leaves are the first
    subnetwork's. A model that computes its loss inside its forward gives the mean of the
    subnetworks' losses there, not the loss of the mean output.
    """

    def __init__(self, full: nn.Module, plan: SubnetPlan, config: SDPConfig):
        super().__init__()
        if config.regime == "backward":
            members = [full]  # each rank runs the full forward: its subnetwork's output is the full model's
        else:
            members = [SubnetDataParallel(copy.deepcopy(full), plan, config=config, simulate_rank=k)
                       for k in range(plan.world_size)]
        self.members = nn.ModuleList(members)
        self.train(full.training)

    def forward(self, *args, **kwargs):
        """The mean over the subnetworks of their outputs on these inputs (see the class)."""
        outputs = [member(*args, **kwargs) for member in self.members]
        columns = zip(*(floating_tensors(out) for out in outputs))
        means = iter([torch.stack([t.float() for t in column]).mean(0) for column in columns])
        return map_floating(lambda _: next(means), outputs[0])

"""What a LightningModule's validation, test and predict steps run on under SDP.

The steps are the user's methods on the LightningModule itself (`self.log`, lists of
outputs, metrics held as attributes must stay those of the object the Trainer knows), so
the evaluated model is put *inside* that object for the duration of each step and taken
out after it:

- "full": the top-level children that hold the model's state (the ones whose names the
  plan lists, not torchmetrics objects or other state-less children) and any of the root's
  own tensors are those of the full model (the union of the subnetworks), assembled once
  per evaluation run with the engine's collective `full_model()`;
- "ensemble": as "full", and the module's own forward (`self(...)`) returns the mean of the
  K subnetworks' outputs (integrations/subnetwork_ensemble.py). Submodules called directly
  (`self.net(x)`) run the full model.

Outside `fit` the module is the plain model (never wrapped, or given back when fitting
ended), so "full" needs nothing and "ensemble" builds the subnetworks from it.
"""
from __future__ import annotations

import contextlib

import torch.nn as nn

from ..engine.config import SDPConfig
from ..engine.data_parallel import SubnetDataParallel
from ..planning.plan import SubnetPlan
from .subnetwork_ensemble import SubnetworkEnsemble


class EvaluatedModel:
    """The model one evaluation run (validation, test or predict) evaluates, built once at its start.

    Args:
        module: the LightningModule the Trainer runs.
        engine: the SubnetDataParallel wrapping it while fitting, else None (a plain module).
        plan, config: the training's plan and engine options.
        mode: "full" or "ensemble".
    Collective when `engine` is given (the full model's assembly): every rank builds it.
    """

    def __init__(self, module: nn.Module, engine: SubnetDataParallel | None, plan: SubnetPlan, config: SDPConfig,
                 mode: str):
        self.module = module
        self.full = engine.full_model() if engine is not None else None
        self.ensemble = SubnetworkEnsemble(self.full if self.full is not None else module, plan, config) \
            if mode == "ensemble" else None
        held = {name.split(".", 1)[0] for name in plan.tensor_shapes} | {name.split(".", 1)[0] for name in plan.aliases}
        self.children = sorted(name for name in held if name in module._modules)
        self.own = sorted(name for name in held if name in module._parameters or name in module._buffers)

    @contextlib.contextmanager
    def inside(self):
        """Within: `module` runs the evaluated model (see the module docstring); after: as before."""
        module, training = self.module, self.module.training
        saved_children = {n: module._modules[n] for n in self.children} if self.full is not None else {}
        saved_own = [(store, n, store[n]) for n in self.own for store in (module._parameters, module._buffers)
                     if n in store] if self.full is not None else []
        saved_forward = module.__dict__.get("forward")
        try:
            for name in saved_children:
                module._modules[name] = self.full._modules[name].train(training)
            for store, name, _ in saved_own:
                store[name] = getattr(self.full, name)
            if self.ensemble is not None:
                ensemble = self.ensemble.train(training)
                module.__dict__["forward"] = lambda *args, **kwargs: ensemble(*args, **kwargs)
            yield
        finally:
            module._modules.update(saved_children)
            for store, name, value in saved_own:
                store[name] = value
            if self.ensemble is not None:
                if saved_forward is None:
                    module.__dict__.pop("forward", None)
                else:
                    module.__dict__["forward"] = saved_forward

"""What a LightningModule's validation, test and predict steps run on under SDP.

The steps are the user's methods on the LightningModule itself (`self.log`, lists of
outputs, metrics held as attributes must stay those of the object the Trainer knows), so
the evaluated model is put *inside* that object for the duration of each step and taken
out after it, by the engine's swap record (engine/regimes/module_swaps.py: every change recorded,
all undone after the step):

- "full": the top-level children that hold the model's state (the ones whose names the
  plan lists, not torchmetrics objects or other state-less children) are swapped for those
  of the full model (the union of the subnetworks), assembled once per evaluation run with
  the engine's collective `full_model()`, and any of the root's own tensors replaced by the
  full model's;
- "ensemble": as "full", and the module's own call (`self(...)`) returns the mean of the
  K subnetworks' outputs (integrations/subnetwork_ensemble.py): a forward hook on the
  module replaces its output (the module's own forward still runs, on the full model, and
  its output is discarded). Submodules called directly (`self.net(x)`) run the full model.

Nothing is set on the LightningModule: no instance `forward`, its children and tensors back
after each step. Outside `fit` the module is the plain model (never wrapped, or given back when
fitting ended), so "full" needs nothing and "ensemble" builds the subnetworks from it.
"""
from __future__ import annotations

import contextlib

import torch.nn as nn

from ..engine.config import SDPConfig
from ..engine.data_parallel import SubnetDataParallel
from ..engine.regimes.module_swaps import ModuleSwaps
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
        swaps, handle = ModuleSwaps(), None
        try:
            if self.full is not None:
                for name in self.children:
                    swaps.swap(module, name, self.full.get_submodule(name).train(training))
                for name in self.own:  # the root's own tensors: replaced in place, recorded
                    swaps.put_tensor(module, name, getattr(self.full, name), release=False)
            if self.ensemble is not None:
                handle = module.register_forward_hook(_Output(self.ensemble.train(training)), with_kwargs=True)
            yield
        finally:
            if handle is not None:
                handle.remove()
            swaps.undo()


class _Output:
    """A forward hook whose output replaces the module's: `model(*args, **kwargs)` on the same inputs."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, module, args, kwargs, output):
        return self.model(*args, **kwargs)

"""What `sdp.eval(); sdp(x)` runs: this rank's subnetwork, said once, or the assembled model.

A DDP validation loop calls the wrapper in eval mode and reads its outputs as the model's.
Under SDP a rank that does not hold the whole model (forward regime, coverage below 1)
would run its subnetwork there, and its metrics would pass for the model's. The engine's
`eval_forward` option (SDPConfig) chooses:

- "subnetwork" (the default): the forward runs this rank's subnetwork, as in training, and
  the first time in the process a warning names what ran and points to `sdp.evaluate()`;
  nothing changes in what runs, nothing is collective (a master-only evaluation still works);
- "full": the forward runs the full model, the union of the subnetworks, assembled from
  every rank's pieces (`full_model()`, a collective: every rank must evaluate) once after
  each optimizer step or load, then reused for every eval-mode forward until the next
  step; it is freed when the wrapper goes back to train mode.

Both apply to forwards in eval mode without gradients (`torch.no_grad()`, `inference_mode()`:
what evaluation loops do). A forward in eval mode that records gradients trains (dropout off,
BatchNorm statistics frozen) and runs the subnetwork as in training. A rank that holds the
whole model (the backward regime, whose forward is the full model; the forward regime at
coverage 1) runs it as it is, in either mode, without a word.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn as nn

_WARNED: set = set()  # what this process has been told once (one entry per kind of warning)


class EvalForward:
    """The eval-mode forward of one engine: the warning, or the assembled model and its cache.

    Args:
        mode: "subnetwork" or "full" (SDPConfig.eval_forward).
        holds_whole_model: True when this rank's forward is the full model already.
        what_runs: how the warning names this rank's subnetwork ("rank 1's subnetwork (52.3%
            of the parameters, coverage 0.5)").
    """

    def __init__(self, mode: str, holds_whole_model: bool, what_runs: str):
        self.mode, self.holds_whole_model, self.what_runs = mode, holds_whole_model, what_runs
        self._model, self._version = None, None

    @classmethod
    def for_rank(cls, mode: str, plan, rank: int, regime: str) -> "EvalForward":
        """The eval-mode forward of `rank` of `plan` in `regime` (the backward regime's forward,
        and a rank owning every unit, are the full model)."""
        held = float(plan.held_fraction[rank])
        return cls(mode, regime == "backward" or bool(plan.owners[rank].all()),
                   f"rank {rank}'s subnetwork ({held:.1%} of the model's parameters, coverage {plan.coverage})")

    def applies(self, module: nn.Module) -> bool:
        """True when a forward of `module` now is an evaluation this class must handle: eval mode,
        no gradients recorded, on a rank whose forward is not the whole model."""
        return not module.training and not torch.is_grad_enabled() and not self.holds_whole_model

    def run(self, module: nn.Module, args: tuple, kwargs: dict, version, assemble: Callable[[], nn.Module]):
        """The eval-mode forward's output. version: changes whenever the trained values may have
        (optimizer steps, loads); assemble() -> the full model (collective on every rank)."""
        if self.mode == "subnetwork":
            _warn_once("subnetwork", f"SubnetDataParallel: a forward in eval mode ran {self.what_runs}, not the "
                       "model: its outputs are this rank's subnetwork's, and a DDP validation loop would report "
                       "them as the model's. For the model call sdp.evaluate(x) on every rank ('full': the union "
                       "of the subnetworks, 'ensemble': the mean of their outputs), or wrap with "
                       "eval_forward='full' so that eval-mode forwards run the assembled model (collective: every "
                       "rank evaluates). Said once per process.")
            return module(*args, **kwargs)
        if self._model is None or self._version != version:
            self._model = None  # the previous step's model is freed before the next is assembled
            with torch.inference_mode(False), torch.no_grad():  # plain tensors, even inside inference_mode
                model = assemble().eval()
            for p in model.parameters():
                p.requires_grad_(False)
            self._model, self._version = model, version
        return self._model(*args, **kwargs)

    def drop(self) -> None:
        """Forget the assembled model (train mode again, or new values loaded)."""
        self._model, self._version = None, None


def _warn_once(kind: str, message: str) -> None:
    if kind not in _WARNED:
        _WARNED.add(kind)
        warnings.warn(message, UserWarning, stacklevel=4)

"""Lightning's precision plugins under SDP: whole-model gradient clipping and the agreed loss scaler.

Lightning clips gradients in its precision plugin (`Trainer(gradient_clip_val=...)` reaches
`Precision.clip_grad_by_norm`, which calls torch's `clip_grad_norm_` on the optimizer's
parameters). Under SDP those are one rank's share of the model: each rank would see a
different norm and owners would diverge. The plugins here clip by the norm of the whole
model's synchronised gradient instead (`SubnetDataParallel.clip_grad_norm_`, the same number
on every rank, DDP's at coverage 1). Clipping by value is elementwise and needs nothing.

"16-mixed" scales the loss with `subnet_ext.GradScaler`, whose found-inf flag is agreed by
every rank, so all ranks skip the same steps and keep equal scales (torch's scaler decides
per rank, from the units it holds). `for_sdp` turns the plugin Lightning chose into one of
these and refuses the precisions SDP does not support yet, naming the supported ones.
"""
from __future__ import annotations

from ._extras import import_extra

import_extra("lightning", "lightning")

import torch  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision, Precision  # noqa: E402

from ..engine.data_parallel import SubnetDataParallel  # noqa: E402
from ..engine.guards.grad_scaler import GradScaler  # noqa: E402
from .loss_scaling import agreed_scaler  # noqa: E402

SUPPORTED = ("32-true", "bf16-mixed", "16-mixed")


class _WholeModelNormClipping:
    """Clipping by norm through the engine once one is attached (`engine`); before, Lightning's own."""

    engine: SubnetDataParallel | None = None

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        """Scale every gradient this rank holds by min(1, clip_val / the whole model's gradient norm).
        Collective (one all-reduce of one number), as Lightning calls it: on every rank, every step."""
        if self.engine is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        self.engine.clip_grad_norm_(clip_val)


class SDPPrecision(_WholeModelNormClipping, Precision):
    """Lightning's "32-true" precision with whole-model gradient clipping by norm."""


class SDPMixedPrecision(_WholeModelNormClipping, MixedPrecision):
    """Lightning's "bf16-mixed" / "16-mixed" (torch.autocast) with whole-model gradient clipping by
    norm; "16-mixed" scales the loss with subnet_ext.GradScaler (skip decisions agreed by every rank).

    Args:
        precision: "16-mixed" or "bf16-mixed". device: the autocast device type ("cuda", "cpu").
        scaler: "16-mixed" only: a subnet_ext.GradScaler, or a torch.amp.GradScaler whose settings
            (initial scale, growth and backoff factors, growth interval) a new agreed one takes.
    """

    def __init__(self, precision: str, device: str, scaler: torch.amp.GradScaler | None = None):
        if precision == "16-mixed" and not isinstance(scaler, GradScaler):
            scaler = agreed_scaler(scaler, device)
        super().__init__(precision, device, scaler)


def for_sdp(plugin: Precision) -> Precision:
    """The SDP form of the precision plugin Lightning chose (`precision=` or `plugins=[...]`).

    Raises:
        ValueError: a precision SDP does not support yet (true half or double weights, FSDP's,
            DeepSpeed's, bitsandbytes, Transformer Engine, XLA), naming the supported ones.
    """
    if isinstance(plugin, _WholeModelNormClipping):
        return plugin
    if type(plugin) is Precision:
        return SDPPrecision()
    if type(plugin) is MixedPrecision:
        return SDPMixedPrecision(plugin.precision, plugin.device, plugin.scaler)
    name = getattr(plugin, "precision", None) or type(plugin).__name__
    raise ValueError(f"SDPStrategy does not support precision {name!r} ({type(plugin).__name__}) yet; use "
                     f"precision= one of {list(SUPPORTED)} (\"16-mixed\" scales the loss with subnet_ext.GradScaler, "
                     "which every rank agrees on)")

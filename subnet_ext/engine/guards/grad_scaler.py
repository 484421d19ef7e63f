"""A loss scaler whose skip decision is agreed by every rank (docs/design.md §5.2).

torch.amp.GradScaler decides from the gradients one rank holds. Under SDP a unit owned
by ranks {0, 1} is averaged among them only, so an inf there is seen by ranks 0 and 1
alone: they skip the step and halve their scale while the others step and keep theirs,
and every parameter the two groups share (at least the shared stem and head) diverges.

`GradScaler` is torch's, with one change: the found-inf flags of `unscale_` (and of the
inf check that optimizers with built-in scaling use) are all-reduced (MAX) over the
process group before the step decision and the scale update, so every rank skips the
same steps and the scales stay equal:

    scaler = subnet_ext.GradScaler("cuda")            # or process_group=..., timeout=...
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(sdp(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt); sdp.clip_grad_norm_(1.0)      # optional
    scaler.step(opt); scaler.update(); opt.zero_grad()
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm import collectives
from ...comm.collectives import as_timedelta


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler whose found-inf is one flag agreed by every rank of a group.

    Args:
        device, init_scale, growth_factor, backoff_factor, growth_interval, enabled: as
            torch.amp.GradScaler.
        process_group: the ranks that must agree (default: the world; the engine's group).
        timeout: seconds the flag's all-reduce may take before CollectiveError (None: the
            group's own timeout).

    Every rank must call `unscale_` / `step` at the same points (the agreement is a
    collective); without torch.distributed initialised it behaves as torch's.
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 process_group=None, timeout: float | None = None):
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        as_timedelta(timeout)  # validates it before any collective
        self.process_group, self.timeout = process_group, timeout

    def _unscale_grads_(self, optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict:
        """torch's unscale and inf check, then the per-device flags [] (0-d float32 each)
        replaced by their MAX over every device and every rank of the group."""
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if not dist.is_initialized() or dist.get_world_size(self.process_group) == 1:
            return per_device
        # A rank with no gradient at all still joins the collective (and then steps or
        # skips with the others): its flag is the scale's device's 0-d tensor.
        if not per_device:
            per_device = {found_inf.device: found_inf}
        gloo = dist.get_backend(self.process_group) == "gloo"
        device = torch.device("cpu") if gloo else found_inf.device
        flag = torch.stack([f.to(device, torch.float32) for f in per_device.values()]).max().reshape(1)
        collectives.all_reduce(flag, self.process_group, op=dist.ReduceOp.MAX, timeout=self.timeout)
        for f in per_device.values():
            f.copy_(flag[0])
        return per_device

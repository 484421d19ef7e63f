"""The part of SubnetDataParallel that a torch DDP training script talks to.

parameters() / named_parameters() (what the optimizer must hold, built after wrapping),
no_sync() and DDP's `require_backward_grad_sync` attribute (gradient accumulation without
communication), register_comm_hook(state, hook). A mixin, as FSDP2's `FSDPModule` is for
`fully_shard`: the engine holds the state, this class gives it DDP's names. It reads from
the engine: `_layout.trainable` (the Parameters this rank trains, in model order), `module`
(the wrapped model), `_phase` (whether a backward's gradients are averaged), `_shards`
(FSDP2 over the shared parameters, or None), `config`, `_averager` (whose reduction a comm
hook replaces) and `_check_open`.
"""
from __future__ import annotations

import contextlib

from ..comm.reduction import HookReduction
from .phase import Phase


class DDPInterface:
    """parameters(), named_parameters(), no_sync() and require_backward_grad_sync, as torch DDP's."""

    def parameters(self, recurse: bool = True):
        """What the optimizer must update: this rank's owned (and shared) parameters."""
        self._check_open("parameters")
        return iter(self._layout.trainable)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """(name, parameter) for each of parameters(), named as in torch DDP ("module." + the
        wrapped model's name), e.g. for weight-decay groups built by name or by dimension."""
        self._check_open("named_parameters")
        named = self.module.named_parameters(prefix=f"{prefix}.module" if prefix else "module",
                                             remove_duplicate=remove_duplicate)
        return ((n, p) for n, p in named if self._layout.is_trainable(p))

    def no_sync(self):
        """Gradient accumulation without communication, as torch DDP's `no_sync()`.

        Backward passes run inside the context only accumulate into `.grad`; the first
        backward after it averages the accumulated sum among owners as usual::

            with sdp.no_sync():
                loss_fn(sdp(x0), y0).backward()
            loss_fn(sdp(x1), y1).backward()   # averages grad(x0) + grad(x1)
            optimizer.step()

        Like DDP's, it sets require_backward_grad_sync to False inside and back after.
        """
        self._check_open("no_sync")
        return _without_gradient_sync(self)

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's attribute. False: backward passes run while it is False only accumulate
        into `.grad`, without communication (as inside no_sync()). True (the default): the next
        backward averages the accumulated sum among owners. A nanoGPT-style loop sets it to
        `micro_step == accumulation_steps - 1` before each micro-batch."""
        return self._phase is not Phase.ACCUMULATING

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        """Set whether the next backward passes average gradients (see the getter)."""
        self._check_open("require_backward_grad_sync")
        self._phase = Phase.TRAINING if value else Phase.ACCUMULATING
        self._averager.enabled = bool(value)  # no_sync(): the averager's hooks only let gradients accumulate
        if self._shards is not None:  # FSDP2's reduce-scatter of the shared parameters follows it
            self._shards.set_gradient_sync(bool(value))


    def register_comm_hook(self, state, hook) -> None:
        """Average gradient buckets with `hook(state, bucket)`, as torch DDP's register_comm_hook.

        The hook is called once per bucket of this rank, in the global bucket order, as soon
        as the bucket's gradients are packed (comm/reduction.py): `bucket` is a CommBucket
        (its flat `buffer()` in the gradients' dtype, `owners`, `process_group`,
        `group_size`, `scale` = 1/group_size, `pieces` and their `matrices()`, `index()`,
        and `all_reduce(tensor)`, the counted collective on the bucket's group), and the hook
        returns the buffer's mean over the group (a Tensor or a torch.futures.Future of one);
        the engine casts it back into the buffer and finishes the averaging rule. Built-in:
        subnet_ext.comm.hooks (allreduce_hook, fp16_compress_hook, bf16_compress_hook,
        low_rank_hook with a LowRankState). Once per engine, as DDP's; not with
        reduce_dtype (itself the cast hook), sync_every > 1 (parameters are averaged, in
        their own dtype) or shard_shared (FSDP2 reduces the shared parameters).
        """
        self._check_open("register_comm_hook")
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable as hook(state, bucket), got {hook!r}")
        if self.config.reduce_dtype is not None:
            raise ValueError(f"register_comm_hook: this engine already casts its gradients for the wire "
                             f"(reduce_dtype={self.config.reduce_dtype}); use either reduce_dtype or a comm hook")
        if isinstance(self._averager.reduction, HookReduction):
            raise RuntimeError(f"register_comm_hook: a comm hook ({self._averager.reduction.name}) is already "
                               "registered; it can be registered only once, as with torch DDP")
        if not self.config.every_step or self._shards is not None:
            raise ValueError("register_comm_hook: comm hooks average gradients in SDP's buckets every step; this "
                             f"engine has sync_every={self.config.sync_every} and shard_shared="
                             f"{self._shards is not None} (needs sync_every=1 and shard_shared=False)")
        self._averager.set_reduction(HookReduction(state, hook))


@contextlib.contextmanager
def _without_gradient_sync(engine):
    """DDP's no_sync(): require_backward_grad_sync False inside, its previous value after."""
    previous = engine.require_backward_grad_sync
    engine.require_backward_grad_sync = False
    try:
        yield
    finally:
        engine.require_backward_grad_sync = previous

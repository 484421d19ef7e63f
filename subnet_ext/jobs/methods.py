"""The three ways to train: torch DDP, torch FSDP2 (`fully_shard`) and SDP, behind one
interface that also measures what each costs (model-state bytes, bytes handed to
collectives, activation bytes) so the report compares them side by side.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from ..planning.buckets import DEFAULT_BUCKET_CAP_MB
from ..comm.communicator import CommCounter
from ..measure.storage import optimizer_state_bytes, tensor_bytes


@contextlib.contextmanager
def eval_mode(module: nn.Module):
    """The module in eval mode (dropout off, norms on running statistics, stochastic depth's
    scaling on) inside the context; its training flags as they were afterwards."""
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield module
    finally:
        for m, training in modes.items():
            m.training = training


def _counting_allreduce_hook(counter: CommCounter):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(process_group, bucket):
        counter.add("gradients", bucket.buffer())
        return default_hooks.allreduce_hook(process_group, bucket)

    return hook


class Method:
    """A wrapped model plus cost accounting. Subclasses: DDPMethod, FSDPMethod, SDPMethod."""

    name = "base"

    def __init__(self, model: nn.Module):
        self.module = model
        self._compiled = None

    def forward_module(self) -> nn.Module:
        """The module a training forward calls (the wrapper, or the model for FSDP2)."""
        return self.module

    def __call__(self, x):
        # `is None`, not `or`: a compiled module's truth value asks its len(), which wrappers lack.
        return (self.forward_module() if self._compiled is None else self._compiled)(x)

    def compile(self) -> None:
        """torch.compile the training forward (--compile); evaluation stays eager."""
        self._compiled = torch.compile(self.forward_module())

    def no_sync(self):
        """Context for the first N-1 micro-batches of --grad-accum: backwards only accumulate."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, max_norm: float, nonfinite_check: bool = False) -> torch.Tensor:
        """Scales the gradients so their global 2-norm is at most max_norm; returns the
        pre-clip norm (a 0-d tensor, the same on every rank). nonfinite_check: the norm must
        be inf or NaN when any rank holds such a gradient (torch's norm over every gradient,
        DDP's all-reduced or FSDP2's shards, already is)."""
        return torch.nn.utils.clip_grad_norm_(list(self.module.parameters()), max_norm)

    def clip_norm_is_agreed(self) -> bool:
        """True when clip_grad_norm_(..., nonfinite_check=True)'s norm is the same on every rank
        and non-finite exactly when some rank holds an inf/NaN gradient: the step's skip
        decision can then be read off it (training.OptimizerStep) instead of a separate pass
        over the gradients and a collective of its own."""
        return True

    def parameters(self):
        """The parameters the optimizer steps."""
        return self.module.parameters()

    def after_step(self):
        """Called after optimizer.step(): counts a step for the per-step comm averages."""

    def memory(self, optimizer) -> dict:
        """Bytes this rank holds: {"parameters", "gradients", "optimizer_state", "model_state" (their sum)}."""
        params = sum(tensor_bytes(p) for p in self.module.parameters())
        grads = sum(tensor_bytes(p.grad) for p in self.module.parameters() if p.grad is not None)
        state = optimizer_state_bytes(optimizer)
        return {"parameters": params, "gradients": grads, "optimizer_state": state,
                "model_state": params + grads + state}

    def comm(self) -> dict:
        """Communication per optimizer step: {"bytes_per_step", "collectives_per_step", "wire_bytes_per_step",
        "source" (counted or predicted)}; bytes are those handed to collectives."""
        raise NotImplementedError

    def full_state_dict(self) -> dict:
        """The full model's state dict ({name: tensor}, full shapes), as the unwrapped model would give
        it; at least on rank 0 (the one that writes it): sharded methods give the others {}."""
        raise NotImplementedError

    def load_full_state_dict(self, sd: dict) -> None:
        """Load a full model state dict (as full_state_dict returns) into the wrapped model."""
        raise NotImplementedError

    def eval_logits(self, x) -> dict:
        """{"full": logits} (plus "ensemble" for SDP), identical on every rank."""
        raise NotImplementedError

    def verify_consistency(self) -> None:
        """Raise ConsistencyError unless the copies that must agree do (collective)."""
        raise NotImplementedError(f"--verify-every is not available for --method {self.name}")


class DDPMethod(Method):
    """torch DistributedDataParallel, with a comm hook that counts the gradient bytes it all-reduces."""

    name = "ddp"

    def __init__(self, model, device, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, stochastic_depth=None):
        from torch.nn.parallel import DistributedDataParallel as DDP

        super().__init__(model)
        self.counter = CommCounter()
        # Stochastic depth (a StochasticDepth installed on `model`): a rank's dropped blocks get no
        # gradient, which DDP reduces as zeros only when told to look for unused parameters.
        self.stochastic_depth = stochastic_depth
        self.ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                       bucket_cap_mb=bucket_cap_mb, find_unused_parameters=stochastic_depth is not None)
        self.ddp.register_comm_hook(None, _counting_allreduce_hook(self.counter))

    def forward_module(self):
        """The module the training forward calls (torch DDP's wrapper, which may be compiled)."""
        return self.ddp

    def no_sync(self):
        """DDP's context that accumulates gradients without all-reducing them."""
        return self.ddp.no_sync()

    def after_step(self):
        """Count one optimizer step (the denominator of the per-step comm averages); stochastic
        depth draws the next step's blocks."""
        self.counter.steps += 1
        if self.stochastic_depth is not None:
            self.stochastic_depth.advance()

    def comm(self):
        """Counted gradient all-reduce bytes and collectives per step; wire bytes = 2(K-1)/K x bytes (ring)."""
        steps = max(1, self.counter.steps)
        k = dist.get_world_size()
        per_step = self.counter.bytes / steps
        return {"bytes_per_step": per_step, "collectives_per_step": self.counter.collectives / steps,
                "wire_bytes_per_step": 2 * (k - 1) / k * per_step, "source": "counted (DDP comm hook)"}

    def full_state_dict(self):
        """A detached copy of the replica's state dict ({name: tensor}, full shapes)."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def load_full_state_dict(self, sd):
        """Load a full state dict into the replica (every rank loads the same `sd`)."""
        self.module.load_state_dict(sd)

    def verify_consistency(self):
        """Raise ConsistencyError unless every rank holds the same state dict (collective)."""
        from ..state.consistency import verify_replicas

        verify_replicas(self.module.state_dict())  # data parallelism: every rank is a replica

    @torch.no_grad()
    def eval_logits(self, x):
        """{"full": output of the replica on x, in eval mode} (e.g. x: [B, in_features] -> logits [B, num_classes])."""
        with eval_mode(self.module):
            return {"full": self.module(x)}


class FSDPMethod(Method):
    """FSDP2: each block, then the root, sharded with `fully_shard` (params gathered per use)."""

    name = "fsdp"

    def __init__(self, model, device):
        from torch.distributed.fsdp import fully_shard

        super().__init__(model)
        blocks = [m for name, m in model.named_modules() if _is_block_list_member(model, name)]
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        self.steps = 0

    def no_sync(self):
        """Accumulate gradients without reduce-scattering them (FSDP2's gradient-sync switch)."""
        from ..engine.shared_shards import fsdp_no_sync

        return fsdp_no_sync(self.module)

    def after_step(self):
        """Count one optimizer step (the denominator of the per-step comm averages)."""
        self.steps += 1

    def comm(self):
        # FSDP2 issues its collectives from C++-backed helpers that a Python counter cannot see
        # reliably; its schedule is fixed, so the bytes are predicted from the parameter sizes:
        # all-gather in forward and again in backward (reshard_after_forward) + one reduce-scatter.
        """Predicted bytes and collectives per step from FSDP2's fixed schedule: two all-gathers and one
        reduce-scatter of the full parameters (3 x full bytes), 3 collectives per sharded module."""
        k = dist.get_world_size()
        full = sum(p.numel() * p.element_size() for p in self.module.parameters())
        n_groups = sum(1 for m in self.module.modules() if _is_fsdp(m))
        return {"bytes_per_step": 3 * full, "collectives_per_step": 3 * n_groups,
                "wire_bytes_per_step": 3 * (k - 1) / k * full, "source": "predicted (FSDP2 schedule)"}

    def full_state_dict(self):
        """The full (unsharded) model state dict on the CPU (collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_full_state_dict(self, sd):
        """Load a full model state dict into the sharded model (each rank keeps its shards)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.module, sd, options=StateDictOptions(full_state_dict=True))

    @torch.no_grad()
    def eval_logits(self, x):
        """{"full": output of the sharded model on x, in eval mode} (parameters gathered per module)."""
        with eval_mode(self.module):
            return {"full": self.module(x)}


def _is_fsdp(m):
    return type(m).__name__.startswith("FSDP")


def _is_block_list_member(model, name):
    """Direct children of a ModuleList (transformer.h, model.layers, blocks) or of a top-level
    Sequential (ResNet's layerN): the usual FSDP units, at any depth."""
    if "." not in name:
        return False
    parent_name = name.rsplit(".", 1)[0]
    parent = model.get_submodule(parent_name)
    return isinstance(parent, nn.ModuleList) or (isinstance(parent, nn.Sequential) and "." not in parent_name)


class SDPMethod(Method):
    """Subnetwork data parallelism: `model` wrapped in SubnetDataParallel with `plan` (each rank
    trains its subnetwork; pieces averaged among their owners)."""

    name = "sdp"

    def __init__(self, model, plan, regime, sync_every, scale, process_group=None, bucket_cap_mb=DEFAULT_BUCKET_CAP_MB,
                 overlap=True, simulate_rank=None, timeout=None, shard_shared=False, assignment="static",
                 reassign_every=0, assignment_shift=1):
        from ..engine import SDPConfig, SubnetDataParallel

        super().__init__(model)
        config = SDPConfig(regime=regime, sync_every=sync_every, scale=scale, bucket_cap_mb=bucket_cap_mb,
                           overlap=overlap, timeout=timeout, shard_shared=shard_shared, assignment=assignment,
                           reassign_every=reassign_every, assignment_shift=assignment_shift,
                           assignment_seed=plan.seed)
        self.sdp = SubnetDataParallel(model, plan, config, process_group=process_group, simulate_rank=simulate_rank)
        self.plan = plan
        self.simulated = simulate_rank is not None  # one rank alone: only its own subnetwork can be evaluated

    def forward_module(self):
        """The module the training forward calls (the SubnetDataParallel wrapper)."""
        return self.sdp

    def no_sync(self):
        """SDP's context that accumulates gradients without averaging them among owners."""
        return self.sdp.no_sync()

    def clip_norm_is_agreed(self) -> bool:
        """Not when every period is > 1 (local SGD: each rank clips by its own gradients' norm); with
        a period per unit group the norm adds every rank's local pieces in the one all-reduce."""
        return 1 in self.sdp.config.periods

    def clip_grad_norm_(self, max_norm, nonfinite_check: bool = False):
        """Clip by the whole model's synchronised gradient norm; returns that norm (0-d tensor);
        nonfinite_check as SubnetDataParallel.clip_grad_norm_'s."""
        # The norm of the synchronised gradient of the whole model (docs/design.md §5.1), not one rank's share.
        return self.sdp.clip_grad_norm_(max_norm, nonfinite_check=nonfinite_check)

    def parameters(self):
        """The parameters this rank's optimizer steps (its subnetwork's, from SubnetDataParallel)."""
        return self.sdp.parameters()

    def memory(self, optimizer):
        """SubnetDataParallel.memory_report, with "model_state" = parameters + gradients + optimizer state."""
        report = dict(self.sdp.memory_report(optimizer))
        report.setdefault("model_state", report["parameters"] + report["gradients"] + report["optimizer_state"])
        return report

    def comm(self):
        """SubnetDataParallel.comm_stats, with "source": counted by the SDP communicator."""
        stats = dict(self.sdp.comm_stats())
        stats.setdefault("source", "counted (SDP communicator)")
        return stats

    def full_state_dict(self):
        """The full model's state dict assembled from every rank's pieces, on rank 0 and on the
        CPU, {} elsewhere (as FSDP's; the other ranks never hold the whole model). Collective."""
        return self.sdp.full_state_dict(rank0_only=True, cpu_offload=True)

    def load_full_state_dict(self, sd):
        """Load a full model state dict: each rank keeps the pieces it holds."""
        self.sdp.load_full_state_dict(sd)

    def verify_consistency(self):
        """Raise ConsistencyError unless every piece's owners hold identical values (collective)."""
        self.sdp.verify_consistency()

    @torch.no_grad()
    def eval_logits(self, x):
        """{"full": full-model logits, "ensemble": mean of the subnetworks' logits}; a simulated rank
        gives {"subnetwork": its own subnetwork's logits}. Logits [B, num_classes] or [B, T, vocab]."""
        if self.simulated:
            return {"subnetwork": self.sdp.evaluate(x, modes=("ensemble",))["ensemble"]}
        return self.sdp.evaluate(x, modes=("full", "ensemble"))

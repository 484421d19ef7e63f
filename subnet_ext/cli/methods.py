"""The three ways to train: torch DDP, torch FSDP2 (`fully_shard`) and SDP, behind one
interface that also measures what each costs (model-state bytes, bytes handed to
collectives, activation bytes) so the report compares them side by side.
"""
from __future__ import annotations

import resource

import torch
import torch.distributed as dist
import torch.nn as nn

from ..planning.buckets import DEFAULT_BUCKET_CAP_MB
from ..comm.communicator import CommCounter


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for t (the local shard of a DTensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


class ActivationMeter:
    """Bytes of tensors autograd saves for backward during a forward (tensor accounting).

    Parameters are not activations and are skipped; storages saved twice count once.
    """

    def __init__(self):
        self.bytes = 0
        self._seen = set()

    def _pack(self, t):
        if not isinstance(t, nn.Parameter) and t.device.type != "meta":
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += key[1]
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def proc_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status in bytes ("VmRSS": resident now, "VmHWM": its
    high-water mark); 0 where the field or the file is missing (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


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

    def __call__(self, x):
        return self.module(x)

    def parameters(self):
        return self.module.parameters()

    def after_step(self):
        """Called after optimizer.step(): counts a step for the per-step comm averages."""

    def memory(self, optimizer) -> dict:
        params = sum(tensor_bytes(p) for p in self.module.parameters())
        grads = sum(tensor_bytes(p.grad) for p in self.module.parameters() if p.grad is not None)
        state = optimizer_state_bytes(optimizer)
        return {"parameters": params, "gradients": grads, "optimizer_state": state,
                "model_state": params + grads + state}

    def comm(self) -> dict:
        raise NotImplementedError

    def full_state_dict(self) -> dict:
        raise NotImplementedError

    def load_full_state_dict(self, sd: dict) -> None:
        raise NotImplementedError

    def eval_logits(self, x) -> dict:
        """{"full": logits} (plus "ensemble" for SDP), identical on every rank."""
        raise NotImplementedError

    def verify_consistency(self) -> None:
        """Raise ConsistencyError unless the copies that must agree do (collective)."""
        raise NotImplementedError(f"--verify-every is not available for --method {self.name}")


class DDPMethod(Method):
    name = "ddp"

    def __init__(self, model, device, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB):
        from torch.nn.parallel import DistributedDataParallel as DDP

        super().__init__(model)
        self.counter = CommCounter()
        self.ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                       bucket_cap_mb=bucket_cap_mb)
        self.ddp.register_comm_hook(None, _counting_allreduce_hook(self.counter))

    def __call__(self, x):
        return self.ddp(x)

    def after_step(self):
        self.counter.steps += 1

    def comm(self):
        steps = max(1, self.counter.steps)
        k = dist.get_world_size()
        per_step = self.counter.bytes / steps
        return {"bytes_per_step": per_step, "collectives_per_step": self.counter.collectives / steps,
                "wire_bytes_per_step": 2 * (k - 1) / k * per_step, "source": "counted (DDP comm hook)"}

    def full_state_dict(self):
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def load_full_state_dict(self, sd):
        self.module.load_state_dict(sd)

    def verify_consistency(self):
        from ..state.consistency import verify_replicas

        verify_replicas(self.module.state_dict())  # data parallelism: every rank is a replica

    @torch.no_grad()
    def eval_logits(self, x):
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

    def after_step(self):
        self.steps += 1

    def comm(self):
        # FSDP2 issues its collectives from C++-backed helpers that a Python counter cannot see
        # reliably; its schedule is fixed, so the bytes are predicted from the parameter sizes:
        # all-gather in forward and again in backward (reshard_after_forward) + one reduce-scatter.
        k = dist.get_world_size()
        full = sum(p.numel() * p.element_size() for p in self.module.parameters())
        n_groups = sum(1 for m in self.module.modules() if _is_fsdp(m))
        return {"bytes_per_step": 3 * full, "collectives_per_step": 3 * n_groups,
                "wire_bytes_per_step": 3 * (k - 1) / k * full, "source": "predicted (FSDP2 schedule)"}

    def full_state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_full_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.module, sd, options=StateDictOptions(full_state_dict=True))

    @torch.no_grad()
    def eval_logits(self, x):
        return {"full": self.module(x)}


def _is_fsdp(m):
    return type(m).__name__.startswith("FSDP")


def _is_block_list_member(model, name):
    """Direct children of a ModuleList/Sequential named layers/blocks/layerN: the usual FSDP units."""
    parts = name.split(".")
    if len(parts) != 2:
        return False
    parent = model.get_submodule(parts[0])
    return isinstance(parent, (nn.ModuleList, nn.Sequential)) and parts[0] != ""


class SDPMethod(Method):
    name = "sdp"

    def __init__(self, model, plan, regime, sync_every, scale, process_group=None, bucket_cap_mb=DEFAULT_BUCKET_CAP_MB,
                 overlap=True, simulate_rank=None, timeout=None, shard_shared=False):
        from ..engine import SubnetDataParallel

        super().__init__(model)
        self.sdp = SubnetDataParallel(model, plan, regime=regime, sync_every=sync_every, scale=scale,
                                      process_group=process_group, bucket_cap_mb=bucket_cap_mb, overlap=overlap,
                                      simulate_rank=simulate_rank, timeout=timeout, shard_shared=shard_shared)
        self.plan = plan

    def __call__(self, x):
        return self.sdp(x)

    def parameters(self):
        return self.sdp.parameters()

    def memory(self, optimizer):
        report = dict(self.sdp.memory_report(optimizer))
        report.setdefault("model_state", report["parameters"] + report["gradients"] + report["optimizer_state"])
        return report

    def comm(self):
        stats = dict(self.sdp.comm_stats())
        stats.setdefault("source", "counted (SDP communicator)")
        return stats

    def full_state_dict(self):
        return self.sdp.full_state_dict()

    def load_full_state_dict(self, sd):
        self.sdp.load_full_state_dict(sd)

    def verify_consistency(self):
        self.sdp.verify_consistency()

    @torch.no_grad()
    def eval_logits(self, x):
        if self.sdp.simulated:  # one rank alone: only its own subnetwork can be evaluated
            return {"subnetwork": self.sdp.evaluate(x, modes=("ensemble",))["ensemble"]}
        return self.sdp.evaluate(x, modes=("full", "ensemble"))

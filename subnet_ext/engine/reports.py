"""What SubnetDataParallel reports about itself: communication counts, memory held, and
the plan's prediction of model-state bytes. Pure functions of what they are given, so
the engine's methods stay thin wrappers."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..planning.costs.comm_costs import predicted_comm
from ..planning.costs.memory_model import model_state
from ..planning.sharding import predicted_fsdp_comm
from ..measure.storage import local_tensor, storage_counter


def comm_stats(counter, plan, rank: int, strategy: str, strategy_costs, regime: str, bucket_cap_bytes: float,
               averager, direct_gradient_runs: int, simulated: bool, shard_shared: bool = False,
               reassignments=()) -> dict:
    """Bytes handed to collectives and collectives issued, in total and per optimizer step.

    Args:
        counter: the engine's CommCounter. averager: its BucketedAverager.
        plan, rank, strategy, regime, bucket_cap_bytes: what the prediction is made for.
        shard_shared: FSDP2 handles the shared parameters; "fsdp" gives its bytes and
            collectives per step, predicted from sizes (FSDP2 issues them, SDP does not count them).
    "reduction" names how gradient buckets are averaged ("all_reduce", or a comm hook's name,
    e.g. "bfloat16_compress_hook" for reduce_dtype=torch.bfloat16); "predicted_per_sync" is
    None-valued for a hook that does not say its bytes (no `collective_bytes`). "reassignments": per change of
    assignment (an ownership schedule), its step, transfers and the bytes this rank's sends were predicted
    to carry (by_quantity["reassign"] counts what they carried).
    """
    steps = max(1, counter.steps)
    return {
        "strategy": strategy, "strategy_costs": strategy_costs, "steps": counter.steps,
        "bytes": counter.bytes, "collectives": counter.collectives,
        "bytes_per_step": counter.bytes / steps, "collectives_per_step": counter.collectives / steps,
        "by_quantity": dict(counter.by_quantity),
        "predicted_per_sync": predicted_comm(plan, rank, strategy, regime, bucket_cap_bytes, shard_shared=shard_shared,
                                             wire=averager.reduction if averager.average_gradients else None),
        "reduction": averager.reduction.name if averager.average_gradients else "all_reduce",
        "fsdp": predicted_fsdp_comm(plan) if shard_shared else None,
        "buckets": len(averager.states), "overlap": averager.overlap,
        "buckets_issued_during_backward": averager.issued_during_backward,
        "direct_gradient_runs": direct_gradient_runs,
        "simulated": simulated,
        "reassignments": [dict(r) for r in reassignments],
    }


def memory_report(module: nn.Module, extra_params: list, averager, device: torch.device, optimizer=None,
                  shared_shards=None, refresh=None) -> dict:
    """Bytes one rank holds; see SubnetDataParallel.memory_report.

    Args:
        module: the wrapped model. extra_params: full tensors held outside its parameters
            (RankLayout.local_tensors()). averager: the BucketedAverager (its buffers).
        device: where the model lives (CUDA: the allocator's peak is reported).
        optimizer: counts its tensor state when given.
        shared_shards: the engine's SharedShards (shard_shared=True): DTensors count their
            local shard, and "sharded_shared" reports the shards' parameter bytes.
        refresh: the backward regime's {period: CopyRefresher}: "refresh_buffer" is their persistent
            buffers (0 before the first refresh; None in the forward regime).
    """
    nbytes = storage_counter()
    params = nbytes([local_tensor(p) for p in module.parameters()] + list(extra_params))
    bucket_storages = averager.buffer_storages()
    grad_list = [local_tensor(p.grad) for p in module.parameters() if p.grad is not None]
    in_buffers = {(g.data_ptr(), g.numel() * g.element_size()) for g in grad_list
                  if g.untyped_storage().data_ptr() in bucket_storages}
    grads = nbytes([g for g in grad_list if g.untyped_storage().data_ptr() not in bucket_storages])
    in_buffer_bytes = sum(n for _, n in in_buffers)
    grads += in_buffer_bytes
    state = 0
    if optimizer is not None:
        state = nbytes([local_tensor(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)])
    buffers = nbytes(list(module.buffers()))
    # Peak activations are measurable on CUDA (allocator peak, which includes the model
    # state); on CPU the training loop measures them with saved-tensor accounting.
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"parameters": params, "gradients": grads, "optimizer_state": state, "buffers": buffers,
            "model_state": params + grads + state, "peak_allocated": peak,
            "communication_buffers": averager.buffer_bytes,
            "gradients_in_buffers": in_buffer_bytes,
            "refresh_buffer": sum(r.buffer_bytes for r in refresh.values()) if refresh else None,
            "sharded_shared": shared_shards.local_bytes() if shared_shards is not None else None}


def predicted_model_state_bytes(plan, rank: int, regime: str, optimizer_state_per_param: float = 2.0,
                                shard_shared: bool = False) -> float:
    """The memory model's parameters + gradients + optimizer state of `rank`, in bytes
    (planning/memory_model.model_state; optimizer state: `optimizer_state_per_param` tensors
    of each owned parameter's size, AdamW's 2 by default)."""
    return float(sum(model_state(plan, rank, regime, optimizer_state_per_param, shard_shared).values()))

"""Per-rank step memory of the baselines SDP is compared with: torch DDP and torch FSDP2.

Both predict from a coverage-1 plan of the model (every unit held by every rank: DDP's and
FSDP2's updates), so the same activation trace (planning/costs/activation_trace.py) and the same
three moments as SDP's (planning/costs/memory_model.py) apply:

- DDP (`gradient_as_bucket_view=False`, torch's default): SDP at C = 1 computes the same
  step, its gradients living in the bucket buffers; DDP keeps its buckets (one copy of every
  gradient, allocated at wrap time) beside the gradients autograd accumulates, so from the
  end of backward to the optimizer step a second copy of every gradient is alive.
- FSDP2 (`fully_shard` on each residual block, then on the root, as jobs/methods.py and
  bench/memory_1b.py wrap): parameters, gradients and optimizer state are sharded over the
  K ranks (dim 0, padded to a multiple of K rows); every rank runs the whole model, so its
  activations are the full model's; the root's own parameters (embeddings, final norm, LM
  head) stay gathered from the forward through the backward; a block is gathered for its
  forward and again for its backward, the next one prefetched while its all-gather output
  is copied out (three blocks' bytes at once); the root's gradients are reduce-scattered at
  the end of the backward, through an input buffer of their size.

`bench/memory_1b.py` puts these predictions beside `torch.cuda.max_memory_allocated` on a
GPU; tests/planning/test_replicated_memory.py checks them on CPU steps (StepMemoryMeter).
"""
from __future__ import annotations

import math

from .activation_trace import ActivationTrace
from .memory_model import _tensor_bytes, activations, optimizer_moments, peak_of, step_moments, update_temporaries


def _check_full_coverage(plan, what: str) -> None:
    if not bool(plan.owners.all()):
        raise ValueError(f"{what}: the plan must hold every unit on every rank (plan_subnetworks(model, K, "
                         f"coverage=1.0, ...)), got coverage {plan.coverage:g}")


def predict_ddp_step_memory(plan, trace: ActivationTrace | None = None, optimizer="adamw",
                            activation_checkpointing: bool = False, optimizer_kernel: str = "for-loop",
                            gradient_as_bucket_view: bool = False) -> dict:
    """Predicted peak bytes of one torch DDP step on one rank (predict_step_memory's dict).

    Args:
        plan: a coverage-1 plan of the model at the job's world size (block level).
        trace, optimizer, activation_checkpointing, optimizer_kernel: as predict_step_memory's.
        gradient_as_bucket_view: DDP's option; True: the gradients are views of the buckets.
    Raises:
        ValueError: the plan does not hold every unit on every rank.
    """
    _check_full_coverage(plan, "predict_ddp_step_memory")
    state, moments = step_moments(plan, 0, trace, "forward", optimizer, False, activation_checkpointing,
                                  optimizer_kernel=optimizer_kernel)
    if not gradient_as_bucket_view:
        copy = plan.full_bytes  # the bucket buffers beside the gradients
        for at in ("end of backward", "optimizer step"):
            grads, kept, transient = moments[at]
            moments[at] = (grads, kept, transient + copy)
    return peak_of(state, moments)


def _shard(plan, name: str, world_size: int) -> float:
    """Bytes of one rank's FSDP2 shard of parameter `name` (ceil(rows / K) rows)."""
    shape = plan.tensor_shapes[name]
    if not shape:
        return _tensor_bytes(plan, name) / world_size
    return _tensor_bytes(plan, name) / shape[0] * math.ceil(shape[0] / world_size)


def predict_fsdp_step_memory(plan, trace: ActivationTrace | None = None, world_size: int | None = None,
                             optimizer="adamw", activation_checkpointing: bool = False,
                             optimizer_kernel: str = "for-loop") -> dict:
    """Predicted peak bytes of one torch FSDP2 step on one rank (predict_step_memory's dict).

    Args:
        plan: a coverage-1 block-level plan of the model (its block units are FSDP2's
            modules; its shared parameters, the root's).
        world_size: K, the ranks the state is sharded over (default: the plan's).
        trace, optimizer, activation_checkpointing, optimizer_kernel: as predict_step_memory's.
    Raises:
        ValueError: the plan does not hold every unit on every rank.
    """
    _check_full_coverage(plan, "predict_fsdp_step_memory")
    k = world_size or plan.world_size
    params = [n for n in plan.param_names if plan.is_float(n)]
    shards = sum(_shard(plan, n, k) for n in params)
    root = sum(_tensor_bytes(plan, n) for n in plan.shared_params if plan.is_float(n))
    blocks = [sum(_tensor_bytes(plan, n) for n in dict.fromkeys(g.params)) for g in plan.groups if g.kind == "block"]
    block = max(blocks, default=0.0)
    acts, recomputed = activations(plan, 0, trace, "forward", activation_checkpointing) if trace else (0.0, 0.0)
    largest_saved = trace.largest if trace else 0.0
    state = {"parameters": shards, "gradients": shards, "optimizer_state": optimizer_moments(optimizer) * shards}
    moments = {  # (gradients alive, activations alive, transient), as memory_model.step_moments
        "start of backward": (0.0, acts, root + 3 * block + 2 * largest_saved + recomputed),
        # The root's gathered parameters, its unsharded gradients and their reduce-scatter input.
        "end of backward": (shards, 0.0, 3 * root),
        "optimizer step": (shards, 0.0, update_temporaries(optimizer_kernel, shards, max(
            (_shard(plan, n, k) for n in params), default=0.0))),
    }
    return peak_of(state, moments)

"""The memory model: one rank's bytes over one training step, predicted from the plan.

Every prediction of memory in the project comes from here (the engine's reports,
`subnet-plan`'s cost table, `plan_for_memory`, the benchmarks). Units are bytes, per rank.

Model state (held for the whole step):
- parameters: the forward regime holds the shared parameters and its units' slices; the
  backward regime holds the full model (units it does not own are refreshed by their owners).
  With `shard_shared`, the shared parameters count as this rank's FSDP2 shard.
- gradients: of what the rank owns (both regimes). Averaged ones live in the communication
  buckets, kept between steps; a unit with one owner has its gradient allocated in backward
  and freed by zero_grad.
- optimizer state: `optimizer_moments(optimizer)` tensors of the owned parameters' size
  (AdamW/Adam: exp_avg and exp_avg_sq; SGD with momentum: the momentum buffer; plain SGD: none).
Persistent extras the engine keeps: the backward regime's refresh buffer (the largest
broadcast: the most bytes one rank leads among the units some rank lacks); at the neuron
level in the forward regime, the
weights gathered from the owned runs for the forward (the units' bytes again).

Activations (planning/costs/activation_trace.py): the shared part plus the owned units' parts in
the forward regime (only the subnetwork runs), the full model's in the backward regime (the
whole forward runs). With activation checkpointing the blocks keep only their inputs and one
block's saved tensors are recomputed at a time in backward (a transient).

The peak is the largest of three moments, found by metering real steps
(measure/step_memory.py; tests/planning/test_memory_model.py checks the sum within 10%):
- start of backward: persistent + bucketed gradients + activations + two of the largest saved
  tensors' size (the gradient flowing back and the next one) [+ one recomputed block];
- end of backward: persistent + every gradient + gradients not yet in their bucket (at most
  the largest bucket this rank fills, or at the neuron level in the forward regime the
  gathered weights' gradient) + one gradient being computed (the largest parameter). Under
  activation checkpointing every bucket's gradients are counted as waiting: measured, the
  GPT's recomputed blocks leave them all waiting (the prediction is exact there), where
  the residual MLP's wait for one bucket (over-predicted by 13% at C = 0.5, K = 4);
- optimizer step: persistent + every gradient + the update's temporaries, by how the optimizer
  runs (`optimizer_kernel`): "for-loop" (one parameter at a time, torch's default on the CPU):
  twice the largest parameter; "foreach" (multi-tensor, torch's default on CUDA): one tensor
  the size of every owned parameter at once (AdamW's sqrt(exp_avg_sq) list, one param group
  of one dtype); "fused" (one
  kernel updating in place): none. Measured with StepMemoryMeter on CPU steps, where each
  can be forced (tests/planning/test_memory_model.py).
Mixed precision (a trace made with `compute_dtype`, i.e. autocast over fp32 parameters): the
activations are the traced ones (autocast's dtypes and its copies of the weights); the
gradient being computed at the end of backward is also held in the compute dtype before it
is added to the fp32 gradient.
With `shard_shared`, FSDP2's gathered shared parameters are alive at both moments, and their
unsharded gradient at the end of backward.
"""
from __future__ import annotations

import weakref

import torch

from .activation_trace import ActivationTrace
from ..buckets import DEFAULT_BUCKET_CAP_MB, build_buckets, refresh_broadcasts
from .comm_costs import choose_strategy
from ..pieces import global_pieces
from ..sharding import communicated_pieces, shard_bytes, sharded_names
from ...vocabulary import REGIMES, dtype_size

OPTIMIZER_KERNELS = ("for-loop", "foreach", "fused")
_MOMENTS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}


def optimizer_moments(optimizer="adamw") -> float:
    """Optimizer-state tensors per parameter, each of the parameter's size and dtype.

    optimizer: "adamw", "adam", "sgd" (no momentum), "sgd_momentum", a torch.optim.Optimizer
    instance (SGD's momentum read from its first param group) or class (SGD: no momentum),
    or a number: the tensors per parameter itself (e.g. 2.0).

    Raises:
        ValueError: an optimizer this model does not know.
    """
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool) and optimizer >= 0:
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        if isinstance(optimizer, torch.optim.SGD):
            return 1 if optimizer.param_groups[0].get("momentum", 0) else 0
        optimizer = type(optimizer)
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.__name__
    key = str(optimizer).lower()
    if key not in _MOMENTS:
        raise ValueError(f"memory model: unknown optimizer {optimizer!r}; expected one of {sorted(_MOMENTS)}, "
                         "a torch.optim.Adam/AdamW/SGD instance or class")
    return _MOMENTS[key]


def optimizer_kernel(optimizer=None, device="cpu") -> str:
    """How a torch optimizer runs its update: "for-loop", "foreach" or "fused" (see the module
    docstring). optimizer: an instance (its `foreach`/`fused` defaults read), or None; an unset
    choice is torch's default for `device`: foreach on CUDA, for-loop on the CPU."""
    defaults = getattr(optimizer, "defaults", {}) if optimizer is not None else {}
    if defaults.get("fused"):
        return "fused"
    if defaults.get("foreach") is None:
        return "foreach" if torch.device(device).type == "cuda" else "for-loop"
    return "foreach" if defaults["foreach"] else "for-loop"


def update_temporaries(kernel: str, owned_bytes: float, largest_bytes: float) -> float:
    """Bytes the optimizer's update allocates at once: see the module docstring.

    Raises:
        ValueError: an unknown kernel.
    """
    if kernel not in OPTIMIZER_KERNELS:
        raise ValueError(f"memory model: optimizer_kernel must be one of {OPTIMIZER_KERNELS}, got {kernel!r}")
    return {"for-loop": 2 * largest_bytes, "foreach": owned_bytes, "fused": 0.0}[kernel]


def gradient_temporary(largest_bytes: float, trace) -> float:
    """The gradient being computed at the end of backward: the largest parameter's, plus its
    half-precision copy under autocast (a trace made with compute_dtype)."""
    dtype = getattr(trace, "compute_dtype", None)
    if dtype is None:
        return largest_bytes
    return largest_bytes * (1 + dtype_size(dtype) / 4)


def _tensor_bytes(plan, name: str) -> float:
    """Bytes of the original model's tensor `name` (its shape and dtype as the plan records them)."""
    return float(plan.numel_of(name) * dtype_size(plan.tensor_dtypes[name]))


def _shared_param_bytes(plan) -> float:
    return sum(_tensor_bytes(plan, n) for n in sharded_names(plan))


def model_state(plan, rank: int, regime: str = "forward", optimizer="adamw", shard_shared: bool = False) -> dict:
    """{"parameters", "gradients", "optimizer_state"} bytes `rank` holds through a step (see the
    module docstring); their sum is the model state."""
    if regime not in REGIMES:
        raise ValueError(f"memory model: regime must be one of {REGIMES}, got {regime!r}")
    owned = float(plan.bytes_per_rank[rank])
    params = plan.full_bytes if regime == "backward" else owned
    if shard_shared:
        # The shared parameters are this rank's shard; their gradient and state too (FSDP2).
        cut = _shared_param_bytes(plan) - shard_bytes(plan, rank)
        owned, params = owned - cut, params - cut
    return {"parameters": params, "gradients": owned, "optimizer_state": optimizer_moments(optimizer) * owned}


def replicated_model_state(plan, optimizer="adamw", world_size: int = 1) -> float:
    """Model-state bytes per rank of the whole model replicated (DDP; world_size=1) or sharded
    evenly over `world_size` ranks (FSDP): parameters + gradients + optimizer state."""
    return plan.full_bytes * (2 + optimizer_moments(optimizer)) / world_size


_PER_PLAN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # plan -> {key: what every rank shares}


def _per_plan(plan, key, compute):
    """compute(), once per (plan, key): what is the same for every rank of a plan (its buckets, its
    refresh buffer, every rank's gathered weights) is computed once, not once per rank and
    configuration (plan_for_memory asks for dozens of them on a 1B model). Plans never change."""
    memo = _PER_PLAN.setdefault(plan, {})
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def _bucket_sizes(plan, shard_shared: bool, bucket_cap_bytes: float) -> list[tuple[tuple, float]]:
    """[(owners, bytes)] of every bucket buffer of the plan's communication (the same on every rank)."""
    strategy, _ = choose_strategy(plan, shard_shared=shard_shared, bucket_cap_bytes=bucket_cap_bytes)
    buckets = build_buckets(plan, communicated_pieces(plan, shard_shared), strategy, bucket_cap_bytes)
    return [(b.owners, float(b.nbytes)) for b in buckets]


def _buckets(plan, rank: int, shard_shared: bool, bucket_cap_bytes: float) -> tuple[float, float]:
    """(bytes of every bucket buffer `rank` fills, bytes of its largest): the buffers are kept
    between steps; a zero-filled bucket spans pieces the rank does not hold (comm/averaging.py)."""
    if plan.world_size == 1:
        return 0.0, 0.0
    every = _per_plan(plan, ("buckets", shard_shared, bucket_cap_bytes),
                      lambda: _bucket_sizes(plan, shard_shared, bucket_cap_bytes))
    sizes = [n for owners, n in every if rank in owners]
    return sum(sizes), max(sizes, default=0.0)


def _largest_param(plan, rank: int) -> float:
    """Bytes of the largest parameter tensor (or owned slice of one) the rank computes a gradient for."""
    sizes = [_tensor_bytes(plan, n) for n in plan.shared_params]
    owned = plan.owners[rank]
    for g, (a, b) in zip(plan.groups, plan.unit_ranges):
        share = int(owned[a:b].sum())
        if share:
            names = g.params if g.kind == "block" else [m.name for m in g.members if not m.buffer]
            per = 1.0 if g.kind == "block" else share / g.size
            sizes += [_tensor_bytes(plan, n) * per for n in dict.fromkeys(names)]
    return float(max(sizes, default=0.0))


def _skipped_relus(plan, rank: int, trace: ActivationTrace, regime: str) -> float:
    """Forward regime, block level: a skipped block whose output passes a ReLU (skip
    "shortcut_relu") still applies it, and the ReLU saves its output (engine/regimes/surgery.py)."""
    if regime != "forward":
        return 0.0
    return sum(trace.block_outputs.get(g.path, 0.0) for g, (a, _) in zip(plan.groups, plan.unit_ranges)
               if g.kind == "block" and g.skip == "shortcut_relu" and not plan.owners[rank, a])


def activations(plan, rank: int, trace: ActivationTrace, regime: str = "forward",
                activation_checkpointing: bool = False) -> tuple[float, float]:
    """(activation bytes kept through the forward, bytes recomputed at once in backward) of `rank`.

    Forward regime: the shared part plus the owned units' parts; backward regime: the full
    model's. With activation checkpointing: what runs outside the blocks plus each block's
    input (a block-level rank runs only its blocks), and one block's saved tensors recomputed.
    """
    held = plan.owners[rank].double()
    relus = _skipped_relus(plan, rank, trace, regime)
    kept = trace.shared + float(held @ trace.unit) + relus
    if regime == "backward":  # others' units run too, keeping what their input gradient needs
        kept += float((1 - held) @ (trace.unit - trace.unit_weight_inputs))
    if not activation_checkpointing or not trace.block_inputs:
        return kept, 0.0
    inside = sum(trace.block_saved.values())
    outside = max(0.0, trace.full - inside)  # saved while no residual block runs: every rank, every regime
    runs = dict.fromkeys(trace.block_inputs, 1.0)
    if plan.level == "block" and regime == "forward":
        unit_of = {g.path: a for g, (a, _) in zip(plan.groups, plan.unit_ranges) if g.kind == "block"}
        runs = {p: float(held[unit_of[p]]) if p in unit_of else 1.0 for p in runs}
    # A neuron-level rank's blocks save its share of each block's bytes (the held fraction of
    # what the blocks save in all); a block-level rank's blocks save all of theirs.
    share = (kept - outside) / inside if plan.level == "neuron" and inside else 1.0
    recomputed = max((trace.block_saved[p] * share for p, r in runs.items() if r), default=0.0)
    return outside + relus + sum(trace.block_inputs[p] * r for p, r in runs.items()), recomputed


def _gathered_bytes(plan, rank: int, regime: str) -> float:
    """Neuron level, forward regime: the bytes of the weights gathered for the forward from the
    rank's pieces, in the groups where its units form more than one piece (a run of units with
    one owner set is one piece; a single piece is the weight itself, nothing is gathered)."""
    if (regime, plan.level) != ("forward", "neuron"):
        return 0.0
    return float(_per_plan(plan, "gathered", lambda: _gathered_per_rank(plan))[rank])


def _gathered_per_rank(plan) -> torch.Tensor:
    """float64 [K]: _gathered_bytes of every rank at once, in tensors (a 1B model has tens of
    thousands of units)."""
    sets = plan.unit_owner_sets()
    index = {s: i for i, s in enumerate(dict.fromkeys(sets))}
    set_id = torch.tensor([index[s] for s in sets])
    group_of = torch.cat([torch.full((b - a,), g) for g, (a, b) in enumerate(plan.unit_ranges)])
    owned = plan.owners
    same_run = torch.zeros_like(owned)  # unit u continues the piece of unit u - 1 on that rank
    same_run[:, 1:] = owned[:, :-1] & (set_id[1:] == set_id[:-1]) & (group_of[1:] == group_of[:-1])
    shape = (plan.world_size, len(plan.unit_ranges))
    pieces = torch.zeros(shape, dtype=torch.float64).index_add_(1, group_of, (owned & ~same_run).double())
    held = torch.zeros(shape, dtype=torch.float64).index_add_(1, group_of, owned.double() * plan.unit_bytes)
    return (held * (pieces > 1)).sum(1)


def _communicated_gradients(plan, rank: int, shard_shared: bool) -> float:
    """Bytes of the rank's gradients that are averaged (held in bucket buffers between steps): its
    units with two or more owners, and the shared parameters unless FSDP2 takes them."""
    shared = plan.shared_bytes if plan.world_size > 1 and not shard_shared else 0.0
    return shared + float(plan.owners[rank].double() @ (plan.unit_bytes * (plan.owner_count > 1)))


def _refresh_buffer_bytes(plan) -> float:
    """The backward regime's refresh buffer (comm/refresh.py): one buffer serves every leader's
    broadcast in turn, sized to the largest (buckets.refresh_broadcasts: the layout the engine packs);
    allocated on every rank, simulated ones too. Once per plan (the budget planner asks for every rank)."""
    return _per_plan(plan, "refresh", lambda: float(max((b.nbytes for _, b in refresh_broadcasts(plan, global_pieces(plan))),
                                                        default=0)))


def _persistent_extras(plan, rank: int, regime: str, shard_shared: bool, buckets: float, communicated: float) -> float:
    """Bytes the engine keeps besides model state: bucket buffers beyond the gradients they hold
    (zero-filled buckets), the backward regime's refresh buffer, the neuron-level forward
    regime's gathered weights, FSDP2's gathered shared parameters."""
    extra = max(0.0, buckets - communicated)
    extra += _refresh_buffer_bytes(plan) if regime == "backward" else 0.0
    extra += _gathered_bytes(plan, rank, regime)
    if shard_shared:
        extra += _shared_param_bytes(plan)
    return extra


def step_moments(plan, rank: int, trace: ActivationTrace | None = None, regime: str = "forward",
                 optimizer="adamw", shard_shared: bool = False, activation_checkpointing: bool = False,
                 bucket_cap_bytes: float = DEFAULT_BUCKET_CAP_MB * 2**20,
                 optimizer_kernel: str = "for-loop") -> tuple[dict, dict]:
    """(model_state(...), {moment: (gradient bytes alive, activation bytes alive, transient bytes)})
    for the three moments of the module docstring; predict_step_memory's arguments."""
    state = model_state(plan, rank, regime, optimizer, shard_shared)
    all_buckets, largest_bucket = _buckets(plan, rank, shard_shared, bucket_cap_bytes)
    communicated = min(_communicated_gradients(plan, rank, shard_shared), state["gradients"])
    extras = _persistent_extras(plan, rank, regime, shard_shared, all_buckets, communicated)
    acts, recomputed = activations(plan, rank, trace, regime, activation_checkpointing) if trace else (0.0, 0.0)
    largest = _largest_param(plan, rank)
    update = update_temporaries(optimizer_kernel, state["gradients"], largest)  # what the optimizer steps
    return state, {
        "start of backward": (communicated, acts, extras + 2 * (trace.largest if trace else 0.0) + recomputed),
        "end of backward": (state["gradients"], 0.0,
                            extras + max(all_buckets if activation_checkpointing else largest_bucket,
                                         _gathered_bytes(plan, rank, regime)) + gradient_temporary(largest, trace)),
        "optimizer step": (state["gradients"], 0.0, extras + update),
    }


def peak_of(state: dict, moments: dict) -> dict:
    """The largest of `moments` (step_moments's) as predict_step_memory's dict."""
    at = max(moments, key=lambda m: sum(moments[m]))
    grads, kept, transient = moments[at]
    held = state["parameters"] + grads + state["optimizer_state"]
    return dict(state, gradients=grads, model_state=held, activations=kept, transient=transient,
                total=held + kept + transient, peak_at=at)


def predict_step_memory(plan, rank: int, trace: ActivationTrace | None = None, regime: str = "forward",
                        optimizer="adamw", shard_shared: bool = False, activation_checkpointing: bool = False,
                        bucket_cap_bytes: float = DEFAULT_BUCKET_CAP_MB * 2**20,
                        optimizer_kernel: str = "for-loop") -> dict:
    """Predicted peak bytes of one training step (forward, backward, optimizer step) on `rank`.

    Args:
        plan: the SubnetPlan. trace: trace_activations(model, plan, one rank's batch); None
            predicts model state only (activations and their temporaries count 0). A trace
            made with compute_dtype predicts autocast training over the plan's dtypes.
        regime, optimizer, shard_shared, activation_checkpointing, bucket_cap_bytes: the
            configuration (SubnetDataParallel's and the training loop's).
        optimizer_kernel: "for-loop", "foreach" or "fused" (optimizer_kernel(optimizer, device)
            reads it off a torch optimizer).
    Returns:
        {"parameters", "gradients", "optimizer_state", "model_state", "activations",
        "transient", "total", "peak_at"}: bytes at the predicted peak ("gradients": those alive
        then); "total" = model_state + activations + transient; "peak_at": "start of
        backward", "end of backward" or "optimizer step".
    """
    return peak_of(*step_moments(plan, rank, trace, regime, optimizer, shard_shared, activation_checkpointing,
                                 bucket_cap_bytes, optimizer_kernel))


def rank_memories(plan, trace: ActivationTrace | None = None, **config) -> list[dict]:
    """predict_step_memory of every rank, in rank order (a budget per rank reads each)."""
    return [predict_step_memory(plan, rank, trace, **config) for rank in range(plan.world_size)]


def worst_of(per_rank: list[dict]) -> dict:
    """The prediction of rank_memories' list with the largest total (the first such), with "rank" added."""
    worst = max(range(len(per_rank)), key=lambda r: per_rank[r]["total"])
    return dict(per_rank[worst], rank=worst)


def worst_rank_memory(plan, trace: ActivationTrace | None = None, **config) -> dict:
    """predict_step_memory of the rank with the largest predicted total (the first such), with "rank" added."""
    return worst_of(rank_memories(plan, trace, **config))

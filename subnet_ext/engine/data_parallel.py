"""SubnetDataParallel: train a structured subnetwork per rank, average among owners.

    plan = plan_subnetworks(model, world_size=K, coverage=0.5, level="block")
    sdp = SubnetDataParallel(model, plan, regime="forward")
    opt = torch.optim.AdamW(sdp.parameters(), lr=3e-4)
    loss_fn(sdp(x), y).backward()     # gradients averaged among owners during the backward
    opt.step(); opt.zero_grad()       # (backward regime: other ranks' copies refreshed)

Synchronisation points: with sync_every=1 the gradients are averaged in buckets
(averaging.py): each bucket's all-reduce is issued from the gradient hooks once its
gradients are ready, and a callback queued on the autograd engine by the first hook
issues the rest, waits and unpacks when the backward ends. After each optimizer step
over these parameters (a global optimizer step hook) the engine counts the step,
averages parameters every `sync_every` steps when sync_every > 1, and in the backward
regime refreshes the copies of units this rank does not own. All of these issue
collectives in one global order, so they cannot deadlock.
"""
from __future__ import annotations

import contextlib
import copy
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..comm.averaging import BucketedAverager, CopyRefresher
from ..planning.buckets import DEFAULT_BUCKET_CAP_MB, build_buckets
from ..comm.communicator import CommCounter, Communicator, SimulatedCommunicator
from ..comm import collectives
from ..state import consistency
from . import clipping, guard
from ..state import optim_state
from ..comm.collectives import as_timedelta
from ..planning.costs import DEFAULT_LATENCY_BYTES, choose_strategy, predicted_comm
from ..planning.pieces import global_pieces, local_starts, rectangle
from ..planning.plan import SubnetPlan, model_fingerprint
from ..state.assembly import assemble, load_pieces
from .surgery import attach_direct_gradients, materialise_forward, prepare_backward

REGIMES = ("forward", "backward")
SCALES = ("none", "inverse")


def _meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of the model whose parameters and persistent buffers live on the meta device
    (no memory); non-persistent buffers (e.g. rotary tables) are real copies."""
    memo = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for m in model.modules():
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _world_and_rank(plan: SubnetPlan, process_group, simulate_rank) -> tuple[int, int]:
    """(world size, rank) this engine runs as: the simulated rank, the group's, or (1, 0)."""
    if simulate_rank is not None:
        if process_group is not None:
            raise ValueError("simulate_rank runs one rank alone; it takes no process_group")
        if not isinstance(simulate_rank, int) or isinstance(simulate_rank, bool) or \
                not 0 <= simulate_rank < plan.world_size:
            raise ValueError(f"simulate_rank must be a rank of the plan's world size {plan.world_size}, "
                             f"got {simulate_rank!r}")
        return plan.world_size, simulate_rank
    if dist.is_initialized():
        return dist.get_world_size(process_group), dist.get_rank(process_group)
    if process_group is not None:
        raise ValueError("a process_group was given but torch.distributed is not initialised")
    return 1, 0


def _weak_call(engine_ref, fn):
    """A hook calling fn(engine, *args) while the engine lives, and nothing after."""

    def hook(*args):
        engine = engine_ref()
        if engine is not None:
            return fn(engine, *args)
        return None

    return hook


class SubnetDataParallel(nn.Module):
    """Wraps `model` (modified in place) so this rank trains its subnetwork of `plan`.

    Args:
        model: the full model, identical on every rank (rank 0's values are broadcast).
        plan: from plan_subnetworks(model, world_size, ...) on the same model structure.
        regime: "forward" (materialise only the subnetwork) or "backward" (full model,
            owned weight gradients and optimizer state only).
        sync_every: H; 1 averages gradients every step, H > 1 averages parameters every
            H optimizer steps (local SGD within owner groups).
        scale: "inverse" multiplies the input of each neuron group's consumer by h/h_k
            (forward regime, neuron level); "none" does nothing.
        process_group: the group the plan's ranks live in (default: the world).
        strategy: "auto" (cost model), "groups" (collectives per owner set) or
            "zero_filled" (world all-reduces, zeros where a rank holds nothing).
        bucket_cap_mb: a bucket (one packed collective) closes at this many MiB.
        overlap: issue each bucket's all-reduce during the backward as soon as its
            gradients are ready (False: all of them when the backward ends; same results).
        simulate_rank: run only rank r of the plan's K ranks, alone, without
            torch.distributed: collectives are no-ops that still count their bytes, so the
            memory and time of one rank of a K-rank job can be measured on one device.
        timeout: seconds any of the engine's collectives may take before it raises a
            CollectiveError naming the operation and the group (None: the process
            group's own timeout). See collectives.py.
    """

    def __init__(self, model: nn.Module, plan: SubnetPlan, regime: str = "forward", sync_every: int = 1,
                 scale: str = "none", process_group=None, strategy: str = "auto",
                 latency_bytes: float = DEFAULT_LATENCY_BYTES, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                 overlap: bool = True, simulate_rank: int | None = None, timeout: float | None = None):
        super().__init__()
        if not isinstance(plan, SubnetPlan):
            raise ValueError(f"plan must be a SubnetPlan, got {type(plan).__name__}")
        if regime not in REGIMES:
            raise ValueError(f"regime must be 'forward' or 'backward', got {regime!r}")
        if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
        if scale not in SCALES:
            raise ValueError(f"scale must be 'none' or 'inverse', got {scale!r}")
        if scale == "inverse" and (plan.level != "neuron" or regime != "forward"):
            raise ValueError(f"scale='inverse' applies to the neuron level in the forward regime; this plan is "
                             f"level={plan.level!r} and regime={regime!r}")
        if not (isinstance(bucket_cap_mb, (int, float)) and 0 < bucket_cap_mb < float("inf")):
            raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        self.simulated = simulate_rank is not None
        self.world_size, self.rank = _world_and_rank(plan, process_group, simulate_rank)
        if plan.world_size != self.world_size:
            raise ValueError(f"the plan was made for world size {plan.world_size}, but the process group has "
                             f"{self.world_size} ranks; make the plan with world_size={self.world_size}")
        fingerprint = model_fingerprint(model)
        if fingerprint != plan.fingerprint:
            raise ValueError(f"the plan was made for another model (structure fingerprint {plan.fingerprint}, "
                             f"this model {fingerprint}); plan this model with plan_subnetworks")
        self.plan, self.regime, self.sync_every, self.scale = plan, regime, sync_every, scale
        self.process_group = process_group
        as_timedelta(timeout)  # validates it before any collective
        self.timeout = timeout
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._sync_initial_state(model)
        self.__dict__["_skeleton"] = _meta_skeleton(model)  # not a submodule: no state of its own

        self.pieces = global_pieces(plan)
        if regime == "forward":
            self._hooks = materialise_forward(model, plan, self.pieces, self.rank, scale)
            self._piece_params, self._value_refs = {}, {}
        else:
            self._hooks = []
            self._piece_params, self._value_refs = prepare_backward(model, plan, self.pieces, self.rank)
        self.module = model
        self.local_start = local_starts(self.pieces, self.rank, compact=regime == "forward")
        self.integer_entries = self._integer_entries()

        self._setup_communication(strategy, latency_bytes, bucket_cap_mb * 2**20, overlap, timeout)
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        self._trainable_ids = {id(p) for p in self._trainable}
        self._pieces_of_param = self._map_pieces_to_parameters()
        # Backward regime: the masked kernel writes owned weight gradients into their buckets.
        self.direct_gradient_runs = 0
        if regime == "backward" and sync_every == 1:
            self.direct_gradient_runs = attach_direct_gradients(
                model, self._piece_params, self._averager.direct_gradient_view,
                _weak_call(weakref.ref(self), lambda engine, piece: engine._pieces_ready((piece,))))
            # Their readiness comes from the kernel's call, not from the (empty) accumulate hook.
            for direct in {p for s in self._averager.states for p in s.direct}:
                del self._pieces_of_param[id(self._piece_params[direct])]
        self._queued = False
        self._sync_grads = True  # False inside no_sync()
        self.optimizer_steps = 0
        for p in self._trainable:
            self._hooks.append(p.register_post_accumulate_grad_hook(
                _weak_call(weakref.ref(self), SubnetDataParallel._on_grad_ready)))
        # Hooks hold the engine weakly. The optimizer-hook registry is global, and a tensor's
        # hooks are kept from C++, where Python's garbage collector cannot see the cycle
        # parameter -> hook -> engine -> module -> parameter: strong references would keep
        # every engine, and the process groups it holds, alive until the interpreter shuts
        # down, when destroying a gloo group can abort the process.
        step_hook = register_optimizer_step_post_hook(
            _weak_call(weakref.ref(self), SubnetDataParallel._on_optimizer_step))
        weakref.finalize(self, step_hook.remove)
        self._hooks.append(step_hook)

    def _setup_communication(self, strategy, latency_bytes, bucket_cap_bytes, overlap, timeout) -> None:
        """Strategy (cost model), bucket layout, process groups (or their simulation), averager."""
        self.bucket_cap_bytes = bucket_cap_bytes
        self.strategy, self.strategy_costs = choose_strategy(self.plan, strategy, latency_bytes, bucket_cap_bytes)
        self.counter = CommCounter()
        self.buckets = build_buckets(self.plan, self.pieces, self.strategy, bucket_cap_bytes)
        owner_sets = [b.owners for b in self.buckets]  # the groups averaging uses; the refresh uses the world
        self._comm = SimulatedCommunicator(self.world_size, self.rank, self.counter) if self.simulated else \
            Communicator(owner_sets, self.world_size, self.rank, self.process_group, self.counter, timeout)
        self._averager = BucketedAverager(self.buckets, self.rank, self._comm, self.device,
                                          {"gradients": self._resolve_grad, "parameters": self._resolve_value},
                                          overlap=overlap)
        self._refresh = CopyRefresher(self.pieces, self.rank, self.world_size, self._resolve_value, self._comm) \
            if self.regime == "backward" else None

    # ------------------------------------------------------------------ lookup
    def value_of(self, name: str) -> torch.Tensor:
        """The local tensor holding state-dict entry `name` (compact in the forward regime)."""
        if name in self._value_refs:
            module, attr = self._value_refs[name]
            return getattr(module, attr)
        path, _, leaf = name.rpartition(".")
        module = self.module.get_submodule(path)
        if leaf in module._parameters:
            return module._parameters[leaf]
        return module._buffers[leaf]

    def _integer_entries(self) -> dict:
        """Non-float entries (e.g. BatchNorm's num_batches_tracked) -> the rank that reports them."""
        out = {}
        block_of = {n: a for g, (a, _) in zip(self.plan.groups, self.plan.unit_ranges) for n in g.params + g.buffers}
        for name in self.plan.tensor_shapes:
            if self.plan.is_float(name):
                continue
            unit = block_of.get(name)
            out[name] = 0 if unit is None else int(torch.nonzero(self.plan.owners[:, unit])[0])
        return out

    def holds_whole(self, name: str) -> bool:
        try:
            self.value_of(name)
            return True
        except (AttributeError, KeyError):
            return False

    def _map_pieces_to_parameters(self) -> dict:
        """id(trainable parameter) -> the pieces held here whose gradient it carries."""
        out = {}
        for p in self.pieces:
            if not p.is_param or self.rank not in p.owners:
                continue
            param = self._piece_params.get(p)
            if param is None:
                param = self.value_of(p.name)
            if id(param) in self._trainable_ids:
                out.setdefault(id(param), []).append(p)
        return out

    def _resolve_value(self, piece):
        t = self.value_of(piece.name)
        return t, rectangle(t.shape, piece.dim, self.local_start[piece], piece.length)

    def _resolve_grad(self, piece):
        if not piece.is_param:
            return self._resolve_value(piece)  # buffers (norm statistics) are averaged as values
        if piece in self._piece_params:
            param, rect_of = self._piece_params[piece], None
        else:
            param = self.value_of(piece.name)
            rect_of = (piece.dim, self.local_start[piece], piece.length)
        if param.grad is None:
            param.grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
        elif not param.grad.is_contiguous():
            param.grad = param.grad.contiguous()
        g = param.grad
        rect = rectangle(g.shape, 0, 0, g.shape[0] if g.dim() else 1) if rect_of is None else \
            rectangle(g.shape, *rect_of)
        return g, rect

    # ------------------------------------------------------------------ sync points
    def _sync_initial_state(self, model: nn.Module) -> None:
        """Every rank starts from rank 0's values (as torch DDP does)."""
        if self.world_size == 1 or self.simulated or not dist.is_initialized():
            return
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        tensors = [t for t in model.state_dict(keep_vars=True).values()]
        by_dtype = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for ts in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in ts])
                collectives.broadcast(flat, src, self.process_group, self.timeout)
                for t, part in zip(ts, flat.split([t.numel() for t in ts])):
                    t.copy_(part.view(t.shape))

    def _on_grad_ready(self, param) -> None:
        self._pieces_ready(self._pieces_of_param.get(id(param), ()))

    def _pieces_ready(self, pieces) -> None:
        """The gradients of these held pieces are final for this backward."""
        if self.sync_every != 1 or not self._sync_grads:
            return  # local SGD (parameters are averaged after optimizer steps instead), or no_sync()
        if not self._queued:
            self._queued = True
            self._averager.start_backward()
            Variable._execution_engine.queue_callback(self._after_backward)
        with torch.no_grad():
            self._averager.grad_ready(pieces)

    def _after_backward(self) -> None:
        self._queued = False
        with torch.no_grad():
            self._averager.finish("gradients")

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if not any(id(p) in self._trainable_ids for g in optimizer.param_groups for p in g["params"]):
            return
        self.after_step()

    def after_step(self) -> None:
        """Called after each optimizer step (automatically for torch.optim optimizers)."""
        self.optimizer_steps += 1
        self.counter.steps += 1
        with torch.no_grad():
            if self.sync_every > 1 and self.optimizer_steps % self.sync_every == 0:
                self._averager.average_now("parameters")
            if self.regime == "backward":
                self._refresh()

    # ------------------------------------------------------------------ public API
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation without communication, as torch DDP's `no_sync()`.

        Backward passes run inside the context only accumulate into `.grad`; the first
        backward after it averages the accumulated sum among owners as usual:

            with sdp.no_sync():
                loss_fn(sdp(x0), y0).backward()
            loss_fn(sdp(x1), y1).backward()   # averages grad(x0) + grad(x1)
            optimizer.step()
        """
        previous = self._sync_grads
        self._sync_grads = False
        try:
            yield
        finally:
            self._sync_grads = previous

    def parameters(self, recurse: bool = True):
        """What the optimizer must update: this rank's owned (and shared) parameters."""
        return iter(self._trainable)

    def full_state_dict(self) -> dict:
        """The whole model's state dict (original names and shapes), identical on every rank.

        Collective: every rank must call it."""
        self._refuse_if_simulated("full_state_dict")
        return assemble(self, reduce=True)

    def local_full_state_dict(self) -> dict:
        """This rank's values in the original names and shapes, NaN where it holds nothing."""
        if self.regime == "backward":
            return {n: self.value_of(n).detach().clone() for n in self.plan.tensor_shapes}
        return assemble(self, reduce=False)

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Start from a full-model state dict (e.g. a checkpoint of the unmasked model)."""
        load_pieces(self, state_dict)

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state in the original names and shapes, identical on every rank:
        {"state": {name: {"exp_avg": tensor, ..., "step": 0-d}}, "param_groups": [...]}.
        Loads on any plan of the same model. Collective. See optim_state.py."""
        return optim_state.full_optimizer_state_dict(self, optimizer)

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Give `optimizer` (over this engine's parameters) its share of a full optimizer state."""
        optim_state.load_full_optimizer_state_dict(self, optimizer, state)

    def verify_consistency(self) -> None:
        """Raise ConsistencyError naming the unit and the ranks unless the owners of every
        unit hold bit-identical values. Collective; call it at a synchronisation point."""
        consistency.verify_consistency(self)

    def gradients_finite(self) -> bool:
        """True when every rank's gradients are finite (one all-reduced flag); when False,
        skip optimizer.step() on every rank. Collective. See guard.py."""
        return guard.gradients_finite(self._trainable, self.process_group, self.timeout)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """Clip gradients by the norm of the whole model's synchronised gradient (as FSDP's
        method); returns that norm (0-d), the same on every rank. Collective; call it after
        backward, before optimizer.step(). With sync_every > 1 it clips each rank by its own
        gradients' norm (local SGD). See clipping.py."""
        return clipping.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite, foreach)

    def full_model(self) -> nn.Module:
        """A new, unmasked model holding the assembled full state (collective)."""
        model = copy.deepcopy(self._skeleton)
        model.load_state_dict(self.full_state_dict(), assign=True)
        return model

    @torch.no_grad()
    def evaluate(self, *inputs, modes=("full", "ensemble")) -> dict:
        """{"full": the union of subnetworks' output, "ensemble": mean of the ranks' subnetwork
        outputs (one all-reduce)}. Collective; runs in eval mode and restores the mode."""
        bad = [m for m in modes if m not in ("full", "ensemble")]
        if bad:
            raise ValueError(f"evaluate modes must be 'full' and/or 'ensemble', got {bad}")
        if "full" in modes:
            self._refuse_if_simulated("evaluate(modes=('full', ...))")
        was_training = self.module.training
        self.module.eval()
        out = {}
        try:
            if "ensemble" in modes:
                y = self.module(*inputs).float()
                if self.world_size > 1 and not self.simulated:  # simulated: this rank's subnetwork alone
                    collectives.all_reduce(y, self.process_group, timeout=self.timeout)
                    y /= self.world_size
                out["ensemble"] = y
            if "full" in modes:
                skeleton = self._skeleton.eval()
                out["full"] = torch.func.functional_call(skeleton, self.full_state_dict(), inputs).float()
        finally:
            self.module.train(was_training)
        return out

    def _refuse_if_simulated(self, what: str) -> None:
        if self.simulated:
            raise ValueError(f"{what} needs every rank's share of the model, but this engine simulates rank "
                             f"{self.rank} of {self.world_size} alone; use evaluate(modes=('ensemble',)) for "
                             "this rank's subnetwork")

    def comm_stats(self) -> dict:
        """Bytes handed to collectives and collectives issued, in total and per optimizer step."""
        steps = max(1, self.counter.steps)
        return {
            "strategy": self.strategy, "strategy_costs": self.strategy_costs, "steps": self.counter.steps,
            "bytes": self.counter.bytes, "collectives": self.counter.collectives,
            "bytes_per_step": self.counter.bytes / steps, "collectives_per_step": self.counter.collectives / steps,
            "by_kind": dict(self.counter.by_kind),
            "predicted_per_sync": predicted_comm(self.plan, self.rank, self.strategy, self.regime,
                                                 self.bucket_cap_bytes),
            "buckets": len(self._averager.states), "overlap": self._averager.overlap,
            "buckets_issued_during_backward": self._averager.issued_during_backward,
            "direct_gradient_runs": self.direct_gradient_runs,
            "simulated": self.simulated,
        }

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """Bytes this rank holds: parameters, gradients, optimizer state, buffers.

        Shared storage (owned views of full tensors) counts once. `model_state` =
        parameters + gradients + optimizer state. A gradient the masked kernel writes
        straight into a communication bucket counts its own bytes as a gradient (not the
        whole bucket); `communication_buffers` counts the buckets whole, so the two
        overlap by `gradients_in_buffers`."""
        seen = set()

        def nbytes(ts):
            total = 0
            for t in ts:
                if t is None or t.device.type == "meta":
                    continue
                key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                if key not in seen:
                    seen.add(key)
                    total += key[1]
            return total

        params = nbytes(list(self.module.parameters()) + [getattr(m, a) for m, a in self._value_refs.values()])
        bucket_storages = self._averager.buffer_storages()
        grad_list = [p.grad for p in self.module.parameters() if p.grad is not None]
        in_buffers = {(g.data_ptr(), g.numel() * g.element_size()) for g in grad_list
                      if g.untyped_storage().data_ptr() in bucket_storages}
        grads = nbytes([g for g in grad_list if g.untyped_storage().data_ptr() not in bucket_storages])
        in_buffer_bytes = sum(n for _, n in in_buffers)
        grads += in_buffer_bytes
        state = 0
        if optimizer is not None:
            state = nbytes([v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)])
        buffers = nbytes(list(self.module.buffers()))
        # Peak activations are measurable on CUDA (allocator peak, which includes the model
        # state); on CPU the training loop measures them with saved-tensor accounting.
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return {"parameters": params, "gradients": grads, "optimizer_state": state, "buffers": buffers,
                "model_state": params + grads + state, "peak_allocated": peak,
                "communication_buffers": self._averager.buffer_bytes,
                "gradients_in_buffers": in_buffer_bytes}

    def predicted_model_state_bytes(self, optimizer_state_per_param: float = 2.0) -> float:
        """Plan's prediction of parameters + gradients + optimizer state (Adam: 2 x params)."""
        own = float(self.plan.bytes_per_rank[self.rank])
        if self.regime == "backward":
            return self.plan.full_bytes + own * (1 + optimizer_state_per_param)
        return own * (2 + optimizer_state_per_param)

    def extra_repr(self) -> str:
        return (f"regime={self.regime!r}, level={self.plan.level!r}, rank={self.rank}/{self.world_size}, "
                f"coverage={self.plan.coverage}, sync_every={self.sync_every}, strategy={self.strategy!r}")

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

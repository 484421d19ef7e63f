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
regime, at those same synchronisation points (every step when sync_every=1), refreshes
the copies of units this rank does not own; between them those copies keep their last
refreshed values and the full forward uses them. All of these issue
collectives in one global order, so they cannot deadlock.

With shard_shared=True (sharding.py) the plan's shared parameters are DTensor shards
managed by torch's FSDP2 (all-gathered before the forward and kept until the end of the
backward, gradients reduce-scattered as the mean over the world, optimizer state sharded);
the buckets then hold the units only. Not with simulate_rank, sync_every > 1 or close().
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..comm.averaging import BucketedAverager
from ..comm.refresh import CopyRefresher
from ..planning.buckets import DEFAULT_BUCKET_CAP_MB, build_buckets
from ..comm.communicator import CommCounter, Communicator, SimulatedCommunicator
from ..comm import collectives
from ..comm.call_check import CallLedger, collective_method
from ..state import consistency
from . import clipping, evaluation, guard, reports
from ..state import full_optim_state
from ..comm.collectives import as_timedelta
from ..planning.costs import DEFAULT_LATENCY_BYTES, choose_strategy
from ..planning.pieces import global_pieces
from ..planning.sharding import communicated_pieces
from ..planning.plan import SubnetPlan, model_fingerprint
from ..state.aliases import with_aliases, without_aliases
from ..state.assembly import assemble, load_pieces
from ..state.layout import RankLayout
from .residual_scale import check_residual_scale, scale_full_state
from .restore import meta_skeleton, restore_structure
from .ddp_interface import DDPInterface
from .optimizer_guard import OptimizerGuard
from .state_dict_guard import install_state_dict_guard
from .setup import REGIMES, SCALES, check_arguments, weak_call, world_and_rank  # noqa: F401
from .sharding import SharedShards
from .surgery import attach_direct_gradients, materialise_forward, prepare_backward

class SubnetDataParallel(DDPInterface, nn.Module):
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
        shard_shared: shard the plan's shared parameters over the group with torch's FSDP2
            (gathered per use, gradients reduce-scattered, optimizer state sharded); SDP
            averages only the units. Needs sync_every=1 and no simulate_rank. See sharding.py.
    """

    def __init__(self, model: nn.Module, plan: SubnetPlan, regime: str = "forward", sync_every: int = 1,
                 scale: str = "none", process_group=None, strategy: str = "auto",
                 latency_bytes: float = DEFAULT_LATENCY_BYTES, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                 overlap: bool = True, simulate_rank: int | None = None, timeout: float | None = None,
                 shard_shared: bool = False):
        super().__init__()
        check_arguments(plan, regime, sync_every, scale, bucket_cap_mb, shard_shared, simulate_rank is not None)
        self.simulated = simulate_rank is not None
        self.world_size, self.rank = world_and_rank(plan, process_group, simulate_rank)
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
        self._optimizer_guard = OptimizerGuard(model)  # the Parameters an optimizer built before wrapping holds
        self.__dict__["_skeleton"] = meta_skeleton(model)  # not a submodule: no state of its own

        pieces = global_pieces(plan)
        if regime == "forward":
            self._hooks = materialise_forward(model, plan, pieces, self.rank, scale)
            piece_params, value_refs = {}, {}
        else:
            piece_params, value_refs, self._hooks = prepare_backward(model, plan, pieces, self.rank)
        self.module = model
        self.layout = RankLayout(plan, self.rank, self.world_size, self.device, model, compact=regime == "forward",
                                 piece_params=piece_params, value_refs=value_refs)
        self.pieces, self.local_start = self.layout.pieces, self.layout.local_start
        self.integer_entries = self.layout.integer_entries
        self.shared_shards = SharedShards(model, self.layout, process_group, self.device) if shard_shared else None

        self._trainable = [p for p in model.parameters() if p.requires_grad]
        self._trainable_ids = {id(p) for p in self._trainable}
        self._setup_communication(strategy, latency_bytes, bucket_cap_mb * 2**20, overlap, timeout)
        # Backward regime: the masked kernel writes owned weight gradients into their buckets.
        self.direct_gradient_runs = 0
        if regime == "backward" and sync_every == 1:
            self.direct_gradient_runs = attach_direct_gradients(
                model, self.layout.piece_params, self._averager.direct_gradient_view,
                weak_call(weakref.ref(self), lambda engine, piece: engine._averager.on_grad_ready((piece,))))
        self.optimizer_steps = 0
        self._install_hooks(model, shard_shared)

    def _install_hooks(self, model: nn.Module, shard_shared: bool) -> None:
        """Gradient-ready and optimizer-step hooks, and what meets a DDP script's habits: an
        optimizer built before wrapping is refused at its first step, the wrapped model's own
        state_dict() does not pass for the model's, collective methods are called in one order."""
        for p in self._trainable:
            self._hooks.append(p.register_post_accumulate_grad_hook(
                weak_call(weakref.ref(self), lambda engine, param: engine._averager.on_param_grad_ready(param))))
        # Hooks hold the engine weakly. The optimizer-hook registry is global, and a tensor's
        # hooks are kept from C++, where Python's garbage collector cannot see the cycle
        # parameter -> hook -> engine -> module -> parameter: strong references would keep
        # every engine, and the process groups it holds, alive until the interpreter shuts
        # down, when destroying a gloo group can abort the process.
        step_hook = register_optimizer_step_post_hook(
            weak_call(weakref.ref(self), SubnetDataParallel._on_optimizer_step))
        weakref.finalize(self, step_hook.remove)
        self._optimizer_guard.attach(self._trainable_ids, self.rank, model)
        guard_hook = register_optimizer_step_pre_hook(self._optimizer_guard)  # holds no engine reference
        weakref.finalize(self, guard_hook.remove)
        self._hooks += [step_hook, guard_hook] + install_state_dict_guard(model, self.plan, self.rank, shard_shared)
        # Every rank calls the collective methods in one order: checked on a gloo group of its own.
        self.call_ledger = CallLedger(self.process_group, self.world_size, self.rank, self.timeout,
                                      not self.simulated, weak_call(weakref.ref(self), SubnetDataParallel._progress))

    def _setup_communication(self, strategy, latency_bytes, bucket_cap_bytes, overlap, timeout) -> None:
        """Strategy (cost model), bucket layout, process groups (or their simulation), averager."""
        self.bucket_cap_bytes = bucket_cap_bytes
        sharded = self.shared_shards is not None  # FSDP2 communicates the shared parameters
        self.strategy, self.strategy_costs = choose_strategy(self.plan, strategy, latency_bytes, bucket_cap_bytes,
                                                             shard_shared=sharded)
        self.counter = CommCounter()
        self.buckets = build_buckets(self.plan, communicated_pieces(self.plan, sharded), self.strategy,
                                     bucket_cap_bytes)
        owner_sets = [b.owners for b in self.buckets]  # the groups averaging uses; the refresh uses the world
        self._comm = SimulatedCommunicator(self.world_size, self.rank, self.counter) if self.simulated else \
            Communicator(owner_sets, self.world_size, self.rank, self.process_group, self.counter, timeout)
        self._averager = BucketedAverager(self.buckets, self.rank, self._comm, self.device, self.layout,
                                          overlap=overlap, trainable_ids=self._trainable_ids,
                                          average_gradients=self.sync_every == 1)
        self._refresh = CopyRefresher(self.pieces, self.rank, self.world_size, self.layout.resolve_value,
                                      self._comm) \
            if self.regime == "backward" else None

    # ------------------------------------------------------------------ lookup
    def value_of(self, name: str) -> torch.Tensor:
        """The local tensor holding state-dict entry `name` (compact in the forward regime)."""
        self._check_open("value_of")
        return self.layout.value_of(name)

    def holds_whole(self, name: str) -> bool:
        """True when this rank holds state-dict entry `name` as a local tensor."""
        self._check_open("holds_whole")
        return self.layout.holds_whole(name)

    # ------------------------------------------------------------------ sync points
    def _sync_initial_state(self, model: nn.Module) -> None:
        """Every rank starts from rank 0's values (as torch DDP does)."""
        if self.world_size == 1 or self.simulated or not dist.is_initialized():
            return
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        collectives.broadcast_by_dtype(list(model.state_dict(keep_vars=True).values()), src, self.process_group,
                                       self.timeout)

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if not any(id(p) in self._trainable_ids for g in optimizer.param_groups for p in g["params"]):
            return
        self.after_step()

    def _progress(self) -> str:
        return f"after {self.optimizer_steps} optimizer steps"

    def after_step(self) -> None:
        """Called after each optimizer step (automatically for torch.optim optimizers)."""
        self._check_open("after_step")
        self.optimizer_steps += 1
        self.counter.steps += 1
        sync_point = self.optimizer_steps % self.sync_every == 0
        with torch.no_grad():
            if self.sync_every > 1 and sync_point:
                self._averager.average_now("parameters")
            # Between synchronisation points a rank's copies of units it does not own keep
            # their last refreshed values (the full forward still uses them): refreshing them
            # every step would cost the refresh's bytes H times per averaging for no agreement.
            if self.regime == "backward" and sync_point:
                self._refresh()

    # ------------------------------------------------------------------ public API
    def forward(self, *args, **kwargs):
        """Run this rank's subnetwork (the wrapped model, with its skipped blocks and sliced units)
        on the inputs; same arguments and output shapes as the unwrapped model."""
        self._check_open("forward")
        out = self.module(*args, **kwargs)
        if self.shared_shards is not None and not torch.is_grad_enabled():
            self.shared_shards.module.reshard()  # no backward will reshard the gathered shared parameters
        return out

    @collective_method(agree=("rank0_only",))
    def full_state_dict(self, rank0_only: bool = False, cpu_offload: bool = False, residual_scale=None) -> dict:
        """The whole model's state dict (original names and shapes), identical on every rank, or with
        FSDP's `rank0_only` on rank 0 alone ({} elsewhere, which hold one bounded chunk at a time), on
        the CPU with `cpu_offload`. residual_scale="owner_fraction" (block level) scales each block's
        residual branches by owners / K in the weights (residual_scale.py). Collective: every rank
        must call it. See state/full_gather.py."""
        self._check_open("full_state_dict")
        self._refuse_if_simulated("full_state_dict")
        check_residual_scale(residual_scale)
        full = with_aliases(self.plan, assemble(self.layout, reduce=True, process_group=self.process_group,
                                                timeout=self.timeout, rank0_only=rank0_only, cpu_offload=cpu_offload))
        return scale_full_state(full, self.plan, self._skeleton, residual_scale) if full else full

    def local_full_state_dict(self) -> dict:
        """This rank's values in the original names and shapes, NaN where it holds nothing."""
        self._check_open("local_full_state_dict")
        if self.regime == "backward":
            own = assemble(self.layout, reduce=False) if self.shared_shards is not None else {}  # shard rows
            return with_aliases(self.plan, {n: own[n] if n in self.layout.sharded else self.value_of(n).detach().clone()
                                            for n in self.plan.tensor_shapes})
        return with_aliases(self.plan, assemble(self.layout, reduce=False))

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Start from a full-model state dict (e.g. a checkpoint of the unmasked model)."""
        self._check_open("load_full_state_dict")
        load_pieces(self.layout, without_aliases(self.plan, state_dict))

    @collective_method(agree=("rank0_only",))
    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, rank0_only: bool = False,
                                  cpu_offload: bool = False) -> dict:
        """The optimizer state in torch's full format (get_optimizer_state_dict(..., full_state_dict=True)
        of DDP/FSDP2): {"state": {name: {"exp_avg": [param shape], ..., "step": 0-d}}, "param_groups":
        [{..., "params": [name, ...]}]}; options as full_state_dict's. Collective. See state/full_optim_state.py."""
        self._check_open("full_optimizer_state_dict")
        return full_optim_state.full_optimizer_state_dict(self.layout, optimizer, self.process_group, self.timeout,
                                                          rank0_only, cpu_offload)

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict,
                                       strict: bool = True) -> None:
        """Give `optimizer` (over this engine's parameters) its share of a full optimizer state
        (SDP's, or torch's full one from DDP/FSDP2); `strict=False` as torch's option."""
        self._check_open("load_full_optimizer_state_dict")
        full_optim_state.load_full_optimizer_state_dict(self.layout, optimizer, state, strict)

    @collective_method
    def verify_consistency(self) -> None:
        """Raise ConsistencyError naming the unit and the ranks unless the owners of every
        unit hold bit-identical values. Collective; call it at a synchronisation point."""
        self._check_open("verify_consistency")
        consistency.verify_consistency(self.layout, self.process_group, self.timeout)

    def gradients_finite(self) -> bool:
        """True when every rank's gradients are finite (one all-reduced flag); when False,
        skip optimizer.step() on every rank. Collective. See guard.py."""
        self._check_open("gradients_finite")
        return guard.gradients_finite(self._trainable, self.process_group, self.timeout)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """Clip gradients by the norm of the whole model's synchronised gradient (as FSDP's
        method); returns that norm (0-d), the same on every rank. Collective; call it after
        backward, before optimizer.step(). With sync_every > 1 it clips each rank by its own
        gradients' norm (local SGD). See clipping.py."""
        return clipping.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite, foreach)

    @collective_method
    def full_model(self, residual_scale=None) -> nn.Module:
        """A new, unmasked model holding the assembled full state, ties kept (collective);
        residual_scale as full_state_dict's."""
        self._check_open("full_model")
        return evaluation.full_model(self._skeleton, self.plan, self.full_state_dict(residual_scale=residual_scale))

    @collective_method
    @torch.no_grad()
    def evaluate(self, *inputs, modes=("full", "ensemble"), loss_fn=None, targets=(), residual_scale=None) -> dict:
        """{mode: output}, each the model's output structure (tensors in tuples, lists, dicts,
        dataclasses, ModelOutputs), floating tensors as float32 (e.g. logits [B, C]):
        "full": the union of subnetworks; "ensemble": the ranks' subnetwork outputs averaged
        (one all-reduce); "subnetwork": this rank's own. With loss_fn(output, *targets) ->
        scalar also "loss": {"full": 0-d, "ensemble": 0-d (of the averaged output),
        "subnetworks": [K], rank r's own at r (NaN for ranks a simulated engine lacks)}.
        residual_scale: of "full", as full_state_dict's. Collective; eval mode, restored. See evaluation.py."""
        self._check_open("evaluate")
        check_residual_scale(residual_scale)
        if "full" in evaluation.check_request(modes, loss_fn, targets)[0]:
            self._refuse_if_simulated("evaluate(modes=('full', ...))")
        communicate = self.world_size > 1 and not self.simulated  # simulated: its own subnetwork alone
        out = evaluation.evaluate(self.module, self._skeleton, self.plan, inputs, modes,
                                  lambda: self.full_state_dict(residual_scale=residual_scale),
                                  (communicate, self.process_group, self.world_size, self.rank, self.timeout),
                                  loss_fn, targets)
        if self.shared_shards is not None:
            self.shared_shards.module.reshard()  # the no-grad forward left them gathered
        return out

    def _refuse_if_simulated(self, what: str) -> None:
        if self.simulated:
            raise ValueError(f"{what} needs every rank's share of the model, but this engine simulates rank "
                             f"{self.rank} of {self.world_size} alone; use evaluate(modes=('ensemble',)) for "
                             "this rank's subnetwork")

    def comm_stats(self) -> dict:
        """Bytes handed to collectives and collectives issued, in total and per optimizer step,
        beside the cost model's prediction per synchronisation (see reports.comm_stats)."""
        self._check_open("comm_stats")
        return reports.comm_stats(self.counter, self.plan, self.rank, self.strategy, self.strategy_costs,
                                  self.regime, self.bucket_cap_bytes, self._averager,
                                  self.direct_gradient_runs, self.simulated, self.shared_shards is not None)

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """Bytes this rank holds: parameters, gradients, optimizer state, buffers.

        Shared storage (owned views of full tensors) counts once. `model_state` =
        parameters + gradients + optimizer state. A gradient that lives in a communication
        bucket (comm/averaging.py) counts its own bytes as a gradient (not the whole
        bucket); `communication_buffers` counts the buckets whole, so the two overlap by
        `gradients_in_buffers`; `refresh_buffer`: the backward regime's refresh buffer."""
        self._check_open("memory_report")
        return reports.memory_report(self.module, self.layout.local_tensors(), self._averager, self.device,
                                     optimizer, self.shared_shards, self._refresh)

    def predicted_model_state_bytes(self, optimizer_state_per_param: float = 2.0) -> float:
        """Plan's prediction of parameters + gradients + optimizer state (Adam: 2 x params)."""
        return reports.predicted_model_state_bytes(self.plan, self.rank, self.regime, optimizer_state_per_param,
                                                   self.shared_shards is not None)

    def extra_repr(self) -> str:
        """regime, level, rank/world size, coverage, sync period and bucket strategy, for repr()."""
        return (f"regime={self.regime!r}, level={self.plan.level!r}, rank={self.rank}/{self.world_size}, "
                f"coverage={self.plan.coverage}, sync_every={self.sync_every}, strategy={self.strategy!r}, "
                f"shard_shared={self.shared_shards is not None}")

    @collective_method
    def close(self) -> None:
        """Give the wrapped model back as it was before wrapping, holding the trained values.

        Collective (assembles the full state first). Every module gets back its type
        (skipped blocks), full-shaped Parameters (not compact ones or owned views), width
        attributes, hooks and attributes as before; the engine's hooks are removed; then
        the assembled full state is loaded into the model. The engine refuses further use.
        """
        self._check_open("close")
        if self.shared_shards is not None:
            raise ValueError("close() cannot give back a model whose shared parameters FSDP2 sharded "
                             "(shard_shared=True); use full_model() or full_state_dict() for the trained model")
        full = self.full_state_dict()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.call_ledger.close()
        restore_structure(self.module, self._skeleton, self.device)
        self.module.load_state_dict(full)
        self._closed = True

    def remove_hooks(self) -> None:
        """Alias of close() (collective): restores the model and removes every hook."""
        self.close()

    def _check_open(self, what: str) -> None:
        if self.__dict__.get("_closed", False):
            raise RuntimeError(f"SubnetDataParallel.{what}: this engine was closed; the model it wrapped is a "
                               "plain model again. Wrap it in a new SubnetDataParallel to train it with SDP.")

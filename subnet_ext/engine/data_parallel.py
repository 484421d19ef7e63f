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

With shard_shared=True (shared_shards.py) the plan's shared parameters are DTensor shards
managed by torch's FSDP2 (all-gathered before the forward and kept until the end of the
backward, gradients reduce-scattered as the mean over the world, optimizer state sharded);
the buckets then hold the units only. Not with simulate_rank, sync_every > 1 or close().

Parts: one class, SubnetDataParallel, whose methods come in this order:
- building: __init__, _assemble (surgery, layout, communication for one plan), hooks;
- ownership in time: after_step, set_step, steps, _reassign, _teardown, register_reassign_hook;
- the step: forward, train, clip_grad_norm_, gradients_finite;
- state in the full model's coordinates: full_state_dict, load_full_state_dict, the optimizer's;
- the whole model: full_model, evaluate, verify_consistency;
- reports: summary, comm_stats, memory_report, predicted_model_state_bytes;
- the end: close, remove_hooks.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..comm.call_check import CallLedger, collective_method
from ..planning.pieces import global_pieces
from ..planning.plan import SubnetPlan, model_fingerprint
from ..planning.assignment.schedule import plan_at, warn_if_never_co_trained
from ..state import consistency, full_optim_state
from ..state.tied_exports import with_aliases, without_aliases
from ..state.assembly import assemble, load_pieces
from ..state.layout import RankLayout
from . import clipping, evaluation, reassignment, reports
from .guards import nonfinite_guard
from .comm_setup import build_communication, piece_periods
from .config import SDPConfig, config_from
from .ddp_interface import DDPInterface
from .part_access import EngineParts
from .regimes.eval_mode import EvalForward
from .guards.optimizer_guard import OptimizerGuard
from .phase import Phase
from .regimes.residual_scale import check_residual_scale, scale_full_state
from .regimes.restore import materialise_meta, meta_skeleton
from .setup_checks import (broadcast_initial_state, check_placement, check_world, refuse_if_simulated, weak_call,
                    world_and_rank)
from .shared_shards import SharedShards
from .guards.state_dict_guard import install_state_dict_guard
from .regimes.module_swaps import ModuleSwaps
from .layers.owned_linear import attach_direct_gradients
from .regimes.surgery import materialise_forward, prepare_backward
from .sync_norm import assign_sync_norm_groups, sync_norm_owners


class SubnetDataParallel(DDPInterface, EngineParts, nn.Module):
    """Wraps `model` (modified in place) so this rank trains its subnetwork of `plan`.

    Args:
        model: the full model, identical on every rank (rank 0's values are broadcast).
        plan: from plan_subnetworks(model, world_size, ...) on the same model structure.
        config: the engine's options, an SDPConfig (regime, sync_every, scale, strategy,
            latency_bytes, bucket_cap_mb, overlap, timeout, shard_shared, eval_forward, buffer_sync,
            reduce_dtype; config.py).
            The same options may be given as keywords instead (`regime="backward"`).
        process_group: the group the plan's ranks live in (default: the world).
        simulate_rank: run only rank r of the plan's K ranks, alone, without
            torch.distributed: collectives are no-ops that still count their bytes, so the
            memory and time of one rank of a K-rank job can be measured on one device.

    Attributes:
        module: the wrapped model (this rank's subnetwork), as DDP's `module`.
        plan: the plan; config: the SDPConfig; rank, world_size: this rank and K.
        layout, communicator, averager, refresh, shared_shards, call_ledger: the engine's parts, read-only
            (engine_parts.py).
    """

    def __init__(self, model: nn.Module, plan: SubnetPlan, config: SDPConfig | None = None, *, process_group=None,
                 simulate_rank: int | None = None, **options):
        super().__init__()
        config = config_from(config, options)
        check_placement(config, plan, simulate_rank is not None)
        self._simulated = simulate_rank is not None
        self.world_size, self.rank = world_and_rank(plan, process_group, simulate_rank)
        check_world(plan, self.world_size, self._simulated)
        fingerprint = model_fingerprint(model)
        if fingerprint != plan.fingerprint:
            raise ValueError(f"the plan was made for another model (structure fingerprint {plan.fingerprint}, "
                             f"this model {fingerprint}); plan this model with plan_subnetworks")
        self.plan, self.config, self._process_group = plan, config, process_group
        self.base_plan, self.schedule = plan, config.schedule  # the assignment at step 0, and how it moves
        warn_if_never_co_trained(plan, self.schedule, self.world_size)
        if self.schedule.moves and self._simulated:
            raise ValueError(f"assignment={config.assignment!r} moves units between ranks, but simulate_rank runs one "
                             "rank alone (no rank to receive them from); simulate assignment='static'")
        self._phase = Phase.TRAINING
        first = next(iter(model.parameters()), None)
        self._device = first.device if first is not None else torch.device("cpu")
        if self.world_size > 1 and not self._simulated:
            broadcast_initial_state(model, process_group, config.timeout)  # rank 0's values, as torch DDP
        self._optimizer_guard = OptimizerGuard(model)  # the Parameters an optimizer built before wrapping holds
        self.__dict__["_skeleton"] = meta_skeleton(model)  # not a submodule: no state of its own
        # What the user trains (the same on every rank): whose optimizer state moves at a change of assignment.
        self._trained_names = frozenset(n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad)
        self._optimizers = []  # weak references to the optimizers that stepped this engine's parameters, in order
        self._swaps = ModuleSwaps()  # every change made to the user's model, undone by close()
        self._comm = None
        self._shards = None
        self._reassignments = []  # what each change of assignment moved (comm_stats)
        self._reassign_hooks = []  # (fn, weak reference to its owner): what follows a change (an EMA)
        self.module = model
        self._assemble(plan)
        me = weakref.ref(self)
        # The optimizer-hook registry is global: registered once, holding the engine weakly (_install_hooks).
        step_hook = register_optimizer_step_post_hook(weak_call(me, SubnetDataParallel._on_optimizer_step))
        weakref.finalize(self, step_hook.remove)
        guard_hook = register_optimizer_step_pre_hook(self._optimizer_guard)  # holds no engine reference
        weakref.finalize(self, guard_hook.remove)
        self._global_hooks = [step_hook, guard_hook]
        # Every rank calls the collective methods in one order: checked on a gloo group of its own.
        self._call_ledger = CallLedger(self._process_group, self.world_size, self.rank, self.config.timeout,
                                       not self._simulated, self._counter)

    def _assemble(self, plan: SubnetPlan) -> None:
        """Make `plan`'s assignment this rank's: the surgery, the layout, the communication and the hooks
        (at construction, and after each change of assignment on the model `_teardown` left)."""
        model, config = self.module, self.config
        self.plan = plan
        pieces = global_pieces(plan)
        # Forward regime: each SyncBatchNorm synchronises among the ranks that run it (sync_norm.py).
        sync_norms = sync_norm_owners(model, plan, pieces) if config.regime == "forward" and self.world_size > 1 \
            and not self._simulated else {}
        if config.regime == "forward":
            self._hooks, self.width_kept = materialise_forward(model, plan, pieces, self.rank, config.scale,
                                                               self._swaps)
            piece_params, value_refs = {}, {}
        else:
            piece_params, value_refs, self._hooks = prepare_backward(model, plan, pieces, self.rank, self._swaps)
            self.width_kept = {}
        materialise_meta(model, self._device)  # what a change of assignment gave this rank (reassignment.py fills it)
        if config.shard_shared and self._shards is None:
            self._shards = SharedShards(model, plan, self._process_group, self._device)
        # Built after every change to the model (surgery, FSDP2's DTensor parameters).
        self._layout = RankLayout(plan, self.rank, self.world_size, self._device, model,
                                  compact=config.regime == "forward", piece_params=piece_params,
                                  value_refs=value_refs, sharded=self._shards.names if self._shards else (),
                                  trainable=[p for p in model.parameters() if p.requires_grad])
        self._setup_communication(set(sync_norms.values()))
        assign_sync_norm_groups(model, sync_norms, self._comm.group_for, self._swaps)
        self._install_hooks(model)
        self._eval_forward = EvalForward.for_rank(config.eval_forward, plan, self.rank, config.regime)

    def _setup_communication(self, module_sets) -> None:
        """Strategy, buckets, process groups (made once), averager, refresh, leader's buffers (communication.py)."""
        again = self._comm is not None  # a change of assignment: the same groups, counter and strategy
        c = build_communication(self.plan, self._layout, self.config, self._process_group, self._simulated,
                                self._shards is not None, self._device, module_sets, self._comm,
                                self._comm.counter if again else None,
                                (self._strategy, self._strategy_costs) if again else None)
        self._strategy, self._strategy_costs, self._counter = c.strategy, c.strategy_costs, c.counter
        self._comm = c.comm
        self._averager, self._refresh, self._leader_buffers, self._drift = c.averager, c.refresh, c.leader_buffers, c.drift

    def _install_hooks(self, model: nn.Module) -> None:
        """The averager's gradient hooks for this assignment (it is told directly when a gradient is
        ready: comm/averaging.py), and what meets a DDP script's habits: an optimizer built before
        wrapping is refused at its first step (the global hooks: __init__), the wrapped model's own
        state_dict() does not pass for the model's."""
        # Backward regime: the masked kernel writes owned weight gradients into their buckets.
        self._direct_gradient_runs = 0
        if self.config.regime == "backward" and 1 in self.config.periods:
            self._direct_gradient_runs = attach_direct_gradients(model, self._layout.piece_params, self._averager)
        self._averager.enabled = self._phase is Phase.TRAINING
        if self._leader_buffers is not None:  # buffer_sync="broadcast": after the averaging, when the backward ends
            self._averager.listeners.append(self._leader_buffers.on_backward)
        self._hooks += self._averager.watch(self._layout.trainable)
        self._optimizer_guard.attach({id(p) for p in self._layout.trainable}, self.rank, model)
        self._hooks += install_state_dict_guard(model, self.plan, self.rank, self._shards is not None, self._swaps)

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if not any(self._layout.is_trainable(p) for g in optimizer.param_groups for p in g["params"]):
            return
        if not any(ref() is optimizer for ref in self._optimizers):
            self._optimizers.append(weakref.ref(optimizer))  # a change of assignment gives it the new parameters
        self.after_step()

    def after_step(self) -> None:
        """Called after each optimizer step (automatically for torch.optim optimizers): counts the step,
        averages parameters at a synchronisation point (sync_every > 1), refreshes the backward regime's
        copies, and where the ownership schedule says so, changes the assignment."""
        self._check_open("after_step")
        self._counter.steps += 1
        steps = self._counter.steps
        with torch.no_grad():
            self._averager.average_now("parameters", steps)  # the buckets of period H > 1 that H divides
            # Between synchronisation points a rank's copies of units it does not own keep
            # their last refreshed values (the full forward still uses them): refreshing them
            # every step would cost the refresh's bytes H times per averaging for no agreement.
            for period, refresh in self._refresh.items():
                if steps % period == 0:
                    refresh()
            self._drift.after_step(steps)  # every drift_check_every steps, where every period ends
        if self.schedule.changes_at(self._counter.steps):
            if self._phase is Phase.ACCUMULATING:
                raise RuntimeError(
                    f"the ownership schedule ({self.schedule.kind} every {self.schedule.every} steps) changes the "
                    f"assignment after optimizer step {self._counter.steps}, but that step was taken inside no_sync() "
                    "(require_backward_grad_sync=False): gradients being accumulated would be lost. Step the optimizer "
                    "outside no_sync(), after the accumulation's last backward.")
            self._reassign(plan_at(self.base_plan, self.schedule, self._counter.steps))

    def summary(self) -> str:
        """The plan's summary, then what this rank's wrap adds: the head groups that keep their width here
        (forward regime: their module cannot run sliced) and, at block level, which neighbouring blocks
        the ownership schedule trains together."""
        from ..planning.assignment.schedule import co_training_lines
        from ..planning.summary import width_kept_lines

        return "\n".join([self.plan.summary(), *width_kept_lines(self.width_kept)] +
                         (co_training_lines(self.base_plan, self.schedule)[1:] if self.schedule.moves else []))

    def register_reassign_hook(self, fn, owner) -> None:
        """Call fn(owner, engine, old_plan) after each change of assignment, on every rank (it may communicate:
        a change is collective), while `owner` lives (held weakly): how an object that keeps per-piece state
        (ExponentialMovingAverage) follows the ownership schedule."""
        self._reassign_hooks.append((fn, weakref.ref(owner)))

    @property
    def steps(self) -> int:
        """Optimizer steps this engine has counted (the schedule's clock)."""
        return self._counter.steps

    def set_step(self, step: int, optimizers=()) -> None:
        """Set the step count (a resumed run) and take the schedule's assignment for it, moving what changes
        hands; `optimizers` built over this engine's parameters get the new ones (so do the optimizers that
        stepped it already). Collective when the assignment changes. Call it before loading a checkpoint's
        full state (load_full_state_dict, load_full_optimizer_state_dict)."""
        self._check_open("set_step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"set_step: step must be an int >= 0, got {step!r}")
        for opt in optimizers:
            if not any(ref() is opt for ref in self._optimizers):
                self._optimizers.append(weakref.ref(opt))
        self._counter.steps = step
        target = plan_at(self.base_plan, self.schedule, step)
        if not torch.equal(target.owners, self.plan.owners):
            self._reassign(target)

    @torch.no_grad()
    def _reassign(self, plan: SubnetPlan) -> None:
        """Change this rank's assignment to `plan`'s (collective): snapshot what it holds, undo the
        surgery, redo it for `plan`, move what changes hands (reassignment.py), give the optimizers
        their new parameters."""
        optimizers = [opt for ref in self._optimizers if (opt := ref()) is not None]
        self._optimizers = [weakref.ref(opt) for opt in optimizers]
        old_plan, old_layout = self.plan, self._layout
        held = reassignment.snapshot(old_layout, optimizers)
        keys = reassignment.state_keys_of(held)
        reassignment.agree(keys, self._comm.world_group, self.config.timeout)
        values = self.config.regime == "forward"
        transfers = reassignment.unit_transfers(old_plan, plan, values, self._trained_names)
        self._teardown()
        self._assemble(plan)
        got_values, got_states = reassignment.exchange(transfers, held, plan, self.rank, self._comm, self._device,
                                                       values, keys)
        reassignment.fill_values(self._layout, held, got_values)
        reassignment.rebind_optimizers(optimizers, self._layout, held, got_states)
        for fn, owner in list(self._reassign_hooks):
            if owner() is not None:
                fn(owner(), self, old_plan)
        self._reassignments.append({"step": self._counter.steps, "transfers": len(transfers),
                                    "predicted_bytes": reassignment.predicted_bytes(
                                        plan, [t for t in transfers if t.src == self.rank],
                                        sum(len(k) for k in keys), values)})

    def _teardown(self) -> None:
        """Undo this assignment's surgery on the model (the swap record), keeping what this rank holds
        whole (shared tensors, owned blocks): the user's modules back, tensors it does not hold on the meta
        device (no memory)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._swaps.undo()

    def state_access(self, what: str) -> tuple[RankLayout, object]:
        """(layout, process group) for a method that reads or writes pieces (the engine's own, the
        EMA's, subnet checkpoints'), `what` naming it in errors, once the engine is known to be open and FSDP2's shards are back in the model (a forward without its
        backward leaves them gathered): resharding is this explicit step, never a lookup's."""
        self._check_open(what)
        if self._shards is not None:
            self._shards.reshard()
        if what.startswith("load"):  # new values: a model assembled for eval mode is stale
            self._eval_forward.drop()
        return self._layout, self._process_group

    # ------------------------------------------------------------------ public API
    def forward(self, *args, **kwargs):
        """Run this rank's subnetwork (the wrapped model, with its skipped blocks and sliced units)
        on the inputs; same arguments and output shapes as the unwrapped model."""
        self._check_open("forward")
        if self._eval_forward.applies(self.module):  # eval mode on a rank without the whole model
            out = self._eval_forward.run(self.module, args, kwargs, self._counter.steps, self._model_for_eval)
        else:
            out = self.module(*args, **kwargs)
        if self._shards is not None and not torch.is_grad_enabled():
            self._shards.reshard()  # no backward will reshard the gathered shared parameters
        return out

    def _model_for_eval(self) -> nn.Module:
        with self._call_ledger.collective("forward in eval mode (eval_forward='full')"):
            return self.full_model()

    def train(self, mode: bool = True):
        """nn.Module's train(); back in train mode, the model assembled for eval-mode forwards is freed."""
        if mode and "_eval_forward" in self.__dict__:
            self._eval_forward.drop()
        return super().train(mode)

    @collective_method(agree=("rank0_only",))
    def full_state_dict(self, rank0_only: bool = False, cpu_offload: bool = False, residual_scale=None) -> dict:
        """The whole model's state dict (original names and shapes), identical on every rank, or with
        FSDP's `rank0_only` on rank 0 alone ({} elsewhere, which hold one bounded chunk at a time), on
        the CPU with `cpu_offload`. residual_scale="owner_fraction" (block level) scales each block's
        residual branches by owners / K in the weights (residual_scale.py). Collective: every rank
        must call it. See state/full_gather.py."""
        layout, group = self.state_access("full_state_dict")
        self.check_not_simulated("full_state_dict")
        check_residual_scale(residual_scale)
        full = with_aliases(self.plan, assemble(layout, reduce=True, process_group=group, timeout=self.config.timeout,
                                                rank0_only=rank0_only, cpu_offload=cpu_offload))
        return scale_full_state(full, self.plan, self._skeleton, residual_scale) if full else full

    def local_full_state_dict(self) -> dict:
        """This rank's values in the original names and shapes, NaN where it holds nothing."""
        layout, _ = self.state_access("local_full_state_dict")
        if self.config.regime == "backward":
            own = assemble(layout, reduce=False) if layout.sharded else {}  # shard rows
            return with_aliases(self.plan, {n: own[n] if n in layout.sharded else layout.value_of(n).detach().clone()
                                            for n in self.plan.tensor_shapes})
        return with_aliases(self.plan, assemble(layout, reduce=False))

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Start from a full-model state dict (e.g. a checkpoint of the unmasked model)."""
        layout, _ = self.state_access("load_full_state_dict")
        load_pieces(layout, without_aliases(self.plan, state_dict))

    @collective_method(agree=("rank0_only",))
    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, rank0_only: bool = False,
                                  cpu_offload: bool = False) -> dict:
        """The optimizer state in torch's full format (get_optimizer_state_dict(..., full_state_dict=True)
        of DDP/FSDP2): {"state": {name: {"exp_avg": [param shape], ..., "step": 0-d}}, "param_groups":
        [{..., "params": [name, ...]}]}; options as full_state_dict's. Collective. See state/full_optim_state.py."""
        layout, group = self.state_access("full_optimizer_state_dict")
        return full_optim_state.full_optimizer_state_dict(layout, optimizer, group, self.config.timeout,
                                                          rank0_only, cpu_offload)

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict,
                                       strict: bool = True) -> None:
        """Give `optimizer` (over this engine's parameters) its share of a full optimizer state
        (SDP's, or torch's full one from DDP/FSDP2); `strict=False` as torch's option."""
        layout, _ = self.state_access("load_full_optimizer_state_dict")
        full_optim_state.load_full_optimizer_state_dict(layout, optimizer, state, strict)

    @collective_method
    def verify_consistency(self) -> None:
        """Raise ConsistencyError naming the unit and the ranks unless the owners of every
        unit hold bit-identical values. Collective; call it at a synchronisation point (with a
        period per unit group, the pieces whose period divides the step count are checked)."""
        layout, group = self.state_access("verify_consistency")
        period_of, steps = piece_periods(self.plan, self.config), self._counter.steps
        due = None if self.config.every_step else (lambda piece: steps % period_of(piece) == 0)
        consistency.verify_consistency(layout, group, self.config.timeout, due)

    def gradients_finite(self) -> bool:
        """True when every rank's gradients are finite (one all-reduced flag); when False,
        skip optimizer.step() on every rank. Collective. See guards/nonfinite_guard.py."""
        self._check_open("gradients_finite")
        return nonfinite_guard.gradients_finite(self._layout.trainable, self._process_group, self.config.timeout)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None, nonfinite_check: bool = False) -> torch.Tensor:
        """Clip gradients by the norm of the whole model's synchronised gradient (as FSDP's
        method); returns that norm (0-d), the same on every rank. Collective; call it after
        backward, before optimizer.step(). With sync_every > 1 it clips each rank by its own
        gradients' norm (local SGD). nonfinite_check: the norm is also inf or NaN when any rank
        holds such a gradient (NonFiniteGuard.check_norm's agreed skip). See clipping.py."""
        layout, _ = self.state_access("clip_grad_norm_")
        period_of = piece_periods(self.plan, self.config)
        communicate = self.world_size > 1 and not self._simulated and dist.is_initialized()
        return clipping.clip_grad_norm_(layout, max_norm, norm_type, error_if_nonfinite, foreach,
                                        local_sgd=1 not in self.config.periods, communicate=communicate,
                                        local=None if self.config.every_step else
                                        lambda piece: period_of(piece) > 1,
                                        group=self._comm.world_group, timeout=self.config.timeout,
                                        nonfinite_check=nonfinite_check)

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
        (one all-reduce); "subnetwork": this rank's own. With `loss_fn(output, *targets)` ->
        scalar also "loss": {"full": 0-d, "ensemble": 0-d (of the averaged output),
        "subnetworks": [K], rank r's own at r (NaN for ranks a simulated engine lacks)}.
        residual_scale: of "full", as full_state_dict's. Collective; eval mode, restored. See engine/evaluation.py."""
        self._check_open("evaluate")
        check_residual_scale(residual_scale)
        if "full" in evaluation.check_request(modes, loss_fn, targets)[0]:
            self.check_not_simulated("evaluate(modes=('full', ...))")
        communicate = self.world_size > 1 and not self._simulated  # simulated: its own subnetwork alone
        out = evaluation.evaluate(self.module, self._skeleton, self.plan, inputs, modes,
                                  lambda: self.full_state_dict(residual_scale=residual_scale),
                                  (communicate, self._process_group, self.world_size, self.rank, self.config.timeout),
                                  loss_fn, targets)
        if self._shards is not None:
            self._shards.reshard()  # the no-grad forward left them gathered
        return out

    def __deepcopy__(self, memo):
        raise TypeError("copy.deepcopy(SubnetDataParallel): it holds process groups and this rank's share of the model. "
                        "For an EMA (AveragedModel, torchvision's or timm's) use subnet_ext.ExponentialMovingAverage("
                        "sdp, decay); for a copy of the model, sdp.full_model() (collective).")

    def check_not_simulated(self, what: str) -> None:
        """Raise for `what` (a method needing every rank's process) on an engine built with simulate_rank."""
        refuse_if_simulated(what, self._simulated, self.rank, self.world_size)

    def comm_stats(self) -> dict:
        """Bytes handed to collectives and collectives issued, in total and per optimizer step,
        beside the cost model's prediction per synchronisation (see reports.comm_stats)."""
        self._check_open("comm_stats")
        return reports.comm_stats(self._counter, self.plan, self.rank, self._strategy, self._strategy_costs,
                                  self.config.regime, self.config.bucket_cap_bytes, self._averager,
                                  self._direct_gradient_runs, self._simulated, self._shards is not None,
                                  self._reassignments)

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """Bytes this rank holds: parameters, gradients, optimizer state, buffers.

        Shared storage (owned views of full tensors) counts once. `model_state` =
        parameters + gradients + optimizer state. A gradient that lives in a communication
        bucket (comm/averaging.py) counts its own bytes as a gradient (not the whole
        bucket); `communication_buffers` counts the buckets whole, so the two overlap by
        `gradients_in_buffers`; `refresh_buffer`: the backward regime's refresh buffer."""
        layout, _ = self.state_access("memory_report")
        return reports.memory_report(self.module, layout.local_tensors(), self._averager, self._device,
                                     optimizer, self._shards, self._refresh)

    def predicted_model_state_bytes(self, optimizer_state_per_param: float = 2.0) -> float:
        """Plan's prediction of parameters + gradients + optimizer state (Adam: 2 x params)."""
        return reports.predicted_model_state_bytes(self.plan, self.rank, self.config.regime,
                                                   optimizer_state_per_param, self._shards is not None)

    def extra_repr(self) -> str:
        """regime, level, rank/world size, coverage, sync period and bucket strategy, for repr()."""
        return (f"regime={self.config.regime!r}, level={self.plan.level!r}, rank={self.rank}/{self.world_size}, "
                f"coverage={self.plan.coverage}, sync_every={self.config.sync_every}, strategy={self._strategy!r}, "
                f"shard_shared={self._shards is not None}")

    @collective_method
    def close(self) -> None:
        """Give the wrapped model back as it was before wrapping, holding the trained values.

        Collective (assembles the full state first). The engine's hooks are removed and its swap
        record undone: the user's module objects are back where they were (skipped blocks and
        sliced layers included), the root's own tensors and attributes as they were, with no
        attribute of the engine's left on any of them; the tensors this rank did not hold are
        given memory again and the assembled full state is loaded into the model. The engine
        refuses further use.
        """
        self._check_open("close")
        if self._shards is not None:
            raise ValueError("close() cannot give back a model whose shared parameters FSDP2 sharded "
                             "(shard_shared=True); use full_model() or full_state_dict() for the trained model")
        full = self.full_state_dict()
        for h in self._hooks + self._global_hooks:
            h.remove()
        self._hooks, self._global_hooks = [], []
        self._averager.enabled = False
        self._call_ledger.close()
        self._swaps.undo()  # the user's own module objects, holding their own Parameters
        materialise_meta(self.module, self._device)  # what this rank did not hold, to load into
        self.module.load_state_dict(full)
        self._phase = Phase.CLOSED

    def remove_hooks(self) -> None:
        """Alias of close() (collective): restores the model and removes every hook."""
        self.close()

    def _check_open(self, what: str) -> None:
        if self.__dict__.get("_phase") is Phase.CLOSED:
            raise RuntimeError(f"SubnetDataParallel.{what}: this engine was closed; the model it wrapped is a "
                               "plain model again. Wrap it in a new SubnetDataParallel to train it with SDP.")

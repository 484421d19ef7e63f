"""An exponential moving average of the model an SDP engine trains.

A DDP script keeps an EMA by deep-copying the model (torch's `AveragedModel`,
torchvision's `ExponentialMovingAverage`, timm's `ModelEmaV3`). Under SDP the engine cannot
be copied (it holds process groups), and a copy of `sdp.module` is this rank's subnetwork,
whose average is not the model's. `ExponentialMovingAverage(sdp, decay)` instead keeps, on
each rank, the average of the pieces this rank owns (the memory of its subnetwork, not of
the model) and assembles the averaged model the way `full_state_dict()` does: every piece
written by its leader, summed over the ranks (a collective).

The arithmetic is AveragedModel's with `multi_avg_fn=get_ema_multi_avg_fn(decay)`: the first
update copies the values, each later one is `lerp_(value, 1 - decay)` per floating tensor;
parameters only, the buffers copied from the model at each update, unless `use_buffers=True`
(buffers averaged too, integer ones as `avg * decay + value * (1 - decay)` cast back, as
AveragedModel does). Owners hold bit-identical values, so the averaged pieces are those of an
AveragedModel over the assembled model; at coverage 1 it equals AveragedModel over torch
DDP's model bit for bit. Its `state_dict()` is AveragedModel's format (`n_averaged` and
`module.<name>` entries of the original model), so checkpoints move between the two.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm.collectives import describe_group
from ..state.tied_exports import with_aliases, without_aliases
from ..state.full_gather import FullEntry, sum_gather
from ..state.layout import RankLayout, as_2d
from . import evaluation

PREFIX = "module."  # AveragedModel's state-dict prefix of the averaged model's entries


class ExponentialMovingAverage(nn.Module):
    """EMA of the model `sdp` trains: this rank's owned pieces averaged, the model assembled on demand.

    Args:
        sdp: a SubnetDataParallel (not copied: the EMA reads its pieces at each update).
        decay: in [0, 1]; the average moves by (1 - decay) toward the model at each update.
        use_buffers: average the buffers too (BatchNorm statistics) instead of copying the
            model's at each update, as AveragedModel's option (torchvision's EMA sets it).
        device: where the averages live (default: the model's device), as AveragedModel's.

    Call `update_parameters()` after optimizer steps (every rank; not collective). Collective,
    every rank in the same order: `state_dict()`, `full_model()`, and the first forward or
    `.module` access after an update or load (the assembled model is then reused).
    """

    def __init__(self, sdp: nn.Module, decay: float = 0.999, use_buffers: bool = False, device=None):
        super().__init__()
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"ExponentialMovingAverage: decay must be a number in [0, 1], got {decay!r}")
        if not hasattr(sdp, "state_access") or not hasattr(sdp, "call_ledger"):
            raise TypeError(f"ExponentialMovingAverage averages a SubnetDataParallel's model, got "
                            f"{type(sdp).__name__}; for a plain or DDP model use torch.optim.swa_utils.AveragedModel")
        self.__dict__["_engine"] = sdp  # not a submodule: its state dict is this rank's subnetwork
        self.decay, self.use_buffers = float(decay), bool(use_buffers)
        # A 0-d long tensor, as AveragedModel's (torchvision's loop resets it with n_averaged.fill_(0)).
        self.register_buffer("n_averaged", torch.tensor(0, dtype=torch.long), persistent=False)
        self._device = torch.device(device) if device is not None else sdp.device
        self._cache, self._cached_at = None, None
        layout = self._layout("ExponentialMovingAverage")
        with torch.no_grad():
            self._averages = {key: value.detach().to(self._device, copy=True)
                              for key, value in self._current(layout).items()}
        self._writes = self._written_keys(layout)
        sdp.register_reassign_hook(_follow_reassignment, self)  # held weakly: the engine outlives no EMA's need

    def _written_keys(self, layout: RankLayout) -> set:
        """The keys this rank writes when the averaged model is assembled (a piece's leader; every rank its
        rows of a sharded piece; an integer entry's reporter, the only rank keeping it)."""
        return {key for key in self._averages if not isinstance(key, tuple)} | {
            (held.piece.name, held.full, held.piece.is_param) for held in layout.held_values()
            if layout.contributes(held.piece)}

    @torch.no_grad()
    def reassigned(self, old_plan, layout: RankLayout, communicator) -> None:
        """After a change of assignment (collective): the averages of the pieces this rank gains arrive from a
        former owner's EMA (engine/reassignment.py), those it loses are dropped."""
        from .reassignment import Held, entry_axis, exchange, fill, unit_transfers

        held = Held()
        for key, average in self._averages.items():
            if isinstance(key, tuple):
                held.values.setdefault(key[0], []).append((key[1], average))
        transfers = unit_transfers(old_plan, layout.plan, values=True)
        received, _ = exchange(transfers, held, layout.plan, layout.rank, communicator, self._device, True, [],
                               quantity="reassign (EMA)")
        current, averages = self._current(layout), {}
        for key, value in current.items():
            if not isinstance(key, tuple):
                averages[key] = self._averages.get(key, value.detach().to(self._device, copy=True))
                continue
            name, full, _ = key
            target = torch.empty((full[1] - full[0], full[3] - full[2]), dtype=value.dtype, device=self._device)
            sources = [([r], v) for r, v in held.values.get(name, [])] + received.get(name, [])
            rects = [full] + [r for r, _ in held.values.get(name, [])]
            fill(target, [((0, target.shape[0], 0, target.shape[1]), full)], sources,
                 entry_axis(layout.plan, name, rects))
            averages[key] = target
        self._averages = averages
        self._writes = self._written_keys(layout)
        self._cache = None

    # ------------------------------------------------------------------ what this rank averages
    def _layout(self, what: str) -> RankLayout:
        layout, _ = self._engine.state_access(what)
        return layout

    def _current(self, layout: RankLayout) -> dict:
        """{key: the model's current value (a view)} of what this rank averages: each floating
        piece it owns (its rows of a sharded one), keyed (name, rectangle), and each integer
        entry it reports, keyed by name."""
        out = {}
        for held in layout.held_values():
            if layout.owns(held.piece) or layout.is_sharded(held.piece):
                r0, r1, c0, c1 = held.local
                out[(held.piece.name, held.full, held.piece.is_param)] = as_2d(held.tensor)[r0:r1, c0:c1]
        for name, reporter in layout.integer_entries.items():
            if reporter == layout.rank:
                out[name] = layout.value_of(name)
        return out

    @torch.no_grad()
    def update_parameters(self, model: nn.Module | None = None) -> None:
        """Move the average toward the model's current values (every rank, after its optimizer step;
        no communication). `model`: the engine or its module (accepted for AveragedModel's call)."""
        if model is not None and model is not self._engine and model is not self._engine.module:
            raise ValueError("ExponentialMovingAverage.update_parameters averages the SubnetDataParallel it was made "
                             f"with; got another model ({type(model).__name__})")
        current = self._current(self._layout("ExponentialMovingAverage.update_parameters"))
        lerped, copied = ([], []), []
        for key, average in self._averages.items():
            value = current[key].to(average.device)
            is_parameter = isinstance(key, tuple) and key[2]
            if int(self.n_averaged) == 0 or not (is_parameter or self.use_buffers):
                copied.append((average, value))
            elif average.is_floating_point():
                lerped[0].append(average)
                lerped[1].append(value)
            else:  # AveragedModel's EMA on an integer buffer (BatchNorm's num_batches_tracked)
                average.copy_(average * self.decay + value * (1 - self.decay))
        for average, value in copied:
            average.copy_(value)
        if lerped[0]:
            torch._foreach_lerp_(lerped[0], lerped[1], 1 - self.decay)
        self.n_averaged += 1
        self._cache = None

    # ------------------------------------------------------------------ the averaged model
    def full_state_dict(self, rank0_only: bool = False, cpu_offload: bool = False) -> dict:
        """The averaged model's state dict, original names and shapes (ties kept), assembled as
        full_state_dict() assembles the model's. Collective; options as full_state_dict's."""
        engine = self._engine
        with engine.call_ledger.collective("ExponentialMovingAverage.full_state_dict"):
            layout, group = engine.state_access("ExponentialMovingAverage.full_state_dict")
            engine.check_not_simulated("ExponentialMovingAverage.full_state_dict")
            written = {key: average for key, average in self._averages.items() if key in self._writes}
            return with_aliases(engine.plan, _assemble(layout, written, group, engine.config.timeout, rank0_only,
                                                       cpu_offload))

    def state_dict(self, *args, rank0_only: bool = False, cpu_offload: bool = False, **kwargs) -> dict:
        """AveragedModel's format: {"n_averaged": 0-d long, "module.<name>": tensor of the original
        shape}. Collective (every rank builds it; save rank 0's). torch's positional arguments
        (destination, prefix, keep_vars) are refused."""
        if args or kwargs:
            raise TypeError("ExponentialMovingAverage.state_dict() takes only rank0_only and cpu_offload")
        full = self.full_state_dict(rank0_only=rank0_only, cpu_offload=cpu_offload)
        if not full:
            return {}
        out = {"n_averaged": self.n_averaged.detach().clone().cpu()}
        out.update((PREFIX + name, value) for name, value in full.items())
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """Take this rank's pieces of an averaged model's state (this class's or AveragedModel's
        format; not collective: every rank reads the same file). strict: every entry present."""
        engine = self._engine
        entries = {k[len(PREFIX):]: v for k, v in state_dict.items() if k.startswith(PREFIX)}
        entries = without_aliases(engine.plan, entries)
        missing = [n for n in engine.plan.tensor_shapes if n not in entries]
        missing = ([] if "n_averaged" in state_dict else ["n_averaged"]) + [PREFIX + n for n in missing]
        if strict and missing:
            raise ValueError(f"ExponentialMovingAverage.load_state_dict: {len(missing)} entries missing (first: "
                             f"{missing[:3]}); it takes a state dict of ExponentialMovingAverage or of "
                             "torch.optim.swa_utils.AveragedModel over this model")
        self._layout("ExponentialMovingAverage.load_state_dict")
        for key, average in self._averages.items():
            if isinstance(key, tuple):
                name, (r0, r1, c0, c1), _ = key
                if name in entries:
                    average.copy_(as_2d(entries[name].contiguous())[r0:r1, c0:c1])
            elif key in entries:
                average.copy_(entries[key])
        if "n_averaged" in state_dict:
            self.n_averaged.fill_(int(state_dict["n_averaged"]))
        self._cache = None

    def full_model(self) -> nn.Module:
        """A new model (the original class) holding the averaged values. Collective."""
        engine = self._engine
        with engine.call_ledger.collective("ExponentialMovingAverage.full_model"):
            return evaluation.full_model(engine.skeleton, engine.plan, self.full_state_dict())

    @property
    def module(self) -> nn.Module:
        """The averaged model (AveragedModel's attribute), assembled once per update or load
        (collective then), in this EMA's train/eval mode, parameters without gradients."""
        if self._cache is None:
            with torch.inference_mode(False), torch.no_grad():
                model = self.full_model()
            for p in model.parameters():
                p.requires_grad_(False)
            self._cache = model
        return self._cache.train(self.training)

    def forward(self, *args, **kwargs):
        """The averaged model's output (as AveragedModel's forward); see `module`."""
        return self.module(*args, **kwargs)

    def extra_repr(self) -> str:
        """decay, use_buffers, n_averaged and the elements this rank averages, for repr()."""
        held = sum(t.numel() for t in self._averages.values())
        return f"decay={self.decay}, use_buffers={self.use_buffers}, n_averaged={int(self.n_averaged)}, " \
            f"elements_here={held}"


def _follow_reassignment(ema: "ExponentialMovingAverage", engine, old_plan) -> None:
    ema.reassigned(old_plan, engine.layout, engine.communicator)


def _assemble(layout: RankLayout, written: dict, group, timeout, rank0_only: bool, cpu_offload: bool) -> dict:
    """{name: full tensor}: the averages this rank writes ({(name, rectangle, is_param) or integer
    name: tensor}) placed into zeros and summed over the ranks, chunk by chunk (full_gather.py)."""
    by_name = {}
    for key, average in written.items():
        by_name.setdefault(key[0] if isinstance(key, tuple) else key, []).append((key, average))

    def write(name, target):
        for key, average in by_name.get(name, ()):
            if isinstance(key, tuple):
                r0, r1, c0, c1 = key[1]
                as_2d(target)[r0:r1, c0:c1].copy_(average)
            else:
                target.copy_(average)

    plan = layout.plan
    entries = [FullEntry(n, shape, getattr(torch, plan.tensor_dtypes[n])) for n, shape in plan.tensor_shapes.items()]
    return sum_gather(entries, write, layout.device, group, timeout, rank0_only, cpu_offload,
                      communicate=layout.world_size > 1 and dist.is_initialized(),
                      label=describe_group(range(layout.world_size), layout.world_size),
                      what="exponential moving average")

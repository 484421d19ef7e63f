"""Ownership in time: which rank owns which unit at each optimizer step (docs/design.md §1.2).

A plan (plan.py) is the assignment at step 0. An `OwnershipSchedule` says how it moves:

- "static": the plan's owners for the whole run (the paper's method, the default);
- "redraw": every `every` optimizer steps a new seeded permutation of the units (IST, ResIST:
  each rank trains another draw of blocks or neurons); the same on every rank, as it is a pure
  function of (seed, step);
- "rolling": every `every` steps each rank's units shift by `shift` positions, cyclically (FedRolex:
  a rank's window of neurons or blocks rolls over the group, so every unit is trained evenly and
  every neighbourhood is visited).

Both move units, never owners: the owner matrix at any step is the plan's with its columns
permuted within *classes* of interchangeable units (a neuron group's units; at block level, the
blocks with identical tensors, e.g. every layer of a transformer). So every assignment has the
plan's owner sets (the same buckets' sizes and process groups), every rank the same number of
units of each class (the same bytes and FLOPs), and a rank's compact tensors the same shapes.

What a change moves (`moved_units`): a unit whose owner set changes reaches each new owner from
one of its current owners (the lowest-ranked), its parameters and optimizer state; the backward
regime holds every value everywhere and moves the optimizer state only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ...vocabulary import ASSIGNMENTS


@dataclass(frozen=True)
class OwnershipSchedule:
    """How ownership moves during training (module docstring).

    Attributes:
        kind: "static", "redraw" or "rolling".
        every: optimizer steps between changes (redraw, rolling; >= 1). A change takes effect after the
            optimizer step that completes `every` steps of the current assignment.
        shift: rolling: positions each rank's units move per change (>= 1).
        seed: redraw: the seed of the draws (the same on every rank).
    """

    kind: str = "static"
    every: int = 0
    shift: int = 1
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ASSIGNMENTS:
            raise ValueError(f"assignment must be one of {', '.join(ASSIGNMENTS)}, got {self.kind!r}")
        for name in ("every", "shift", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"OwnershipSchedule.{name} must be an int, got {type(value).__name__} {value!r}")
        if self.kind != "static" and self.every < 1:
            raise ValueError(f"assignment {self.kind!r} needs every (reassign_every) >= 1, the optimizer steps "
                             f"between changes; got {self.every}")
        if self.shift < 1:
            raise ValueError(f"OwnershipSchedule.shift must be >= 1, got {self.shift}")

    @property
    def moves(self) -> bool:
        """True when ownership ever changes."""
        return self.kind != "static"

    def epoch(self, step: int) -> int:
        """The assignment in force after `step` optimizer steps (0 for the plan's own)."""
        return 0 if not self.moves else step // self.every

    def changes_at(self, step: int) -> bool:
        """True when the optimizer step that brings the count to `step` ends an assignment."""
        return self.moves and step > 0 and step % self.every == 0

    def permutation(self, classes: list[list[int]], epoch: int, units: int) -> torch.Tensor:
        """int64 [units]: column u of epoch `epoch`'s owner matrix is column perm[u] of the plan's."""
        perm = torch.arange(units)
        if epoch == 0 or not self.moves:
            return perm
        for c, members in enumerate(classes):
            n = len(members)
            if n < 2:
                continue
            if self.kind == "rolling":
                order = [(i - epoch * self.shift) % n for i in range(n)]
            else:
                rng = np.random.default_rng([self.seed, epoch, c])
                order = rng.permutation(n).tolist()
            for i, j in enumerate(order):
                perm[members[i]] = members[j]
        return perm

    def to_dict(self) -> dict:
        """{"kind", "every", "shift", "seed"} (what a checkpoint records)."""
        return {"kind": self.kind, "every": self.every, "shift": self.shift, "seed": self.seed}


STATIC = OwnershipSchedule()


def unit_classes(plan) -> list[list[int]]:
    """Classes of interchangeable units, each a list of unit ids in plan order: every neuron group's
    units; at block level the blocks with the same tensors (names relative to the block, shapes and
    dtypes) and the same skip path, e.g. all layers of a transformer, or the blocks of one ResNet stage
    after its first."""
    classes, by_signature = [], {}
    for g, (a, b) in zip(plan.groups, plan.unit_ranges):
        if g.kind != "block":
            classes.append(list(range(a, b)))
            continue
        prefix = len(g.path) + 1
        signature = (g.skip, tuple((n[prefix:], tuple(plan.tensor_shapes.get(n, ())), plan.tensor_dtypes.get(n))
                                   for n in g.params + g.buffers))
        if signature not in by_signature:
            by_signature[signature] = len(classes)
            classes.append([])
        classes[by_signature[signature]].append(a)
    return classes


def owners_at(plan, schedule: OwnershipSchedule, step: int) -> torch.Tensor:
    """The owner matrix, bool [K, units], in force after `step` optimizer steps."""
    return owners_of_epoch(plan, schedule, schedule.epoch(step))


def owners_of_epoch(plan, schedule: OwnershipSchedule, epoch: int, classes=None) -> torch.Tensor:
    """The owner matrix, bool [K, units], of assignment number `epoch` (0: the plan's)."""
    if epoch == 0:
        return plan.owners
    perm = schedule.permutation(classes if classes is not None else unit_classes(plan), epoch, len(plan.units))
    return plan.owners[:, perm]


def plan_at(plan, schedule: OwnershipSchedule, step: int):
    """The plan in force after `step` optimizer steps: `plan` with owners_at's owners."""
    epoch = schedule.epoch(step)
    return plan if epoch == 0 else plan.with_owners(owners_of_epoch(plan, schedule, epoch))


def moved_units(before: torch.Tensor, after: torch.Tensor) -> list[tuple[int, int, int]]:
    """(unit, from rank, to rank) for every rank that owns a unit after a change and did not before,
    the sender being the lowest-ranked owner before; in (unit, to rank) order."""
    out = []
    for u in range(before.shape[1]):
        gained = torch.nonzero(after[:, u] & ~before[:, u]).flatten().tolist()
        if gained:
            source = int(torch.nonzero(before[:, u])[0])
            out += [(u, source, dst) for dst in gained]
    return out


def co_training(plan, schedule: OwnershipSchedule = STATIC, steps: int = 10_000, cap: int = 500) -> list[tuple]:
    """Block level: for each pair of neighbouring blocks in model order, (block path, next block path,
    the fraction of the run's assignments in which some rank owns both). The run's assignments: those of
    `steps` optimizer steps under `schedule` (at most `cap` of them, evenly spread). [] at neuron level."""
    if plan.level != "block" or len(plan.units) < 2:
        return []
    last = schedule.epoch(max(steps - 1, 0))
    epochs = range(last + 1) if last < cap else sorted({round(i * last / (cap - 1)) for i in range(cap)})
    classes = unit_classes(plan)
    together = np.zeros(len(plan.units) - 1)
    for e in epochs:
        o = owners_of_epoch(plan, schedule, e, classes).numpy()
        together += (o[:, :-1] & o[:, 1:]).any(axis=0)
    fractions = together / len(epochs)
    return [(plan.groups[u].path, plan.groups[u + 1].path, float(f)) for u, f in enumerate(fractions)]


def never_trained_together(pairs: list[tuple]) -> list[tuple]:
    """The neighbouring pairs of co_training() that no rank ever trains together."""
    return [(a, b) for a, b, f in pairs if f == 0.0]


def co_training_lines(plan, schedule=None, steps: int = 10_000) -> list[str]:
    """Block level: which neighbouring blocks some rank trains together (under `schedule`: in what share of
    the assignments of `steps` optimizer steps), and a warning when the full model stacks blocks no rank
    ever trained together."""
    pairs = co_training(plan, schedule or STATIC, steps)
    if not pairs:
        return []
    moving = schedule is not None and schedule.moves
    cells = [f"{a} + {b.rsplit('.', 1)[-1]}: {f:.0%}" if moving else f"{a} + {b.rsplit('.', 1)[-1]}: {'yes' if f else 'no'}"
             for a, b, f in pairs]
    what = f"share of the assignments over {steps} steps" if moving else "static assignment"
    lines = ["", f"neighbouring blocks trained together by some rank ({what}): " + "; ".join(cells)]
    never = never_trained_together(pairs)
    if never:
        lines.append(f"warning: {len(never)} of {len(pairs)} pairs of neighbouring blocks are never trained together "
                     f"by any rank ({', '.join(f'{a} + {b}' for a, b in never[:3])}): the full model stacks blocks that "
                     "never learned to work beside each other (docs/study-schedules.md measures what that costs on Tiny "
                     "Shakespeare). Move ownership during training (SubnetDataParallel(..., assignment='redraw', "
                     "reassign_every=N)) or plan block_assignment='contiguous'.")
    return lines


def check_periods(schedule: OwnershipSchedule, sync_every: int) -> None:
    """A change must fall on a synchronisation point: `every` a multiple of the longest period (ValueError)."""
    if schedule.moves and schedule.every % sync_every:
        raise ValueError(f"assignment {schedule.kind!r} changes ownership every {schedule.every} steps, but parameters "
                         f"are averaged every {sync_every} steps: a change must fall on an averaging point, so use "
                         f"reassign_every a multiple of {sync_every} (e.g. {math.lcm(schedule.every, sync_every)})")


def warn_if_never_co_trained(plan, schedule: OwnershipSchedule, world_size: int) -> None:
    """Warn (once across ranks) when some neighbouring blocks are never trained together by any rank under
    `schedule` (co_training_lines says which, and what to do)."""
    import warnings

    from .rank_graph import on_first_rank

    if plan.level != "block" or world_size < 2 or not on_first_rank():
        return
    lines = [line for line in co_training_lines(plan, schedule) if line.startswith("warning: ")]
    if lines:
        warnings.warn("SubnetDataParallel: " + lines[0][len("warning: "):], stacklevel=3)

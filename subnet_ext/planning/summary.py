"""SubnetPlan.summary(): what each unit and each rank holds, next to the requested coverage.

A rank holds the shared parameters plus the units it owns, so at coverage C it holds
about C of the model only when the units carry most of the parameters. A plan whose
shared parameters push a rank's held fraction more than HELD_MARGIN above C (a half-
recognised block, a large embedding) says so, with the largest shared tensors; and every
module the planner left whole that it could have split is named with why (unsplit.py).
"""
from __future__ import annotations

from .assignment.coverage import describe, is_per_rank
from .assignment.schedule import co_training_lines
from .discovery.unsplit import unsplit_lines

HELD_MARGIN = 0.10  # a rank holding more than coverage + this fraction of the parameters is flagged


def _group_rows(plan) -> list[str]:
    rows = ["| group | kind | units | parameters per unit |", "|---|---|---:|---:|"]
    for g, (a, b) in zip(plan.groups, plan.unit_ranges):
        per_unit = sorted({int(n) for n in plan.unit_params[a:b].tolist()})
        shown = f"{per_unit[0]:,}" if len(per_unit) == 1 else f"{per_unit[0]:,} .. {per_unit[-1]:,}"
        rows.append(f"| {g.path} | {g.kind} | {b - a} | {shown} |")
    return rows


def _held_warning(plan) -> list[str]:
    held = plan.held_fraction
    over = [r for r in range(plan.world_size) if float(held[r]) > plan.coverage_of(r) + HELD_MARGIN]
    if not over:
        return []
    total = max(plan.total_params, 1)
    largest = sorted(plan.shared_params, key=lambda n: -plan.numel_of(n))[:3]
    names = ", ".join(f"{n} ({plan.numel_of(n):,})" for n in largest)
    fix = "Make more of the model units (declare whole residual blocks, not their parts)" if plan.level == "block" \
        else "Plan at level='block' (whole blocks carry their norms)"
    return [f"warning: rank(s) {over} hold up to {float(held[over].max()):.1%} of the model's parameters at "
            f"coverage {describe(plan.coverage)}: the shared parameters ({plan.shared_param_count / total:.1%} of the model; "
            f"largest {names}) are held by every rank. {fix}, or shard the shared parameters (shard_shared=True)."]


def _effective(plan) -> str:
    """', effective coverage r/K' when whole owners round the coverage asked for; else ''."""
    lo, hi = int(plan.owner_count.min()), int(plan.owner_count.max())
    if is_per_rank(plan.coverage) or lo != hi:
        return ""
    effective = lo / plan.world_size
    return "" if abs(effective - plan.coverage) <= 1e-9 else f": effective coverage {lo}/{plan.world_size} = {effective:g}"


def plan_summary(plan) -> str:
    """Units per group, per-rank parameters, held fraction, bytes and FLOPs, the checks, and
    a warning when shared parameters lift a rank far above the coverage."""
    k, full = plan.world_size, plan.full_bytes
    total = plan.total_params
    lines = [f"SubnetPlan: {len(plan.units)} {plan.level}-level units in {len(plan.groups)} group(s), "
             f"world size {k}, coverage {describe(plan.coverage)} ({plan.owners_per_unit_text}"
             f"{_effective(plan)}), seed {plan.seed}",
             f"shared: {len(plan.shared_params)} parameter tensors, {plan.shared_param_count:,} parameters "
             f"({plan.shared_param_count / max(total, 1):.1%}), {plan.shared_bytes / 2**20:.2f} MiB; full model "
             f"{total:,} parameters, {full / 2**20:.2f} MiB",
             f"FLOPs: {plan.flops_source}", ""] + _group_rows(plan)
    lines += ["", "| rank | coverage | units | parameters | held | param MiB | GFLOP |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in range(k):
        b, f = float(plan.bytes_per_rank[r]), float(plan.flops_per_rank[r])
        lines.append(f"| {r} | {plan.coverage_of(r):g} | {int(plan.owners[r].sum())} | {int(plan.params_per_rank[r]):,} "
                     f"| {float(plan.held_fraction[r]):.1%} | {b / 2**20:.2f} | {f / 1e9:.4f} |")
    imb, parts = plan.imbalance, plan.rank_components() if k > 1 else [[0]]
    graph = "connected" if len(parts) == 1 else f"disconnected by units, tied by shared parameters only {parts}"
    counted_by = "traced" if plan.flops_source.startswith("traced") else "2 x params"
    lines += ["", f"checks: every unit owned (min owners {int(plan.owner_count.min())}), "
                  f"rank graph by shared units {graph} (spectral gap {plan.spectral_gap:.3f}), "
                  f"imbalance bytes {imb['bytes']:.1%} flops {imb['flops']:.1%} ({counted_by}), "
                  f"{len(plan.owner_sets())} distinct owner set(s)"]
    return "\n".join(lines + co_training_lines(plan) + unsplit_lines(plan.unsplit) + _held_warning(plan))


def width_kept_lines(width_kept: dict) -> list[str]:
    """The head groups that keep their width on a rank ({module path: why}, what the engine's surgery found)."""
    if not width_kept:
        return []
    lines = ["width kept (forward regime, this rank): these attentions cannot run with their heads sliced, so they "
             "keep their width: compact weights, owned heads' outputs scattered into the full width, unowned heads "
             "computed on zeros (their attention activations and FLOPs do not shrink):"]
    return lines + [f"- {path}: {why}" for path, why in width_kept.items()]

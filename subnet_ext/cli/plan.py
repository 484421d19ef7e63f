"""`subnet-plan`: the plan and its predicted costs against DDP and FSDP, without training.

    subnet-plan --model llama --preset 1b --world-size 8 --coverage 0.25 --level block

The model is built on the meta device (no memory, even for the 1B preset); --memory-budget
reads and traces it once per level for every owner count it tries
(bench/results/plan-for-memory-cpu.md).
FLOPs are traced from one forward of a sample input on the meta device (resnet
3x32x32 images, mlp its 64 features, llama and gpt [1, --seq-len] tokens), so the bytes and
FLOP imbalances printed are those of the plan's subnetworks at that input size.
Model state assumes fp32 parameters and gradients and AdamW (8 bytes per parameter);
communication is per step, as ring all-reduce bytes moved per rank (docs/design.md §2).
"""
from __future__ import annotations

import argparse
import sys

import torch

from ..planning.costs.comm_costs import choose_strategy, predicted_comm
from ..planning.assignment.coverage import describe
from ..planning.costs.memory_model import model_state, replicated_model_state
from ..planning.sharding import predicted_fsdp_comm
from ..models import GPT_PRESETS, LLAMA_PRESETS, build_model
from ..planning.costs.budget import NoConfigurationFits, plan_for_memory
from ..planning.plan import plan_subnetworks
from ..planning.costs.sizes import format_size, parse_size
from ..jobs.tasks import sample_input_for
from ..vocabulary import LEVELS, REGIMES

MIB = 2 ** 20


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `subnet-plan` (model, preset, width, world size, coverage, level, ...)."""
    from ..jobs.arguments import HelpFormatter

    p = argparse.ArgumentParser(prog="subnet-plan", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", choices=("mlp", "resnet", "llama", "gpt"), default="llama", help="the model to plan")
    p.add_argument("--preset", default=None, help=f"llama preset: {'|'.join(LLAMA_PRESETS)}; gpt preset: "
                                                  f"{'|'.join(GPT_PRESETS)} (default: tiny)")
    p.add_argument("--width", type=int, default=None,
                   help="mlp and resnet: hidden width (default: mlp 128, resnet 64)")
    p.add_argument("--world-size", type=int, default=8, metavar="K", help="ranks the plan is made for")
    p.add_argument("--coverage", type=float, default=0.5, metavar="C",
                   help="fraction of ranks owning each unit, in (0, 1]; round(C x K) owners, at least one "
                        "(chosen, not read, with --memory-budget)")
    p.add_argument("--level", choices=LEVELS, default="block",
                   help="unit: whole residual blocks, or neurons, attention heads and conv channels (chosen with "
                        "--memory-budget)")
    p.add_argument("--regime", choices=REGIMES, default="forward",
                   help="the regime whose memory and communication the cost table predicts (chosen with "
                        "--memory-budget)")
    p.add_argument("--seed", type=int, default=0, help="relabels the ranks by a seeded permutation (0: none)")
    p.add_argument("--seq-len", type=int, default=64, help="llama, gpt: tokens in the traced sample (FLOPs)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the plan as JSON to PATH (default: no file)")
    p.add_argument("--memory-budget", type=_budget, default=None, metavar="SIZE",
                   help="per-rank memory budget, e.g. 8GiB, 512MiB, 1.5GB, or one per rank (8GiB,8GiB,4GiB,4GiB: "
                        "a coverage per rank may be chosen): choose level, coverage, regime, sharding "
                        "and activation checkpointing that fit it (subnet_ext.plan_for_memory, every owner count from "
                        "--world-size down to 1; --coverage, --level and --regime are then chosen, not read), "
                        "printing every candidate's predicted peak (default: none, plan as given)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="samples per rank in the traced batch (activations in --memory-budget's predictions)")
    p.add_argument("--optimizer", choices=("adamw", "sgd", "sgd_momentum"), default="adamw",
                   help="optimizer whose state --memory-budget counts")
    p.add_argument("--shard-shared", action="store_true",
                   help="also predict SDP with the shared parameters sharded by FSDP2 (SubnetDataParallel shard_shared)")
    return p


def _budget(text: str) -> int | list[int]:
    """argparse type of --memory-budget: bytes, or a list of bytes (one per rank, comma-separated),
    or argparse's error naming the bad size."""
    try:
        sizes = [parse_size(part.strip()) for part in text.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return sizes[0] if len(sizes) == 1 else sizes


def fit_budget(args, model):
    """The plan plan_for_memory chooses for --memory-budget (its table printed), with `args.regime`
    and `args.shard_shared` set to its choice (so the cost table shows it); None after printing
    why nothing fits to stderr."""
    shape, dtype = sample_input_for(args.model, model, args.seq_len)
    sample = ((args.batch_size, *shape[1:]), dtype)
    budget = args.memory_budget
    described = f"{', '.join(map(format_size, budget))} (one per rank)" if isinstance(budget, list) else \
        f"{format_size(budget)} per rank"
    print(f"Fitting {described}, {args.world_size} ranks, batch {list(sample[0])} per rank, {args.optimizer}:\n")
    try:
        fit = plan_for_memory(model, args.world_size, budget, sample_input=sample,
                              optimizer=args.optimizer, seed=args.seed)
    except (NoConfigurationFits, ValueError) as e:  # nothing fits, or not one budget per rank
        print(f"subnet-plan: {e}", file=sys.stderr)
        return None
    print(f"SubnetDataParallel(model, plan, regime={fit.sdp_kwargs['regime']!r}, "
          f"shard_shared={fit.sdp_kwargs['shard_shared']}); activation checkpointing: "
          f"{'yes (--activation-checkpointing)' if fit.activation_checkpointing else 'no'}\n")
    args.regime, args.shard_shared = fit.sdp_kwargs["regime"], fit.sdp_kwargs["shard_shared"]
    return fit.plan


def _state(plan, rank: int, regime: str, shard_shared: bool = False) -> float:
    """The memory model's model-state bytes of `rank` (AdamW)."""
    return float(sum(model_state(plan, rank, regime, "adamw", shard_shared).values()))


def sharded_row(plan, regime: str, strategy: str) -> tuple:
    """(label, model state, ring bytes, collectives) of SDP with shard_shared: units as SDP,
    shared / K x (params + grads + AdamW), FSDP2's all-gather + reduce-scatter of the
    shared part ((K-1)/K of the full buffer moved per rank each)."""
    k = plan.world_size
    state = max(_state(plan, r, regime, shard_shared=True) for r in range(k))
    units = [predicted_comm(plan, r, strategy, regime, shard_shared=True) for r in range(k)]
    fsdp = predicted_fsdp_comm(plan)
    ring = max(c["ring_bytes"] for c in units) + (k - 1) / k * fsdp["bytes"]
    return (f"sdp ({plan.level}, {regime}, C={describe(plan.coverage)}, {strategy}, shard-shared)", state, ring,
            max(c["collectives"] for c in units) + fsdp["collectives"])


def cost_table(plan, regime: str, shard_shared: bool = False) -> str:
    """Markdown table: worst-rank model state and per-step communication of DDP, FSDP, SDP
    (and SDP with sharded shared parameters when `shard_shared`)."""
    k, full = plan.world_size, plan.full_bytes
    strategy, _ = choose_strategy(plan)
    sdp_state = max(_state(plan, r, regime) for r in range(k))
    sdp_comm = [predicted_comm(plan, r, strategy, regime) for r in range(k)]
    rows = [
        ("ddp", replicated_model_state(plan), 2 * (k - 1) / k * full, "per bucket"),
        ("fsdp", replicated_model_state(plan, world_size=k), 3 * (k - 1) / k * full, "3 per layer"),
        (f"sdp ({plan.level}, {regime}, C={describe(plan.coverage)}, {strategy})", sdp_state,
         max(c["ring_bytes"] for c in sdp_comm), max(c["collectives"] for c in sdp_comm)),
    ]
    if shard_shared:
        rows.append(sharded_row(plan, regime, choose_strategy(plan, shard_shared=True)[0]))
    lines = ["| method | model state MiB/rank | ×ddp | comm MiB/step/rank | ×ddp | collectives/step |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, state, comm, count in rows:
        ratio = comm / rows[0][2] if rows[0][2] else float("nan")
        lines.append(f"| {name} | {state / MIB:.1f} | {state / rows[0][1]:.3f} | {comm / MIB:.2f} | "
                     f"{ratio:.3f} | {count} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Plan the subnetworks of a model built on the meta device and print the plan, its imbalance and
    the predicted per-rank costs (optionally the plan JSON to --json); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error(f"--world-size must be at least 1, got {args.world_size}")
    if not 0.0 < args.coverage <= 1.0:
        parser.error(f"--coverage must be in (0, 1], got {args.coverage}")
    kw = {} if args.model in ("llama", "gpt") else {"in_features": 64, "in_channels": 3, "num_classes": 10}
    if args.width is not None:
        kw["width"] = args.width
    try:
        with torch.device("meta"):
            model = build_model(args.model, preset=args.preset, **kw)
        if args.memory_budget is not None:
            if args.batch_size < 1:
                parser.error(f"--batch-size must be at least 1, got {args.batch_size}")
            plan = fit_budget(args, model)
            if plan is None:
                return 1
        else:
            plan = plan_subnetworks(model, args.world_size, args.coverage, args.level, args.seed,
                                    sample_input=sample_input_for(args.model, model, args.seq_len))
    except ValueError as e:
        parser.error(str(e))
    n = sum(p.numel() for p in model.parameters())
    print(f"model {args.model}{' ' + args.preset if args.preset else ''}: {n / 1e6:.1f}M parameters\n")
    print(plan.summary())
    imb = plan.imbalance
    print(f"\nimbalance (max/mean - 1): bytes {imb['bytes']:.1%}, FLOPs {imb['flops']:.1%} ({plan.flops_source})")
    print("\nPredicted per-rank costs (fp32 + AdamW; ring all-reduce bytes):\n")
    print(cost_table(plan, args.regime, args.shard_shared))
    if args.json:
        with open(args.json, "w") as f:
            f.write(plan.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())

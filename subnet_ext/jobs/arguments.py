"""The arguments of `subnet-train`: the parser, the checks argparse's types cannot make,
and `training_args`, which builds one run's arguments without a command line."""
from __future__ import annotations

import argparse
import math
import os

from ..engine.config import DEFAULT_TIMEOUT_S, longest_period
from ..models.gpt import GPT_PRESETS
from ..models.llama import LLAMA_PRESETS
from ..planning.buckets import DEFAULT_BUCKET_CAP_MB
from .launch import choose_backend
from .training import DECAY_CHOICES
from ..vocabulary import ASSIGNMENTS, BLOCK_ASSIGNMENTS, LEVELS, REGIMES

METHODS = ("ddp", "fsdp", "sdp")
MODELS = ("mlp", "resnet", "llama", "gpt")  # and hf:DIR, a transformers causal LM's folder


def _coverage(value: str):
    """--coverage: one number, or one per rank separated by commas (a tuple)."""
    try:
        parts = [float(v) for v in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--coverage takes a number in (0, 1] or a comma-separated list of them, got "
                                         f"{value!r}") from None
    return parts[0] if len(parts) == 1 else tuple(parts)


def _sync_every(value: str):
    """--sync-every: one period H (an int), or a period per unit group, `shared=1,units=4` (keys as
    SDPConfig.sync_every's: shared, units, or a unit group path pattern such as transformer.h.*)."""
    if "=" not in value:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--sync-every takes an int or periods per group such as "
                                             f"shared=1,units=4, got {value!r}") from None
    periods = {}
    for part in value.split(","):
        key, _, period = part.partition("=")
        try:
            periods[key.strip()] = int(period)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--sync-every: {part!r} is not GROUP=INT (e.g. shared=1,units=4)") \
                from None
        if not key.strip() or periods[key.strip()] < 1:
            raise argparse.ArgumentTypeError(f"--sync-every: {part!r} needs a group name and a period >= 1")
    return periods


def _model_name(value: str) -> str:
    if value in MODELS or (value.startswith("hf:") and len(value) > 3):
        return value
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(MODELS)} or hf:DIR)")


DESCRIPTION = """\
Train a model with Subnetwork Data Parallelism (sdp), torch DDP (ddp) or FSDP2 (fsdp) on
one or more processes, and report its loss, memory and communication per rank.

  subnet-train --method sdp --level neuron --coverage 0.5 --nproc 4     # 4 local CPU/GPU workers
  torchrun --nproc-per-node 4 -m subnet_ext.cli.train --method sdp ...  # under torchrun
  subnet-train compare [--nproc 2 --seeds 5 ...]    # DDP and the four SDP variants, one table
                                                    # (subnet-train compare --help)

Coverage C: the fraction of ranks that own each unit (a neuron, head, channel or residual
block); each unit gets round(C x ranks) owners, at least one. The SDP options apply to
--method sdp only. Docs: docs/command-line.md."""

SDP_ONLY = ("level", "regime", "coverage", "sync_every", "scale", "no_overlap", "assignment", "reassign_every",
            "block_assignment")  # ignored by ddp and fsdp


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and each option's default after its help (none for an
    option that is off or unset by default)."""

    def _get_help_string(self, action):
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if unset or "%(default)" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `subnet-train` (method, model, data, steps, SDP level/regime, checkpoints, ...)."""
    p = argparse.ArgumentParser(prog="subnet-train", description=DESCRIPTION, formatter_class=HelpFormatter)
    p.add_argument("--method", choices=METHODS, default="sdp", help="training method")
    p.add_argument("--model", type=_model_name, default="mlp", metavar="{mlp,resnet,llama,gpt,hf:DIR}",
                   help="hf:DIR: a transformers causal LM (DIR/config.json; weights optional), on token data; "
                        'needs pip install "subnet_ext[hf]"')
    p.add_argument("--preset", default=None, help=f"model preset (llama: {'|'.join(LLAMA_PRESETS)}; gpt: "
                                                  f"{'|'.join(GPT_PRESETS)}; default: tiny)")
    p.add_argument("--width", type=int, default=None,
                   help="mlp and resnet: hidden width (default: mlp 128; resnet 64, 16 for one input channel)")
    p.add_argument("--data", default="digits", help="digits (bundled) | cifar:PATH (python-pickle layout) "
                   "| synthetic | pysrc (the Python standard library's sources as characters) | shakespeare[:PATH] "
                   "(nanoGPT's Tiny Shakespeare; default path $SUBNET_EXT_TINY_SHAKESPEARE) | tokens:PATH.bin")
    _add_sdp_args(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the data order and the plan")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="examples per rank per micro-batch")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (language models)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--decay", choices=DECAY_CHOICES, default="all",
                   help="what --weight-decay applies to: every parameter, or matrices (tensors of 2+ dimensions: no "
                        "decay on biases and norms, as nanoGPT)")
    p.add_argument("--beta2", type=float, default=0.999, help="AdamW's second-moment decay (nanoGPT's Shakespeare "
                                                              "recipe: 0.99)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="evaluate every N steps, printing a line (0: only at the end)")
    _add_training_args(p)
    run = p.add_argument_group("launch")
    run.add_argument("--nproc", type=int, default=None,
                     help="start N local workers (not under torchrun; default: one process, or torchrun's workers)")
    run.add_argument("--backend", default="auto", help="auto (nccl on GPU, gloo on CPU) | gloo | nccl")
    run.add_argument("--device", default="auto", help="auto | cpu | cuda")
    run.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                     help="seconds any collective may take before the run stops with an error naming it")
    rel = p.add_argument_group("reliability")
    rel.add_argument("--verify-every", type=int, default=0,
                     help="every N steps, check that the owners of every unit hold identical values (0: never)")
    rel.add_argument("--max-skipped", type=int, default=None,
                     help="stop after more than K steps were skipped for inf/NaN gradients (default: never stop)")
    ck = p.add_argument_group("checkpoints and output")
    ck.add_argument("--save-dir", default=None, help="folder for checkpoints (default: none, no checkpoints)")
    ck.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    ck.add_argument("--keep-last", type=int, default=3, help="keep the newest N checkpoints")
    ck.add_argument("--resume", nargs="?", const="latest", default=None, metavar="latest|auto|PATH",
                    help="continue from the newest good checkpoint in --save-dir (latest, the default), from it "
                         "if there is one (auto: otherwise start fresh; for torchrun --max-restarts), or from "
                         "the checkpoint folder PATH (default: start fresh)")
    ck.add_argument("--out", default=None, help="folder for report.json, report.md and plots (default: none; the "
                    "report table is printed either way)")
    ck.add_argument("--stop-after", type=int, default=0, help=argparse.SUPPRESS)  # interruption, for tests
    return p


def _add_sdp_args(p: argparse.ArgumentParser) -> None:
    """The SDP options (SDP_ONLY are refused with another --method)."""
    sdp = p.add_argument_group("SDP")
    sdp.add_argument("--level", choices=LEVELS, default="block",
                     help="unit: whole residual blocks, or neurons, attention heads and conv channels")
    sdp.add_argument("--regime", choices=REGIMES, default="forward",
                     help="forward: each rank runs only its subnetwork; backward: the full forward, gradients and "
                          "optimizer state only for the owned units")
    sdp.add_argument("--coverage", type=_coverage, default=0.5,
                     help="fraction of ranks owning each unit, in (0, 1]; rounded to whole owners, at least one; or one "
                          "value per rank, comma-separated (1,0.5,0.5,0.25: ranks with unequal memory)")
    sdp.add_argument("--block-assignment", choices=BLOCK_ASSIGNMENTS, default="balanced",
                     help="block level's static pattern: owner windows balanced by bytes and FLOPs, or contiguous runs "
                          "of neighbouring blocks (every neighbour pair but the wrap trained together)")
    sdp.add_argument("--assignment", choices=ASSIGNMENTS, default="static",
                     help="how ownership moves during training: static (the plan's), redraw (a seeded permutation of "
                          "the units every --reassign-every steps), rolling (each rank's units shift by "
                          "--assignment-shift every --reassign-every steps)")
    sdp.add_argument("--reassign-every", type=int, default=0, metavar="N",
                     help="optimizer steps between changes of assignment (redraw, rolling; a multiple of --sync-every)")
    sdp.add_argument("--assignment-shift", type=int, default=1, metavar="S",
                     help="rolling: positions each rank's units move per change")
    sdp.add_argument("--sync-every", type=_sync_every, default=1, metavar="H|GROUP=H,...",
                     help="H: 1 averages gradients every step; H > 1 averages parameters every H steps; or a period "
                          "per unit group, e.g. shared=1,units=4 (SDPConfig.sync_every's mapping)")
    sdp.add_argument("--scale", choices=("none", "inverse"), default="none",
                     help="inverse: scale each neuron group's consumer input by full width / kept width (neuron "
                          "level, forward regime)")
    sdp.add_argument("--bucket-cap-mb", type=float, default=DEFAULT_BUCKET_CAP_MB,
                     help="MiB per packed collective (SDP buckets; DDP's bucket_cap_mb too)")
    sdp.add_argument("--no-overlap", action="store_true",
                     help="issue SDP's all-reduces after the backward instead of during it (for measurement)")
    sdp.add_argument("--simulate-rank", type=int, default=None, metavar="R",
                     help="run only rank R of a --world-size K SDP job, alone on this device; collectives "
                          "become no-ops that still count bytes (measures one rank's memory and time; default: off)")
    sdp.add_argument("--world-size", type=int, default=None, metavar="K",
                     help="K for --simulate-rank (default: none; required with it)")
    sdp.add_argument("--shard-shared", action="store_true",
                     help="shard the shared parameters (embeddings, head, norms, ...) over the ranks with torch FSDP2; "
                          "SDP averages only the units")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    from .training import LR_SCHEDULES, PRECISIONS

    t = p.add_argument_group("optimizer step (the same for every method)")
    t.add_argument("--log-every", type=int, default=10, metavar="N",
                   help="every N steps, read the steps' losses and gradient norms to the host in one copy and "
                        "print a line (step, loss, throughput); a step itself reads only its skip flag")
    t.add_argument("--grad-clip", type=float, default=None, metavar="MAX",
                   help="clip the global gradient 2-norm to MAX (sdp: the synchronised gradient's norm); the "
                        "pre-clip norm goes to history['grad_norm'] (default: no clipping)")
    t.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32",
                   help="autocast dtype of forward + loss; fp16 adds a loss scaler whose skips every rank agrees on")
    t.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each residual block in backward (non-reentrant torch.utils.checkpoint)")
    t.add_argument("--stochastic-depth", type=float, default=0.0, metavar="P",
                   help="ddp: drop each residual block with probability P at every step, on each rank independently, "
                        "and scale the residual branches by 1 - P at evaluation (Huang et al. 2016; 0: off)")
    t.add_argument("--compile", action="store_true",
                   help="torch.compile the training forward (sdp/ddp: the wrapper; fsdp: the model)")
    t.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                   help="constant, or cosine to --min-lr at --steps (after the warmup)")
    t.add_argument("--min-lr", type=float, default=0.0, help="where the cosine schedule ends (nanoGPT's min_lr)")
    t.add_argument("--warmup-steps", type=int, default=0, help="linear warmup over N optimizer steps")
    t.add_argument("--grad-accum", type=int, default=1, metavar="N",
                   help="micro-batches of --batch-size per optimizer step (the first N-1 without communication)")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Rejects values argparse's types cannot, with the value in the message."""
    # why one function: one check per option, read top to bottom, each error naming its option
    coverages = args.coverage if isinstance(args.coverage, (list, tuple)) else [args.coverage]
    if not all(0.0 < c <= 1.0 for c in coverages):
        p.error(f"--coverage must be in (0, 1] (each value of a list), got {args.coverage}")
    if args.assignment != "static" and args.reassign_every < 1:
        p.error(f"--assignment {args.assignment} needs --reassign-every N >= 1, got {args.reassign_every}")
    period = longest_period(args.sync_every)
    if args.reassign_every and args.reassign_every % period:
        p.error(f"--reassign-every {args.reassign_every} must be a multiple of --sync-every's longest period {period} "
                "(a change of assignment falls on an averaging point)")
    if not 0 <= args.seed < 2**31:
        p.error(f"--seed must be in [0, 2**31), got {args.seed}")
    if period < 1:
        p.error(f"--sync-every must be at least 1, got {args.sync_every}")
    for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("eval_every", "save_every", "stop_after", "verify_every", "warmup_steps"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        p.error(f"--lr must be positive and finite, got {args.lr}")
    if not (args.weight_decay >= 0 and math.isfinite(args.weight_decay)):
        p.error(f"--weight-decay must be >= 0 and finite, got {args.weight_decay}")
    if not 0.0 <= args.beta2 < 1.0:
        p.error(f"--beta2 must be in [0, 1), got {args.beta2}")
    if not (0.0 <= args.min_lr <= args.lr and math.isfinite(args.min_lr)):
        p.error(f"--min-lr must be in [0, --lr = {args.lr}], got {args.min_lr}")
    _check_training_args(p, args)
    _check_method_options(p, args)
    if args.width is not None and args.width < 1:
        p.error(f"--width must be at least 1, got {args.width}")
    _check_preset(p, args)
    if args.nproc is not None and args.nproc < 1:
        p.error(f"--nproc must be at least 1, got {args.nproc}")
    try:  # refused here, before any worker starts (e.g. --device cuda --nproc 2 on one GPU)
        choose_backend(args.backend, args.device, args.nproc or 1)
    except ValueError as e:
        p.error(str(e))
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        p.error(f"--timeout must be a positive, finite number of seconds, got {args.timeout}")
    if args.keep_last < 1:
        p.error(f"--keep-last must be at least 1, got {args.keep_last}")
    if args.max_skipped is not None and args.max_skipped < 0:
        p.error(f"--max-skipped must be >= 0, got {args.max_skipped}")
    if args.verify_every and args.method == "fsdp":
        p.error("--verify-every needs replicated copies to compare (sdp or ddp); fsdp shards every parameter")
    if args.verify_every and args.verify_every % period:
        p.error(f"--verify-every {args.verify_every} must be a multiple of --sync-every's longest period {period}: "
                "owners agree only right after the steps that average")
    _check_checkpoint_args(p, args)
    if not args.bucket_cap_mb > 0:
        p.error(f"--bucket-cap-mb must be positive, got {args.bucket_cap_mb}")
    _check_shard_shared(p, args)
    if (args.simulate_rank is None) != (args.world_size is None):
        p.error("--simulate-rank R and --world-size K go together")
    if args.simulate_rank is not None:
        if args.method != "sdp":
            p.error(f"--simulate-rank applies to --method sdp (a full replica is --method ddp --nproc 1), "
                    f"got --method {args.method}")
        if args.world_size < 1 or not 0 <= args.simulate_rank < args.world_size:
            p.error(f"--simulate-rank must be in [0, --world-size), got {args.simulate_rank} of {args.world_size}")
        if (args.nproc or 1) != 1:
            p.error(f"--simulate-rank runs one process; drop --nproc {args.nproc}")
        if args.save_dir:
            p.error("--simulate-rank holds one rank's share of the model, so it cannot write checkpoints; "
                    "drop --save-dir")
        if args.verify_every:
            p.error("--verify-every compares the owners' copies, but --simulate-rank runs one rank alone; "
                    "drop --verify-every")
    if args.data.startswith(("cifar:", "tokens:")) and not os.path.exists(args.data.split(":", 1)[1]):
        p.error(f"--data {args.data}: path {args.data.split(':', 1)[1]!r} does not exist")


def _check_method_options(p, args) -> None:
    """Refuse SDP options given to ddp or fsdp (set to other values than their defaults), which
    would otherwise be ignored without a word."""
    if args.method == "sdp":
        return
    given = [f"--{name.replace('_', '-')}" + ("" if getattr(args, name) is True else f" {getattr(args, name)}")
             for name in SDP_ONLY if getattr(args, name) != p.get_default(name)]
    if given:
        p.error(f"{', '.join(given)}: SDP option(s), but --method {args.method} trains the whole model on every rank "
                f"and would ignore them; drop them, or use --method sdp")


def _check_shard_shared(p, args) -> None:
    if args.shard_shared and (args.method != "sdp" or args.simulate_rank is not None
                              or longest_period(args.sync_every) > 1):
        p.error("--shard-shared applies to --method sdp with --sync-every 1 and without --simulate-rank (FSDP2 "
                f"shards over real ranks, every step); got --method {args.method}, --sync-every {args.sync_every}"
                + (f", --simulate-rank {args.simulate_rank}" if args.simulate_rank is not None else ""))


def _check_training_args(p, args) -> None:
    if not 0.0 <= args.stochastic_depth < 1.0:
        p.error(f"--stochastic-depth is a drop probability in [0, 1), got {args.stochastic_depth}")
    if args.stochastic_depth and args.method != "ddp":
        p.error(f"--stochastic-depth applies to --method ddp (SDP's block level already trains subnetworks; FSDP2 "
                f"cannot reduce blocks a rank skipped), got --method {args.method}")
    if args.grad_clip is not None and not (args.grad_clip > 0 and math.isfinite(args.grad_clip)):
        p.error(f"--grad-clip must be positive and finite, got {args.grad_clip}")
    if args.warmup_steps >= args.steps and args.warmup_steps:
        p.error(f"--warmup-steps {args.warmup_steps} must be less than --steps {args.steps}")
    if args.model.startswith("hf:") and (args.preset is not None or args.width is not None):
        p.error(f"--preset and --width apply to the project's models; --model {args.model} takes its size from "
                "DIR/config.json")
    if args.model.startswith("hf:") and not os.path.isfile(os.path.join(args.model[3:], "config.json")):
        p.error(f"--model {args.model}: {os.path.join(args.model[3:], 'config.json')!r} does not exist")


def _check_preset(p, args) -> None:
    presets = {"llama": LLAMA_PRESETS, "gpt": GPT_PRESETS}
    if args.model in presets and args.preset not in (None, *presets[args.model]):
        p.error(f"--preset {args.preset!r} is not a {args.model} preset; choose one of "
                f"{', '.join(presets[args.model])}")
    if args.model not in presets and not args.model.startswith("hf:") and args.preset is not None:
        p.error(f"--preset applies to --model llama or gpt only, got --preset {args.preset!r} with --model {args.model}")
    if args.model in presets and args.width is not None:
        p.error(f"--width does not apply to {args.model}; pick a --preset instead")
    if args.model == "gpt" and args.seq_len > GPT_PRESETS[args.preset or "tiny"].block_size:
        p.error(f"--seq-len {args.seq_len} exceeds the gpt {args.preset or 'tiny'} preset's context of "
                f"{GPT_PRESETS[args.preset or 'tiny'].block_size} tokens")


def _check_checkpoint_args(p, args) -> None:
    from ..state.checkpoint_store import list_checkpoints

    if args.resume in ("latest", "auto") and not args.save_dir:
        p.error(f"--resume needs --save-dir (--resume {args.resume} looks for checkpoints there)")
    if args.resume not in (None, "latest", "auto") and not os.path.isdir(args.resume):
        p.error(f"--resume {args.resume!r}: no such checkpoint folder (use latest, auto or a step-N folder)")
    if args.save_dir and os.path.exists(args.save_dir) and not os.path.isdir(args.save_dir):
        p.error(f"--save-dir {args.save_dir!r} exists and is not a folder")
    if args.save_dir and not args.resume and list_checkpoints(args.save_dir):
        p.error(f"--save-dir {args.save_dir!r} already holds checkpoints of a run; continue it with --resume "
                "(or --resume auto), or choose another folder (checkpoints are never overwritten silently)")


def training_args(**overrides) -> argparse.Namespace:
    """The arguments of one run as `subnet-train` would parse them: the defaults, with
    `overrides` (attribute names: method="sdp", batch_size=16, ...), checked by check_args.
    For programs that launch runs (compare) without building command lines.

    Raises:
        ValueError: an unknown setting, or a value check_args refuses (its message).
    """
    parser = build_parser()
    args = parser.parse_args([])
    unknown = sorted(set(overrides) - set(vars(args)))
    if unknown:
        raise ValueError(f"training_args: unknown setting(s) {unknown}; known: {sorted(vars(args))}")
    vars(args).update(overrides)

    def refuse(message):
        raise ValueError(message)

    parser.error = refuse  # check_args reports through parser.error: a ValueError here, not an exit
    check_args(parser, args)
    return args

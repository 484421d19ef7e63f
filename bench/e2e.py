"""End-to-end step benchmark (gloo): torch DDP, torch FSDP2 and SDP side by side.

    python bench/e2e.py                       # the broad grid (one of the two runs of make bench-e2e)
    python bench/e2e.py --models tiny --worlds 2 --coverages 0.5 --rounds 2 --steps 1 --min-seconds 0  # a quick look
    python bench/e2e.py --device cuda --methods ddp,sdp --sdp-variants block-forward --skip-overlap

--device cuda puts every rank on GPU rank % GPU count (several ranks may share one GPU:
the process group stays gloo, which, unlike NCCL, allows that); peak memory is then the
CUDA allocator's peak instead of resident-memory growth.

Grid: llama presets × world sizes × {ddp, fsdp, sdp (block|neuron) × (forward|backward) ×
coverages}. Configurations of one preset and world size form a group, run in the same
worker processes (one thread each, gloo on 127.0.0.1) in interleaved rounds: each round
runs every configuration of the group once on the same shapes (built afresh, warmed up,
one timed window, torn down; e2e_worker.py), so a slow spell of the shared machine hits
one round of every configuration rather than every step of one. Per configuration: step
time (median over rounds of the slowest rank's median step), its ratio to DDP taken per
round (median and range over rounds), model-state bytes (parameters + gradients +
optimizer state, worst rank), peak resident-memory growth from before the model was built
(worst rank), bytes handed to collectives and collectives per step. Then the overlap
experiment (SDP with overlap on, off, and with no communication at all: every rank
simulating itself, in rounds of its own), the targets' verdicts (each on the median ratio),
and with --profile where one step's time goes (torch.profiler's top ops per configuration).

Everything printed is measured in this run; the Markdown goes to --out with the command,
commit and the load average before and after.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import provenance
from e2e_report import (combine, growth_tables, main_table, overlap_lines, profile_section, sdp_targets,
                        shard_targets)
from e2e_worker import Config, run_group
from subnet_ext.planning.buckets import DEFAULT_BUCKET_CAP_MB

METHOD_ORDER = ("ddp", "fsdp", "sdp")
SDP_VARIANTS = (("block", "forward"), ("block", "backward"), ("neuron", "forward"), ("neuron", "backward"))
GROUP_TIMEOUT_S = 4 * 3600  # one group's rounds, all configurations together


def grid(opts) -> list[list[Config]]:
    """The configurations, one list per group (preset, world size), DDP first."""
    groups = []
    for model in opts.models:
        for world in opts.worlds:
            base = dict(model=model, world=world, steps=opts.steps, min_seconds=opts.min_seconds,
                        warmup=opts.warmup, batch_size=opts.batch_size, seq_len=opts.seq_len,
                        bucket_cap_mb=opts.bucket_cap_mb, device=opts.device)
            configs = [Config(method=m, **base) for m in ("ddp", "fsdp") if m in opts.methods]
            for level, regime in (opts.sdp_variants if "sdp" in opts.methods else ()):
                for c in (c for k, c in opts.coverages if k in (None, world)):
                    for shard in {"off": (False,), "also": (False, True), "only": (True,)}[opts.shard_shared]:
                        configs.append(Config(method="sdp", level=level, regime=regime, coverage=c,
                                              shard_shared=shard, **base))
            groups.append(configs)
    return groups


def run_configs(configs: list[Config], opts) -> list[tuple[Config, dict]]:
    """One group's configurations in interleaved rounds; a group whose workers fail gives
    every configuration that error."""
    from subnet_ext.testing import run_distributed

    try:
        per_rank = run_distributed(run_group, configs[0].world, configs, opts.rounds, opts.profile,
                                   timeout=GROUP_TIMEOUT_S)
    except RuntimeError as e:
        lines = [ln for ln in str(e).splitlines() if "Error" in ln]
        return [(cfg, {"error": (lines[0] if lines else str(e))[:200]}) for cfg in configs]
    return combine(configs, per_rank)


def overlap_experiment(opts) -> tuple[list[str], dict]:
    """SDP with overlap on / off / no communication at all, on a setting with heavy traffic."""
    base = dict(model=opts.overlap_model, world=2, method="sdp", level="block", regime="forward", coverage=1.0,
                steps=opts.steps, min_seconds=opts.min_seconds, warmup=opts.warmup,
                batch_size=opts.overlap_batch_size, seq_len=opts.seq_len,
                bucket_cap_mb=opts.overlap_bucket_cap_mb, device=opts.device)
    runs = {"overlap": Config(**base), "no overlap": Config(**base, overlap=False),
            "no communication": Config(**base, simulate=True)}
    done = dict(zip(runs, (r for _, r in run_configs(list(runs.values()), opts))))
    description = (
        f"Overlap: llama {opts.overlap_model}, K = 2, SDP block forward at coverage 1.0 (every parameter averaged "
        f"over both ranks), batch {opts.overlap_batch_size} × {opts.seq_len} per rank (small, so that communication "
        f"is a large share of the step), buckets of {opts.overlap_bucket_cap_mb:g} MiB; \"no communication\": each "
        "rank simulates itself (collectives are no-ops, packing still runs), same processes and threads; the three "
        f"in {opts.rounds} interleaved rounds of their own.")
    return overlap_lines(done, description), done


def parse(argv=None):
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,small,medium", help="llama presets, comma-separated")
    p.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    p.add_argument("--coverages", default="0.25,0.5,1.0",
                   help="SDP coverages, comma-separated; K:C runs coverage C at world size K only (e.g. 2:0.5,4:0.25)")
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved rounds: each runs every configuration of a group once (ratios per round)")
    p.add_argument("--steps", type=int, default=3, help="per round: at least this many timed steps per configuration")
    p.add_argument("--min-seconds", type=float, default=1.0,
                   help="per round: and at least this many seconds of timed steps (at most 60 steps)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed steps per configuration per round, at least 1 (the first step allocates the "
                        "gradients and optimizer state)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--bucket-cap-mb", type=float, default=DEFAULT_BUCKET_CAP_MB, help="DDP's and SDP's bucket size")
    p.add_argument("--overlap-model", default="small")
    p.add_argument("--overlap-bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--overlap-batch-size", type=int, default=2)
    p.add_argument("--out", default="bench/results/e2e-cpu.md")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where every rank runs")
    p.add_argument("--methods", default="ddp,fsdp,sdp", help="a subset of ddp,fsdp,sdp, comma-separated")
    p.add_argument("--sdp-variants", default=",".join(f"{lv}-{rg}" for lv, rg in SDP_VARIANTS),
                   help="SDP level-regime pairs, comma-separated (e.g. block-forward)")
    p.add_argument("--skip-overlap", action="store_true", help="leave out the overlap experiment")
    p.add_argument("--shard-shared", choices=("off", "also", "only"), default="off",
                   help="SDP rows with the shared parameters sharded by FSDP2 (sdp-*-shard): none, beside the "
                        "unsharded rows, or instead of them")
    p.add_argument("--fail-on-error", action="store_true",
                   help="exit 1 when a configuration failed or was refused (bench/gpu_check.sh)")
    p.add_argument("--profile", action="store_true",
                   help="profile one step per configuration (rank 0, torch.profiler) and list its top ops")
    opts = p.parse_args(argv)
    if opts.rounds < 1 or opts.warmup < 1 or opts.steps < 1:
        p.error(f"--rounds, --warmup and --steps must be at least 1, got {opts.rounds}, {opts.warmup}, {opts.steps}")
    opts.methods = opts.methods.split(",")
    if not opts.methods or set(opts.methods) - set(METHOD_ORDER):
        p.error(f"--methods must be a subset of {','.join(METHOD_ORDER)}, got {','.join(opts.methods)}")
    opts.sdp_variants = [tuple(v.split("-", 1)) for v in opts.sdp_variants.split(",")]
    if set(opts.sdp_variants) - set(SDP_VARIANTS):
        p.error(f"--sdp-variants must be among {','.join(f'{a}-{b}' for a, b in SDP_VARIANTS)}")
    if opts.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU is visible")
    opts.models = opts.models.split(",")
    opts.worlds = [int(k) for k in opts.worlds.split(",")]
    opts.coverages = [(int(c.split(":")[0]), float(c.split(":")[1])) if ":" in c else (None, float(c))
                      for c in opts.coverages.split(",")]
    return opts


def header(opts, command: str, started: float, load_before: str) -> list[str]:
    """Title, command, commit, machine and load, and what the columns mean."""
    return [
        f"# End-to-end step benchmark ({opts.device.upper()}, gloo)", "",
        f"Command: `{command}`, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}, "
        f"commit {provenance.commit()}, wall time {time.time() - started:.0f} s.",
        f"Machine: {provenance.machine()}. Load average (1, 5, 15 min): {load_before} before, {provenance.load()} "
        "after.",
        f"Each rank one process with one thread, gloo on 127.0.0.1. Per rank: batch {opts.batch_size} × "
        f"{opts.seq_len} tokens of synthetic Markov text, AdamW. {opts.rounds} interleaved rounds per group (preset, "
        f"K): each round builds every configuration afresh, runs {opts.warmup} warm-up step(s) and a window of at least "
        f"{opts.steps} timed steps and {opts.min_seconds:g} s (at most 60 steps). Step ms: median over rounds of the "
        "slowest rank's median step. ×ddp of step time: the ratio taken in each round, median [min-max] over rounds; "
        f"every verdict uses the median. DDP and SDP buckets {opts.bucket_cap_mb:g} MiB.",
        "FLOPs/rank ×ddp (plan): the busiest rank's share of one forward's FLOPs as its plan counts them (traced "
        "from a sample; a DDP or FSDP2 rank computes everything): the compute floor of the step-time ratio. "
        "Model state: parameters + gradients + optimizer state held by the worst rank (tensor accounting). "
        "Peak RSS growth: the worst rank's resident-memory high-water mark minus its resident memory before the "
        "model was built (the mark reset and freed heap returned to the OS before each build). Comm: bytes handed to "
        "collectives per step (DDP: counted in a comm hook; SDP: counted by its communicator; FSDP2: predicted from "
        "its fixed schedule; sdp-*-shard rows: SDP's counted bytes plus FSDP2's all-gather + reduce-scatter of the "
        "shared parameters, predicted from their sizes).",
        *([f"Device: {torch.cuda.get_device_name(0)}, ranks on GPU rank % {torch.cuda.device_count()}; the peak "
           "RSS growth column is the CUDA allocator's peak minus what was allocated before the model was built."]
          if opts.device == "cuda" else []), "",
    ]


def main(argv=None) -> int:
    """Runs the grid group by group, then the overlap experiment; writes --out."""
    opts = parse(argv)
    started, load_before = time.time(), provenance.load()
    results = []
    for configs in grid(opts):
        if configs:
            print(f"[e2e] llama {configs[0].model}, K={configs[0].world}: {len(configs)} configurations, "
                  f"{opts.rounds} rounds", flush=True)
            results += run_configs(configs, opts)
    overlap, overlap_res = ([], {}) if opts.skip_overlap else overlap_experiment(opts)
    small = "small" if "small" in opts.models else opts.models[0]
    command = " ".join(["python bench/e2e.py", *(sys.argv[1:] if argv is None else argv)])
    verdicts = [*sdp_targets(results, overlap_res, small, opts.device), *shard_targets(results, small, opts.device)]
    lines = [*header(opts, command, started, load_before), *verdicts[1:], "", *main_table(results),
             *growth_tables(results, opts.models, opts.worlds), "", *overlap, *profile_section(results)]
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(opts.out) or ".", exist_ok=True)
    with open(opts.out, "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {opts.out}")
    failed = [c.label for c, r in results if "error" in r] + [f"overlap: {k}" for k, r in overlap_res.items()
                                                              if "error" in r]
    print(f"[summary] {len(results)} configuration(s), {len(failed)} failed or refused"
          + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed and opts.fail_on_error else 0


if __name__ == "__main__":
    sys.exit(main())

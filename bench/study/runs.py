"""What the study runs: the sizes (profiles), the run list, the protocols' marks and where each
result goes.

The benchmark is nanoGPT's Tiny Shakespeare CPU recipe (subnet_ext/data/shakespeare.py): the
project's GPT at 4 layers x 128 (preset `shakespeare`: no biases, tied embedding, GPT-2
initialisation), context 64, 12 sequences per iteration over the K = 4 ranks (3 each), AdamW
(betas 0.9, 0.99; weight decay 0.1 on matrices), gradient clipping 1.0, peak learning rate 1e-3
after 100 warmup iterations, 2,000 iterations: DDP's equal-tokens mark. Validation loss is the
mean over every 64-character window of the validation split (1,742 windows).

Runs (every run over each seed; C = 0.5: two owners per unit, C = 0.25: one):
- anchor: the published recipe as published (its cosine schedule to 1e-4 at 2,000 iterations,
  no cooldown branch), in one process (12 sequences) and on K = 4 ranks (3 each): does our
  harness reproduce nanoGPT's 1.88?
- ddp; ddp-halfbatch (DDP at half the batch per rank, rounded: 2 of the recipe's 3 sequences,
  so fewer FLOPs per step and more steps at equal FLOPs); ddp-sd-c0.5 (stochastic depth, every block dropped with
  probability 0.5 on each rank independently);
- smaller dense models (controls): the size of one SDP subnetwork, trained as DDP:
  dense-half-depth (2 of the 4 blocks: block level at C = 0.5), dense-half-width (2 of 4 heads,
  256 of 512 MLP neurons: neuron level at C = 0.5), and the quarter ones (C = 0.25);
- sdp-{block,neuron}-{forward,backward}-c{0.5,0.25}: both levels, both regimes, both coverages;
- derived runs, which compute the same updates as the run they read their loss from and are
  measured on a few steps of their own (memory, FLOPs, communication): fsdp (FSDP2) and ddp-ac
  (activation checkpointing of every block) from ddp; sdp-*-forward-ac-c0.5 from the SDP run.
The deeper model (task `shakespeare-deep`, 8 blocks, the same recipe) runs DDP, block-level SDP
in the forward regime and its smaller dense control (4 blocks) to show how the block level's
full model changes with depth.

Protocols: each is a mark, a step count fixed before the run reaches it: equal tokens (the
step where the run's tokens reach DDP's), equal FLOPs (the first step where its FLOPs reach
DDP's) and, on CUDA only, equal wall time. The stable trajectory runs at a constant rate after
warmup; every mark M is read after a cooldown branch of d = round(cooldown x M) steps from step
M - d, the rate decaying linearly (warmup-stable-decay), for every method alike.
"""
from __future__ import annotations

import math
import os

from subnet_ext.vocabulary import LEVELS, REGIMES

# Sizes. "full" is `make study` (62 training runs of 2,000 iterations: hours on 2 CPU cores,
# docs/status.md); "quick" its reduced form, which CI runs
# (<= 3 min): the whole pipeline at a few steps; "cuda" the same study, one GPU per rank.
_RECIPE = dict(model="gpt", data="shakespeare", seq_len=64, batch_size=3, lr=1e-3, min_lr=1e-4, beta2=0.99,
               weight_decay=0.1, decay="matrices", grad_clip=1.0, warmup_steps=100, eval_sequences=None)
_MAIN = dict(_RECIPE, preset="shakespeare", runs="main", anchor=True)
_DEEP = dict(_RECIPE, preset="shakespeare-deep", runs="deep", anchor=False)
# Memory a user would recognise: a wider model (d = 256) at micro-batch 1 x 128 in bf16 autocast, where
# model state fills most of a step's memory; a few metered steps per method, no training run.
_MEMORY = dict(_RECIPE, preset="shakespeare-d256", runs="memory", anchor=False, batch_size=1, seq_len=128,
               precision="bf16", steps=4, warmup_steps=1, eval_every=4, eval_sequences=8, seeds=1)
PROFILES = {
    "full": dict(seeds=3, cooldown=0.2, wall_time=False, measure_steps=4, timeout=900.0, tasks={
        "shakespeare": dict(_MAIN, steps=2000, eval_every=250),
        "shakespeare-deep": dict(_DEEP, steps=2000, eval_every=250, seeds=2), "memory-bf16": _MEMORY}),
    # The schedules of ownership (SCHEDULES) beside their static runs, DDP and the half-size dense models:
    # `python -m bench.study --profile schedules` (docs/study-schedules.md); the best of each level joins the
    # full study (BEST_SCHEDULES).
    "schedules": dict(seeds=2, cooldown=0.2, wall_time=False, measure_steps=4, timeout=900.0, tasks={
        "shakespeare": dict(_MAIN, steps=2000, eval_every=250, runs="schedules", anchor=False)}),
    "quick": dict(seeds=2, cooldown=0.25, wall_time=False, measure_steps=4, timeout=300.0, tasks={
        "shakespeare": dict(_MAIN, steps=8, warmup_steps=2, eval_every=4, eval_sequences=24),
        "shakespeare-deep": dict(_DEEP, steps=8, warmup_steps=2, eval_every=4, eval_sequences=24),
        "memory-bf16": _MEMORY}),
    "cuda": dict(seeds=5, cooldown=0.2, wall_time=True, measure_steps=12, timeout=900.0, tasks={
        "shakespeare": dict(_MAIN, steps=2000, eval_every=250),
        "shakespeare-deep": dict(_DEEP, steps=2000, eval_every=250), "memory-bf16": _MEMORY}),
}
TASKS = ("shakespeare", "shakespeare-deep", "memory-bf16")
MAIN_TASK = "shakespeare"
MEMORY_TASK = "memory-bf16"
MAIN_K = 4
MAX_EXTENSION = 10  # no mark beyond 10 x `steps` (flagged "capped")
# "No worse" means worse by less than this (nats per character), declared before the runs: the tolerance
# within which our DDP must reproduce nanoGPT's published loss, and a difference a user of this benchmark
# would call "the same quality". Used only where a family's seeds can support it (stats.py).
EQUIVALENCE_MARGIN = 0.05
COVERAGES = (0.5, 0.25)
# Ownership that moves (planning/assignment/schedule.py), block and neuron level, forward regime, C = 0.5, the "schedules"
# profile's sweep: (level, assignment, reassign_every, block_assignment). Neuron-level redraw every step
# is left out: a redraw scatters a group's units into hundreds of pieces, and rebuilding that every step costs
# more than the step (bench/results/reassignment-cpu.md measures a change's cost).
SCHEDULES = (("block", "static", 0, "contiguous"), ("block", "redraw", 1, "balanced"),
             ("block", "redraw", 10, "balanced"), ("block", "redraw", 50, "balanced"),
             ("block", "redraw", 250, "balanced"), ("block", "rolling", 50, "contiguous"),
             ("neuron", "redraw", 10, "balanced"), ("neuron", "redraw", 50, "balanced"),
             ("neuron", "redraw", 250, "balanced"), ("neuron", "rolling", 10, "balanced"))
# The sweep's best schedule of each level at equal tokens (docs/study-schedules.md; a test checks these against its
# summary.json): the full study trains them on every seed, the block level's on the deeper model too.
BEST_SCHEDULES = (("block", "rolling", 50, "contiguous"),)  # neuron level: no schedule beat its static run
# The smaller dense models: (name, GPT preset, the SDP setting whose per-rank size it has).
DENSE_CONTROLS = {"main": (("dense-half-depth", "shakespeare-half-depth", ("block", 0.5)),
                           ("dense-half-width", "shakespeare-half-width", ("neuron", 0.5)),
                           ("dense-quarter-depth", "shakespeare-quarter-depth", ("block", 0.25)),
                           ("dense-quarter-width", "shakespeare-quarter-width", ("neuron", 0.25))),
                  "deep": (("dense-half-depth", "shakespeare", ("block", 0.5)),)}


def data_path(path: str | None = None) -> str:
    """The Tiny Shakespeare file: `path`, else $SUBNET_EXT_TINY_SHAKESPEARE, else ../shared/data next to
    the repository (where this project's machines keep it)."""
    from subnet_ext.data.shakespeare import ENVIRONMENT_VARIABLE

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return path or os.environ.get(ENVIRONMENT_VARIABLE) or os.path.join(os.path.dirname(repo), "shared", "data",
                                                                       "tinyshakespeare.txt")


def _cfg(task: str, k: int, seed: int, name: str, method: str, **extra) -> dict:
    return {"task": task, "name": name, "K": k, "seed": seed, "method": method, "baseline": "ddp", **extra}


def _sdp(task, k, seed, level, regime, coverage, suffix="", **extra) -> dict:
    return _cfg(task, k, seed, f"sdp-{level}-{regime}{suffix}-c{coverage:g}", "sdp", level=level, regime=regime,
                coverage=coverage, **extra)


def schedule_name(level: str, assignment: str, every: int, block_assignment: str) -> str:
    """The run name of a SCHEDULES entry (forward regime, C = 0.5): sdp-block-forward-redraw10-c0.5,
    sdp-block-forward-contig-c0.5 (static, contiguous), sdp-block-forward-rolling50-contig-c0.5."""
    suffix = "" if assignment == "static" else f"-{assignment}{every}"
    suffix += "-contig" if block_assignment == "contiguous" else ""
    return f"sdp-{level}-forward{suffix}-c0.5"


def seed_mean(per_seed: dict, name: str, model: str = "full", k: int = MAIN_K) -> float | None:
    """The mean over seeds of run `name`'s loss at equal tokens for `model` ("full", "ensemble",
    "subnetworks": a seed's list of the ranks' losses counts as its mean) from a summary's per_seed;
    None when no seed measured it."""
    values = per_seed.get(f"K{k}/{name}", {}).get("tokens", {}).get(model, {}).values()
    flat = [sum(v) / len(v) if isinstance(v, list) else v for v in values if v is not None]
    return sum(flat) / len(flat) if flat else None


def best_schedules(per_seed: dict, k: int = MAIN_K) -> tuple:
    """The best SCHEDULES entry of each level at equal tokens (the lowest mean full-model loss over the
    seeds), kept only where it beats that level's static run (forward regime, C = 0.5): what BEST_SCHEDULES
    must be, read off a sweep's summary.json (`per_seed` of the main task). A level without every one of
    its runs measured gives nothing."""
    best = []
    for level in LEVELS:
        entries = [e for e in SCHEDULES if e[0] == level]
        losses = {e: seed_mean(per_seed, schedule_name(*e), k=k) for e in entries}
        static = seed_mean(per_seed, f"sdp-{level}-forward-c0.5", k=k)
        if static is None or any(v is None for v in losses.values()):
            continue
        entry = min(losses, key=losses.get)
        if losses[entry] < static:
            best.append(entry)
    return tuple(best)


def _schedule_runs(task, k, seed, levels, schedules) -> list[dict]:
    out = []
    for level, assignment, every, block_assignment in schedules:
        if level in levels:
            cfg = _sdp(task, k, seed, level, "forward", 0.5, assignment=assignment, reassign_every=every,
                       block_assignment=block_assignment)
            cfg["name"] = schedule_name(level, assignment, every, block_assignment)
            out.append(_job(cfg))
    return out


def _job(config: dict, readers=()) -> dict:
    return {"config": config, "readers": list(readers)}


def anchor_jobs(task: str, seeds: list[int]) -> dict[int, list[dict]]:
    """{world size: jobs}: the published recipe as published (cosine schedule, one mark at `steps`), in
    one process with the whole batch and on MAIN_K ranks."""
    out = {}
    for k in (1, MAIN_K):
        out[k] = [_job(_cfg(task, k, seed, "recipe", "ddp", schedule="cosine", batch_size_factor=MAIN_K / k,
                            baseline=None)) for seed in seeds]
    return out


def jobs(task: str, seeds: list[int], k: int = MAIN_K, runs: str = "main") -> list[dict]:
    """The jobs of `task` at world size k (the anchor's are apart: anchor_jobs), DDP first for every seed (the
    others read its tokens and FLOPs): [{"config": trained cfg, "readers": [derived cfg, ...]}].
    runs: "main" (the whole list, BEST_SCHEDULES included), "deep" (DDP, block-level SDP forward and its best
    schedule), "schedules" (DDP, the half-size dense models, the static forward runs at C = 0.5 and
    SCHEDULES) or "memory" (memory_jobs)."""
    if runs == "memory":
        return memory_jobs(task, k)
    if runs == "schedules":
        out = []
        for seed in seeds:
            out.append(_job(_cfg(task, k, seed, "ddp", "ddp")))
            # The smaller dense models of a C = 0.5 subnetwork's size: what a user would train instead.
            out += [_job(_cfg(task, k, seed, name, "ddp", preset=preset))
                    for name, preset, (_, coverage) in DENSE_CONTROLS["main"] if coverage == 0.5]
            out += [_job(_sdp(task, k, seed, level, "forward", 0.5)) for level in LEVELS]
            out += _schedule_runs(task, k, seed, LEVELS, SCHEDULES)
        return out
    out = []
    for seed in seeds:
        ddp = _cfg(task, k, seed, "ddp", "ddp")
        out.append(_job(ddp, [_cfg(task, k, seed, "fsdp", "fsdp", derived_from="ddp"),
                              _cfg(task, k, seed, "ddp-ac", "ddp", activation_checkpointing=True,
                                   derived_from="ddp")] if runs == "main" else []))
        for name, preset, _ in DENSE_CONTROLS[runs]:
            out.append(_job(_cfg(task, k, seed, name, "ddp", preset=preset)))
        if runs == "deep":
            out.append(_job(_sdp(task, k, seed, "block", "forward", 0.5)))
            out += _schedule_runs(task, k, seed, ("block",), BEST_SCHEDULES)
            continue
        out += [_job(_cfg(task, k, seed, "ddp-halfbatch", "ddp", batch_size_factor=0.5)),
                _job(_cfg(task, k, seed, "ddp-sd-c0.5", "ddp", stochastic_depth=0.5))]
        for coverage in COVERAGES:
            for level in LEVELS:
                for regime in REGIMES:
                    cfg = _sdp(task, k, seed, level, regime, coverage)
                    readers = []
                    if coverage == 0.5 and regime == "forward":
                        readers.append(_sdp(task, k, seed, level, regime, coverage, "-ac", activation_checkpointing=True,
                                            derived_from=cfg["name"]))
                    out.append(_job(cfg, readers))
        out += _schedule_runs(task, k, seed, LEVELS, BEST_SCHEDULES)
    return out


def memory_jobs(task: str, k: int = MAIN_K) -> list[dict]:
    """The bf16 memory measurement: DDP, FSDP2, checkpointing and SDP (both levels and regimes at C = 0.5,
    block level forward at C = 0.25, and with checkpointing), each a few metered steps (no loss)."""
    cfgs = [_cfg(task, k, 0, "ddp", "ddp"), _cfg(task, k, 0, "fsdp", "fsdp"),
            _cfg(task, k, 0, "ddp-ac", "ddp", activation_checkpointing=True)]
    cfgs += [_sdp(task, k, 0, level, regime, 0.5) for level in LEVELS for regime in REGIMES]
    cfgs += [_sdp(task, k, 0, "block", "forward", 0.25),
             _sdp(task, k, 0, "block", "forward", 0.5, "-ac", activation_checkpointing=True)]
    return [_job(dict(c, measure_only=True, baseline=None)) for c in cfgs]


def all_configs(task: str, seeds: list[int], runs: str = "main") -> list[dict]:
    """Every configuration of `task` at MAIN_K (trained and derived), in the order they run."""
    return [c for j in jobs(task, seeds, MAIN_K, runs) for c in [j["config"], *j["readers"]]]


def result_path(out: str, task: str, k: int, seed: int, name: str) -> str:
    """Where the JSON of configuration `name` (task, world size k, seed) goes."""
    return os.path.join(out, "results", task, f"K{k}", f"seed{seed}", f"{name}.json")


def batch_size_of(cfg: dict, sizes: dict) -> int:
    """The configuration's batch per rank: the task's, times its batch_size_factor."""
    return max(1, round(sizes["batch_size"] * cfg.get("batch_size_factor", 1.0)))


def training_overrides(cfg: dict, sizes: dict, timeout: float, device_type: str) -> dict:
    """subnet_ext.jobs.arguments.training_args(**overrides) of one configuration (sizes: its task's)."""
    overrides = dict(method=cfg["method"], model=sizes["model"], preset=cfg.get("preset", sizes["preset"]),
                     data=sizes["data"], steps=sizes["steps"], batch_size=batch_size_of(cfg, sizes),
                     seq_len=sizes["seq_len"], lr=sizes["lr"], min_lr=sizes["min_lr"], beta2=sizes["beta2"],
                     weight_decay=sizes["weight_decay"], decay=sizes["decay"], grad_clip=sizes["grad_clip"],
                     warmup_steps=sizes["warmup_steps"], seed=cfg["seed"], timeout=timeout, device=device_type,
                     activation_checkpointing=cfg.get("activation_checkpointing", False),
                     stochastic_depth=cfg.get("stochastic_depth", 0.0), precision=sizes.get("precision", "fp32"))
    if cfg["method"] == "sdp":
        overrides.update(level=cfg["level"], regime=cfg["regime"], coverage=cfg["coverage"],
                         assignment=cfg.get("assignment", "static"), reassign_every=cfg.get("reassign_every", 0),
                         block_assignment=cfg.get("block_assignment", "balanced"))
    return overrides


# ---------------------------------------------------------------------------------------- marks
def cooldown_steps(mark: int, fraction: float) -> int:
    """d: the length of the cooldown branch that ends at `mark` (at least 1, at most mark - 1)."""
    return min(max(1, round(fraction * mark)), max(1, mark - 1))


def tokens_mark(base_tokens: int, tokens_per_step: int) -> int:
    """The first step at which a run taking `tokens_per_step` has seen `base_tokens` (DDP's)."""
    return max(1, -(-base_tokens // tokens_per_step))


def flops_mark(base_flops: float, flops_of_step, limit: int) -> int | None:
    """The first step s (1-based count) at which the sum of flops_of_step(0..s-1) reaches
    `base_flops`; None when it does not within `limit` steps. flops_of_step: step -> FLOPs."""
    total = 0.0
    for step in range(limit):
        total += flops_of_step(step)
        if total >= base_flops * (1 - 1e-12):
            return step + 1
    return None


def seconds_mark(base_seconds: float, step_time: float, limit: int) -> int | None:
    """Equal wall time (CUDA profiles): the step at which `step_time` per step reaches
    `base_seconds` (DDP's training seconds at its equal-tokens mark); None beyond `limit`."""
    if step_time <= 0:
        return None
    mark = max(1, math.ceil(base_seconds / step_time - 1e-9))
    return mark if mark <= limit else None

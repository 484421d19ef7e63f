"""What the study runs: the sizes (profiles), the run list and where each result goes.

Runs (K = 4 ranks unless stated, every run over each seed):
- ddp; fsdp (FSDP2, each block and the root sharded); ddp-ac (DDP + activation
  checkpointing of every block); ddp-sd-c0.5 and ddp-sd-c0.25 (DDP + stochastic depth,
  each block dropped per step and rank with probability 1 - C, branches scaled by C at
  evaluation);
- sdp-{block,neuron}-{forward,backward}-c{0.5,0.25} (C = 0.5: two owners per unit,
  C = 0.25: one);
- final full-model phases off sdp-block-forward at both coverages: the last
  `phase_fraction` of the steps in the backward regime at the same coverage
  ("+backward-phase") or with C = 1 ("+c1-phase"), resumed from the forward run's full
  state and optimizer state (the resume-on-another-coverage path);
- K = 2 (pysrc): ddp and the four SDP variants at C = 0.5 (one owner per unit).

Protocols, from one run each: the learning rate is constant after a linear warmup, so a
run's loss at step s is what a run of s steps reaches (same batches, same updates), and
each run continues until it has taken `steps` steps AND spent the DDP run's FLOPs AND
its training seconds (same world size and seed). Equal iterations: the loss at `steps`;
FLOP-matched: at the step where its FLOPs reach DDP's; equal time: where its seconds do.
"""
from __future__ import annotations

import os

# Sizes. "full" is `make study` (2 CPU cores, <= 60 min); "quick" its reduced form (<= 10 min);
# "tiny" the CI check of the whole pipeline; "cuda" the same study larger, one GPU per rank.
# Per task: the model (a preset of the GPT; the residual MLP on digits), the batch per rank,
# the steps, the evaluation grid and the held-out set (pysrc: windows of the validation files).
_DIGITS = dict(model="mlp", preset=None, data="digits", seq_len=1, batch_size=32, eval_sequences=None,
               lr=3e-3, weight_decay=0.0)
PROFILES = {
    "full": dict(seeds=3, phase_fraction=0.1, time_check_every=5, timeout=900.0, tasks={
        "pysrc": dict(model="gpt", preset="small", data="pysrc", seq_len=128, batch_size=4, steps=300, eval_every=50,
                      eval_sequences=64, lr=2e-3, weight_decay=0.0, warmup_steps=30),
        "digits": dict(_DIGITS, steps=150, eval_every=25, warmup_steps=10)}),
    "quick": dict(seeds=2, phase_fraction=0.2, time_check_every=5, timeout=600.0, tasks={
        "pysrc": dict(model="gpt", preset="small", data="pysrc", seq_len=64, batch_size=4, steps=60, eval_every=20,
                      eval_sequences=32, lr=2e-3, weight_decay=0.0, warmup_steps=6),
        "digits": dict(_DIGITS, steps=50, eval_every=25, warmup_steps=5)}),
    "tiny": dict(seeds=2, phase_fraction=0.5, time_check_every=1, timeout=300.0, tasks={
        "pysrc": dict(model="gpt", preset="small", data="pysrc", seq_len=16, batch_size=2, steps=4, eval_every=4,
                      eval_sequences=8, lr=2e-3, weight_decay=0.0, warmup_steps=1),
        "digits": dict(_DIGITS, batch_size=8, steps=4, eval_every=4, warmup_steps=1)}),
    "cuda": dict(seeds=3, phase_fraction=0.1, time_check_every=10, timeout=900.0, tasks={
        "pysrc": dict(model="gpt", preset="medium", data="pysrc", seq_len=256, batch_size=32, steps=2000,
                      eval_every=200, eval_sequences=512, lr=1e-3, weight_decay=0.0, warmup_steps=100),
        "digits": dict(_DIGITS, steps=400, eval_every=50, warmup_steps=20)}),
}
TASKS = ("pysrc", "digits")
TASK_WORLDS = {"pysrc": (4, 2), "digits": (4,)}  # digits, the second task, at the main world size only

MAIN_K = 4
COVERAGES = (0.5, 0.25)
SDP_VARIANTS = [(level, regime) for level in ("block", "neuron") for regime in ("forward", "backward")]
PHASES = (("backward-phase", "backward", None), ("c1-phase", "forward", 1.0))  # (suffix, regime, coverage)


def _sdp(task: str, k: int, seed: int, level: str, regime: str, coverage: float) -> dict:
    return {"task": task, "name": f"sdp-{level}-{regime}-c{coverage:g}", "K": k, "seed": seed, "method": "sdp",
            "level": level, "regime": regime, "coverage": coverage, "baseline": "ddp"}


def _plain(task: str, k: int, seed: int, name: str, method: str, **extra) -> dict:
    return {"task": task, "name": name, "K": k, "seed": seed, "method": method, "baseline": "ddp", **extra}


def jobs(task: str, seeds: list[int], k: int) -> list[dict]:
    """The jobs of `task` at world size k, DDP first for every seed (the others read its FLOPs and
    time): [{"config": cfg, "phases": [cfg, ...]}]. k = MAIN_K: the full list; other k: C = 0.5 only."""
    out = []
    for seed in seeds:
        out.append({"config": _plain(task, k, seed, "ddp", "ddp"), "phases": []})
        if k == MAIN_K:
            out.append({"config": _plain(task, k, seed, "fsdp", "fsdp"), "phases": []})
            out.append({"config": _plain(task, k, seed, "ddp-ac", "ddp", activation_checkpointing=True),
                        "phases": []})
            for c in COVERAGES:
                out.append({"config": _plain(task, k, seed, f"ddp-sd-c{c:g}", "ddp", stochastic_depth=1.0 - c),
                            "phases": []})
        for c in (COVERAGES if k == MAIN_K else (0.5,)):
            for level, regime in SDP_VARIANTS:
                cfg = _sdp(task, k, seed, level, regime, c)
                phases = []
                if k == MAIN_K and (level, regime) == ("block", "forward"):
                    for suffix, p_regime, p_cov in PHASES:
                        phase = _sdp(task, k, seed, level, p_regime, p_cov or c)
                        phase["name"] = f"{cfg['name']}+{suffix}"
                        phase["phase_of"] = cfg["name"]
                        phases.append(phase)
                out.append({"config": cfg, "phases": phases})
    return out


def world_sizes(main_only: bool = False) -> list[int]:
    """The world sizes the study launches, the main one first."""
    return [MAIN_K] if main_only else [MAIN_K, 2]


def result_path(out: str, task: str, k: int, seed: int, name: str) -> str:
    """Where the JSON of configuration `name` (task, world size k, seed) goes."""
    return os.path.join(out, "results", task, f"K{k}", f"seed{seed}", f"{name}.json")


def training_overrides(cfg: dict, sizes: dict, timeout: float, device_type: str) -> dict:
    """subnet_ext.cli.arguments.training_args(**overrides) of one configuration (sizes: its task's)."""
    overrides = dict(method=cfg["method"], model=sizes["model"], preset=sizes["preset"], data=sizes["data"],
                     steps=sizes["steps"], batch_size=sizes["batch_size"], seq_len=sizes["seq_len"],
                     lr=sizes["lr"], weight_decay=sizes["weight_decay"], warmup_steps=sizes["warmup_steps"],
                     seed=cfg["seed"], timeout=timeout, device=device_type,
                     activation_checkpointing=cfg.get("activation_checkpointing", False),
                     stochastic_depth=cfg.get("stochastic_depth", 0.0))
    if cfg["method"] == "sdp":
        overrides.update(level=cfg["level"], regime=cfg["regime"], coverage=cfg["coverage"])
    return overrides

"""What the study runs: the sizes (profiles), the run list, the protocols' marks and where each
result goes.

Runs (K = 4 ranks; every run over each seed; C = 0.5: two owners per unit, C = 0.25: one):
- ddp; ddp-halfbatch (DDP at half the batch per rank: SDP's FLOPs per step, a dense control
  for the FLOP-matched protocol); ddp-sd-c0.5 (stochastic depth, every block dropped with
  probability 0.5) and ddp-sdlin-c0.5 (the usual linearly increasing drop rates, the same mean);
- sdp-block-{forward,backward}-c0.5, sdp-neuron-forward-c0.5, sdp-block-forward-c0.25, and
  sdp-block-forward-contig-c0.5 (each rank trains runs of neighbouring blocks:
  plan_subnetworks(block_assignment="contiguous")); SDP_VARIANTS says what was left out and why;
- derived runs, which compute the same updates as the run they read their loss from and
  are measured on a few steps of their own (memory, FLOPs, communication): fsdp (FSDP2)
  and ddp-ac (activation checkpointing of every block) from ddp; sdp-*-ac-c0.5 (SDP with
  checkpointing) from the SDP run. CI checks that fsdp and ddp-ac train DDP's model;
- a final phase off each sdp-block-forward run: its cooldown to the equal-tokens mark
  trained in the backward regime at the same coverage ("+backward-phase").
Digits (the second task) runs DDP, its derived runs, the dense control, uniform stochastic depth
and the four C = 0.5 variants.

Protocols: each is a mark, a step count fixed before the run reaches it: equal tokens (the
step where the run's tokens reach DDP's), equal FLOPs (the first step where its FLOPs reach
DDP's) and, on CUDA only, equal wall time (predicted from the run's median step time;
on these CPUs the ranks share two cores, so time is not a protocol). The stable trajectory
runs at a constant rate after warmup; every mark M is read after a cooldown branch of
d = round(cooldown x M) steps from step M - d, the rate decaying linearly (warmup-stable-decay),
for every method alike.
"""
from __future__ import annotations

import math
import os

# Sizes. "full" is `make study` (2 CPU cores, <= 60 min); "quick" its reduced form (<= 10 min: at 40
# text steps it took 10.2 min alone here);
# "tiny" the CI check of the whole pipeline; "cuda" the same study larger, one GPU per rank.
_DIGITS = dict(model="mlp", preset=None, data="digits", seq_len=1, batch_size=32, eval_sequences=None,
               lr=3e-3, weight_decay=0.0, runs="small")
_TEXT = dict(model="gpt", preset="deep", data="pysrc", lr=2e-3, weight_decay=0.0, runs="main")
PROFILES = {
    "full": dict(seeds=5, cooldown=0.2, wall_time=False, measure_steps=4, timeout=900.0, tasks={
        "pysrc": dict(_TEXT, seq_len=64, batch_size=4, steps=120, eval_every=40, eval_sequences=64, warmup_steps=12),
        "digits": dict(_DIGITS, steps=120, eval_every=40, warmup_steps=10)}),
    "quick": dict(seeds=3, cooldown=0.2, wall_time=False, measure_steps=4, timeout=600.0, tasks={
        "pysrc": dict(_TEXT, seq_len=64, batch_size=4, steps=28, eval_every=14, eval_sequences=24, warmup_steps=3),
        "digits": dict(_DIGITS, steps=24, eval_every=12, warmup_steps=3)}),
    "tiny": dict(seeds=2, cooldown=0.25, wall_time=False, measure_steps=4, timeout=300.0, tasks={
        "pysrc": dict(_TEXT, seq_len=16, batch_size=2, steps=4, eval_every=4, eval_sequences=8, warmup_steps=1),
        "digits": dict(_DIGITS, batch_size=8, steps=4, eval_every=4, warmup_steps=1)}),
    "cuda": dict(seeds=5, cooldown=0.2, wall_time=True, measure_steps=12, timeout=900.0, tasks={
        "pysrc": dict(_TEXT, seq_len=128, batch_size=32, steps=2000, eval_every=200, eval_sequences=512,
                      lr=1e-3, warmup_steps=100),
        "digits": dict(_DIGITS, steps=400, eval_every=50, warmup_steps=20)}),
}
TASKS = ("pysrc", "digits")
MAIN_K = 4
# "No worse" means within this margin of the baseline's loss (nats per character on pysrc, per
# sample on digits), declared before the runs: about DDP's seed-to-seed spread on each task.
EQUIVALENCE_MARGIN = {"pysrc": 0.02, "digits": 0.02}
MAX_EXTENSION = 10  # no mark beyond 10 x `steps` (flagged "capped")
# The SDP variants at C = 0.5. The text task leaves out the neuron level's backward regime (the
# variant that saves least: full parameters and activations, 0.86x DDP's memory in the earlier
# study) to fit five seeds in the time budget; digits, whose runs cost seconds, keeps all four.
SDP_VARIANTS = {"main": (("block", "forward"), ("block", "backward"), ("neuron", "forward")),
                "small": (("block", "forward"), ("block", "backward"), ("neuron", "forward"), ("neuron", "backward"))}


def _cfg(task: str, k: int, seed: int, name: str, method: str, **extra) -> dict:
    return {"task": task, "name": name, "K": k, "seed": seed, "method": method, "baseline": "ddp", **extra}


def _sdp(task, k, seed, level, regime, coverage, suffix="", **extra) -> dict:
    return _cfg(task, k, seed, f"sdp-{level}-{regime}{suffix}-c{coverage:g}", "sdp", level=level, regime=regime,
                coverage=coverage, **extra)


def _sdp_job(task, k, seed, level, regime, coverage, runs) -> dict:
    cfg = _sdp(task, k, seed, level, regime, coverage)
    readers, phases = [], []
    if coverage == 0.5 and runs == "main":
        readers.append(_sdp(task, k, seed, level, regime, coverage, "-ac", activation_checkpointing=True,
                            derived_from=cfg["name"]))
    if (level, regime) == ("block", "forward") and runs == "main":
        phases.append(_sdp(task, k, seed, level, "backward", coverage, phase_of=cfg["name"]))
        phases[-1]["name"] = f"{cfg['name']}+backward-phase"
    return {"config": cfg, "readers": readers, "phases": phases}


def jobs(task: str, seeds: list[int], k: int = MAIN_K, runs: str = "main") -> list[dict]:
    """The jobs of `task`, DDP first for every seed (the others read its tokens and FLOPs):
    [{"config": trained cfg, "readers": [derived cfg, ...], "phases": [cfg, ...]}].
    runs: "main" (the text task's whole list) or "small" (digits: baselines and C = 0.5)."""
    out = []
    for seed in seeds:
        ddp = _cfg(task, k, seed, "ddp", "ddp")
        out.append({"config": ddp, "readers": [
            _cfg(task, k, seed, "fsdp", "fsdp", derived_from="ddp"),
            _cfg(task, k, seed, "ddp-ac", "ddp", activation_checkpointing=True, derived_from="ddp")], "phases": []})
        plain = [_cfg(task, k, seed, "ddp-halfbatch", "ddp", batch_size_factor=0.5),
                 _cfg(task, k, seed, "ddp-sd-c0.5", "ddp", stochastic_depth=0.5)]
        if runs == "main":
            plain.append(_cfg(task, k, seed, "ddp-sdlin-c0.5", "ddp", stochastic_depth=0.5, sd_schedule="linear"))
        out += [{"config": c, "readers": [], "phases": []} for c in plain]
        for level, regime in SDP_VARIANTS[runs]:
            out.append(_sdp_job(task, k, seed, level, regime, 0.5, runs))
        if runs == "main":
            out.append({"config": _sdp(task, k, seed, "block", "forward", 0.5, "-contig", assignment="contiguous"),
                        "readers": [], "phases": []})
            out.append(_sdp_job(task, k, seed, "block", "forward", 0.25, runs))
    return out


def all_configs(task: str, seeds: list[int], runs: str = "main") -> list[dict]:
    """Every configuration of `task` (trained, derived and phases), in the order they run."""
    return [c for j in jobs(task, seeds, MAIN_K, runs) for c in [j["config"], *j["readers"], *j["phases"]]]


def result_path(out: str, task: str, k: int, seed: int, name: str) -> str:
    """Where the JSON of configuration `name` (task, world size k, seed) goes."""
    return os.path.join(out, "results", task, f"K{k}", f"seed{seed}", f"{name}.json")


def batch_size_of(cfg: dict, sizes: dict) -> int:
    """The configuration's batch per rank: the task's, times its batch_size_factor."""
    return max(1, round(sizes["batch_size"] * cfg.get("batch_size_factor", 1.0)))


def training_overrides(cfg: dict, sizes: dict, timeout: float, device_type: str) -> dict:
    """subnet_ext.cli.arguments.training_args(**overrides) of one configuration (sizes: its task's)."""
    overrides = dict(method=cfg["method"], model=sizes["model"], preset=sizes["preset"], data=sizes["data"],
                     steps=sizes["steps"], batch_size=batch_size_of(cfg, sizes), seq_len=sizes["seq_len"],
                     lr=sizes["lr"], weight_decay=sizes["weight_decay"], warmup_steps=sizes["warmup_steps"],
                     seed=cfg["seed"], timeout=timeout, device=device_type,
                     activation_checkpointing=cfg.get("activation_checkpointing", False),
                     stochastic_depth=cfg.get("stochastic_depth", 0.0) if cfg.get("sd_schedule") != "linear" else 0.0)
    if cfg["method"] == "sdp":
        overrides.update(level=cfg["level"], regime=cfg["regime"], coverage=cfg["coverage"])
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

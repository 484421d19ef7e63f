"""One rank of the end-to-end step benchmark: every configuration of one group (one model,
one world size), in interleaved rounds.

Each round runs every configuration once, in turn (the order rotated by one each round,
so none always runs first): a fresh model from seed 0, its wrapper (DDP, FSDP2 or SDP)
and AdamW, warm-up steps, then a timed window, then teardown (objects freed, the process
groups the configuration created destroyed, freed heap returned to the OS, the peak-memory
mark reset), so every configuration starts from the same process state. A machine that
slows down for a while then slows one round of every configuration, not every step of
one: the caller takes step-time ratios per round and their median.

All ranks run the same configurations in the same order (collectives keep them in step).
"""
from __future__ import annotations

import ctypes
import gc
import math
import statistics
import time
from dataclasses import dataclass

import torch

from subnet_ext.planning.buckets import DEFAULT_BUCKET_CAP_MB

PROFILE_TOP_OPS = 12


@dataclass(frozen=True)
class Config:
    """One benchmarked configuration: a model, a world size, a method and its options."""

    model: str
    world: int
    method: str
    level: str | None = None
    regime: str | None = None
    coverage: float | None = None
    overlap: bool = True
    simulate: bool = False  # every rank simulates itself: no communication at all
    shard_shared: bool = False  # SDP with the shared parameters sharded by FSDP2
    device: str = "cpu"  # "cpu" or "cuda"
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    steps: int = 3  # per round: at least this many timed steps ...
    min_seconds: float = 1.0  # ... and at least this long (up to max_steps)
    max_steps: int = 60
    warmup: int = 1
    batch_size: int = 8
    seq_len: int = 64

    @property
    def label(self) -> str:
        """The row name: "ddp", "fsdp" or e.g. "sdp-block-forward-c0.5-shard"."""
        if self.method != "sdp":
            return self.method
        extra = ("" if self.overlap else "-no-overlap") + ("-no-comm" if self.simulate else "") + \
            ("-shard" if self.shard_shared else "")
        return f"sdp-{self.level}-{self.regime}-c{self.coverage:g}{extra}"


def _status_bytes(field: str) -> int:
    from subnet_ext.measure.storage import proc_status_bytes

    return proc_status_bytes(field)


def _return_freed_memory() -> None:
    """Free unreachable objects, give freed heap back to the OS, and restart the resident-
    memory high-water mark (VmHWM) from the current size (Linux; a no-op elsewhere)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _process_groups() -> set:
    import torch.distributed as dist

    return set(getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", {}))


class _Run:
    """One configuration built on this rank: the wrapped model, its optimizer and batches."""

    def __init__(self, rank: int, world: int, cfg: Config, device: torch.device):
        from subnet_ext.jobs.methods import DDPMethod, FSDPMethod, SDPMethod
        from subnet_ext.jobs.tasks import sample_input_for
        from subnet_ext.data.tokens import SyntheticTokens
        from subnet_ext.models.llama import LLAMA_PRESETS
        from subnet_ext.models.registry import build_model
        from subnet_ext.planning.plan import plan_subnetworks

        torch.manual_seed(0)
        model = build_model("llama", preset=cfg.model).to(device)
        if cfg.method == "ddp":
            self.method = DDPMethod(model, device, cfg.bucket_cap_mb)
        elif cfg.method == "fsdp":
            self.method = FSDPMethod(model, device)
        self.flops_share = 1.0  # of the whole model's forward FLOPs, on the busiest rank
        if cfg.method == "sdp":  # planned as subnet-train plans (FLOPs traced from a sample)
            plan = plan_subnetworks(model, world_size=world, coverage=cfg.coverage, level=cfg.level,
                                    sample_input=sample_input_for("llama", model, cfg.seq_len))
            self.flops_share = float(plan.flops_per_rank.max() / (plan.shared_flops + plan.unit_flops.sum()))
            self.method = SDPMethod(model, plan, cfg.regime, 1, "none", bucket_cap_mb=cfg.bucket_cap_mb,
                                    overlap=cfg.overlap, simulate_rank=rank if cfg.simulate else None,
                                    shard_shared=cfg.shard_shared)
        self.device, self.sdp = device, cfg.method == "sdp"
        self.optimizer = torch.optim.AdamW(self.method.parameters(), lr=1e-3)
        source = SyntheticTokens(LLAMA_PRESETS[cfg.model].vocab_size, cfg.seq_len, seed=0)
        gen = torch.Generator().manual_seed(1000 + rank)
        # Made before timing, reused in turn.
        self.pool = [tuple(t.to(device) for t in source.batch(cfg.batch_size, gen)) for _ in range(8)]
        self.taken, self.memory, self.loss = 0, None, float("nan")

    def step(self) -> None:
        """One training step (forward, loss, backward, optimizer step), ended on the device."""
        x, y = self.pool[self.taken % len(self.pool)]
        self.taken += 1
        logits = self.method(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # step times end when the GPU's work does
        if self.memory is None:
            self.memory = self.method.memory(self.optimizer)  # gradients still allocated
        self.optimizer.zero_grad(set_to_none=True)
        self.method.after_step()
        self.loss = loss.detach()


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _profile_one_step(run: _Run) -> dict:
    """torch.profiler over one step: {"wall_ms", "matmul_ms" (self time of the matrix
    products), "comm_ms" (of the c10d:: collectives, waiting included), "optimizer_ms"
    (the optimizer step, inclusive), "ops": the top ops by self CPU time as
    [{"op", "self_ms", "share" (of the step's wall time), "calls"}]}."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run.step()
        wall = time.perf_counter() - start
    events = list(prof.key_averages())
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:PROFILE_TOP_OPS]
    return {"wall_ms": 1e3 * wall,
            "matmul_ms": sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS) / 1e3,
            "comm_ms": sum(e.self_cpu_time_total for e in events if e.key.startswith("c10d::")) / 1e3,
            "optimizer_ms": sum(e.cpu_time_total for e in events if e.key.startswith("Optimizer.step")) / 1e3,
            "ops": [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3, "share": e.self_cpu_time_total / 1e6 / wall,
                     "calls": e.count} for e in top]}


def _window(rank: int, world: int, cfg: Config, profile: bool) -> dict:
    """Builds `cfg`, warms up, times one window; this rank's figures for this round."""
    import torch.distributed as dist

    device = torch.device("cpu")
    if cfg.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = _status_bytes("VmRSS") if device.type == "cpu" else torch.cuda.memory_allocated(device)
    run = _Run(rank, world, cfg, device)
    dist.barrier()
    warm = torch.tensor([0.0])
    for _ in range(cfg.warmup):
        start = time.perf_counter()
        run.step()
        warm = torch.tensor([time.perf_counter() - start])
    # Enough timed steps for at least min_seconds (short steps are noisy on a shared
    # machine); every rank takes the same count from the slowest rank's warm-up step.
    dist.all_reduce(warm, op=dist.ReduceOp.MAX)
    timed = int(min(cfg.max_steps, max(cfg.steps, math.ceil(cfg.min_seconds / max(warm.item(), 1e-6)))))
    ends = [time.perf_counter()]
    for _ in range(timed):
        run.step()
        ends.append(time.perf_counter())
    comm = run.method.comm()
    fsdp = comm.get("fsdp") or {"bytes": 0, "collectives": 0}  # SDP's sharded part: predicted from sizes
    peak = (_status_bytes("VmHWM") if device.type == "cpu" else torch.cuda.max_memory_allocated(device)) - before
    out = {"step_s": statistics.median(b - a for a, b in zip(ends, ends[1:])), "timed_steps": timed,
           "model_state": run.memory["model_state"], "peak_growth": peak, "flops_share": run.flops_share,
           "comm_bytes": comm["bytes_per_step"] + fsdp["bytes"],
           "collectives": comm["collectives_per_step"] + fsdp["collectives"], "loss": float(run.loss),
           "predicted_model_state": run.method.sdp.predicted_model_state_bytes() if run.sdp else float("nan")}
    if profile:
        out["profile"] = _profile_one_step(run)
    return out


def _isolated(window):
    """Runs window() from a clean process state, then frees what it made, including the
    process groups it created (SDP's owner-set groups, made anew by the next build)."""
    import torch.distributed as dist

    groups = _process_groups()
    _return_freed_memory()
    try:
        return window()
    finally:
        gc.collect()
        for group in _process_groups() - groups:
            dist.destroy_process_group(group)


def run_group(rank: int, world: int, configs: list[Config], rounds: int, profile: bool) -> dict:
    """Every configuration of the group, `rounds` times, interleaved (runs inside
    subnet_ext.testing.run_distributed, one call per rank).

    Returns {label: {"rounds": [this rank's figures per round], "error": message or absent}};
    a configuration that raises (e.g. a plan the planner refuses) is recorded and left out
    of later rounds. With `profile`, the last round profiles one extra step per configuration.
    """
    results = {cfg.label: {"rounds": []} for cfg in configs}
    # One untimed window first: what the process pays once (library set-up, thread pools,
    # first-use caches) then counts in no configuration's memory or time.
    try:
        _isolated(lambda: _window(rank, world, configs[0], False))
    except Exception:  # noqa: BLE001 -- the same configuration fails again in round 1, where it is recorded
        pass
    for r in range(rounds):
        for cfg in configs[r % len(configs):] + configs[:r % len(configs)]:
            entry = results[cfg.label]
            if "error" in entry:
                continue
            try:
                entry["rounds"].append(_isolated(lambda: _window(rank, world, cfg, profile and r == rounds - 1)))
            except Exception as e:  # noqa: BLE001 -- recorded and shown in the table's row
                entry["error"] = f"{type(e).__name__}: {e}"[:300]
            if rank == 0:
                shown = entry.get("error") or f"{1e3 * entry['rounds'][-1]['step_s']:.1f} ms/step"
                print(f"[e2e] round {r + 1}/{rounds} {cfg.model} K={world} {cfg.label}: {shown}", flush=True)
    return results

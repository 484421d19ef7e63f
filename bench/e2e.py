"""End-to-end step benchmark (gloo): torch DDP, torch FSDP2 and SDP side by side.

    python bench/e2e.py                       # the full grid (make bench-e2e), ~20 min on 2 cores
    python bench/e2e.py --models tiny --worlds 2 --coverages 0.5 --steps 3   # a quick look
    python bench/e2e.py --device cuda --methods ddp,sdp --sdp-variants block-forward --skip-overlap

--device cuda puts every rank on GPU rank % GPU count (several ranks may share one GPU:
the process group stays gloo, which, unlike NCCL, allows that); peak memory is then the
CUDA allocator's peak instead of resident-memory growth.

Grid: llama presets × world sizes × {ddp, fsdp, sdp (block|neuron) × (forward|backward) ×
coverages}. Every configuration runs in fresh worker processes (one thread each, gloo on
127.0.0.1), so peak memory is that configuration's own. Per configuration: median step
time (steady state, slowest rank), model-state bytes (parameters + gradients + optimizer
state, worst rank), peak resident memory growth after the model was built (worst rank),
bytes handed to collectives and collectives per step, each also as a ratio to DDP's in
the same invocation. Then the overlap experiment (SDP with overlap on, off, and with no
communication at all: every rank simulating itself) and the issue's targets.

Everything printed is measured in this run; the Markdown goes to --out.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from subnet_ext.planning.buckets import DEFAULT_BUCKET_CAP_MB

METHOD_ORDER = ("ddp", "fsdp", "sdp")
SDP_VARIANTS = (("block", "forward"), ("block", "backward"), ("neuron", "forward"), ("neuron", "backward"))


@dataclass(frozen=True)
class Config:
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
    steps: int = 6  # at least this many timed steps ...
    min_seconds: float = 3.0  # ... and at least this long (up to max_steps)
    max_steps: int = 60
    warmup: int = 2
    batch_size: int = 8
    seq_len: int = 64

    @property
    def label(self) -> str:
        if self.method != "sdp":
            return self.method
        extra = ("" if self.overlap else "-no-overlap") + ("-no-comm" if self.simulate else "") + \
            ("-shard" if self.shard_shared else "")
        return f"sdp-{self.level}-{self.regime}-c{self.coverage:g}{extra}"


def measure(rank: int, world: int, cfg: Config) -> dict:
    """One rank of one configuration (runs inside subnet_ext.testing.run_distributed)."""
    import torch.distributed as dist

    from subnet_ext.data.tokens import SyntheticTokens
    from subnet_ext.models.llama import LLAMA_PRESETS
    from subnet_ext.models.registry import build_model
    from subnet_ext.planning.plan import plan_subnetworks
    from subnet_ext.cli.methods import DDPMethod, FSDPMethod, SDPMethod, proc_status_bytes

    device = torch.device("cpu")
    if cfg.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = proc_status_bytes("VmRSS") if device.type == "cpu" else torch.cuda.memory_allocated(device)
    torch.manual_seed(0)
    model = build_model("llama", preset=cfg.model).to(device)
    if cfg.method == "ddp":
        method = DDPMethod(model, device, cfg.bucket_cap_mb)
    elif cfg.method == "fsdp":
        method = FSDPMethod(model, device)
    else:
        plan = plan_subnetworks(model, world_size=world, coverage=cfg.coverage, level=cfg.level)
        method = SDPMethod(model, plan, cfg.regime, 1, "none", bucket_cap_mb=cfg.bucket_cap_mb,
                           overlap=cfg.overlap, simulate_rank=rank if cfg.simulate else None,
                           shard_shared=cfg.shard_shared)
    optimizer = torch.optim.AdamW(method.parameters(), lr=1e-3)
    source = SyntheticTokens(LLAMA_PRESETS[cfg.model].vocab_size, cfg.seq_len, seed=0)
    gen = torch.Generator().manual_seed(1000 + rank)
    # Made before timing, reused in turn.
    pool = [tuple(t.to(device) for t in source.batch(cfg.batch_size, gen)) for _ in range(8)]
    memory, taken = None, 0

    def train_step():
        nonlocal memory, taken
        x, y = pool[taken % len(pool)]
        taken += 1
        logits = method(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # step times end when the GPU's work does
        if memory is None:
            memory = method.memory(optimizer)  # gradients still allocated
        optimizer.zero_grad(set_to_none=True)
        method.after_step()
        return loss

    dist.barrier()
    for _ in range(cfg.warmup):
        start = time.perf_counter()
        train_step()
        warm = torch.tensor([time.perf_counter() - start])
    # Enough timed steps for at least min_seconds (short steps are noisy on a shared
    # machine); every rank takes the same count from the slowest rank's warm-up step.
    dist.all_reduce(warm, op=dist.ReduceOp.MAX)
    timed = int(min(cfg.max_steps, max(cfg.steps, math.ceil(cfg.min_seconds / warm.item()))))
    ends = [time.perf_counter()]
    for _ in range(timed):
        loss = train_step()
        ends.append(time.perf_counter())
    comm = method.comm()
    fsdp = comm.get("fsdp") or {"bytes": 0, "collectives": 0}  # SDP's sharded part: predicted from sizes
    predicted = method.sdp.predicted_model_state_bytes() if cfg.method == "sdp" else float("nan")
    peak = (proc_status_bytes("VmHWM") if device.type == "cpu" else torch.cuda.max_memory_allocated(device)) - rss_before
    steady = [b - a for a, b in zip(ends, ends[1:])]
    return {"step_s": statistics.median(steady), "timed_steps": timed, "model_state": memory["model_state"],
            "peak_growth": peak, "comm_bytes": comm["bytes_per_step"] + fsdp["bytes"],
            "collectives": comm["collectives_per_step"] + fsdp["collectives"], "loss": loss.item(),
            "predicted_model_state": predicted}


def run_config(cfg: Config) -> dict:
    """Worst-rank figures of one configuration, or {"error": message} if it cannot run."""
    from subnet_ext.testing import run_distributed

    try:
        ranks = run_distributed(measure, cfg.world, cfg, timeout=1800)
    except RuntimeError as e:
        lines = [ln for ln in str(e).splitlines() if "Error" in ln]
        return {"error": (lines[0] if lines else str(e))[:200]}
    # Steps are synchronous, so the slowest rank is the step time; memory: the worst rank.
    return {k: max(r[k] for r in ranks) for k in ("step_s", "model_state", "peak_growth", "comm_bytes",
                                                    "collectives", "predicted_model_state")}


def _mib(b):
    return f"{b / 2**20:.2f}"


def _ratio(a, b):
    return f"{a / b:.3f}" if b else "n/a"


def grid(opts) -> list[Config]:
    configs = []
    for model in opts.models:
        for world in opts.worlds:
            base = dict(model=model, world=world, steps=opts.steps, min_seconds=opts.min_seconds,
                        warmup=opts.warmup, batch_size=opts.batch_size, seq_len=opts.seq_len,
                        bucket_cap_mb=opts.bucket_cap_mb, device=opts.device)
            configs += [Config(method=m, **base) for m in ("ddp", "fsdp") if m in opts.methods]
            for level, regime in (opts.sdp_variants if "sdp" in opts.methods else ()):
                for c in (c for k, c in opts.coverages if k in (None, world)):
                    for shard in {"off": (False,), "also": (False, True), "only": (True,)}[opts.shard_shared]:
                        configs.append(Config(method="sdp", level=level, regime=regime, coverage=c,
                                              shard_shared=shard, **base))
    return configs


def main_table(results: list[tuple[Config, dict]]) -> list[str]:
    lines = ["| model | K | run | owners/unit | step ms | ×ddp | model state MiB/rank | ×ddp | peak RSS growth MiB "
             "| ×ddp | comm MiB/step | ×ddp | collectives/step |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    from subnet_ext.planning.plan import owners_per_unit

    ddp = {(c.model, c.world): r for c, r in results if c.method == "ddp" and "error" not in r}
    for c, r in results:
        owners = owners_per_unit(c.world, c.coverage) if c.method == "sdp" else "-"
        if "error" in r:
            lines.append(f"| {c.model} | {c.world} | {c.label} | {owners} | refused or failed: {r['error']} "
                         "| | | | | | | | |")
            continue
        d = ddp.get((c.model, c.world), {})
        lines.append(
            f"| {c.model} | {c.world} | {c.label} | {owners} | {1e3 * r['step_s']:.1f} | {_ratio(r['step_s'], d.get('step_s'))} "
            f"| {_mib(r['model_state'])} | {_ratio(r['model_state'], d.get('model_state'))} "
            f"| {_mib(r['peak_growth'])} | {_ratio(r['peak_growth'], d.get('peak_growth'))} "
            f"| {_mib(r['comm_bytes'])} | {_ratio(r['comm_bytes'], d.get('comm_bytes'))} | {r['collectives']:.1f} |")
    return lines


def growth_tables(results: list[tuple[Config, dict]], models, worlds) -> list[str]:
    """How step time and model-state memory grow with model size and world size, per run."""
    cols = [(m, k) for m in models for k in worlds]
    out = []
    for key, name, fmt in (("step_s", "step ms", lambda v: f"{1e3 * v:.1f}"),
                           ("model_state", "model state MiB/rank", _mib)):
        out += ["", f"{name} by model (columns: preset/K):", "",
                "| run | " + " | ".join(f"{m}/{k}" for m, k in cols) + " |",
                "|---|" + "---:|" * len(cols)]
        labels = list(dict.fromkeys(c.label for c, _ in results))
        for label in labels:
            cells = []
            for m, k in cols:
                r = next((r for c, r in results if c.label == label and c.model == m and c.world == k), None)
                cells.append("-" if r is None or "error" in r else fmt(r[key]))
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def overlap_experiment(opts) -> tuple[list[str], dict]:
    """SDP with overlap on / off / no communication at all, on a setting with heavy traffic."""
    base = dict(model=opts.overlap_model, world=2, method="sdp", level="block", regime="forward", coverage=1.0,
                steps=opts.steps, min_seconds=opts.min_seconds, warmup=opts.warmup,
                batch_size=opts.overlap_batch_size, seq_len=opts.seq_len,
                bucket_cap_mb=opts.overlap_bucket_cap_mb, device=opts.device)
    runs = {"overlap": Config(**base), "no overlap": Config(**base, overlap=False),
            "no communication": Config(**base, simulate=True)}
    res = {name: run_config(cfg) for name, cfg in runs.items()}
    lines = [f"Overlap: llama {opts.overlap_model}, K = 2, SDP block forward at coverage 1.0 (every parameter "
             f"averaged over both ranks), batch {opts.overlap_batch_size} × {opts.seq_len} per rank (small, so that "
             f"communication is a large share of the step), buckets of {opts.overlap_bucket_cap_mb:g} MiB; "
             "\"no communication\": each rank simulates itself (collectives are no-ops, packing still runs), same "
             "processes and threads.", "",
             "| variant | step ms | comm MiB/step | collectives/step |", "|---|---:|---:|---:|"]
    for name, r in res.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | |")
        else:
            lines.append(f"| {name} | {1e3 * r['step_s']:.1f} | {_mib(r['comm_bytes'])} | {r['collectives']:.1f} |")
    return lines, res


def targets(results, overlap_res, small_model: str) -> list[str]:
    out = ["", "Targets (issue 5, CPU):"]
    find = lambda **kw: next((r for c, r in results if all(getattr(c, k) == v for k, v in kw.items())  # noqa: E731
                              and "error" not in r), None)
    ddp = find(model=small_model, world=2, method="ddp")
    sdp = find(model=small_model, world=2, method="sdp", level="block", regime="forward", coverage=0.5)
    if ddp and sdp:
        t, m = sdp["step_s"] / ddp["step_s"], sdp["model_state"] / ddp["model_state"]
        out.append(f"- llama {small_model}, 2 ranks, SDP block forward c0.5: step time {t:.3f}× DDP (target ≤ 0.7): "
                   f"{'PASS' if t <= 0.7 else 'FAIL'}; model state {m:.3f}× DDP (target ≤ 0.6): "
                   f"{'PASS' if m <= 0.6 else 'FAIL'}")
    on, off, none = (overlap_res.get(k, {}) for k in ("overlap", "no overlap", "no communication"))
    if all(r and "error" not in r for r in (on, off, none)):
        comm = off["step_s"] - none["step_s"]
        hidden = (off["step_s"] - on["step_s"]) / comm if comm > 0 else float("nan")
        share = comm / off["step_s"]
        out.append(f"- overlap: communication is {100 * share:.0f}% of the non-overlapped step (setting needs ≥ 20%: "
                   f"{'yes' if share >= 0.2 else 'no'}); overlap hides {100 * hidden:.0f}% of it (target ≥ 50%): "
                   f"{'PASS' if hidden >= 0.5 and share >= 0.2 else 'FAIL'}")
    for model in dict.fromkeys(c.model for c, _ in results):
        for world in dict.fromkeys(c.world for c, _ in results):
            d = find(model=model, world=world, method="ddp")
            s = find(model=model, world=world, method="sdp", level="block", regime="forward", coverage=1.0)
            if d and s:
                t = s["step_s"] / d["step_s"]
                out.append(f"- llama {model}, K={world}: SDP at coverage 1.0 step time {t:.3f}× DDP (target ≤ 1.10): "
                           f"{'PASS' if t <= 1.10 else 'FAIL'}")
    return out


def shard_targets(results, small_model: str) -> list[str]:
    """Issue 16's targets for SDP with sharded shared parameters (rows only when they ran)."""
    find = lambda **kw: next((r for c, r in results if all(getattr(c, k) == v for k, v in kw.items())  # noqa: E731
                              and "error" not in r), None)
    sdp = dict(model=small_model, method="sdp", level="block", regime="forward", shard_shared=True)
    out = []
    ddp2, shard2 = find(model=small_model, world=2, method="ddp"), find(world=2, coverage=0.5, **sdp)
    if ddp2 and shard2:
        m, t = shard2["model_state"] / ddp2["model_state"], shard2["step_s"] / ddp2["step_s"]
        out.append(f"- llama {small_model}, 2 ranks, sdp block forward c0.5 shard: model state {m:.3f}× DDP (target "
                   f"≤ 0.52): {'PASS' if m <= 0.52 else 'FAIL'}; step time {t:.3f}× DDP (target ≤ 0.75): "
                   f"{'PASS' if t <= 0.75 else 'FAIL'}")
    ddp4, fsdp4 = find(model=small_model, world=4, method="ddp"), find(model=small_model, world=4, method="fsdp")
    shard4 = find(world=4, coverage=0.25, **sdp)
    if ddp4 and fsdp4 and shard4:
        m, t = shard4["model_state"] / ddp4["model_state"], shard4["step_s"] / fsdp4["step_s"]
        f4 = fsdp4["model_state"] / ddp4["model_state"]
        out.append(f"- llama {small_model}, 4 ranks, sdp block forward c0.25 shard: model state {m:.3f}× DDP (target "
                   f"≤ 0.28; FSDP2 {f4:.3f}): {'PASS' if m <= 0.28 else 'FAIL'}; "
                   f"step time {t:.3f}× FSDP2 (target ≤ 0.6): {'PASS' if t <= 0.6 else 'FAIL'}")
    for c, r in results:
        if c.shard_shared and "error" not in r:
            e = r["predicted_model_state"] / r["model_state"] - 1
            out.append(f"- {c.model} K={c.world} {c.label}: subnet-plan's model state "
                       f"{_mib(r['predicted_model_state'])} MiB vs measured {_mib(r['model_state'])} MiB "
                       f"({100 * e:+.1f}%, target within 5%): "
                       f"{'PASS' if abs(e) <= 0.05 else 'FAIL'}")
    return ["", "Targets (issue 16, sharded shared parameters, CPU):", *out] if out else []


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,small,medium", help="llama presets, comma-separated")
    p.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    p.add_argument("--coverages", default="0.25,0.5,1.0",
                   help="SDP coverages, comma-separated; K:C runs coverage C at world size K only (e.g. 2:0.5,4:0.25)")
    p.add_argument("--steps", type=int, default=6, help="at least this many timed steps per configuration")
    p.add_argument("--min-seconds", type=float, default=3.0,
                   help="and at least this many seconds of timed steps (at most 60 steps)")
    p.add_argument("--warmup", type=int, default=2)
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
    opts = p.parse_args(argv)
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


def main(argv=None) -> int:
    opts = parse(argv)
    started = time.time()
    results = []
    for cfg in grid(opts):
        r = run_config(cfg)
        results.append((cfg, r))
        shown = r.get("error") or f"{1e3 * r['step_s']:.1f} ms/step, model state {_mib(r['model_state'])} MiB"
        print(f"[e2e] {cfg.model} K={cfg.world} {cfg.label}: {shown}", flush=True)
    overlap_lines, overlap_res = ([], {}) if opts.skip_overlap else overlap_experiment(opts)
    command = "python bench/e2e.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        f"# End-to-end step benchmark ({opts.device.upper()}, gloo)", "",
        f"Command: `{command.strip()}` (`make bench-e2e`), {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}, "
        f"wall time {time.time() - started:.0f} s.",
        f"Machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, torch {torch.__version__}; "
        f"each rank one process with one thread, gloo on 127.0.0.1. Per rank: batch {opts.batch_size} × "
        f"{opts.seq_len} tokens of synthetic Markov text, AdamW; {opts.warmup} warm-up steps, then at least "
        f"{opts.steps} timed steps and {opts.min_seconds:g} s (at most 60 steps); median step time of the slowest "
        f"rank; DDP and SDP buckets {opts.bucket_cap_mb:g} MiB.",
        "Model state: parameters + gradients + optimizer state held by the worst rank (tensor accounting). "
        "Peak RSS growth: the worst rank's resident-memory high-water mark minus its resident memory before the "
        "model was built. Comm: bytes handed to collectives per step (DDP: counted in a comm hook; SDP: counted "
        "by its communicator; FSDP2: predicted from its fixed schedule; sdp-*-shard rows: SDP's counted bytes plus "
        "FSDP2's all-gather + reduce-scatter of the shared parameters, predicted from their sizes).",
        *([f"Device: {torch.cuda.get_device_name(0)}, ranks on GPU rank % {torch.cuda.device_count()}; the peak "
           "RSS growth column is the CUDA allocator's peak minus what was allocated before the model was built."]
          if opts.device == "cuda" else []), "",
        *main_table(results), *growth_tables(results, opts.models, opts.worlds), "", *overlap_lines,
        *targets(results, overlap_res, "small" if "small" in opts.models else opts.models[0]),
        *shard_targets(results, "small" if "small" in opts.models else opts.models[0]),
    ]
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(opts.out) or ".", exist_ok=True)
    with open(opts.out, "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

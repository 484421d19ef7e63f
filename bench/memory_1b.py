"""The paper's memory claim at its scale: one rank of K = 8 training a ~1B-parameter LLaMA.

    python bench/memory_1b.py --out bench/results/h200/memory-1b.md          # on a GPU (gpu_check.sh all)
    python bench/memory_1b.py --device cpu --size tiny --out /tmp/m.md        # the same code on CPU (CI)
    python bench/memory_1b.py --device cpu --size 1b --predict-only           # the memory model's column alone

One process plays rank `--rank` of a K-rank job (K = `--world-size`, 8) for each
configuration in turn: torch DDP, DDP with activation checkpointing, torch FSDP2, SDP (the
simulated rank, `SubnetDataParallel(simulate_rank=r)`: its own subnetwork, buckets and
optimizer, collectives replaced by no-ops that count bytes) at block and neuron level, in
both regimes, at C = 0.5 and 0.25, and SDP with activation checkpointing. DDP and FSDP2 run
over torch's fake process group of K ranks (`init_process_group("fake")`): their buckets,
shards and gathered buffers are real, their collectives are not run (DDP's through a comm
hook that returns its bucket untouched). So every row is one rank's compute and memory
without communication.

The model is the `--size` LLaMA preset ("1b": TinyLlama-1.1B's shape; "tiny": the tiny
preset with 8 layers and 4 key/value heads, so that K = 8 plans have blocks and head groups
to share) in fp32, the
step's forward and loss under `torch.autocast` in bf16 (`--dtype`), AdamW (`--optimizer-
kernel`: torch's foreach path, its CUDA default, unless told), one rank's batch of
`--batch-size` x `--seq-len` synthetic tokens. Per configuration: `--warmup` steps (the first
creates the optimizer state), then `--steps` timed steps (median), then one step under
StepMemoryMeter (model state / activations / transient at its peak). Peak memory: on a GPU
`torch.cuda.max_memory_allocated` over the timed steps (the allocator's peak: model state,
activations, workspaces, rounding); on the CPU the meter's peak of live tensor storage.
Beside it the memory model's prediction for the same configuration (planning/costs/memory_model.py
for SDP, planning/costs/replicated_memory.py for DDP and FSDP2; activations traced under the same
autocast), and whether it lies within 10% of the measured peak.

docs/results.md shows the committed GPU table (bench/results/h200/memory-1b.md) beside the
paper's figures, or says it has not run: `python bench/memory_1b.py --write-docs` rewrites that
block from the file (tests/bench/test_memory_1b.py fails while it is stale).

The Markdown table (command, commit, device) is rewritten after every configuration, with a
JSON file of every number beside it (same name, .json), so a run stopped at its time limit
(`--time-limit`) keeps what it measured. Exit 0: every configuration ran and every
prediction is within 10%; 3: it ran, but some prediction is off by more or the time limit
left rows out (a result, not a failure); 1: an error.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from subnet_ext.vocabulary import LEVELS

import provenance

WITHIN = 0.10  # the memory model's tested accuracy (planning/costs/budget.py MARGIN)
PAPER = ("the paper's 1B LLaMA: -28% peak memory per device at coverage 0.5 (v5 abstract: 28-60% "
         "under FLOP-matched settings)")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results", "h200", "memory-1b.md")  # the GPU run's table, once committed
DOC = os.path.join(REPO, "docs", "results.md")
BEGIN, END = "<!-- memory-1b:begin", "<!-- memory-1b:end -->"


@dataclasses.dataclass(frozen=True)
class Row:
    """One configuration: method ("ddp", "fsdp", "sdp"), SDP's level, regime and coverage,
    activation checkpointing."""

    method: str
    level: str = "block"
    regime: str = "forward"
    coverage: float = 1.0
    checkpointing: bool = False

    @property
    def name(self) -> str:
        """A label such as "sdp block/forward C=0.5 +checkpointing"."""
        base = self.method if self.method != "sdp" else f"sdp {self.level}/{self.regime} C={self.coverage:g}"
        return base + (" +checkpointing" if self.checkpointing else "")


# Most telling first, so that a run stopped by its time limit leaves out the least: DDP and
# SDP's recommended configurations, FSDP2, checkpointing, C = 0.25, then the backward regime.
ROWS = ([Row("ddp"), Row("sdp", "block", "forward", 0.5), Row("sdp", "neuron", "forward", 0.5), Row("fsdp"),
         Row("ddp", checkpointing=True), Row("sdp", "block", "forward", 0.5, True),
         Row("sdp", "neuron", "forward", 0.5, True), Row("sdp", "block", "forward", 0.25),
         Row("sdp", "neuron", "forward", 0.25)]
        + [Row("sdp", level, "backward", c) for c in (0.5, 0.25) for level in LEVELS])


def model_config(size: str):
    """The LlamaConfig of --size ("1b", or "tiny" with 8 layers and 4 key/value heads)."""
    from subnet_ext.models.llama import LLAMA_PRESETS

    if size == "tiny":  # 4 kv heads as the 1b's: K = 8 at C = 0.25 gives every rank one head group
        return dataclasses.replace(LLAMA_PRESETS["tiny"], num_hidden_layers=8, num_key_value_heads=4)
    return LLAMA_PRESETS[size]


def init_fake_group(world_size: int, rank: int) -> None:
    """torch's fake process group of `world_size` ranks: collectives return at once, untouched."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def _untouched_bucket(state, bucket):
    """A DDP comm hook that skips the all-reduce: the bucket comes back as it went in."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class Setup:
    """Plans and activation traces of the configurations, made once on a meta copy of the model."""

    def __init__(self, opts, device: torch.device):
        from subnet_ext.models.llama import LlamaForCausalLM

        self.opts, self.device, self.cfg = opts, device, model_config(opts.size)
        with torch.device("meta"):
            self.meta = LlamaForCausalLM(self.cfg)
        self.sample = ((opts.batch_size, opts.seq_len), torch.long)
        self.compute = {"bf16": torch.bfloat16, "fp32": None}[opts.dtype]
        self._plans = {}

    def plan(self, level: str, coverage: float):
        """(plan, activation trace) at K = --world-size, made once per (level, coverage)."""
        import subnet_ext as sx
        from subnet_ext.planning.costs.activation_trace import trace_activations

        key = (level, coverage)
        if key not in self._plans:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # one owner per unit at C = 1/K: said in the table
                plan = sx.plan_subnetworks(self.meta, self.opts.world_size, coverage, level, seed=self.opts.seed)
            self._plans[key] = (plan, trace_activations(self.meta, plan, self.sample, self.device, self.compute))
        return self._plans[key]

    def predict(self, row: Row) -> dict:
        """The memory model's predicted peak of `row` (predict_step_memory's dict)."""
        from subnet_ext.planning.costs.memory_model import predict_step_memory
        from subnet_ext.planning.costs.replicated_memory import predict_ddp_step_memory, predict_fsdp_step_memory

        kernel = self.opts.optimizer_kernel
        if row.method == "sdp":
            plan, trace = self.plan(row.level, row.coverage)
            return predict_step_memory(plan, self.opts.rank, trace, row.regime, "adamw",
                                       activation_checkpointing=row.checkpointing, optimizer_kernel=kernel)
        plan, trace = self.plan("block", 1.0)
        if row.method == "ddp":
            return predict_ddp_step_memory(plan, trace, "adamw", row.checkpointing, kernel)
        return predict_fsdp_step_memory(plan, trace, self.opts.world_size, "adamw", row.checkpointing, kernel)


def build(setup: Setup, row: Row):
    """(the module a step calls, the modules holding model state, the optimizer) of `row`."""
    from subnet_ext.jobs.training import apply_activation_checkpointing
    from subnet_ext.models.llama import LlamaForCausalLM

    torch.manual_seed(setup.opts.seed)
    with torch.device(setup.device):
        model = LlamaForCausalLM(setup.cfg)
    if row.checkpointing:
        apply_activation_checkpointing(model)
    if row.method == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[setup.device.index] if setup.device.type == "cuda"
                                          else None)
        wrapped.register_comm_hook(None, _untouched_bucket)
    elif row.method == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
    else:
        import subnet_ext as sx

        plan, _ = setup.plan(row.level, row.coverage)
        wrapped = sx.SubnetDataParallel(model, plan, regime=row.regime, simulate_rank=setup.opts.rank)
    kernel = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, **kernel[setup.opts.optimizer_kernel])
    return wrapped, optimizer


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(setup: Setup, row: Row) -> dict:
    """Warm-up, timed and metered steps of `row`: {"step_s", "peak", "meter", "model_state"}."""
    from subnet_ext.data.tokens import SyntheticTokens
    from subnet_ext.measure.step_memory import StepMemoryMeter

    opts, device = setup.opts, setup.device
    # What the rows before left allocated (0 unless one leaked): it would count in this row's peak.
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    wrapped, optimizer = build(setup, row)
    source = SyntheticTokens(setup.cfg.vocab_size, opts.seq_len, seed=opts.seed)
    gen = torch.Generator().manual_seed(opts.rank)
    x, y = (t.to(device) for t in source.batch(opts.batch_size, gen))

    def step():
        with torch.autocast(device.type, dtype=setup.compute or torch.float32, enabled=setup.compute is not None):
            logits = wrapped(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(opts.warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(opts.steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    meter = StepMemoryMeter([wrapped], [optimizer], device)
    with meter:
        step()
    result = meter.result()
    del wrapped, optimizer, x, y
    return {"step_s": statistics.median(times), "peak": peak if peak is not None else result["total"],
            "meter": result, "allocated_before": before}


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def table(setup: Setup, results: dict, argv: list[str], started: float, skipped: list[str]) -> str:
    """The Markdown report of `results` ({row name: {"row", "predicted", "measured" | "error"}})."""
    opts, device = setup.opts, setup.device
    ddp = results.get(Row("ddp").name, {}).get("measured")
    largest = max((r["measured"]["peak"] for r in results.values() if "measured" in r), default=0)
    unit, scale = ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)
    gib = lambda b: f"{b / scale:.3f}"  # noqa: E731
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else provenance.machine()
    peak_name = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "StepMemoryMeter peak (live tensors)"
    params = sum(p.numel() for p in setup.meta.parameters())
    lines = [f"# Peak memory and step time of one rank of K = {opts.world_size}: llama {opts.size}", "",
             f"Command: `python bench/memory_1b.py {' '.join(argv)}`; commit {provenance.commit()}; "
             f"{device.type} ({where}); torch {torch.__version__}; {time.time() - started:.0f} s.", "",
             f"llama {opts.size}: {params / 1e6:,.1f} M parameters (fp32), forward and loss under autocast "
             f"{opts.dtype}, AdamW ({opts.optimizer_kernel}), batch {opts.batch_size} x {opts.seq_len} tokens per "
             f"rank, rank {opts.rank} of {opts.world_size}; {opts.warmup} warm-up + {opts.steps} timed steps "
             f"(median). Peak: {peak_name}. Predicted: the memory model (planning/costs/memory_model.py, "
             "planning/costs/replicated_memory.py). DDP and FSDP2 over torch's fake process group, SDP as a simulated "
             "rank: no collective runs, so step times are one rank's compute.", "",
             f"| configuration | peak {unit} | predicted {unit} | predicted / measured | predicted peak at | "
             f"peak vs DDP | step ms | step vs DDP | meter: state / activations / transient {unit} |",
             "|---|---:|---:|---:|---|---:|---:|---:|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:120]} | | | | | | | |")
            continue
        m, p, split = r["measured"], r["predicted"]["total"], r["measured"]["meter"]
        vs = (lambda a, b: f"{a / b:.3f}" if b else "-")  # noqa: E731
        lines.append(f"| {name} | {gib(m['peak'])} | {gib(p)} | {p / m['peak']:.3f} | "
                     f"{r['predicted']['peak_at']} | {vs(m['peak'], ddp['peak'] if ddp else 0)} | "
                     f"{1e3 * m['step_s']:.1f} | {vs(m['step_s'], ddp['step_s'] if ddp else 0)} | "
                     f"{gib(split['model_state'])} / {gib(split['activations'])} / {gib(split['transient'])} |")
    lines += [""] + [f"- not run: {name} (time limit)" for name in skipped]
    lines += [f"- {verdict}" for verdict in verdicts(results)] + [f"- for comparison, {PAPER}."]
    return "\n".join(lines) + "\n"


def verdicts(results: dict) -> list[str]:
    """One line per check: every prediction within 10%; SDP C = 0.5's peak against DDP's."""
    ran = {n: r for n, r in results.items() if "measured" in r}
    off = [n for n, r in ran.items() if abs(r["predicted"]["total"] / r["measured"]["peak"] - 1) > WITHIN]
    out = [f"memory model within {WITHIN:.0%} of the measured peak: {len(ran) - len(off)} of {len(ran)} rows"
           + (f" ({'PASS' if not off else 'FAIL'}{': ' + ', '.join(off) if off else ''})" if ran else "")]
    ddp = ran.get(Row("ddp").name)
    for level in LEVELS:
        sdp = ran.get(Row("sdp", level, "forward", 0.5).name)
        if ddp and sdp:
            out.append(f"sdp {level}/forward C=0.5 peak {sdp['measured']['peak'] / ddp['measured']['peak'] - 1:+.1%} "
                       "against DDP's")
    return out


def write(path: str | None, text: str, results: dict) -> None:
    """The table to `path` and every number to `path` with .json (nothing without a path)."""
    if not path:
        return
    with open(path, "w") as f:
        f.write(text)
    stem = path[:-3] if path.endswith(".md") else path
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1, default=str)


def docs_block(results: str = RESULTS) -> str:
    """docs/results.md's block between its memory-1b markers: the results file's report (its
    title dropped) beside the paper's figures, or a note that it has not run."""
    lines = [f"{BEGIN}: generated by bench/memory_1b.py --write-docs from "
             f"{os.path.relpath(results, REPO)}; do not edit by hand -->", ""]
    if os.path.exists(results):
        with open(results) as f:
            body = f.read().strip().splitlines()
        lines += body[1:] if body and body[0].startswith("# ") else body
    else:
        lines += [f"Not run yet: it needs a GPU. `bash bench/gpu_check.sh all` runs it (its memory-1b step) and "
                  f"its table goes to `{os.path.relpath(results, REPO)}`. The same script runs in CI at its CPU "
                  "size (`--device cpu --size tiny`, tests/bench/test_memory_1b.py)."]
    return "\n".join(lines + ["", f"For comparison, {PAPER}.", "", END])


def write_docs(doc: str = DOC, results: str = RESULTS) -> None:
    """Replace the marked block of `doc` by docs_block(results)."""
    with open(doc) as f:
        text = f.read()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    with open(doc, "w") as f:
        f.write(text[:start] + docs_block(results) + text[end:])


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--size", default="1b", choices=("1b", "tiny"), help="the LLaMA preset (default: 1b)")
    p.add_argument("--world-size", type=int, default=8, help="K (default: 8)")
    p.add_argument("--rank", type=int, default=0, help="the rank measured (default: 0)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per rank (default: 2; tiny: 2)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: 2048; tiny: 64)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="autocast dtype (default: bf16)")
    p.add_argument("--optimizer-kernel", default="foreach", choices=("foreach", "for-loop", "fused"),
                   help="AdamW's implementation (default: foreach, torch's CUDA default)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: 2)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (default: 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", default=None, help="comma-separated substrings: only the rows whose name has one")
    p.add_argument("--time-limit", type=float, default=None, help="seconds: start no row after this")
    p.add_argument("--predict-only", action="store_true", help="print the predictions, run nothing")
    p.add_argument("--out", default=None, help="the Markdown file (and .json beside it)")
    p.add_argument("--write-docs", action="store_true", help="rewrite docs/results.md's block from the GPU "
                   "results file and exit")
    opts = p.parse_args(argv)
    opts.batch_size = opts.batch_size or 2
    opts.seq_len = opts.seq_len or (64 if opts.size == "tiny" else 2048)
    if not 0 <= opts.rank < opts.world_size:
        p.error(f"--rank must lie in [0, {opts.world_size}), got {opts.rank}")
    return opts


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    opts = parse(argv)
    if opts.write_docs:
        write_docs()
        return 0
    use_cuda = torch.cuda.is_available() if opts.device == "auto" else opts.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    started = time.time()
    setup = Setup(opts, device)
    rows = [r for r in ROWS if opts.rows is None or any(s in r.name for s in opts.rows.split(","))]
    if opts.predict_only:
        for row in rows:
            p = setup.predict(row)
            print(f"{row.name}: predicted {p['total'] / 2**30:.3f} GiB at the {p['peak_at']}")
        return 0
    init_fake_group(opts.world_size, opts.rank)
    results, skipped = {}, []
    for row in rows:
        if opts.time_limit is not None and time.time() - started > opts.time_limit:
            skipped.append(row.name)
            continue
        try:
            results[row.name] = {"row": dataclasses.asdict(row), "predicted": setup.predict(row),
                                 "measured": measure(setup, row)}
        except Exception as e:  # noqa: BLE001 - one configuration's failure is reported in its row
            results[row.name] = {"row": dataclasses.asdict(row), "error": f"{type(e).__name__}: {e}"}
        _free(device)
        outcome = results[row.name].get("measured", results[row.name])
        print(f"[memory_1b] {row.name}: {json.dumps(outcome, default=str)[:300]}", flush=True)
        write(opts.out, table(setup, results, argv, started, skipped), results)
    text = table(setup, results, argv, started, skipped)
    print(text)
    write(opts.out, text, results)
    errors = [n for n, r in results.items() if "error" in r]
    print(f"[summary] {len(results) - len(errors)} of {len(rows)} rows ran; " + "; ".join(verdicts(results)))
    if errors:
        return 1
    return 3 if skipped or "FAIL" in verdicts(results)[0] else 0


if __name__ == "__main__":
    sys.exit(main())

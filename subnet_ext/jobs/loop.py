"""One rank's training run: set up the method, step, evaluate, checkpoint, report.

Every rank executes the same sequence of collectives; only rank 0 prints and writes
the report. Batches depend only on (seed, step, rank), so a resumed run sees the
batches the interrupted one would have seen.

Reliability (docs/reliability.md): a step whose gradients are not finite on some rank
is skipped on every rank (`NonFiniteGuard`, decided on the device; the skipped steps are
read with the losses, every --log-every steps, where `--max-skipped` stops the run);
`--verify-every N` proves the owners agree; checkpoints are verified and atomic
(`run_checkpoints`); every collective has a deadline (`--timeout`).
"""
from __future__ import annotations

import time
from argparse import Namespace

import torch
import torch.distributed as dist

from ..planning.buckets import DEFAULT_BUCKET_CAP_MB
from ..engine.guards.nonfinite_guard import NonFiniteGuard
from .launch import init_distributed, pick_backend
from . import run_checkpoints
from .faults import Faults
from ..measure.storage import ActivationMeter, peak_rss_bytes
from .methods import DDPMethod, FSDPMethod, SDPMethod
from .stochastic_depth import StochasticDepth
from .tasks import build_task
from .training import OptimizerStep, apply_activation_checkpointing, make_optimizer, training_settings


def data_rank(args: Namespace) -> tuple[int, int]:
    """(rank, world size) whose data this process trains on: the simulated rank's, if any."""
    if getattr(args, "simulate_rank", None) is not None:
        return args.simulate_rank, args.world_size
    return dist.get_rank(), dist.get_world_size()


def make_method(args: Namespace, model, device, stochastic_depth=None):
    """The training method `args.method` names (DDPMethod, FSDPMethod or SDPMethod) wrapped around
    `model` on `device`; for SDP the plan is made here, FLOPs traced at the task's input size.
    stochastic_depth: the StochasticDepth installed on `model` (ddp only), or None."""
    bucket_cap_mb = getattr(args, "bucket_cap_mb", DEFAULT_BUCKET_CAP_MB)
    if args.method == "ddp":
        return DDPMethod(model, device, bucket_cap_mb, stochastic_depth=stochastic_depth)
    if args.method == "fsdp":
        return FSDPMethod(model, device)
    from ..planning.plan import plan_subnetworks
    from .tasks import sample_input_for

    # FLOPs traced at the task's input size, so blocks are balanced by compute as well as bytes
    sample = sample_input_for(args.model, model, getattr(args, "seq_len", 64), getattr(args, "data", None))
    plan = plan_subnetworks(model, world_size=data_rank(args)[1], coverage=args.coverage, level=args.level,
                            seed=args.seed, sample_input=sample,
                            block_assignment=getattr(args, "block_assignment", "balanced"))
    return SDPMethod(model, plan, args.regime, args.sync_every, args.scale, bucket_cap_mb=bucket_cap_mb,
                     overlap=not getattr(args, "no_overlap", False), simulate_rank=getattr(args, "simulate_rank", None),
                     timeout=args.timeout, shard_shared=getattr(args, "shard_shared", False),
                     assignment=getattr(args, "assignment", "static"), reassign_every=getattr(args, "reassign_every", 0),
                     assignment_shift=getattr(args, "assignment_shift", 1))


@torch.no_grad()
def evaluate(method, task, device) -> dict:
    """{"full": metrics, "ensemble": metrics?}; metrics = loss (nats) and accuracy."""
    sums = {}
    for x, y in task.eval_batches():
        x, y = x.to(device), y.to(device)
        for mode, logits in method.eval_logits(x).items():
            loss, correct, n = task.score(logits, y)
            acc = sums.setdefault(mode, [0.0, 0.0, 0])
            acc[0] += loss
            acc[1] += correct
            acc[2] += n
    return {mode: {"loss": s[0] / s[2], "accuracy": s[1] / s[2]} for mode, s in sums.items()}


def run_worker(args: Namespace) -> dict | None:
    """Train on this rank; returns the report on rank 0 (None elsewhere)."""
    backend, device = pick_backend(args.backend, args.device)
    init_distributed(backend, timeout_s=args.timeout, device=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    task = build_task(args.data, args.model, args.preset, args.batch_size, args.seq_len, args.seed, args.width)
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = task.make_model().to(device)
    if args.activation_checkpointing:  # before wrapping: the wrappers see the checkpointed blocks
        apply_activation_checkpointing(model)
    stochastic = StochasticDepth(model, args.stochastic_depth, args.seed, rank) if args.stochastic_depth else None
    method = make_method(args, model, device, stochastic)
    if args.compile:
        method.compile()
    optimizer = make_optimizer(method.parameters(), args)

    start, history = 0, {"step": [], "loss": [], "eval": [], "skipped": []}
    if args.resume:
        resumed = run_checkpoints.resume(args, method, optimizer)
        if resumed is not None:
            start, history = resumed
            if stochastic is not None:  # the draws of the steps the resumed run has yet to take
                stochastic.step = len(history["step"])
    history.setdefault("lr", [])
    if args.grad_clip is not None:  # the pre-clip norm is computed only when clipping
        history.setdefault("grad_norm", [])
    progress = _progress(args, task, rank, start)
    if _already_finished(args, task, start, history, progress):
        return None
    measured = _train(args, task, method, optimizer, history, start, device, rank, progress)
    if measured is None:
        return None  # a deliberate interruption, for resume tests
    final = evaluate(method, task, device)
    progress.evaluation(args.steps, final, final=True)
    history["eval"] = [e for e in history["eval"] if e["step"] != args.steps] + [{"step": args.steps, **final}]
    if args.save_dir:
        run_checkpoints.save(args.save_dir, args.steps, method, optimizer, history, args, final=True)
    local = {
        "rank": rank,
        **measured,
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_cuda_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
    }
    per_rank = [None] * world
    dist.all_gather_object(per_rank, local)
    comm = method.comm()
    if rank != 0:
        return None
    report = _report(args, task, method, per_rank, comm, final, history, world)
    if args.out:
        from .report import write_run_report

        write_run_report(report, args.out)
    return report


def _already_finished(args, task, start: int, history: dict, progress) -> bool:
    """True (rank 0 says so; nothing is trained, evaluated or saved) when the resumed checkpoint
    is a finished run's (its final evaluation at its last step) at or past --steps, or any
    checkpoint past --steps; a report of such a run would be a table of n/a."""
    last = history["eval"][-1] if history["eval"] else None
    if not (start > args.steps or (start == args.steps and start and last is not None and last["step"] == start)):
        return False
    from .progress import metrics_text

    where = args.save_dir if args.resume in ("latest", "auto") else args.resume
    said = f"; its final evaluation: {metrics_text({k: v for k, v in last.items() if k != 'step'}, task.task_type)}" \
        if last is not None and last["step"] == start else ""
    progress.note(f"subnet-train: the run resumed from {where} already finished: its checkpoint holds {start} "
                  f"optimizer steps (--steps {args.steps}){said}. Nothing to train; raise --steps to train it "
                  "further, or start a new run with another --save-dir.")
    progress.close()
    return True


def _train(args, task, method, optimizer, history, start, device, rank, progress=None) -> dict | None:
    """Steps start..args.steps, appending to history; this rank's measurements
    {memory, activation_bytes, step_time_s}, or None after --stop-after. progress: rank 0's lines
    and bar (made here when not given).

    A step reads nothing to the host: its skip decision stays on the device (OptimizerStep).
    Losses, gradient norms and the skip decisions are read together every --log-every
    steps, and before anything that uses the history (`_settle`)."""
    guard = NonFiniteGuard(args.max_skipped, timeout=args.timeout)
    guard.skipped_steps = list(history["skipped"])
    stepper = OptimizerStep(method, optimizer, guard, args, device, taken=len(history["step"]))
    faults = Faults(rank)
    progress = progress if progress is not None else _progress(args, task, rank, start)
    scalars = DeferredScalars(history)
    log_every = getattr(args, "log_every", 10)
    step_times, memory, activation_bytes = [], None, None
    for step in range(start, args.steps):
        faults.before_step(step + 1)
        t0 = time.perf_counter()
        meter = ActivationMeter() if activation_bytes is None else None
        loss = stepper.accumulate(task, step, *data_rank(args), meter=meter)
        if activation_bytes is None:
            activation_bytes = meter.bytes
        faults.after_backward(step + 1, method.parameters())
        # Every rank steps, or every rank skips (one all-reduced flag: the guard's, or the fp16
        # scaler's), decided on the device: optimizer.step() and its hooks run either way.
        record = stepper.finish(step + 1)
        if memory is None:
            memory = method.memory(optimizer)  # grads still allocated: measured before zero_grad
        method.after_step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
        _record(history, scalars, step + 1, loss, record)
        progress.step_done()
        boundary = step + 1 == args.steps or bool(args.stop_after and step + 1 - start >= args.stop_after)
        if (step + 1) % log_every == 0 or boundary or _saves_or_evaluates(args, step + 1):
            _settle(history, scalars, guard)
            if (step + 1) % log_every == 0 or boundary:
                progress.log(step + 1, history)
        if args.verify_every and (step + 1) % args.verify_every == 0:
            method.verify_consistency()
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            with progress.paused():
                history["eval"].append({"step": step + 1, **evaluate(method, task, device)})
                progress.evaluation(step + 1, {k: v for k, v in history["eval"][-1].items() if k != "step"})
        if args.save_dir and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            with progress.paused():
                run_checkpoints.save(args.save_dir, step + 1, method, optimizer, history, args)
        if args.stop_after and step + 1 - start >= args.stop_after:
            progress.close()
            return None
    _settle(history, scalars, guard)
    progress.close()
    return {"memory": memory, "activation_bytes": activation_bytes,
            "step_time_s": _median(step_times[1:] or step_times)}


def _saves_or_evaluates(args, step: int) -> bool:
    """True when this step's end writes a checkpoint or evaluates (the history must be read)."""
    return bool((args.save_dir and args.save_every and step % args.save_every == 0)
                or (args.eval_every and step % args.eval_every == 0))


class DeferredScalars:
    """Per-step device scalars (loss, gradient norm) appended to the history as tensors and
    read to the host together, in one copy, by `flush()`: reading each as it is made would
    wait for that step's work to finish, every step."""

    def __init__(self, history: dict):
        self.history, self.pending = history, []

    def append(self, key: str, value) -> None:
        """history[key].append(value); a tensor is replaced by its float at the next flush."""
        self.history[key].append(value)
        if torch.is_tensor(value):
            self.pending.append((key, len(self.history[key]) - 1, value))

    def flush(self, extra: list[torch.Tensor] = ()) -> list[float]:
        """Replace every pending tensor in the history by its value, and return the values of
        the 0-d tensors `extra`, all in one device-to-host copy."""
        tensors = [v for _, _, v in self.pending] + list(extra)
        if not tensors:
            return []
        device = tensors[0].device
        values = torch.stack([v.detach().float().reshape(()).to(device) for v in tensors]).tolist()
        for (key, i, _), v in zip(self.pending, values):
            self.history[key][i] = v
        self.pending = []
        return values[len(values) - len(extra):]


def _record(history: dict, scalars: DeferredScalars, step: int, loss, record: dict) -> None:
    """Appends one step to the history: loss (mean over micro-batches), lr, pre-clip norm
    (the tensors are read at the next flush)."""
    history["step"].append(step)
    scalars.append("loss", loss)
    history["lr"].append(record["lr"])
    if "grad_norm" in history:
        scalars.append("grad_norm", record["grad_norm"])


def _settle(history: dict, scalars: DeferredScalars, guard) -> None:
    """Read the pending losses, norms and skip decisions in one copy; the skipped steps go to
    history["skipped"] (their gradient norm, not finite, becomes None). Raises
    TooManySkippedSteps past --max-skipped (on every rank at the same step)."""
    skipped = guard.settle(scalars.flush(extra=guard.pending_flags()))
    history["skipped"] = list(guard.skipped_steps)
    if skipped and "grad_norm" in history:
        index = {s: i for i, s in enumerate(history["step"])}
        for s in skipped:
            history["grad_norm"][index[s]] = None


def _report(args, task, method, per_rank, comm, final, history, world):
    step_time = max(r["step_time_s"] for r in per_rank)
    samples = args.batch_size * world * (args.seq_len if task.task_type == "language" else 1)
    return {
        "method": args.method,
        "label": _label(args),
        "model": args.model, "preset": args.preset, "data": args.data, "task": task.task_type,
        "loss_floor": task.floor,
        "world_size": world, "steps": args.steps, "batch_size_per_rank": args.batch_size,
        "training": training_settings(args),
        "simulated": ({"rank": args.simulate_rank, "world_size": args.world_size}
                      if getattr(args, "simulate_rank", None) is not None else None),
        "sdp": {"level": args.level, "regime": args.regime, "coverage": args.coverage,
                "sync_every": args.sync_every, "scale": args.scale, "assignment": getattr(args, "assignment", "static"),
                "reassign_every": getattr(args, "reassign_every", 0),
                "block_assignment": getattr(args, "block_assignment", "balanced")} if args.method == "sdp" else None,
        "plan": method.plan.summary() if args.method == "sdp" else None,
        "final": final,
        "per_rank": per_rank,
        "comm": comm,
        "step_time_s": step_time,
        "throughput_per_s": samples / step_time if step_time > 0 else None,
        "throughput_unit": "tokens" if task.task_type == "language" else "samples",
        "history": history,
        "skipped_steps": len(history.get("skipped", [])),
    }


def _label(args):
    if args.method != "sdp":
        return args.method
    from ..planning.assignment.coverage import is_per_rank

    coverage = "-".join(f"{c:g}" for c in args.coverage) if is_per_rank(args.coverage) else f"{args.coverage:g}"
    moving = getattr(args, "assignment", "static")
    schedule = f"-{moving}{args.reassign_every}" if moving != "static" else ""
    return f"sdp-{args.level}-{args.regime}{schedule}-c{coverage}"


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def _progress(args, task, rank: int, start: int):
    """Rank 0's progress lines and terminal bar (progress.py), counting every rank's examples
    (tokens for a language model) of each optimizer step."""
    from .progress import TrainingProgress

    language = task.task_type == "language"
    per_step = args.batch_size * data_rank(args)[1] * args.grad_accum * (args.seq_len if language else 1)
    if getattr(args, "simulate_rank", None) is not None:  # one rank's batches, in this one process
        per_step //= args.world_size
    return TrainingProgress(rank, start, args.steps, per_step, "tokens" if language else "samples", task.task_type)

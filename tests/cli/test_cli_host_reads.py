"""subnet-train's step reads nothing to the host.

The skip decision for non-finite gradients stays on the device (the fused AdamW takes it
as its found_inf), and the loss of each micro-batch, the clipped gradient norm and the
skip decisions are read together every --log-every steps (and at the end). Counted with
tests/host_reads.py over the training loop (one simulated rank, so no processes), against
the count the test expects: one read per flush, none per step, a skipped step included
(fp16 too, where torch's scaler would read its found-inf for an optimizer that cannot take it).
The history must still hold every step's loss and norm as numbers, and the skipped step.
"""
import math

import pytest
import torch

from host_reads import counting_host_reads
from subnet_ext.jobs import loop
from subnet_ext.jobs.faults import NAN
from subnet_ext.jobs.tasks import build_task
from subnet_ext.cli.train import build_parser, check_args
from subnet_ext.jobs.training import make_optimizer


def args_for(*argv):
    parser = build_parser()
    args = parser.parse_args(["--model", "mlp", "--data", "digits", "--batch-size", "8", "--width", "16", *argv])
    check_args(parser, args)
    return args


@pytest.mark.parametrize("regime,precision,nan_at", [("forward", "fp32", None), ("backward", "fp32", None),
                                                    ("forward", "fp32", 2), ("backward", "fp16", 2)])
def test_steps_read_nothing_and_the_log_interval_once(regime, precision, nan_at, monkeypatch):
    steps, log_every = 6, 3
    if nan_at is not None:  # a NaN gradient at that step: skipped, still without a read
        monkeypatch.setenv(NAN, f"0:{nan_at}")
    args = args_for("--method", "sdp", "--simulate-rank", "0", "--world-size", "2", "--level", "neuron",
                    "--regime", regime, "--steps", str(steps), "--log-every", str(log_every), "--grad-accum", "2",
                    "--grad-clip", "1.0", "--precision", precision)
    task = build_task(args.data, args.model, args.preset, args.batch_size, args.seq_len, args.seed, args.width)
    torch.manual_seed(args.seed)
    device = torch.device("cpu")
    method = loop.make_method(args, task.make_model(), device)
    optimizer = make_optimizer(method.parameters(), args)  # the CLI's optimizer
    history = {"step": [], "loss": [], "eval": [], "skipped": [], "lr": [], "grad_norm": []}
    with counting_host_reads() as host:
        measured = loop._train(args, task, method, optimizer, history, 0, device, 0)
    assert measured is not None
    # Reads of values the step computed (not the batches, which are made on the host).
    step_reads = [r for r in host.reads if not r[1].startswith(("data/", "jobs/tasks.py"))]
    flushes = math.ceil(steps / log_every)
    assert len(step_reads) == flushes, step_reads
    assert all(r[1] == "jobs/loop.py" for r in step_reads), step_reads  # the flush's one copy, nothing else
    assert host.scalar_reads == []  # nor does torch read a value (fp16: the scaler hands found_inf to the optimizer)
    assert history["skipped"] == ([] if nan_at is None else [nan_at])
    assert len(history["loss"]) == len(history["grad_norm"]) == steps
    norms = [n for i, n in enumerate(history["grad_norm"]) if i + 1 != nan_at]
    assert all(isinstance(v, float) and math.isfinite(v) for v in history["loss"] + norms), history
    if nan_at is not None:
        assert history["grad_norm"][nan_at - 1] is None


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_the_fused_finiteness_flag(bad):
    """guard.nonfinite_flag against the test's own element-wise check, over dtypes, an
    empty gradient and a parameter without one."""
    from subnet_ext.engine.guards.nonfinite_guard import nonfinite_flag

    params = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
              for shape, dtype in [((0,), torch.float32), ((3, 4), torch.float32), ((5,), torch.bfloat16),
                                   ((2, 2), torch.float16), ((7,), torch.float32)]]
    for p in params[:-1]:
        p.grad = torch.randn(p.shape).to(p.dtype)
    if bad is not None:
        params[2].grad[3] = bad
    expected = any(not torch.isfinite(p.grad).all() for p in params if p.grad is not None)
    flag = nonfinite_flag(params)
    assert flag.dtype == torch.float32 and flag.dim() == 0 and flag.item() == float(expected)
    assert nonfinite_flag([params[-1]]) is None

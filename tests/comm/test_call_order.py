"""Collective methods called on only some ranks fail on every rank, naming what each rank did.

A DDP script evaluates and checkpoints under `if master_process:`; with SDP those calls are
collectives. Before the check, rank 0's full-state all-reduce met rank 1's gradient
all-reduce on the same group and gloo aborted the process (SIGABRT, "Received data size
doesn't match expected size"). Here:

- a training script (as a user runs it: the exception propagates, the interpreter exits)
  where one rank alone calls full_state_dict() or evaluate() while the other trains: both
  processes exit with Python's error status (not SIGABRT), within 60 s, each raising
  CallOrderError (the rank in the gradient all-reduce too) whose message names both ranks' calls;
- two ranks calling different collective methods (or a checkpoint save, or the same method
  with different rank0_only options): both raise at once, naming both calls, and the engine stays usable;
- the check adds nothing to a training step: no store request, the same collectives.
"""
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import subnet_ext as sx
from sdp_helpers import batch, make_model
from subnet_ext.jobs.launch import free_port
from subnet_ext.testing import run_distributed

TIMEOUT_S = 5.0
HERE = os.path.dirname(os.path.abspath(__file__))  # tests/comm: this module
TESTS = os.path.dirname(HERE)  # tests/: the shared helpers (sdp_helpers)
ROOT = os.path.dirname(TESTS)


def master_only_script(call: str, caller: int) -> None:
    """A worker process of the test below (run as `python -c`): trains a small GPT and, at
    step 2, calls `call` on rank `caller` only. Prints the seconds from that step to the end."""
    from subnet_ext.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1337 + rank)  # nanoGPT seeds each rank differently; rank 0's values are broadcast
    model = GPT(GPTConfig(block_size=32, vocab_size=65, n_layer=2, n_head=2, n_embd=32, parallel_residual=True))
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, 2, 0.5, "block"), timeout=TIMEOUT_S)
    opt = torch.optim.AdamW(sdp.parameters(), lr=1e-3)
    started = None
    try:
        for step in range(6):
            x = torch.randint(0, 65, (4, 16))
            if step == 2:
                started = time.monotonic()
                if rank == caller:
                    getattr(sdp, call)(*((x,) if call == "evaluate" else ()))
            sdp(x, x)[1].backward()
            opt.step()
            opt.zero_grad()
    finally:
        print(f"seconds after the call: {time.monotonic() - started:.1f}", file=sys.stderr, flush=True)


def _launch(call: str, caller: int) -> list:
    """Run master_only_script on 2 ranks as separate processes; [(exit code, stderr)] per rank."""
    port = free_port()
    code = f"import sys; sys.path[:0] = [{HERE!r}, {TESTS!r}]; import test_call_order as t; " \
           f"t.master_only_script({call!r}, {caller})"
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        out.append((p.returncode, err))
    return out


@pytest.mark.parametrize("call,caller", [("full_state_dict", 0), ("evaluate", 1)])
def test_a_collective_method_on_one_rank_fails_on_every_rank(call, caller):
    other = 1 - caller
    for rank, (code, err) in enumerate(_launch(call, caller)):
        tail = err[-3000:]
        assert code == 1, (rank, code, tail)  # Python's error exit: not SIGABRT (-6 / 134), not a hang
        assert f"rank {caller} called {call} (#1)" in err, (rank, tail)
        assert f"rank {other} was in all_reduce of gradients" in err, (rank, tail)
        assert "EnforceNotMet" not in err and "terminate called" not in err, (rank, tail)
        # The same class on every rank: the rank whose gradient all-reduce failed raises
        # CallOrderError too, so one `except sx.CallOrderError` catches it everywhere.
        assert "subnet_ext.comm.call_check.CallOrderError: SubnetDataParallel:" in err, (rank, tail)
        # Within the deadline (shortened here through SDPConfig.timeout, the documented knob):
        # the deadline is what ends the wait, on both ranks, a few seconds at most after it.
        seconds = float(err.rsplit("seconds after the call: ", 1)[1].split()[0])
        assert TIMEOUT_S * 0.9 <= seconds < TIMEOUT_S + 10, (rank, seconds)


def test_the_default_deadline_is_the_command_lines_and_the_porting_guides():
    """The engine's default deadline is DEFAULT_TIMEOUT_S = 300 s, subnet-train's --timeout
    default, and the porting guide states it beside the rank-0-only pattern (the engines a
    test builds without a timeout use it: test_the_check_adds_nothing_to_a_training_step)."""
    from subnet_ext.jobs.arguments import build_parser
    from subnet_ext.engine.config import DEFAULT_TIMEOUT_S

    assert sx.SDPConfig().timeout == DEFAULT_TIMEOUT_S == 300.0
    assert build_parser().get_default("timeout") == DEFAULT_TIMEOUT_S
    with open(os.path.join(ROOT, "docs", "porting.md")) as f:
        porting = f.read()
    said = porting[porting.index("if rank == 0:"):]
    assert f"{DEFAULT_TIMEOUT_S:g} s by default" in said[:1500], "docs/porting.md must state the default deadline"


def _different_calls(rank, world, folder):
    out = {}
    model = make_model()
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 0.5, "block"), timeout=60.0)
    opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
    x, y = batch(rank, 0)
    F.cross_entropy(sdp(x), y).backward()
    opt.step()
    for label, mine in (("methods", "full_state_dict" if rank == 0 else "verify_consistency"),
                        ("checkpoint", "save" if rank == 0 else "full_state_dict"),
                        ("options", "rank0_only" if rank == 0 else "full_state_dict")):
        started = time.monotonic()
        try:
            if mine == "save":
                sx.checkpoint.save_subnet_checkpoint(folder, 1, sdp, opt)
            elif mine == "rank0_only":  # the same method, but a reduce here and an all-reduce there
                sdp.full_state_dict(rank0_only=True)
            else:
                getattr(sdp, mine)()
            out[label] = None
        except sx.CallOrderError as e:
            out[label] = (str(e), time.monotonic() - started)
    # No data collective was issued: the engine goes on, and the ranks agree.
    out["after"] = {n: t.numpy().tobytes() for n, t in sdp.full_state_dict().items()}
    return out


def test_different_collective_methods_fail_at_once_and_the_engine_stays_usable(tmp_path):
    results = run_distributed(_different_calls, 2, str(tmp_path))
    for r in results:
        message, seconds = r["methods"]
        assert "rank 0 called full_state_dict (#1)" in message and "rank 1 called verify_consistency (#1)" in message
        assert seconds < 30  # decided on sight, not by the 60 s timeout
        message, _ = r["checkpoint"]
        assert "rank 0 called save_subnet_checkpoint (#2)" in message, message
        assert "rank 1 called full_state_dict (#2)" in message, message
        message, seconds = r["options"]
        assert "rank 0 called full_state_dict(rank0_only=True) (#3)" in message, message
        assert "rank 1 called full_state_dict (#3)" in message, message
        assert seconds < 30
    assert results[0]["after"] == results[1]["after"]


class _CountingStore:
    """Wraps a c10d store, counting every request."""

    def __init__(self, store):
        self.store, self.requests = store, 0

    def __getattr__(self, name):
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.requests += 1
            return attr(*args, **kwargs)

        return counted


def _training_adds_nothing(rank, world):
    counts = {}
    for checked in (True, False):
        model = make_model()
        sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 0.5, "neuron"), regime="backward")
        store = _CountingStore(sdp.call_ledger.store) if checked else None
        sdp.call_ledger.store = store  # None: the engine without the order check
        opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
        calls, original = [0], dist.all_reduce

        def counted_all_reduce(*args, **kwargs):
            calls[0] += 1
            return original(*args, **kwargs)

        dist.all_reduce = counted_all_reduce
        try:
            for step in range(3):
                x, y = batch(rank, step)
                F.cross_entropy(sdp(x), y).backward()
                sdp.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
        finally:
            dist.all_reduce = original
        counts[checked] = {"all_reduce": calls[0], "store": store.requests if store else 0,
                           # built without a timeout: the default deadline, for the steps and the order check
                           "deadline": (sdp.config.timeout, sdp.communicator.timeout, sdp.call_ledger.timeout)}
        sdp.full_state_dict()
        counts[checked]["store_after_call"] = store.requests if store else 0
    return counts


def test_the_check_adds_nothing_to_a_training_step():
    for counts in run_distributed(_training_adds_nothing, 2):
        assert counts[True]["all_reduce"] == counts[False]["all_reduce"] > 0, counts
        assert counts[True]["store"] == 0, counts
        assert counts[True]["store_after_call"] > 0, counts  # the counter does see the check's requests
        assert counts[True]["deadline"] == (300.0, 300.0, 300.0), counts

"""subnet-train under faults: a worker SIGKILLed under torchrun --max-restarts resumes from
the last checkpoint and ends bit-identical to an uninterrupted run; a NaN gradient on one
rank is skipped everywhere (the skip decided on the device: parameters and optimizer state
of every rank's checkpoint unchanged by that step, the step counts those of the steps the
test did not spoil, counted in the report, owners still agree); --max-skipped stops the
run cleanly."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from subnet_ext.jobs.launch import free_port
from subnet_ext.cli.train import main
from subnet_ext.jobs.run_checkpoints import load_full_model_state
from subnet_ext.state.checkpoint_store import read_state, state_metadata

TINY = ["--model", "mlp", "--width", "16", "--data", "digits", "--batch-size", "16", "--method", "sdp"]


def test_killed_worker_restarts_and_matches_uninterrupted_run(tmp_path):
    run = [*TINY, "--steps", "8", "--save-every", "2", "--level", "neuron", "--regime", "backward"]
    assert main([*run, "--nproc", "2", "--save-dir", str(tmp_path / "whole"), "--out", str(tmp_path / "w")]) == 0
    env = dict(os.environ, SUBNET_EXT_FAULT_KILL="1:5", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "subnet_ext.cli.train",
           *run, "--save-dir", str(tmp_path / "elastic"), "--resume", "auto", "--timeout", "30",
           "--out", str(tmp_path / "e")]
    # Its own session, so a hung run is killed with every worker it started.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"the elastic run did not finish within 240 s:\n{log[-4000:]}")
    assert proc.returncode == 0, log[-4000:]
    assert "exitcode: -9" in log, log[-4000:]  # the first attempt really lost a worker to SIGKILL
    whole = load_full_model_state(str(tmp_path / "whole" / "step-000008"))
    elastic = load_full_model_state(str(tmp_path / "elastic" / "step-000008"))
    for name in whole:
        assert torch.equal(elastic[name], whole[name]), name  # bit-identical (CPU, same seed)
    losses = [json.loads((tmp_path / d / "report.json").read_text())["history"]["loss"] for d in ("w", "e")]
    assert losses[1] == losses[0]


def saved_state(folder) -> dict:
    """{key: tensor}: every tensor a checkpoint holds (all ranks' parameters and optimizer
    state: SDP's pieces, or DDP/FSDP's full tensors), read in this process."""
    request = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in state_metadata(str(folder)).items()}
    read_state(str(folder), request)
    return request


@pytest.mark.parametrize("method", ["sdp", "fsdp"])
def test_nan_on_one_rank_is_skipped_everywhere(tmp_path, monkeypatch, method):
    steps, bad = 5, 3
    monkeypatch.setenv("SUBNET_EXT_FAULT_NAN", f"1:{bad}")
    out, ck = tmp_path / "out", tmp_path / "ck"
    extra = ["--level", "neuron", "--regime", "backward", "--verify-every", "1"] if method == "sdp" else []
    assert main([*TINY[:-1], method, "--steps", str(steps), "--nproc", "2", *extra, "--max-skipped", "2",
                 "--save-dir", str(ck), "--save-every", "1", "--keep-last", str(steps), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["skipped_steps"] == 1 and report["history"]["skipped"] == [bad]
    assert len(report["history"]["loss"]) == steps  # (sdp) --verify-every 1 passed after every step, NaN step included
    states = {s: saved_state(ck / f"step-{s:06d}") for s in (bad - 1, bad, bad + 1, steps)}
    # Every rank's parameters and optimizer state (moments, step counts) are as the step before left them ...
    assert states[bad].keys() == states[bad - 1].keys()
    changed = [k for k in states[bad] if not torch.equal(states[bad][k], states[bad - 1][k])]
    assert changed == [], changed
    # ... while the next step moves them (so the comparison above can fail).
    assert all(not torch.equal(states[bad + 1][k], states[bad][k]) for k in states[bad] if "exp_avg_sq" in k)
    # The optimizer counted the steps the test did not spoil: all but one (SDP saves its step counts).
    counts = {float(v) for k, v in states[steps].items() if k.startswith("optim/step/")}
    assert counts == ({steps - 1.0} if method == "sdp" else set()), counts


def test_max_skipped_stops_cleanly(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SUBNET_EXT_FAULT_NAN", "0:2,0:3")
    code = main([*TINY, "--steps", "5", "--nproc", "1", "--max-skipped", "1", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 1 and "stopped" in err and "--max-skipped" in err and "[2, 3]" in err, err
    assert not (tmp_path / "o" / "report.json").exists()

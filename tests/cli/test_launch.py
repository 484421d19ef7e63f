"""Backend choice with more local ranks than GPUs (on CPU: the GPU count is monkeypatched).

NCCL cannot run two ranks on one GPU, so --device auto falls back to gloo on the CPU with
a one-line note, and an explicit --device cuda / --backend nccl is refused naming both
counts. On NCCL the worker binds its process group to its GPU (`device_id`, so the
communicators are made at init, not in the first backward): checked on the arguments
`init_process_group` receives, monkeypatched.
"""
import pytest
import torch

import torch.distributed as dist

from subnet_ext.cli import train
from subnet_ext.jobs import launch, loop, runner


@pytest.fixture
def gpus(monkeypatch):
    """Pretend `n` GPUs are visible; set_device is recorded, not run."""
    calls = []

    def fake(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(i))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: calls[-1])
        return calls

    return fake


def test_auto_falls_back_to_gloo_on_cpu_with_a_note(gpus):
    gpus(1)
    backend, device, note = launch.choose_backend("auto", "auto", local_world_size=2)
    assert (backend, device) == ("gloo", "cpu")
    assert "2 local ranks" in note and "1 GPU" in note and "gloo" in note
    # Enough GPUs: NCCL, no note.
    gpus(2)
    assert launch.choose_backend("auto", "auto", local_world_size=2) == ("nccl", "cuda", None)
    assert launch.choose_backend("auto", "auto", local_world_size=1) == ("nccl", "cuda", None)


@pytest.mark.parametrize("backend,device_flag", [("auto", "cuda"), ("nccl", "auto"), ("nccl", "cuda"),
                                            ("gloo", "cuda")])
def test_explicit_gpu_request_is_refused_naming_counts(gpus, backend, device_flag):
    gpus(1)
    with pytest.raises(ValueError, match=r"3 local ranks need one GPU each, but 1 GPU\(s\) are visible"):
        launch.choose_backend(backend, device_flag, local_world_size=3)


def test_bad_values_are_named(gpus):
    gpus(0)
    with pytest.raises(ValueError, match="local world size must be at least 1, got 0"):
        launch.choose_backend("auto", "auto", 0)
    with pytest.raises(ValueError, match="no GPU is visible"):
        launch.choose_backend("auto", "cuda", 1)
    assert launch.choose_backend("auto", "auto", 4) == ("gloo", "cpu", None)  # no GPU: plain gloo, no note


def test_pick_backend_reads_local_world_size_and_notes_once(gpus, monkeypatch, capsys):
    calls = gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert launch.pick_backend("auto", "auto") == ("gloo", torch.device("cpu"))
    assert capsys.readouterr().err.count("NCCL needs one GPU per rank") == 1  # local rank 0 only
    assert calls == []  # no GPU was made current
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert launch.pick_backend("auto", "auto") == ("nccl", torch.device("cuda", 0)) and calls == [0]


def test_cli_refuses_cuda_with_too_many_ranks(gpus, capsys):
    gpus(1)
    with pytest.raises(SystemExit) as e:
        train.main(["--nproc", "2", "--device", "cuda"])
    assert e.value.code == 2
    assert "2 local ranks need one GPU each, but 1 GPU(s)" in capsys.readouterr().err


def test_cli_auto_pins_gloo_on_cpu_before_spawning(gpus, monkeypatch, capsys):
    gpus(1)
    spawned = []
    monkeypatch.setattr(runner, "spawn_local", lambda fn, args, n: spawned.append((args.backend, args.device, n)))
    parser = train.build_parser()
    args = parser.parse_args(["--nproc", "2"])
    train.check_args(parser, args)
    assert train.run(args) is None  # the stand-in wrote no report
    assert spawned == [("gloo", "cpu", 2)]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "uses gloo on the CPU" in err


class _Initialised(Exception):
    """Stops a worker right after init_process_group (the stand-in raises it)."""


@pytest.fixture
def init_calls(monkeypatch):
    """The keyword arguments of every init_process_group call; the call itself raises _Initialised."""
    calls = []

    def fake(**kwargs):
        calls.append(kwargs)
        raise _Initialised

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", fake)
    return calls


@pytest.mark.parametrize("restart", [None, "1"])
def test_the_worker_binds_nccl_to_its_gpu(gpus, init_calls, monkeypatch, restart):
    """Local rank 1 of 2 with 2 GPUs: nccl with device_id cuda:1 (also under torchrun's restart,
    through the rendezvous store); gloo gets no device_id."""
    gpus(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    if restart is None:
        monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
        monkeypatch.setattr(dist, "rendezvous", lambda url, timeout: iter([(dist.HashStore(), 1, 2)]))
    parser = train.build_parser()
    for backend, device in [("auto", "auto"), ("gloo", "cpu")]:
        args = parser.parse_args(["--backend", backend, "--device", device, "--timeout", "42"])
        train.check_args(parser, args)
        with pytest.raises(_Initialised):
            loop.run_worker(args)
    nccl, gloo = init_calls
    assert nccl["backend"] == "nccl" and nccl["device_id"] == torch.device("cuda", 1), nccl
    assert nccl["timeout"].total_seconds() == 42 and (restart is None) == ("store" not in nccl), nccl
    assert gloo["backend"] == "gloo" and "device_id" not in gloo, gloo


def test_nccl_without_a_gpu_is_refused():
    with pytest.raises(ValueError, match="nccl backend needs this rank's CUDA device, got device"):
        launch.init_distributed("nccl", device=torch.device("cpu"))

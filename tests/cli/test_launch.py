"""Backend choice with more local ranks than GPUs (on CPU: the GPU count is monkeypatched).

NCCL cannot run two ranks on one GPU, so --device auto falls back to gloo on the CPU with
a one-line note, and an explicit --device cuda / --backend nccl is refused naming both
counts.
"""
import pytest
import torch

from subnet_ext.cli import launch, runner, train


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

"""Process launch: run under torchrun, or start N local workers on one machine.

Under torchrun the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK) is already set; otherwise `spawn_local` starts `nproc` workers that
rendezvous on 127.0.0.1 at a free port, each with one thread per core share.
"""
from __future__ import annotations

import datetime
import gc
import os
import socket
import sys
import traceback
from typing import Callable, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A local worker failed; the message is its exception (type and text) and its rank."""


def clean_stop_types() -> tuple:
    """Errors a run detects and stops on by design: reported in one line, no traceback."""
    from ..state.checkpoint_store import CheckpointError
    from ..comm.collectives import CollectiveError
    from ..state.consistency import ConsistencyError
    from ..engine.guards.nonfinite_guard import TooManySkippedSteps

    return TooManySkippedSteps, ConsistencyError, CollectiveError, CheckpointError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    """True when RANK, WORLD_SIZE and MASTER_ADDR are set, i.e. this process is a torchrun worker."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def choose_backend(requested: str = "auto", device: str = "auto",
                   local_world_size: int = 1) -> tuple[str, str, str | None]:
    """(backend, device type, note): the choice alone, without touching any device.

    NCCL on GPUs, gloo on CPUs, unless asked otherwise. NCCL refuses two ranks on one GPU
    ("Duplicate GPU detected"), so with more local ranks than visible GPUs: --device auto
    falls back to gloo on the CPU and `note` says why (one line, for the user); an explicit
    --device cuda or --backend nccl is refused. note is None when nothing was overridden.

    Args:
        requested: --backend, "auto" | "gloo" | "nccl".
        device: --device, "auto" | "cpu" | "cuda".
        local_world_size: ranks started on this machine (--nproc, or torchrun's LOCAL_WORLD_SIZE).
    """
    if requested not in ("auto", "gloo", "nccl"):
        raise ValueError(f"--backend must be auto, gloo or nccl, got {requested!r}")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {device!r}")
    if local_world_size < 1:
        raise ValueError(f"the local world size must be at least 1, got {local_world_size}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    use_cuda = gpus > 0 if device == "auto" else device == "cuda"
    if use_cuda and gpus == 0:
        raise ValueError("--device cuda was asked for but no GPU is visible")
    note = None
    if use_cuda and gpus < local_world_size:
        if device == "cuda" or requested == "nccl":
            raise ValueError(f"{local_world_size} local ranks need one GPU each, but {gpus} GPU(s) are visible "
                             f"(NCCL cannot put two ranks on one GPU): use --nproc {gpus} or fewer, or --device cpu")
        use_cuda = False
        note = (f"{local_world_size} local ranks but {gpus} GPU(s) visible: NCCL needs one GPU per rank, "
                "so this run uses gloo on the CPU")
    backend = ("nccl" if use_cuda else "gloo") if requested == "auto" else requested
    if backend == "nccl" and not use_cuda:
        raise ValueError("--backend nccl needs --device cuda (NCCL runs on GPUs only)")
    return backend, ("cuda" if use_cuda else "cpu"), note


def pick_backend(requested: str = "auto", device: str = "auto",
                 local_world_size: int | None = None) -> tuple[str, torch.device]:
    """(backend, device) for this rank (choose_backend), with the rank's GPU made current.

    local_world_size defaults to LOCAL_WORLD_SIZE from the environment (1 when unset);
    the fallback note is printed once per machine, by local rank 0.
    """
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    backend, device_type, note = choose_backend(requested, device, local_world_size)
    if note and local == 0:
        print(f"subnet-train: {note}", file=sys.stderr, flush=True)
    if device_type == "cuda":
        torch.cuda.set_device(local % torch.cuda.device_count())
        return backend, torch.device("cuda", torch.cuda.current_device())
    return backend, torch.device("cpu")


def init_distributed(backend: str, timeout_s: float = 300.0, device: torch.device | None = None) -> None:
    """init_process_group from the environment, with a bounded timeout (no endless hangs).

    On NCCL, `device` (this rank's GPU, e.g. cuda:LOCAL_RANK) is passed as `device_id`: the
    group is bound to it and its communicators are made now, eagerly, rather than lazily
    inside the first collective (the first backward's gradient all-reduce).

    Raises:
        ValueError: NCCL without a CUDA device.
    """
    if dist.is_initialized():
        return
    options = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if backend == "nccl":
        if device is None or torch.device(device).type != "cuda":
            raise ValueError(f"init_distributed: the nccl backend needs this rank's CUDA device, got {device!r}")
        options["device_id"] = torch.device(device)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        dist.init_process_group(backend=backend, **options)
        return
    # Under torchrun the agent's store outlives a restart: without a per-attempt namespace a
    # restarted rank can read the dead attempt's gloo addresses and fail to connect.
    store, rank, world = next(dist.rendezvous("env://", timeout=options["timeout"]))
    store = dist.PrefixStore(f"subnet_ext/attempt_{restart}", store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, **options)


def shutdown_distributed() -> None:
    """destroy_process_group, after freeing what still references the groups (engines in
    reference cycles): a gloo group destroyed later, during interpreter shutdown, can
    abort the process ("terminate called without an active exception")."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def exit_worker(code: int = 0) -> NoReturn:
    """End a worker process now, skipping the interpreter's teardown.

    A gloo process group that something still references (torch DDP holds its own) is
    destroyed only during teardown, where its worker thread may release the last work
    object and touch Python objects the finalising interpreter no longer serves: the
    process then aborts ("terminate called without an active exception") after a run that
    succeeded. Workers have written everything they produce, so they leave directly.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _worker(local_rank: int, nproc: int, port: int, fn: Callable, args, threads: int) -> None:
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(threads),
    )
    torch.set_num_threads(threads)
    try:
        fn(args)
    except clean_stop_types() as e:
        print(f"[rank {local_rank}] stopped: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        shutdown_distributed()
    exit_worker(0)


def spawn_local(fn: Callable, args, nproc: int) -> None:
    """Run fn(args) in `nproc` local worker processes; raises if any worker fails.

    Oversubscribed ranks on few cores run many times slower, so each worker gets
    max(1, cores // nproc) threads.
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    threads = max(1, (os.cpu_count() or 1) // nproc)
    try:
        mp.start_processes(_worker, args=(nproc, free_port(), fn, args, threads), nprocs=nproc, join=True,
                           start_method="spawn")
    except mp.ProcessRaisedException as e:
        # Its text is the worker's whole traceback; the last line is the exception itself.
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        raise WorkerError(f"worker {e.error_index} failed: {lines[-1] if lines else e}") from e

"""Start an integration's runs as real processes and read back what each rank recorded.

The scripts (lightning_runs.py, hf_runs.py) are run by the interpreter running the tests,
with the repository and this folder importable, gloo's rendezvous on 127.0.0.1 at a free
port, one thread per process, and no launcher variables inherited from the caller (a stray
LOCAL_RANK would make Lightning believe it is a child process).
"""
import importlib.util
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from subnet_ext.jobs.launch import free_port

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
                      "MASTER_ADDR", "MASTER_PORT")


def require_extra(packages: tuple, extras: str) -> None:
    """Fail (not skip) when a package of the extras ("hf", "lightning,hf") is missing: `make test`
    installs them, so CI must run these tests; a missing package is a broken environment there,
    not an optional feature."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: these tests need the [{extras}] extras (pip install -e "
                    f"'.[{extras}]'; make test installs them)")


def environment(**extra) -> dict:
    """The processes' environment: this repository first on the path, a fresh rendezvous port."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), str(HERE), os.environ.get("PYTHONPATH")])))
    env.update(extra)
    return env


def check_done(done: subprocess.CompletedProcess, what: str) -> None:
    """Assert the run succeeded, showing the end of its output when it did not."""
    assert done.returncode == 0, (f"{what} failed (exit {done.returncode}):\n--- stdout\n{done.stdout[-4000:]}\n"
                                  f"--- stderr\n{done.stderr[-8000:]}")


def run_script(script: str, args: list, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run tests/integrations/<script> with `args` under the interpreter running the tests."""
    return subprocess.run([sys.executable, str(HERE / script), *map(str, args)], env=env or environment(),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def load_ranks(out_dir: pathlib.Path, mode: str, world_size: int) -> list:
    """[what rank r saved for `mode`, for r in range(world_size)]."""
    return [torch.load(out_dir / f"{mode}-rank{r}.pt", weights_only=False) for r in range(world_size)]


def run_ranks(script: str, args: list, world_size: int, timeout: float, log_dir: pathlib.Path) -> None:
    """Run tests/integrations/<script> as `world_size` processes with torchrun's environment (RANK,
    LOCAL_RANK, WORLD_SIZE, ...; one shared rendezvous port), as `torchrun --nproc-per-node` would;
    assert every one succeeded. Output goes to log_dir/<script>-rank<r>.log; when a rank fails,
    the others (waiting in a collective) are stopped after a few seconds."""
    base = environment(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    logs = [open(log_dir / f"{pathlib.Path(script).stem}-rank{r}.log", "w+") for r in range(world_size)]
    processes = [subprocess.Popen([sys.executable, str(HERE / script), *map(str, args)],
                                  env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), cwd=ROOT, text=True,
                                  stdout=logs[r], stderr=subprocess.STDOUT) for r in range(world_size)]
    deadline, failed_at = time.monotonic() + timeout, None
    try:
        while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
            if failed_at is None and any(p.poll() not in (None, 0) for p in processes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() > failed_at + 10:
                break
            time.sleep(0.2)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(processes, logs)):
        log.seek(0)
        output = log.read()
        log.close()
        assert p.returncode == 0, f"rank {rank} of {script} failed (exit {p.returncode}):\n{output[-8000:]}"

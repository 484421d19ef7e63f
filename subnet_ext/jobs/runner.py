"""Run one training job: under torchrun, in this process, or in N local workers."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .launch import choose_backend, free_port, shutdown_distributed, spawn_local, under_torchrun


def run(args: argparse.Namespace) -> dict | None:
    """Runs one training job in this process tree; returns rank 0's report when local."""
    from .loop import run_worker

    if under_torchrun():
        try:
            return run_worker(args)
        finally:
            shutdown_distributed()
    nproc = args.nproc or 1
    if nproc == 1:
        env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return run_worker(args)
        finally:
            shutdown_distributed()
            # Restored, or a later run in this process would believe it runs under torchrun.
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    # Decided once here, so the workers get an explicit choice and the note prints once.
    args.backend, args.device, note = choose_backend(args.backend, args.device, nproc)
    if note:
        print(f"subnet-train: {note}", file=sys.stderr, flush=True)
    if not args.out:  # the workers hand their report back through this folder
        import tempfile

        args.out = tempfile.mkdtemp(prefix="subnet-train-")
    spawn_local(run_worker, args, nproc)
    if args.out and os.path.exists(os.path.join(args.out, "report.json")):
        with open(os.path.join(args.out, "report.json")) as f:
            return json.load(f)
    return None

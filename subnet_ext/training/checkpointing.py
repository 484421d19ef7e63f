"""Checkpoints of a training run, written atomically.

Layout under save_dir:
  step-000120/model.pt        full model state (original names and shapes), rank 0
  step-000120/optim-rank3.pt  that rank's optimizer state and RNG state
  step-000120/meta.json       step, world size, method, history
  LATEST                      name of the newest complete checkpoint (written last)

Every file goes to a temporary name, is fsynced, then renamed, and LATEST moves only
after all ranks finished theirs: a crash mid-save leaves the previous checkpoint intact.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

LATEST = "LATEST"


def _atomic_write(path: str, write) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _identity(args) -> dict:
    keys = ("method", "model", "preset", "data", "level", "regime", "coverage", "seed", "width")
    return {k: getattr(args, k, None) for k in keys}


def save(save_dir: str, step: int, method, optimizer, history: dict, args) -> None:
    """Collective: every rank writes its optimizer state; rank 0 the model and meta."""
    rank, world = dist.get_rank(), dist.get_world_size()
    name = f"step-{step:06d}"
    folder = os.path.join(save_dir, name)
    full = method.full_state_dict()  # collective for SDP and FSDP
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    local = {"optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}
    _atomic_write(os.path.join(folder, f"optim-rank{rank}.pt"), lambda f: torch.save(local, f))
    if rank == 0:
        _atomic_write(os.path.join(folder, "model.pt"), lambda f: torch.save(full, f))
        meta = {"step": step, "world_size": world, "identity": _identity(args), "history": history}
        _atomic_write(os.path.join(folder, "meta.json"), lambda f: f.write(json.dumps(meta).encode()))
    dist.barrier()
    if rank == 0:
        _fsync_dir(folder)
        _atomic_write(os.path.join(save_dir, LATEST), lambda f: f.write(name.encode()))
        _fsync_dir(save_dir)
    dist.barrier()


def resume(save_dir: str, method, optimizer, args):
    """Loads the newest checkpoint into method and optimizer; returns (step, history).

    Raises:
        FileNotFoundError: no complete checkpoint in save_dir.
        ValueError: the checkpoint was made by a different run (method, model, plan
            settings or world size).
    """
    if not save_dir:
        raise ValueError("--resume needs --save-dir")
    latest = os.path.join(save_dir, LATEST)
    if not os.path.exists(latest):
        raise FileNotFoundError(f"--resume: no complete checkpoint in {save_dir!r} (no {LATEST} file)")
    with open(latest) as f:
        folder = os.path.join(save_dir, f.read().strip())
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    world = dist.get_world_size()
    if meta["world_size"] != world or meta["identity"] != _identity(args):
        raise ValueError(
            f"--resume: checkpoint {folder!r} was made by world size {meta['world_size']} with {meta['identity']}, "
            f"but this run is world size {world} with {_identity(args)}"
        )
    method.load_full_state_dict(torch.load(os.path.join(folder, "model.pt"), map_location="cpu"))
    local = torch.load(os.path.join(folder, f"optim-rank{dist.get_rank()}.pt"), map_location="cpu",
                       weights_only=False)
    optimizer.load_state_dict(local["optimizer"])
    torch.set_rng_state(local["rng"])
    return meta["step"], meta["history"]

"""Checkpoints of a `subnet-train` run: what is saved for each method, and resuming.

Layout (see subnet_ext/engine/subnet_checkpoint.py and state/checkpoint_store.py for the atomic commit and the checks):
  step-000120/state/           torch.distributed.checkpoint files, one per rank + .metadata
  step-000120/manifest.json    step, run identity, plan, history, optimizer settings, each
                               rank's RNG state, every file's size and SHA-256
  step-000120/model.pt         the consolidated full model (final checkpoint only)
  LATEST                       name of the newest committed checkpoint

SDP saves each piece of the parameters and of the optimizer state once, in the full
model's coordinates (optim_state.py), so a run resumes on another world size, coverage,
level or regime. DDP and FSDP save torch's own distributed state dicts
(torch.distributed.checkpoint.state_dict), which DCP reshards to a new world size.
A resume refuses a checkpoint of another model, data, method or seed.
"""
from __future__ import annotations

import base64
import warnings

import torch
import torch.distributed as dist

from ..engine.subnet_checkpoint import load_subnet_checkpoint, save_subnet_checkpoint
from ..state.checkpoint_store import (CheckpointError, CheckpointWriteError, find_checkpoint, list_checkpoints, read_state,
                                save_checkpoint, state_metadata)

# What must match for a resume; SDP may change world size, coverage, level, regime and
# sync period (the state is re-planned), DDP/FSDP the world size.
FIXED = ("method", "model", "preset", "data", "width", "seed")
RECORDED = FIXED + ("level", "regime", "coverage", "sync_every", "scale")


def stream_seed(seed: int, step: int, rank: int) -> int:
    """The random seed of (run seed, step, rank): distinct per rank and step, the same
    after a restart (used for batches and for RNG states a checkpoint lacks)."""
    return (seed * 1_000_003 + step) * 4099 + rank


def identity(args) -> dict:
    """What a checkpoint was written by: FIXED (must match on resume), the SDP settings and
    the optimizer-step settings ("training": precision, clipping, schedule, accumulation...,
    recorded, free to change on resume)."""
    from .training import training_settings

    return {**{k: getattr(args, k, None) for k in RECORDED}, "training": training_settings(args)}


# ----------------------------------------------------------------------------- RNG
def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _decode(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict:
    """This process's RNG states, base64-encoded: {"cpu": str, "cuda": [str per device] when CUDA is initialised}."""
    out = {"cpu": _encode(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_encode(s.cpu()) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(saved_ranks: list, rank: int, world: int, seed: int, step: int) -> None:
    """This rank's saved RNG state when the world size is unchanged; otherwise a seed
    derived from (seed, step, rank), so ranks still draw different streams."""
    if len(saved_ranks) == world and saved_ranks[rank] and "cpu" in saved_ranks[rank]:
        torch.set_rng_state(_decode(saved_ranks[rank]["cpu"]))
        cuda = saved_ranks[rank].get("cuda")
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([_decode(s) for s in cuda])
        return
    torch.manual_seed(stream_seed(seed, step, rank))


# ----------------------------------------------------------------------------- method state
def _torch_state(method, optimizer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(method.module, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _load_method_state(method, optimizer, folder: str, manifest: dict) -> None:
    if method.name == "sdp":
        load_subnet_checkpoint(folder, method.sdp, optimizer, verified_manifest=manifest)
        return
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _torch_state(method, optimizer)  # the structure to fill (initialises the optimizer state)
    read_state(folder, state)
    set_state_dict(method.module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


# ----------------------------------------------------------------------------- save / resume
def save(save_dir: str, step: int, method, optimizer, history: dict, args, final: bool = False) -> str | None:
    """Checkpoint the run (collective). A failed periodic save is a warning on every rank
    (training goes on, the older checkpoints are intact); a failed final save raises."""
    extra = None
    if final:
        full = method.full_state_dict()  # collective for SDP and FSDP
        extra = {"model.pt": lambda f: torch.save(full, f)}
    body = {"identity": identity(args), "world_size": dist.get_world_size(), "history": history}
    per_rank = {"rng": rng_state()}
    try:
        if method.name == "sdp":
            return save_subnet_checkpoint(save_dir, step, method.sdp, optimizer, body, keep_last=args.keep_last,
                                          extra_files=extra, per_rank=per_rank)
        return save_checkpoint(save_dir, step, _torch_state(method, optimizer), body, keep_last=args.keep_last,
                               extra_files=extra, per_rank=per_rank)
    except CheckpointWriteError as e:
        if final:
            raise
        warnings.warn(f"{e}; training continues and the next save will try again", RuntimeWarning, stacklevel=2)
        return None


def check_compatible(folder: str, manifest: dict, args) -> None:
    """Raise CheckpointError, naming each differing setting, unless the checkpoint at `folder`
    was written by a run with the same FIXED settings (method, model, preset, data, width, seed) as `args`."""
    saved = manifest.get("identity", {})
    diffs = [f"{k} {saved.get(k)!r} vs {getattr(args, k, None)!r}" for k in FIXED
             if saved.get(k) != getattr(args, k, None)]
    if diffs:
        raise CheckpointError(f"--resume: checkpoint {folder} belongs to another run ({'; '.join(diffs)}: checkpoint "
                              "vs this run). Resume with the same settings, or use another --save-dir.")


def resume(args, method, optimizer) -> tuple[int, dict] | None:
    """Load the checkpoint `--resume` names into method and optimizer; (step, history).

    --resume latest: the newest good checkpoint in --save-dir (an error if there is none);
    --resume auto: the same, or None (start fresh) when --save-dir holds no checkpoint;
    --resume PATH: that checkpoint folder. Bad newer checkpoints are skipped with a warning.
    """
    mode = args.resume
    if mode in ("latest", "auto"):
        if mode == "auto" and not list_checkpoints(args.save_dir):
            return None
        where = args.save_dir
    else:
        where = mode
    folder, manifest, _ = find_checkpoint(where)
    check_compatible(folder, manifest, args)
    if getattr(method, "sdp", None) is not None:  # the schedule's assignment at that step, before its state loads
        method.sdp.set_step(manifest["step"], optimizers=[optimizer])
    _load_method_state(method, optimizer, folder, manifest)
    step = manifest["step"]
    restore_rng([r["rng"] if r else None for r in manifest["ranks"]], dist.get_rank(), dist.get_world_size(),
                args.seed, step)
    history = manifest["history"]
    history.setdefault("skipped", [])
    return step, history


def load_full_model_state(folder: str) -> dict:
    """The full model's state dict (original names and shapes) from a checkpoint of any
    method, in this process alone (no process group needed). Verifies the checksums."""
    from ..state.checkpoint_store import verify_checkpoint

    if dist.is_initialized():
        raise RuntimeError("load_full_model_state reads a checkpoint in one process; call it outside a process group")
    manifest = verify_checkpoint(folder)
    available = state_metadata(folder)
    if manifest.get("plan") is None:
        request = {k[len("model."):]: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in available.items()
                   if k.startswith("model.")}
        read_state(folder, {"model": request})
        return request
    return _assemble_sdp(folder, manifest, available)


def _assemble_sdp(folder, manifest, available) -> dict:
    from ..state.optim_state import MODEL
    from ..planning.pieces import global_pieces
    from ..planning.plan import SubnetPlan
    from ..planning.pieces import full_rectangle
    from ..state.layout import as_2d, piece_key

    plan = SubnetPlan.from_json(manifest["plan"])
    out = {n: torch.zeros(shape, dtype=getattr(torch, plan.tensor_dtypes[n]))
           for n, shape in plan.tensor_shapes.items()}
    pieces = global_pieces(plan)
    request = {MODEL + piece_key(p): torch.empty(available[MODEL + piece_key(p)][0], dtype=out[p.name].dtype)
               for p in pieces}
    request.update({MODEL + n: torch.empty(available[MODEL + n][0], dtype=out[n].dtype) for n in out
                    if not plan.is_float(n)})
    read_state(folder, request)
    for p in pieces:
        r0, r1, c0, c1 = full_rectangle(plan, p)
        as_2d(out[p.name])[r0:r1, c0:c1].copy_(request[MODEL + piece_key(p)])
    for n in out:
        if not plan.is_float(n):
            out[n].copy_(request[MODEL + n])
    return out

